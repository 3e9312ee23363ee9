"""One test per branch of seeds 000 (vllm/stream.go) and 003 (openai_compat.go).

Each test is named after the seed and the branch and quotes the Go condition
it covers. Real-socket behaviour (headers on the wire, refused connections,
resets, probe timeouts) uses ``FakeBackend``; the rest uses the in-memory
``FakeTransport``. Where IOP deliberately goes beyond the seed, the test says
so.
"""

from __future__ import annotations

import gzip
import json
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import pytest
import trio

from iop.adapters import join_openai_path
from iop.adapters.openai_compat import OpenAICompatAdapter
from iop.adapters.vllm import VllmAdapter
from iop.capabilities import ProviderStatus
from iop.config import Deadlines, OpenAICompatInstance, VllmInstance, decode_config
from iop.events import (
    Complete,
    Delta,
    Error,
    FinishReason,
    ReasoningDelta,
    RuntimeEvent,
    Start,
    Usage,
)
from iop.runtime import collect_run
from iop.spec import ChatRequest, ExecutionSpec, FunctionDef, Message, Tool
from iop.testing import (
    CHAT_COMPLETIONS_PATH,
    MODELS_PATH,
    ConnectFailure,
    FakeBackend,
    FakeTransport,
    RecordedRequest,
    Reply,
    Split,
    load_transcript,
    open_fake_backend,
    transcript_body,
)

DEADLINES = Deadlines(first_token_timeout_s=10.0, idle_timeout_s=10.0, request_timeout_s=30.0)
NOTICE_S = 5.0

WEATHER = Tool(
    function=FunctionDef(
        name="get_weather",
        description="Get the current weather for a city",
        parameters={"type": "object", "properties": {"city": {"type": "string"}}},
    )
)
TIME = Tool(function=FunctionDef(name="get_time", parameters={"type": "object"}))
# WEATHER as a client sends it (OpenAI's shape).
WEATHER_JSON: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
FULL_SHAPE_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ],
    },
    {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    {"role": "user", "content": "  spaces kept  "},
]

AUTO_TOOL_400 = load_transcript("vllm_400_auto_tool_choice_body.json")
AUTO_TOOL_400_LEGACY = (
    b'{"object":"error","message":"\\"auto\\" tool choice requires --enable-auto-tool-choice '
    b'and --tool-call-parser to be set","type":"BadRequestError","param":null,"code":400}'
)
TOOL_PARSER_400 = (
    b'{"error":{"message":"tool_choice=\\"required\\" requires --tool-call-parser to be set",'
    b'"type":"BadRequestError","param":null,"code":400}}'
)
CONTEXT_400 = (
    b'{"error":{"message":"This model\'s maximum context length is 4096 tokens. However, you '
    b'requested 5000 tokens.","type":"BadRequestError","param":null,"code":400}}'
)

VLLM_TEXT = transcript_body("vllm_text_stream_with_usage.txt")
VLLM_TOOLS = transcript_body("vllm_tool_call_stream_hermes.txt")
VLLM_TEXT_TOOLS = transcript_body("hermes_text_tool_call_in_content_vllm.txt")


# --- helpers ----------------------------------------------------------------------------


def spec(*, target: str = "", model: str = "m", **request: Any) -> ExecutionSpec:
    request.setdefault("messages", [Message(role="user", content="What is the weather?")])
    return ExecutionSpec(
        run_id="run-1", target=target, request=ChatRequest(model=model, stream=True, **request)
    )


def sse(*chunks: object) -> bytes:
    """An SSE body: dicts are JSON chunks, strings raw payloads (e.g. "[DONE]")."""
    out = bytearray()
    for c in chunks:
        payload = c if isinstance(c, str) else json.dumps(c)
        out += b"data: " + payload.encode() + b"\n\n"
    return bytes(out)


def chunk(
    content: str | None = None,
    *,
    finish: str | None = None,
    usage: dict[str, Any] | None = None,
    **delta: Any,
) -> dict[str, Any]:
    d: dict[str, Any] = dict(delta)
    if content is not None:
        d["content"] = content
    out: dict[str, Any] = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": d, "finish_reason": finish}],
    }
    if usage is not None:
        out["usage"] = usage
    return out


HELLO = sse(chunk("Hello"), chunk(" world"), chunk("!", finish="stop"), "[DONE]")


async def run(adapter: OpenAICompatAdapter | VllmAdapter, s: ExecutionSpec) -> list[RuntimeEvent]:
    return await collect_run(adapter, s, DEADLINES)


