"""The ``/v1/completions`` surface, sans-IO: parsing, the stream, the body, errors.

Every chunk and body is validated against OpenAI's ``CreateCompletionResponse``
schema (``tests/sim/_schemas.py``), every error against OpenAI's error shape.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop.api import Surface
from iop.api._surface import Call, RunContext
from iop.api.completions import COMPLETIONS
from iop.config import OutputPolicy
from iop.errors import RequestError
from iop.events import (
    Cancelled,
    CancelReason,
    Complete,
    Delta,
    Error,
    FinishReason,
    RuntimeEvent,
    Start,
    Usage,
)
from iop.spec import CompletionRequest, Routing
from tests.sim._schemas import validate_completion, validate_completion_chunk

CTX = RunContext(run_id="r1", created=1700000000, policy=OutputPolicy())
SURFACE: Surface = COMPLETIONS
USAGE = Usage(input_tokens=3, output_tokens=2)


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "prompt": "Once", **fields}).encode()


def parse(**fields: Any) -> Call:
    return SURFACE.parse(body(**fields), {})


def refused(raw: bytes) -> RequestError:
    with pytest.raises(RequestError) as info:
        SURFACE.parse(raw, {})
    assert info.value.status == 400
    return info.value


def sse_payloads(data: bytes) -> list[str]:
    assert data.endswith(b"\n\n")
    out = []
    for frame in data.decode().split("\n\n")[:-1]:
        assert frame.startswith("data: "), frame
        out.append(frame[len("data: ") :])
    return out


def validate_error(obj: Any) -> None:
    assert set(obj) == {"error"}
    assert set(obj["error"]) == {"message", "type", "param", "code"}
    assert isinstance(obj["error"]["message"], str)


# --- parsing ------------------------------------------------------------------------


def test_parse_maps_the_request_onto_a_completion_run() -> None:
    call = parse(
        max_tokens=5,
        temperature=0.5,
        stop=["\n"],
        echo=True,
        seed=7,
        user="u1",
        stream=True,
        stream_options={"include_usage": True},
        top_k=40,
    )
    assert call.stream is True
    assert call.model == "m"
    assert call.request == CompletionRequest(
        model="m",
        prompt="Once",
        stream=True,
        max_tokens=5,
        temperature=0.5,
        stop=["\n"],
        seed=7,
        echo=True,
        user="u1",
        extra_body={"top_k": 40},
        # ``user`` is its session key too (iop.api._routing).
        routing=Routing(session="u1", session_from="user"),
    )


def test_max_tokens_defaults_to_openais_16() -> None:
    assert parse().request == CompletionRequest(model="m", prompt="Once", max_tokens=16)
    assert parse(max_tokens=None).request == CompletionRequest(
        model="m", prompt="Once", max_tokens=16
    )


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("hi", "hi"), (["hi"], "hi"), ([1, 2], [1, 2]), ([[1, 2]], [1, 2])],
)
def test_prompt_forms(prompt: Any, expected: Any) -> None:
    request = parse(prompt=prompt).request
    assert isinstance(request, CompletionRequest)
    assert request.prompt == expected


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
        ({"prompt": [[1], [2]]}, "prompt", "one prompt per request"),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": [[]]}, "prompt", "empty"),
        ({"prompt": ["a", 1]}, "prompt", "must be a string"),
        ({"prompt": None}, "prompt", "Missing required parameter"),
        ({"n": 2}, "n", "'n' must be 1"),
        ({"logprobs": 2}, "logprobs", "log probabilities"),
        ({"best_of": 2, "stream": True}, "best_of", "stream"),
        ({"max_tokens": -1}, "max_tokens", "minimum"),
        ({"temperature": 3}, "temperature", "between 0 and 2"),
        ({"top_p": 1.5}, "top_p", "between 0 and 1"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({"max_tokens": "many"}, "max_tokens", "Invalid type"),
        ({"model": ""}, "model", "Missing required parameter"),
    ],
)
def test_invalid_requests_get_openais_400(fields: dict[str, Any], param: str, words: str) -> None:
    error = refused(body(**fields))
    assert error.param == param
    assert words in error.message


def test_missing_fields_and_bad_json() -> None:
    assert refused(b'{"prompt": "x"}').param == "model"
    assert refused(b'{"model": "m"}').param == "prompt"
    assert refused(b"{not json").code == "invalid_json"
    assert refused(b"[1]").code == "invalid_type"


# --- streaming ----------------------------------------------------------------------


def stream(events: list[RuntimeEvent], *, include_usage: bool = False) -> list[Any]:
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    call = parse(stream=True, **options)
    enc = SURFACE.stream(call, CTX)
    data = enc.start() + enc.feed_many(events)
    assert enc.finished
    payloads = sse_payloads(data)
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def test_stream_bytes_are_openais_text_completion_chunks() -> None:
    call = parse(stream=True)
    enc = SURFACE.stream(call, CTX)
    data = enc.start() + enc.feed_many([Start(), Delta("Hel"), Delta("lo")])
    assert data == (
        b'data: {"id":"cmpl-r1","object":"text_completion","created":1700000000,"model":"m",'
        b'"choices":[{"index":0,"text":"Hel","logprobs":null,"finish_reason":null}]}\n\n'
        b'data: {"id":"cmpl-r1","object":"text_completion","created":1700000000,"model":"m",'
        b'"choices":[{"index":0,"text":"lo","logprobs":null,"finish_reason":null}]}\n\n'
    )
    assert enc.keepalive() == b": keep-alive\n\n"
    assert not enc.finished
    end = enc.feed_many([Complete(finish_reason=FinishReason.LENGTH, usage=USAGE)])
    assert end == (
        b'data: {"id":"cmpl-r1","object":"text_completion","created":1700000000,"model":"m",'
        b'"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length"}]}\n\n'
        b"data: [DONE]\n\n"
    )


def test_stream_with_usage_validates_against_openais_schema() -> None:
    chunks = stream([Start(), Delta("a"), Delta("b"), Complete(usage=USAGE)], include_usage=True)
    for chunk in chunks:
        validate_completion_chunk(chunk)
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


def test_tool_call_finish_reasons_are_stop_on_the_legacy_endpoint() -> None:
    chunks = stream([Start(), Complete(finish_reason=FinishReason.TOOL_CALLS)])
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "terminal",
    [
        Error(message="backend died", status=502, code="backend_error"),
        Cancelled(reason=CancelReason.IDLE_TIMEOUT),
    ],
)
def test_stream_failure_after_output_is_an_error_event_then_done(terminal: RuntimeEvent) -> None:
    chunks = stream([Start(), Delta("a"), terminal])
    validate_completion_chunk(chunks[0])
    validate_error(chunks[-1])
    assert chunks[-1]["error"]["type"] == "server_error"


_EVENTS = st.lists(st.builds(Delta, st.text(max_size=5)), max_size=8)
_TERMINALS = st.sampled_from(
    [
        Complete(usage=USAGE),
        Complete(finish_reason=FinishReason.LENGTH),
        Error(message="x", status=500),
        Cancelled(reason=CancelReason.NODE_LOST),
    ]
)


@given(_EVENTS, _TERMINALS, st.booleans())
def test_any_run_streams_valid_chunks_and_exactly_one_done(
    deltas: list[RuntimeEvent], terminal: RuntimeEvent, include_usage: bool
) -> None:
    chunks = stream([Start(), *deltas, terminal], include_usage=include_usage)
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    assert text == "".join(d.text for d in deltas if isinstance(d, Delta))
    for chunk in chunks:
        if "error" in chunk:
            validate_error(chunk)
            assert chunk is chunks[-1]
        else:
            validate_completion_chunk(chunk)


# --- non-streaming ------------------------------------------------------------------


def collect(events: list[RuntimeEvent]) -> tuple[int, Any]:
    col = SURFACE.collector(parse(), CTX)
    for event in events:
        col.feed(event)
    assert col.finished
    status, raw = col.result()
    return status, json.loads(raw)


def test_body_is_openais_create_completion_response() -> None:
    status, obj = collect([Start(), Delta("Hel"), Delta("lo"), Complete(usage=USAGE)])
    assert status == 200
    validate_completion(obj)
    assert obj == {
        "id": "cmpl-r1",
        "object": "text_completion",
        "created": 1700000000,
        "model": "m",
        "choices": [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


@pytest.mark.parametrize(
    ("terminal", "status", "type_"),
    [
        (Error(message="no", status=404, code="model_not_found"), 404, "invalid_request_error"),
        (Error(message="slow", status=429, code="queue_full"), 429, "rate_limit_error"),
        (Cancelled(reason=CancelReason.FIRST_TOKEN_TIMEOUT), 504, "server_error"),
        (Cancelled(reason=CancelReason.NODE_LOST), 503, "server_error"),
    ],
)
def test_failed_run_is_openais_error_body(terminal: RuntimeEvent, status: int, type_: str) -> None:
    got, obj = collect([Start(), terminal])
    assert got == status
    validate_error(obj)
    assert obj["error"]["type"] == type_


def test_error_body_of_the_surface() -> None:
    status, raw = SURFACE.error_body(404, "nope", code="model_not_found", param="model")
    assert status == 404
    assert msgspec.json.decode(raw) == {
        "error": {
            "message": "nope",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


# --- cached prompt tokens -----------------------------------------------------------

CACHED = Usage(input_tokens=30, output_tokens=2, cached_input_tokens=20)


def test_cached_prompt_tokens_reach_the_client_as_the_ledger_charges_them() -> None:
    # The ledger charges a completed run's cached tokens at the cached price
    # (docs/operations.md, "Usage and budgets"), so the client must see them:
    # OpenAI's CompletionUsage carries them in prompt_tokens_details, as chat
    # does (iop/api/chat/_encode.py). Found by the soak (iop/bench/_soak.py):
    # llama.cpp reuses its prompt cache, and the ledger's cached tokens
    # exceeded what the clients of /v1/completions were told.
    _, obj = collect([Start(), Delta("a"), Complete(usage=CACHED)])
    validate_completion(obj)
    assert obj["usage"]["prompt_tokens_details"] == {"cached_tokens": 20}
    chunks = stream([Start(), Delta("a"), Complete(usage=CACHED)], include_usage=True)
    validate_completion_chunk(chunks[-1])
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 20}
