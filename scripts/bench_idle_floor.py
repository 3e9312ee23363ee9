"""The floor under an idle node link: what one heartbeat frame costs the edge.

``bench_stress.py --only idle-nodes`` measures the whole edge with 100 idle
nodes. This script measures what is left when IOP is taken away: a server
process runs hypercorn exactly as the edge does (``EdgeASGI`` with a
``LinkEndpoint``, the frame guard, the edge's HTTP/1.1 protocol and stall
guard, ``EdgeConfig()``'s hypercorn config), but its link handler does
nothing but the one operation measured; a client process holds ``--links``
WebSocket links (the node's own ``open_ws_link``), each sending at its own
random phase. The server's CPU (utime + stime, ``getrusage``) over
``--window-s`` once every link is up, divided by the frames moved, is the
cost of one frame; divided by links and seconds, the cost of a node.

Modes, interleaved ``--repeat`` times:

* ``quiet``: links open, nothing sent (what an open connection costs);
* ``in``: every link sends a 12-byte binary message every ``--interval-s``;
  the handler reads it (``AsgiFrameChannel.receive``): hypercorn's read,
  wsproto, its queue to the app, one wake-up of the handler's task;
* ``in-pong``: every link sends an unsolicited WebSocket pong
  (RFC 6455 §5.5.3, "a unidirectional heartbeat") every ``--interval-s``; hypercorn
  reads and parses it and drops it: no task but its reader wakes;
* ``out``: the handler sends a 12-byte binary message every
  ``--interval-s`` (one sleeping task per link, as a scope deadline is):
  a timer, a wake-up, wsproto, hypercorn's send path and the socket write
  (on loopback the write also pays for the peer's receive processing).

Examples:
  python scripts/bench_idle_floor.py                    # 100 links, 3 x 4 modes, ~3 min
  python scripts/bench_idle_floor.py --modes in,out --links 200 --window-s 20
"""

from __future__ import annotations

import argparse
import logging
import random
import resource
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import trio

MODES = ("quiet", "in", "in-pong", "out")
FRAME = b"\x91\x82\xa1t\xa4ping\xa5nonce\x01"  # about the size of a batched ping


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _phase_fn(aligned: bool, interval: float) -> Any:
    """When a link's first frame goes: a random phase, or (aligned) the next
    whole multiple of the interval on this process's clock, the same for all."""
    if not aligned:
        return lambda: random.random() * interval
    return lambda: interval - (trio.current_time() % interval)


async def _serve(mode: str, links: int, interval: float, window: float, aligned: bool) -> None:
    from iop.config import EdgeConfig
    from iop.edge.server._link_asgi import EdgeASGI, LinkEndpoint
    from iop.edge.server._serve import _hypercorn_config
    from iop.edge.server._stall import StallGuard, serve_guarded
    from iop.errors import LinkClosed

    cfg = EdgeConfig()
    phase = _phase_fn(aligned, interval)
    joined = 0
    all_joined = trio.Event()

    async def handle(chan: Any, peer: str = "", *, on_open: Any = None) -> None:
        nonlocal joined
        if on_open is not None:
            on_open(cfg.link_frame_bytes)
        joined += 1
        if joined == links:
            all_joined.set()
        try:
            if mode == "out":
                await trio.sleep(phase())
                while True:
                    await chan.send(FRAME)
                    await trio.sleep(interval)
            else:
                while True:
                    await chan.receive()
        except LinkClosed:
            pass

    hello, queued = cfg.link.max_hello_bytes, cfg.link_queued_bytes
    app = EdgeASGI(http=None, link=LinkEndpoint(handle, hello_limit=hello, max_queued=queued))
    stop = trio.Event()
    hc = _hypercorn_config(cfg, "127.0.0.1:0")
    hc.errorlog = logging.getLogger("bench.hypercorn")
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(serve_guarded, app, hc, StallGuard(30.0), shutdown_trigger=stop.wait)
        )
        print("ws" + str(binds[0])[len("http") :] + "/v1/link", flush=True)
        await all_joined.wait()
        await trio.sleep(2 * interval)  # every link is in its steady state
        cpu0, wall0 = _cpu_s(), time.perf_counter()
        await trio.sleep(window)
        cpu, wall = _cpu_s() - cpu0, time.perf_counter() - wall0
        print(f"{cpu} {wall}", flush=True)
        stop.set()
        nursery.cancel_scope.cancel()


