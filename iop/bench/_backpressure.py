"""What the backpressure runners share: a sim + edge + node stack, slow and fast clients.

Used by ``iop.bench._slow_reader``, ``_credit_window``, ``_channel_capacity``
and ``_hol`` (docs/research.md, sections 1 and 3). A ``Stack`` starts
``iop sim``, ``iop edge`` and ``iop node`` with ``iop.testing.Proc`` (logs in
the run's directory) and stops them all by PID, last started first, also on
error. The clients speak HTTP/1.1 over trio sockets, so a slow reader really
stops reading (its receive buffer set small before it connects: the kernel
then holds a few KiB for it, not megabytes) and a fast one times its first
content byte and its end.

Nothing here asserts a time: it measures. Every figure is taken on a 2-core
machine shared with other work, so each window also says how much CPU no
process of the run used (``foreign_cpu_pct_of_core``).
"""

from __future__ import annotations

import re
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx
import msgspec
import trio

from iop.bench._stress import CpuWindow, rss_kb
from iop.testing import EDGE_READY, SIM_READY, Proc, free_port, poll, toml_dumps

__all__ = [
    "MODEL",
    "CpuWindow",
    "FastResult",
    "Stack",
    "fast_stream",
    "median",
    "rss_kb",
    "sim_stats",
    "slow_reader",
]

NODE_TOKEN: Final = "bench-token"
MODEL: Final = "iop-sim"
# The slow client's receive buffer: the kernel doubles it (socket(7)); a few
# KiB, so that the edge's writes block after a few dozen chunks, not after
# the megabytes loopback autotuning would grant.
SLOW_RCVBUF: Final = 4096
_CONTENT: Final = re.compile(rb'"content":"[^"]')


def median(values: list[float]) -> float | None:
    vals = sorted(v for v in values if v == v)
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


class Stack:
    """``iop sim`` + ``iop edge`` + ``iop node``, stopped by PID (``close``)."""

    def __init__(self, python: str, logdir: Path) -> None:
        self.python = python
        self.logdir = logdir
        self.procs: list[Proc] = []
        self.sim_url = ""
        self.url = ""
        self.host = ""
        self.port = 0
        self.pids: dict[str, int] = {}

    def _launch(self, name: str, *args: str) -> Proc:
        p = Proc(name, list(args), self.logdir, python=self.python)
        self.procs.append(p)
        return p

    def start(
        self,
        *,
        edge: dict[str, Any],
        node: dict[str, Any],
        slots: int,
        sim_flags: list[str],
    ) -> None:
        """Start sim and edge at once (each on a port chosen here), the node
        once the sim listens (it dials the edge until it listens, but probes
        the sim once and then only every ``probe_interval_s``: started
        before the sim listens, it would wait that long to use it), then wait
        until the edge serves the sim's model."""
        sim_port, edge_port = free_port(), free_port()
        self.sim_url = f"http://127.0.0.1:{sim_port}"
        self.url = f"http://127.0.0.1:{edge_port}"
        self.host, self.port = "127.0.0.1", edge_port
        sim = self._launch("sim", "sim", "--port", str(sim_port), "--model", MODEL, *sim_flags)
        path = self.logdir / "edge.toml"
        path.write_text(toml_dumps(edge))
        e = self._launch(
            "edge",
            "edge",
            "--port",
            str(edge_port),
            "--node-token",
            NODE_TOKEN,
            "--config",
            str(path),
        )
        node_cfg = {
            "node": {
                "id": "node",
                "probe_interval_s": 30.0,
                "reconnect_min_s": 0.1,
                "reconnect_max_s": 0.5,
                **node,
                "edges": [{"url": f"ws://127.0.0.1:{edge_port}/v1/link", "token": NODE_TOKEN}],
            },
            "instances": [
                {
                    "adapter": "vllm",
                    "name": "sim",
                    "endpoint": self.sim_url,
                    "max_concurrency": slots,
                }
            ],
        }
        path = self.logdir / "node.toml"
        path.write_text(toml_dumps(node_cfg))
        sim.wait_stdout(SIM_READY)
        n = self._launch("node", "node", "--config", str(path))
        self.pids = {"edge": e.pid, "node": n.pid, "sim": sim.pid}
        e.wait_stdout(EDGE_READY)

        def ready() -> bool:
            for p in self.procs:
                if not p.alive:
                    raise AssertionError(f"{p.name} exited during start-up\n{p.logs()}")
            try:
                with httpx.Client(timeout=2, trust_env=False) as c:
                    models = c.get(self.url + "/v1/models").json()["data"]
            except (httpx.HTTPError, ValueError, KeyError):
                return False
            return any(m["id"] == MODEL for m in models)

        poll(ready, timeout=60, what="the edge to serve the sim's model", interval=0.05)

    def rss(self) -> dict[str, int]:
        return {k: rss_kb(p) for k, p in self.pids.items()}

    def close(self) -> None:
        for p in self.procs:
            p.send(signal.SIGTERM)  # all drain at once; stop() below reaps each
        for p in reversed(self.procs):
            try:
                p.stop()
            except Exception as exc:  # keep stopping the others
                print(f"bench: stopping {p.name}: {exc!r}")


