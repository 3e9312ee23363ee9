"""``credit-window``: per ``link.run_window``, throughput of fast streams and memory of slow readers.

docs/research.md, section 1. For each window a fresh sim + edge + node
(the edge's ``link.run_window`` set in its config; ``0`` is per-run credit
off) serves two phases:

* **throughput**: ``streams`` concurrent streams of ``tokens`` tokens each,
  read as fast as the client can: tokens per second over the phase, and the
  CPU edge and node spend per token (robust to the shared machine's load,
  unlike the rate);
* **memory**: ``slow_readers`` clients stream a long answer and stop reading
  after its first bytes; once every buffer on the way is full, the RSS of
  edge and node above what they had before, per reader.

``iop.bench._channel_capacity`` sweeps ``node.run_backlog`` with the same
two phases (``sweep_point``).

Entry points: ``run(Options(...), RunContext(...))``; ``tables(result)`` and
``plots(result, img_dir)`` for the report.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

import httpx
import msgspec
import trio

from iop.bench._backpressure import Stack, sim_stats, stack
from iop.bench._client import fast_stream, slow_reader
from iop.bench._procs import CpuWindow
from iop.bench._results import median
from iop.bench._runner import RunContext, register, tables_report

__all__ = [
    "Options",
    "SweepOptions",
    "plots",
    "run",
    "smoke_sizes",
    "sweep",
    "sweep_point",
    "tables",
]


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    windows: list[int] = msgspec.field(default_factory=lambda: [1, 4, 16, 64, 256, 0])
    streams: int = 8
    tokens: int = 1000
    slow_readers: int = 16
    slow_tokens: int = 30_000
    hold_s: float = 4.0
    node_run_backlog: int = 16


class SweepOptions(Protocol):
    """What a sweep's points share: the fast streams and the slow readers."""

    streams: int
    tokens: int
    slow_readers: int
    slow_tokens: int
    hold_s: float


def smoke_sizes(opts: SweepOptions) -> dict[str, Any]:
    """The smoke run's sizes of a sweep's points (seconds each)."""
    return {
        "streams": 2,
        "tokens": 50,
        "slow_readers": 1,
        "slow_tokens": min(opts.slow_tokens, 20_000),
        "hold_s": 1.0,
    }


def sweep(
    ctx: RunContext, opts: SweepOptions, points: list[tuple[str, int, int]]
) -> list[dict[str, Any]]:
    """``sweep_point`` per (name, run_window, run_backlog), one after the other."""
    out = []
    for name, window, backlog in points:
        out.append(
            sweep_point(
                ctx,
                name,
                run_window=window,
                run_backlog=backlog,
                streams=opts.streams,
                tokens=opts.tokens,
                slow_readers=opts.slow_readers,
                slow_tokens=opts.slow_tokens,
                hold_s=opts.hold_s,
            )
        )
        time.sleep(0.2)
    return out


def sweep_point(
    ctx: RunContext,
    name: str,
    *,
    run_window: int,
    run_backlog: int,
    streams: int,
    tokens: int,
    slow_readers: int,
    slow_tokens: int,
    hold_s: float,
) -> dict[str, Any]:
    """One stack, its throughput phase and its memory phase."""
    workdir = ctx.workdir / name
    with stack(ctx.python, workdir) as s:
        s.start(
            edge={
                "link": {"run_window": run_window},
                "server": {"write_stall_timeout_s": hold_s + 60.0},
            },
            node={"run_backlog": run_backlog},
            slots=streams + slow_readers + 1,
            sim_flags=["--ttft", "0"],
        )
        point: dict[str, Any] = trio.run(
            _point, s, streams, tokens, slow_readers, slow_tokens, hold_s
        )
    point |= {"run_window": run_window, "run_backlog": run_backlog}
    return point


