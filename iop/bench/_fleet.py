"""``fleet``: tokens per core with hundreds to thousands of paced streams open.

docs/benchmarks.md, "Tokens per core at fleet scale". One run starts
``sims`` ``iop sim`` processes (``tokens`` content chunks per answer,
``tokens_per_s`` apart: a model that decodes at that rate), an ``iop
edge`` with one ``iop node`` (the *split* shape: separate processes) and an
``iop up`` (both in one process), each with one instance per sim. Then, per
level of ``levels`` (streams open at once), per shape in turn (``direct``:
the clients spread over the sims themselves, no gateway), a closed loop of
that many streams, started ``1 / level`` of a stream's length apart so
their tokens are spread evenly over time, runs for ``warmup_s`` and then a
measured window of ``window_s``:

* **tokens** are the content chunks the clients received inside the window;
  each process's CPU (utime+stime from ``/proc``, robust to the box's other
  load) over the window divided by them is its **µs per token**, and the
  tokens over the gateway's CPU seconds its **tokens/s per core** (what one
  core delivers when it is the bottleneck: at saturation, a process's CPU
  is 100 % of a core and its rate is this);
* **TTFT** of the streams started inside the window, and the **inter-token
  gap** (between two content chunks of one stream, both inside the window):
  p50 and p99, and their difference to ``direct`` at the same level (added
  TTFT, added inter-token p99);
* the sims', the clients' (this process) and the foreign CPU.

With ``profile`` and py-spy in the interpreter's venv (or on PATH), one
more window of ``profile_s`` per gateway shape and level runs with py-spy on
each of its processes (non-blocking, 250 Hz; its own CPU lands in the
foreign column, so the measured window comes first and carries none of
it): the top functions and packages by self time, and the raw stacks in the
run's directory.

The load generator is one process (``RawClient``: h11 on trio sockets, O(1)
per event): at a thousand paced streams it can be the box's bottleneck too,
so its CPU is reported beside the gateways'.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import h11
import msgspec
import trio

from iop.bench._client import RawClient, decode_chunk, sse_data
from iop.bench._procs import (
    CpuWindow,
    Stack,
    find_py_spy,
    process_stack,
    raise_fd_limit,
    spy_report,
    start_edge,
    start_node,
    start_py_spy,
    start_sims,
    wait_instances,
    wait_models,
)
from iop.bench._results import pct
from iop.bench._runner import RunContext, register, tables_report
from iop.testing import UP_READY, Proc, toml_dumps

__all__ = ["Options", "Recorder", "relative", "run", "stream_bodies", "summarize", "tables"]

MODEL: Final = "iop-sim"
SHAPES: Final = ("direct", "split", "up")
# A stream that makes no progress for this long fails the run: far above a
# token's 20 ms on a saturated box, so that a gateway that stops answering
# ends the run instead of hanging it.
STREAM_DEADLINE_S: Final = 120.0
# py-spy's rate: the platform runner's, so the profiles compare.
SPY_RATE: Final = 250
# A process at or above this share of a core over a window is the level's
# bottleneck (one trio thread: it cannot use more than one core).
SATURATED_PCT: Final = 90.0


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``fleet`` runner's options (``[args]`` of its scenario)."""

    levels: list[int] = msgspec.field(default_factory=lambda: [256, 1024])
    shapes: list[str] = msgspec.field(default_factory=lambda: list(SHAPES))
    sims: int = 4
    tokens: int = 64
    tokens_per_s: float = 50.0
    warmup_s: float = 4.0
    window_s: float = 10.0
    profile: bool = True
    profile_s: float = 5.0


# --------------------------------------------------------------------------- the clients


