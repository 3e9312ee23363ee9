"""The stack the backpressure runners share: ``iop sim`` + ``iop edge`` + ``iop node``.

Used by ``iop.bench._slow_reader``, ``_credit_window``, ``_channel_capacity``
and ``_hol`` (docs/research.md, sections 1 and 3). A ``Stack`` starts the
three on ports chosen up front, so that sim and edge start at once, and
stops them all by PID (``iop.bench._procs.Stack``), also on error. Their
clients, slow and fast readers on bare sockets, are
``iop.bench._client.slow_reader`` and ``fast_stream``.

Nothing here asserts a time: it measures. Every figure is taken on a 2-core
machine shared with other work, so each window also says how much CPU no
process of the run used (``iop.bench._procs.CpuWindow``).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import httpx
import msgspec

from iop.bench import _procs
from iop.bench._client import SIM_MODEL
from iop.bench._procs import NODE_TOKEN, rss_kb
from iop.testing import EDGE_READY, SIM_READY, free_port, poll, toml_dumps

__all__ = ["MODEL", "Stack", "sim_stats", "stack"]

MODEL: Final = SIM_MODEL


class Stack(_procs.Stack):
    """``iop sim`` + ``iop edge`` + ``iop node``, stopped by PID (``close``)."""

    def __init__(self, python: str, logdir: Path) -> None:
        super().__init__(python, logdir)
        self.sim_url = ""
        self.url = ""
        self.host = ""
        self.port = 0
        self.pids: dict[str, int] = {}

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
        sim = self.launch("sim", "sim", "--port", str(sim_port), "--model", MODEL, *sim_flags)
        path = self.logdir / "edge.toml"
        path.write_text(toml_dumps(edge))
        e = self.launch(
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
        n = self.launch("node", "node", "--config", str(path))
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
            p.send(signal.SIGTERM)  # all drain at once; stop_all() reaps each
        self.stop_all()


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
