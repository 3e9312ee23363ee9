"""The sim's HTTP server on a real loopback socket, with real clients."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import msgspec
import pytest
import trio

from iop.adapters.sim import SimAdapter
from iop.adapters.vllm import VllmAdapter
from iop.config import Deadlines, SimConfig, SimInstance, VllmInstance
from iop.events import Cancelled, CancelReason, Complete, Delta, Error, RuntimeEvent
from iop.runtime import collect_run, open_run_supervisor
from iop.sim import (
    MAX_REQUEST_BYTES,
    SimApp,
    build_script,
    create_sim_app,
    parse_chat_request,
    serve_sim,
    stream_plan,
)
from iop.spec import ChatRequest, ExecutionSpec, FunctionDef, Message, Tool

FAST = SimConfig(ttft_s=0.0, output_tokens=16)
WEATHER = Tool(
    function=FunctionDef(
        name="get_weather",
        parameters={"type": "object", "properties": {"city": {"type": "string"}}},
    )
)
# Generous: these tests run on a shared, sometimes very busy machine.
WAIT_S = 20.0


@asynccontextmanager
async def running_sim(cfg: SimConfig = FAST) -> AsyncIterator[tuple[SimApp, str]]:
    app = create_sim_app(cfg)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        url: str = await nursery.start(
            partial(serve_sim, cfg, "127.0.0.1", 0, app=app, shutdown_trigger=stop.wait)
        )
        try:
            yield app, url
        finally:
            stop.set()


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "iop-sim", "messages": [{"role": "user", "content": "hi"}], **kw}


async def wait_until(predicate: Any) -> None:
    with trio.fail_after(WAIT_S):
        while not predicate():
            await trio.sleep(0.01)


async def test_streaming_is_byte_exact_vllm_sse() -> None:
    body = chat(stream=True, stream_options={"include_usage": True})
    async with running_sim() as (app, url), httpx.AsyncClient(base_url=url) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
            raw = await resp.aread()
        await wait_until(lambda: app.sim_stats.streams_finished == 1)
        assert app.sim_stats.client_disconnects == 0
        assert app.sim_stats.open_streams == 0
    assert raw.endswith(b"data: [DONE]\n\n")
    first = json.loads(raw.split(b"\n\n")[0][len(b"data: ") :])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    # The same bytes the sans-IO encoder gives for this request and `created`.
    script = build_script(parse_chat_request(msgspec.json.encode(body)), FAST)
    assert raw == stream_plan(script, created=first["created"], include_usage=True).body


async def test_non_streaming() -> None:
    async with running_sim() as (_, url), httpx.AsyncClient(base_url=url) as client:
        resp = await client.post("/v1/chat/completions", json=chat())
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/json"
    data = resp.json()
    assert data["object"] == "chat.completion"
    script = build_script(parse_chat_request(msgspec.json.encode(chat())), FAST)
    assert data["choices"][0]["message"]["content"] == script.content
    assert data["usage"]["completion_tokens"] == 17


async def test_models_and_health() -> None:
    async with (
        running_sim(SimConfig(model="tiny")) as (_, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        models = await client.get("/v1/models")
        health = await client.get("/health")
        missing = await client.get("/v2/nothing")
    assert models.status_code == 200
    assert [m["id"] for m in models.json()["data"]] == ["tiny"]
    assert health.status_code == 200
    assert health.content == b""
    assert missing.status_code == 404
    assert missing.json() == {"detail": "Not Found"}


@pytest.mark.parametrize(
    ("content", "status", "message"),
    [
        (b"{not json", 400, "invalid JSON"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', 400, "model"),
        (b'{"model": "iop-sim"}', 400, "messages"),
        (
            b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}',
            404,
            "The model `gpt-9` does not exist.",
        ),
    ],
)
async def test_bad_requests(content: bytes, status: int, message: str) -> None:
    async with running_sim() as (app, url), httpx.AsyncClient(base_url=url) as client:
        resp = await client.post(
            "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
        )
        assert app.sim_stats.statuses[status] == 1
    assert resp.status_code == status
    err = resp.json()["error"]
    assert list(err) == ["message", "type", "param", "code"]
    assert err["code"] == status
    assert message in err["message"]


async def test_oversize_body_is_413() -> None:
    big = b'{"model": "iop-sim", "messages": [], "pad": "' + b"x" * MAX_REQUEST_BYTES + b'"}'
    async with running_sim() as (_, url), httpx.AsyncClient(base_url=url) as client:
        resp = await client.post(
            "/v1/chat/completions", content=big, headers={"content-type": "application/json"}
        )
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == 413


async def test_auto_tool_choice_400_is_vllms_exact_body() -> None:
    cfg = SimConfig(ttft_s=0.0, auto_tool_choice=False)
    tools = [msgspec.to_builtins(WEATHER)]
    async with running_sim(cfg) as (_, url), httpx.AsyncClient(base_url=url) as client:
        resp = await client.post("/v1/chat/completions", json=chat(tools=tools, stream=True))
    assert resp.status_code == 400
    assert resp.content == (
        b'{"error":{"message":"\\"auto\\" tool choice requires --enable-auto-tool-choice '
        b'and --tool-call-parser to be set","type":"BadRequestError","param":null,"code":400}}'
    )


async def test_injected_http_errors_and_per_request_overrides() -> None:
    async with running_sim() as (_, url), httpx.AsyncClient(base_url=url) as client:
        limited = await client.post(
            "/v1/chat/completions", json=chat(stream=True, iop_sim={"failure": "http_429"})
        )
        fine = await client.post("/v1/chat/completions", json=chat(iop_sim={"output_tokens": 2}))
    assert limited.status_code == 429
    assert limited.headers["retry-after"] == "1"
    assert limited.json()["error"]["code"] == 429
    assert fine.json()["usage"]["completion_tokens"] == 3


async def test_injected_401_echoes_the_authorization_header() -> None:
    # What OpenAI-compatible servers do with a key they refuse: the e2e test
    # of secret masking relies on it.
    body = chat(stream=True, iop_sim={"failure": "http_401"})
    async with running_sim() as (_, url), httpx.AsyncClient(base_url=url) as client:
        refused = await client.post(
            "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-echoed-1"}
        )
        anonymous = await client.post("/v1/chat/completions", json=body)
    assert refused.status_code == 401
    assert refused.json()["error"]["message"] == "Incorrect API key provided: Bearer sk-echoed-1"
    assert anonymous.json()["error"]["message"] == "Incorrect API key provided: (none)"


async def test_truncated_stream_has_no_done() -> None:
    body = chat(stream=True, iop_sim={"failure": "truncate", "fail_after_tokens": 3})
    async with (
        running_sim() as (_, url),
        httpx.AsyncClient(base_url=url) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as resp,
    ):
        raw = await resp.aread()
    assert resp.headers["connection"] == "close"
    assert b"[DONE]" not in raw
    assert raw.count(b"data: ") == 1 + 3


async def test_client_disconnect_mid_stream_is_seen_by_the_server() -> None:
    # Far longer than WAIT_S at this pace; no longer: the sim builds the whole
    # answer before its headers (100,000 tokens outlasted httpx's 5 s under load).
    cfg = SimConfig(ttft_s=0.0, tokens_per_s=200, output_tokens=10_000)
    async with running_sim(cfg) as (app, url), httpx.AsyncClient(base_url=url) as client:
        async with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as resp:
            lines = 0
            async for line in resp.aiter_lines():
                lines += bool(line)
                if lines == 5:
                    break
            assert app.sim_stats.open_streams == 1
        await wait_until(lambda: app.sim_stats.client_disconnects == 1)
        assert app.sim_stats.open_streams == 0
        assert app.sim_stats.streams_finished == 0


async def test_stalled_stream_sends_headers_then_waits_for_the_client() -> None:
    body = chat(stream=True, iop_sim={"failure": "stall_before_first_byte"})
    async with running_sim() as (app, url), httpx.AsyncClient(base_url=url) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            await wait_until(lambda: app.sim_stats.open_streams == 1)
        await wait_until(lambda: app.sim_stats.client_disconnects == 1)


# --- the vLLM adapter against the sim ---------------------------------------------


def spec(run_id: str = "r1", **kw: Any) -> ExecutionSpec:
    request = ChatRequest(model="iop-sim", messages=[Message(role="user", content="hi")], **kw)
    return ExecutionSpec(run_id=run_id, request=request)


async def test_vllm_fallback_chain_ends_in_a_text_tool_call() -> None:
    cfg = SimConfig(ttft_s=0.0, auto_tool_choice=False)
    async with running_sim(cfg) as (app, url):
        vllm = VllmAdapter(VllmInstance(name="v", endpoint=url))
        try:
            events = await collect_run(vllm, spec(tools=[WEATHER]))
        finally:
            await vllm.aclose()
        # auto -> 400, forced -> 400, text fallback -> 200.
        assert app.sim_stats.statuses == {400: 2, 200: 1}
    done = events[-1]
    assert isinstance(done, Complete), done
    assert done.text_tool_fallback
    content = "".join(e.text for e in events if isinstance(e, Delta))
    assert content.startswith('<tool_call>{"name": "get_weather", "arguments": {"city": ')
    assert content.endswith("}}</tool_call>")


def comparable(events: list[RuntimeEvent]) -> list[Any]:
    out: list[Any] = []
    for e in events:
        if isinstance(e, Error):
            out.append(("error", e.status, e.code))
        else:
            out.append(e)
    return out


@pytest.mark.parametrize(
    ("sim", "kw"),
    [
        ({}, {}),
        ({"reasoning_tokens": 4}, {"max_tokens": 9}),
        ({}, {"tools": [WEATHER]}),
        ({"failure": "malformed_chunk", "fail_after_tokens": 2}, {}),
        ({"failure": "midstream_error", "fail_after_tokens": 2}, {}),
        ({"failure": "truncate", "fail_after_tokens": 2}, {}),
        ({"failure": "http_500"}, {}),
        ({"failure": "http_429"}, {}),
    ],
)
async def test_in_process_adapter_matches_vllm_adapter_over_http(
    sim: dict[str, Any], kw: dict[str, Any]
) -> None:
    cfg = SimConfig(ttft_s=0.0, output_tokens=8, **sim)
    local = await collect_run(SimAdapter(SimInstance(name="s", sim=cfg)), spec(**kw))
    async with running_sim(cfg) as (_, url):
        vllm = VllmAdapter(VllmInstance(name="v", endpoint=url))
        try:
            remote = await collect_run(vllm, spec(**kw))
        finally:
            await vllm.aclose()
    assert comparable(remote) == comparable(local)


async def test_cancelled_vllm_run_closes_the_sims_stream() -> None:
    # Far longer than WAIT_S at this pace; no longer: the sim builds the whole
    # answer before its headers (100,000 tokens outlasted httpx's 5 s under load).
    cfg = SimConfig(ttft_s=0.0, tokens_per_s=100, output_tokens=10_000)
    async with running_sim(cfg) as (app, url):
        vllm = VllmAdapter(VllmInstance(name="v", endpoint=url))
        try:
            async with open_run_supervisor() as sup:
                run = sup.start_run(vllm, spec(), Deadlines())
                seen: list[RuntimeEvent] = []
                async with run.events:
                    async for ev in run.events:
                        seen.append(ev)
                        if len(seen) == 4:
                            run.cancel(CancelReason.CLIENT_DISCONNECT)
            done = seen[-1]
            assert isinstance(done, Cancelled)
            assert done.reason is CancelReason.CLIENT_DISCONNECT
            await wait_until(lambda: app.sim_stats.client_disconnects == 1)
            assert app.sim_stats.open_streams == 0
        finally:
            await vllm.aclose()


@pytest.mark.parametrize(
    ("failure", "status"), [("midstream_error", 500), ("truncate", 200), ("malformed_chunk", 200)]
)
async def test_non_streaming_failures(failure: str, status: int) -> None:
    async with running_sim() as (_, url), httpx.AsyncClient(base_url=url) as client:
        resp = await client.post("/v1/chat/completions", json=chat(iop_sim={"failure": failure}))
    assert resp.status_code == status
    if failure == "midstream_error":
        assert resp.json()["error"]["type"] == "InternalServerError"
    elif failure == "truncate":
        with pytest.raises(json.JSONDecodeError):
            json.loads(resp.content)
    else:
        assert resp.json()["object"] == "chat.completion"


async def test_stalled_non_streaming_request_is_cut_by_the_client() -> None:
    body = chat(iop_sim={"failure": "stall_mid_stream"})
    async with running_sim() as (app, url), httpx.AsyncClient(base_url=url) as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(client.post, "/v1/chat/completions", json=body))
            await wait_until(lambda: app.sim_stats.open_completions == 1)
            nursery.cancel_scope.cancel()
        await wait_until(lambda: app.sim_stats.client_disconnects == 1)
        assert app.sim_stats.open_completions == 0
