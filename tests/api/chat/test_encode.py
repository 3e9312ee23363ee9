"""The edge's OpenAI output: every branch of seed 001's stream handler, and more.

Tests named ``test_seed_*`` cover one branch of seed 001's
``streamChatCompletion`` / ``streamBufferedChatCompletion`` each; the Go
condition is quoted in a comment. Every stream a test produces goes through
``check_stream``: decoded with IOP's own WHATWG SSE decoder, each chunk
validated against OpenAI's OpenAPI schema and the official SDK's pydantic
types, ``[DONE]`` exactly once and last. Several streams also go through the
real ``openai`` client (``sdk_stream``) over an in-memory transport of
``httpx2``, the HTTP client openai v3 is built on.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx2
import jsonschema
import msgspec
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from iop.api._openai_errors import cancel_status, error_body, openai_error_type
from iop.api._output import (
    PREVIEW_CHARS,
    has_xml_tool_call,
    normalize_tool_calls,
    strip_think,
    wrap_xml_completion,
)
from iop.api.chat._encode import KEEPALIVE, ChatCompletionCollector, ChatCompletionStream
from iop.config import OutputPolicy
from iop.errors import InvariantError
from iop.events import (
    Cancelled,
    CancelReason,
    Complete,
    Delta,
    Error,
    FinishReason,
    ReasoningDelta,
    RuntimeEvent,
    Start,
    ToolCall,
    Usage,
)
from iop.spec import ChatRequest, FunctionDef, Message, StreamOptions, Tool
from iop.wire import SSEDecoder, parse_tool_calls
from tests.edge._openai_schema import (
    rewrite_nullable,
    validate_chunk,
    validate_completion,
    validate_error,
)

RUN_ID = "run1"
COMPLETION_ID = f"chatcmpl-{RUN_ID}"
CREATED = 1_700_000_000
MODEL = "qwen3-8b"

WEATHER = Tool(
    function=FunctionDef(
        name="get_weather",
        parameters={"type": "object", "properties": {"city": {"type": "string"}}},
    )
)
TIME = Tool(function=FunctionDef(name="get_time"))
MESSAGES = [Message(role="user", content="What's the weather in Paris?")]
PLAIN = ChatRequest(model=MODEL, messages=MESSAGES, stream=True)
WITH_TOOLS = ChatRequest(model=MODEL, messages=MESSAGES, stream=True, tools=[WEATHER, TIME])
USAGE_ON = StreamOptions(include_usage=True)
STRICT = OutputPolicy(strict=True)
BUFFERED = OutputPolicy(strict=True, stream_buffer=True)

HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PARIS_ARGS = '{"city":"Paris"}'
USAGE = Usage(input_tokens=12, output_tokens=7, cached_input_tokens=4, reasoning_tokens=3)


# --- helpers -------------------------------------------------------------------------


def make_stream(
    request: ChatRequest = PLAIN, policy: OutputPolicy | None = None
) -> ChatCompletionStream:
    return ChatCompletionStream(COMPLETION_ID, CREATED, MODEL, request, policy)


def run_stream(
    events: Sequence[RuntimeEvent],
    request: ChatRequest = PLAIN,
    policy: OutputPolicy | None = None,
) -> bytes:
    stream = make_stream(request, policy)
    out = stream.start() + b"".join(stream.feed(e) for e in events)
    assert stream.finished
    return out


def decode(raw: bytes) -> list[Any]:
    """The data of each SSE event: parsed JSON, or the string ``[DONE]``."""
    decoder = SSEDecoder()
    events = decoder.feed(raw)
    assert decoder.close() is None  # nothing left half-framed
    return [e.data if e.data == "[DONE]" else json.loads(e.data) for e in events]


def check_stream(raw: bytes) -> list[dict[str, Any]]:
    """Validate a whole stream; return its JSON objects (without ``[DONE]``)."""
    items = decode(raw)
    assert items[-1] == "[DONE]"
    assert items.count("[DONE]") == 1
    objs: list[dict[str, Any]] = items[:-1]
    assert objs, "the role chunk is always sent"
    first = objs[0]
    assert first["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    for i, obj in enumerate(objs):
        if "error" in obj:
            assert i == len(objs) - 1, "an error ends the stream"
            validate_error(obj)
            continue
        validate_chunk(obj)
        ChatCompletionChunk.model_validate(obj, strict=False)
        assert obj["id"] == COMPLETION_ID
        assert obj["object"] == "chat.completion.chunk"
        assert obj["created"] == CREATED
        assert obj["model"] == MODEL
    return objs


def chunks(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if "error" not in o]


def deltas(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o["choices"][0]["delta"] for o in chunks(objs) if o["choices"]]


def content(objs: list[dict[str, Any]]) -> str:
    return "".join(d.get("content") or "" for d in deltas(objs))


def content_pieces(objs: list[dict[str, Any]]) -> list[str]:
    return [d["content"] for d in deltas(objs)[1:] if "content" in d]


def reasoning(objs: list[dict[str, Any]]) -> str:
    return "".join(d.get("reasoning_content") or "" for d in deltas(objs))


def tool_calls(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [tc for d in deltas(objs) for tc in d.get("tool_calls", ())]


def finish_reason(objs: list[dict[str, Any]]) -> str | None:
    reasons: list[str | None] = [
        o["choices"][0]["finish_reason"] for o in chunks(objs) if o["choices"]
    ]
    assert all(r is None for r in reasons[:-1])
    return reasons[-1]


def error_of(objs: list[dict[str, Any]]) -> dict[str, Any]:
    assert "error" in objs[-1]
    error: dict[str, Any] = objs[-1]["error"]
    return error


def sdk_client(handler: Any) -> tuple[httpx2.Client, openai.OpenAI]:
    http = httpx2.Client(transport=httpx2.MockTransport(handler))
    client = openai.OpenAI(
        api_key="k",
        base_url="http://edge.test/v1",
        http_client=http,
        max_retries=0,
        _strict_response_validation=True,
    )
    return http, client


def sdk_stream(raw: bytes) -> ChatCompletion:
    """Read ``raw`` as the official client does and accumulate it as its helper does."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=raw)

    http, client = sdk_client(handler)
    with http:
        state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
        for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        ):
            state.handle_chunk(chunk)
        return state.get_final_completion()


def sdk_create(status: int, body: bytes) -> ChatCompletion:
    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(status, headers={"content-type": "application/json"}, content=body)

    http, client = sdk_client(handler)
    with http:
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )


# --- seed 001: streamChatCompletion ---------------------------------------------------


