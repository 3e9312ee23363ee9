"""The edge's HTTP layer on a real socket (hypercorn, port 0) with httpx, and a
hand-played node attached to the core over an in-memory link."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import httpx
import msgspec
import pytest
import trio
import trio.testing

from iop.capabilities import Capabilities
from iop.config import Deadlines, EdgeConfig, EdgeServer, LinkSettings, SchedulerSettings
from iop.edge import EdgeHandle, serve_edge
from iop.events import (
    Cancelled,
    CancelReason,
    Complete,
    Delta,
    Error,
    FinishReason,
    ReasoningDelta,
    Start,
    ToolCall,
    Usage,
)
from iop.wire import SSEDecoder
from tests.edge._openai_schema import validate_chunk, validate_completion, validate_error
from tests.edge.test_core import TOKEN, FakeNode

pytestmark = pytest.mark.timeout(60)


def config(**server: object) -> EdgeConfig:
    return EdgeConfig(
        server=msgspec.structs.replace(
            EdgeServer(port=0, keepalive_interval_s=0.2, drain_timeout_s=1.0), **server
        ),
        # Wall-clock tests of the HTTP layer, not of liveness (tested in virtual
        # time: tests/edge/test_core.py, test_link_hardening.py): on a loaded
        # machine a CPU-bound test (a hypothesis property) can starve the trio
        # thread past the default 2 s, and the hand-played node would be lost.
        link=LinkSettings(node_tokens=[TOKEN], run_window=8, heartbeat_timeout_s=60.0),
        scheduler=SchedulerSettings(max_queue=1, queue_timeout_s=2.0),
        deadlines=Deadlines(first_token_timeout_s=5, idle_timeout_s=5, request_timeout_s=30),
    )


@asynccontextmanager
async def edge(
    cfg: EdgeConfig | None = None, *, with_node: bool = True
) -> AsyncIterator[tuple[EdgeHandle, FakeNode | None, httpx.AsyncClient]]:
    from iop.testing import memory_link_pair

    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        handle: EdgeHandle = await nursery.start(
            partial(serve_edge, cfg or config(), shutdown=stop)
        )
        node = None
        if with_node:
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


async def answer(node: FakeNode, *events: object) -> str:
    assign = await node.assigns.receive()
    run_id = assign.assign.run_id
    await node.send(run_id, *events)  # type: ignore[arg-type]
    return run_id


def sse_objects(body: bytes) -> list[object]:
    dec = SSEDecoder()
    out: list[object] = []
    for ev in dec.feed(body):
        out.append("[DONE]" if ev.data == "[DONE]" else json.loads(ev.data))
    return out


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def test_streaming_chat() -> None:
    async with edge() as (_, node, client), trio.open_nursery() as n:
        assert node is not None
        n.start_soon(
            answer,
            node,
            Start(),
            ReasoningDelta("hm"),
            Delta("Hel"),
            Delta("lo"),
            Complete(usage=Usage(input_tokens=3, output_tokens=2)),
        )
        resp = await client.post(
            "/v1/chat/completions",
            json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
        )
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        objs = sse_objects(resp.content)
        assert objs[-1] == "[DONE]"
        chunks = [o for o in objs[:-1] if isinstance(o, dict)]
        for c in chunks:
            validate_chunk(c)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
        assert text == "Hello"
        assert any(
            c["choices"] and c["choices"][0]["delta"].get("reasoning_content") == "hm"
            for c in chunks
        )
        assert chunks[-1]["usage"]["prompt_tokens"] == 3


async def test_a_closed_stream_logs_its_summary_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="iop.edge.http")
    async with edge() as (_, node, client), trio.open_nursery() as n:
        assert node is not None
        n.start_soon(answer, node, Start(), Delta("Hi"), Complete())
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert resp.status_code == 200
    closed = [r.getMessage() for r in caplog.records if " closed: " in r.getMessage()]
    assert len(closed) == 1
    assert closed[0].startswith("stream ")


async def test_non_streaming_chat_with_tool_calls() -> None:
    async with edge() as (_, node, client), trio.open_nursery() as n:
        assert node is not None
        call = ToolCall(id="c1", name="get_weather", arguments='{"city":"Paris"}')
        n.start_soon(answer, node, Start(), Complete(tool_calls=(call,)))
        body = {
            **CHAT,
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "parameters": {"type": "object"}},
                }
            ],
        }
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200
        obj = resp.json()
        validate_completion(obj)
        choice = obj["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[]", 400, None),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), 400, "model"),
        (json.dumps({"model": "m"}).encode(), 400, "messages"),
        (
            json.dumps({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}).encode(),
            400,
            "messages[0].role",
        ),
        (
            json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode(),
            404,
            "model",
        ),
    ],
)
async def test_bad_requests_get_openai_errors(body: bytes, status: int, param: str | None) -> None:
    async with edge() as (_, _, client):
        resp = await client.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        assert resp.status_code == status
        obj = resp.json()
        validate_error(obj)
        if param is not None:
            assert obj["error"]["param"] == param


async def test_oversized_body_is_413() -> None:
    async with edge(config(max_body_bytes=1000)) as (_, _, client):
        resp = await client.post("/v1/chat/completions", content=b"x" * 5000)
        assert resp.status_code == 413
        validate_error(resp.json())


async def test_unknown_route_and_method() -> None:
    async with edge() as (_, _, client):
        resp = await client.get("/v1/nope")
        assert resp.status_code == 404
        validate_error(resp.json())
        resp = await client.get("/v1/chat/completions")
        assert resp.status_code == 405
        validate_error(resp.json())


async def test_no_nodes_is_503_and_not_ready() -> None:
    async with edge(with_node=False) as (_, _, client):
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 503
        assert (await client.get("/readyz")).status_code == 503
        assert (await client.get("/healthz")).status_code == 200


async def test_models_health_and_admin() -> None:
    async with edge() as (_, _, client):
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list"
        assert [m["id"] for m in models["data"]] == ["m"]
        assert (await client.get("/readyz")).json()["status"] == "ready"
        admin = (await client.get("/admin/nodes")).json()
        assert admin["nodes"][0]["id"] == "n1"
        assert admin["nodes"][0]["instances"][0]["instance"] == "i0"
        # Every trio task of the process, this test's own among them: the
        # root, the edge's services, the fake node's, this request's handler.
        from iop.edge._views import live_tasks

        assert 10 < admin["tasks"] <= live_tasks() + 2


async def test_early_error_gets_a_real_status() -> None:
    async with edge() as (_, node, client), trio.open_nursery() as n:
        assert node is not None
        n.start_soon(
            answer,
            node,
            Start(),
            Error(message="context too long", status=400, code="backend_http_error"),
        )
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert resp.status_code == 400
        assert resp.json()["error"]["message"] == "context too long"


async def test_early_context_overflow_is_openais_error() -> None:
    async with edge() as (_, node, client), trio.open_nursery() as n:
        assert node is not None
        n.start_soon(
            answer,
            node,
            Start(),
            Error(
                message="vllm returned 400 Bad Request: maximum context length is 8 tokens",
                status=400,
                code="context_length_exceeded",
                param="messages",
            ),
        )
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert resp.status_code == 400
        body = resp.json()
        validate_error(body)
        assert body["error"] == {
            "message": "vllm returned 400 Bad Request: maximum context length is 8 tokens",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }


async def test_error_after_output_is_an_sse_error_object() -> None:
    async with edge() as (_, node, client), trio.open_nursery() as n:
        assert node is not None
        n.start_soon(
            answer,
            node,
            Start(),
            Delta("par"),
            Error(message="backend died", status=502, code="backend_stream_error"),
        )
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert resp.status_code == 200
        objs = sse_objects(resp.content)
        assert objs[-1] == "[DONE]"
        err = objs[-2]
        assert isinstance(err, dict)
        validate_error(err)
        assert err["error"]["message"] == "backend died"


async def test_keepalive_while_waiting_then_answer() -> None:
    async with edge() as (_, node, client), trio.open_nursery() as n:
        assert node is not None

        async def slow() -> None:
            assign = await node.assigns.receive()
            await trio.sleep(0.7)  # several keep-alive intervals
            await node.send(assign.assign.run_id, Start(), Delta("x"), Complete())

        n.start_soon(slow)
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert b": keep-alive\n\n" in resp.content
        assert sse_objects(resp.content)[-1] == "[DONE]"


async def test_client_disconnect_cancels_the_run_on_the_node() -> None:
    async with edge() as (handle, node, client):
        assert node is not None

        async def stream_then_leave() -> None:
            async with client.stream(
                "POST", "/v1/chat/completions", json={**CHAT, "stream": True}
            ) as resp:
                async for line in resp.aiter_lines():
                    if "tok" in line:
                        return  # leaving the block closes the connection

        async with trio.open_nursery() as n:
            n.start_soon(stream_then_leave)
            assign = await node.assigns.receive()
            await node.send(assign.assign.run_id, Start(), Delta("tok"))
        with trio.fail_after(5):
            while not node.cancels:
                await trio.sleep(0.01)
        assert node.cancels[0].cancel.reason is CancelReason.CLIENT_DISCONNECT
        assert handle.core.snapshot()["outcomes"] == {"cancelled:client_disconnect": 1}


async def test_a_client_leaving_a_collected_run_cancels_it_on_the_node() -> None:
    # Not streamed: the client waits for the whole answer and leaves first.
    async with edge() as (handle, node, client):
        assert node is not None

        async def ask_then_leave(cancel_scope: trio.CancelScope) -> None:
            with cancel_scope:
                await client.post("/v1/chat/completions", json=CHAT)

        leave = trio.CancelScope()
        async with trio.open_nursery() as n:
            n.start_soon(ask_then_leave, leave)
            assign = await node.assigns.receive()
            await node.send(assign.assign.run_id, Start(), Delta("tok"))
            leave.cancel()  # closes the connection
        with trio.fail_after(5):
            while not node.cancels:
                await trio.sleep(0.01)
        assert node.cancels[0].cancel.reason is CancelReason.CLIENT_DISCONNECT
        with trio.fail_after(5):
            while handle.core.supervisor.runs:
                await trio.sleep(0.01)
        assert handle.core.metrics.outcomes().get("cancelled:client_disconnect") == 1


async def test_queue_full_is_429_with_retry_after() -> None:
    async with edge() as (_, node, client), trio.open_nursery() as n:
        assert node is not None
        results: list[int] = []

        async def call() -> None:
            r = await client.post("/v1/chat/completions", json=CHAT)
            results.append(r.status_code)

        n.start_soon(call)  # takes the only slot
        await node.assigns.receive()
        n.start_soon(call)  # waits in the queue (max_queue=1)
        with trio.fail_after(5):
            while not (await client.get("/admin/nodes")).json()["queued"]:
                await trio.sleep(0.01)
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 429
        assert resp.headers["retry-after"] == "1"
        validate_error(resp.json())
        n.cancel_scope.cancel()


async def test_api_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    async with edge(config(api_keys=["sk-1"])) as (_, _, client):
        resp = await client.get("/v1/models")
        assert resp.status_code == 401
        validate_error(resp.json())
        resp = await client.get("/v1/models", headers={"Authorization": "Bearer sk-1"})
        assert resp.status_code == 200


async def test_cancelled_before_output_gets_a_real_status() -> None:
    cfg = msgspec.structs.replace(
        config(),
        deadlines=Deadlines(first_token_timeout_s=0.05, idle_timeout_s=5, request_timeout_s=30),
    )
    async with edge(cfg) as (_, node, client):
        assert node is not None
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert resp.status_code == 504
        body = resp.json()
        validate_error(body)
        assert body["error"]["code"] == "first_token_timeout"


async def test_metrics() -> None:
    async with edge() as (_, node, client), trio.open_nursery() as n:
        assert node is not None
        n.start_soon(
            answer,
            node,
            Start(),
            Delta("a"),
            Complete(usage=Usage(input_tokens=3, output_tokens=1)),
        )
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 200
        n.start_soon(
            answer, node, Start(), Error(message="bad", status=400, code="backend_http_error")
        )
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 400
        n.start_soon(answer, node, Start(), Delta("b"), Complete(finish_reason=FinishReason.LENGTH))
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        text = (await client.get("/metrics")).text
        admin = (await client.get("/admin/nodes")).json()
    assert 'iop_runs_total{model="m",outcome="complete",reason="stop"} 1.0' in text
    assert 'iop_runs_total{model="m",outcome="complete",reason="length"} 1.0' in text
    assert 'iop_runs_total{model="m",outcome="error",reason="backend_http_error"} 1.0' in text
    # The admin view reads the same counter: completions of any finish reason
    # as one count, in the order each outcome first happened.
    assert list(admin["outcomes"].items()) == [("complete", 2), ("error:backend_http_error", 1)]
    assert 'iop_tokens_total{kind="input",model="m"} 3.0' in text
    assert 'iop_run_ttft_seconds_count{model="m"} 2.0' in text
    assert 'iop_instance_slots{instance="i0",node="n1"} 1.0' in text
    assert "iop_nodes_connected 1.0" in text
    assert "iop_queue_depth 0.0" in text
    assert 'iop_queue_exits_total{how="cancelled"} 0.0' in text
    assert "iop_preemptions_total 0.0" in text
    assert "iop_priority_overflows_total 0.0" in text
    assert admin["queue"] == {
        "exits": {"placed": 0, "cancelled": 0, "timed_out": 0, "shed": 0, "load_failed": 0},
        "last_exit": None,
        "refused": {"queue_full": 0, "queue_delay": 0, "deadline": 0, "shed": 0},
        "preempted": 0,
        "priority_overflows": 0,
        "sessions": {"seen": 0, "queued": 0, "overflowed": 0},
    }


async def test_admin_page() -> None:
    async with edge() as (_, node, client), trio.open_nursery() as n:
        assert node is not None
        n.start_soon(answer, node, Start(), Delta("a"), Complete())
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        resp = await client.get("/admin")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/html")
    page = resp.text
    assert "IOP edge: serving" in page
    assert "<td>n1</td>" in page
    assert "<td>i0</td>" in page
    assert "<td>complete</td>" in page
    assert "No node is connected." not in page


def test_admin_page_escapes_what_nodes_report() -> None:
    from iop.edge.routes._admin_page import render_admin_page

    snap = {
        "nodes": [
            {
                "id": "<script>x</script>",
                "instances": [
                    {"instance": "a&b", "targets": ["m<1>"], "provider_status": "unavailable"}
                ],
            }
        ],
        "runs": [],
        "outcomes": {},
    }
    page = render_admin_page(snap).decode()
    assert "<script>" not in page
    assert "&lt;script&gt;x&lt;/script&gt;" in page
    assert "a&amp;b" in page
    assert 'class="bad"' in page
    empty = render_admin_page({}).decode()
    assert "No node is connected." in empty


# --- secrets ---------------------------------------------------------------------------

API_KEY = "sk-client-key-marker-71a3"
ADMIN_KEY = "sk-admin-key-marker-5c0e"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("after_output", [False, True])
async def test_error_messages_never_carry_the_edges_secrets(
    stream: bool, after_output: bool
) -> None:
    # A node (or its backend) that echoes a credential: the edge's own
    # secrets must not reach the client, whatever the node sent.
    leak = f"Incorrect API key provided: Bearer {API_KEY} (node token {TOKEN})"
    events: list[object] = [Start(), *([Delta("x")] if after_output else [])]
    async with edge(config(api_keys=[API_KEY])) as (_, node, client), trio.open_nursery() as n:
        assert node is not None
        client.headers["Authorization"] = f"Bearer {API_KEY}"
        n.start_soon(
            answer, node, *events, Error(message=leak, status=401, code="backend_http_error")
        )
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert API_KEY not in resp.text
    assert TOKEN not in resp.text
    assert "Incorrect API key provided: Bearer *** (node token ***)" in resp.text


async def test_a_cancel_message_never_carries_the_edges_secrets() -> None:
    async with edge() as (_, node, client), trio.open_nursery() as n:
        assert node is not None
        n.start_soon(
            answer, node, Start(), Cancelled(reason=CancelReason.EXPLICIT, message=f"t={TOKEN}!")
        )
        resp = await client.post("/v1/chat/completions", json=CHAT)
    assert TOKEN not in resp.text
    assert "t=***!" in resp.text


async def test_admin_views_and_metrics_never_carry_the_edges_secrets() -> None:
    from iop.testing import memory_link_pair

    cfg = config(api_keys=[API_KEY], admin_keys=[ADMIN_KEY])
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        handle: EdgeHandle = await nursery.start(partial(serve_edge, cfg, shutdown=stop))
        edge_end, node_end = memory_link_pair()
        nursery.start_soon(handle.core.handle_link, edge_end, "test")
        node = FakeNode(node_end)
        leaky = Capabilities(
            adapter="sim",
            instance=f"i-{API_KEY}",
            provider=f"token {TOKEN}",
            targets=("m",),
            max_concurrency=1,
        )
        await node.hello([leaky])
        nursery.start_soon(node.serve)
        auth = {"Authorization": f"Bearer {API_KEY}"}
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        async with httpx.AsyncClient(base_url=handle.url, timeout=10, headers=auth) as client:
            nursery.start_soon(answer, node, Start(), Complete())
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            pages = {
                p: (await client.get(p, headers=admin)).text
                for p in ("/admin", "/admin/nodes", "/metrics")
            }
        stop.set()
    for path, text in pages.items():
        assert API_KEY not in text, path
        assert ADMIN_KEY not in text, path
        assert TOKEN not in text, path
    assert "token ***" in pages["/admin/nodes"]
    assert "token ***" in pages["/admin"]
    assert 'instance="i-***"' in pages["/metrics"]
