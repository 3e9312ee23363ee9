"""Memory of open idle streams on edge and node, and whether it comes back.

Starts a sim, an edge and a node (each its own process, stopped by PID at the
end), with deadlines, queues and slots far above what the streams need, and
the file-descriptor limit raised to its hard limit. After 50 finished
requests (warm-up) it reads the RSS of edge and node (VmRSS), then for each
``--streams`` count N, ``--cycles`` times:

1. opens N streamed chat requests on raw sockets, each answered with one
   content chunk and then nothing (the sim's ``iop_sim`` override: two
   tokens at 0.0005 tokens/s), and waits until every one has its chunk;
2. reads RSS and open fds: (RSS - base) / N is the memory per open stream;
3. closes the N client sockets, waits until the edge has no run left and
   both processes are back to their base fds (how long that takes is
   printed), and reads RSS again.

RSS seldom shrinks when streams close (CPython keeps freed arenas that are
not wholly empty, and malloc keeps its pages), so "comes back" is read two
ways: the Python heap back at its base (``--tracemalloc``), and the next
cycle's open streams fitting in what the last cycle left (RSS not growing).

``--census`` adds ``scripts/bench_census`` to the children's PYTHONPATH and,
at every reading, writes a census of live objects by type
(``<pid>-types-<n>.json``) and, with ``--tracemalloc N``, a tracemalloc
snapshot; the script prints the difference from the base per stream, and
with snapshots the bytes per stream by the code that allocated them (the
innermost frame outside trio and contextlib: the library or IOP module that
asked for a task, a channel or a buffer). Tracing makes everything slow: use
it with a few hundred streams.

Examples:
  python scripts/bench_idle_streams.py                           # 200 and 1000 streams
  python scripts/bench_idle_streams.py --code /tmp/before        # another source tree
  python scripts/bench_idle_streams.py --streams 200 --cycles 1 --census --tracemalloc 10
  python scripts/bench_idle_streams.py --unit-costs             # a trio task, a channel...

docs/benchmarks.md, "Where the fixed cost goes", quotes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

REPO = Path(__file__).resolve().parent.parent
MODEL = "iop-sim"
# One chunk, then a pause of 2000 s: the stream stays open and idle.
BODY = (
    b'{"model":"iop-sim","stream":true,"messages":[{"role":"user","content":"Tell me."}],'
    b'"iop_sim":{"output_tokens":2,"tokens_per_s":0.0005}}'
)
WARM_BODY = BODY.replace(b'"tokens_per_s":0.0005', b'"tokens_per_s":0')

_EDGE_TOML = """\
[server]
port = 0
keepalive_interval_s = 600.0
[link]
node_tokens = ["bench"]
# A traced process can pause for seconds at a snapshot: the link must not drop.
heartbeat_interval_s = 2.0
heartbeat_timeout_s = 120.0
[scheduler]
max_queue = 8192
queue_timeout_s = 600.0
[deadlines]
first_token_timeout_s = 3600.0
idle_timeout_s = 3600.0
request_timeout_s = 7200.0
"""
_NODE_TOML = """\
[node]
id = "idle"
probe_interval_s = 30.0
[[node.edges]]
url = "{link}"
token = "bench"
[[instances]]
adapter = "vllm"
name = "sim"
endpoint = "{sim}"
max_concurrency = 4096
max_queue = 4096
queue_timeout_s = 600.0
[instances.deadlines]
first_token_timeout_s = 3600.0
idle_timeout_s = 3600.0
request_timeout_s = 7200.0
"""


def rss_kib(pid: int) -> int:
    m = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    assert m is not None
    return int(m.group(1))


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def wait_for(path: Path, pattern: str, timeout: float = 180) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if m := re.search(pattern, path.read_text(errors="replace")):
            return m
        time.sleep(0.05)
    raise RuntimeError(f"{path}: no {pattern!r}:\n{path.read_text()[-2000:]}")


async def open_streams(host: str, port: int, n: int, streams: list[trio.SocketStream]) -> None:
    """``n`` streams, each until its first content chunk arrived."""
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(BODY)
    ) + BODY

    async def one() -> None:
        s = await trio.open_tcp_stream(host, port)
        streams.append(s)
        await s.send_all(request)
        got = b""
        while b'"content":"' not in got.replace(b'"content":""', b""):
            data = await s.receive_some(65536)
            if not data:
                raise RuntimeError(f"closed before the first chunk: {got[:300]!r}")
            got += data

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one)
            if i % 50 == 49:
                await trio.sleep(0.05)  # the listen backlog is 100


async def hold_then_close(
    host: str, port: int, n: int, on_open: Callable[[], dict[str, Any]], out: dict[str, Any]
) -> None:
    """Open ``n`` idle streams, take ``on_open``'s reading, close them all."""
    streams: list[trio.SocketStream] = []
    try:
        with trio.fail_after(900):
            await open_streams(host, port, n, streams)
        await trio.sleep(2.0)
        out["open"] = on_open()
    finally:
        for s in streams:
            await s.aclose()