@dataclass
class Recorder:
    """What the clients of one window saw: every time is ``trio.current_time()``.

    The window is ``[opened, closed)``; before ``open`` and after ``close``
    nothing is counted (the warm-up, and the streams cancelled at the end).
    """

    opened: float = math.inf
    closed: float = math.inf
    tokens: int = 0
    streams: int = 0  # completed inside the window
    errors: dict[str, int] = field(default_factory=dict)
    ttft_s: list[float] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)

    def inside(self, t: float) -> bool:
        return self.opened <= t < self.closed

    def token(self, started: float, prev: float | None, t: float) -> None:
        """A content chunk at ``t`` of a stream sent at ``started`` whose previous
        content chunk came at ``prev`` (None: this is its first)."""
        if not self.inside(t):
            return
        self.tokens += 1
        if prev is None:
            if self.inside(started):
                self.ttft_s.append(t - started)
        elif self.inside(prev):
            self.gaps_s.append(t - prev)

    def ended(self, t: float, error: str) -> None:
        if not self.inside(t):
            return
        if error:
            self.errors[error] = self.errors.get(error, 0) + 1
        else:
            self.streams += 1


async def paced_stream(client: RawClient, body: bytes, expect: int, rec: Recorder) -> None:
    """One streamed chat completion, each content chunk recorded as it arrives."""
    started = trio.current_time()
    prev: float | None = None
    state = {"status": 0, "buf": b"", "chunks": 0, "done": False}

    def on_head(status: int, headers: list[tuple[bytes, bytes]]) -> None:
        state["status"] = status

    def on_data(data: bytes) -> None:
        nonlocal prev
        if state["status"] != 200:
            return
        payloads, state["buf"] = sse_data(state["buf"] + data)  # type: ignore[operator]
        now = trio.current_time()
        for payload in payloads:
            if payload == b"[DONE]":
                state["done"] = True
                continue
            chunk = decode_chunk(payload)
            if chunk.choices and chunk.choices[0].delta.content:
                rec.token(started, prev, now)
                prev = now
                state["chunks"] += 1  # type: ignore[operator]

    error = ""
    try:
        with trio.fail_after(STREAM_DEADLINE_S):
            await client.post("/v1/chat/completions", body, on_head, on_data)
    except (h11.ProtocolError, trio.BrokenResourceError, OSError) as exc:
        # Where it broke tells the client's stale keep-alive connection
        # (before the head) from a stream cut off (after some chunks).
        where = "before the head" if not state["status"] else f"after {state['chunks']} chunks"
        error = f"broken: {type(exc).__name__} ({where}: {exc})"
    except msgspec.DecodeError:
        error = "undecodable chunk"
    if not error and state["status"] != 200:
        error = f"HTTP {state['status']}"
    elif not error and (state["chunks"] != expect or not state["done"]):
        error = "incomplete"
    rec.ended(trio.current_time(), error)


async def run_streams(
    clients: list[RawClient],
    bodies: list[bytes],
    *,
    streams: int,
    expect: int,
    stream_s: float,
    warmup_s: float,
    window_s: float,
    on_open: Any,
    on_close: Any,
) -> Recorder:
    """``streams`` closed-loop streams (stream ``i`` on ``clients[i % n]``
    with ``bodies[i % m]``, started ``i * stream_s / streams`` after the
    first), measured for
    ``window_s`` after ``warmup_s``; ``on_open()`` / ``on_close()`` are
    called at the window's ends (where the CPU is read)."""
    rec = Recorder()
    stagger = stream_s / max(1, streams)

    async def worker(i: int) -> None:
        await trio.sleep(i * stagger)
        client = clients[i % len(clients)]
        body = bodies[i % len(bodies)]
        while True:
            await paced_stream(client, body, expect, rec)

    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(worker, i)
        # A measurement window is time itself, not a wait for an event.
        await trio.sleep(warmup_s)
        on_open()
        rec.opened = trio.current_time()
        await trio.sleep(window_s)
        rec.closed = trio.current_time()
        on_close()
        nursery.cancel_scope.cancel()
    for c in clients:
        c.close_idle()
    return rec


