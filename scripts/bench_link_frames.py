"""The edge's CPU per node-link frame: the ASGI link transport against quart's.

The full platform benchmark (``scripts/bench_platform.py``) spends most of the
edge's CPU on HTTP and SSE, and on a shared 2-core box its noise (±20 %) hides
a few microseconds per frame. This one measures only the link's transport:
a server process runs hypercorn with the edge's config and one handler that
reads frames (answering every 8th with a 24-byte frame, as the edge returns
credit); a client process (the node's own ``open_ws_link``) sends them. The
server reports its own CPU time (utime + stime) from the first frame to the
last, divided by the frames.

Two transports, interleaved ``--repeat`` times:

* ``asgi``: ``iop.edge.server._link_asgi`` (``EdgeASGI`` + ``LinkEndpoint``), what the
  edge serves;
* ``quart``: the quart-trio websocket route the edge used before it (a
  ``FrameChannel`` over quart's ``websocket`` object, the frame guard as an
  ASGI middleware), kept here as the reference.

Both have the frame guard installed (limits, no deflate).

Examples:
  python scripts/bench_link_frames.py                       # 3 x 20,000 frames of 300 bytes
  python scripts/bench_link_frames.py --frames 50000 --size 2000 --repeat 5
"""

from __future__ import annotations

import argparse
import logging
import resource
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import trio

CREDIT_EVERY = 8  # a frame back per this many, like the edge's credit


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _quart_app(handle: Any, hello_limit: int, max_queued: int) -> Any:
    """The link as quart served it: a websocket route, the guard as middleware."""
    from quart import websocket
    from quart_trio import QuartTrio

    from iop.edge.server._link_guard import LinkFrameGuard, LinkFrameLimits
    from iop.errors import LinkLimitError
    from iop.protocol import CLOSE_RATE, CLOSE_TOO_BIG, LinkClosed

    class QuartChannel:
        def __init__(self, limits: LinkFrameLimits | None) -> None:
            self._limits = limits
            self._closed = False

        async def send(self, frame: bytes) -> None:
            await websocket.send(frame)

        async def receive(self) -> bytes:
            limits = self._limits
            data: bytes | str | None = None
            with trio.CancelScope() as scope:
                if limits is not None:
                    if limits.tripped:
                        scope.cancel()
                    limits.waiting(scope)
                try:
                    data = await websocket.receive()
                finally:
                    if limits is not None:
                        limits.waiting(None)
            if limits is not None:
                if data is not None:
                    limits.consumed(len(data))
                if limits.oversize is not None:
                    raise LinkClosed("too big", close_code=CLOSE_TOO_BIG)
                if limits.overqueued:
                    raise LinkLimitError("queued", close_code=CLOSE_RATE)
            assert isinstance(data, bytes)
            return data

        async def aclose(self, code: int = 1000, reason: str = "") -> None:
            if not self._closed:
                self._closed = True
                await websocket.close(code, reason)

    app = QuartTrio("bench")
    guard = LinkFrameGuard(hello_limit=hello_limit, max_queued=max_queued)

    @app.websocket("/v1/link")
    async def link() -> None:
        limits = websocket.scope.get("iop.link_limits")
        await websocket.accept()
        await handle(QuartChannel(limits), on_open=None if limits is None else limits.open)

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            scope = {**scope, "iop.link_limits": guard.install(scope, send)}
        await app(scope, receive, send)

    return guarded


async def _serve(transport: str, frames: int) -> None:
    from iop.config import EdgeConfig
    from iop.edge.server._link_asgi import EdgeASGI, LinkEndpoint
    from iop.edge.server._serve import _hypercorn_config
    from iop.edge.server._stall import StallGuard, serve_guarded

    cfg = EdgeConfig()
    done = trio.Event()
    result: list[float] = []

    async def handle(chan: Any, peer: str = "", *, on_open: Any = None) -> None:
        if on_open is not None:
            on_open(cfg.link_frame_bytes)
        await chan.receive()
        cpu0, wall0 = _cpu_s(), time.perf_counter()
        for i in range(1, frames):
            await chan.receive()
            if i % CREDIT_EVERY == 0:
                await chan.send(b"c" * 24)
        result[:] = [_cpu_s() - cpu0, time.perf_counter() - wall0]
        await chan.send(b"done")
        await chan.aclose()
        done.set()

    hello, queued = cfg.link.max_hello_bytes, cfg.link_queued_bytes
    if transport == "asgi":
        app: Any = EdgeASGI(
            http=None, link=LinkEndpoint(handle, hello_limit=hello, max_queued=queued)
        )
    else:
        app = _quart_app(handle, hello, queued)
    stop = trio.Event()
    hc = _hypercorn_config(cfg, "127.0.0.1:0")
    hc.errorlog = logging.getLogger("bench.hypercorn")
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(serve_guarded, app, hc, StallGuard(30.0), shutdown_trigger=stop.wait)
        )
        print("ws" + str(binds[0])[len("http") :] + "/v1/link", flush=True)
        await done.wait()
        print(f"{result[0] / (frames - 1) * 1e6:.2f} {result[1]:.2f}", flush=True)
        stop.set()


async def _send(url: str, frames: int, size: int) -> None:
    from iop.node import open_ws_link

    frame = b"x" * size
    async with open_ws_link(url) as chan, trio.open_nursery() as nursery:

        async def read() -> None:
            while await chan.receive() != b"done":
                pass

        nursery.start_soon(read)
        for _ in range(frames):
            await chan.send(frame)


def _one(python: str, transport: str, frames: int, size: int) -> tuple[float, float]:
    """One server process and one client process; (µs CPU per frame, wall s)."""
    me = [python, __file__]
    server = subprocess.Popen(
        [*me, "--serve", transport, "--frames", str(frames)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        url = server.stdout.readline().strip()
        subprocess.run(
            [*me, "--dial", url, "--frames", str(frames), "--size", str(size)],
            check=True,
            timeout=600,
        )
        us, wall = server.stdout.readline().split()
        server.wait(30)
        return float(us), float(wall)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--frames", type=int, default=20_000, help="frames per run (%(default)s)")
    ap.add_argument("--size", type=int, default=300, help="bytes per frame (%(default)s)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per transport (%(default)s)")
    ap.add_argument(
        "--transports", default="asgi,quart", help="comma-separated, interleaved (%(default)s)"
    )
    ap.add_argument("--serve", choices=["asgi", "quart"], help=argparse.SUPPRESS)
    ap.add_argument("--dial", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        trio.run(_serve, args.serve, args.frames)
        return 0
    if args.dial:
        trio.run(_send, args.dial, args.frames, args.size)
        return 0
    transports = args.transports.split(",")
    got: dict[str, list[float]] = {t: [] for t in transports}
    for i in range(args.repeat):
        for t in transports:
            us, wall = _one(sys.executable, t, args.frames, args.size)
            got[t].append(us)
            load = Path("/proc/loadavg").read_text().split()[0]
            print(f"run {i + 1} {t:5}: {us:6.1f} µs CPU per frame ({wall:.1f} s, load {load})")
    for t, values in got.items():
        print(f"{t:5}: median {statistics.median(values):.1f} µs CPU per frame, runs {values}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