async def _dial(url: str, mode: str, links: int, interval: float, aligned: bool) -> None:
    from iop.node import open_ws_link

    phase = _phase_fn(aligned, interval)

    async def one(task_status: trio.TaskStatus[None]) -> None:
        async with open_ws_link(url) as chan:
            task_status.started()
            ws = chan._ws
            if mode in ("in", "in-pong"):
                await trio.sleep(phase())
                while True:
                    if mode == "in":
                        await chan.send(FRAME)
                    else:
                        await ws.pong(b"")
                    await trio.sleep(interval)
            else:
                while True:
                    await chan.receive()

    async with trio.open_nursery() as nursery:
        for _ in range(links):
            await nursery.start(one)
        # Runs until the server closes or this process is killed.


def _one(args: argparse.Namespace, mode: str) -> dict[str, float]:
    me = [sys.executable, __file__]
    common = ["--links", str(args.links), "--interval-s", str(args.interval_s)]
    common += ["--aligned"] if args.aligned else []
    server = subprocess.Popen(
        [*me, "--serve", mode, *common, "--window-s", str(args.window_s)],
        stdout=subprocess.PIPE,
        text=True,
    )
    client = None
    try:
        assert server.stdout is not None
        url = server.stdout.readline().strip()
        client = subprocess.Popen(
            [*me, "--dial", url, "--mode", mode, *common], stderr=subprocess.DEVNULL
        )
        cpu, wall = map(float, server.stdout.readline().split())
        server.wait(30)
    finally:
        for p in (client, server):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    frames = 0.0 if mode == "quiet" else args.links * wall / args.interval_s
    return {
        "cpu_pct": 100 * cpu / wall,
        "us_per_link_s": 1e6 * cpu / wall / args.links,
        "us_per_frame": 1e6 * cpu / frames if frames else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--links", type=int, default=100, help="links (%(default)s)")
    ap.add_argument(
        "--interval-s", type=float, default=1.0, help="per link, between frames (%(default)s)"
    )
    ap.add_argument("--window-s", type=float, default=15.0, help="CPU window (%(default)s)")
    ap.add_argument(
        "--aligned",
        action="store_true",
        help="every link sends at the same instants (one wake-up for many frames)",
    )
    ap.add_argument("--repeat", type=int, default=3, help="runs per mode (%(default)s)")
    ap.add_argument("--modes", default=",".join(MODES), help="interleaved (%(default)s)")
    ap.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--dial", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        trio.run(_serve, args.serve, args.links, args.interval_s, args.window_s, args.aligned)
        return 0
    if args.dial:
        trio.run(_dial, args.dial, args.mode, args.links, args.interval_s, args.aligned)
        return 0
    modes = args.modes.split(",")
    got: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for i in range(args.repeat):
        for m in modes:
            r = _one(args, m)
            got[m].append(r)
            load = Path("/proc/loadavg").read_text().split()[0]
            print(
                f"run {i + 1} {m:8}: {r['cpu_pct']:5.2f} % of a core, "
                f"{r['us_per_link_s']:6.1f} µs per link-second, "
                f"{r['us_per_frame']:6.1f} µs per frame (load {load})",
                flush=True,
            )
    for m, rs in got.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(
            f"{m:8}: median {med['cpu_pct']:.2f} % of a core, "
            f"{med['us_per_link_s']:.1f} µs per link-second, {med['us_per_frame']:.1f} µs per frame"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
