"""The platform in one trio run, in memory, for virtual-time tests.

``open_virtual_platform`` wires the real parts together with no socket: the
edge's core and its HTTP app (``open_edge_core``, ``create_edge_app``), a real
``NodeAgent`` whose ``vllm`` adapter talks to a ``FakeTransport`` (scripted
replies, in memory), and between them ``memory_link_pair()`` for the link.
The client is httpx over ``ASGIStreamTransport``, which runs the edge's ASGI
app per request and streams its body as it is sent (httpx's own
``ASGITransport`` buffers a whole response, so it cannot show a stream
stall, nor hang up mid-stream).

Nothing here sleeps on the wall clock: under trio's ``MockClock`` with
``autojump_threshold=0`` (pytest-trio's ``autojump_clock``, or
``run_virtual``) a 60 s idle deadline passes in no wall time, so deadline
and stall tests are instant and exact. What a socket would add (hypercorn,
the WebSocket, the edge's write-stall guard, the node's connection pool) is
not here: the loopback platform (``iop.testing._platform``) has it.

Leaks are trio tasks: ``task_count()`` walks the run's task tree, and
``assert_no_leaks`` waits (in virtual time) until it is back to the mark's.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Final, TypeVar, cast

import httpx
import msgspec
import trio

from iop.adapters import build_adapter
from iop.config import EdgeConfig, NodeConfig, NodeEdge, VllmInstance, decode_config
from iop.edge import EdgeCore, create_edge_app, open_edge_core
from iop.errors import LinkError
from iop.node import open_node_agent
from iop.testing._fake_backend import (
    CHAT_COMPLETIONS_PATH,
    MODELS_PATH,
    FakeTransport,
    Reply,
    TransportResponse,
)
from iop.testing._faults import Fault, synthetic_stream
from iop.testing._memory_link import memory_link_pair
from iop.testing._platform import FAKE_MODEL, NODE_TOKEN
from iop.testing._replay_server import DEFAULT_TRANSCRIPT
from iop.testing._streams import ClientStream, StreamEnd, assert_one_terminal, chat_body
from iop.testing._transcripts import transcript_body

__all__ = [
    "ASGIStreamTransport",
    "VirtualMark",
    "VirtualPlatform",
    "open_virtual_platform",
    "run_virtual",
    "task_count",
]

T = TypeVar("T")

log = logging.getLogger("iop.testing.virtual")

# Response body messages buffered between the app and the client: 0, as a
# socket with a full buffer: the app's ``send`` waits for the client's read,
# so a client that stops reading holds the edge (credit does the rest).
BODY_BUFFER: Final = 0
# A platform's facts settle this long after what caused them (virtual time:
# costs nothing; long enough for the edge's own deadlines to play out).
SETTLE_TIMEOUT_S: Final = 600.0
# Closing: how long the links may take to end after the node's drain.
CLOSE_TIMEOUT_S: Final = 5.0
# _poll: the waits marked so poll, in virtual time,
# where a poll costs no wall time, for facts that have no event to wait on
# (a task count, a record's field, the registry).
# The base URL of the fake backend (never resolved: the transport is in memory).
_BACKEND_URL: Final = "http://backend.invalid"


def task_count() -> int:
    """Tasks alive in the current trio run (the whole tree from the root)."""
    count = 0
    root = trio.lowlevel.current_root_task()
    assert root is not None  # inside a trio run
    stack = [root]
    while stack:
        task = stack.pop()
        count += 1
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return count


class _ASGIBody(httpx.AsyncByteStream):
    """The app's body pieces as they come; closing it tells the app the client left."""

    def __init__(self, pieces: trio.MemoryReceiveChannel[bytes], gone: trio.Event) -> None:
        self._pieces = pieces
        self._gone = gone

    def __aiter__(self) -> _ASGIBody:
        # A class, not an async generator: a stream left early leaves nothing
        # for the garbage collector to finalise.
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._pieces.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        self._gone.set()
        await self._pieces.aclose()