def stream_bodies(streams: int) -> list[bytes]:
    """One request body per stream, each prompt its own: the same prompt for
    all would be placed by its prefix (docs/operations.md) on one instance,
    and one sim would carry the whole fleet."""
    return [
        msgspec.json.encode(
            {
                "model": MODEL,
                "stream": True,
                "messages": [{"role": "user", "content": f"{i}: tell me about the fleet."}],
            }
        )
        for i in range(streams)
    ]


# --------------------------------------------------------------------------- the processes


@dataclass
class Fleet:
    sims: list[tuple[Proc, str]]
    gateways: dict[str, tuple[str, dict[str, Proc]]]  # shape -> (url, processes charged)


def _instances(sims: list[tuple[Proc, str]], concurrency: int) -> list[dict[str, Any]]:
    # max_concurrency and max_queue at the highest level on each instance:
    # the edge's scheduler never queues (the sims have no limit).
    return [
        {
            "adapter": "vllm",
            "name": f"sim{i}",
            "endpoint": url,
            "max_concurrency": concurrency,
            "max_queue": concurrency,
        }
        for i, (_, url) in enumerate(sims)
    ]


def start_fleet(stack: Stack, opts: Options, smoke: bool) -> Fleet:
    sim_flags = ["--ttft", "0", "--output-tokens", str(opts.tokens)]
    sim_flags += ["--tokens-per-s", f"{opts.tokens_per_s:g}", "--model", MODEL]
    sims = start_sims(stack, opts.sims, *sim_flags, "--log-level", "warning")
    top = max(opts.levels)
    instances = _instances(sims, top)
    gateways: dict[str, tuple[str, dict[str, Proc]]] = {}
    if "direct" in opts.shapes:
        gateways["direct"] = ("", {})
    up: Proc | None = None
    if "up" in opts.shapes:
        path = stack.logdir / "up.toml"
        path.write_text(
            toml_dumps(
                {
                    "node": {"id": "fleet-up", "probe_interval_s": 30.0},
                    "edge": {"scheduler": {"max_queue": 4 * top}},
                    "instances": instances,
                }
            )
        )
        up = stack.launch("up", "up", "--port", "0", "--config", str(path))
    if "split" in opts.shapes:
        edge, url, link = start_edge(stack, {"scheduler": {"max_queue": 4 * top}})
        node = start_node(stack, "node", link, {"probe_interval_s": 30.0}, instances)
        wait_instances(url, len(sims), timeout=60.0)
        wait_models(url, {MODEL}, [edge, node], 60.0)
        gateways["split"] = (url, {"edge": edge, "node": node})
    if up is not None:
        m = up.wait_stdout(UP_READY, timeout=60.0)
        wait_models(m[1], {MODEL}, [up], 60.0)
        gateways["up"] = (m[1], {"up": up})
    return Fleet(sims, {s: gateways[s] for s in SHAPES if s in gateways})


# --------------------------------------------------------------------------- one window


def _ms(v: float) -> float | None:
    return None if math.isnan(v) else round(v * 1000, 2)