def test_seed_role_chunk_first() -> None:
    # writeSSE(w, flusher, chatCompletionChunk{... Delta: chatDelta{Role: "assistant"}})
    stream = make_stream()
    objs = decode(stream.start())
    assert objs == [
        {
            "id": COMPLETION_ID,
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
    ]
    validate_chunk(objs[0])


def test_seed_delta_passes_through_without_tools() -> None:
    # case "delta": ... if toolTextFilter != nil { ... }  (nil: no tools)
    raw = run_stream([Start(), Delta("Hel"), Delta("lo "), Delta(HERMES), Complete()])
    objs = check_stream(raw)
    assert content_pieces(objs) == ["Hel", "lo ", HERMES]
    assert finish_reason(objs) == "stop"


def test_seed_delta_empty_is_skipped() -> None:
    # case "delta": if event.GetDelta() == "" { continue }
    stream = make_stream()
    stream.start()
    assert stream.feed(Delta("")) == b""
    assert stream.feed(Start()) == b""  # Start produces nothing either


def test_seed_delta_filter_holds_tool_call_back() -> None:
    # if toolTextFilter != nil { delta = toolTextFilter.Append(delta) }; if delta == "" { continue }
    stream = make_stream(WITH_TOOLS)
    stream.start()
    assert decode(stream.feed(Delta("Let me check. ")))[0]["choices"][0]["delta"] == {
        "content": "Let me check."
    }
    assert stream.feed(Delta("<tool")) == b""
    assert stream.feed(Delta('_call>\n{"name": "get_weather", ')) == b""
    assert stream.feed(Delta('"arguments": {"city": "Paris"}}\n</tool_call>')) == b""


def test_seed_reasoning_delta_sent_as_reasoning_content() -> None:
    # case "reasoning_delta": writeSSE(... chatDelta{ReasoningContent: event.GetDelta()})
    raw = run_stream(
        [Start(), ReasoningDelta("Hmm, "), ReasoningDelta("Paris."), Delta("Sunny."), Complete()]
    )
    objs = check_stream(raw)
    assert list(deltas(objs)[1:3]) == [
        {"reasoning_content": "Hmm, "},
        {"reasoning_content": "Paris."},
    ]
    assert reasoning(objs) == "Hmm, Paris."
    assert content(objs) == "Sunny."


def test_seed_reasoning_delta_empty_is_skipped() -> None:
    # case "reasoning_delta": if event.GetDelta() == "" { continue }
    stream = make_stream()
    stream.start()
    assert stream.feed(ReasoningDelta("")) == b""


def test_seed_reasoning_delta_dropped_under_strict() -> None:
    # if outputPolicy.Strict { continue }
    raw = run_stream(
        [Start(), ReasoningDelta("secret"), Delta("answer"), Complete()], policy=STRICT
    )
    objs = check_stream(raw)
    assert reasoning(objs) == ""
    assert "reasoning_content" not in json.dumps(objs)
    assert content(objs) == "answer"


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (FinishReason.STOP, "stop"),
        (FinishReason.LENGTH, "length"),
        (FinishReason.CONTENT_FILTER, "content_filter"),
    ],
)
def test_seed_complete_finish_reason_from_event(reason: FinishReason, expected: str) -> None:
    # finishReason := metadata["finish_reason"]; if finishReason == "" { finishReason = "stop" }
    objs = check_stream(run_stream([Delta("x"), Complete(finish_reason=reason)]))
    assert finish_reason(objs) == expected
    assert deltas(objs)[-1] == {}


def test_seed_complete_default_finish_reason_is_stop() -> None:
    # if finishReason == "" { finishReason = "stop" }
    objs = check_stream(run_stream([Complete()]))
    assert finish_reason(objs) == "stop"
    assert content(objs) == ""


def test_seed_complete_native_tool_calls_flush_pending_first() -> None:
    # if len(nativeToolCalls) > 0 { if toolTextFilter != nil { pending := toolTextFilter.Flush() ...
    #   writeContentDeltaSSE(pending) } ... writeToolCallsDeltaSSE(...); finishReason = "tool_calls" }
    call = ToolCall(id="call_abc", name="get_weather", arguments=PARIS_ARGS)
    raw = run_stream(
        [Start(), Delta("Checking <"), Complete(tool_calls=(call,))], request=WITH_TOOLS
    )
    objs = check_stream(raw)
    assert content_pieces(objs) == ["Checking", " <"]  # held text released before the calls
    kinds = [next(iter(d)) if d else "finish" for d in deltas(objs)[1:]]
    assert kinds == ["content", "content", "tool_calls", "finish"]
    assert tool_calls(objs) == [
        {
            "index": 0,
            "id": "call_abc",
            "type": "function",
            "function": {"name": "get_weather", "arguments": PARIS_ARGS},
        }
    ]
    assert finish_reason(objs) == "tool_calls"


def test_seed_complete_native_tool_calls_without_filter() -> None:
    # if len(nativeToolCalls) > 0 { if toolTextFilter != nil {...} }: no tools, no filter
    call = ToolCall(id="", name="get_weather", arguments="")
    objs = check_stream(run_stream([Delta("ok"), Complete(tool_calls=(call,))]))
    assert content(objs) == "ok"
    assert tool_calls(objs) == [
        {
            "index": 0,
            "id": f"call_{RUN_ID}_0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": "{}"},
        }
    ]
    assert finish_reason(objs) == "tool_calls"


def test_seed_complete_native_tool_calls_normalised_against_request_tools() -> None:
    # nativeToolCalls = normalizeNativeToolCallsForResponse(nativeToolCalls, req.Tools)
    calls = (
        ToolCall(id="a", name="GET_WEATHER", arguments=PARIS_ARGS, index=3),
        ToolCall(id="a", name="functions.get_time", arguments="  ", index=7),
        ToolCall(id="", name="functions.get_time:2", arguments="{}", index=9),
        ToolCall(id="b", name="unknown_tool", arguments="not json", index=1),
    )
    objs = check_stream(run_stream([Complete(tool_calls=calls)], request=WITH_TOOLS))
    assert [
        (tc["index"], tc["id"], tc["function"]["name"], tc["function"]["arguments"])
        for tc in tool_calls(objs)
    ] == [
        (0, "a", "get_weather", PARIS_ARGS),
        (1, f"call_{RUN_ID}_1", "get_time", "{}"),  # repeated id replaced
        (2, f"call_{RUN_ID}_2", "get_time", "{}"),
        (3, "b", "unknown_tool", "not json"),  # kept as the backend said
    ]