@contextmanager
def stack(python: str, logdir: Path) -> Iterator[Stack]:
    s = Stack(python, logdir)
    try:
        yield s
    finally:
        s.close()


class _SimStats(msgspec.Struct):
    open_streams: int = 0
    streams_opened: int = 0
    client_disconnects: int = 0


async def sim_stats(client: httpx.AsyncClient, sim_url: str) -> _SimStats:
    r = await client.get(sim_url + "/sim/stats")
    return msgspec.json.decode(r.content, type=_SimStats)


def _request(host: str, port: int, max_tokens: int) -> bytes:
    body = msgspec.json.encode(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "stream": True,
            "max_tokens": max_tokens,
            # The sim's answer length for this request only: it generates a
            # whole answer's words before it streams, so a server default as
            # long as the slow readers' answers would cost every short
            # request that CPU too (iop/sim/_script.py).
            "iop_sim": {"output_tokens": max_tokens},
        }
    )
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


async def _connect(host: str, port: int, rcvbuf: int | None = None) -> trio.SocketStream:
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect((host, port))
    return trio.SocketStream(sock)


async def slow_reader(
    host: str,
    port: int,
    max_tokens: int,
    *,
    read_bytes_per_s: float,
    hold_s: float,
    first_bytes: trio.Event | None = None,
) -> int:
    """Stream ``max_tokens`` and read them slowly (0: not at all after the
    first bytes) for ``hold_s``, then hang up; returns the bytes read."""
    stream = await _connect(host, port, SLOW_RCVBUF)
    got = 0
    try:
        await stream.send_all(_request(host, port, max_tokens))
        got = len(await stream.receive_some(1024))
        if first_bytes is not None:
            first_bytes.set()
        end = trio.current_time() + hold_s
        if read_bytes_per_s <= 0:
            await trio.sleep_until(end)
            return got
        step = 1024 / read_bytes_per_s
        while trio.current_time() < end:
            await trio.sleep(step)
            data = await stream.receive_some(1024)
            if not data:
                break
            got += len(data)
        return got
    finally:
        # RST, not FIN: a client that goes away (its process ended), with
        # unread data in its buffer, which Linux resets anyway.
        with trio.move_on_after(1):
            await stream.aclose()


@dataclass
class FastResult:
    ttft_s: float | None
    total_s: float
    events: int
    ok: bool


async def fast_stream(host: str, port: int, max_tokens: int) -> FastResult:
    """Stream ``max_tokens`` as fast as we can read; time the first content and the end."""
    t0 = trio.current_time()
    ttft: float | None = None
    events = 0
    tail = b""
    stream = await _connect(host, port)
    async with stream:
        await stream.send_all(_request(host, port, max_tokens))
        while True:
            data = await stream.receive_some(65536)
            if not data:
                break
            if ttft is None and _CONTENT.search(tail + data):
                ttft = trio.current_time() - t0
            events += data.count(b"data: ")
            tail = data[-64:]
    return FastResult(ttft, trio.current_time() - t0, events, b"[DONE]" in tail)
