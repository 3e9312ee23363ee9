"""The Messages encoder and collector: bytes, the SDK's own types, the SDK's own client."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anthropic
import httpx2
import msgspec
import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop.api import RunContext
from iop.api._shaped import Shaped, ShapedDone, ShapedFailed, ShapedReasoning, ShapedText
from iop.api.messages import MESSAGES, PING, MessagesCollector, MessagesStream
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
from tests.api.messages._sdk import (
    parse_sse,
    validate_count,
    validate_error,
    validate_event,
    validate_message,
)

_CTX = RunContext(run_id="r1", created=1, policy=OutputPolicy())
_EVENT: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)


def _call(**fields: Any) -> Any:
    body: dict[str, Any] = {
        "model": "claude-x",
        "max_tokens": 64,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    body.update(fields)
    return MESSAGES.parse(msgspec.json.encode(body), {})


def _stream(**fields: Any) -> MessagesStream:
    return MESSAGES.stream(_call(**fields), _CTX)


def _collector(**fields: Any) -> MessagesCollector:
    return MESSAGES.collector(_call(stream=False, **fields), _CTX)


def _checked(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = parse_sse(raw)
    for name, data in events:
        validate_event(name, data)
    return events


def _run(enc: MessagesStream, events: Sequence[RuntimeEvent]) -> bytes:
    return enc.start() + enc.feed_many(events)


# --- byte-exact ------------------------------------------------------------------------

_TEXT_RUN = (
    b"event: message_start\n"
    b'data: {"type":"message_start","message":{"id":"msg_r1","type":"message",'
    b'"role":"assistant","model":"claude-x","content":[],"stop_reason":null,'
    b'"stop_sequence":null,"usage":{"input_tokens":0,"cache_creation_input_tokens":0,'
    b'"cache_read_input_tokens":0,"output_tokens":0}}}\n\n'
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hel"}}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"lo \\""}}\n\n'
    b"event: content_block_stop\n"
    b'data: {"type":"content_block_stop","index":0}\n\n'
    b"event: message_delta\n"
    b'data: {"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},'
    b'"usage":{"input_tokens":7,"cache_creation_input_tokens":0,"cache_read_input_tokens":3,'
    b'"output_tokens":2}}\n\n'
    b"event: message_stop\n"
    b'data: {"type":"message_stop"}\n\n'
)


def test_text_run_bytes() -> None:
    enc = _stream()
    out = _run(
        enc,
        [
            Start(),
            Delta("Hel"),
            Delta('lo "'),
            Complete(usage=Usage(input_tokens=10, cached_input_tokens=3, output_tokens=2)),
        ],
    )
    assert out == _TEXT_RUN
    assert enc.finished
    _checked(out)


def test_tool_use_run_bytes() -> None:
    enc = _stream()
    call = ToolCall(id="toolu_1", name="bash", arguments='{"command": "ls"}')
    out = enc.feed_many(
        [
            Delta("Listing."),
            Complete(
                finish_reason=FinishReason.TOOL_CALLS,
                tool_calls=(call,),
                usage=Usage(input_tokens=5, output_tokens=9),
            ),
        ]
    )
    start, rest = out.split(b"\n\n", 1)
    assert start.startswith(b"event: message_start\n")  # feed before start() starts it
    assert rest == (
        b"event: content_block_start\n"
        b'data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}\n\n'
        b"event: content_block_delta\n"
        b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Listing."}}\n\n'
        b"event: content_block_stop\n"
        b'data: {"type":"content_block_stop","index":0}\n\n'
        b"event: content_block_start\n"
        b'data: {"type":"content_block_start","index":1,"content_block":{"type":"tool_use",'
        b'"id":"toolu_1","name":"bash","input":{}}}\n\n'
        b"event: content_block_delta\n"
        b'data: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta",'
        b'"partial_json":"{\\"command\\": \\"ls\\"}"}}\n\n'
        b"event: content_block_stop\n"
        b'data: {"type":"content_block_stop","index":1}\n\n'
        b"event: message_delta\n"
        b'data: {"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},'
        b'"usage":{"input_tokens":5,"cache_creation_input_tokens":0,"cache_read_input_tokens":0,'
        b'"output_tokens":9}}\n\n'
        b"event: message_stop\n"
        b'data: {"type":"message_stop"}\n\n'
    )
    _checked(out)


def test_ping_is_the_keepalive() -> None:
    enc = _stream()
    enc.start()
    assert enc.keepalive() == PING == b'event: ping\ndata: {"type":"ping"}\n\n'
    _checked(PING)


# --- blocks ------------------------------------------------------------------------------


def _names(raw: bytes) -> list[str]:
    return [
        f"{name}:{data.get('content_block', data.get('delta', {})).get('type', '')}"
        if name.startswith("content_block_s") or name == "content_block_delta"
        else name
        for name, data in _checked(raw)
    ]


def test_reasoning_then_text_are_two_blocks() -> None:
    raw = _run(_stream(), [ReasoningDelta("hmm"), ReasoningDelta("!"), Delta("ok"), Complete()])
    assert _names(raw) == [
        "message_start",
        "content_block_start:thinking",
        "content_block_delta:thinking_delta",
        "content_block_delta:thinking_delta",
        "content_block_stop:",
        "content_block_start:text",
        "content_block_delta:text_delta",
        "content_block_stop:",
        "message_delta",
        "message_stop",
    ]


def test_thinking_disabled_drops_reasoning() -> None:
    raw = _run(
        _stream(thinking={"type": "disabled"}), [ReasoningDelta("hmm"), Delta("ok"), Complete()]
    )
    assert "content_block_start:thinking" not in _names(raw)


def test_strict_policy_drops_reasoning() -> None:
    ctx = RunContext(run_id="r1", created=1, policy=OutputPolicy(strict=True))
    enc = MESSAGES.stream(_call(), ctx)
    raw = _run(enc, [ReasoningDelta("hmm"), Delta("ok"), Complete()])
    assert "content_block_start:thinking" not in _names(raw)


def test_a_run_without_output_gets_one_empty_text_block() -> None:
    raw = _run(_stream(), [Start(), Delta(""), Complete()])
    assert _names(raw) == [
        "message_start",
        "content_block_start:text",
        "content_block_stop:",
        "message_delta",
        "message_stop",
    ]


@pytest.mark.parametrize(
    ("finish", "stop"),
    [
        (FinishReason.STOP, "end_turn"),
        (FinishReason.LENGTH, "max_tokens"),
        (FinishReason.CONTENT_FILTER, "refusal"),
        (FinishReason.TOOL_CALLS, "end_turn"),  # a backend that claims calls but sent none
    ],
)
def test_stop_reasons(finish: FinishReason, stop: str) -> None:
    events = _checked(_run(_stream(), [Delta("x"), Complete(finish_reason=finish)]))
    assert events[-2][1]["delta"]["stop_reason"] == stop


def test_broken_tool_arguments_become_an_empty_input() -> None:
    call = ToolCall(id="t", name="f", arguments='{"a": ')
    events = _checked(_run(_stream(), [Complete(tool_calls=(call,))]))
    deltas = [d for n, d in events if n == "content_block_delta"]
    assert deltas == [
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "input_json_delta", "partial_json": "{}"},
        }
    ]


def test_native_calls_get_unique_ids() -> None:
    calls = (ToolCall(id="x", name="f"), ToolCall(id="x", name="g", index=5))
    events = _checked(_run(_stream(), [Complete(tool_calls=calls)]))
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [(b["id"], b["name"]) for b in starts] == [("x", "f"), ("call_r1_1", "g")]


# --- failures after the stream began -------------------------------------------------------


@pytest.mark.parametrize(
    ("terminal", "etype"),
    [
        (Cancelled(reason=CancelReason.NODE_LOST), "overloaded_error"),
        (Cancelled(reason=CancelReason.SHUTDOWN), "overloaded_error"),
        (Cancelled(reason=CancelReason.IDLE_TIMEOUT), "timeout_error"),
        (Cancelled(reason=CancelReason.TOTAL_TIMEOUT), "timeout_error"),
        (Cancelled(reason=CancelReason.EXPLICIT), "api_error"),
        (Error(message="backend broke", status=502, code="backend_stream_error"), "api_error"),
        (Error(message="no capacity", status=503, code="backend_unavailable"), "overloaded_error"),
        (Error(message="too long", status=400, code="backend_http_error"), "invalid_request_error"),
    ],
)
def test_a_failure_ends_with_one_error_event(terminal: RuntimeEvent, etype: str) -> None:
    enc = _stream()
    events = _checked(_run(enc, [Delta("par"), terminal]))
    assert [n for n, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "error",
    ]
    assert events[-1][1]["error"]["type"] == etype
    assert events[-1][1]["request_id"] == "req_r1"
    assert enc.finished


def test_node_lost_message() -> None:
    enc = _stream()
    raw = _run(
        enc, [Delta("x"), Cancelled(reason=CancelReason.NODE_LOST, message="node disconnected")]
    )
    assert raw.endswith(
        b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
        b'"message":"node disconnected"},"request_id":"req_r1"}\n\n'
    )


def test_fail_from_the_http_layer() -> None:
    enc = _stream()
    enc.start()
    events = _checked(
        enc.fail(504, "timed out waiting for the first token", code="first_token_timeout")
    )
    assert events == [
        (
            "error",
            {
                "type": "error",
                "error": {
                    "type": "timeout_error",
                    "message": "timed out waiting for the first token",
                },
                "request_id": "req_r1",
            },
        )
    ]


def test_nothing_after_the_end() -> None:
    enc = _stream()
    _run(enc, [Complete()])
    with pytest.raises(InvariantError):
        enc.feed_many([Delta("late")])
    with pytest.raises(InvariantError):
        enc.keepalive()
    with pytest.raises(InvariantError):
        enc.start()


def test_lone_surrogates_do_not_break_the_stream() -> None:
    events = _checked(_run(_stream(), [Delta("a\ud800b"), Complete()]))
    assert events[2][1]["delta"]["text"] == "a?b"


# --- hypothesis: any shaped sequence gives a well-formed stream ------------------------------

_calls = st.lists(
    st.builds(
        ToolCall,
        id=st.text(min_size=1, max_size=5),
        name=st.text(min_size=1, max_size=5),
        arguments=st.sampled_from(["{}", '{"a": 1}', "", "nope", "[1]"]),
    ),
    max_size=3,
).map(lambda cs: tuple(msgspec.structs.replace(c, index=i) for i, c in enumerate(cs)))
_usage = st.builds(
    Usage,
    input_tokens=st.integers(0, 10**6),
    output_tokens=st.integers(0, 10**6),
    cached_input_tokens=st.integers(0, 10**6),
)
_done = st.builds(
    ShapedDone,
    finish_reason=st.sampled_from(list(FinishReason)),
    calls=_calls,
    usage=_usage,
)
_failed = st.builds(
    ShapedFailed,
    status=st.sampled_from([400, 404, 429, 500, 502, 503, 504]),
    code=st.sampled_from(["x", *[r.value for r in CancelReason]]),
    message=st.text(max_size=20),
)
_body_events = st.lists(
    st.one_of(
        st.builds(ShapedText, st.text(max_size=8)),
        st.builds(ShapedReasoning, st.text(max_size=8)),
    ),
    max_size=12,
)


@given(body=_body_events, end=st.one_of(_done, _failed), pings=st.lists(st.integers(0, 12)))
def test_any_shaped_sequence_is_a_well_formed_stream(
    body: list[Shaped], end: Shaped, pings: list[int]
) -> None:
    enc = _stream()
    raw = enc.start()
    for i, event in enumerate(body):
        if i in pings:
            raw += enc.keepalive()
        raw += enc.feed_shaped([event])
    raw += enc.feed_shaped([end])
    assert enc.finished
    events = _checked(raw)
    names = [n for n, _ in events]
    assert names[0] == "message_start"
    assert names.count("message_start") == 1
    assert sum(n in ("message_stop", "error") for n in names) == 1
    assert names[-1] in ("message_stop", "error")
    if names[-1] == "message_stop":
        assert names[-2] == "message_delta"
    open_index: int | None = None
    last = -1
    for name, data in events:
        if name == "content_block_start":
            assert open_index is None
            assert data["index"] == last + 1
            open_index = last = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_index
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        elif name in ("message_delta", "error"):
            assert open_index is None  # every started block was stopped
    text = "".join(e.text for e in body if isinstance(e, ShapedText))
    streamed = "".join(
        d["delta"]["text"]
        for n, d in events
        if n == "content_block_delta" and d["delta"]["type"] == "text_delta"
    )
    assert streamed == text.encode("utf-8", "replace").decode("utf-8")


# --- the collector ---------------------------------------------------------------------------------


def _collect(events: Sequence[RuntimeEvent], **fields: Any) -> tuple[int, dict[str, Any]]:
    col = _collector(**fields)
    for event in events:
        col.feed(event)
    assert col.finished
    status, body = col.result()
    return status, msgspec.json.decode(body)


def test_collector_message() -> None:
    call = ToolCall(id="toolu_1", name="bash", arguments='{"command":"ls"}')
    status, body = _collect(
        [
            Start(),
            ReasoningDelta("think"),
            Delta("Let me "),
            Delta("look."),
            Complete(tool_calls=(call,), usage=Usage(input_tokens=12, output_tokens=4)),
        ]
    )
    assert status == 200
    message = validate_message(body)
    assert body == {
        "id": "msg_r1",
        "type": "message",
        "role": "assistant",
        "model": "claude-x",
        "content": [
            {"type": "thinking", "thinking": "think", "signature": ""},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "ls"}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 12,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 4,
        },
    }
    assert message.content[2].type == "tool_use"


def test_collector_empty_answer_has_one_empty_text_block() -> None:
    status, body = _collect([Complete(finish_reason=FinishReason.LENGTH)])
    assert status == 200
    validate_message(body)
    assert body["content"] == [{"type": "text", "text": ""}]
    assert body["stop_reason"] == "max_tokens"


def test_collector_only_tool_calls_has_no_text_block() -> None:
    status, body = _collect([Complete(tool_calls=(ToolCall(id="t", name="f", arguments=""),))])
    assert status == 200
    validate_message(body)
    assert body["content"] == [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]


@pytest.mark.parametrize(
    ("terminal", "status", "etype"),
    [
        (Cancelled(reason=CancelReason.NODE_LOST), 529, "overloaded_error"),
        (Cancelled(reason=CancelReason.QUEUE_TIMEOUT), 529, "overloaded_error"),
        (Cancelled(reason=CancelReason.FIRST_TOKEN_TIMEOUT), 504, "timeout_error"),
        (Cancelled(reason=CancelReason.CLIENT_DISCONNECT), 500, "api_error"),
        (Error(message="x", status=429, code="queue_full"), 429, "rate_limit_error"),
        (Error(message="x", status=404, code="model_not_found"), 404, "not_found_error"),
        (Error(message="x", status=422, code="backend_http_error"), 422, "invalid_request_error"),
        (Error(message="x", status=200, code="weird"), 500, "api_error"),
    ],
)
def test_collector_errors(terminal: RuntimeEvent, status: int, etype: str) -> None:
    got, body = _collect([Delta("x"), terminal])
    assert got == status
    validate_error(body)
    assert body["error"]["type"] == etype


def test_collector_refuses_events_after_the_end() -> None:
    col = _collector()
    col.feed(Complete())
    with pytest.raises(InvariantError):
        col.feed(Delta("late"))


def test_collector_result_before_the_end() -> None:
    with pytest.raises(InvariantError):
        _collector().result()


def test_collector_thinking_disabled() -> None:
    _, body = _collect([ReasoningDelta("x"), Delta("y"), Complete()], thinking={"type": "disabled"})
    assert [b["type"] for b in body["content"]] == ["text"]


# --- the official SDK's own client reads our bytes ----------------------------------------------


def _client(events: Sequence[RuntimeEvent]) -> anthropic.Anthropic:
    """An SDK client whose transport answers each request through the Messages surface."""

    def handle(request: httpx2.Request) -> httpx2.Response:
        body = request.read()
        if request.url.path.endswith("/count_tokens"):
            status, data, headers = MESSAGES.count_tokens(MESSAGES.parse_count_tokens(body))
            return httpx2.Response(status, content=data, headers=headers)
        call = MESSAGES.parse(body, dict(request.headers))
        if call.stream:
            enc = MESSAGES.stream(call, _CTX)
            data = enc.start() + enc.keepalive() + enc.feed_many(events)
            return httpx2.Response(200, content=data, headers={"content-type": "text/event-stream"})
        col = MESSAGES.collector(call, _CTX)
        for event in events:
            col.feed(event)
        status, data = col.result()
        return httpx2.Response(status, content=data, headers={"content-type": "application/json"})

    return anthropic.Anthropic(
        api_key="k",
        base_url="http://iop.test",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handle)),
    )


_TOOL_RUN: Sequence[RuntimeEvent] = (
    Start(),
    ReasoningDelta("The user wants files."),
    Delta("Listing."),
    Complete(
        finish_reason=FinishReason.TOOL_CALLS,
        tool_calls=(ToolCall(id="toolu_9", name="bash", arguments='{"command": "ls -l"}'),),
        usage=Usage(input_tokens=30, output_tokens=7, cached_input_tokens=10),
    ),
)
_ARGS: dict[str, Any] = {
    "model": "claude-x",
    "max_tokens": 100,
    "messages": [{"role": "user", "content": "list files"}],
    "tools": [{"name": "bash", "input_schema": {"type": "object"}}],
}


def test_sdk_stream_accumulates_our_events() -> None:
    with _client(_TOOL_RUN).messages.stream(**_ARGS) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert texts == ["Listing."]
    assert final.id == "msg_r1"
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "The user wants files."  # type: ignore[union-attr]
    tool = final.content[2]
    assert tool.type == "tool_use"
    assert (tool.id, tool.name, tool.input) == ("toolu_9", "bash", {"command": "ls -l"})
    assert final.stop_reason == "tool_use"
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (20, 10)
    assert final.usage.output_tokens == 7


def test_sdk_raw_stream_events_are_the_sdks_types() -> None:
    events = list(_client(_TOOL_RUN).messages.create(stream=True, **_ARGS))
    assert [e.type for e in events][:2] == ["message_start", "content_block_start"]
    assert events[-1].type == "message_stop"


def test_sdk_create_reads_our_message() -> None:
    message = _client(_TOOL_RUN).messages.create(**_ARGS)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.stop_reason == "tool_use"


def test_sdk_raises_our_stream_error() -> None:
    run = [Delta("partial"), Cancelled(reason=CancelReason.NODE_LOST, message="node disconnected")]
    with (
        pytest.raises(anthropic.APIStatusError, match="node disconnected") as info,
        _client(run).messages.stream(**_ARGS) as stream,
    ):
        stream.get_final_message()
    assert info.value.type == "overloaded_error"


@pytest.mark.parametrize(
    ("terminal", "exc"),
    [
        (Cancelled(reason=CancelReason.NODE_LOST), anthropic.OverloadedError),
        (Error(message="x", status=429, code="queue_full"), anthropic.RateLimitError),
        (Error(message="x", status=404, code="model_not_found"), anthropic.NotFoundError),
        (Cancelled(reason=CancelReason.TOTAL_TIMEOUT), anthropic.GatewayTimeoutError),
    ],
)
def test_sdk_raises_the_right_class_for_a_failed_call(
    terminal: RuntimeEvent, exc: Callable[..., Exception]
) -> None:
    with pytest.raises(exc):  # type: ignore[call-overload]
        _client([terminal]).messages.create(**_ARGS)


def test_sdk_count_tokens() -> None:
    count = _client([]).messages.count_tokens(
        model="claude-x", messages=[{"role": "user", "content": "x" * 40}]
    )
    validate_count(count.model_dump())
    assert count.input_tokens == 10 + 4


def test_reasoning_only_answer_has_an_empty_text_block_in_both_forms() -> None:
    run = [ReasoningDelta("hmm"), Complete()]
    names = _names(_run(_stream(), run))
    assert names[1:6] == [
        "content_block_start:thinking",
        "content_block_delta:thinking_delta",
        "content_block_stop:",
        "content_block_start:text",
        "content_block_stop:",
    ]
    _, body = _collect(run)
    assert [b["type"] for b in body["content"]] == ["thinking", "text"]


def _blocks(blocks: Sequence[Any]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for b in blocks:
        if b.type == "text":
            out.append(("text", b.text))
        elif b.type == "thinking":
            out.append(("thinking", b.thinking, b.signature))
        else:
            out.append(("tool_use", b.id, b.name, b.input))
    return out


@given(body=_body_events, done=_done)
def test_the_sdks_accumulated_stream_equals_the_collectors_message(
    body: list[Shaped], done: ShapedDone
) -> None:
    # accumulate_event is the SDK's own stream accumulator (what
    # MessageStream.get_final_message() returns), fed our events one by one.
    from anthropic.lib.streaming._messages import accumulate_event

    text = "".join(e.text for e in body if isinstance(e, ShapedText))
    reasoning = "".join(e.text for e in body if isinstance(e, ShapedReasoning))
    done = msgspec.structs.replace(done, content=text, reasoning=reasoning)
    enc = _stream()
    raw = enc.start() + enc.feed_shaped([*body, done])
    snapshot: Any = None
    json_bufs: dict[int, bytes] = {}
    for name, data in _checked(raw):
        if name == "ping":
            continue
        event = _EVENT.validate_python(data)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)
    col = _collector()
    col.feed_shaped([*body, done])
    status, collected = col.result()
    assert status == 200
    message = validate_message(msgspec.json.decode(collected))
    streamed_blocks = _blocks(snapshot.content)

    # The stream may split text or thinking into several blocks (they
    # alternate); the collector gives one of each. Joined, they agree.
    def joined(blocks: list[tuple[Any, ...]], kind: str) -> str:
        return "".join(b[1] for b in blocks if b[0] == kind)

    mine = _blocks(message.content)
    for kind in ("text", "thinking"):
        assert joined(streamed_blocks, kind) == joined(mine, kind)
    assert [b for b in streamed_blocks if b[0] == "tool_use"] == [
        b for b in mine if b[0] == "tool_use"
    ]
    assert snapshot.stop_reason == message.stop_reason
    assert snapshot.usage.model_dump() == message.usage.model_dump()
    assert snapshot.id == message.id
