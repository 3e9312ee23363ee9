"""A mock OpenAI-compatible chat backend inside the benchmark's own process.

``cancel`` and ``memory`` put it behind a node (``openai_compat``
instances, ``mock_instance``) so that the client's close and the backend's
seeing its socket end are timed on one clock (``time.perf_counter``,
CLOCK_MONOTONIC, the clock of the edge's ``time.monotonic()`` too), and so
that an answer can be held at any point of its stream. It is a small trio +
h11 TCP server; what it does with a request is said by the request's
``bench`` object, which edge and node pass through as an unknown key.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import h11
import msgspec
import trio

from iop.bench._client import MAX_HTTP_BYTES, next_event
from iop.bench._procs import Stack, start_edge, start_node, wait_models
from iop.testing import Proc

__all__ = ["BackendTrial", "MockBackend", "MockCluster", "mock_instance", "start_mock_cluster"]

log = logging.getLogger("bench")


@dataclass(eq=False)
class BackendTrial:
    """What the mock backend saw of one request (by its ``bench.trial`` id)."""

    reached: trio.Event = field(default_factory=trio.Event)  # its window is reached
    closed: trio.Event = field(default_factory=trio.Event)  # its socket ended
    arrived_at: float = math.nan
    eof_at: float = math.nan


def _chunk(model: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


class MockBackend:
    """An OpenAI-compatible chat backend in this process (h11 over trio sockets).

    ``GET /v1/models`` lists ``model``. ``POST /v1/chat/completions`` reads
    the request's ``bench`` object (passed through by edge and node as an
    unknown key): ``{"trial": id, "mode": m, "chunks": n}``. Modes:
    ``complete`` answers in full (``chunks`` chunks, or one JSON answer);
    ``head`` sends nothing; ``first`` sends the SSE headers; ``mid`` the
    headers and ``chunks`` chunks; ``idle`` the headers and one chunk;
    ``holder`` the headers and one chunk, then the rest once ``release`` is
    set. Every mode but ``complete`` then waits for the connection to end
    and records when in ``trials[id]``.
    """

    def __init__(self, model: str) -> None:
        self.model = model
        self.trials: dict[str, BackendTrial] = {}
        self.release = trio.Event()
        self.open_streams = 0
        self.requests = 0
        self.errors: Counter[str] = Counter()
        self.port = 0

    def trial(self, tid: str) -> BackendTrial:
        return self.trials.setdefault(tid, BackendTrial())

    async def start(self, nursery: trio.Nursery) -> str:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1", backlog=4096)
        self.port = listeners[0].socket.getsockname()[1]
        nursery.start_soon(trio.serve_listeners, self._handle, listeners)
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HTTP_BYTES)
        try:
            while True:
                req, body = await _read_request(stream, conn)
                if req is None:
                    return
                target = req.target.split(b"?")[0]
                if req.method == b"GET" and target.endswith(b"/models"):
                    models = {"object": "list", "data": [{"id": self.model, "object": "model"}]}
                    await _send_whole(stream, conn, 200, msgspec.json.encode(models))
                elif req.method == b"POST" and target.endswith(b"/chat/completions"):
                    self.requests += 1
                    if not await self._chat(stream, conn, msgspec.json.decode(body)):
                        return
                else:
                    await _send_whole(stream, conn, 404, b'{"error": {"message": "not found"}}')
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the node went away: what the held modes wait for anyway
        except (h11.ProtocolError, msgspec.DecodeError) as exc:
            self.errors[type(exc).__name__] += 1
            log.warning("mock backend: bad request: %r", exc)
        finally:
            stream.socket.close()

    async def _chat(self, stream: trio.SocketStream, conn: h11.Connection, body: Any) -> bool:
        """Answer one chat request; False when the connection must end."""
        bench = body.get("bench") or {}
        mode = bench.get("mode", "complete")
        tid = str(bench.get("trial", ""))
        chunks = int(bench.get("chunks", 8))
        streaming = bool(body.get("stream"))
        model = body.get("model", self.model)
        trial = self.trial(tid) if tid else BackendTrial()
        trial.arrived_at = time.perf_counter()
        if mode == "complete":
            await self._complete(stream, conn, model, streaming, chunks)
            return True
        if mode != "head":
            await _send(stream, conn, _sse_head())
            await _send(stream, conn, h11.Data(data=_chunk(model, {"role": "assistant"})))
            n = {"first": 0, "mid": chunks, "idle": 1, "holder": 1}.get(mode, 0)
            for _ in range(n):
                await _send(stream, conn, h11.Data(data=_chunk(model, {"content": "tok "})))
        trial.reached.set()
        self.open_streams += 1
        try:
            if mode == "holder":
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._until_eof, stream, trial, nursery.cancel_scope)
                    await self.release.wait()
                    await self._finish(stream, conn, model, chunks)
                    nursery.cancel_scope.cancel()
                return False
            await self._until_eof(stream, trial)
            return False
        finally:
            self.open_streams -= 1

    async def _until_eof(
        self, stream: trio.SocketStream, trial: BackendTrial, scope: trio.CancelScope | None = None
    ) -> None:
        try:
            while await stream.receive_some(4096):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # a reset is an end too
        trial.eof_at = time.perf_counter()
        trial.closed.set()
        if scope is not None:
            scope.cancel()

    async def _complete(
        self, stream: trio.SocketStream, conn: h11.Connection, model: str, streaming: bool, n: int
    ) -> None:
        if not streaming:
            answer = {
                "id": "chatcmpl-bench",
                "object": "chat.completion",
                "created": 0,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "tok " * n},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1},
            }
            await _send_whole(stream, conn, 200, msgspec.json.encode(answer))
            return
        await _send(stream, conn, _sse_head())
        await _send(stream, conn, h11.Data(data=_chunk(model, {"role": "assistant"})))
        await self._finish(stream, conn, model, n)

    async def _finish(
        self, stream: trio.SocketStream, conn: h11.Connection, model: str, n: int
    ) -> None:
        data = b"".join(_chunk(model, {"content": "tok "}) for _ in range(n))
        data += _chunk(model, {}, "stop") + b"data: [DONE]\n\n"
        await _send(stream, conn, h11.Data(data=data))
        await _send(stream, conn, h11.EndOfMessage())


def _sse_head() -> h11.Response:
    return h11.Response(
        status_code=200,
        headers=[("content-type", "text/event-stream"), ("transfer-encoding", "chunked")],
    )


async def _send(stream: trio.SocketStream, conn: h11.Connection, event: h11.Event) -> None:
    data = conn.send(event)
    if data:
        await stream.send_all(data)


async def _send_whole(
    stream: trio.SocketStream, conn: h11.Connection, status: int, body: bytes
) -> None:
    head = h11.Response(
        status_code=status,
        headers=[("content-type", "application/json"), ("content-length", str(len(body)))],
    )
    await _send(stream, conn, head)
    await _send(stream, conn, h11.Data(data=body))
    await _send(stream, conn, h11.EndOfMessage())


async def _read_request(
    stream: trio.SocketStream, conn: h11.Connection
) -> tuple[h11.Request | None, bytes]:
    event = await next_event(stream, conn)
    if isinstance(event, h11.ConnectionClosed):
        return None, b""
    if not isinstance(event, h11.Request):
        raise h11.RemoteProtocolError(f"expected a request, got {event!r}")
    req = event
    body = b""
    while True:
        event = await next_event(stream, conn)
        if isinstance(event, h11.Data):
            body += event.data
            if len(body) > MAX_HTTP_BYTES:
                raise h11.RemoteProtocolError("request body too large")
        elif isinstance(event, h11.EndOfMessage):
            return req, body
        else:
            raise h11.RemoteProtocolError(f"unexpected {event!r}")


def mock_instance(name: str, url: str, slots: int, **extra: Any) -> dict[str, Any]:
    """A node's ``openai_compat`` instance on a mock backend at ``url``."""
    return {
        "adapter": "openai_compat",
        "name": name,
        "endpoint": url,
        "max_concurrency": slots,
        **extra,
    }


@dataclass
class MockCluster:
    edge: Proc
    node: Proc
    url: str  # http://host:port
    link: str  # ws://host:port/v1/link

    def pids(self) -> dict[str, int]:
        return {"edge": self.edge.pid, "node": self.node.pid}


async def start_mock_cluster(
    stack: Stack,
    edge_cfg: dict[str, Any],
    instances: list[dict[str, Any]],
    models: set[str],
) -> MockCluster:
    """Edge and node started from a trio task (the mock backends must keep serving)."""
    edge, url, link = await trio.to_thread.run_sync(start_edge, stack, edge_cfg)
    node = await trio.to_thread.run_sync(
        start_node, stack, "node", link, {"probe_interval_s": 30.0}, instances
    )
    await trio.to_thread.run_sync(wait_models, url, models, stack.procs)
    return MockCluster(edge, node, url, link)
