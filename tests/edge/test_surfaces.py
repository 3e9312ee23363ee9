"""The edge's one handler serves any ``iop.api.Surface``: a toy surface, routed by
one ``SurfaceRoute``, gets parsing, its own key header, streaming with its own
keep-alives, collecting, and every error (401, 400, 413, 429, early failure) in
its own shape, on a real socket with a hand-played node."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from functools import partial

import httpx
import msgspec
import pytest
import trio

from iop.api import (
    CHAT,
    Call,
    OutputShaper,
    RunContext,
    ShapedDone,
    ShapedFailed,
    ShapedReasoning,
    ShapedText,
)
from iop.capabilities import Capabilities
from iop.config import Deadlines, EdgeConfig
from iop.edge import EdgeHandle, SurfaceRoute, bearer_key, serve_edge
from iop.errors import RequestError
from iop.events import Complete, Delta, RuntimeEvent, Start
from iop.spec import ChatRequest, Message
from iop.testing import memory_link_pair
from tests.edge.test_app import CHAT as CHAT_BODY
from tests.edge.test_app import answer, config
from tests.edge.test_core import FakeNode

pytestmark = pytest.mark.timeout(60)


def toy_key(headers: Mapping[str, str]) -> str:
    return headers.get("x-toy-key", "") or bearer_key(headers)


class ToyStream:
    def __init__(self, call: Call, ctx: RunContext) -> None:
        self._shaper = OutputShaper(call.request, ctx.policy, ctx.run_id)
        self._version = call.native
        self.finished = False

    def start(self) -> bytes:
        return f"event: start\ndata: {self._version}\n\n".encode()

    def feed_many(self, events: Iterable[RuntimeEvent]) -> bytes:
        out = b""
        for shaped in self._shaper.feed_many(events):
            if isinstance(shaped, ShapedText | ShapedReasoning):
                out += b"event: text\ndata: " + shaped.text.encode() + b"\n\n"
            else:
                self.finished = True
                kind = "done" if isinstance(shaped, ShapedDone) else "failed"
                out += f"event: {kind}\n\n".encode()
        return out

    def keepalive(self) -> bytes:
        return b"event: ping\n\n"


class ToyCollector:
    def __init__(self, call: Call, ctx: RunContext) -> None:
        self._shaper = OutputShaper(call.request, ctx.policy, ctx.run_id, buffered=True)
        self._result: tuple[int, bytes] | None = None

    @property
    def finished(self) -> bool:
        return self._result is not None

    def feed(self, event: RuntimeEvent) -> None:
        for shaped in self._shaper.feed(event):
            if isinstance(shaped, ShapedDone):
                self._result = (200, msgspec.json.encode({"toy": shaped.content}))
            elif isinstance(shaped, ShapedFailed):
                self._result = TOY.error_body(shaped.status, shaped.message, code=shaped.code)

    def result(self) -> tuple[int, bytes]:
        assert self._result is not None
        return self._result


class ToySurface:
    """Body ``"[!]text"``: a run on model ``m`` saying ``text`` (``!`` streams)."""

    @property
    def name(self) -> str:
        return "toy"

    def parse(self, body: bytes, headers: Mapping[str, str], *, tenant: str) -> Call:
        text = body.decode()
        if text == "boom":
            raise RuntimeError("the toy surface broke")
        if not text.strip("!"):
            raise RequestError("toy bodies are not empty", param="body", code="empty")
        stream = text.startswith("!")
        request = ChatRequest(model="m", messages=[Message(role="user", content=text)])
        return Call(request=request, stream=stream, model="m", native=headers.get("toy-version"))

    def error_body(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> tuple[int, bytes]:
        sent = 529 if status == 429 else status  # a surface may map statuses
        return sent, msgspec.json.encode({"toy_error": {"message": message, "code": code}})

    def stream(self, call: Call, ctx: RunContext) -> ToyStream:
        return ToyStream(call, ctx)

    def collector(self, call: Call, ctx: RunContext) -> ToyCollector:
        return ToyCollector(call, ctx)


TOY = ToySurface()


ROUTES = [SurfaceRoute("/v1/chat/completions", CHAT), SurfaceRoute("/toy", TOY, toy_key)]


@asynccontextmanager
async def edge(
    cfg: EdgeConfig | None = None,
) -> AsyncIterator[tuple[EdgeHandle, FakeNode, httpx.AsyncClient]]:
    """The edge serving ``ROUTES``, one hand-played node serving model ``m``."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        serve = partial(serve_edge, cfg or config(), shutdown=stop, routes=ROUTES)
        handle: EdgeHandle = await nursery.start(serve)
        edge_end, node_end = memory_link_pair()
        nursery.start_soon(handle.core.handle_link, edge_end, "test")
        node = FakeNode(node_end)
        await node.hello(
            [Capabilities(adapter="sim", instance="i0", targets=("m",), max_concurrency=1)]
        )
        nursery.start_soon(node.serve)
        async with httpx.AsyncClient(base_url=handle.url, timeout=10) as client:
            yield handle, node, client
        stop.set()


