"""``hol``: one stalled run beside fast runs on one node link, per-run credit on and off.

docs/research.md, section 3. For each mode a fresh sim + edge + node (one
node, so one link carries every run):

* ``slow``: one client streams a long answer and stops reading after its
  first bytes; the edge cuts it off after ``write_stall_timeout_s``
  (``slow_client``), as it would in production;
* ``settle_s`` later (every buffer on its way is full by then), ``fast``
  clients each stream ``tokens`` tokens, all at once, read as fast as they
  can: their time to first content and to the end, from their own start.

Modes: ``run_window`` 64 (credit on, the default) and 0 (credit off: the
edge's reader waits for the stalled run's client, and every run on the
link waits with it), and a baseline with credit on and no slow run.

Entry points: ``run(Options(...), RunContext(...))``; ``tables(result)`` and
``plots(result, img_dir)`` for the report.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import trio

from iop.bench._backpressure import Stack, stack
from iop.bench._client import FastResult, fast_stream, slow_reader
from iop.bench._procs import CpuWindow
from iop.bench._results import median
from iop.bench._runner import RunContext, register, tables_report

__all__ = ["Options", "plots", "run", "tables"]


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    fast: int = 8
    tokens: int = 200
    slow_tokens: int = 30_000
    settle_s: float = 2.0
    write_stall_timeout_s: float = 10.0
    windows: list[int] = msgspec.field(default_factory=lambda: [64, 0])
    baseline: bool = True


def _smoke(opts: Options) -> Options:
    return msgspec.structs.replace(
        opts,
        fast=2,
        tokens=20,
        slow_tokens=min(opts.slow_tokens, 20_000),
        settle_s=1.0,
        write_stall_timeout_s=2.0,
        windows=[0],
        baseline=False,
    )


@register(
    "hol",
    Options,
    "One stalled run beside fast runs on one link: their TTFT and completion with "
    "per-run credit on and off.",
    report=tables_report(__name__),
)
def run(opts: Options, ctx: RunContext) -> dict[str, Any]:
    if ctx.smoke:
        opts = _smoke(opts)
    modes: list[tuple[str, int, bool]] = []
    if opts.baseline:
        modes.append(("baseline", 64, False))
    modes += [(f"window-{w}", w, True) for w in opts.windows]
    out = []
    for name, window, slow in modes:
        with stack(ctx.python, ctx.workdir / name) as s:
            s.start(
                edge={
                    "link": {"run_window": window},
                    "server": {"write_stall_timeout_s": opts.write_stall_timeout_s},
                },
                node={},
                slots=opts.fast + 2,
                sim_flags=["--ttft", "0"],
            )
            mode = trio.run(_mode, s, opts, slow)
        mode |= {"mode": name, "run_window": window, "slow": slow}
        out.append(mode)
        time.sleep(0.2)
    return {"options": msgspec.to_builtins(opts), "modes": out}


async def _mode(s: Stack, opts: Options, slow: bool) -> dict[str, Any]:
    await fast_stream(s.host, s.port, 20)  # warm-up
    fast: list[FastResult] = []
    slow_bytes: list[int] = []
    cpu = CpuWindow(s.pids)

    async def one() -> None:
        fast.append(await fast_stream(s.host, s.port, opts.tokens))

    async def stalled(first: trio.Event) -> None:
        slow_bytes.append(
            await slow_reader(
                s.host,
                s.port,
                opts.slow_tokens,
                read_bytes_per_s=0,
                hold_s=opts.write_stall_timeout_s + 5.0,
                first_bytes=first,
            )
        )

    async with trio.open_nursery() as nursery:
        if slow:
            first = trio.Event()
            nursery.start_soon(stalled, first)
            await first.wait()
            await trio.sleep(opts.settle_s)
        async with trio.open_nursery() as fast_nursery:
            for _ in range(opts.fast):
                fast_nursery.start_soon(one)
        nursery.cancel_scope.cancel()  # the slow client goes too
    window = cpu.stop()
    ttfts = [r.ttft_s for r in fast if r.ttft_s is not None]
    return {
        "fast": [{"ttft_ms": _ms(r.ttft_s), "total_ms": _ms(r.total_s), "ok": r.ok} for r in fast],
        "ttft_ms_median": _ms(median(ttfts)),
        "ttft_ms_max": _ms(max(ttfts) if ttfts else None),
        "total_ms_median": _ms(median([r.total_s for r in fast])),
        "total_ms_max": _ms(max(r.total_s for r in fast)),
        "completed": sum(r.ok for r in fast),
        "cpu": window,
    }


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


def _label(m: dict[str, Any]) -> str:
    if not m["slow"]:
        return "credit on, no slow run"
    return "credit off" if m["run_window"] == 0 else f"credit on (`run_window = {m['run_window']}`)"


def tables(result: dict[str, Any]) -> dict[str, str]:
    """The ``<!-- bench:hol -->`` table."""
    o = result["options"]
    rows = [
        "| mode | fast runs completed | TTFT median (ms) | TTFT max (ms) | "
        "completion median (ms) | completion max (ms) | foreign CPU (% core) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for m in result["modes"]:
        rows.append(
            f"| {_label(m)} | {m['completed']} of {o['fast']} | {m['ttft_ms_median']} "
            f"| {m['ttft_ms_max']} | {m['total_ms_median']} | {m['total_ms_max']} "
            f"| {m['cpu']['foreign_cpu_pct_of_core']:.0f} |"
        )
    return {
        "hol": "\n".join(rows)
        + (
            f"\n\n{o['fast']} fast runs of {o['tokens']} tokens, started together "
            f"{o['settle_s']:g} s after one client stopped reading a {o['slow_tokens']}-token "
            f"answer on the same node; the edge cuts a client off after "
            f"`write_stall_timeout_s = {o['write_stall_timeout_s']:g}`."
        )
    }


def plots(result: dict[str, Any], img_dir: Path) -> list[Path]:
    """``research_hol.png``: each fast run's TTFT and completion time, per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = result["modes"]
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, m in enumerate(modes):
        ttft = [f["ttft_ms"] for f in m["fast"] if f["ttft_ms"] is not None]
        total = [f["total_ms"] for f in m["fast"]]
        ax.scatter(
            [i - 0.1] * len(ttft), ttft, marker="o", color="C0", label="TTFT" if i == 0 else None
        )
        ax.scatter(
            [i + 0.1] * len(total),
            total,
            marker="x",
            color="C1",
            label="completion" if i == 0 else None,
        )
    ax.set_xticks(range(len(modes)), [_label(m).replace("`", "") for m in modes])
    ax.set_yscale("log")
    ax.set_ylabel("ms from the fast run's start")
    ax.set_title("Fast runs beside one stalled run on the same link")
    ax.legend()
    fig.tight_layout()
    img_dir.mkdir(parents=True, exist_ok=True)
    path = img_dir / "research_hol.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]
