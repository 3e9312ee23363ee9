"""The Responses stream and collector: bytes, OpenAI's schemas, the SDK's own parsing."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import httpx
import openai
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import omit
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from iop.api import RunContext
from iop.api._shaped import Shaped, ShapedDone, ShapedFailed, ShapedReasoning, ShapedText
from iop.api.responses import KEEPALIVE, ResponsesStream, ResponsesSurface, ResponseStore
from iop.config import OutputPolicy
from iop.errors import InvariantError, RequestError
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
from tests.api.responses._schema import validate_error, validate_event, validate_response

CREATED = 1_700_000_000
SHELL = {"type": "function", "name": "shell", "parameters": {"type": "object"}, "strict": False}


def _surface() -> ResponsesSurface:
    return ResponsesSurface(
        ResponseStore(max_entries=64, max_bytes=1 << 22, ttl_s=600), clock=lambda: 5.0
    )


def _stream(
    body: dict[str, Any], run_id: str = "r1", policy: OutputPolicy | None = None
) -> ResponsesStream:
    surface = _surface()
    call = surface.parse(json.dumps({"model": "m", "stream": True, **body}).encode(), {})
    return surface.stream(
        call, RunContext(run_id=run_id, created=CREATED, policy=policy or OutputPolicy())
    )


def _events(data: bytes) -> list[dict[str, Any]]:
    """Parse SSE bytes, checking that every ``event:`` line names its data's type."""
    out = []
    for block in data.decode().split("\n\n"):
        if not block or block.startswith(":"):
            continue
        event_line, data_line = block.split("\n")
        obj = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {obj['type']}"
        out.append(obj)
    return out


# --- byte-exact ---------------------------------------------------------------------------

RESP = (
    '{"id":"resp_r1","object":"response","created_at":1700000000,"status":"STATUS",'
    '"completed_at":DONE_AT,"error":null,"incomplete_details":null,"instructions":null,'
    '"max_output_tokens":null,"model":"m","output":OUTPUT,"parallel_tool_calls":true,'
    '"previous_response_id":null,"reasoning":{"effort":null,"summary":null},"store":true,'
    '"temperature":null,"text":{"format":{"type":"text"}},"tool_choice":TOOL_CHOICE,'
    '"tools":TOOLS,"top_p":null,"truncation":"disabled",USAGE"metadata":{}}'
)


def _resp(
    status: str, output: str = "[]", usage: str = "", done_at: str = "null", tools: str = "[]"
) -> str:
    return (
        RESP.replace("STATUS", status)
        .replace("DONE_AT", done_at)
        .replace("OUTPUT", output)
        .replace("TOOL_CHOICE", '"auto"')
        .replace("TOOLS", tools)
        .replace("USAGE", usage)
    )


def _sse(kind: str, data: str) -> str:
    return f"event: {kind}\ndata: {data}\n\n"


USAGE = (
    '"usage":{"input_tokens":5,"input_tokens_details":{"cached_tokens":1,"cache_write_tokens":0},'
    '"output_tokens":2,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":7},'
)


