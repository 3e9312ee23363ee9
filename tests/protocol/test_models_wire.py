"""On-demand models on the link (docs/protocol.md, "Models on demand"): what
older peers see, and the load_model / model_load exchange."""

from __future__ import annotations

import msgspec
import pytest

from iop.errors import InvariantError, LinkProtocolError
from iop.protocol import (
    PROTOCOL_VERSION,
    CapabilitiesChanged,
    CapabilitiesUpdate,
    ControlModel,
    EdgeSession,
    LoadModel,
    LoadModelReceived,
    ModelAction,
    ModelControlAnswered,
    ModelControlReceived,
    ModelControlResult,
    ModelLoadAnswered,
    ModelLoadResult,
    ModelOffer,
    NodeJoined,
    NodeSession,
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


# --- the operator's controls (ControlModel / ModelControlResult) ---------------


def test_a_hello_says_whether_the_node_takes_model_controls() -> None:
    edge, node = pair()
    edge.receive(node.hello([CAPS], models=[OFFER], memory_mib=24000, model_controls=True), 0.0)
    assert edge.peer_model_controls
    old_edge, old_node = pair()
    old_edge.receive(old_node.hello([CAPS], models=[OFFER], memory_mib=24000), 0.0)
    assert not old_edge.peer_model_controls


def test_an_edge_sends_no_control_to_a_node_that_did_not_offer_them() -> None:
    # An older node would close the link on the unknown tag.
    edge, _ = open_pair()
    with pytest.raises(InvariantError, match="takes no control_model"):
        edge.control_model("c1", "qwen", ModelAction.UNLOAD)
    assert not edge.has_data_to_send


def _controlled_pair() -> tuple[EdgeSession, NodeSession]:
    edge, node = pair()
    edge.receive(node.hello([CAPS], models=[OFFER], model_controls=True), 0.0)
    node.receive(edge.welcome(), 0.0)
    return edge, node


@pytest.mark.parametrize("action", list(ModelAction))
def test_control_model_is_answered_once(action: ModelAction) -> None:
    edge, node = _controlled_pair()
    edge.control_model("c1", "qwen", action, by="admin key from 127.0.0.1")
    [received] = to_node(edge, node)
    assert received == ModelControlReceived(
        ControlModel(request_id="c1", model="qwen", action=action, by="admin key from 127.0.0.1")
    )
    answer = ModelControlResult(request_id="c1", model="qwen", ok=True, offer=OFFER)
    node.model_control_result(answer)
    assert to_edge(node, edge) == [ModelControlAnswered(answer)]
    node.model_control_result(answer)
    with pytest.raises(LinkProtocolError, match="answers no control_model"):
        to_edge(node, edge)


def test_an_unknown_action_from_a_newer_edge_is_a_protocol_error() -> None:
    _, node = _controlled_pair()
    frame = msgspec.msgpack.encode(
        [{"t": "control_model", "request_id": "c", "model": "m", "action": "defrag"}]
    )
    with pytest.raises(LinkProtocolError):
        node.receive(frame, 0.0)


class OldOffer(msgspec.Struct):
    """A ModelOffer as an edge from before the counters decodes it."""

    model: str
    state: str
    memory_mib: int
    load_s: float = 0.0


def test_an_older_edge_reads_an_offer_with_counters() -> None:
    offer = msgspec.structs.replace(
        OFFER, state="loading", loading_s=3.5, loads=4, load_failures=1, evictions=2, cold_starts=9
    )
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(offer), type=OldOffer)
    assert (old.model, old.state) == ("qwen", "loading")
    # and a new edge reads an old offer's missing counters as 0
    new = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=ModelOffer)
    assert (new.loads, new.evictions, new.cold_starts, new.loading_s) == (0, 0, 0, 0.0)


class OldModelLoadResult(msgspec.Struct, tag_field="t", tag="model_load"):
    """The load answer an edge from before ``pinned`` decodes."""

    request_id: str
    model: str
    ok: bool
    code: str = ""
    message: str = ""


def test_a_refusal_naming_pinned_models_reads_as_a_refusal_to_an_older_edge() -> None:
    result = ModelLoadResult(
        request_id="q1", model="b", ok=False, code="model_load_refused", message="no", pinned=("a",)
    )
    old = msgspec.msgpack.decode(encode(result), type=OldModelLoadResult)
    assert (old.ok, old.code, old.message) == (False, "model_load_refused", "no")


def test_an_older_nodes_refusal_reads_as_one_that_passes() -> None:
    edge, node = open_pair()
    edge.load_model("q1", "b")
    to_node(edge, node)
    old = OldModelLoadResult(request_id="q1", model="b", ok=False, code="model_load_refused")
    [answered] = edge.receive(encode_batch([msgspec.msgpack.encode(old)]), 0.0)
    assert isinstance(answered, ModelLoadAnswered)
    assert answered.result.pinned == ()
