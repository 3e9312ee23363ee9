"""Operations on the link: the tagged ExecutionSpec, the new events, old peers."""

from __future__ import annotations

import msgspec
import pytest

from iop.capabilities import Capabilities
from iop.errors import LinkProtocolError
from iop.events import Complete, EmbeddingData, TokenCount
from iop.protocol import (
    PROTOCOL_VERSION,
    Assign,
    RunEvents,
    decode_edge_batch,
    decode_edge_message,
    decode_node_message,
    encode,
    encode_batch,
)
from iop.spec import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    ExecutionSpec,
    Message,
    OperationRequest,
    TokenizeRequest,
)

REQUESTS: list[OperationRequest] = [
    ChatRequest(model="m", messages=[Message(role="user", content="hi")]),
    CompletionRequest(model="m", prompt="Once", max_tokens=16, extra_body={"top_k": 3}),
    CompletionRequest(model="m", prompt=[1, 2, 3]),
    EmbeddingRequest(model="e", inputs=["a", [1, 2]], encoding_format="base64", dimensions=8),
    TokenizeRequest(model="m", messages=[Message(role="user", content="hi")]),
    TokenizeRequest(model="m", prompt="hi"),
]


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: type(r).__name__)
def test_every_operation_round_trips_in_an_assign(request_: OperationRequest) -> None:
    assign = Assign(
        run_id="r1", instance="i0", spec=ExecutionSpec(run_id="r1", request=request_), credit=4
    )
    got = decode_edge_message(encode(assign))
    assert got == assign
    assert decode_edge_batch(encode_batch([encode(assign)])) == [assign]
    assert isinstance(got, Assign)
    assert type(got.spec.request) is type(request_)


def test_operation_names() -> None:
    ops = [ExecutionSpec(run_id="r", request=r).operation for r in REQUESTS]
    assert ops == ["chat", "completion", "completion", "embedding", "tokenize", "tokenize"]


def test_a_version_1_assign_without_op_is_a_protocol_error() -> None:
    # What a version-1 edge sent: the chat request without its "op" tag. The
    # version check in the Hello keeps such peers apart (since version 2).
    assert PROTOCOL_VERSION >= 2
    spec = {"run_id": "r1", "request": {"model": "m", "messages": []}}
    frame = msgspec.msgpack.encode(
        {"t": "assign", "run_id": "r1", "instance": "i0", "spec": spec, "credit": 4}
    )
    with pytest.raises(LinkProtocolError):
        decode_edge_message(frame)


def test_capabilities_of_an_old_peer_decode_as_chat_only() -> None:
    old = msgspec.msgpack.encode({"adapter": "vllm", "instance": "v0", "targets": ["m"]})
    caps = msgspec.msgpack.decode(old, type=Capabilities)
    assert caps.operations == ("chat",)
    assert caps.serves("chat")
    assert not caps.serves("embedding")


def test_new_events_round_trip_and_a_4096_dim_vector_is_16_kib() -> None:
    vector = EmbeddingData.of(0, [0.25] * 4096)
    frame = encode(RunEvents(run_id="r1", seq=0, events=[vector, TokenCount(count=3), Complete()]))
    got = decode_node_message(frame)
    assert isinstance(got, RunEvents)
    assert got.events == [vector, TokenCount(count=3), Complete()]
    single = len(encode(RunEvents(run_id="r1", seq=0, events=[vector])))
    assert 4096 * 4 < single < 4096 * 4 + 100


def test_a_specs_cache_salt_is_defaulted_both_ways() -> None:
    """New edge, old node: the old spec decodes the new one (unknown fields
    are skipped). Old edge, new node: no salt. And no salt, no bytes: an
    edge of one tenant sends what it sent before the field existed."""
    request = ChatRequest(model="m", messages=[Message(role="user", content="hi")])
    salted = Assign(
        run_id="r1",
        instance="i0",
        spec=ExecutionSpec(run_id="r1", request=request, cache_salt="s" * 43),
        credit=4,
    )
    assert decode_edge_message(encode(salted)) == salted

    class OldSpec(msgspec.Struct, frozen=True, kw_only=True):
        run_id: str
        request: OperationRequest
        target: str = ""
        traceparent: str = ""

    raw = msgspec.msgpack.decode(encode(salted))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(raw["spec"]), type=OldSpec).run_id == "r1"

    plain = Assign(
        run_id="r1", instance="i0", spec=ExecutionSpec(run_id="r1", request=request), credit=4
    )
    assert b"cache_salt" not in encode(plain)
    old = msgspec.msgpack.encode(
        {"t": "assign", "run_id": "r1", "instance": "i0", "credit": 4,
         "spec": {"run_id": "r1", "request": {"op": "chat", "model": "m", "messages": []}}}
    )  # fmt: skip
    got = decode_edge_message(old)
    assert isinstance(got, Assign)
    assert got.spec.cache_salt == ""
