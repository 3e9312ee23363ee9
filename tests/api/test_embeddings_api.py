"""The ``/v1/embeddings`` surface, sans-IO: parsing, float and base64 bodies, errors.

Bodies are validated against OpenAI's ``CreateEmbeddingResponse`` schema
(``tests/sim/_schemas.py``); base64 vectors decode to exactly the floats of
the float encoding.
"""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop.api import Surface
from iop.api._surface import Call, RunContext
from iop.api.embeddings import EMBEDDINGS, MAX_INPUTS
from iop.config import OutputPolicy
from iop.errors import InvariantError, RequestError
from iop.events import (
    Cancelled,
    CancelReason,
    Complete,
    EmbeddingData,
    Error,
    RuntimeEvent,
    Start,
    Usage,
)
from iop.spec import EmbeddingRequest, Routing
from tests.sim._schemas import validate_embeddings

CTX = RunContext(run_id="r1", created=1700000000, policy=OutputPolicy())
SURFACE: Surface = EMBEDDINGS
VECTORS = [[0.5, -0.25, 0.125], [1.0, 0.0, -1.0]]


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "emb", "input": ["a", "b"], **fields}).encode()


def parse(**fields: Any) -> Call:
    return SURFACE.parse(body(**fields), {})


def refused(raw: bytes) -> RequestError:
    with pytest.raises(RequestError) as info:
        SURFACE.parse(raw, {})
    assert info.value.status == 400
    return info.value


def test_parse_maps_inputs_and_options() -> None:
    call = parse(encoding_format="base64", dimensions=3, user="u", truncate_prompt_tokens=8)
    assert call.stream is False
    assert call.request == EmbeddingRequest(
        model="emb",
        inputs=["a", "b"],
        encoding_format="base64",
        dimensions=3,
        user="u",
        extra_body={"truncate_prompt_tokens": 8},
        routing=Routing(session="u", session_from="user"),  # iop.api._routing
    )


@pytest.mark.parametrize(
    ("value", "inputs"),
    [("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_input_forms(value: Any, inputs: list[Any]) -> None:
    request = parse(input=value).request
    assert isinstance(request, EmbeddingRequest)
    assert request.inputs == inputs


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"input": []}, "input", "empty array"),
        ({"input": ""}, "input", "must not be empty"),
        ({"input": ["a", ""]}, "input", "'input[1]' must not be empty"),
        ({"input": [[]]}, "input", "must not be empty"),
        ({"input": ["a", 1]}, "input", "must be a string"),
        ({"input": ["x"] * (MAX_INPUTS + 1)}, "input", f"at most {MAX_INPUTS}"),
        ({"encoding_format": "int8"}, "encoding_format", "Invalid value"),
        ({"dimensions": 0}, "dimensions", "minimum of 1"),
        ({"stream": True}, "stream", "not streamed"),
        ({"model": ""}, "model", "Missing required parameter"),
    ],
)
def test_invalid_requests_get_openais_400(fields: dict[str, Any], param: str, words: str) -> None:
    error = refused(body(**fields))
    assert error.param == param
    assert words in error.message


def test_exactly_max_inputs_is_accepted() -> None:
    request = parse(input=["x"] * MAX_INPUTS).request
    assert isinstance(request, EmbeddingRequest)
    assert len(request.inputs) == MAX_INPUTS


def test_missing_input() -> None:
    assert refused(b'{"model": "emb"}').param == "input"


def collect(call: Call, events: list[RuntimeEvent]) -> tuple[int, Any]:
    col = SURFACE.collector(call, CTX)
    for event in events:
        assert not col.finished
        col.feed(event)
    assert col.finished
    status, raw = col.result()
    return status, json.loads(raw)


def run_events() -> list[RuntimeEvent]:
    data = [EmbeddingData.of(i, v) for i, v in enumerate(VECTORS)]
    return [Start(), *data, Complete(usage=Usage(input_tokens=4))]


def test_float_body_is_openais_create_embedding_response() -> None:
    status, obj = collect(parse(), run_events())
    assert status == 200
    validate_embeddings(obj)
    assert obj == {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": VECTORS[0]},
            {"object": "embedding", "index": 1, "embedding": VECTORS[1]},
        ],
        "model": "emb",
        "usage": {"prompt_tokens": 4, "total_tokens": 4},
    }


def test_base64_body_is_little_endian_float32_of_the_same_vectors() -> None:
    status, obj = collect(parse(encoding_format="base64"), run_events())
    assert status == 200
    for item, vector in zip(obj["data"], VECTORS, strict=True):
        raw = base64.b64decode(item["embedding"])
        assert list(struct.unpack(f"<{len(vector)}f", raw)) == vector


def test_float32_rounding_is_what_the_client_gets() -> None:
    event = EmbeddingData.of(0, [0.1])
    (value,) = event.floats()
    assert value == struct.unpack("<f", struct.pack("<f", 0.1))[0]


@pytest.mark.parametrize(
    ("terminal", "status"),
    [
        (Error(message="not a pooling model", status=400, code="invalid_request_error"), 400),
        (Cancelled(reason=CancelReason.TOTAL_TIMEOUT), 504),
        (Cancelled(reason=CancelReason.NODE_LOST), 503),
    ],
)
def test_failed_run_is_openais_error_body(terminal: RuntimeEvent, status: int) -> None:
    got, obj = collect(parse(), [Start(), EmbeddingData.of(0, [1.0]), terminal])
    assert got == status
    assert set(obj["error"]) == {"message", "type", "param", "code"}


def test_missing_or_misordered_vectors_are_a_502() -> None:
    got, obj = collect(parse(), [Start(), EmbeddingData.of(0, [1.0]), Complete()])
    assert got == 502
    assert "1 embeddings for 2 inputs" in obj["error"]["message"]
    got, obj = collect(
        parse(), [Start(), EmbeddingData.of(1, [1.0]), EmbeddingData.of(0, [1.0]), Complete()]
    )
    assert got == 502
    assert "out of order" in obj["error"]["message"]


def test_embeddings_have_no_stream() -> None:
    with pytest.raises(InvariantError):
        SURFACE.stream(parse(), CTX)


_VECTORS = st.lists(
    st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=6),
    min_size=1,
    max_size=5,
)


@given(_VECTORS)
def test_any_vectors_give_a_valid_body_and_base64_equals_float(vectors: list[list[float]]) -> None:
    events: list[RuntimeEvent] = [Start(), *(EmbeddingData.of(i, v) for i, v in enumerate(vectors))]
    events.append(Complete(usage=Usage(input_tokens=len(vectors))))
    inputs = [f"t{i}" for i in range(len(vectors))]
    _, as_floats = collect(parse(input=inputs), events)
    _, as_base64 = collect(parse(input=inputs, encoding_format="base64"), events)
    validate_embeddings(as_floats)
    for f, b, v in zip(as_floats["data"], as_base64["data"], vectors, strict=True):
        raw = base64.b64decode(b["embedding"])
        assert list(struct.unpack(f"<{len(v)}f", raw)) == f["embedding"] == v