def _type_diff(before: Path, after: Path, n: int, top: int) -> list[str]:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    rows = []
    for kind in set(a) | set(b):
        count = (b.get(kind, [0, 0])[0] - a.get(kind, [0, 0])[0]) / n
        size = (b.get(kind, [0, 0])[1] - a.get(kind, [0, 0])[1]) / n
        rows.append((size, count, kind))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    out = [f"  gc-tracked objects: {total / 1024:.1f} KiB per stream (sys.getsizeof)"]
    out += [f"  {size:7.0f} B {count:6.1f}  {kind}" for size, count, kind in rows[:top]]
    return out


_SKIP = ("/trio/", "contextlib.py", "<attrs generated", "/outcome/", "<frozen", "functools.py")


def _owner_diff(before: Path, after: Path, n: int, top: int) -> list[str]:
    def short(path: str) -> str:
        for marker in ("site-packages/", "/lib/python3.11/", "/iop/"):
            if marker in path:
                return ("iop/" if marker == "/iop/" else "") + path.split(marker, 1)[1]
        return path

    sizes: Counter[str] = Counter()
    for stat in tracemalloc.Snapshot.load(str(after)).compare_to(
        tracemalloc.Snapshot.load(str(before)), "traceback"
    ):
        frames = list(stat.traceback)
        owner = next((f for f in reversed(frames) if not any(s in f.filename for s in _SKIP)), None)
        sizes[short(owner.filename) if owner else "?"] += stat.size_diff
    out = [f"  traced: {sum(sizes.values()) / 1024 / n:.1f} KiB per stream, by allocating code"]
    out += [f"  {v / 1024 / n:6.2f} KiB  {k}" for k, v in sizes.most_common(top) if v > 0]
    return out


