"""``slow-reader``: memory while slow clients hold long streams; CPU and the backend's socket after they leave.

``readers`` clients each stream a long answer (``max_tokens``) from the sim
through edge and node, and read it at ``read_bytes_per_s`` (0: not at all
after the first bytes) for ``hold_s``. Measured: the RSS of edge, node and
sim before and while they are connected, and the CPU of each meanwhile (a
stalled stream should cost nothing: credit stops the node, the node stops
reading the sim); then the clients hang up, and over ``after_s`` the CPU of
each (it must fall to idle) and how long until the sim's stream of each
ends (``/sim/stats`` ``open_streams``): the backend's socket closed.

Entry points: ``run(Options(...), RunContext(...))``; ``tables(result)``
and ``plots(result, img_dir)`` for the report.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

from iop.bench._backpressure import Stack, sim_stats, stack
from iop.bench._client import slow_reader
from iop.bench._procs import CpuWindow
from iop.bench._runner import RunContext, register, tables_report

__all__ = ["Options", "plots", "run", "tables"]


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    readers: int = 16
    read_bytes_per_s: float = 0.0
    hold_s: float = 10.0
    after_s: float = 5.0
    max_tokens: int = 30_000
    run_window: int = 64
    node_run_backlog: int = 16


def _smoke(opts: Options) -> Options:
    return msgspec.structs.replace(
        opts, readers=2, hold_s=1.0, after_s=0.5, max_tokens=min(opts.max_tokens, 3000)
    )


@register(
    "slow-reader",
    Options,
    "Slow clients on long streams: edge/node memory while connected; CPU and the "
    "backend's socket after they leave.",
    report=tables_report(__name__),
)
def run(opts: Options, ctx: RunContext) -> dict[str, Any]:
    if ctx.smoke:
        opts = _smoke(opts)
    with stack(ctx.python, ctx.workdir) as s:
        s.start(
            edge={
                "link": {"run_window": opts.run_window},
                # Longer than the hold: the edge must not cut the readers off.
                "server": {"write_stall_timeout_s": opts.hold_s + 60.0},
            },
            node={"run_backlog": opts.node_run_backlog},
            slots=opts.readers + 1,
            sim_flags=["--ttft", "0"],
        )
        time.sleep(0.5)
        before = s.rss()
        result = trio.run(_measure, opts, s)
        result["rss_kb"]["before"] = before
    result["options"] = msgspec.to_builtins(opts)
    return result


async def _measure(opts: Options, s: Stack) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
        firsts = [trio.Event() for _ in range(opts.readers)]
        out: dict[str, Any] = {"rss_kb": {}}
        async with trio.open_nursery() as nursery:
            for ev in firsts:
                nursery.start_soon(_reader, s, opts, ev)
            for ev in firsts:
                await ev.wait()
            # Let the streams fill every buffer on the way, then measure.
            await trio.sleep(min(2.0, opts.hold_s / 2))
            hold = CpuWindow(s.pids)
            await trio.sleep(max(0.0, opts.hold_s - min(2.0, opts.hold_s / 2) - 0.5))
            out["rss_kb"]["connected"] = s.rss()
            out["open_backend_streams_connected"] = (
                await sim_stats(client, s.sim_url)
            ).open_streams
            out["cpu_while_connected"] = hold.stop()
        # Every reader has hung up now.
        left = trio.current_time()
        after = CpuWindow(s.pids)
        closed_after: float | None = None
        end = left + opts.after_s
        while trio.current_time() < end:
            if closed_after is None and (await sim_stats(client, s.sim_url)).open_streams == 0:
                closed_after = trio.current_time() - left
            await trio.sleep(0.02)
        out["cpu_after_leaving"] = after.stop()
        out["backend_closed_after_s"] = None if closed_after is None else round(closed_after, 3)
        out["rss_kb"]["after"] = s.rss()
        return out


async def _reader(s: Stack, opts: Options, first: trio.Event) -> None:
    await slow_reader(
        s.host,
        s.port,
        opts.max_tokens,
        read_bytes_per_s=opts.read_bytes_per_s,
        hold_s=opts.hold_s,
        first_bytes=first,
    )


def _per_reader(result: dict[str, Any], proc: str) -> float:
    r = result["rss_kb"]
    n: int = result["options"]["readers"]
    delta: int = r["connected"][proc] - r["before"][proc]
    return delta / n


def tables(result: dict[str, Any]) -> dict[str, str]:
    """The ``<!-- bench:slow-reader -->`` table."""
    o = result["options"]
    rows = [
        "| | edge | node | sim |",
        "| --- | ---: | ---: | ---: |",
    ]
    r = result["rss_kb"]
    for phase in ("before", "connected", "after"):
        rows.append(
            f"| RSS {phase} (MiB) | "
            + " | ".join(f"{r[phase][p] / 1024:.1f}" for p in ("edge", "node", "sim"))
            + " |"
        )
    rows.append(
        "| RSS per reader while connected (KiB) | "
        + " | ".join(f"{_per_reader(result, p):.0f}" for p in ("edge", "node", "sim"))
        + " |"
    )
    for key, label in (
        ("cpu_while_connected", "CPU while connected (% of a core)"),
        ("cpu_after_leaving", "CPU after they left (% of a core)"),
    ):
        c = result[key]["cpu_pct_of_core"]
        rows.append(
            f"| {label} | " + " | ".join(f"{c[p]:.1f}" for p in ("edge", "node", "sim")) + " |"
        )
    closed = result["backend_closed_after_s"]
    text = "\n".join(rows) + (
        f"\n\n{o['readers']} readers at {o['read_bytes_per_s']:g} B/s for {o['hold_s']:g} s, "
        f"`run_window = {o['run_window']}`; the sim's streams were "
        f"{'all closed ' + format(closed * 1000, '.0f') + ' ms' if closed is not None else 'not all closed'}"
        f" after the readers hung up ({result['open_backend_streams_connected']} open while "
        f"connected). Foreign CPU: {result['cpu_while_connected']['foreign_cpu_pct_of_core']:.0f} % "
        f"of a core while connected, {result['cpu_after_leaving']['foreign_cpu_pct_of_core']:.0f} % "
        "after."
    )
    return {"slow-reader": text}


def plots(result: dict[str, Any], img_dir: Path) -> list[Path]:
    """``research_slow_reader.png``: RSS per process by phase, CPU while connected and after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    procs = ["edge", "node", "sim"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    r = result["rss_kb"]
    width = 0.25
    for i, phase in enumerate(("before", "connected", "after")):
        ax1.bar(
            [j + (i - 1) * width for j in range(3)],
            [r[phase][p] / 1024 for p in procs],
            width,
            label=phase,
        )
    ax1.set_xticks(range(3), procs)
    ax1.set_ylabel("RSS (MiB)")
    ax1.legend()
    ax1.set_title(f"{result['options']['readers']} slow readers")
    for i, (key, label) in enumerate(
        (("cpu_while_connected", "while connected"), ("cpu_after_leaving", "after they left"))
    ):
        c = result[key]["cpu_pct_of_core"]
        ax2.bar(
            [j + (i - 0.5) * width for j in range(3)], [c[p] for p in procs], width, label=label
        )
    ax2.set_xticks(range(3), procs)
    ax2.set_ylabel("CPU (% of one core)")
    ax2.legend()
    fig.tight_layout()
    img_dir.mkdir(parents=True, exist_ok=True)
    path = img_dir / "research_slow_reader.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]