def test_seed_complete_synthesises_text_tool_calls_cleaned_text_first() -> None:
    # else if toolTextFilter != nil && shouldSynthesizeTextToolCalls(...) {
    #   cleaned, toolCalls := synthesizeToolCallsFromText(...); if len(toolCalls) > 0 {
    #   if remaining := unstreamedCleanedText(cleaned, emittedContent.String()); remaining != "" {...}
    #   writeToolCallsDeltaSSE(...); finishReason = "tool_calls" }
    raw = run_stream(
        [
            Delta("Let me check. "),
            Delta(HERMES[:20]),
            Delta(HERMES[20:]),
            Delta(" Then I answer."),
            Complete(text_tool_fallback=True),
        ],
        request=WITH_TOOLS,
    )
    objs = check_stream(raw)
    assert content_pieces(objs) == ["Let me check.", "  Then I answer."]
    assert content(objs) == parse_tool_calls("Let me check. " + HERMES + " Then I answer.").content
    assert tool_calls(objs) == [
        {
            "index": 0,
            "id": f"call_{RUN_ID}_0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": PARIS_ARGS},
        }
    ]
    kinds = [next(iter(d)) if d else "finish" for d in deltas(objs)[1:]]
    assert kinds == ["content", "content", "tool_calls", "finish"]
    assert finish_reason(objs) == "tool_calls"


def test_seed_complete_synthesis_without_remaining_text() -> None:
    # if remaining := unstreamedCleanedText(...); remaining != "" -- false: no extra content chunk
    objs = check_stream(
        run_stream([Delta(HERMES), Complete(text_tool_fallback=True)], request=WITH_TOOLS)
    )
    assert content(objs) == ""
    assert len(tool_calls(objs)) == 1


def test_seed_complete_synthesis_finding_no_calls_flushes_pending() -> None:
    # if len(toolCalls) > 0 {...} else if pending := toolTextFilter.Flush(); pending != "" {...}
    broken = "<tool_call>{not json}</tool_call>"
    raw = run_stream(
        [Delta("Hi "), Delta(broken), Complete(text_tool_fallback=True)], request=WITH_TOOLS
    )
    objs = check_stream(raw)
    assert content(objs) == "Hi " + broken
    assert tool_calls(objs) == []
    assert finish_reason(objs) == "stop"


def test_seed_complete_filter_without_synthesis_flushes_pending() -> None:
    # else if toolTextFilter != nil { if pending := toolTextFilter.Flush(); pending != "" {...} }
    raw = run_stream([Delta("Hi "), Delta(HERMES), Complete()], request=WITH_TOOLS)
    objs = check_stream(raw)
    assert content(objs) == "Hi " + HERMES  # no fallback flag: the text is the answer
    assert tool_calls(objs) == []
    assert finish_reason(objs) == "stop"


def test_seed_complete_filter_with_nothing_pending() -> None:
    # ... pending != "" -- false: only the finish chunk
    objs = check_stream(run_stream([Delta("plain"), Complete()], request=WITH_TOOLS))
    assert content_pieces(objs) == ["plain"]


@pytest.mark.parametrize(
    ("mode", "fallback", "synthesised"),
    [
        ("fallback", True, True),
        ("fallback", False, False),
        ("always", False, True),
        ("always", True, True),
        ("never", True, False),
        ("never", False, False),
    ],
)
def test_seed_should_synthesize_text_tool_calls(
    mode: Any, fallback: bool, synthesised: bool
) -> None:
    # shouldSynthesizeTextToolCalls(handle.Dispatch(), isTextToolFallback(metadata))
    policy = OutputPolicy(text_tool_calls=mode)
    raw = run_stream(
        [Delta(HERMES), Complete(text_tool_fallback=fallback)], request=WITH_TOOLS, policy=policy
    )
    objs = check_stream(raw)
    assert bool(tool_calls(objs)) is synthesised
    assert content(objs) == ("" if synthesised else HERMES)


def test_synthesis_needs_request_tools() -> None:
    # With no tools there is no filter (seed) and nothing to validate names against.
    policy = OutputPolicy(text_tool_calls="always")
    objs = check_stream(
        run_stream([Delta(HERMES), Complete(text_tool_fallback=True)], policy=policy)
    )
    assert tool_calls(objs) == []
    assert content(objs) == HERMES


def test_native_tool_calls_win_over_synthesis() -> None:
    call = ToolCall(id="call_n", name="get_time", arguments="{}")
    raw = run_stream(
        [Delta(HERMES), Complete(tool_calls=(call,), text_tool_fallback=True)], request=WITH_TOOLS
    )
    objs = check_stream(raw)
    assert [tc["id"] for tc in tool_calls(objs)] == ["call_n"]
    assert content(objs) == HERMES  # native branch: pending text is flushed, not parsed


def test_finish_reason_tool_calls_without_calls_is_stop() -> None:
    # vLLM issues #50477/#53363: prose with finish_reason "tool_calls" and no calls.
    objs = check_stream(
        run_stream([Delta("prose"), Complete(finish_reason=FinishReason.TOOL_CALLS)])
    )
    assert finish_reason(objs) == "stop"


@pytest.mark.parametrize(
    ("status", "type_"),
    [
        (400, "invalid_request_error"),
        (404, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "server_error"),
        (502, "server_error"),
        (200, "server_error"),
    ],
)
def test_seed_error_event_sends_error_object_then_done(status: int, type_: str) -> None:
    # case "error", "cancelled": msg := event.GetError() ... writeSSEError(w, flusher, msg)
    stream = make_stream()
    raw = (
        stream.start()
        + stream.feed(Delta("partial"))
        + stream.feed(Error(message="backend exploded", status=status, code="backend_http_error"))
    )
    objs = check_stream(raw)
    assert error_of(objs) == {
        "message": "backend exploded",
        "type": type_,
        "param": None,
        "code": "backend_http_error",
    }
    assert stream.finished
    assert stream.summary().outcome == "error"


def test_error_param_reaches_the_body_streamed_and_collected() -> None:
    event = Error(message="too long", status=400, code="context_length_exceeded", param="messages")
    stream = make_stream()
    objs = check_stream(stream.start() + stream.feed(Delta("x")) + stream.feed(event))
    assert error_of(objs)["param"] == "messages"
    status, body = collect([Start(), event])
    assert status == 400
    assert json.loads(body)["error"] == {
        "message": "too long",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }


def test_seed_error_default_message_is_run_failed() -> None:
    # if msg == "" { msg = "run failed" }
    objs = check_stream(run_stream([Error(message="")]))
    assert error_of(objs)["message"] == "run failed"


