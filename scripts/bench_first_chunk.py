"""The time to first chunk at c=1 through edge + node, A/B between trees, and where it goes.

Starts, per source tree, the platform of ``bench_platform.py`` (the paced sim,
an edge and a node, each its own process; the first tree's sims also serve
``direct``) and keeps them all up. Then it sends one paced streamed request
at a time (``--tokens`` chunks at 50 tok/s), to ``direct`` and to each tree's
edge in turn, the order rotating, so that every tree is measured in the same
minutes as ``direct``: the added time to first chunk is a tree's TTFT minus
``direct``'s, per percentile. It prints the CPU per request of each edge and
node (utime+stime from /proc over the measured requests), the load average
and the busy CPU of the whole machine.

``--timeline N`` then runs N more requests to the first tree with
``strace -f -ttt --seccomp-bpf`` on its edge, its node and the sim (only
``read``, ``write``, ``recvfrom`` and ``sendto`` stop the traced process),
and splits each request's path to its first chunk at the system calls that
cross a process boundary:

  edge:  request read -> Assign written        (parse, run, placement, Assign)
  node:  Assign read -> backend request sent    (run, adapter, pool)
  sim:   request read -> first chunk sent       (the backend, also in direct)
  node:  first chunk read -> events frame sent  (SSE parse, session, frame)
  edge:  events frame read -> client write      (session, run, SSE encode, write)
  hops:  each send -> the peer's read of it     (loopback and the peer's wake-up)

strace slows every system call it stops, so each part is an upper bound; the
sum is compared with the same requests' TTFT. docs/benchmarks.md ("Fixed cost
and the first chunk at c=1") quotes it.

Examples:
  python scripts/bench_first_chunk.py                                  # this tree
  git archive HEAD~3 | (mkdir -p /tmp/before && tar -x -C /tmp/before)
  python scripts/bench_first_chunk.py --trees before=/tmp/before,after=. --n 200
  python scripts/bench_first_chunk.py --n 50 --timeline 30
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_platform as bp

HERE = Path(__file__).resolve().parent.parent


def _body(tokens: int) -> bytes:
    return json.dumps(
        {
            "model": bp.MODEL_PACED,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
            "iop_sim": {"output_tokens": tokens},
        }
    ).encode()


async def series(urls: dict[str, str], n: int, tokens: int, pause_s: float) -> dict[str, list]:
    """``n`` rounds of one request per URL, the order rotating; TTFT in ms."""
    out: dict[str, list[float]] = {k: [] for k in urls}
    keys, body = list(urls), _body(tokens)
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        for i in range(n):
            for k in keys[i % len(keys) :] + keys[: i % len(keys)]:
                s = await bp.one_request(c, urls[k] + "/v1/chat/completions", body, tokens)
                if not s.ok:
                    raise RuntimeError(f"{k}: {s}")
                out[k].append(s.ttft_s * 1e3)
                if pause_s:
                    await trio.sleep(pause_s)
    return out


def _pcts(v: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(v, n=100, method="inclusive")
    return statistics.median(v), q[89], q[98]


# --- the strace timeline ------------------------------------------------------------

_LINE = re.compile(r'^(\d+)\s+(\d+\.\d+) (read|write|recvfrom|sendto)\((\d+), "(.*?)"')


def _calls(path: Path) -> list[tuple[float, str, int, str]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if m and not line.rstrip().endswith("EAGAIN (Resource temporarily unavailable)"):
            out.append((float(m[2]), m[3], int(m[4]), m[5]))
    return out


def _first(calls: list[Any], after: float, pred: Any) -> Any:
    return next((c for c in calls if c[0] >= after and pred(c)), None)


def timeline(files: dict[str, Path], starts: list[float]) -> list[dict[str, float]]:
    """Per request (its start times), the parts of its path to the first chunk, in ms."""
    edge, node, sim = (_calls(files[k]) for k in ("edge", "node", "sim"))
    rows = []
    for t0 in starts:
        req = _first(edge, t0, lambda c: c[1] in ("read", "recvfrom") and "POST /v1/" in c[3])
        if req is None:
            continue
        assign = _first(edge, req[0], lambda c: c[1] in ("write", "sendto") and "assign" in c[3])
        if assign is None:
            continue
        link_fd = assign[2]
        n_assign = _first(
            node, assign[0], lambda c: c[1] in ("read", "recvfrom") and "assign" in c[3]
        )
        n_up = n_assign and _first(
            node, n_assign[0], lambda c: c[1] in ("write", "sendto") and "POST /v1/" in c[3]
        )
        s_req = n_up and _first(
            sim, n_up[0], lambda c: c[1] in ("read", "recvfrom") and "POST /v1/" in c[3]
        )
        # The node's first events frame after its request (a Start goes with it).
        n_link = n_assign[2] if n_assign else -1
        n_frame = n_up and _first(
            node, n_up[0], lambda c, fd=n_link: c[1] in ("write", "sendto") and c[2] == fd
        )
        if not (n_assign and n_up and s_req and n_frame):
            continue
        chunks = [
            c
            for c in node
            if n_up[0] < c[0] <= n_frame[0]
            and c[1] in ("read", "recvfrom")
            and c[2] != n_link
            and "data: " in c[3]
        ]
        sends = [
            c
            for c in sim
            if s_req[0] < c[0]
            and c[1] in ("write", "sendto")
            and "data: " in c[3]
            and (not chunks or c[0] <= chunks[-1][0])
        ]
        frame = _first(
            edge, n_frame[0], lambda c, fd=link_fd: c[1] in ("read", "recvfrom") and c[2] == fd
        )
        out = frame and _first(
            edge, frame[0], lambda c, fd=req[2]: c[1] in ("write", "sendto") and c[2] == fd
        )
        if not (chunks and sends and frame and out):
            continue
        ms = 1e3
        rows.append(
            {
                "edge: request -> Assign": (assign[0] - req[0]) * ms,
                "hop: Assign -> node": (n_assign[0] - assign[0]) * ms,
                "node: Assign -> backend request": (n_up[0] - n_assign[0]) * ms,
                "hop: node -> sim": (s_req[0] - n_up[0]) * ms,
                "sim: request -> first chunk": (sends[-1][0] - s_req[0]) * ms,
                "hop: sim -> node": (chunks[-1][0] - sends[-1][0]) * ms,
                "node: chunk -> events frame": (n_frame[0] - chunks[-1][0]) * ms,
                "hop: frame -> edge": (frame[0] - n_frame[0]) * ms,
                "edge: frame -> client write": (out[0] - frame[0]) * ms,
                "total: request -> client write": (out[0] - req[0]) * ms,
            }
        )
    return rows


def run_timeline(plat: dict[str, int], url: str, n: int, tokens: int, out_dir: Path) -> None:
    files = {k: out_dir / f"strace-{k}.txt" for k in plat}
    spies = [
        subprocess.Popen(
            ["strace", "-f", "-ttt", "-s", "200", "--seccomp-bpf", "-e",
             "trace=read,write,recvfrom,sendto", "-o", str(files[k]), "-p", str(pid)],
            stderr=subprocess.DEVNULL,
        )
        for k, pid in plat.items()
    ]  # fmt: skip
    time.sleep(2)
    starts: list[float] = []
    ttfts: list[float] = []

    async def go() -> None:
        body = _body(tokens)
        async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
            for _ in range(n):
                await trio.sleep(0.25)
                starts.append(time.time())
                s = await bp.one_request(c, url + "/v1/chat/completions", body, tokens)
                ttfts.append(s.ttft_s * 1e3)

    try:
        trio.run(go)
        time.sleep(0.5)
    finally:
        for s in spies:
            s.send_signal(signal.SIGINT)
            s.wait()
    rows = timeline(files, starts)
    print(f"\ntimeline under strace: {len(rows)} of {n} requests matched; TTFT under strace "
          f"p50 {statistics.median(ttfts):.2f} ms")  # fmt: skip
    if not rows:
        return
    print(f"{'part':34s} {'p50 ms':>8s} {'min ms':>8s}")
    for key in rows[0]:
        vals = [r[key] for r in rows]
        print(f"{key:34s} {statistics.median(vals):8.2f} {min(vals):8.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trees", default=f"this={HERE}", help="NAME=DIR,... source trees")
    ap.add_argument("--n", type=int, default=100, help="rounds (one request per target each)")
    ap.add_argument("--tokens", type=int, default=2, help="chunks per answer, 50 tok/s")
    ap.add_argument("--pause", type=float, default=0.0, help="seconds between requests")
    ap.add_argument("--timeline", type=int, default=0, metavar="N", help="then N under strace")
    ap.add_argument("--out-dir", type=Path, default=HERE / "bench-results")
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.trees.split(","))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.ExitStack() as stack:
        urls: dict[str, str] = {}
        procs: dict[str, dict[str, int]] = {}
        sim_pid = 0
        for i, (name, tree) in enumerate(trees.items()):
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"c1-{name}-")))
            bp.REPO = Path(tree).resolve()  # the children import this tree's iop/
            os.environ["PYTHONPATH"] = str(bp.REPO)
            shapes = ["direct", "split"] if i == 0 else ["split"]
            ns = argparse.Namespace(python=sys.executable, paced_rate=50.0, shape_list=shapes)
            plat = stack.enter_context(bp.running_platform(ns, tmp))
            if i == 0:
                urls["direct"] = plat.gateways["direct"].urls[bp.MODEL_PACED]
                sim_pid = plat.sims["sim_paced"].pid
            urls[name] = plat.gateways["split"].urls[bp.MODEL_PACED]
            procs[name] = {k: p.pid for k, p in plat.gateways["split"].procs.items()}
            print(f"bench: {name} ({tree}) at {urls[name]}", flush=True)
        trio.run(series, urls, 10, args.tokens, args.pause)  # warm-up
        load0 = os.getloadavg()[0]
        busy0, total0 = bp.machine_cpu_s()
        cpu0 = {(t, k): bp.proc_cpu_s(p) for t, d in procs.items() for k, p in d.items()}
        res = trio.run(series, urls, args.n, args.tokens, args.pause)
        busy1, total1 = bp.machine_cpu_s()
        cpu = {
            tk: (bp.proc_cpu_s(procs[tk[0]][tk[1]]) - v) / args.n * 1e3 for tk, v in cpu0.items()
        }
        busy = 100 * (busy1 - busy0) / (total1 - total0) * (os.cpu_count() or 1)
        print(f"\n{args.n} rounds, load average {load0:.2f} -> {os.getloadavg()[0]:.2f}, "
              f"machine busy {busy:.0f} % of a core (every process)")  # fmt: skip
        d = _pcts(res["direct"])
        print(f"{'target':10s} {'p50':>7s} {'p90':>7s} {'p99':>7s}   added p50 / p90 / p99   CPU ms/req edge + node")  # fmt: skip
        for k, v in res.items():
            p = _pcts(v)
            line = f"{k:10s} {p[0]:7.2f} {p[1]:7.2f} {p[2]:7.2f}"
            if k != "direct":
                e, n = cpu[(k, "edge")], cpu[(k, "node")]
                line += f"   {p[0]-d[0]:+6.2f} / {p[1]-d[1]:+6.2f} / {p[2]-d[2]:+6.2f}   {e:.2f} + {n:.2f} = {e+n:.2f}"  # fmt: skip
            print(line)
        if args.timeline:
            first = next(iter(procs))
            run_timeline(
                {**procs[first], "sim": sim_pid},
                urls[first],
                args.timeline,
                args.tokens,
                args.out_dir,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