def summarize(
    rec: Recorder, cpu: dict[str, Any], gateway: list[str], tokens: int
) -> dict[str, Any]:
    """One window's figures: ``cpu`` is ``CpuWindow.stop()``'s, ``gateway``
    the names of the processes charged to the shape."""
    wall = cpu["wall_s"]
    n = rec.tokens
    procs: dict[str, Any] = {}
    for name in gateway:
        s = cpu["cpu_s"][name]
        procs[name] = {
            "cpu_pct_of_core": cpu["cpu_pct_of_core"][name],
            "us_per_token": round(s * 1e6 / n, 1) if n else None,
            "tokens_per_s_per_core": round(n / s) if s > 0 else None,
            "saturated": cpu["cpu_pct_of_core"][name] >= SATURATED_PCT,
        }
    gw_s = sum(cpu["cpu_s"][name] for name in gateway)
    sims_s = sum(v for k, v in cpu["cpu_s"].items() if k.startswith("sim"))
    return {
        "tokens": n,
        "tokens_per_s": round(n / wall, 1) if wall > 0 else None,
        "streams_completed": rec.streams,
        "errors": dict(rec.errors),
        "procs": procs,
        "gateway_us_per_token": round(gw_s * 1e6 / n, 1) if n and gateway else None,
        # µs per token x tokens per answer: the platform runner's "CPU ms per request".
        "gateway_ms_per_request": round(gw_s * 1e3 * tokens / n, 2) if n and gateway else None,
        "gateway_tokens_per_s_per_core": round(n / gw_s) if gw_s > 0 else None,
        "sims_us_per_token": round(sims_s * 1e6 / n, 1) if n else None,
        "client_us_per_token": round(cpu["cpu_s"]["client"] * 1e6 / n, 1) if n else None,
        "ttft_ms": {"p50": _ms(pct(rec.ttft_s, 50)), "p99": _ms(pct(rec.ttft_s, 99))},
        "gap_ms": {"p50": _ms(pct(rec.gaps_s, 50)), "p99": _ms(pct(rec.gaps_s, 99))},
        "cpu_pct_of_core": cpu["cpu_pct_of_core"],
        "foreign_cpu_pct_of_core": cpu["foreign_cpu_pct_of_core"],
        "loadavg": cpu["loadavg"],
        "wall_s": wall,
    }