@pytest.mark.parametrize(
    ("event", "message", "code"),
    [
        (
            Cancelled(reason=CancelReason.NODE_LOST, message="node disconnected"),
            "node disconnected",
            "node_lost",
        ),
        (
            Cancelled(reason=CancelReason.IDLE_TIMEOUT),
            "timed out waiting for the next token",
            "idle_timeout",
        ),
        (Cancelled(reason=CancelReason.SHUTDOWN), "the server is shutting down", "shutdown"),
        (
            Cancelled(reason=CancelReason.EXPLICIT, message="cancelled by admin"),
            "cancelled by admin",
            "explicit",
        ),
    ],
)
def test_seed_cancelled_event_sends_error_object_then_done(
    event: Cancelled, message: str, code: str
) -> None:
    # case "error", "cancelled": msg = event.GetError() / event.GetMessage()
    objs = check_stream(run_stream([Start(), Delta("x"), event]))
    assert error_of(objs) == {
        "message": message,
        "type": "server_error",
        "param": None,
        "code": code,
    }


def test_seed_wait_timeout_via_fail() -> None:
    # case <-time.After(handle.WaitTimeout()): writeSSEError(w, flusher, errRunTimedOut.Error())
    stream = make_stream()
    raw = stream.start() + stream.feed(Delta("x")) + stream.fail("run timed out")
    objs = check_stream(raw)
    assert error_of(objs) == {
        "message": "run timed out",
        "type": "run_error",
        "param": None,
        "code": None,
    }
    assert stream.finished
    assert stream.summary().outcome == "failed"


def test_fail_before_start_still_sends_role_chunk_first() -> None:
    # if stream.Events == nil { writeSSEError(w, flusher, "run stream unavailable") }
    stream = make_stream()
    objs = check_stream(stream.fail("run stream unavailable", type="server_error", code="x"))
    assert error_of(objs)["code"] == "x"


def test_error_streams_raise_api_error_in_the_sdk() -> None:
    raw = run_stream(
        [Delta("partial"), Error(message="boom", status=502, code="backend_stream_error")]
    )

    with pytest.raises(openai.APIError) as info:
        sdk_stream(raw)
    assert info.value.message == "boom"
    assert info.value.code == "backend_stream_error"
    assert info.value.type == "server_error"


# --- usage ---------------------------------------------------------------------------


def test_include_usage_chunk_before_done() -> None:
    request = msgspec.structs.replace(PLAIN, stream_options=USAGE_ON)
    objs = check_stream(run_stream([Delta("hi"), Complete(usage=USAGE)], request=request))
    usage_chunk = objs[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {
        "prompt_tokens": 12,
        "completion_tokens": 7,
        "total_tokens": 19,
        "prompt_tokens_details": {"cached_tokens": 4},
        "completion_tokens_details": {"reasoning_tokens": 3},
    }
    # "All other chunks will also include a usage field, but with a null value."
    assert all(o["usage"] is None for o in objs[:-1])
    final = sdk_stream(run_stream([Delta("hi"), Complete(usage=USAGE)], request=request))
    assert final.usage is not None
    assert final.usage.total_tokens == 19


def test_no_usage_without_include_usage() -> None:
    for options in (None, StreamOptions(include_usage=False), StreamOptions()):
        request = msgspec.structs.replace(PLAIN, stream_options=options)
        objs = check_stream(run_stream([Delta("hi"), Complete(usage=USAGE)], request=request))
        assert all("usage" not in o for o in objs)
        assert objs[-1]["choices"][0]["finish_reason"] == "stop"


def test_no_usage_chunk_after_an_error() -> None:
    request = msgspec.structs.replace(PLAIN, stream_options=USAGE_ON)
    objs = check_stream(run_stream([Delta("hi"), Error(message="x")], request=request))
    assert [o.get("choices") for o in objs if o.get("usage")] == []


# --- strict, streaming -------------------------------------------------------------------


def test_strict_streaming_strips_think_blocks_across_splits() -> None:
    text = "<think>plan it</think>\n\nThe answer is 4. <THINK>again</think> Done."
    for size in (1, 2, 3, 7, len(text)):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        objs = check_stream(run_stream([Delta(p) for p in pieces] + [Complete()], policy=STRICT))
        assert content(objs) == "The answer is 4. Done."
        assert content(objs) == strip_think(text)


def test_strict_streaming_with_tools_strips_think_before_parsing() -> None:
    text = f"<think>maybe {HERMES}?</think>Sure. {HERMES}"
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
    objs = check_stream(
        run_stream(
            [Delta(p) for p in pieces] + [Complete(text_tool_fallback=True)],
            request=WITH_TOOLS,
            policy=STRICT,
        )
    )
    assert content(objs) == "Sure."
    assert len(tool_calls(objs)) == 1


def test_strict_streaming_releases_held_tag_prefix_at_the_end() -> None:
    objs = check_stream(run_stream([Delta("a < b, and x <thi"), Complete()], policy=STRICT))
    assert content(objs) == "a < b, and x <thi"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("plain", "plain"),
        ("<think>x</think>answer", "answer"),
        ("<think>x</think>\n\n  answer", "answer"),
        ("before <think>x</think> after", "before after"),
        ("<think>never closed", ""),
        ("answer <think>cut off by max_tokens", "answer "),
        ("prefilled reasoning</think>\nanswer", "prefilled reasoninganswer"),
        ("<Think>x</THINK>y", "y"),
        ("a<think>1</think>b<think>2</think>c", "abc"),
        ("<think><think>nested</think>rest", "rest"),
        ("x <thinking> y", "x <thinking> y"),
        ("</thin", "</thin"),
    ],
)
def test_strip_think(text: str, expected: str) -> None:
    assert strip_think(text) == expected


# --- seed 001: streamBufferedChatCompletion -------------------------------------------------


def test_seed_buffered_sends_nothing_until_the_end() -> None:
    stream = make_stream(WITH_TOOLS, BUFFERED)
    assert stream.buffered
    stream.start()
    assert stream.feed(Delta("Hello")) == b""
    assert stream.feed(ReasoningDelta("hmm")) == b""
    assert stream.keepalive() == KEEPALIVE == b": keep-alive\n\n"


def test_seed_buffered_native_tool_calls_text_first() -> None:
    # if len(nativeToolCalls) > 0 { ... if text != "" { writeSSE(Content: text) }
    #   writeSSE(ToolCalls: ...); finishReason = "tool_calls" }
    call = ToolCall(id="call_x", name="Get_Weather", arguments=PARIS_ARGS)
    raw = run_stream(
        [
            Delta("<think>hmm</think>"),
            Delta("Checking."),
            ReasoningDelta("r"),
            Complete(tool_calls=(call,)),
        ],
        request=WITH_TOOLS,
        policy=BUFFERED,
    )
    objs = check_stream(raw)
    assert content_pieces(objs) == ["Checking."]
    assert [tc["function"]["name"] for tc in tool_calls(objs)] == ["get_weather"]
    kinds = [next(iter(d)) if d else "finish" for d in deltas(objs)[1:]]
    assert kinds == ["content", "tool_calls", "finish"]
    assert finish_reason(objs) == "tool_calls"
    assert reasoning(objs) == ""