def toy_error(body: bytes) -> dict[str, object]:
    error: dict[str, object] = json.loads(body)["toy_error"]
    return error


async def test_streaming_through_the_generic_handler() -> None:
    async with edge() as (_, node, client), trio.open_nursery() as n:
        n.start_soon(answer, node, Start(), Delta("Hel"), Delta("lo"), Complete())
        resp = await client.post("/toy", content=b"!hi", headers={"Toy-Version": "7"})
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [e for e in resp.content.split(b"\n\n") if e and e != b"event: ping"]
        assert events == [
            b"event: start\ndata: 7",
            b"event: text\ndata: Hel",
            b"event: text\ndata: lo",
            b"event: done",
        ]


async def test_the_surfaces_keepalive_while_waiting() -> None:
    async with edge() as (_, node, client):
        # The node answers only once the client has seen a keep-alive.
        async with client.stream("POST", "/toy", content=b"!hi") as resp:
            assert resp.status_code == 200
            run_id = (await node.assigns.receive()).assign.run_id
            seen = b""
            async for chunk in resp.aiter_bytes():
                if b"event: ping" not in seen and b"event: ping" in seen + chunk:
                    await node.send(run_id, Start(), Delta("x"), Complete())
                seen += chunk
        assert seen.startswith(b"event: start\ndata: None\n\nevent: ping\n\n")
        assert seen.endswith(b"event: text\ndata: x\n\nevent: done\n\n")


async def test_collecting_through_the_generic_handler() -> None:
    async with edge() as (_, node, client), trio.open_nursery() as n:
        n.start_soon(answer, node, Start(), Delta("a"), Delta("b"), Complete())
        resp = await client.post("/toy", content=b"hi")
        assert (resp.status_code, resp.json()) == (200, {"toy": "ab"})


async def test_every_error_takes_the_surfaces_shape() -> None:
    async with edge(config(api_keys=["sk-1"], max_body_bytes=1000)) as (_, _, client):
        resp = await client.post("/toy", content=b"hi")
        assert resp.status_code == 401
        assert toy_error(resp.content)["code"] == "invalid_api_key"
        ok = {"x-toy-key": "sk-1"}
        resp = await client.post("/toy", content=b"!", headers=ok)
        assert (resp.status_code, toy_error(resp.content)["code"]) == (400, "empty")
        resp = await client.post("/toy", content=b"x" * 5000, headers=ok)
        assert resp.status_code == 413
        assert "too large" in str(toy_error(resp.content)["message"])
        # The chat route keeps OpenAI's shape and its Bearer key.
        resp = await client.post("/v1/chat/completions", json=CHAT_BODY, headers=ok)
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"


async def test_queue_full_is_the_surfaces_status_with_retry_after() -> None:
    async with edge() as (_, node, client), trio.open_nursery() as n:

        async def call() -> None:
            await client.post("/toy", content=b"hi")

        n.start_soon(call)  # takes the only slot
        await node.assigns.receive()
        n.start_soon(call)  # waits in the queue (max_queue=1)
        with trio.fail_after(5):
            while not (await client.get("/admin/nodes")).json()["queued"]:
                await trio.sleep(0.01)
        resp = await client.post("/toy", content=b"!hi")
        assert resp.status_code == 529
        assert resp.headers["retry-after"] == "1"
        assert toy_error(resp.content)["code"] == "queue_full"
        n.cancel_scope.cancel()