async def _point(
    s: Stack, streams: int, tokens: int, readers: int, slow_tokens: int, hold_s: float
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    await fast_stream(s.host, s.port, 20)  # warm-up: connections, imports, caches
    await trio.sleep(0.3)
    cpu = CpuWindow(s.pids)
    t0 = trio.current_time()
    results = []

    async def one() -> None:
        results.append(await fast_stream(s.host, s.port, tokens))

    async with trio.open_nursery() as nursery:
        for _ in range(streams):
            nursery.start_soon(one)
    wall = trio.current_time() - t0
    window = cpu.stop()
    total = streams * tokens
    out["throughput"] = {
        "wall_s": round(wall, 3),
        "tokens_per_s": round(total / wall, 1),
        "completed": sum(r.ok for r in results),
        "ttft_ms_median": _ms(median([r.ttft_s for r in results if r.ttft_s is not None])),
        "edge_us_per_token": round(window["cpu_s"]["edge"] * 1e6 / total, 2),
        "node_us_per_token": round(window["cpu_s"]["node"] * 1e6 / total, 2),
        "cpu": window,
    }
    await trio.sleep(0.5)
    before = s.rss()
    firsts = [trio.Event() for _ in range(readers)]
    async with (
        httpx.AsyncClient(timeout=5, trust_env=False) as client,
        trio.open_nursery() as nursery,
    ):
        for ev in firsts:
            nursery.start_soon(_slow, s, slow_tokens, hold_s, ev)
        for ev in firsts:
            await ev.wait()
        await trio.sleep(hold_s / 2)
        held = s.rss()
        stats = await sim_stats(client, s.sim_url)
    out["memory"] = {
        "rss_kb_before": before,
        "rss_kb_held": held,
        "edge_kib_per_reader": round((held["edge"] - before["edge"]) / readers, 1),
        "node_kib_per_reader": round((held["node"] - before["node"]) / readers, 1),
        # Streams still open on the sim while the readers held them: all of
        # them, or the buffers on the way took whole answers.
        "backend_streams_open": stats.open_streams,
        "readers": readers,
    }
    return out


async def _slow(s: Stack, tokens: int, hold_s: float, first: trio.Event) -> None:
    await slow_reader(s.host, s.port, tokens, read_bytes_per_s=0, hold_s=hold_s, first_bytes=first)


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


@register(
    "credit-window",
    Options,
    "Per link.run_window: throughput of fast streams, edge/node memory per stalled reader.",
    report=tables_report(__name__),
)
def run(opts: Options, ctx: RunContext) -> dict[str, Any]:
    if ctx.smoke:
        opts = msgspec.structs.replace(opts, windows=[0], **smoke_sizes(opts))
    points = [(f"window-{w}", w, opts.node_run_backlog) for w in opts.windows]
    return {"options": msgspec.to_builtins(opts), "points": sweep(ctx, opts, points)}


def _label(w: int) -> str:
    return "off" if w == 0 else str(w)


def sweep_table(result: dict[str, Any], key: str, head: str) -> str:
    rows = [
        f"| {head} | tokens/s | edge µs/token | node µs/token | TTFT median (ms) "
        "| edge KiB/stalled reader | node KiB/stalled reader | sim streams held open | "
        "foreign CPU (% core) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in result["points"]:
        t, m = p["throughput"], p["memory"]
        label = _label(p[key]) if key == "run_window" else str(p[key])
        rows.append(
            f"| {label} | {t['tokens_per_s']:.0f} | {t['edge_us_per_token']:.1f} "
            f"| {t['node_us_per_token']:.1f} | {t['ttft_ms_median']} "
            f"| {m['edge_kib_per_reader']:.0f} | {m['node_kib_per_reader']:.0f} "
            f"| {m['backend_streams_open']} of {m['readers']} "
            f"| {t['cpu']['foreign_cpu_pct_of_core']:.0f} |"
        )
    o = result["options"]
    return "\n".join(rows) + (
        f"\n\n{o['streams']} concurrent streams of {o['tokens']} tokens for the rate; "
        f"{o['slow_readers']} readers that stop after the first bytes of a "
        f"{o['slow_tokens']}-token answer for the memory (RSS above the stack's own "
        f"before they came, {o['hold_s'] / 2:g} s after they stalled)."
    )


def tables(result: dict[str, Any]) -> dict[str, str]:
    """The ``<!-- bench:credit-window -->`` table."""
    return {"credit-window": sweep_table(result, "run_window", "`run_window`")}


def sweep_plot(result: dict[str, Any], key: str, xlabel: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in result["points"] if p[key] != 0]
    off = [p for p in result["points"] if p[key] == 0]
    xs = [p[key] for p in points]
    fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(14, 4))
    ax1.plot(xs, [p["throughput"]["tokens_per_s"] for p in points], "o-", label="tokens/s")
    if xs:
        ax1.set_xscale("log", base=2)
    ax1.set_xlabel(xlabel)
    ax1.set_ylabel("tokens/s (fast streams; noisy: shared box)")
    if off:
        ax1.axhline(off[0]["throughput"]["tokens_per_s"], ls="--", color="grey", label="credit off")
    ax1.legend()
    for proc, style, color in (("edge", "o-", "C0"), ("node", "s-", "C1")):
        key_us = f"{proc}_us_per_token"
        ax3.plot(xs, [p["throughput"][key_us] for p in points], style, color=color, label=proc)
        if off:
            ax3.axhline(
                off[0]["throughput"][key_us], ls="--", color=color, label=f"{proc}, credit off"
            )
        ax2.plot(xs, [p["memory"][f"{proc}_kib_per_reader"] for p in points], style, label=proc)
        if off:
            ax2.axhline(
                off[0]["memory"][f"{proc}_kib_per_reader"],
                ls="--",
                color=color,
                label=f"{proc}, credit off",
            )
    if xs:
        ax3.set_xscale("log", base=2)
    ax3.set_xlabel(xlabel)
    ax3.set_ylabel("CPU per token (µs)")
    ax3.legend()
    if xs:
        ax2.set_xscale("log", base=2)
    ax2.set_xlabel(xlabel)
    ax2.set_ylabel("RSS per stalled reader (KiB)")
    ax2.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plots(result: dict[str, Any], img_dir: Path) -> list[Path]:
    """``research_credit_window.png``: throughput and memory per window."""
    return [
        sweep_plot(
            result, "run_window", "link.run_window (events)", img_dir / "research_credit_window.png"
        )
    ]
