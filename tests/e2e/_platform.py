"""Real IOP processes on loopback for the end-to-end tests (helpers, no fixtures).

Every process is ``python -m iop ...`` started by ``Proc`` (the one process
runner of the tests and of ``scripts/bench_platform.py``, in
``iop/testing/_processes.py``, re-exported here): its stdout and stderr go to
files in the test's log directory (``conftest.py`` prints their tails when a
test fails), and it is stopped by PID (SIGTERM, then SIGKILL).
``Sim``, ``Edge`` and ``Node`` wrap the three kinds of process with what the
tests need: start-up lines parsed for URLs, ``/sim/stats``, ``/admin/nodes``
and ``/readyz`` polling with deadlines, and an ``openai.OpenAI`` client.

Waits poll with a deadline (never a fixed sleep to "wait for" something), and
the only timing assertions are generous upper bounds on liveness.
"""

from __future__ import annotations

import contextlib
import os
import re
import ssl
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx
import openai
import pytest

from iop.testing import (
    EDGE_READY,
    NODE_READY,
    SIM_READY,
    Proc,
    free_port,
    poll,
    toml_dumps,
)
from tests.edge._openai_schema import validate_chunk, validate_completion

__all__ = [
    "LOG_LINE",
    "MODEL",
    "TOKEN",
    "Cluster",
    "Edge",
    "Node",
    "Proc",
    "Procs",
    "Sim",
    "StreamResult",
    "free_port",
    "poll",
    "read_more",
    "read_stream",
    "start_edge",
    "start_node",
    "start_sim",
    "toml_dumps",
    "validated_completion",
]

MODEL: Final = "iop-sim"
# docs/operations.md "Logs": every stderr line is `time level logger: message`.
LOG_LINE: Final = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) +[\w.]+: \S")
TOKEN: Final = "e2e-node-token"


# --- processes -------------------------------------------------------------------------


@contextlib.contextmanager
def _stop_on_error(proc: Proc) -> Iterator[None]:
    """Stop ``proc`` if its start-up check fails: no fixture will own it."""
    try:
        yield
    except BaseException:
        proc.stop()
        raise


# A pooled connection is dropped after this long idle: well inside the edge's
# and the sim's keep-alive timeout (server.keep_alive_timeout_s, 5 s), so the
# client never reuses a connection the server is closing at that moment (a
# request on it fails "Server disconnected without sending a response"; seen
# once, after a 5 s poll, on a busy machine).
KEEPALIVE_EXPIRY_S: Final = 2.0


def _http(base_url: str, verify: ssl.SSLContext | bool = True) -> httpx.Client:
    return httpx.Client(
        base_url=base_url,
        timeout=5.0,
        trust_env=False,
        verify=verify,
        limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S),
    )


# --- the sim ---------------------------------------------------------------------------


@dataclass
class Sim:
    """``iop sim``: the backend in vLLM's wire format, and its ``/sim/stats``."""

    proc: Proc
    url: str  # http://127.0.0.1:PORT (https:// with --tls-certfile)
    verify: ssl.SSLContext | bool = True  # what the test's clients trust (https)
    _client: httpx.Client = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._client = _http(self.url, self.verify)

    def close(self) -> None:
        self._client.close()

    def stats(self) -> dict[str, Any]:
        resp = self._client.get("/sim/stats")
        resp.raise_for_status()
        data: dict[str, Any] = resp.json()
        return data

    def open(self) -> int:
        s = self.stats()
        return int(s["open_streams"]) + int(s["open_completions"])

    def wait_idle(self, timeout: float = 15.0) -> dict[str, Any]:
        """Wait until no generation is open (what earlier tests started has ended)."""
        return poll(
            lambda: (s := self.stats())["open_streams"] == 0 and s["open_completions"] == 0 and s,
            timeout=timeout,
            what="the sim to have no open generation",
        )

    def wait_open(self, n: int = 1, timeout: float = 15.0) -> dict[str, Any]:
        """Wait until at least ``n`` generations are open."""
        return poll(
            lambda: (s := self.stats())["open_streams"] + s["open_completions"] >= n and s,
            timeout=timeout,
            what=f"the sim to have {n} open generation(s)",
        )

    def wait_disconnects(self, more_than: int, timeout: float = 10.0) -> float:
        """Wait until ``client_disconnects`` exceeds ``more_than``; returns the seconds waited."""
        t0 = time.monotonic()
        poll(
            lambda: self.stats()["client_disconnects"] > more_than,
            timeout=timeout,
            what=f"the sim to see its client go away (client_disconnects > {more_than})",
            interval=0.005,
        )
        return time.monotonic() - t0


