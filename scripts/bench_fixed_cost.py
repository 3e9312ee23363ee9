"""The fixed CPU cost of a request through edge and node, A/B between source trees.

Starts one platform per source tree (``bench_platform.running_platform``: a
sim, an edge and a node, each its own process) and keeps them all up, then
runs every level on each in turn, ``--pairs`` times, alternating which tree
goes first. A level is ``--requests`` requests at ``--concurrency``, after 32
unmeasured ones:

* ``stream-N``: a streamed chat answer of N content chunks (the sim's
  ``iop_sim.output_tokens`` override), chunks as fast as the sim sends them;
* ``json-N``: the same answer not streamed (``"stream": false``).

What it reports is CPU time per request of the edge and the node
(utime+stime from /proc, as ``bench_platform.py`` does), the median over the
pairs and the median of the per-pair differences, and, with a ``stream-1``
and a ``stream-64`` level, the split into a fixed part and a part per chunk.

``--profile LEVEL`` then runs that level twice more with py-spy attached
(``--nonblocking --rate 250 --format raw``; ``--blocking`` drops
``--nonblocking``: py-spy then pauses the process for each sample, and no
stack is read half-changed): once with the edge alone on CPU 0
and every other process on CPU 1, once for the node the same way, so that
the profiled process is never descheduled for its peers (a sampler counts a
runnable process that waits for the CPU where it stopped, which inflates the
frames just after a send). It prints where the samples go, by part of a
request (``EDGE_PARTS``, ``NODE_PARTS``), over the samples with a whole stack
that are not in epoll's wait.

Examples:
  python scripts/bench_fixed_cost.py                              # this tree
  git archive HEAD~3 | tar -x -C /tmp/before
  python scripts/bench_fixed_cost.py --trees before=/tmp/before,after=.
  python scripts/bench_fixed_cost.py --levels stream-1 --profile stream-1

docs/benchmarks.md, "Where the fixed cost goes", quotes the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_platform as bp

from iop.testing import Proc

REPO = Path(__file__).resolve().parent.parent
WARMUP = 32


# The benchmark's own typed view of a chat chunk (the fields it reads).
_decode_chunk = bp._decode_chunk


# --------------------------------------------------------------------------- load


def level_body(name: str) -> tuple[bytes, int, bool]:
    """The request body of level ``stream-N`` or ``json-N``, N and whether it streams."""
    kind, _, n = name.partition("-")
    if kind not in ("stream", "json") or not n.isdigit() or int(n) < 1:
        raise ValueError(f"level {name!r}: expected stream-N or json-N")
    body = {
        "model": bp.MODEL_FAST,
        "stream": kind == "stream",
        "messages": [{"role": "user", "content": "Tell me about the benchmark."}],
        "iop_sim": {"output_tokens": int(n)},
    }
    return msgspec.json.encode(body), int(n), kind == "stream"


async def one(client: httpx.AsyncClient, body: bytes, chunks: int, stream: bool) -> str:
    """One request; "" when the answer is whole, else what was wrong."""
    headers = {"Content-Type": "application/json"}
    try:
        if not stream:
            r = await client.post("/v1/chat/completions", content=body, headers=headers)
            if r.status_code != 200 or not r.json()["choices"][0]["message"]["content"]:
                return f"HTTP {r.status_code} {r.text[:200]}"
            return ""
        async with client.stream(
            "POST", "/v1/chat/completions", content=body, headers=headers
        ) as r:
            if r.status_code != 200:
                return f"HTTP {r.status_code}"
            raw = await r.aread()
    except httpx.HTTPError as exc:
        return repr(exc)
    content = 0
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: {"):
            chunk = _decode_chunk(event[6:])
            content += bool(chunk.choices and chunk.choices[0].delta.content)
    if content != chunks or b"data: [DONE]" not in raw:
        return f"{content} content chunks (expected {chunks})"
    return ""


async def drive(url: str, name: str, n: int, concurrency: int) -> list[str]:
    body, chunks, stream = level_body(name)
    errors: list[str] = []
    left = n
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(connect=5, read=60, write=5, pool=60)
    async with httpx.AsyncClient(
        base_url=url, limits=limits, timeout=timeout, trust_env=False
    ) as client:

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                if err := await one(client, body, chunks, stream):
                    errors.append(err)

        with trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                for _ in range(concurrency):
                    nursery.start_soon(worker)
    return errors


@dataclass
class _Split:
    """The edge + node shape of ``bench_platform.running_platform``, and its sims."""

    url: str
    edge: Proc
    node: Proc
    sim_fast: Proc
    sim_paced: Proc


@contextlib.contextmanager
def _split_platform(logdir: Path) -> Iterator[_Split]:
    args = argparse.Namespace(
        shape_list=["split"], python=sys.executable, paced_rate=50.0, litellm=Path("/nonexistent")
    )
    with bp.running_platform(args, logdir) as plat:
        gw = plat.gateways["split"]
        yield _Split(
            url=gw.urls[bp.MODEL_FAST],
            edge=gw.procs["edge"],
            node=gw.procs["node"],
            sim_fast=plat.sims["sim"],
            sim_paced=plat.sims["sim_paced"],
        )


def _cpu_s(p: Proc) -> float:
    return bp.proc_cpu_s(p.pid)


def run_level(plat: _Split, name: str, n: int, concurrency: int) -> dict[str, Any]:
    """One measured level (after ``WARMUP`` requests): CPU ms per request."""
    trio.run(drive, plat.url, name, WARMUP, concurrency)
    procs = {"edge": plat.edge, "node": plat.node, "sim": plat.sim_fast}
    cpu0 = {k: _cpu_s(p) for k, p in procs.items()}
    own0 = time.process_time()
    busy0, total0 = bp.machine_cpu_s()
    t0 = time.perf_counter()
    errors = trio.run(drive, plat.url, name, n, concurrency)
    wall = time.perf_counter() - t0
    busy1, total1 = bp.machine_cpu_s()
    cpu = {k: _cpu_s(p) - cpu0[k] for k, p in procs.items()}
    ours = sum(cpu.values()) + time.process_time() - own0
    ms = {k: round(v * 1000 / n, 3) for k, v in cpu.items()}
    return {
        "level": name,
        "requests": n,
        "errors": dict(Counter(errors)),
        "edge_ms": ms["edge"],
        "node_ms": ms["node"],
        "edge_node_ms": round(ms["edge"] + ms["node"], 3),
        "sim_ms": ms["sim"],
        "req_per_s": round(n / wall, 1),
        "loadavg": round(os.getloadavg()[0], 2),
        # Busy CPU, in % of one core, that none of the benchmark's processes used.
        "foreign_pct": round(100 * max(0.0, (busy1 - busy0) - ours) / wall, 1)
        if total1 > total0
        else None,
    }


# --------------------------------------------------------------------------- profile

_FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")

Rule = tuple[str, Callable[[list[str]], bool]]


def _has(*names: str) -> Callable[[list[str]], bool]:
    return lambda stack: any(fn == n or fn.endswith("." + n) for fn in stack for n in names)


def _logged(part: Callable[[list[str]], bool]) -> Callable[[list[str]], bool]:
    return lambda stack: part(stack) and _has("Logger._log")(stack)


# Parts of a request, first match wins (function names as py-spy prints them).
EDGE_PARTS: list[Rule] = [
    (
        "link: frames to and from the node",
        _has("EdgeCore._writer", "EdgeCore.handle_link", "WSStream.handle", "WSStream.app_send"),
    ),
    ("run: the outcome's log line (INFO)", _logged(_has("RunSupervisor._supervise"))),
    ("run: metrics", _has("EdgeCore.record_outcome")),
    ("run: supervisor and RemoteExecutor", _has("RunSupervisor._supervise")),
    (
        "IOP handler: auth, parse, spec, start_run, first output",
        _has("_Surfaces.answer", "_in_quart"),
    ),
    ("SSE body: _sse_body and the surface's encoder", _has("_RunBody.__anext__")),
    ("response writes: hypercorn, h11, stall guard, socket", _has("_send_answer")),
    (
        "ASGI layer: quart's per-request machinery, or SurfaceASGI",
        _has(
            "TrioASGIHTTPConnection.__call__",
            "TrioASGIHTTPConnection.handle_messages",
            "TrioASGIHTTPConnection.handle_request",
            "ASGIWrapper.__call__",
            "SurfaceASGI.__call__",
            "_watch_disconnect",
        ),
    ),
    ("request read: hypercorn and h11", _has("TCPServer.run")),
    ("trio: scheduler and task bookkeeping", lambda stack: True),
]
NODE_PARTS: list[Rule] = [
    (
        "link: frames to and from the edge",
        _has("NodeAgent._write_loop", "NodeAgent.serve_link", "WebSocketConnection._reader_task"),
    ),
    (
        "adapter: its 'executing' log line (INFO)",
        lambda s: _logged(_has("VllmAdapter.execute_chat"))(s) and not _has("HTTPBackend.pump")(s),
    ),
    ("upstream request: build, send, response head", _has("VllmAdapter._request_with_fallback")),
    ("upstream body: read, SSE parse, events, drain", _has("HTTPBackend.pump")),
    ("run: the outcome's log line (INFO)", _logged(_has("RunSupervisor._supervise"))),
    (
        "run: supervisor, agent, slots",
        _has("RunSupervisor._supervise", "NodeAgent._run_task", "NodeAgent._forward"),
    ),
    ("trio: scheduler and task bookkeeping", lambda stack: True),
]


def parts(raw: Path, rules: list[Rule]) -> dict[str, Any]:
    """Samples of a py-spy raw file by part, over the whole non-idle stacks."""
    counts: Counter[str] = Counter()
    total = idle = truncated = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack_text, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        stack = [m["fn"] for m in map(_FRAME.match, stack_text.split(";")) if m]
        if stack and stack[-1] == "EpollIOManager.get_events":
            idle += n  # epoll_wait: mostly waiting
        elif "unrolled_run" not in stack:
            truncated += n  # a stack py-spy read only in part (non-blocking mode)
        else:
            counts[next(name for name, rule in rules if rule(stack))] += n
    used = max(1, total - idle - truncated)
    return {
        "samples": total,
        "epoll_wait_pct": round(100 * idle / max(1, total), 1),
        "truncated_pct": round(100 * truncated / max(1, total), 1),
        "parts_pct": {name: round(100 * counts[name] / used, 1) for name, _ in rules},
    }


def profile(
    plat: _Split, name: str, n: int, concurrency: int, out: Path, *, nonblocking: bool
) -> dict[str, Any]:
    py_spy = bp.find_py_spy(sys.executable)
    if py_spy is None:
        raise SystemExit("--profile needs py-spy (pip install py-spy)")
    procs = {"edge": plat.edge, "node": plat.node, "sim": plat.sim_fast, "paced": plat.sim_paced}
    result: dict[str, Any] = {}

    def pin(pid: int, cpus: str) -> None:
        subprocess.run(
            ["taskset", "-a", "-p", "-c", cpus, str(pid)], check=True, capture_output=True
        )

    try:
        for target, rules in (("edge", EDGE_PARTS), ("node", NODE_PARTS)):
            for key, proc in procs.items():
                pin(proc.pid, "0" if key == target else "1")
            os.sched_setaffinity(0, {1})  # py-spy, started from here, too
            raw = out / f"pyspy-fixed-{name}-{target}-{time.strftime('%H%M%S')}.txt"
            argv = [py_spy, "record", "--pid", str(procs[target].pid), "--rate", "250"]
            argv += ["--format", "raw", "--output", str(raw)]
            if nonblocking:
                argv.append("--nonblocking")
            spy = subprocess.Popen(
                argv,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            try:
                time.sleep(1.0)  # let py-spy attach
                level = run_level(plat, name, n, concurrency)
            finally:
                os.kill(spy.pid, signal.SIGINT)  # py-spy writes its file on SIGINT
                spy.wait(30)
            result[target] = {"level": level, "raw": str(raw), **parts(raw, rules)}
    finally:
        cpus = os.cpu_count() or 1
        for proc in procs.values():
            with contextlib.suppress(subprocess.CalledProcessError):
                pin(proc.pid, f"0-{cpus - 1}")
        os.sched_setaffinity(0, set(range(cpus)))
    return result


# --------------------------------------------------------------------------- main


def fit(runs: list[dict[str, Any]], key: str) -> tuple[float, float] | None:
    """(fixed ms, µs per chunk) from the medians of the streamed levels."""
    points = []
    for lv in sorted({r["level"] for r in runs if r["level"].startswith("stream-")}):
        chunks = int(lv.split("-")[1])
        points.append((chunks, statistics.median(r[key] for r in runs if r["level"] == lv)))
    if len({x for x, _ in points}) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, slope * 1000


def report(runs: list[dict[str, Any]], trees: list[str]) -> None:
    levels = list(dict.fromkeys(r["level"] for r in runs))
    print("\nCPU ms per request, median over the pairs [min..max]")
    print(f"{'level':<12}{'tree':<10}{'edge':>18}{'node':>18}{'edge+node':>20}")
    for lv in levels:
        for tree in trees:
            rs = [r for r in runs if r["level"] == lv and r["tree"] == tree]
            cells = []
            for key in ("edge_ms", "node_ms", "edge_node_ms"):
                vals = [r[key] for r in rs]
                cells.append(f"{statistics.median(vals):.2f} [{min(vals):.2f}..{max(vals):.2f}]")
            print(f"{lv:<12}{tree:<10}{cells[0]:>18}{cells[1]:>18}{cells[2]:>20}")
    if len(trees) == 2:
        a, b = trees
        print(f"\nper-pair difference {b} - {a}, median [min..max]")
        for lv in levels:
            cells = []
            for key in ("edge_ms", "node_ms", "edge_node_ms"):
                diffs = []
                for rep in sorted({r["rep"] for r in runs}):
                    x = {r["tree"]: r[key] for r in runs if r["level"] == lv and r["rep"] == rep}
                    diffs.append(x[b] - x[a])
                cells.append(
                    f"{statistics.median(diffs):+.2f} [{min(diffs):+.2f}..{max(diffs):+.2f}]"
                )
            print(f"{lv:<12}{'':<10}{cells[0]:>18}{cells[1]:>18}{cells[2]:>20}")
    for tree in trees:
        got = fit([r for r in runs if r["tree"] == tree], "edge_node_ms")
        if got is not None:
            print(f"{tree}: edge+node = {got[0]:.2f} ms per request + {got[1]:.0f} µs per chunk")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--trees",
        default=f"this={REPO}",
        help="NAME=DIR,... source trees (each with its own iop/) to compare (default: this one)",
    )
    ap.add_argument("--pairs", type=int, default=3, help="rounds over every level and tree")
    ap.add_argument("--requests", type=int, default=400, help="requests per level")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--levels", default="stream-1,stream-16,stream-64,json-64")
    ap.add_argument("--profile", metavar="LEVEL", help="then profile LEVEL on the first tree")
    ap.add_argument("--profile-requests", type=int, default=4000)
    ap.add_argument(
        "--blocking",
        action="store_true",
        help="let py-spy pause the process for each sample (whole stacks, a little overhead)",
    )
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench-results")
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.trees.split(","))
    levels = args.levels.split(",")
    for name in levels + ([args.profile] if args.profile else []):
        level_body(name)  # fails early on a bad name
    args.out_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    result: dict[str, Any] = {"trees": trees, "settings": vars(args) | {"out_dir": None}}
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        plats: dict[str, _Split] = {}
        for name, tree in trees.items():
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"fixed-{name}-")))
            # The children run `python -m iop` in bench_platform.REPO: that
            # directory's iop/ is the one they import.
            bp.REPO = Path(tree).resolve()
            os.environ["PYTHONPATH"] = str(bp.REPO)
            plats[name] = stack.enter_context(_split_platform(tmp))
            print(f"bench: {name} ({tree}) at {plats[name].url}", flush=True)
        for rep in range(args.pairs):
            for lv in levels:
                order = list(plats) if rep % 2 == 0 else list(plats)[::-1]
                for name in order:
                    r = run_level(plats[name], lv, args.requests, args.concurrency)
                    runs.append(r | {"tree": name, "rep": rep})
                    print(
                        f"bench: [{rep + 1}/{args.pairs}] {lv:<10} {name:<8} edge {r['edge_ms']:.2f}"
                        f" node {r['node_ms']:.2f} ms/req, load {r['loadavg']},"
                        f" foreign {r['foreign_pct']}% {r['errors'] or ''}",
                        flush=True,
                    )
        if args.profile:
            first = next(iter(plats))
            result["profile"] = profile(
                plats[first],
                args.profile,
                args.profile_requests,
                args.concurrency,
                args.out_dir,
                nonblocking=not args.blocking,
            )
    result["runs"] = runs
    out = args.out_dir / f"fixed-cost-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    report(runs, list(trees))
    for target, prof in result.get("profile", {}).items():
        lv = prof["level"]
        ms = lv[f"{target}_ms"]
        print(
            f"\n{target}, {args.profile} pinned alone on CPU 0 ({ms:.2f} ms/req there):"
            f" {prof['samples']} samples, {prof['epoll_wait_pct']} % in epoll's wait,"
            f" {prof['truncated_pct']} % truncated; the rest:"
        )
        for part, pct in prof["parts_pct"].items():
            print(f"  {pct:5.1f} %  {part}")
    print(f"\nbench: results in {out}")
    failed = sum(sum(r["errors"].values()) for r in runs)
    return 1 if failed or any(math.isnan(r["edge_ms"]) for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