def text(events: list[RuntimeEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


def last(events: list[RuntimeEvent], kind: type[Complete] | type[Error]) -> Any:
    assert isinstance(events[0], Start), events
    assert isinstance(events[-1], kind), events[-1]
    return events[-1]


@asynccontextmanager
async def compat(
    endpoint: str = "http://backend", transport: FakeTransport | None = None, **cfg: Any
) -> AsyncIterator[OpenAICompatAdapter]:
    adapter = OpenAICompatAdapter(
        OpenAICompatInstance(name="lemon", endpoint=endpoint, **cfg), transport=transport
    )
    try:
        yield adapter
    finally:
        await adapter.aclose()


@asynccontextmanager
async def vllm(
    endpoint: str = "http://backend", transport: FakeTransport | None = None, **cfg: Any
) -> AsyncIterator[VllmAdapter]:
    adapter = VllmAdapter(VllmInstance(name="v0", endpoint=endpoint, **cfg), transport=transport)
    try:
        yield adapter
    finally:
        await adapter.aclose()


@pytest.fixture
async def fb() -> AsyncIterator[FakeBackend]:
    async with open_fake_backend() as backend:
        yield backend


@pytest.fixture
def refused_url() -> Iterator[str]:
    """A loopback port bound but not listening: connecting is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def body_of(requests: list[RecordedRequest], i: int = -1) -> dict[str, Any]:
    body = requests[i].json
    assert isinstance(body, dict)
    return body


# =========================================================================================
# Seed 003: openai_compat.go
# =========================================================================================

# --- Capabilities / ProbeProvider ---------------------------------------------------------


async def test_003_probe_provider_label_in_probe_and_capabilities() -> None:
    # Go: if a.provider != "" { result.Metadata = map[string]string{"provider": a.provider} }
    ft = FakeTransport()
    ft.route(MODELS_PATH, Reply.json({"object": "list", "data": [{"id": "m1"}, {"id": "m2"}]}))
    async with compat(transport=ft, provider="lemonade") as a:
        probe = await a.probe()
        caps = await a.capabilities()
    assert (probe.provider, probe.adapter, probe.instance) == ("lemonade", "openai_compat", "lemon")
    assert caps.provider == "lemonade"
    assert caps.adapter == "openai_compat"
    assert caps.instance == "lemon"
    assert caps.targets == ("m1", "m2")
    assert caps.provider_status is ProviderStatus.AVAILABLE


async def test_003_probe_no_provider_label() -> None:
    # Go: if a.provider != "" {...}  (false: no provider metadata)
    ft = FakeTransport()
    ft.route(MODELS_PATH, Reply.json({"data": []}))
    async with compat(transport=ft) as a:
        assert (await a.probe()).provider == ""


async def test_003_capabilities_unavailable_keeps_configured_targets(refused_url: str) -> None:
    # Go: status := Available; if err != nil { status = Unavailable }
    async with compat(refused_url, targets=["fallback-model"]) as a:
        caps = await a.capabilities()
    assert caps.provider_status is ProviderStatus.UNAVAILABLE
    # Beyond the seed (which advertised no targets): the configured ones.
    assert caps.targets == ("fallback-model",)


@pytest.mark.parametrize("capacity", [0, -3])
def test_003_effective_capacity_default_8_when_le_0(capacity: int) -> None:
    # Go: func effectiveCapacity(capacity, defaultVal int) int { if capacity <= 0 { return defaultVal } }
    cfg = OpenAICompatInstance(name="x", endpoint="http://h", max_concurrency=capacity)
    assert cfg.max_concurrency == 8
    decoded = decode_config(
        {"adapter": "openai_compat", "name": "x", "endpoint": "http://h", "max_concurrency": 0},
        OpenAICompatInstance,
        source="node.toml",
    )
    assert decoded.max_concurrency == 8


async def test_003_effective_capacity_positive_kept_and_advertised() -> None:
    # Go: effectiveCapacity: return capacity  (capacity > 0)
    ft = FakeTransport()
    ft.route(MODELS_PATH, Reply.json({"data": []}))
    async with compat(transport=ft, max_concurrency=3) as a:
        assert (await a.capabilities()).max_concurrency == 3
    async with compat(transport=ft, max_concurrency=0) as a:
        assert (await a.capabilities()).max_concurrency == 8


async def test_003_probe_available_without_target(fb: FakeBackend) -> None:
    # Go: if target == "" { result.Status = Available; return result, nil }
    fb.route(MODELS_PATH, Reply.json(transcript_body("real-xllamacpp-models.txt")))
    async with compat(fb.url) as a:
        probe = await a.probe()
    assert probe.status is ProviderStatus.AVAILABLE
    assert probe.targets == ("SmolLM2-135M-Instruct",)
    assert probe.detail == ""
    assert fb.requests[-1].method == "GET"
    assert fb.requests[-1].path == "/v1/models"


async def test_003_probe_target_found(fb: FakeBackend) -> None:
    # Go: if found { result.Status = Available }
    fb.route(MODELS_PATH, Reply.json({"data": [{"id": "a"}, {"id": ""}, {"id": "b"}]}))
    async with compat(fb.url) as a:
        probe = await a.probe("b")
    assert probe.status is ProviderStatus.AVAILABLE
    # Go: if model.ID != "" { out = append(out, model.ID) }
    assert probe.targets == ("a", "b")
    assert probe.target == "b"


async def test_003_probe_target_not_found(fb: FakeBackend) -> None:
    # Go: else { Status = Unavailable; Detail = fmt.Sprintf("target model %q not found in provider models", target) }
    fb.route(MODELS_PATH, Reply.json({"data": [{"id": "a"}]}))
    async with compat(fb.url) as a:
        probe = await a.probe("zzz")
    assert probe.status is ProviderStatus.UNAVAILABLE
    assert "target model" in probe.detail
    assert "'zzz'" in probe.detail
    assert probe.detail.endswith("not found in provider models")
    assert probe.targets == ("a",)


async def test_003_probe_unavailable_connection_refused(refused_url: str) -> None:
    # Go: if err != nil { Status = Unavailable; Detail = err.Error() }  (fetchTargets: "request failed: %w")
    async with compat(refused_url) as a:
        probe = await a.probe("m")
        caps = await a.capabilities()
    assert probe.status is ProviderStatus.UNAVAILABLE
    assert probe.detail.startswith("request failed")
    # Beyond the seed: the cause, named, and on the wire in the capabilities.
    host_port = refused_url.split("//", 1)[1].rstrip("/")
    assert probe.detail == f"request failed: connection refused by {host_port}"
    assert caps.provider_detail == probe.detail


async def test_probe_detail_never_carries_userinfo_or_path(refused_url: str) -> None:
    host_port = refused_url.split("//", 1)[1]
    async with compat(f"http://admin:hunter2@{host_port}/secret-path?key=k3y") as a:
        detail = (await a.capabilities()).provider_detail
    assert detail == f"request failed: connection refused by {host_port}"


async def test_003_probe_unavailable_non_2xx(fb: FakeBackend) -> None:
    # Go: if resp.StatusCode < 200 || >= 300 { return nil, fmt.Errorf("status code %d", resp.StatusCode) }
    fb.route(MODELS_PATH, Reply.json({"error": "loading"}, status=503))
    async with compat(fb.url) as a:
        probe = await a.probe()
    assert probe.status is ProviderStatus.UNAVAILABLE
    assert probe.detail == "status code 503"


@pytest.mark.parametrize("payload", [b"<html>proxy error</html>", b'{"data": [{"id": 5}]}'])
async def test_003_probe_unavailable_bad_json(fb: FakeBackend, payload: bytes) -> None:
    # Go: if err := json.NewDecoder(resp.Body).Decode(&models); err != nil { "decode response: %w" }
    fb.route(MODELS_PATH, Reply.json(payload))
    async with compat(fb.url) as a:
        probe = await a.probe()
    assert probe.status is ProviderStatus.UNAVAILABLE
    assert probe.detail.startswith("decode response")


async def test_003_probe_null_data_is_an_empty_list(fb: FakeBackend) -> None:
    # Go: for _, model := range models.Data  (Ollama sends "data": null with no model)
    fb.route(MODELS_PATH, Reply.json({"object": "list", "data": None}))
    async with compat(fb.url) as a:
        probe = await a.probe()
    assert probe.status is ProviderStatus.AVAILABLE
    assert probe.targets == ()


async def test_003_probe_timeout_honoured(fb: FakeBackend) -> None:
    # Go: probeCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
    assert OpenAICompatInstance(name="x", endpoint="http://h").probe_timeout_s == 2.0
    fb.route(MODELS_PATH, Reply.json({"data": []}, stall_before_headers=True))
    async with compat(fb.url, probe_timeout_s=0.1) as a:
        started = trio.current_time()
        probe = await a.probe()
        elapsed = trio.current_time() - started
    assert probe.status is ProviderStatus.UNAVAILABLE
    assert "0.1" in probe.detail
    assert 0.1 <= elapsed < 2.0
    # The abandoned probe does not leave its connection open.
    conn = await fb.wait_client_closed(NOTICE_S)
    assert conn.closed_by_client


# --- applyHeaders ---------------------------------------------------------------------------


async def test_003_apply_headers_content_type_owned_on_post_kept_on_get(fb: FakeBackend) -> None:
    # Go: if jsonBody && http.CanonicalHeaderKey(k) == "Content-Type" { continue }
    #     req.Header.Set(k, v); if jsonBody { req.Header.Set("Content-Type", "application/json") }
    fb.route(MODELS_PATH, Reply.json({"data": [{"id": "m"}]}))
    fb.route(CHAT_COMPLETIONS_PATH, Reply.sse(HELLO))
    headers = {"Authorization": "Bearer sk-1", "X-Tenant": "t1", "content-type": "text/plain"}
    async with compat(fb.url, headers=headers) as a:
        await a.probe()
        events = await run(a, spec())
    last(events, Complete)
    get, post = fb.requests
    assert get.method == "GET"
    assert get.header("authorization") == "Bearer sk-1"
    assert get.header("x-tenant") == "t1"
    assert get.header_values("content-type") == ["text/plain"]
    assert post.method == "POST"
    assert post.header("authorization") == "Bearer sk-1"
    assert post.header("x-tenant") == "t1"
    assert post.header_values("content-type") == ["application/json"]


# --- buildRequestBody ---------------------------------------------------------------------


async def test_003_build_request_body_options_copied_adapter_fields_win() -> None:
    # Go: for k, v := range opts { body[k] = v }  then  body["model"] = model;
    #     body["messages"] = messages; body["stream"] = true
    ft = FakeTransport()
    ft.route(CHAT_COMPLETIONS_PATH, Reply.sse(HELLO))
    options = {
        "model": "x",
        "stream": False,
        "messages": [],
        "temperature": 0.3,
        "num_ctx": 4096,
    }
    async with compat(transport=ft) as a:
        events = await run(a, spec(target="served-model", options=options))
    last(events, Complete)
    body = body_of(ft.requests)
    assert body["model"] == "served-model"
    assert body["stream"] is True
    assert body["messages"] == [{"role": "user", "content": "What is the weather?"}]
    assert body["temperature"] == 0.3
    assert body["num_ctx"] == 4096


async def test_003_build_request_body_passthrough_keys() -> None:
    # Go: for _, key := range []string{"tools", "format", "think", "keep_alive"} {
    #         if v, ok := input[key]; ok { body[key] = v } }
    ft = FakeTransport()
    ft.route(CHAT_COMPLETIONS_PATH, Reply.sse(HELLO))
    fmt = {"type": "object", "properties": {"a": {"type": "string"}}}
    async with compat(transport=ft) as a:
        await run(a, spec(tools=[WEATHER], format=fmt, think=True, keep_alive="5m"))
        await run(a, spec())
    with_keys, without = body_of(ft.requests, 0), body_of(ft.requests, 1)
    assert [t["function"] for t in with_keys["tools"]] == [WEATHER_JSON["function"]]
    assert with_keys["format"] == fmt
    assert with_keys["think"] is True
    assert with_keys["keep_alive"] == "5m"
    # Go: if v, ok := input[key]; ok  (absent keys stay absent)
    for key in ("tools", "format", "think", "keep_alive"):
        assert key not in without


async def test_003_messages_keep_their_full_shape() -> None:
    # Go: messagesFromInput kept only string role/content (dropping tool calls,
    # tool results and content parts); IOP passes every message unchanged.
    ft = FakeTransport()
    ft.route(CHAT_COMPLETIONS_PATH, Reply.sse(HELLO))
    async with compat(transport=ft) as a:
        await run(a, spec(messages=msgspec.convert(FULL_SHAPE_MESSAGES, list[Message])))
    sent = body_of(ft.requests)["messages"]
    assert len(sent) == len(FULL_SHAPE_MESSAGES)
    for got, want in zip(sent, FULL_SHAPE_MESSAGES, strict=True):
        assert got == want


async def test_003_tools_and_tool_calls_keep_type_function() -> None:
    # Go: for _, key := range []string{"tools", ...} { body[key] = v }  (passed as received)
    ft = FakeTransport()
    ft.route(CHAT_COMPLETIONS_PATH, Reply.sse(HELLO))
    named = {"type": "function", "function": {"name": "get_weather"}}
    request = msgspec.convert(
        {
            "model": "m",
            "messages": FULL_SHAPE_MESSAGES,
            "tools": [WEATHER_JSON],
            "tool_choice": named,
        },
        ChatRequest,
    )
    async with compat(transport=ft) as a:
        await run(a, ExecutionSpec(run_id="r", request=request))
    body = body_of(ft.requests)
    assert body["tools"] == [WEATHER_JSON]
    assert body["tool_choice"] == named
    assert body["messages"] == FULL_SHAPE_MESSAGES


# --- joinOpenAIPath -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("http://h/v1", "http://h/v1/chat/completions"),
        ("http://h/v1/", "http://h/v1/chat/completions"),
        ("http://h", "http://h/v1/chat/completions"),
        ("http://h:8000/", "http://h:8000/v1/chat/completions"),
        ("http://h/api/v1", "http://h/api/v1/chat/completions"),
        ("http://h/v1beta", "http://h/v1beta/v1/chat/completions"),
        ("http://h/v1?key=1", "http://h/v1/chat/completions?key=1"),
    ],
)
def test_003_join_openai_path(endpoint: str, url: str) -> None:
    # Go: if strings.HasSuffix(basePath, "/v1") && strings.HasPrefix(path, "/v1/") {
    #         path = strings.TrimPrefix(path, "/v1") }
    assert join_openai_path(endpoint.rstrip("/"), CHAT_COMPLETIONS_PATH) == url
    assert join_openai_path(endpoint, CHAT_COMPLETIONS_PATH) == url


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
async def test_003_endpoint_joining_on_the_wire(fb: FakeBackend, suffix: str) -> None:
    # Go: joinOpenAIPath(a.endpoint, "/v1/chat/completions") and (a.endpoint, "/v1/models")
    fb.route(CHAT_COMPLETIONS_PATH, Reply.sse(HELLO))
    fb.route(MODELS_PATH, Reply.json({"data": []}))
    async with compat(fb.url + suffix) as a:
        await a.probe()
        await run(a, spec())
    assert [r.target for r in fb.requests] == ["/v1/models", "/v1/chat/completions"]


# --- Execute: validation -----------------------------------------------------------------------


@pytest.mark.parametrize("target", ["", "   "])
async def test_003_execute_model_required_error_without_start(target: str) -> None:
    # Go: if model == "" { return fmt.Errorf("openai_compat adapter: target/model is required") }
    #     (returned before sink.Emit(start))
    ft = FakeTransport()
    async with compat(transport=ft) as a:
        events = await run(a, spec(target=target, model=" "))
    [error] = events
    assert isinstance(error, Error)
    assert error.message == "openai_compat adapter: target/model is required"
    assert error.status == 400
    assert ft.requests == []


async def test_003_execute_target_wins_over_request_model() -> None:
    # Go: model := strings.TrimSpace(spec.Target); if model == "" { model = stringInput(spec.Input, "model") }
    ft = FakeTransport()
    ft.route(CHAT_COMPLETIONS_PATH, Reply.sse(HELLO))
    async with compat(transport=ft) as a:
        events = await run(a, spec(target="  served  ", model="asked"))
        await run(a, spec(model="asked"))
    assert events[0] == Start(target="served")
    assert [body_of(ft.requests, i)["model"] for i in (0, 1)] == ["served", "asked"]


async def test_003_execute_messages_required_error_without_start() -> None:
    # Go: if len(messages) == 0 { return fmt.Errorf("openai_compat adapter: messages are required") }
    ft = FakeTransport()
    async with compat(transport=ft) as a:
        events = await run(a, spec(messages=[]))
    [error] = events
    assert isinstance(error, Error)
    assert error.message == "openai_compat adapter: messages are required"
    assert ft.requests == []


# --- Execute: request and response status -------------------------------------------------------


async def test_003_execute_request_failed(refused_url: str) -> None:
    # Go: if err != nil { emitError("openai_compat request failed: %v", err) }
    async with compat(refused_url) as a:
        events = await run(a, spec())
    error = last(events, Error)
    assert error.message.startswith("openai_compat request failed")
    assert (error.status, error.code) == (503, "backend_unavailable")


async def test_003_execute_non_2xx_error_with_body_message(fb: FakeBackend) -> None:
    # Go: msg := readLimited(resp.Body, 4096); emitError("openai_compat returned %s: %s", resp.Status, msg)
    real = transcript_body("real-xllamacpp-errors.txt", 2)  # llama.cpp: context exceeded
    fb.route(CHAT_COMPLETIONS_PATH, Reply.json(real, status=400))
    async with compat(fb.url) as a:
        events = await run(a, spec())
    error = last(events, Error)
    assert error.message == (
        "openai_compat returned 400 Bad Request: request (3031 tokens) exceeds the available "
        "context size (2048 tokens), try increasing it"
    )
    assert error.status == 400


async def test_003_execute_non_2xx_empty_body_falls_back_to_status(fb: FakeBackend) -> None:
    # Go: if msg == "" { msg = resp.Status }
    fb.route(CHAT_COMPLETIONS_PATH, Reply.text(b"", status=503))
    async with compat(fb.url) as a:
        events = await run(a, spec())
    error = last(events, Error)
    assert (
        error.message == "openai_compat returned 503 Service Unavailable: 503 Service Unavailable"
    )
    assert error.status == 503


async def test_003_execute_non_2xx_body_read_is_bounded(fb: FakeBackend) -> None:
    # Go: readLimited(resp.Body, 4096)
    fb.route(CHAT_COMPLETIONS_PATH, Reply.text("E" * 50_000, status=422))
    async with compat(fb.url) as a:
        events = await run(a, spec())
    error = last(events, Error)
    assert error.status == 422
    assert error.message.startswith("openai_compat returned 422 Unprocessable Entity: EEE")
    assert error.message.count("E") <= 4096 + 2


# --- Execute: the stream -------------------------------------------------------------------------


async def test_003_stream_done_emits_complete() -> None:
    # Go: if payload == "[DONE]" { return sink.Emit(ctx, completeEvent(...finishReason, usage...)) }
    ft = FakeTransport()
    body = transcript_body("real-xllamacpp-chat-stream.txt")
    ft.route(CHAT_COMPLETIONS_PATH, Reply.sse(body + sse(chunk("after done"))))
    async with compat(transport=ft) as a:
        events = await run(a, spec())
    done = last(events, Complete)
    assert done.finish_reason is FinishReason.LENGTH
    assert done.usage == Usage(input_tokens=37, output_tokens=40, cached_input_tokens=24)
    assert "after done" not in text(events)
    assert text(events).startswith("The rainbow is a beautiful")


async def test_003_stream_reasoning_content_emits_reasoning_delta() -> None:
    # Go: if reasoning := choice.Delta.ReasoningContent; reasoning != "" { Emit(ReasoningDelta) }
    ft = FakeTransport()
    ft.route(
        CHAT_COMPLETIONS_PATH,
        Reply.sse(sse(chunk(reasoning_content="think"), chunk("answer"), "[DONE]")),
    )
    async with compat(transport=ft) as a:
        events = await run(a, spec())
    assert [type(e) for e in events] == [Start, ReasoningDelta, Delta, Complete]


async def test_003_stream_ignores_lines_that_are_not_data() -> None:
    # Go: if !strings.HasPrefix(line, "data: ") { continue }
    # (IOP parses full SSE: comments, other fields, and "data:" without a space.)
    body = (
        b": keep-alive\n\nevent: message\nid: 1\n"
        b'data:{"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n' + sse(chunk("b"), "[DONE]")
    )
    ft = FakeTransport()
    ft.route(CHAT_COMPLETIONS_PATH, Reply.sse(body))
    async with compat(transport=ft) as a:
        events = await run(a, spec())
    assert text(events) == "ab"
    last(events, Complete)


async def test_003_stream_malformed_chunk_counted() -> None:
    # Go: if err := json.Unmarshal([]byte(payload), &chunk); err != nil { continue }
    ft = FakeTransport()
    body = sse(chunk("a"), "{not json", chunk("b"), "[DONE]")
    ft.route(CHAT_COMPLETIONS_PATH, Reply.sse(body))
    async with compat(transport=ft) as a:
        events = await run(a, spec())
    assert last(events, Complete).malformed_chunks == 1
    assert text(events) == "ab"


async def test_003_stream_choice_less_chunk_skipped_usage_kept() -> None:
    # Go: if chunk.Usage != nil { usage = ... }  then  if len(chunk.Choices) == 0 { continue }
    ft = FakeTransport()
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    body = sse(chunk("a"), {"choices": [], "usage": usage}, {"choices": []}, "[DONE]")
    ft.route(CHAT_COMPLETIONS_PATH, Reply.sse(body))
    async with compat(transport=ft) as a:
        events = await run(a, spec())
    assert [type(e) for e in events] == [Start, Delta, Complete]
    assert last(events, Complete).usage == Usage(input_tokens=5, output_tokens=2)


async def test_003_stream_usage_nil_estimates_output_tokens() -> None:
    # Go: if usage == nil { usage = &runtime.UsageStats{OutputTokens: outputTokens} }
    # The seed counted words (strings.Fields); IOP counts streamed chunks (about
    # one token each) and flags the usage as estimated.
    ft = FakeTransport()
    ft.route(CHAT_COMPLETIONS_PATH, Reply.sse(HELLO))
    async with compat(transport=ft) as a:
        events = await run(a, spec())
    usage = last(events, Complete).usage
    assert usage.output_tokens == 3
    assert usage.input_tokens == 0
    assert usage.estimated


async def test_003_stream_scan_failed(fb: FakeBackend) -> None:
    # Go: if err := scanner.Err(); err != nil { emitError("openai_compat stream scan failed: %v") }
    fb.route(CHAT_COMPLETIONS_PATH, Reply.sse(HELLO, truncate_after_bytes=60, reset=True))
    async with compat(fb.url) as a:
        events = await run(a, spec())
    error = last(events, Error)
    assert error.message.startswith("openai_compat stream scan failed")
    assert error.code == "backend_stream_error"


async def test_003_stream_ended_without_done() -> None:
    # Go: emitError("openai_compat stream ended without [DONE]")
    ft = FakeTransport()
    ft.route(CHAT_COMPLETIONS_PATH, Reply.sse(sse(chunk("a", finish="stop"))))
    async with compat(transport=ft) as a:
        events = await run(a, spec())
    error = last(events, Error)
    assert error.message.startswith("openai_compat stream ended without [DONE]")
    assert text(events) == "a"


# =========================================================================================
# Seed 000: vllm/stream.go
# =========================================================================================

# --- prepareExecution --------------------------------------------------------------------


async def test_000_prepare_model_required_error_without_start() -> None:
    # Go: if model == "" { return nil, fmt.Errorf("vllm adapter: target/model is required") }
    ft = FakeTransport()
    async with vllm(transport=ft) as a:
        events = await run(a, spec(model=""))
    [error] = events
    assert isinstance(error, Error)
    assert error.message == "vllm adapter: target/model is required"
    assert ft.requests == []


async def test_000_prepare_messages_required_error_without_start() -> None:
    # Go: if len(messages) == 0 { return nil, fmt.Errorf("vllm adapter: messages are required") }
    ft = FakeTransport()
    async with vllm(transport=ft) as a:
        events = await run(a, spec(messages=[]))
    [error] = events
    assert isinstance(error, Error)
    assert error.message == "vllm adapter: messages are required"


async def test_000_prepare_request_carries_tools_and_tool_choice() -> None:
    # Go: if val, ok := spec.Input["tools"]; ok { chatReq.Tools = val }
    #     if val, ok := spec.Input["tool_choice"]; ok { chatReq.ToolChoice = val }; Stream: true
    ft = FakeTransport()
    ft.route(CHAT_COMPLETIONS_PATH, Reply.sse(VLLM_TEXT))
    async with vllm(transport=ft) as a:
        await run(a, spec(target="Qwen", tools=[WEATHER], tool_choice="auto"))
    body = body_of(ft.requests)
    assert body["model"] == "Qwen"
    assert body["stream"] is True
    assert body["tool_choice"] == "auto"
    assert [t["function"] for t in body["tools"]] == [WEATHER_JSON["function"]]


# --- requestWithFallback -------------------------------------------------------------------


async def test_000_first_response_2xx_no_fallback() -> None:
    # Go: if resp.StatusCode >= 200 && resp.StatusCode < 300 { return resp, false, nil }
    ft = FakeTransport()
    ft.script(CHAT_COMPLETIONS_PATH, Reply.sse(VLLM_TOOLS))
    async with vllm(transport=ft) as a:
        events = await run(a, spec(tools=[WEATHER], tool_choice="auto"))
    done = last(events, Complete)
    assert not done.text_tool_fallback
    assert len(ft.requests) == 1


@pytest.mark.parametrize(
    "error_body", [AUTO_TOOL_400, AUTO_TOOL_400_LEGACY], ids=["nested", "flat"]
)
async def test_000_auto_tool_choice_unsupported_single_tool_forced_retry(error_body: bytes) -> None:
    # Go: if isAutoToolChoiceUnsupportedError(msg) {
    #         if forced, ok := forcedToolChoiceForSingleTool(e.chatReq.Tools); ok {
    #             e.chatReq.ToolChoice = forced ... if 2xx { return resp, false, nil } } }
    ft = FakeTransport()
    ft.script(CHAT_COMPLETIONS_PATH, Reply.json(error_body, status=400), Reply.sse(VLLM_TOOLS))
    async with vllm(transport=ft) as a:
        events = await run(a, spec(tools=[WEATHER], tool_choice="auto"))
    done = last(events, Complete)
    assert not done.text_tool_fallback
    assert [c.name for c in done.tool_calls] == ["get_weather"]
    first, retry = body_of(ft.requests, 0), body_of(ft.requests, 1)
    assert first["tool_choice"] == "auto"
    assert retry["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert retry["tools"] == first["tools"]
    assert retry["messages"] == first["messages"]


async def test_000_auto_tool_choice_unsupported_two_tools_straight_to_text_fallback() -> None:
    # Go: forcedToolChoiceForSingleTool(tools) -> ok == false (two tools): no retry;
    #     then if fallbackReq, ok := textToolFallbackChatRequest(e.chatReq, msg); ok {...}
    ft = FakeTransport()
    ft.script(
        CHAT_COMPLETIONS_PATH, Reply.json(AUTO_TOOL_400, status=400), Reply.sse(VLLM_TEXT_TOOLS)
    )
    async with vllm(transport=ft) as a:
        events = await run(a, spec(tools=[WEATHER, TIME]))
    done = last(events, Complete)
    assert done.text_tool_fallback
    assert len(ft.requests) == 2
    fallback = body_of(ft.requests, 1)
    assert "tools" not in fallback
    assert "tool_choice" not in fallback
    assert "<tool_call>" in text(events)


async def test_000_forced_retry_still_tool_error_then_text_fallback() -> None:
    # Go: retry non-2xx: msg = readLimited(resp.Body, 4096)  then
    #     if fallbackReq, ok := textToolFallbackChatRequest(e.chatReq, msg); ok { ... return resp, true, nil }
    ft = FakeTransport()
    ft.script(
        CHAT_COMPLETIONS_PATH,
        Reply.json(AUTO_TOOL_400, status=400),
        Reply.json(TOOL_PARSER_400, status=400),
        Reply.sse(VLLM_TEXT_TOOLS),
    )
    async with vllm(transport=ft) as a:
        events = await run(a, spec(tools=[WEATHER], tool_choice="auto"))
    done = last(events, Complete)
    assert done.text_tool_fallback
    assert done.tool_calls == ()
    assert len(ft.requests) == 3
    fallback = body_of(ft.requests, 2)
    assert "tools" not in fallback
    assert "tool_choice" not in fallback
    system = fallback["messages"][0]
    assert system["role"] == "system"
    assert "<tools>" in system["content"]
    assert "get_weather" in system["content"]
    assert fallback["messages"][-1] == {"role": "user", "content": "What is the weather?"}


async def test_000_forced_retry_non_tool_error_is_reported() -> None:
    # Go: textToolFallbackChatRequest(e.chatReq, msg) -> ok == false; then
    #     emitError("vllm returned %s: %s", resp.Status, msg)  (the retry's status and body)
    ft = FakeTransport()
    ft.script(
        CHAT_COMPLETIONS_PATH,
        Reply.json(AUTO_TOOL_400, status=400),
        Reply.json(b'{"error":{"message":"engine dead","code":503}}', status=503),
    )
    async with vllm(transport=ft) as a:
        events = await run(a, spec(tools=[WEATHER], tool_choice="auto"))
    error = last(events, Error)
    assert error.status == 503
    assert error.message == "vllm returned 503 Service Unavailable: engine dead"
    assert len(ft.requests) == 2


async def test_000_text_fallback_non_2xx_error_with_last_status() -> None:
    # Go: fallback non-2xx: msg = readLimited(resp.Body, 4096); emitError("vllm returned %s: %s", resp.Status, msg)
    ft = FakeTransport()
    ft.script(
        CHAT_COMPLETIONS_PATH,
        Reply.json(AUTO_TOOL_400, status=400),
        Reply.json(b'{"error":{"message":"prompt too long","code":413}}', status=413),
    )
    async with vllm(transport=ft) as a:
        events = await run(a, spec(tools=[WEATHER, TIME]))
    error = last(events, Error)
    assert error.status == 413
    assert error.message == "vllm returned 413 Request Entity Too Large: prompt too long"
    assert len(ft.requests) == 2


async def test_000_text_fallback_disabled_reports_the_tool_error() -> None:
    # Beyond the seed: text_tool_fallback = false turns the fallback off.
    ft = FakeTransport()
    ft.script(CHAT_COMPLETIONS_PATH, Reply.json(AUTO_TOOL_400, status=400))
    async with vllm(transport=ft, text_tool_fallback=False) as a:
        events = await run(a, spec(tools=[WEATHER, TIME]))
    error = last(events, Error)
    assert error.status == 400
    assert "--enable-auto-tool-choice" in error.message
    assert len(ft.requests) == 1


@pytest.mark.parametrize("shape", ["nested", "flat"])
async def test_000_non_tool_400_error_without_retry(shape: str) -> None:
    # Go: !isAutoToolChoiceUnsupportedError(msg) and textToolFallbackChatRequest -> ok == false:
    #     emitError("vllm returned %s: %s", resp.Status, msg)
    message = "This model's maximum context length is 4096 tokens."
    body: dict[str, Any] = (
        {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
        if shape == "nested"
        else {"object": "error", "message": message, "type": "BadRequestError", "code": 400}
    )
    ft = FakeTransport()
    ft.script(CHAT_COMPLETIONS_PATH, Reply.json(body, status=400))
    async with vllm(transport=ft) as a:
        events = await run(a, spec(tools=[WEATHER], tool_choice="auto"))
    error = last(events, Error)
    assert error.status == 400
    assert error.message == f"vllm returned 400 Bad Request: {message}"
    # Beyond the seed: a context overflow gets OpenAI's code (iop.wire._errors).
    assert error.code == "context_length_exceeded"
    assert error.param == "messages"
    assert len(ft.requests) == 1


async def test_000_non_2xx_excerpt_is_bounded() -> None:
    # Go: msg := readLimited(resp.Body, 4096)
    ft = FakeTransport()
    ft.script(CHAT_COMPLETIONS_PATH, Reply.text("<html>" + "x" * 20_000, status=502))
    async with vllm(transport=ft) as a:
        events = await run(a, spec())
    error = last(events, Error)
    assert error.status == 502
    assert len(error.message.encode()) <= 4096 + 64


@pytest.mark.parametrize(
    ("failing", "message"),
    [
        (0, "vllm request failed"),
        (1, "vllm retry request failed"),
        (2, "vllm text tool fallback request failed"),
    ],
    ids=["first", "retry", "text-fallback"],
)
async def test_000_request_failed_at_each_step(failing: int, message: str) -> None:
    # Go: resp, err := v.doChatCompletion(...); if err != nil {
    #         emitError("vllm request failed: %v") / ("vllm retry request failed: %v")
    #         / ("vllm text tool fallback request failed: %v") }
    before = [Reply.json(AUTO_TOOL_400, status=400), Reply.json(TOOL_PARSER_400, status=400)]
    ft = FakeTransport()
    ft.script(CHAT_COMPLETIONS_PATH, *before[:failing], ConnectFailure())
    async with vllm(transport=ft) as a:
        events = await run(a, spec(tools=[WEATHER], tool_choice="auto"))
    error = last(events, Error)
    assert error.message.startswith(message + ":")
    assert (error.status, error.code) == (503, "backend_unavailable")
    assert len(ft.requests) == failing + 1


async def test_000_request_failed_on_a_real_refused_connection(refused_url: str) -> None:
    # Go: if err != nil { emitError("vllm request failed: %v", err) }  (on real sockets)
    async with vllm(refused_url) as a:
        events = await run(a, spec())
    error = last(events, Error)
    assert error.message.startswith("vllm request failed")
    assert error.status == 503


# --- consumeStream / handlePayload --------------------------------------------------------------


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
async def test_000_reasoning_from_either_field(field: str) -> None:
    # Go: reasoning := choice.Delta.ReasoningText(); if reasoning != "" { Emit(ReasoningDelta) }
    ft = FakeTransport()
    thoughts = [{"choices": [{"index": 0, "delta": {field: t}}]} for t in ("let me", " think")]
    body = sse(*thoughts, chunk("ok"), "[DONE]")
    ft.route(CHAT_COMPLETIONS_PATH, Reply.sse(body, split=Split.bytewise()))
    async with vllm(transport=ft) as a:
        events = await run(a, spec())
    assert [e.text for e in events if isinstance(e, ReasoningDelta)] == ["let me", " think"]
    assert text(events) == "ok"
    last(events, Complete)


async def test_000_reasoning_transcript_ge_v016() -> None:
    # Go: ReasoningText() reads "reasoning" (vLLM >= 0.16)
    ft = FakeTransport()
    ft.route(
        CHAT_COMPLETIONS_PATH,
        Reply.sse(transcript_body("vllm_reasoning_stream_ge_v0.16.txt"), split=Split.random(4)),
    )
    async with vllm(transport=ft) as a:
        events = await run(a, spec())
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    assert reasoning.startswith("\nOkay, the user said hi.")
    assert text(events) == "\n\nHello! How can I help?"


async def test_000_usage_with_cached_and_reasoning_tokens() -> None:
    # Go: if d := chunk.Usage.PromptTokensDetails; d != nil { CachedInputTokens = d.CachedTokens }
    #     if d := chunk.Usage.CompletionTokensDetails; d != nil { ReasoningTokens = d.ReasoningTokens }
    usage = {
        "prompt_tokens": 100,
        "completion_tokens": 20,
        "total_tokens": 120,
        "prompt_tokens_details": {"cached_tokens": 64},
        "completion_tokens_details": {"reasoning_tokens": 12},
    }
    ft = FakeTransport()
    ft.route(
        CHAT_COMPLETIONS_PATH, Reply.sse(sse(chunk("a", finish="stop", usage=usage), "[DONE]"))
    )
    async with vllm(transport=ft) as a:
        events = await run(a, spec())
    assert last(events, Complete).usage == Usage(
        input_tokens=100, output_tokens=20, cached_input_tokens=64, reasoning_tokens=12
    )


async def test_000_usage_in_the_choice_less_final_chunk() -> None:
    # Go: if len(chunk.Choices) == 0 { return nil }  comes before the usage branch, so the
    # seed dropped vLLM's usage chunk ("choices": []). IOP reads it.
    ft = FakeTransport()
    ft.route(CHAT_COMPLETIONS_PATH, Reply.sse(VLLM_TEXT))
    async with vllm(transport=ft) as a:
        events = await run(a, spec())
    assert last(events, Complete).usage == Usage(input_tokens=30, output_tokens=10)


async def test_000_malformed_chunk_counted() -> None:
    # Go: if err := json.Unmarshal([]byte(payload), &chunk); err != nil { return nil }
    # (the seed skipped silently; IOP counts and reports)
    ft = FakeTransport()
    ft.route(
        CHAT_COMPLETIONS_PATH, Reply.sse(sse(chunk("a"), '{"choices": [', chunk("b"), "[DONE]"))
    )
    async with vllm(transport=ft) as a:
        events = await run(a, spec())
    assert last(events, Complete).malformed_chunks == 1
    assert text(events) == "ab"


async def test_000_malformed_chunks_over_the_limit_fail() -> None:
    # Beyond the seed: past malformed_chunk_limit the run fails.
    ft = FakeTransport()
    ft.route(CHAT_COMPLETIONS_PATH, Reply.sse(sse(chunk("a"), "{", "{", chunk("b"), "[DONE]")))
    async with vllm(transport=ft, malformed_chunk_limit=1) as a:
        events = await run(a, spec())
    error = last(events, Error)
    assert error.code == "backend_protocol_error"


async def test_000_choice_less_chunk_skipped() -> None:
    # Go: if len(chunk.Choices) == 0 { return nil }
    ft = FakeTransport()
    body = sse({"choices": []}, {}, chunk("a"), {"choices": None}, "[DONE]")
    ft.route(CHAT_COMPLETIONS_PATH, Reply.sse(body))
    async with vllm(transport=ft) as a:
        events = await run(a, spec())
    assert [type(e) for e in events] == [Start, Delta, Complete]
    assert last(events, Complete).malformed_chunks == 0


async def test_000_tool_call_deltas_accumulated() -> None:
    # Go: if len(choice.Delta.ToolCalls) > 0 { s.toolCalls.AddDelta(choice.Delta.ToolCalls) }
    ft = FakeTransport()
    ft.route(CHAT_COMPLETIONS_PATH, Reply.sse(VLLM_TOOLS, split=Split.random(9)))
    async with vllm(transport=ft) as a:
        events = await run(a, spec(tools=[WEATHER]))
    done = last(events, Complete)
    [call] = done.tool_calls
    assert call.id == "chatcmpl-tool-01124f84c71ff641dd8be1b9f42082ac"
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}
    assert done.finish_reason is FinishReason.TOOL_CALLS
    assert done.usage == Usage(input_tokens=212, output_tokens=28)


async def test_000_parallel_tool_call_deltas_accumulated_by_index() -> None:
    # Go: AddDelta keyed by index (llama.cpp streams two calls, index 0 and 1)
    ft = FakeTransport()
    ft.route(CHAT_COMPLETIONS_PATH, Reply.sse(transcript_body("real-xllamacpp-tools.txt", 6)))
    async with vllm(transport=ft) as a:
        events = await run(a, spec(tools=[WEATHER]))
    calls = last(events, Complete).tool_calls
    assert [(c.index, c.name) for c in calls] == [(0, "get_weather"), (1, "get_weather")]
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}] * 2
    assert calls[0].id != calls[1].id


async def test_000_done_emits_complete() -> None:
    # Go: if payload == "[DONE]" { return session.emitComplete(ctx, sink) }
    ft = FakeTransport()
    body = sse(chunk("a", finish="length"), "[DONE]", chunk("ignored"))
    ft.route(CHAT_COMPLETIONS_PATH, Reply.sse(body))
    async with vllm(transport=ft) as a:
        events = await run(a, spec())
    done = last(events, Complete)
    assert done.finish_reason is FinishReason.LENGTH
    assert text(events) == "a"
    assert done == Complete(
        finish_reason=FinishReason.LENGTH, usage=Usage(output_tokens=1, estimated=True)
    )


async def test_000_scan_failed_on_connection_reset(fb: FakeBackend) -> None:
    # Go: if err := scanner.Err(); err != nil { emitError("vllm stream scan failed: %v") }
    cut = VLLM_TEXT.index(b"data: ", 400) + 10
    fb.route(CHAT_COMPLETIONS_PATH, Reply.sse(VLLM_TEXT, truncate_after_bytes=cut, reset=True))
    async with vllm(fb.url) as a:
        events = await run(a, spec())
    error = last(events, Error)
    assert error.message.startswith("vllm stream scan failed")
    assert (error.status, error.code) == (502, "backend_stream_error")


async def test_000_stream_ended_without_done() -> None:
    # Go: emitError("vllm stream ended without [DONE]")
    ft = FakeTransport()
    without_done = VLLM_TEXT[: VLLM_TEXT.index(b"data: [DONE]")]
    ft.route(CHAT_COMPLETIONS_PATH, Reply.sse(without_done))
    async with vllm(transport=ft) as a:
        events = await run(a, spec())
    error = last(events, Error)
    assert error.message.startswith("vllm stream ended without [DONE]")
    assert text(events) == "Hello! How can I help you today?"


# =========================================================================================
# Bugs found while writing these tests (fixed; kept as regression tests)
# =========================================================================================


async def test_000_non_2xx_gzip_encoded_error_body_is_decoded(fb: FakeBackend) -> None:
    # Go: msg := readLimited(resp.Body, 4096)  (resp.Body is transparently gunzipped)
    body = gzip.compress(CONTEXT_400)
    headers = (("content-type", "application/json"), ("content-encoding", "gzip"))
    fb.route(CHAT_COMPLETIONS_PATH, Reply(status=400, headers=headers, body=body))
    async with vllm(fb.url) as a:
        events = await run(a, spec())
    assert fb.requests[0].header("accept-encoding") is not None
    error = last(events, Error)
    assert "maximum context length is 4096 tokens" in error.message


async def test_000_keep_alive_connection_reused_after_done(fb: FakeBackend) -> None:
    # Go: defer resp.Body.Close() after [DONE]  (the seed had the same issue)
    fb.route(CHAT_COMPLETIONS_PATH, Reply.sse(VLLM_TEXT))
    async with vllm(fb.url) as a:
        for _ in range(3):
            last(await run(a, spec()), Complete)
    assert len(fb.connections) == 1