def start_sim(
    log_dir: Path, name: str = "sim", *flags: str, verify: ssl.SSLContext | bool = True
) -> Sim:
    proc = Proc(name, ["sim", "--port", "0", *flags], log_dir)
    with _stop_on_error(proc):
        m = proc.wait_stdout(SIM_READY)
    return Sim(proc, m.group(1), verify)


# --- the edge --------------------------------------------------------------------------


@dataclass
class Edge:
    """``iop edge``: its URLs, admin and readiness endpoints, and an SDK client."""

    proc: Proc
    url: str  # http://127.0.0.1:PORT
    link_url: str  # ws://127.0.0.1:PORT/v1/link
    api_key: str | None = None  # the first of server.api_keys, if any
    # The first of server.admin_keys, if any: what opens /admin* and /metrics
    # once clients have keys (a client key never does).
    admin_key: str | None = None
    verify: ssl.SSLContext | bool = True  # what the test's clients trust (https)
    _client: httpx.Client = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._client = _http(self.url, self.verify)
        if self.api_key is not None:
            self._client.headers["Authorization"] = f"Bearer {self.api_key}"

    def close(self) -> None:
        self._client.close()

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def get(self, path: str) -> httpx.Response:
        return self._client.get(path)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return self._client.post(path, **kwargs)

    def admin_get(self, path: str) -> httpx.Response:
        """``GET path`` as the operator: with the admin key, if any."""
        headers = {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else None
        return self._client.get(path, headers=headers)

    def admin(self) -> dict[str, Any]:
        resp = self.admin_get("/admin/nodes")
        resp.raise_for_status()
        data: dict[str, Any] = resp.json()
        return data

    def models(self) -> list[str]:
        resp = self.get("/v1/models")
        resp.raise_for_status()
        return [m["id"] for m in resp.json()["data"]]

    def ready_with(self, model: str, node_id: str | None = None) -> bool:
        try:
            if self.get("/readyz").status_code != 200:
                return False
            resp = self.get("/v1/models")
        except httpx.TransportError:
            return False
        for m in resp.json()["data"]:
            if m["id"] == model and (node_id is None or node_id in m["nodes"]):
                return True
        return False

    def wait_ready(
        self, model: str = MODEL, node_id: str | None = None, timeout: float = 20.0
    ) -> None:
        """Wait for ``/readyz`` 200 and ``model`` in ``/v1/models`` (served by ``node_id``)."""
        poll(
            lambda: self.ready_with(model, node_id),
            timeout=timeout,
            what=f"edge {self.url} to be ready with {model!r}"
            + (f" on node {node_id!r}" if node_id else ""),
        )

    def wait_no_runs(self, timeout: float = 10.0) -> dict[str, Any]:
        """Wait until the edge has no run left (in the supervisor or on any node)."""
        return poll(
            lambda: (
                (a := self.admin())["runs"] == [] and all(n["runs"] == [] for n in a["nodes"]) and a
            ),
            timeout=timeout,
            what="the edge to have no runs left",
        )

    def outcome(self, key: str) -> int:
        return int(self.admin()["outcomes"].get(key, 0))

    def openai(self, timeout: float = 30.0) -> openai.OpenAI:
        http_client = None if self.verify is True else httpx.Client(verify=self.verify)
        return openai.OpenAI(
            base_url=f"{self.url}/v1",
            api_key=self.api_key or "x",
            max_retries=0,
            timeout=timeout,
            http_client=http_client,
        )


def _log_flags(log_level: str | None) -> list[str]:
    return ["--log-level", log_level] if log_level else []


def start_edge(
    log_dir: Path,
    config: dict[str, Any],
    *,
    name: str = "edge",
    port: int = 0,
    token: str = TOKEN,
    log_level: str | None = None,
    verify: ssl.SSLContext | bool = True,
) -> Edge:
    """``iop [--log-level L] edge --port PORT --node-token TOKEN --config <config as TOML>``."""
    cfg = log_dir / f"{name}.toml"
    log_dir.mkdir(parents=True, exist_ok=True)
    cfg.write_text(toml_dumps(config))
    proc = Proc(
        name,
        [
            *_log_flags(log_level),
            "edge",
            "--port",
            str(port),
            "--node-token",
            token,
            "--config",
            str(cfg),
        ],
        log_dir,
    )
    with _stop_on_error(proc):
        m = proc.wait_stdout(EDGE_READY)
    server = config.get("server", {})
    keys = server.get("api_keys") or [None]
    admin_keys = server.get("admin_keys") or [None]
    return Edge(proc, m.group(1), m.group(2), keys[0], admin_keys[0], verify)


# --- the node --------------------------------------------------------------------------


@dataclass
class Node:
    proc: Proc
    node_id: str


def start_node(
    log_dir: Path,
    edges: Iterable[str],
    sim_url: str,
    *,
    name: str = "node",
    node_id: str = "n1",
    node: dict[str, Any] | None = None,
    instance: dict[str, Any] | None = None,
    more_instances: Iterable[dict[str, Any]] = (),
    token: str = TOKEN,
    log_level: str | None = None,
    tracing: dict[str, Any] | None = None,
    edge_settings: dict[str, Any] | None = None,
    models: Iterable[dict[str, Any]] = (),
) -> Node:
    """``iop node`` with one vllm instance on ``sim_url`` (and ``more_instances``),
    dialling ``edges`` (link URLs), each entry with ``edge_settings`` (TLS files),
    and on-demand ``models`` (``[[models]]``; ``node`` then sets ``memory_mib``)."""
    config: dict[str, Any] = {
        "node": {
            "id": node_id,
            "reconnect_min_s": 0.1,
            "reconnect_max_s": 1.0,
            **(node or {}),
            "edges": [{"url": url, "token": token, **(edge_settings or {})} for url in edges],
        },
        "instances": [
            {"adapter": "vllm", "name": "vllm-sim", "endpoint": sim_url, **(instance or {})},
            *more_instances,
        ],
    }
    if tracing is not None:
        config["tracing"] = tracing
    if models:
        config["models"] = list(models)
    log_dir.mkdir(parents=True, exist_ok=True)
    cfg = log_dir / f"{name}.toml"
    cfg.write_text(toml_dumps(config))
    proc = Proc(name, [*_log_flags(log_level), "node", "--config", str(cfg)], log_dir)
    with _stop_on_error(proc):
        proc.wait_stdout(NODE_READY)
    return Node(proc, node_id)


# --- the OpenAI SDK side -----------------------------------------------------------------


@dataclass
class StreamResult:
    """A validated streamed answer, as the SDK delivered it."""

    chunks: list[dict[str, Any]]
    content: str
    content_deltas: list[str]
    reasoning: str
    tool_calls: dict[int, dict[str, Any]]
    finish_reason: str | None
    usage: dict[str, Any] | None


# Long streams (thousands of chunks) validate a sample: the first chunks, then
# one in this many, and every chunk that is not a plain content delta.
SAMPLE_AFTER: Final = 64


def _feed(result: StreamResult, chunk: Any, validate_every: int) -> None:
    obj = chunk.to_dict()
    n = len(result.chunks)
    plain = bool(obj["choices"]) and set(obj["choices"][0]["delta"]) == {"content"}
    if validate_every <= 1 or n < SAMPLE_AFTER or n % validate_every == 0 or not plain:
        validate_chunk(obj)
    result.chunks.append(obj)
    if obj.get("usage"):
        result.usage = obj["usage"]
    for choice in obj["choices"]:
        delta = choice.get("delta") or {}
        if delta.get("content"):
            result.content_deltas.append(delta["content"])
            result.content += delta["content"]
        if delta.get("reasoning_content"):
            result.reasoning += delta["reasoning_content"]
        for tc in delta.get("tool_calls") or ():
            acc = result.tool_calls.setdefault(
                tc["index"], {"id": None, "name": None, "arguments": ""}
            )
            acc["id"] = tc.get("id") or acc["id"]
            fn = tc.get("function") or {}
            acc["name"] = fn.get("name") or acc["name"]
            acc["arguments"] += fn.get("arguments") or ""
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]