def test_a_text_run_byte_for_byte() -> None:
    enc = _stream({"input": "hi"})
    out = enc.start() + enc.keepalive()
    out += enc.feed_many(
        [
            Start(),
            Delta("Hel"),
            Delta("lo"),
            Complete(usage=Usage(input_tokens=5, output_tokens=2, cached_input_tokens=1)),
        ]
    )
    msg = (
        '{"type":"message","id":"msg_r1_0","status":"STATUS","role":"assistant","content":CONTENT}'
    )
    part = '{"type":"output_text","text":"TEXT","annotations":[],"logprobs":[]}'
    done_item = msg.replace("STATUS", "completed").replace(
        "CONTENT", "[" + part.replace("TEXT", "Hello") + "]"
    )
    ids = '"item_id":"msg_r1_0","output_index":0,"content_index":0'
    expected = "".join(
        [
            _sse(
                "response.created",
                f'{{"type":"response.created","sequence_number":0,"response":{_resp("in_progress")}}}',
            ),
            _sse(
                "response.in_progress",
                f'{{"type":"response.in_progress","sequence_number":1,"response":{_resp("in_progress")}}}',
            ),
            # OpenAI's keepalive event, numbered in the stream's sequence.
            _sse("keepalive", '{"type":"keepalive","sequence_number":2}'),
            _sse(
                "response.output_item.added",
                '{"type":"response.output_item.added","sequence_number":3,"output_index":0,"item":'
                + msg.replace("STATUS", "in_progress").replace("CONTENT", "[]")
                + "}",
            ),
            _sse(
                "response.content_part.added",
                f'{{"type":"response.content_part.added","sequence_number":4,{ids},"part":'
                + part.replace("TEXT", "")
                + "}",
            ),
            _sse(
                "response.output_text.delta",
                f'{{"type":"response.output_text.delta","sequence_number":5,{ids},"delta":"Hel","logprobs":[]}}',
            ),
            _sse(
                "response.output_text.delta",
                f'{{"type":"response.output_text.delta","sequence_number":6,{ids},"delta":"lo","logprobs":[]}}',
            ),
            _sse(
                "response.output_text.done",
                f'{{"type":"response.output_text.done","sequence_number":7,{ids},"text":"Hello","logprobs":[]}}',
            ),
            _sse(
                "response.content_part.done",
                f'{{"type":"response.content_part.done","sequence_number":8,{ids},"part":'
                + part.replace("TEXT", "Hello")
                + "}",
            ),
            _sse(
                "response.output_item.done",
                f'{{"type":"response.output_item.done","sequence_number":9,"output_index":0,"item":{done_item}}}',
            ),
            _sse(
                "response.completed",
                '{"type":"response.completed","sequence_number":10,"response":'
                + _resp("completed", output=f"[{done_item}]", usage=USAGE, done_at="1700000000")
                + "}",
            ),
        ]
    )
    assert out.decode() == expected
    assert enc.finished


def test_a_tool_call_run_byte_for_byte() -> None:
    enc = _stream({"input": "list", "tools": [SHELL]})
    call = ToolCall(id="call_9", name="shell", arguments='{"cmd":"ls"}')
    enc.start()  # created + in_progress, as in the text run
    out = enc.feed_many([Complete(finish_reason=FinishReason.TOOL_CALLS, tool_calls=(call,))])
    tools = '[{"type":"function","name":"shell","description":null,"parameters":{"type":"object"},"strict":false}]'
    fc = '{"type":"function_call","id":"fc_r1_0","status":"STATUS","call_id":"call_9","name":"shell","arguments":ARGS}'
    args = json.dumps('{"cmd":"ls"}')
    done_item = fc.replace("STATUS", "completed").replace("ARGS", args)
    zero = (
        '"usage":{"input_tokens":0,"input_tokens_details":{"cached_tokens":0,"cache_write_tokens":0},'
        '"output_tokens":0,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":0},'
    )
    expected = "".join(
        [
            _sse(
                "response.output_item.added",
                '{"type":"response.output_item.added","sequence_number":2,"output_index":0,"item":'
                + fc.replace("STATUS", "in_progress").replace("ARGS", '""')
                + "}",
            ),
            _sse(
                "response.function_call_arguments.delta",
                '{"type":"response.function_call_arguments.delta","sequence_number":3,'
                f'"item_id":"fc_r1_0","output_index":0,"delta":{args}}}',
            ),
            _sse(
                "response.function_call_arguments.done",
                '{"type":"response.function_call_arguments.done","sequence_number":4,'
                f'"item_id":"fc_r1_0","output_index":0,"name":"shell","arguments":{args}}}',
            ),
            _sse(
                "response.output_item.done",
                f'{{"type":"response.output_item.done","sequence_number":5,"output_index":0,"item":{done_item}}}',
            ),
            _sse(
                "response.completed",
                '{"type":"response.completed","sequence_number":6,"response":'
                + _resp(
                    "completed",
                    output=f"[{done_item}]",
                    usage=zero,
                    done_at="1700000000",
                    tools=tools,
                )
                + "}",
            ),
        ]
    )
    assert out.decode() == expected


# --- every event and every response against OpenAI's schemas ------------------------------

RUNS: dict[str, list[RuntimeEvent]] = {
    "text": [
        Start(),
        Delta("Hello"),
        Delta(" world"),
        Complete(usage=Usage(input_tokens=3, output_tokens=2)),
    ],
    "reasoning": [
        ReasoningDelta("hmm"),
        Delta("answer"),
        Complete(usage=Usage(reasoning_tokens=1)),
    ],
    "tools": [
        Delta("calling"),
        Complete(
            tool_calls=(
                ToolCall(id="a", name="shell", arguments='{"c":1}'),
                ToolCall(id="", name="shell", arguments=""),
            )
        ),
    ],
    "length": [Delta("cut"), Complete(finish_reason=FinishReason.LENGTH)],
    "filtered": [Delta("x"), Complete(finish_reason=FinishReason.CONTENT_FILTER)],
    "empty": [Complete()],
    "error": [
        Delta("part"),
        Error(message="backend broke", status=502, code="backend_stream_error"),
    ],
    "rate": [Error(message="slow down", status=429, code="backend_http_error")],
    "cancelled": [ReasoningDelta("r"), Cancelled(reason=CancelReason.IDLE_TIMEOUT)],
}