def test_seed_buffered_native_tool_calls_without_text() -> None:
    # if text != "" -- false: only the tool calls
    call = ToolCall(id="call_x", name="get_weather", arguments=PARIS_ARGS)
    objs = check_stream(run_stream([Complete(tool_calls=(call,))], WITH_TOOLS, BUFFERED))
    assert content_pieces(objs) == []
    assert len(tool_calls(objs)) == 1


def test_seed_buffered_synthesised_calls_cleaned_text_first() -> None:
    # else if shouldSynthesizeTextToolCalls(...) { if len(toolCalls) > 0 { if cleaned != "" {...}
    raw = run_stream(
        [Delta("Let me look. "), Delta(HERMES), Complete(text_tool_fallback=True)],
        WITH_TOOLS,
        BUFFERED,
    )
    objs = check_stream(raw)
    assert content_pieces(objs) == ["Let me look."]
    assert tool_calls(objs)[0]["id"] == f"call_{RUN_ID}_0"
    assert finish_reason(objs) == "tool_calls"


def test_seed_buffered_synthesised_calls_without_cleaned_text() -> None:
    # if cleaned != "" -- false
    objs = check_stream(
        run_stream([Delta(HERMES), Complete(text_tool_fallback=True)], WITH_TOOLS, BUFFERED)
    )
    assert content_pieces(objs) == []
    assert len(tool_calls(objs)) == 1


def test_seed_buffered_synthesis_finding_no_calls_sends_text() -> None:
    # if len(toolCalls) > 0 {...} else if text != "" { writeSSE(Content: text) }
    objs = check_stream(
        run_stream(
            [Delta("no calls here"), Complete(text_tool_fallback=True)], WITH_TOOLS, BUFFERED
        )
    )
    assert content_pieces(objs) == ["no calls here"]
    assert finish_reason(objs) == "stop"


def test_seed_buffered_plain_text() -> None:
    # } else if text != "" { writeSSE(Content: text) }
    objs = check_stream(run_stream([Delta("Hel"), Delta("lo"), Complete()], PLAIN, BUFFERED))
    assert content_pieces(objs) == ["Hello"]


def test_seed_buffered_empty_text() -> None:
    # text == "": no content chunk, just the finish chunk and [DONE]
    objs = check_stream(
        run_stream([Delta("<think>only thinking</think>"), Complete()], PLAIN, BUFFERED)
    )
    assert len(objs) == 2
    assert content(objs) == ""
    assert finish_reason(objs) == "stop"


def test_seed_buffered_error() -> None:
    # text, ... err := collectRunResult(...); if err != nil { writeSSEError(w, flusher, err.Error()) }
    stream = make_stream(PLAIN, BUFFERED)
    raw = stream.start() + stream.feed(Delta("x")) + stream.feed(Error(message="boom", status=503))
    objs = check_stream(raw)
    assert error_of(objs)["message"] == "boom"
    assert content(objs) == ""
    summary = stream.summary()
    assert summary.outcome == "error"
    assert summary.content_len == 1


def test_seed_buffered_usage() -> None:
    request = msgspec.structs.replace(PLAIN, stream_options=USAGE_ON)
    objs = check_stream(run_stream([Delta("hi"), Complete(usage=USAGE)], request, BUFFERED))
    assert objs[-1]["choices"] == []
    assert objs[-1]["usage"]["total_tokens"] == 19


def test_stream_buffer_without_strict_is_ignored() -> None:
    # if outputPolicy.Strict && outputPolicy.StreamBuffer
    stream = make_stream(PLAIN, OutputPolicy(stream_buffer=True))
    assert not stream.buffered
    stream.start()
    assert stream.feed(Delta("x")) != b""


# --- xml completion tool ---------------------------------------------------------------

XML = OutputPolicy(strict=True, stream_buffer=True, xml_completion_tool="attempt_completion")


def test_xml_completion_tool_wraps_plain_text() -> None:
    objs = check_stream(run_stream([Delta("<think>x</think>All done."), Complete()], PLAIN, XML))
    assert content(objs) == (
        "<attempt_completion>\n<result>\nAll done.\n</result>\n</attempt_completion>"
    )
    final = sdk_stream(run_stream([Delta("All done."), Complete()], PLAIN, XML))
    assert final.choices[0].message.content == wrap_xml_completion(
        "All done.", "attempt_completion"
    )


@pytest.mark.parametrize(
    "text",
    [
        "I'll read it.\n<read_file>\n<path>a.py</path>\n</read_file>",
        "<attempt_completion><result>ok</result></attempt_completion>",
        "   ",
        "",
    ],
)
def test_xml_completion_tool_leaves_tool_calls_and_blank_text(text: str) -> None:
    objs = check_stream(run_stream([Delta(text), Complete()], PLAIN, XML))
    assert content(objs) == text


def test_xml_completion_tool_not_with_tool_calls() -> None:
    call = ToolCall(id="c", name="get_time", arguments="{}")
    objs = check_stream(run_stream([Delta("text"), Complete(tool_calls=(call,))], WITH_TOOLS, XML))
    assert content(objs) == "text"


def test_xml_completion_tool_needs_strict() -> None:
    policy = OutputPolicy(xml_completion_tool="attempt_completion")
    _status, body = collect([Delta("All done."), Complete()], policy=policy)
    assert json.loads(body)["choices"][0]["message"]["content"] == "All done."


def test_has_xml_tool_call() -> None:
    assert has_xml_tool_call("<execute_command>\n<command>ls</command>\n</execute_command>")
    assert has_xml_tool_call("<done>x</done>", "done")
    assert not has_xml_tool_call("<thinking>x</thinking> and <b>bold</b>")
    assert not has_xml_tool_call("<read_file> never closed")


def test_output_policy_is_the_configs() -> None:
    # One OutputPolicy: the edge config's, decoded per model (forbids unknown keys).
    import iop.config

    assert OutputPolicy is iop.config.OutputPolicy
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"strict": True, "stirct": True}, OutputPolicy)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"text_tool_calls": "sometimes"}, OutputPolicy)


# --- stream mechanics ---------------------------------------------------------------


def test_feed_after_finished_raises() -> None:
    stream = make_stream()
    stream.start()
    stream.feed(Complete())
    assert stream.finished
    with pytest.raises(InvariantError):
        stream.feed(Delta("x"))
    with pytest.raises(InvariantError):
        stream.fail("x")
    with pytest.raises(InvariantError):
        stream.keepalive()


def test_start_twice_raises() -> None:
    stream = make_stream()
    stream.start()
    with pytest.raises(InvariantError):
        stream.start()