def read_stream(
    stream: Iterable[Any], *, limit: int | None = None, validate_every: int = 1
) -> StreamResult:
    """Iterate an SDK stream (up to ``limit`` chunks), validating every chunk
    (or a sample, for long streams: ``validate_every``)."""
    return read_more(
        iter(stream), StreamResult([], "", [], "", {}, None, None), limit, validate_every
    )


def read_more(
    stream: Iterator[Any], result: StreamResult, n: int | None = None, validate_every: int = 1
) -> StreamResult:
    """Continue ``result`` with ``n`` more chunks of ``stream`` (all if None)."""
    for i, chunk in enumerate(stream):
        _feed(result, chunk, validate_every)
        if n is not None and i + 1 >= n:
            break
    return result


def validated_completion(completion: Any) -> dict[str, Any]:
    obj: dict[str, Any] = completion.to_dict()
    validate_completion(obj)
    return obj


# --- groups of processes ---------------------------------------------------------------


@dataclass
class Cluster:
    sim: Sim
    edge: Edge
    node: Node


class Procs:
    """Processes owned by one test: started on demand, all stopped at its end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._owned: list[Proc] = []
        self._closers: list[Edge | Sim] = []

    def sim(self, name: str = "sim", *flags: str, verify: ssl.SSLContext | bool = True) -> Sim:
        s = start_sim(self.log_dir, name, *flags, verify=verify)
        self._owned.append(s.proc)
        self._closers.append(s)
        return s

    def edge(
        self, config: dict[str, Any], *, name: str = "edge", port: int = 0, **kwargs: Any
    ) -> Edge:
        e = start_edge(self.log_dir, config, name=name, port=port, **kwargs)
        self._owned.append(e.proc)
        self._closers.append(e)
        return e

    def node(self, edges: list[Edge], sim: Sim, **kwargs: Any) -> Node:
        n = start_node(self.log_dir, [e.link_url for e in edges], sim.url, **kwargs)
        self._owned.append(n.proc)
        return n

    def adopt(self, proc: Proc) -> None:
        """Stop ``proc`` at the test's end too."""
        self._owned.append(proc)

    def adopt_client(self, closer: Edge | Sim) -> None:
        self._closers.append(closer)

    def stop_all(self) -> None:
        for c in self._closers:
            c.close()
        # Nodes first (they were started last), then edges, then backends.
        for proc in reversed(self._owned):
            proc.stop()


def require_real_backend() -> None:
    """Skip the test when the real llama.cpp backend cannot run here; fail it
    instead under ``IOP_REQUIRE_REAL_BACKEND=1`` (scripts/check.sh sets it)."""
    from iop.managed import llamacpp_available

    reason = llamacpp_available()
    if reason is None:
        return
    if os.environ.get("IOP_REQUIRE_REAL_BACKEND") == "1":
        pytest.fail(
            f"IOP_REQUIRE_REAL_BACKEND=1 but the real llama.cpp backend cannot run: {reason}",
            pytrace=False,
        )
    pytest.skip(f"real llama.cpp backend unavailable: {reason}")