@pytest.mark.parametrize("name", RUNS)
def test_every_streamed_event_validates_against_openais_schema(name: str) -> None:
    enc = _stream(
        {"input": "hi", "tools": [SHELL], "metadata": {"k": "v"}, "reasoning": {"effort": "low"}}
    )
    events = _events(enc.start() + enc.feed_many(RUNS[name]))
    for event in events:
        validate_event(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    terminal = events[-1]
    assert terminal["type"] in ("response.completed", "response.incomplete", "response.failed")
    validate_response(terminal["response"])


@pytest.mark.parametrize("name", RUNS)
def test_every_collected_body_validates_against_openais_schema(name: str) -> None:
    surface = _surface()
    call = surface.parse(json.dumps({"model": "m", "input": "hi", "tools": [SHELL]}).encode(), {})
    col = surface.collector(call, RunContext(run_id="r1", created=CREATED, policy=OutputPolicy()))
    for event in RUNS[name]:
        assert not col.finished
        col.feed(event)
    status, body = col.result()
    obj = json.loads(body)
    if status == 200:
        validate_response(obj)
        Response.model_validate(obj)
    else:
        validate_error(obj)
        assert status >= 400


def test_length_is_incomplete_with_max_output_tokens() -> None:
    enc = _stream({"input": "hi", "max_output_tokens": 16})
    events = _events(enc.start() + enc.feed_many(RUNS["length"]))
    last = events[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["status"] == "incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["max_output_tokens"] == 16
    assert last["response"]["output"][0]["status"] == "incomplete"


def test_a_failure_after_the_start_closes_open_items_then_fails_the_response() -> None:
    enc = _stream({"input": "hi"})
    events = _events(enc.start() + enc.feed_many(RUNS["cancelled"]))
    kinds = [e["type"] for e in events]
    assert kinds[-2:] == ["response.output_item.done", "response.failed"]
    assert events[-2]["item"]["status"] == "incomplete"
    failed = events[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {
        "code": "server_error",
        "message": "timed out waiting for the next token (idle_timeout)",
    }
    rate = _events(_stream({"input": "hi"}).feed_many(RUNS["rate"]))
    assert rate[-1]["response"]["error"]["code"] == "rate_limit_exceeded"


def test_collector_failure_is_openais_error_body_with_the_runs_status() -> None:
    surface = _surface()
    call = surface.parse(b'{"model": "m", "input": "hi"}', {})
    col = surface.collector(call, RunContext(run_id="r1", created=CREATED, policy=OutputPolicy()))
    col.feed(Cancelled(reason=CancelReason.NODE_LOST))
    status, body = col.result()
    assert status == 503
    assert json.loads(body) == {
        "error": {
            "message": "node disconnected",
            "type": "server_error",
            "param": None,
            "code": "node_lost",
        }
    }


def test_strict_policy_sends_no_reasoning() -> None:
    enc = _stream({"input": "hi"}, policy=OutputPolicy(strict=True))
    events = _events(enc.start() + enc.feed_many(RUNS["reasoning"]))
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["message"]


def test_the_stream_refuses_use_after_its_end() -> None:
    enc = _stream({"input": "hi"})
    enc.feed_many([Complete()])  # start() is implied
    with pytest.raises(InvariantError):
        enc.feed_many([Delta("late")])
    with pytest.raises(InvariantError):
        enc.keepalive()
    with pytest.raises(InvariantError):
        enc.start()


def test_a_keepalive_before_the_start_is_a_comment_after_it_an_event() -> None:
    # Before response.created there is no sequence to number an event in;
    # after it, Codex's idle timer only sees events (tests/agents/test_through_iop.py).
    enc = _stream({"input": "hi"})
    assert enc.keepalive() == KEEPALIVE == b": keep-alive\n\n"
    enc.start()  # sequence numbers 0 and 1
    first = enc.keepalive()
    assert first == b'event: keepalive\ndata: {"type":"keepalive","sequence_number":2}\n\n'
    (event,) = _events(first + enc.keepalive())[:1]
    validate_event(event)
    out = enc.feed_many([Complete()]).decode()
    assert '"type":"response.completed","sequence_number":4,' in out


def test_the_sdk_stream_helper_reads_through_keepalive_events() -> None:
    surface = _surface()

    def handler(request: httpx.Request) -> httpx.Response:
        call = surface.parse(request.content, dict(request.headers))
        enc = surface.stream(call, RunContext(run_id="r1", created=CREATED, policy=OutputPolicy()))
        data = enc.start() + enc.keepalive() + enc.feed_many([Delta("Hel")])
        data += enc.keepalive() + enc.feed_many([Delta("lo"), Complete()])
        return httpx.Response(200, content=data, headers={"content-type": "text/event-stream"})

    http = httpx.Client(transport=httpx.MockTransport(handler))
    client = openai.OpenAI(api_key="k", base_url="http://iop.test/v1", http_client=http)
    with client.responses.stream(model="m", input="hi") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds.count("keepalive") == 2
    assert kinds[-1] == "response.completed"
    assert final.output_text == "Hello"


def test_fail_ends_the_stream_for_the_http_layer() -> None:
    enc = _stream({"input": "hi"})
    events = _events(
        enc.start() + enc.feed_shaped([ShapedText("x")]) + enc.fail("timed out", status=504)
    )
    assert events[-1]["type"] == "response.failed"
    assert enc.finished


def test_error_body_is_openais() -> None:
    status, body = _surface().error_body(
        404, "The model 'x' does not exist", code="model_not_found", param="model"
    )
    assert status == 404
    obj = json.loads(body)
    validate_error(obj)
    assert obj["error"] == {
        "message": "The model 'x' does not exist",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert _surface().error_body(200, "odd")[0] == 500


# --- hypothesis: any shaped sequence is a well-formed stream --------------------------------

_text = st.text(alphabet=st.sampled_from('ab \n"\\é😀'), max_size=6)
_calls = st.lists(
    st.tuples(st.sampled_from(["shell", "read"]), st.sampled_from(['{"a":1}', "{}", "not json"])),
    max_size=3,
).map(
    lambda calls: tuple(
        ToolCall(id=f"call_{i}", name=n, arguments=a, index=i) for i, (n, a) in enumerate(calls)
    )
)
_usage = st.builds(Usage, input_tokens=st.integers(0, 99), output_tokens=st.integers(0, 99))
_done = st.builds(
    ShapedDone, finish_reason=st.sampled_from(list(FinishReason)), calls=_calls, usage=_usage
)
_failed = st.builds(
    ShapedFailed,
    status=st.sampled_from([429, 500, 502, 503, 504]),
    code=st.sampled_from(["backend_error", "idle_timeout"]),
    message=_text,
)
_body = st.lists(
    st.one_of(st.builds(ShapedText, _text), st.builds(ShapedReasoning, _text)), max_size=10
)

_SDK_EVENT: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
_TERMINALS = {"response.completed", "response.incomplete", "response.failed"}


def _check_well_formed(events: list[dict[str, Any]]) -> None:
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    terminals = [i for i, e in enumerate(events) if e["type"] in _TERMINALS]
    assert terminals == [len(events) - 1]
    added = {
        e["output_index"]: i
        for i, e in enumerate(events)
        if e["type"] == "response.output_item.added"
    }
    done = {
        e["output_index"]: i
        for i, e in enumerate(events)
        if e["type"] == "response.output_item.done"
    }
    assert added.keys() == done.keys()
    assert all(added[k] < done[k] for k in added)
    final = events[-1]["response"]["output"]
    assert [events[done[k]]["item"] for k in sorted(done)] == final
    for k, item in enumerate(final):
        deltas = [
            e["delta"]
            for e in events
            if e.get("output_index") == k and e["type"].endswith(".delta")
        ]
        if item["type"] == "function_call":
            assert "".join(deltas) == item["arguments"]
        else:
            assert "".join(deltas) == item["content"][0]["text"]
            assert item["content"][0]["text"]  # no empty items


@given(body=_body, terminal=st.one_of(_done, _failed), started=st.booleans())
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_shaped_sequence_is_a_well_formed_stream(
    body: list[Shaped], terminal: Shaped, started: bool
) -> None:
    enc = _stream({"input": "hi", "tools": [SHELL, {**SHELL, "name": "read"}]})
    out = enc.start() if started else b""
    out += enc.feed_shaped([*body, terminal])
    assert enc.finished
    events = _events(out)
    _check_well_formed(events)
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in events:
        validate_event(event)
        state.handle_event(_SDK_EVENT.validate_python(event))  # the SDK's own consistency checks


# --- the official SDK over its own HTTP client --------------------------------------------


def _client(
    surface: ResponsesSurface,
    events: Callable[[], Iterable[RuntimeEvent]],
    *,
    byte_by_byte: bool = False,
) -> openai.OpenAI:
    """An SDK client whose requests the surface answers in memory (no server);
    ``byte_by_byte`` hands the SDK a stream one byte at a time."""
    count = iter(range(1000))

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/responses"
        try:
            call = surface.parse(request.content, dict(request.headers))
        except RequestError as exc:
            status, body = surface.error_body(
                exc.status, exc.message, code=exc.code, param=exc.param
            )
            return httpx.Response(
                status, content=body, headers={"content-type": "application/json"}
            )
        ctx = RunContext(run_id=f"run{next(count)}", created=CREATED, policy=OutputPolicy())
        if call.stream:
            enc = surface.stream(call, ctx)
            data = enc.start() + enc.feed_many(events())
            content = (data[i : i + 1] for i in range(len(data))) if byte_by_byte else data
            return httpx.Response(
                200, content=content, headers={"content-type": "text/event-stream"}
            )
        col = surface.collector(call, ctx)
        for event in events():
            col.feed(event)
        status, body = col.result()
        return httpx.Response(status, content=body, headers={"content-type": "application/json"})

    http = httpx.Client(transport=httpx.MockTransport(handler))
    return openai.OpenAI(
        api_key="k", base_url="http://iop.test/v1", http_client=http, max_retries=0
    )


def test_sdk_create_non_streaming_and_previous_response_id() -> None:
    surface = _surface()
    client = _client(
        surface, lambda: [Delta("Hello"), Complete(usage=Usage(input_tokens=2, output_tokens=1))]
    )
    first = client.responses.create(model="m", input="hi", instructions="sys")
    assert isinstance(first, Response)
    assert first.output_text == "Hello"
    assert first.status == "completed"
    assert first.usage is not None
    assert first.usage.total_tokens == 3
    second = client.responses.create(model="m", input="again", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input="x", previous_response_id="resp_gone")
    assert info.value.code == "previous_response_not_found"
    assert info.value.param == "previous_response_id"


def test_sdk_streams_parse_into_its_event_types() -> None:
    client = _client(_surface(), lambda: RUNS["reasoning"])
    stream = client.responses.create(model="m", input="hi", stream=True)
    types = [type(event).__name__ for event in stream]
    assert types[0] == "ResponseCreatedEvent"
    assert "ResponseReasoningTextDeltaEvent" in types
    assert "ResponseTextDeltaEvent" in types
    assert types[-1] == "ResponseCompletedEvent"


def test_sdk_stream_helper_accumulates_a_tool_call_turn() -> None:
    client = _client(_surface(), lambda: RUNS["tools"], byte_by_byte=True)
    with client.responses.stream(model="m", input="hi", tools=[SHELL]) as stream:  # type: ignore[list-item]
        final = stream.get_final_response()
    assert final.output_text == "calling"
    calls = [item for item in final.output if item.type == "function_call"]
    assert [(c.call_id, c.name, c.arguments) for c in calls] == [
        ("a", "shell", '{"c":1}'),
        ("call_run0_1", "shell", "{}"),
    ]


def test_sdk_sees_a_failed_stream_as_response_failed() -> None:
    client = _client(_surface(), lambda: RUNS["error"])
    events = list(client.responses.create(model="m", input="hi", stream=True))
    assert events[-1].type == "response.failed"
    assert events[-1].response.error is not None
    assert events[-1].response.error.message == "backend broke (backend_stream_error)"


def test_lone_surrogates_from_a_backend_become_question_marks() -> None:
    enc = _stream({"input": "hi"})
    events = _events(enc.start() + enc.feed_many([Delta("a\ud800b"), Complete()]))
    for event in events:
        validate_event(event)
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "a?b"


def test_the_collector_refuses_events_after_its_terminal() -> None:
    surface = _surface()
    col = surface.collector(
        surface.parse(b'{"model": "m", "input": "hi"}', {}),
        RunContext(run_id="r1", created=CREATED, policy=OutputPolicy()),
    )
    with pytest.raises(InvariantError):
        col.result()
    col.feed(Complete())
    with pytest.raises(InvariantError):
        col.feed(Delta("late"))