def relative(level: dict[str, dict[str, Any]]) -> None:
    """Each gateway shape of a level against ``direct`` of the same level:
    added TTFT p50/p99, added inter-token p99, throughput in % of direct."""
    direct = level.get("direct")
    for shape, w in level.items():
        if shape == "direct" or direct is None:
            continue

        def diff(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round(a - b, 2)

        w["added_ttft_ms"] = {
            p: diff(w["ttft_ms"][p], direct["ttft_ms"][p]) for p in ("p50", "p99")
        }
        w["added_gap_p99_ms"] = diff(w["gap_ms"]["p99"], direct["gap_ms"]["p99"])
        d = direct["tokens_per_s"]
        w["throughput_pct_of_direct"] = round(100 * w["tokens_per_s"] / d, 1) if d else None


def _window(
    fleet: Fleet, shape: str, streams: int, opts: Options, *, window_s: float
) -> tuple[Recorder, dict[str, Any]]:
    url, procs = fleet.gateways[shape]
    urls = [u for _, u in fleet.sims] if shape == "direct" else [url]
    clients = [RawClient(u, max_idle=streams) for u in urls]
    bodies = stream_bodies(streams)
    pids = {name: p.pid for name, p in procs.items()}
    pids |= {f"sim{i}": p.pid for i, (p, _) in enumerate(fleet.sims)}
    box: dict[str, Any] = {}

    def on_open() -> None:
        box["w"] = CpuWindow(pids)

    def on_close() -> None:
        box["cpu"] = box["w"].stop()

    rec = trio.run(
        lambda: run_streams(
            clients,
            bodies,
            streams=streams,
            expect=opts.tokens,
            stream_s=opts.tokens / opts.tokens_per_s,
            warmup_s=opts.warmup_s,
            window_s=window_s,
            on_open=on_open,
            on_close=on_close,
        )
    )
    return rec, box["cpu"]


def _profile(  # pragma: no cover - py-spy attaches by ptrace: not in the suite
    fleet: Fleet, shape: str, streams: int, opts: Options, py_spy: str, outdir: Path
) -> dict[str, Any]:
    _, procs = fleet.gateways[shape]
    spies: dict[str, Any] = {}

    def on_open() -> None:
        for name, p in procs.items():
            raw = outdir / f"pyspy-fleet-{shape}-c{streams}-{name}.txt"
            spies[name] = (
                raw,
                start_py_spy(py_spy, p.pid, raw, rate=SPY_RATE, seconds=opts.profile_s),
            )

    url = fleet.gateways[shape][0]
    trio.run(
        lambda: run_streams(
            [RawClient(url, max_idle=streams)],
            stream_bodies(streams),
            streams=streams,
            expect=opts.tokens,
            stream_s=opts.tokens / opts.tokens_per_s,
            warmup_s=opts.warmup_s,
            window_s=opts.profile_s + 1.0,
            on_open=on_open,
            on_close=lambda: None,
        )
    )
    return spy_report(spies)


# --------------------------------------------------------------------------- the run


def _smoke(opts: Options) -> Options:
    return msgspec.structs.replace(
        opts,
        levels=[8],
        sims=min(opts.sims, 2),
        tokens=min(opts.tokens, 8),
        warmup_s=min(opts.warmup_s, 1.0),
        window_s=min(opts.window_s, 1.5),
        profile=False,
    )


@register(
    "fleet",
    Options,
    "Paced streams at 256 and 1,024 open: CPU per token, tokens/s per core, added TTFT",
    report=tables_report("iop.bench._fleet"),
)
def run(opts: Options, ctx: RunContext) -> dict[str, Any]:
    if ctx.smoke:
        opts = _smoke(opts)
    unknown = set(opts.shapes) - set(SHAPES)
    if unknown:
        raise ValueError(f"unknown shapes {sorted(unknown)}; known: {', '.join(SHAPES)}")
    fd = raise_fd_limit()
    need = 3 * max(opts.levels) + 256  # client, edge and node sockets per stream, and spare
    if fd["now"] < need:
        raise RuntimeError(f"open-files limit {fd['now']} < {need} for {max(opts.levels)} streams")
    py_spy = find_py_spy(ctx.python) if opts.profile else None
    t0 = time.monotonic()
    levels: dict[str, dict[str, Any]] = {}
    profiles: dict[str, Any] = {}
    with process_stack(ctx.python, ctx.workdir) as stack:
        fleet = start_fleet(stack, opts, ctx.smoke)
        for streams in opts.levels:
            level: dict[str, Any] = {}
            # Repeat r runs the shapes in turn, reversed on odd repeats.
            order = list(fleet.gateways)
            for shape in order[::-1] if ctx.repeat % 2 else order:
                rec, cpu = _window(fleet, shape, streams, opts, window_s=opts.window_s)
                level[shape] = summarize(rec, cpu, list(fleet.gateways[shape][1]), opts.tokens)
            relative(level)
            levels[f"c{streams}"] = {s: level[s] for s in fleet.gateways}
            if py_spy is not None:
                for shape in fleet.gateways:
                    if shape != "direct":
                        profiles[f"{shape}-c{streams}"] = _profile(
                            fleet, shape, streams, opts, py_spy, ctx.workdir
                        )
    return {
        "options": msgspec.to_builtins(opts),
        "fd_limit": fd,
        "levels": levels,
        "profiles": profiles,
        "profile_skipped": None
        if py_spy is not None or not opts.profile
        else "py-spy is not installed (pip install py-spy)",
        "elapsed_s": round(time.monotonic() - t0, 1),
        "cpus": os.cpu_count(),
    }


# --------------------------------------------------------------------------- the report


def _f(v: Any, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def tables(result: dict[str, Any]) -> str:
    """The docs' table: per level and shape, per process."""
    rows = [
        "| streams | shape | tokens/s | process | CPU % of a core | µs per token | tokens/s per core | TTFT p50 / p99, ms (added) | inter-token p99, ms (added) | errors |",
        "| ---: | --- | ---: | --- | ---: | ---: | ---: | --- | --- | ---: |",
    ]
    for level, shapes in result["levels"].items():
        for shape, w in shapes.items():
            names = list(w["procs"]) + (["total"] if len(w["procs"]) > 1 else [])
            if not names:
                names = ["(sims)"]
            for i, name in enumerate(names):
                first = i == 0
                if name == "total":
                    us, per_core, load = (
                        w["gateway_us_per_token"],
                        w["gateway_tokens_per_s_per_core"],
                        "-",
                    )
                elif name == "(sims)":
                    us, per_core, load = w["sims_us_per_token"], None, "-"
                else:
                    p = w["procs"][name]
                    sat = " (saturated)" if p["saturated"] else ""
                    us, per_core, load = (
                        p["us_per_token"],
                        p["tokens_per_s_per_core"],
                        f"{_f(p['cpu_pct_of_core'])}{sat}",
                    )
                ttft = gap = errs = tps = ""
                if first:
                    t, g = w["ttft_ms"], w["gap_ms"]
                    ttft = f"{_f(t['p50'])} / {_f(t['p99'])}"
                    gap = _f(g["p99"])
                    if "added_ttft_ms" in w:
                        a = w["added_ttft_ms"]
                        ttft += f" (+{_f(a['p50'])} / +{_f(a['p99'])})"
                        gap += f" (+{_f(w['added_gap_p99_ms'])})"
                    errs = _f(sum(w["errors"].values()))
                    tps = _f(w["tokens_per_s"], 0)
                rows.append(
                    f"| {level[1:] if first else ''} | {shape if first else ''} | {tps} | {name} | {load} | {_f(us)} | {_f(per_core)} | {ttft} | {gap} | {errs} |"
                )
    out = "\n".join(rows)
    prof = result.get("profiles") or {}
    if prof:
        lines = [
            "",
            "| profile (py-spy, self %) | process | top functions |",
            "| --- | --- | --- |",
        ]
        for key, by_proc in prof.items():
            for name, rep in by_proc.items():
                top = rep.get("self_pct_top_functions", [])[:6]
                fns = "; ".join(f"`{fn}` {share}" for fn, share in top) or rep.get("error", "-")
                lines.append(f"| {key} | {name} | {fns} |")
        out += "\n" + "\n".join(lines)
    return out


def plots(result: dict[str, Any], img_dir: Path) -> list[Path]:
    """``bench_fleet.png``: CPU per token of each gateway process (edge and
    node stacked) and tokens/s per core of each shape, per level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(result["levels"], key=lambda k: int(k.removeprefix("c")))
    if not levels:
        return []
    fig, (cpu_ax, core_ax) = plt.subplots(1, 2, figsize=(10, 4))
    xs = range(len(levels))
    width = 0.38

    def us(level: str, shape: str, proc: str) -> float:
        cell = result["levels"][level].get(shape) or {}
        value = (cell.get("procs") or {}).get(proc, {}).get("us_per_token")
        return float(value) if value is not None else 0.0

    edge = [us(lv, "split", "edge") for lv in levels]
    node = [us(lv, "split", "node") for lv in levels]
    up = [us(lv, "up", "up") for lv in levels]
    left = [x - width / 2 for x in xs]
    right = [x + width / 2 for x in xs]
    cpu_ax.bar(left, edge, width, label="edge (edge + node)", color="C0")
    cpu_ax.bar(left, node, width, bottom=edge, label="node (edge + node)", color="C1")
    cpu_ax.bar(right, up, width, label="iop up", color="C2")
    cpu_ax.set_ylabel("µs of CPU per paced token")
    split_core = [1e6 / (e + n) if e + n else 0.0 for e, n in zip(edge, node, strict=True)]
    up_core = [1e6 / u if u else 0.0 for u in up]
    core_ax.bar(left, split_core, width, label="edge + node", color="C0")
    core_ax.bar(right, up_core, width, label="iop up", color="C2")
    core_ax.set_ylabel("paced tokens/s per core")
    names = [f"{int(lv.removeprefix('c')):,} streams" for lv in levels]
    for ax in (cpu_ax, core_ax):
        ax.set_xticks(list(xs), names)
        ax.legend()
    fig.suptitle("Paced streams (64 tokens, 50 tokens/s) through the gateway")
    fig.tight_layout()
    img_dir.mkdir(parents=True, exist_ok=True)
    path = img_dir / "bench_fleet.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]