def test_feed_before_start_prepends_the_role_chunk() -> None:
    stream = make_stream()
    assert stream.keepalive() == KEEPALIVE  # allowed before the role chunk
    raw = stream.feed(Delta("hi")) + stream.feed(Complete())
    assert content(check_stream(raw)) == "hi"


def test_feed_many_joins_feeds() -> None:
    events: list[RuntimeEvent] = [
        Start(),
        Delta("a"),
        ReasoningDelta("r"),
        Delta(""),
        Delta("b"),
        Complete(),
    ]
    one = make_stream()
    many = make_stream()
    assert one.start() + b"".join(one.feed(e) for e in events) == many.start() + many.feed_many(
        events
    )


def test_content_chunk_template_matches_a_full_encoding() -> None:
    # The hot path builds chunks from byte templates; they must equal a real encoding.
    for request in (PLAIN, msgspec.structs.replace(PLAIN, stream_options=USAGE_ON)):
        stream = ChatCompletionStream('chatcmpl-"quoted"', CREATED, 'mo"del\n', request)
        stream.start()
        text = 'héllo "wörld"\n\t\u2028 </script> \x00'
        expected: dict[str, Any] = {
            "id": 'chatcmpl-"quoted"',
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": 'mo"del\n',
            "choices": [
                {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
            ],
        }
        if request.stream_options:
            expected["usage"] = None
        assert stream.feed(Delta(text)) == b"data: " + msgspec.json.encode(expected) + b"\n\n"


def test_lone_surrogates_are_replaced() -> None:
    objs = check_stream(run_stream([Delta("a\ud800b"), Complete()]))
    assert content(objs) == "a?b"
    objs = check_stream(run_stream([Error(message="bad \udc80 byte")]))
    assert error_of(objs)["message"] == "bad ? byte"


def test_summary() -> None:
    stream = make_stream(policy=STRICT)
    stream.start()
    assert stream.summary().outcome == "open"
    stream.feed(Delta("x" * 1500))
    stream.feed(Delta("y"))
    stream.feed(ReasoningDelta("think"))
    stream.feed(Complete(finish_reason=FinishReason.LENGTH))
    summary = stream.summary()
    assert summary.outcome == "complete"
    assert summary.finish_reason == "length"
    assert summary.content_len == 1501
    assert summary.reasoning_len == 5
    assert len(summary.content_preview) == PREVIEW_CHARS
    assert summary.content_preview.startswith("xxx")
    assert summary.reasoning_preview == "think"
    assert summary.strict
    assert not summary.stream_buffer


def test_summary_buffered_reports_normalised_output() -> None:
    stream = make_stream(WITH_TOOLS, XML)
    stream.start()
    stream.feed(ReasoningDelta("r"))
    stream.feed(Delta("<think>t</think>done"))
    stream.feed(Complete())
    summary = stream.summary()
    assert summary.normalized
    assert summary.reasoning_len == 0
    assert summary.content_preview.startswith("<attempt_completion>")
    assert summary.tool_calls == 0


def test_normalize_tool_calls_without_tools_keeps_names() -> None:
    calls = normalize_tool_calls(
        [ToolCall(id="x", name="functions.Anything", arguments="{}")], None, run_id="r"
    )
    assert calls == (ToolCall(id="x", name="functions.Anything", arguments="{}", index=0),)


def test_sdk_accumulates_tool_call_stream() -> None:
    call = ToolCall(id="call_abc", name="get_weather", arguments=PARIS_ARGS)
    raw = run_stream([Delta("Checking."), Complete(tool_calls=(call,))], request=WITH_TOOLS)
    final = sdk_stream(raw)
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert choice.message.tool_calls is not None
    [tc] = choice.message.tool_calls
    assert tc.type == "function"
    assert (tc.id, tc.function.name, tc.function.arguments) == (
        "call_abc",
        "get_weather",
        PARIS_ARGS,
    )


def test_sdk_reads_reasoning_and_content() -> None:
    raw = run_stream([ReasoningDelta("hmm"), Delta("4"), Complete()])
    final = sdk_stream(raw)
    assert final.choices[0].message.content == "4"
    assert final.choices[0].finish_reason == "stop"


def test_module_is_sans_io() -> None:
    # Loaded by path, so the test holds whatever iop/api/__init__.py imports.
    import iop.api.chat._encode as out_module
    import iop.api.chat._request as request_module

    io = ["trio", "httpx", "httpcore", "quart", "quart_trio", "hypercorn", "anyio"]
    for module in (out_module, request_module):
        code = (
            "import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('m', {module.__file__!r})\n"
            "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
            f"print(','.join(m for m in {io!r} if m in sys.modules))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
        )
        assert out.stdout.strip() == "", f"{Path(str(module.__file__)).name} imports {out.stdout}"


# --- errors ------------------------------------------------------------------------


def test_error_body_shape() -> None:
    body = json.loads(error_body("bad", type="invalid_request_error", param="model", code="x"))
    assert body == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "model", "code": "x"}
    }
    validate_error(body)


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (400, "invalid_request_error"),
        (401, "invalid_request_error"),
        (404, "invalid_request_error"),
        (429, "rate_limit_error"),
        (499, "invalid_request_error"),
        (500, "server_error"),
        (503, "server_error"),
        (302, "server_error"),
    ],
)
def test_openai_error_type(status: int, expected: str) -> None:
    assert openai_error_type(status) == expected


@pytest.mark.parametrize(
    ("reason", "status"),
    [
        (CancelReason.NODE_LOST, 503),
        (CancelReason.FIRST_TOKEN_TIMEOUT, 504),
        (CancelReason.IDLE_TIMEOUT, 504),
        (CancelReason.TOTAL_TIMEOUT, 504),
        (CancelReason.QUEUE_TIMEOUT, 504),
        (CancelReason.EXPLICIT, 500),
        (CancelReason.SHUTDOWN, 500),
        (CancelReason.CLIENT_DISCONNECT, 500),
    ],
)
def test_cancel_status(reason: CancelReason, status: int) -> None:
    assert cancel_status(reason) == status


# --- non-streaming ---------------------------------------------------------------------


def collect(
    events: Sequence[RuntimeEvent],
    request: ChatRequest = PLAIN,
    policy: OutputPolicy | None = None,
) -> tuple[int, bytes]:
    collector = ChatCompletionCollector(COMPLETION_ID, CREATED, MODEL, request, policy)
    collector.feed_many(events)
    assert collector.finished
    status, body = collector.result()
    obj = json.loads(body)
    if status == 200:
        validate_completion(obj)
        ChatCompletion.model_validate(obj)
        sdk = sdk_create(status, body)
        assert sdk.choices[0].message.content == obj["choices"][0]["message"]["content"]
    else:
        validate_error(obj)
    return status, body


def message_of(body: bytes) -> dict[str, Any]:
    message: dict[str, Any] = json.loads(body)["choices"][0]["message"]
    return message


