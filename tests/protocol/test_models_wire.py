"""On-demand models on the link (docs/protocol.md, "Models on demand"): what
older peers see, and the load_model / model_load exchange."""

from __future__ import annotations

import msgspec
import pytest

from iop.errors import LinkProtocolError
from iop.protocol import (
    PROTOCOL_VERSION,
    CapabilitiesChanged,
    CapabilitiesUpdate,
    LoadModel,
    LoadModelReceived,
    ModelLoadAnswered,
    ModelLoadResult,
    ModelOffer,
    NodeJoined,
    encode,
    encode_batch,
)
from tests.protocol.test_protocol import CAPS, open_pair, pair, to_edge, to_node

OFFER = ModelOffer(model="qwen", state="cold", memory_mib=18000, load_s=41.2)


class OldHello(msgspec.Struct, tag_field="t", tag="hello"):
    """The hello an edge from before on-demand models decodes."""

    protocol_version: int
    node_id: str
    token: str
    instances: list[object] = []


def test_an_older_edge_reads_a_hello_with_models_and_ignores_them() -> None:
    _, node = pair()
    frame = node.hello([CAPS], models=[OFFER], memory_mib=24000)
    old = msgspec.msgpack.decode(frame, type=OldHello)
    assert old.protocol_version == PROTOCOL_VERSION
    assert len(old.instances) == 1


def test_the_edge_reads_the_offers_in_the_hello_and_in_caps() -> None:
    edge, node = pair()
    [joined] = edge.receive(node.hello([CAPS], models=[OFFER], memory_mib=24000), 0.0)
    assert isinstance(joined, NodeJoined)
    assert joined.hello.models == [OFFER]
    assert joined.hello.memory_mib == 24000
    edge, node = open_pair()
    node.capabilities([CAPS], [msgspec.structs.replace(OFFER, state="ready")])
    [changed] = to_edge(node, edge)
    assert isinstance(changed, CapabilitiesChanged)
    assert changed.models is not None
    assert changed.models[0].state == "ready"


def test_caps_of_a_node_without_models_are_encoded_as_before() -> None:
    assert msgspec.msgpack.decode(encode(CapabilitiesUpdate(instances=[]))) == {
        "t": "caps",
        "instances": [],
    }


def test_load_model_is_answered_once() -> None:
    edge, node = open_pair()
    edge.load_model("q1", "qwen")
    [received] = to_node(edge, node)
    assert isinstance(received, LoadModelReceived)
    assert received.request == LoadModel(request_id="q1", model="qwen")
    answer = ModelLoadResult(request_id="q1", model="qwen", ok=True)
    node.model_load_result(answer)
    assert to_edge(node, edge) == [ModelLoadAnswered(answer)]
    # A second answer to the same request answers nothing: a protocol error.
    node.model_load_result(answer)
    with pytest.raises(LinkProtocolError, match="answers no load_model"):
        to_edge(node, edge)


def test_an_answer_to_no_request_is_a_protocol_error() -> None:
    edge, _ = open_pair()
    frame = encode_batch([encode(ModelLoadResult(request_id="x", model="m", ok=False))])
    with pytest.raises(LinkProtocolError):
        edge.receive(frame, 0.0)
