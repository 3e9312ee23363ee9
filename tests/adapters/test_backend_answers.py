"""What backends answer, replayed byte for byte through a real ``FakeBackend``.

Mid-stream failures in non-standard shapes, backend errors mapped onto
OpenAI's codes, and the bounds on what a backend can make an adapter buffer
(tool-call arguments, the ``/v1/models`` probe body).
"""

from __future__ import annotations

import pytest
import trio

from iop.adapters.openai_compat import OpenAICompatAdapter
from iop.adapters.vllm import VllmAdapter
from iop.capabilities import ProviderStatus
from iop.config import Deadlines, OpenAICompatInstance, VllmInstance
from iop.events import Complete, Delta, Error, RuntimeEvent, Start
from iop.runtime import collect_run
from iop.spec import ChatRequest, ExecutionSpec, Message
from iop.testing import (
    CHAT_COMPLETIONS_PATH,
    MODELS_PATH,
    FakeBackend,
    Reply,
    Split,
    captured_exchanges,
    load_transcript,
    open_fake_backend,
)

DEADLINES = Deadlines(first_token_timeout_s=10.0, idle_timeout_s=10.0, request_timeout_s=30.0)
SPEC = ExecutionSpec(
    run_id="r1",
    request=ChatRequest(model="m", messages=[Message(role="user", content="hi")], stream=True),
)


def _compat(fb: FakeBackend, **options: object) -> OpenAICompatAdapter:
    cfg = OpenAICompatInstance(name="c", endpoint=fb.url, provider="llamacpp", **options)  # type: ignore[arg-type]
    return OpenAICompatAdapter(cfg)


def _vllm(fb: FakeBackend, **options: object) -> VllmAdapter:
    return VllmAdapter(VllmInstance(name="v", endpoint=fb.url, **options))  # type: ignore[arg-type]


async def _run(adapter: OpenAICompatAdapter | VllmAdapter) -> list[RuntimeEvent]:
    try:
        return await collect_run(adapter, SPEC, DEADLINES)
    finally:
        await adapter.aclose()