class ASGIStreamTransport(httpx.AsyncBaseTransport):
    """An httpx transport into an ASGI app, streaming (see the module doc).

    Each request's app call is a task in ``nursery``; the response returns
    once the app sent its head, and its body streams from the app's sends.
    Closing the response early sends ``http.disconnect`` to the app.
    """

    def __init__(self, app: Callable[..., Awaitable[None]], nursery: trio.Nursery) -> None:
        self._app = app
        self._nursery = nursery

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": request.url.scheme,
            "path": request.url.path,
            "raw_path": request.url.raw_path.split(b"?")[0],
            "query_string": request.url.query,
            "root_path": "",
            "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "client": ("127.0.0.1", 1),
            "server": (request.url.host, request.url.port or 80),
        }
        send_piece, pieces = trio.open_memory_channel[bytes](BODY_BUFFER)
        gone = trio.Event()
        head: dict[str, Any] = {}
        started = trio.Event()
        request_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal request_sent
            if not request_sent:
                request_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                head.update(message)
                started.set()
            elif message["type"] == "http.response.body":
                data = message.get("body", b"")
                if data and not gone.is_set():
                    try:
                        await send_piece.send(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        gone.set()
                if not message.get("more_body", False):
                    send_piece.close()

        async def run_app() -> None:
            async with send_piece:
                try:
                    await self._app(scope, receive, send)
                finally:
                    started.set()

        self._nursery.start_soon(run_app)
        await started.wait()
        if not head:
            raise httpx.RemoteProtocolError("the app ended without a response", request=request)
        return httpx.Response(
            head["status"],
            headers=[(k, v) for k, v in head.get("headers", [])],
            stream=_ASGIBody(pieces, gone),
            request=request,
        )


@dataclass(frozen=True)
class VirtualMark:
    """The virtual platform's counters at one moment.

    Attributes:
        at: ``trio.current_time()`` when taken.
        outcomes: The edge's ended runs by outcome.
        tasks: Tasks alive in the run.
        responses: Responses the fake backend had returned.
    """

    at: float
    outcomes: dict[str, int]
    tasks: int
    responses: int


class VirtualPlatform:
    """Edge core + app, node agent and fake backend in one trio run (see the module doc).

    Attributes:
        core: The edge's core (registry, scheduler, runs, metrics).
        backend: The fake backend (``FakeTransport``): script it directly, or
            with ``replay``.
        model: The model served.
        client: An ``httpx.AsyncClient`` on the edge's app (base URL
            ``http://edge``).
        test_mark: The mark the assertions count from by default.
    """

    def __init__(
        self, core: EdgeCore, backend: FakeTransport, model: str, client: httpx.AsyncClient
    ) -> None:
        self.core = core
        self.backend = backend
        self.model = model
        self.client = client
        self.test_mark: VirtualMark | None = None

    def replay(
        self,
        transcript: str | bytes = DEFAULT_TRANSCRIPT,
        fault: Fault | None = None,
        *,
        times: int = 1,
    ) -> None:
        """Answer the next ``times`` chat requests with a transcript (name or body) and a fault."""
        body = transcript if isinstance(transcript, bytes) else transcript_body(transcript)
        reply = (fault or Fault.none()).reply(body)
        self.backend.script(CHAT_COMPLETIONS_PATH, *[reply] * times)

    def replay_stream(self, chunks: int, fault: Fault | None = None, *, times: int = 1) -> None:
        """Answer the next chat requests with a synthetic stream of ``chunks`` content chunks."""
        self.replay(synthetic_stream(chunks, model=self.model), fault, times=times)

    def chat_body(
        self, prompt: str = "Hello!", *, stream: bool = True, **body: Any
    ) -> dict[str, Any]:
        """A Chat Completions body for the platform's model."""
        return chat_body(self.model, prompt, stream=stream, **body)

    async def stream_chat(
        self,
        prompt: str = "Hello!",
        *,
        hang_up_after: int | None = None,
        read_delay_s: float = 0.0,
        **body: Any,
    ) -> ClientStream:
        """Stream one answer into a ``ClientStream`` (as ``LoopbackPlatform.stream_chat``)."""
        stream = ClientStream(started_at=trio.current_time())
        try:
            async with self.client.stream(
                "POST", "/v1/chat/completions", json=self.chat_body(prompt, **body)
            ) as resp:
                stream.status = resp.status_code
                if not resp.headers.get("content-type", "").startswith("text/event-stream"):
                    stream.feed_body(await resp.aread())
                else:
                    # httpx's aiter_raw is an async generator over another one:
                    # leaving it early would leave both to the garbage collector.
                    assert isinstance(resp.stream, httpx.AsyncByteStream)
                    pieces = cast(AsyncGenerator[bytes, None], resp.stream.__aiter__())
                    async with aclosing(pieces):
                        async for data in pieces:
                            if stream.take(data, hang_up_after, at=trio.current_time()):
                                break
                            if read_delay_s > 0:
                                await trio.sleep(read_delay_s)
        except httpx.TransportError as exc:
            stream.finish(StreamEnd.TRANSPORT_ERROR, at=trio.current_time(), error=repr(exc))
        stream.finish(StreamEnd.CLOSED, at=trio.current_time())
        return stream

    def outcomes(self) -> dict[str, int]:
        """The edge's ended runs by outcome."""
        return self.core.metrics.outcomes()

    def mark(self) -> VirtualMark:
        """The counters now."""
        return VirtualMark(
            trio.current_time(), self.outcomes(), task_count(), len(self.backend.responses)
        )

    def _since(self, since: VirtualMark | None) -> VirtualMark:
        mark = since or self.test_mark
        if mark is None:
            raise ValueError("no mark: pass since=platform.mark() taken before the run")
        return mark

    def outcomes_since(self, since: VirtualMark | None = None) -> dict[str, int]:
        """Runs ended since ``since`` (default ``test_mark``), by outcome."""
        base = self._since(since).outcomes
        return {k: v - base.get(k, 0) for k, v in self.outcomes().items() if v - base.get(k, 0)}

    async def wait_idle(self, within_s: float = SETTLE_TIMEOUT_S) -> None:
        """Wait (virtual time) until the edge has no run."""
        with trio.fail_after(within_s):
            await self.core.supervisor.wait_idle()

    async def assert_one_terminal(
        self, stream: ClientStream, *, kind: str | None = None, since: VirtualMark | None = None
    ) -> str:
        """One terminal event on the client's stream, and exactly one run ended on the edge."""
        __tracebackhide__ = True  # pytest: show the caller's line
        name = assert_one_terminal(stream, kind=kind)
        mark = self._since(since)
        await self.wait_idle()
        ended = self.outcomes_since(mark)
        if sum(ended.values()) != 1:
            raise AssertionError(f"expected exactly one run to end on the edge, outcomes: {ended}")
        return name

    async def assert_backend_closed_within(
        self,
        ms: float,
        *,
        after: float | None = None,
        since: VirtualMark | None = None,
        by_client: bool = True,
    ) -> TransportResponse:
        """The backend's response was closed within ``ms`` virtual milliseconds of ``after``
        (default: when the last request since the mark arrived)."""
        __tracebackhide__ = True  # pytest: show the caller's line
        mark = self._since(since)
        responses = self.backend.responses[mark.responses :]
        chats = [r for r in responses if r.request.path == CHAT_COMPLETIONS_PATH]
        if not chats:
            raise AssertionError("the backend received no chat request since the mark")
        record = chats[-1]
        start = record.request.received_at if after is None else after
        deadline = start + ms / 1000.0
        with trio.move_on_at(deadline + 1e-9):
            while record.closed_at is None:  # noqa: ASYNC110 (_poll)
                await trio.sleep(min(0.001, max(deadline - trio.current_time(), 0)) or 0.001)
        if record.closed_at is None or record.closed_at - start > ms / 1000.0:
            raise AssertionError(
                f"the backend's response was still open {ms:g} ms (virtual) after the start"
            )
        if by_client and not record.closed_by_client:
            raise AssertionError("the backend ended its response itself; the node did not close it")
        return record

    async def assert_no_leaks(
        self, *, since: VirtualMark | None = None, within_s: float = SETTLE_TIMEOUT_S
    ) -> None:
        """No run left and the run's task count back to the mark's, within ``within_s`` (virtual)."""
        __tracebackhide__ = True  # pytest: show the caller's line
        mark = self._since(since)
        with trio.move_on_after(within_s):
            while self.core.supervisor.runs or task_count() > mark.tasks:  # noqa: ASYNC110 (_poll)
                await trio.sleep(0.01)
            return
        raise AssertionError(
            f"leaked: {task_count()} tasks alive, {mark.tasks} at the mark; "
            f"runs on the edge: {sorted(self.core.supervisor.runs)}"
        )


def _edge_config(extra: Mapping[str, Any] | None) -> EdgeConfig:
    data: dict[str, Any] = {"link": {"node_tokens": [NODE_TOKEN]}}
    for key, value in (extra or {}).items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, Mapping) else value
    return decode_config(data, EdgeConfig, source="edge_config")


