"""``channel-capacity``: per ``node.run_backlog``, throughput of fast streams and memory of slow readers.

The bounded channels between a run's producer and its consumer, and which
of them a config key sets:

=================================  ==========================================
node: adapter → link session       ``node.run_backlog`` (16): events beyond
                                   credit (credit off: not yet sent) before
                                   the adapter waits; swept here
edge: link reader → HTTP stream    ``link.run_window + 2``: derived from the
                                   credit, swept by ``credit-window``
node/edge: a run's memory channel  ``RUN_EVENT_BUFFER`` (16, iop/runtime/_run.py):
                                   only between an adapter and a local
                                   consumer (``iop up``'s in-process runs,
                                   tests), not on the edge ↔ node path
=================================  ==========================================

The same two phases as ``credit-window`` (``sweep``), with the
window at its default.

Entry points: ``run(Options(...), RunContext(...))``; ``tables(result)`` and
``plots(result, img_dir)`` for the report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from iop.bench._credit_window import smoke_sizes, sweep, sweep_plot, sweep_table
from iop.bench._runner import RunContext, register, tables_report

__all__ = ["Options", "plots", "run", "tables"]


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    backlogs: list[int] = msgspec.field(default_factory=lambda: [1, 4, 16, 64])
    run_window: int = 64
    streams: int = 8
    tokens: int = 1000
    slow_readers: int = 16
    slow_tokens: int = 30_000
    hold_s: float = 4.0


@register(
    "channel-capacity",
    Options,
    "Per node.run_backlog: throughput of fast streams, edge/node memory per stalled reader.",
    report=tables_report(__name__),
)
def run(opts: Options, ctx: RunContext) -> dict[str, Any]:
    if ctx.smoke:
        opts = msgspec.structs.replace(opts, backlogs=[4], **smoke_sizes(opts))
    points = [(f"backlog-{b}", opts.run_window, b) for b in opts.backlogs]
    return {"options": msgspec.to_builtins(opts), "points": sweep(ctx, opts, points)}


def tables(result: dict[str, Any]) -> dict[str, str]:
    """The ``<!-- bench:channel-capacity -->`` table."""
    return {"channel-capacity": sweep_table(result, "run_backlog", "`node.run_backlog`")}


def plots(result: dict[str, Any], img_dir: Path) -> list[Path]:
    """``research_channel_capacity.png``: throughput and memory per backlog."""
    return [
        sweep_plot(
            result,
            "run_backlog",
            "node.run_backlog (events)",
            img_dir / "research_channel_capacity.png",
        )
    ]