def _text(events: list[RuntimeEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


# --- llama.cpp before PR #16109: `error:` field line, then [DONE] ------------------


@pytest.mark.parametrize("split", [Split.whole(), Split.bytewise(), Split.random(7)])
async def test_llamacpp_pre16109_error_field_fails_the_run(split: Split) -> None:
    body = load_transcript("llamacpp_pre16109_midstream_error.txt")
    async with open_fake_backend() as fb:
        fb.script(CHAT_COMPLETIONS_PATH, Reply.sse(body, split=split))
        events = await _run(_compat(fb))
    assert events[0] == Start(target="m")
    assert events[-1] == Error(
        message="openai_compat stream error: Failed to decode the batch (synthetic message)",
        status=500,
        code="backend_stream_error",
    )
    # Whatever was streamed before the failure reached the client as it came.
    assert "Hello! How".startswith(_text(events))


# --- the /v1/models probe reads a bounded body -------------------------------------

PROBE_LIMIT = 4096


def _model_list(count: int) -> bytes:
    entries = ",".join(f'{{"id":"model-{i:06d}","object":"model"}}' for i in range(count))
    return f'{{"object":"list","data":[{entries}]}}'.encode()


async def test_probe_body_over_the_limit_fails_with_a_clear_detail() -> None:
    body = _model_list(2000)  # about 80 KiB
    assert len(body) > PROBE_LIMIT
    async with open_fake_backend() as fb:
        fb.script(MODELS_PATH, Reply.json(body, split=Split.every(1024)))
        adapter = _compat(fb, probe_max_body_bytes=PROBE_LIMIT)
        try:
            probe = await adapter.probe()
        finally:
            await adapter.aclose()
        conn = await fb.wait_connection_closed(5.0)
    assert probe.status is ProviderStatus.UNAVAILABLE
    assert probe.detail == (f"/v1/models body exceeds probe_max_body_bytes={PROBE_LIMIT} bytes")
    assert probe.targets == ()
    # It stopped reading early: most of the body was never sent.
    assert conn.body_bytes_sent < len(body)


async def test_probe_of_an_endless_body_fails_at_the_limit_not_at_its_end() -> None:
    # The body's first bytes, then a stall that never ends: only the limit
    # can stop the read before the probe deadline does.
    body = _model_list(2000)
    async with open_fake_backend() as fb:
        fb.script(
            MODELS_PATH,
            Reply.json(body, split=Split.every(512), stall_after_bytes=PROBE_LIMIT + 512),
        )
        adapter = _compat(fb, probe_max_body_bytes=PROBE_LIMIT, probe_timeout_s=60.0)
        try:
            with trio.fail_after(30):
                probe = await adapter.probe()
        finally:
            await adapter.aclose()
    assert probe.status is ProviderStatus.UNAVAILABLE
    assert "probe_max_body_bytes" in probe.detail


async def test_probe_body_at_the_limit_is_read() -> None:
    body = _model_list(3)
    async with open_fake_backend() as fb:
        fb.script(MODELS_PATH, Reply.json(body))
        adapter = _vllm(fb, probe_max_body_bytes=len(body))
        try:
            probe = await adapter.probe()
        finally:
            await adapter.aclose()
    assert probe.status is ProviderStatus.AVAILABLE
    assert probe.targets == ("model-000000", "model-000001", "model-000002")


async def test_probe_error_body_is_read_as_an_excerpt_only() -> None:
    async with open_fake_backend() as fb:
        fb.script(MODELS_PATH, Reply.text(b"x" * 100_000, status=500))
        adapter = _compat(fb)
        try:
            probe = await adapter.probe()
        finally:
            await adapter.aclose()
    assert probe.status is ProviderStatus.UNAVAILABLE
    assert probe.detail == "status code 500"


# --- streamed tool-call arguments are bounded ----------------------------------------


def _tool_stream(fragments: int, fragment: str) -> bytes:
    """vLLM-style: the call's header, then ``fragments`` argument fragments."""
    head = (
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1",'
        b'"type":"function","function":{"name":"get_weather","arguments":""}}]}}]}\n\n'
    )
    piece = (
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,'
        b'"function":{"arguments":"' + fragment.encode() + b'"}}]}}]}\n\n'
    )
    end = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}\n\n'
    return head + piece * fragments + end + b"data: [DONE]\n\n"


@pytest.mark.parametrize("kind", ["openai_compat", "vllm"])
async def test_tool_call_arguments_past_the_limit_end_the_run(kind: str) -> None:
    limit = 4096
    body = _tool_stream(1000, "x" * 16)  # 16,000 bytes of arguments
    async with open_fake_backend() as fb:
        fb.script(CHAT_COMPLETIONS_PATH, Reply.sse(body, split=Split.random(3, max_piece=300)))
        make = _compat if kind == "openai_compat" else _vllm
        events = await _run(make(fb, max_tool_call_bytes=limit))
        await fb.wait_client_closed(5.0)
    assert events[-1] == Error(
        message=f"tool calls exceed {limit} bytes (1 call(s) so far)",
        status=502,
        code="tool_calls_too_large",
    )


async def test_tool_call_arguments_under_the_limit_complete() -> None:
    body = _tool_stream(10, "x")
    async with open_fake_backend() as fb:
        fb.script(CHAT_COMPLETIONS_PATH, Reply.sse(body, split=Split.bytewise()))
        events = await _run(_compat(fb, max_tool_call_bytes=4096))
    last = events[-1]
    assert isinstance(last, Complete)
    assert [(c.name, c.arguments) for c in last.tool_calls] == [("get_weather", "x" * 10)]


# --- backend errors get OpenAI's codes ------------------------------------------------


def _captured(name: str, needle: str) -> Reply:
    exchange = next(e for e in captured_exchanges(name) if needle in e.command)
    assert exchange.status is not None
    return Reply(
        status=exchange.status,
        headers=tuple((k, v) for k, v in exchange.headers if k.lower() == "content-type"),
        body=exchange.body,
    )


async def test_llamacpp_context_overflow_is_context_length_exceeded() -> None:
    async with open_fake_backend() as fb:
        fb.script(CHAT_COMPLETIONS_PATH, _captured("real-xllamacpp-errors.txt", "too-long-stream"))
        events = await _run(_compat(fb))
    assert events[-1] == Error(
        message="openai_compat returned 400 Bad Request: request (3031 tokens) exceeds the "
        "available context size (2048 tokens), try increasing it",
        status=400,
        code="context_length_exceeded",
        param="messages",
    )


async def test_vllm_context_overflow_is_context_length_exceeded() -> None:
    message = (
        "This model's maximum context length is 2048 tokens. However, you requested 3000 "
        "tokens (2900 in the messages, 100 in the completion). Please reduce the length of "
        "the messages or completion."
    )
    body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
    async with open_fake_backend() as fb:
        fb.script(CHAT_COMPLETIONS_PATH, Reply.json(body, status=400))
        events = await _run(_vllm(fb))
    assert events[-1] == Error(
        message=f"vllm returned 400 Bad Request: {message}",
        status=400,
        code="context_length_exceeded",
        param="messages",
    )


@pytest.mark.parametrize(
    ("status", "body", "code"),
    [
        (
            429,
            {"error": {"message": "slow down", "type": "rate_limit", "code": 429}},
            "rate_limit_exceeded",
        ),
        (
            404,
            {"error": {"message": "The model `m` does not exist.", "code": 404}},
            "model_not_found",
        ),
        (400, {"error": {"message": "'messages' is required", "code": 400}}, "backend_http_error"),
    ],
)
async def test_other_backend_errors(status: int, body: object, code: str) -> None:
    async with open_fake_backend() as fb:
        fb.script(CHAT_COMPLETIONS_PATH, Reply.json(body, status=status))
        events = await _run(_compat(fb))
    last = events[-1]
    assert isinstance(last, Error)
    assert (last.status, last.code, last.param) == (status, code, None)


async def test_in_stream_context_error_is_mapped_too() -> None:
    body = (
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
        b'data: {"error": {"message": "This model\'s maximum context length is 8 tokens.", '
        b'"type": "BadRequestError", "param": null, "code": 400}}\n\n'
        b"data: [DONE]\n\n"
    )
    async with open_fake_backend() as fb:
        fb.script(CHAT_COMPLETIONS_PATH, Reply.sse(body))
        events = await _run(_vllm(fb))
    last = events[-1]
    assert isinstance(last, Error)
    assert (last.code, last.param) == ("context_length_exceeded", "messages")