def test_collector_plain_text_with_reasoning_and_usage() -> None:
    status, body = collect(
        [
            Start(),
            ReasoningDelta("hmm"),
            Delta("Hel"),
            Delta(""),
            Delta("lo"),
            Complete(usage=USAGE),
        ]
    )
    assert status == 200
    assert json.loads(body) == {
        "id": COMPLETION_ID,
        "object": "chat.completion",
        "created": CREATED,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Hello",
                    "refusal": None,
                    "reasoning_content": "hmm",
                },
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 12,
            "completion_tokens": 7,
            "total_tokens": 19,
            "prompt_tokens_details": {"cached_tokens": 4},
            "completion_tokens_details": {"reasoning_tokens": 3},
        },
    }


def test_collector_empty_answer_is_empty_string() -> None:
    _, body = collect([Complete()])
    assert message_of(body)["content"] == ""


def test_collector_native_tool_calls() -> None:
    calls = (ToolCall(id="", name="functions.get_weather", arguments=PARIS_ARGS),)
    _, body = collect([Complete(tool_calls=calls)], request=WITH_TOOLS)
    message = message_of(body)
    assert message["content"] is None
    assert message["tool_calls"] == [
        {
            "id": f"call_{RUN_ID}_0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": PARIS_ARGS},
        }
    ]
    assert json.loads(body)["choices"][0]["finish_reason"] == "tool_calls"


def test_collector_synthesised_tool_calls_with_cleaned_text() -> None:
    _, body = collect(
        [Delta("Let me check. " + HERMES), Complete(text_tool_fallback=True)], request=WITH_TOOLS
    )
    message = message_of(body)
    assert message["content"] == "Let me check."
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"


def test_collector_text_tools_without_synthesis_stay_text() -> None:
    _, body = collect([Delta(HERMES), Complete()], request=WITH_TOOLS)
    assert message_of(body)["content"] == HERMES
    assert "tool_calls" not in message_of(body)


def test_collector_strict_and_xml() -> None:
    _, body = collect([ReasoningDelta("r"), Delta("<think>x</think>Done."), Complete()], policy=XML)
    message = message_of(body)
    assert "reasoning_content" not in message
    assert message["content"] == wrap_xml_completion("Done.", "attempt_completion")


@pytest.mark.parametrize(
    ("event", "status", "type_", "code"),
    [
        (
            Error(message="bad params", status=400, code="backend_http_error"),
            400,
            "invalid_request_error",
            "backend_http_error",
        ),
        (Error(message="slow down", status=429, code="rate"), 429, "rate_limit_error", "rate"),
        (Error(message="", status=502), 502, "server_error", "backend_error"),
        (Error(message="odd", status=200), 500, "server_error", "backend_error"),
        (Cancelled(reason=CancelReason.NODE_LOST), 503, "server_error", "node_lost"),
        (Cancelled(reason=CancelReason.TOTAL_TIMEOUT), 504, "server_error", "total_timeout"),
        (Cancelled(reason=CancelReason.SHUTDOWN), 500, "server_error", "shutdown"),
        (
            Cancelled(reason=CancelReason.SLOW_CLIENT),
            408,
            "invalid_request_error",
            "slow_client",
        ),
    ],
)
def test_collector_errors(event: RuntimeEvent, status: int, type_: str, code: str) -> None:
    got_status, body = collect([Start(), Delta("partial"), event])
    assert got_status == status
    error = json.loads(body)["error"]
    assert (error["type"], error["code"], error["param"]) == (type_, code, None)
    assert error["message"]


def test_collector_errors_raise_in_the_sdk() -> None:
    _, body = collect([Error(message="bad params", status=400)])
    with pytest.raises(openai.BadRequestError) as info:
        sdk_create(400, body)
    assert info.value.message.endswith("bad params")
    assert info.value.code == "backend_error"  # Error.code default
    assert info.value.body == {
        "message": "bad params",
        "type": "invalid_request_error",
        "param": None,
        "code": "backend_error",
    }


def test_collector_mechanics() -> None:
    collector = ChatCompletionCollector(COMPLETION_ID, CREATED, MODEL, PLAIN)
    with pytest.raises(InvariantError):
        collector.result()
    assert collector.summary().outcome == "open"
    collector.feed(Delta("x"))
    collector.feed(Complete())
    with pytest.raises(InvariantError):
        collector.feed(Delta("late"))
    summary = collector.summary()
    assert (summary.outcome, summary.content_len, summary.finish_reason) == ("complete", 1, "stop")


# --- the schema helper itself ---------------------------------------------------------------


def test_schema_helper_rejects_what_openai_would() -> None:
    good = decode(make_stream().start())[0]
    validate_chunk(good)
    bad_finish = json.loads(json.dumps(good))
    bad_finish["choices"][0]["finish_reason"] = "abort"  # vLLM's, not OpenAI's
    missing_id = {k: v for k, v in good.items() if k != "id"}
    for bad in (bad_finish, missing_id):
        with pytest.raises(jsonschema.ValidationError):
            validate_chunk(bad)
    with pytest.raises(jsonschema.ValidationError):  # vLLM's integer code
        validate_error({"error": {"message": "m", "type": "t", "param": None, "code": 400}})


def test_rewrite_nullable() -> None:
    schema = {
        "properties": {
            "a": {"type": "string", "nullable": True},
            "b": {"type": "string", "enum": ["x"], "nullable": True},
            "c": {"$ref": "#/x", "nullable": True},
            "d": {"type": ["string", "null"], "nullable": True},
            "e": {"type": "string", "nullable": False},
        }
    }
    assert rewrite_nullable(schema) == {
        "properties": {
            "a": {"type": ["string", "null"]},
            "b": {"type": ["string", "null"], "enum": ["x", None]},
            "c": {"anyOf": [{"$ref": "#/x"}, {"type": "null"}]},
            "d": {"type": ["string", "null"]},
            "e": {"type": "string"},
        }
    }


# --- properties ----------------------------------------------------------------------------

FRAGMENTS = [
    "Hello",
    " ",
    "\n",
    "world",
    "<",
    ">",
    "tool",
    "_call",
    "<tool_call>",
    "</tool_call>",
    "<TOOL_CALL>",
    "{{tool_call}}",
    "{{/tool_call}}",
    "<function=get_weather>",
    "<parameter=city>",
    "Paris",
    "</parameter>",
    "</function>",
    "<think>",
    "</think>",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '{"name": "nope"}',
    "{",
    "}",
    '"',
    "é",
    "\u2028",
    "{{",
    "<th",
    "ink>",
]
fragment_text = st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join)
delta_lists = st.lists(st.one_of(fragment_text, st.text(max_size=8)), max_size=12)