@asynccontextmanager
async def open_virtual_platform(
    *,
    model: str = FAKE_MODEL,
    edge_config: Mapping[str, Any] | None = None,
    instance: Mapping[str, Any] | None = None,
) -> AsyncIterator[VirtualPlatform]:
    """Edge, node and fake backend in this trio run, ready to serve ``model``.

    Args:
        model: The model the fake backend lists.
        edge_config: Edge config (TOML keys as dicts: ``{"deadlines":
            {"idle_timeout_s": 5}}``).
        instance: Keys of the node's ``vllm`` instance (``max_concurrency``...).
    """
    backend = FakeTransport()
    backend.route(
        MODELS_PATH, Reply.json({"object": "list", "data": [{"id": model, "object": "model"}]})
    )
    backend.route(CHAT_COMPLETIONS_PATH, Reply.sse(transcript_body(DEFAULT_TRANSCRIPT)))
    inst = msgspec.convert(
        {"adapter": "vllm", "name": "backend", "endpoint": _BACKEND_URL, **(instance or {})},
        VllmInstance,
    )
    edge = NodeEdge(url="ws://edge.invalid/v1/link", token=NODE_TOKEN)
    node_cfg = msgspec.convert(
        {
            "node": {"id": "iop-virtual-node", "edges": [msgspec.to_builtins(edge)]},
            "instances": [msgspec.to_builtins(inst)],
        },
        NodeConfig,
    )
    adapter = build_adapter(inst, transport=backend)
    async with (
        open_edge_core(_edge_config(edge_config)) as core,
        open_node_agent(node_cfg, adapters={"backend": adapter}) as agent,
        trio.open_nursery() as nursery,
    ):
        edge_end, node_end = memory_link_pair()
        nursery.start_soon(core.handle_link, edge_end, "memory")

        node_done = trio.Event()

        async def serve_node() -> None:
            try:
                await agent.serve_link(node_end, edge=edge)
            except* LinkError:
                log.debug("virtual platform: the link closed")
            finally:
                node_done.set()

        nursery.start_soon(serve_node)
        with trio.fail_after(SETTLE_TIMEOUT_S):
            while not any(  # noqa: ASYNC110 (_poll)
                model in i.caps.targets
                for n in core.registry.nodes.values()
                for i in n.instances.values()
            ):
                await trio.sleep(0.01)
        transport = ASGIStreamTransport(create_edge_app(core), nursery)
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            yield VirtualPlatform(core, backend, model, client)
        # The node drains, as a stopping node does: goodbye, then the link
        # closes cleanly (runs still going are cancelled with ``shutdown``).
        await agent.drain(0)
        with trio.move_on_after(CLOSE_TIMEOUT_S):
            await node_done.wait()
            while core.registry.nodes:  # noqa: ASYNC110 (_poll)
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    await adapter.aclose()


def run_virtual(scenario: Callable[[VirtualPlatform], Awaitable[T]], **options: Any) -> T:
    """Run ``await scenario(platform)`` in a new trio run under ``MockClock(autojump_threshold=0)``.

    For sync tests (no pytest-trio needed); ``options`` go to ``open_virtual_platform``.
    """

    async def main() -> T:
        async with open_virtual_platform(**options) as platform:
            platform.test_mark = platform.mark()
            return await scenario(platform)

    # Here, not at the top: trio.testing imports pytest when it can, and
    # importing iop.testing must not (tests/plugin/test_plugin.py).
    from trio.testing import MockClock

    return trio.run(main, clock=MockClock(autojump_threshold=0))