def unit_costs(n: int = 2000) -> None:
    """What trio's building blocks cost, in this process (tracemalloc, ``n`` of each)."""
    import gc

    import trio.testing

    async def measure(label: str, make: Callable[[trio.Nursery, trio.Event], Any]) -> None:
        async with trio.open_nursery() as nursery:
            release = trio.Event()
            gc.collect()
            before = tracemalloc.take_snapshot()
            kept = [make(nursery, release) for _ in range(n)]
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            after = tracemalloc.take_snapshot()
            size = sum(st.size_diff for st in after.compare_to(before, "filename"))
            print(f"  {size / n:6.0f} B  {label}")
            release.set()
            del kept

    async def waiter(release: trio.Event) -> None:
        await release.wait()

    async def in_scope(release: trio.Event) -> None:
        with trio.CancelScope():
            await release.wait()

    async def in_nursery(release: trio.Event) -> None:
        async with trio.open_nursery():
            await release.wait()

    async def run() -> None:
        await measure("a task awaiting an Event", lambda n, r: n.start_soon(waiter, r))
        await measure("a task in a cancel scope of its own", lambda n, r: n.start_soon(in_scope, r))
        await measure("a task in a nursery of its own", lambda n, r: n.start_soon(in_nursery, r))
        await measure(
            "a memory channel pair (capacity 16)", lambda n, r: trio.open_memory_channel(16)
        )
        await measure("a trio.Event", lambda n, r: trio.Event())

    tracemalloc.start(1)
    print("trio building blocks, bytes each (tracemalloc):")
    trio.run(run)
    tracemalloc.stop()


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--code", type=Path, default=REPO, help="source tree whose iop/ runs")
    ap.add_argument("--streams", default="200,1000", help="stream counts (default: %(default)s)")
    ap.add_argument("--cycles", type=int, default=2, help="open/close cycles per count")
    ap.add_argument("--census", action="store_true", help="object census at every reading")
    ap.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES", help="with --census")
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench-results")
    ap.add_argument("--unit-costs", action="store_true", help="what a trio task or channel costs")
    args = ap.parse_args()
    if args.unit_costs:
        unit_costs()
        return 0
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    counts = [int(x) for x in args.streams.split(",")]
    if max(counts) * 2 + 100 > hard:
        raise SystemExit(f"the fd limit ({hard}) is too low for {max(counts)} streams")
    code = args.code.resolve()
    tmp = Path(tempfile.mkdtemp(prefix="idle-streams-"))
    census = tmp / "census"
    census.mkdir()
    env = {**os.environ, "PYTHONPATH": str(code), "PYTHONUNBUFFERED": "1"}
    traced = dict(env)
    if args.census:
        traced["PYTHONPATH"] += os.pathsep + str(REPO / "scripts" / "bench_census")
        traced["IOP_BENCH_CENSUS"] = str(census)
        if args.tracemalloc:
            traced["IOP_BENCH_TRACEMALLOC"] = str(args.tracemalloc)
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, child_env: dict[str, str], *argv: str) -> subprocess.Popen[bytes]:
        with open(tmp / f"{name}.out", "wb") as out, open(tmp / f"{name}.err", "wb") as err:
            p = subprocess.Popen(
                [sys.executable, "-m", "iop", *argv],
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=child_env,
                cwd=code,
                start_new_session=True,
            )
        procs.append(p)
        return p

    result: dict[str, Any] = {"code": str(code), "levels": []}
    try:
        start("sim", env, "sim", "--port", "0", "--ttft", "0", "--tokens-per-s", "0")
        (tmp / "edge.toml").write_text(_EDGE_TOML)
        edge = start("edge", traced, "edge", "--config", str(tmp / "edge.toml"))
        sim_url = wait_for(tmp / "sim.out", r"(http://[0-9.:]+)/v1")[1]
        m = wait_for(tmp / "edge.out", r"(http://[0-9a-z.:\[\]]+)/v1.*nodes dial (ws://\S+)")
        url = m[1]
        (tmp / "node.toml").write_text(_NODE_TOML.format(link=m[2], sim=sim_url))
        node = start("node", traced, "node", "--config", str(tmp / "node.toml"))
        with httpx.Client(base_url=url, trust_env=False, timeout=60) as client:
            deadline = time.monotonic() + 180
            while not any(x["id"] == MODEL for x in client.get("/v1/models").json()["data"]):
                if time.monotonic() > deadline:
                    raise RuntimeError("the node's model never showed up")
                time.sleep(0.1)
            for _ in range(50):
                client.post(
                    "/v1/chat/completions",
                    content=WARM_BODY,
                    headers={"Content-Type": "application/json"},
                )
        host, port = url.removeprefix("http://").rsplit(":", 1)
        time.sleep(1.0)
        readings: list[dict[str, Any]] = []

        def reading(tag: str) -> dict[str, Any]:
            r = {
                "tag": tag,
                "edge_kib": rss_kib(edge.pid),
                "node_kib": rss_kib(node.pid),
                "edge_fds": fds(edge.pid),
                "node_fds": fds(node.pid),
            }
            if args.census:
                for p in (edge, node):
                    os.kill(p.pid, signal.SIGUSR2)
                    if args.tracemalloc:
                        os.kill(p.pid, signal.SIGUSR1)
                time.sleep(5.0 if args.tracemalloc else 2.0)
            readings.append(r)
            return r

        base = reading("base")
        print(
            f"bench: base RSS edge {base['edge_kib']} KiB, node {base['node_kib']} KiB", flush=True
        )
        for n in counts:
            for cycle in range(args.cycles):
                out: dict[str, Any] = {}
                on_open = partial(reading, f"open {n} #{cycle}")
                trio.run(hold_then_close, host, int(port), n, on_open, out)
                t0 = time.monotonic()
                deadline = t0 + 120
                with httpx.Client(base_url=url, trust_env=False, timeout=60) as client:
                    while time.monotonic() < deadline and client.get("/admin/nodes").json()["runs"]:
                        time.sleep(0.2)
                out["runs_gone_s"] = round(time.monotonic() - t0, 1)
                while time.monotonic() < deadline and (
                    fds(edge.pid) > base["edge_fds"] + 5 or fds(node.pid) > base["node_fds"] + 5
                ):
                    time.sleep(0.2)
                out["fds_back_s"] = round(time.monotonic() - t0, 1)
                time.sleep(2.0)
                out["closed"] = reading(f"closed {n} #{cycle}")
                op, cl = out["open"], out["closed"]
                level = {
                    "streams": n,
                    "cycle": cycle,
                    "edge_kib_per_stream": round((op["edge_kib"] - base["edge_kib"]) / n, 1),
                    "node_kib_per_stream": round((op["node_kib"] - base["node_kib"]) / n, 1),
                    "after_close_edge_kib": cl["edge_kib"] - base["edge_kib"],
                    "after_close_node_kib": cl["node_kib"] - base["node_kib"],
                    "runs_gone_s": out.get("runs_gone_s"),
                    "fds_back_s": out.get("fds_back_s"),
                }
                result["levels"].append(level)
                print(
                    f"bench: {n} streams #{cycle}: edge {level['edge_kib_per_stream']} KiB/stream,"
                    f" node {level['node_kib_per_stream']} KiB/stream; closed: runs gone after"
                    f" {level['runs_gone_s']} s, fds back after {level['fds_back_s']} s, RSS over"
                    f" base edge {level['after_close_edge_kib']} KiB node"
                    f" {level['after_close_node_kib']} KiB",
                    flush=True,
                )
        result["readings"] = readings
        if args.census:
            first_open = next(i for i, r in enumerate(readings) if r["tag"].startswith("open"))
            n = int(readings[first_open]["tag"].split()[1])
            for name, p in (("edge", edge), ("node", node)):
                print(f"\n{name}, {readings[first_open]['tag']} against the base:")
                print(
                    "\n".join(
                        _type_diff(
                            census / f"{p.pid}-types-0.json",
                            census / f"{p.pid}-types-{first_open}.json",
                            n,
                            20,
                        )
                    )
                )
                if args.tracemalloc:
                    for i, what in ((first_open, "open"), (first_open + 1, "closed")):
                        print(f"  -- {what}:")
                        print(
                            "\n".join(
                                _owner_diff(
                                    census / f"{p.pid}-0.snap", census / f"{p.pid}-{i}.snap", n, 16
                                )
                            )
                        )
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGINT)
        for p in reversed(procs):
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(5)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"idle-streams-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nbench: results in {path} (logs and census in {tmp})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