def visible(objs: list[dict[str, Any]]) -> str:
    return "".join(content_pieces(objs))


@settings(max_examples=150, deadline=None)
@given(texts=delta_lists, reasoning_texts=st.lists(st.text(max_size=5), max_size=3))
def test_property_without_tools_content_is_exactly_the_deltas(
    texts: list[str], reasoning_texts: list[str]
) -> None:
    events: list[RuntimeEvent] = [Start()]
    for i, text in enumerate(texts):
        events.append(Delta(text))
        if i < len(reasoning_texts):
            events.append(ReasoningDelta(reasoning_texts[i]))
    events.append(Complete(text_tool_fallback=True))
    objs = check_stream(run_stream(events))
    assert visible(objs) == "".join(texts)
    assert reasoning(objs) == "".join(reasoning_texts[: len(texts)])
    assert all(p for p in content_pieces(objs))  # no empty content chunks


@settings(max_examples=150, deadline=None)
@given(texts=delta_lists, fallback=st.booleans())
def test_property_with_tools_raw_tool_syntax_never_leaks(texts: list[str], fallback: bool) -> None:
    full = "".join(texts)
    objs = check_stream(
        run_stream(
            [Delta(t) for t in texts] + [Complete(text_tool_fallback=fallback)], request=WITH_TOOLS
        )
    )
    shown = visible(objs)
    if not fallback:
        assert shown == full  # nothing synthesised: everything is released, losslessly
        return
    parsed = parse_tool_calls(full, [WEATHER, TIME])
    # Only what the parser itself judged not to be a call may reach the client.
    for opener in ("<tool_call", "<function="):
        if opener in shown.lower():
            assert opener in parsed.content.lower()
    if "{{tool_call" in shown:
        assert "{{tool_call" in parsed.content
    assert [(tc["function"]["name"], tc["function"]["arguments"]) for tc in tool_calls(objs)] == [
        (c.name, c.arguments) for c in parsed.calls
    ]


CALLS = [
    HERMES,
    '{{tool_call}}{"name": "get_time", "arguments": {}}{{/tool_call}}',
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
    "</tool_call>",
]
prose = (
    st.lists(st.sampled_from([*"abc <>_/\n\té{}", "tool", "call", "think"]), max_size=20)
    .map("".join)
    .filter(lambda s: "<tool_call" not in s.lower() and "<function=" not in s.lower())
)


@settings(max_examples=150, deadline=None)
@given(
    segments=st.lists(st.one_of(prose, st.sampled_from(CALLS)), min_size=1, max_size=6),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_property_well_formed_calls_become_tool_calls(segments: list[str], cuts: list[int]) -> None:
    full = "".join(segments)
    points = sorted({0, len(full), *(c for c in cuts if c < len(full))})
    pieces = [full[a:b] for a, b in itertools.pairwise(points)]
    objs = check_stream(
        run_stream(
            [Delta(p) for p in pieces] + [Complete(text_tool_fallback=True)], request=WITH_TOOLS
        )
    )
    shown = visible(objs)
    parsed = parse_tool_calls(full, [WEATHER, TIME], id_prefix=f"call_{RUN_ID}_")
    assert "<tool_call" not in shown.lower()
    assert "{{tool_call" not in shown
    assert "<function=" not in shown.lower()
    assert len(parsed.calls) == sum(s in CALLS for s in segments)
    assert [
        (tc["id"], tc["function"]["name"], tc["function"]["arguments"]) for tc in tool_calls(objs)
    ] == [(c.id, c.name, c.arguments) for c in parsed.calls]
    # The prose reaches the client (up to whitespace, which unstreamedCleanedText trims).
    assert "".join(shown.split()) == "".join(parsed.content.split())
    assert finish_reason(objs) == ("tool_calls" if parsed.calls else "stop")


@settings(max_examples=100, deadline=None)
@given(texts=delta_lists)
def test_property_strict_streaming_equals_buffered(texts: list[str]) -> None:
    events: list[RuntimeEvent] = [*(Delta(t) for t in texts), Complete()]
    streamed = check_stream(run_stream(events, policy=STRICT))
    buffered = check_stream(run_stream(events, policy=BUFFERED))
    assert visible(streamed) == visible(buffered) == strip_think("".join(texts))
    _, body = collect(events, policy=STRICT)
    assert message_of(body)["content"] == strip_think("".join(texts))


# --- the text kept for tool-call parsing is bounded -----------------------------------------


def test_text_kept_for_tool_parsing_past_the_limit_is_released_as_text() -> None:
    limit = 200
    policy = OutputPolicy(max_tool_text_chars=limit)
    stream = make_stream(WITH_TOOLS, policy)
    raw = stream.start()
    # An opener, then "arguments" that never end: the filter holds them back...
    raw += stream.feed(Delta("<tool_call>\n" + '{"name": "get_weather", "arguments": "'))
    piece = "x" * 50
    held = b""
    for _ in range(3):
        held += stream.feed(Delta(piece))
    assert held == b""  # still under the limit: nothing released
    # ...until the kept text crosses the limit: all of it goes out as text,
    # and from then on the answer streams as plain text.
    raw += held + stream.feed(Delta(piece))
    assert stream.tool_text_abandoned
    raw += stream.feed(Delta("tail"))
    raw += stream.feed(Complete(text_tool_fallback=True))
    objs = check_stream(raw)
    expected = '<tool_call>\n{"name": "get_weather", "arguments": "' + piece * 4 + "tail"
    assert content(objs) == expected
    assert tool_calls(objs) == []
    assert finish_reason(objs) == "stop"


def test_text_under_the_limit_still_becomes_tool_calls() -> None:
    policy = OutputPolicy(max_tool_text_chars=len(HERMES))
    stream = make_stream(WITH_TOOLS, policy)
    raw = (
        stream.start() + stream.feed(Delta(HERMES)) + stream.feed(Complete(text_tool_fallback=True))
    )
    assert not stream.tool_text_abandoned
    objs = check_stream(raw)
    assert [c["function"]["name"] for c in tool_calls(objs)] == ["get_weather"]


def test_native_tool_calls_survive_an_abandoned_text_parse() -> None:
    stream = make_stream(WITH_TOOLS, OutputPolicy(max_tool_text_chars=10))
    raw = stream.start() + stream.feed(Delta("a long answer, " * 3))
    assert stream.tool_text_abandoned
    call = ToolCall(id="c1", name="get_weather", arguments='{"city":"Paris"}')
    raw += stream.feed(Complete(tool_calls=(call,)))
    objs = check_stream(raw)
    assert content(objs) == "a long answer, " * 3
    assert [c["function"]["name"] for c in tool_calls(objs)] == ["get_weather"]