async def test_a_run_that_fails_before_output_gets_the_surfaces_error() -> None:
    cfg = msgspec.structs.replace(
        config(),
        deadlines=Deadlines(first_token_timeout_s=0.05, idle_timeout_s=5, request_timeout_s=30),
    )
    async with edge(cfg) as (_, _, client):
        resp = await client.post("/toy", content=b"!hi")
        assert resp.status_code == 504
        assert toy_error(resp.content) == {
            "message": "no output within first_token_timeout_s=0.05",
            "code": "first_token_timeout",
        }


async def test_an_unexpected_error_is_a_500_in_the_surfaces_shape(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with edge() as (_, node, client):
        resp = await client.post("/toy", content=b"boom")
        assert resp.status_code == 500
        assert toy_error(resp.content)["code"] == "internal_error"
        assert node.assigned == []
        # The connection stays usable.
        ok = await client.post("/toy", content=b"")
        assert ok.status_code == 400
    assert "unhandled error on POST /toy" in caplog.text
    assert "the toy surface broke" in caplog.text


async def test_other_methods_on_a_surface_path_get_its_405() -> None:
    async with edge() as (_, _, client):
        resp = await client.get("/toy")
        assert resp.status_code == 405
        assert "Method GET is not allowed on /toy" in str(toy_error(resp.content)["message"])


@pytest.fixture
def scopes(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Cancel scopes entered (nurseries too: each opens one), by task name."""
    counts: Counter[str] = Counter()
    enter = trio.CancelScope.__enter__

    def counting(self: trio.CancelScope) -> trio.CancelScope:
        counts[trio.lowlevel.current_task().name] += 1
        return enter(self)

    monkeypatch.setattr(trio.CancelScope, "__enter__", counting)
    return counts


def _in_answers(counts: Counter[str]) -> int:
    # hypercorn runs each request's app in a task of its ``_handle``.
    return sum(n for name, n in counts.items() if name.endswith("._handle"))


async def _read_until(lines: AsyncIterator[str], wanted: str) -> None:
    async for line in lines:
        if line == wanted:
            return
    raise AssertionError(f"the stream ended before {wanted!r}")


async def test_a_stream_waits_for_each_event_without_a_cancel_scope(scopes: Counter[str]) -> None:
    # Each event is sent only once the client has the one before: the
    # answer waits for every one. The keep-alive's timer was a cancel scope
    # around each of those waits (a deadline into trio's heap and out, two
    # context managers: per token of every stream); now one clock keeps the
    # time of every stream (iop/edge/runs/_keepalive.py).
    tokens = 24
    async with (
        edge() as (_, node, client),
        client.stream("POST", "/toy", content=b"!hi") as resp,
    ):
        run_id = (await node.assigns.receive()).assign.run_id
        lines = resp.aiter_lines()
        await node.send(run_id, Start(), Delta("t0"))
        await _read_until(lines, "data: t0")
        before = _in_answers(scopes)
        for i in range(1, tokens):
            await node.send(run_id, Delta(f"t{i}"))
            await _read_until(lines, f"data: t{i}")
        during = _in_answers(scopes) - before
        await node.send(run_id, Complete())
        await _read_until(lines, "event: done")
    assert during == 0  # one per event before (23)


async def test_a_stream_that_pauses_after_its_first_output_keeps_alive() -> None:
    async with edge() as (handle, node, client):
        core = handle.core
        async with client.stream("POST", "/toy", content=b"!hi") as resp:
            run_id = (await node.assigns.receive()).assign.run_id
            lines = resp.aiter_lines()
            await node.send(run_id, Start(), Delta("a"))
            await _read_until(lines, "data: a")
            # Nothing more from the node until the client has a keep-alive.
            await _read_until(lines, "event: ping")
            await node.send(run_id, Delta("b"), Complete())
            await _read_until(lines, "data: b")
            await _read_until(lines, "event: done")
    assert core.keepalives.wakeups >= 1
    assert len(core.keepalives) == 0  # the stream left the clock
