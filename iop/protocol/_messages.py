"""Edge <-> node link messages and their codec.

Each direction's messages are a tagged union (tag field ``"t"``), msgpack-encoded;
each direction has its own union so a peer that sends the other side's
message is a protocol error, not a silent no-op. The two handshake frames
(``Hello``, ``Welcome``) carry one message each; every frame after them is a
msgpack **array** of one or more messages (``encode_batch``), so a link
driver sends everything queued for all runs in one frame: the per-frame
costs (WebSocket framing, the server's per-message machinery, the reader's
wake-up) are spread over many events.
New fields are always added with defaults, so an older peer still decodes a
newer one's messages; incompatible changes bump ``PROTOCOL_VERSION``, which is
checked in the ``Hello``.

::

    node                                   edge
     |  Hello(version, node id, token,      |
     |        instances)  ----------------> |  token checked (constant time)
     |  <---------------- Welcome(heartbeat) |
     |  <----------------- Assign(run, credit)
     |  RunEvents(run, seq, [events]) ----> |  at most `credit` non-terminal events
     |  <----------------- Credit(run, n)    |  as the client consumes them
     |  <----------------- Cancel(run, reason)
     |  Ping(nonce) ----------------------> |  nothing else sent for heartbeat_interval_s,
     |                                      |  or an answer to the edge's ping
     |  <----------------- Ping(nonce)       |  the edge's sweep, every heartbeat_timeout_s
     |  CapabilitiesUpdate(instances) ----> |  when a probe changes something
     |  LoadReport(instances) ------------> |  when the load changes, at most
     |                                      |  Welcome.load_reports_per_s a second

On-demand models (docs/protocol.md, "Models on demand") are new in protocol
3 without a version bump either: a node that may start models lists them
(``ModelOffer``) in its ``Hello`` and ``CapabilitiesUpdate`` (fields an
older edge ignores), and only an edge that read them sends ``LoadModel``,
naming a model the node offered; the node answers each with one
``ModelLoadResult``. An older node, which would refuse the unknown tag,
offers none and so is never asked.

The operator's controls of those models (``ControlModel``: load, unload,
pin, unpin, from the edge's admin API) came later, again without a version
bump: a node that takes them says so in its ``Hello`` (``model_controls``),
and an edge sends ``ControlModel`` only to such a node; the node answers
each at once with one ``ModelControlResult`` carrying the model's new
state. The counters and ``loading_s`` a newer node adds to ``ModelOffer``
are fields an older edge ignores.

``LoadReport`` is new in protocol 3 without a version bump: a node sends it
only to an edge whose ``Welcome`` asked for it (``load_reports_per_s`` > 0),
so an older edge, which would refuse the unknown tag, never gets one, and an
older node simply never sends one (the edge then places on its own counts).
"""

from __future__ import annotations

import enum
from typing import Final, TypeVar

import msgspec

from iop.capabilities import Capabilities
from iop.errors import LinkProtocolError
from iop.events import CancelReason, RuntimeEvent
from iop.spec import ExecutionSpec
from iop.timeline import NodeTimeline

__all__ = [
    "PROTOCOL_VERSION",
    "Assign",
    "Cancel",
    "CapabilitiesUpdate",
    "ControlModel",
    "Credit",
    "EdgeMessage",
    "EngineLoad",
    "Goodbye",
    "Hello",
    "InstanceLoad",
    "LoadModel",
    "LoadReport",
    "ModelAction",
    "ModelControlResult",
    "ModelLoadResult",
    "ModelOffer",
    "NodeMessage",
    "Ping",
    "RunEvents",
    "Welcome",
    "array_header",
    "decode_edge_batch",
    "decode_edge_message",
    "decode_node_batch",
    "decode_node_message",
    "encode",
    "encode_batch",
]

# 3: frames after the handshake are arrays of messages (``encode_batch``).
# 2: ``ExecutionSpec.request`` became a tagged union of operations (``"op"``:
# chat, completion, embedding, tokenize) and runs gained ``EmbeddingData`` and
# ``TokenCount`` events. A version-1 edge's Assign has no ``"op"``, which a
# version-2 node cannot decode, so peers of different versions refuse each
# other at the Hello instead of failing every run.
PROTOCOL_VERSION: Final = 3


class _Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="t"):
    pass


# --- node -> edge -------------------------------------------------------------


class ModelOffer(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """An on-demand model of the node: what it is doing, and what loading it costs.

    Attributes:
        model: The model's name: the instance a run for it is assigned to.
        state: ``cold``, ``loading``, ``ready``, ``draining``, ``unloading``
            or ``failed`` (``iop.ondemand.ModelState``).
        memory_mib: What it takes of the node's budget while loaded.
        load_s: How long its last load took (0: never loaded yet).
        pinned: Loaded at start and never unloaded.
        runs: Runs holding it now.
        detail: Why it is failed, or what it loads or unloads for.
        retry_in_s: While failed: how long until it may load again.
        loading_s: While loading: how long it has been loading when the
            offer was sent (the reader adds the time since).
        loads: Good loads since the node started (counters: the edge's
            metrics count their increase).
        load_failures: Failed loads, and exits of a loaded model.
        evictions: Unloads to make room for another model.
        cold_starts: Runs that found it not loaded and waited for a load.
    """

    model: str
    state: str
    memory_mib: int
    load_s: float = 0.0
    pinned: bool = False
    runs: int = 0
    detail: str = ""
    retry_in_s: float = 0.0
    loading_s: float = 0.0
    loads: int = 0
    load_failures: int = 0
    evictions: int = 0
    cold_starts: int = 0


class ModelLoadResult(_Msg, frozen=True, kw_only=True, tag="model_load"):
    """The answer to ``LoadModel``: ``ok`` once the model is ready, or why not
    (``code``: ``model_load_failed``, ``model_load_refused``,
    ``model_load_timeout``, ``unknown_instance``, ``node_draining``).

    ``pinned``, with ``model_load_refused``: the pinned models in the way of
    a refusal that lasts until an operator unpins one (pinned models alone
    leave no room, or a group rule needs one gone). Empty: a refusal that
    passes (runs in flight, ``min_residency_s``), or an older node's, which
    an edge reads as one that passes; an older edge ignores the field.
    """

    request_id: str
    model: str
    ok: bool
    code: str = ""
    message: str = ""
    pinned: tuple[str, ...] = ()


class ModelControlResult(_Msg, frozen=True, kw_only=True, tag="model_control", omit_defaults=True):
    """The answer to ``ControlModel``, sent at once (a load is started, not
    waited for): ``ok`` with the model's state after it (``offer``), or why
    not (``code``: ``model_not_found``, ``model_pinned``,
    ``model_load_refused``, ``model_load_failed``, ``node_draining``)."""

    request_id: str
    model: str
    ok: bool
    code: str = ""
    message: str = ""
    offer: ModelOffer | None = None


class Hello(_Msg, frozen=True, kw_only=True, tag="hello", omit_defaults=True):
    """First frame of a node: who it is, its token, what it serves.

    Its defaulted fields are left out when at their default: every peer
    since each was added reads a missing one as that default, and a node
    without models or controls keeps its hello as small as before them
    (``link.max_hello_bytes``)."""

    protocol_version: int
    node_id: str
    token: str
    instances: list[Capabilities] = []
    software: str = ""
    # The largest frame this node accepts (0: a node from before this field,
    # which accepted 16 MiB). The edge sends nothing bigger: a run whose
    # Assign would not fit is refused alone (413), the link stays up.
    max_frame_bytes: int = 0
    # On-demand models (an older node sends none) and their memory budget.
    models: list[ModelOffer] = []
    memory_mib: int = 0
    # The node takes ``ControlModel`` (an older node, which would close the
    # link on the unknown tag, sends False and is never sent one).
    model_controls: bool = False


class CapabilitiesUpdate(_Msg, frozen=True, kw_only=True, tag="caps", omit_defaults=True):
    """The node's instances changed (probe status, targets), or its
    on-demand models' states (``models``: None from a node without them)."""

    instances: list[Capabilities]
    models: list[ModelOffer] | None = None


class RunEvents(_Msg, frozen=True, kw_only=True, tag="events", omit_defaults=True):
    """Events of one run, in order; ``seq`` counts frames per run from 0.

    ``timeline``: the node's side of the run (``iop.timeline``), in the
    node's clock, on the message that carries the terminal event. An edge
    that predates it ignores it.
    """

    run_id: str
    seq: int
    events: list[RuntimeEvent]
    timeline: NodeTimeline | None = None


class Ping(_Msg, frozen=True, kw_only=True, tag="ping"):
    """Heartbeat (either direction): the sender had nothing else to send for
    its interval. Nobody answers it; any frame proves its sender alive."""

    nonce: int


class Goodbye(_Msg, frozen=True, kw_only=True, tag="bye"):
    """The node is draining: assign it nothing new."""

    reason: str = ""


class EngineLoad(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What an instance's engine published about its load (``iop.adapters``
    scrapes it), as far as it says; None: not published.

    Attributes:
        running: Requests the engine is executing (vLLM
            ``num_requests_running``, SGLang ``num_running_reqs``, llama.cpp
            slots processing).
        waiting: Requests queued inside the engine.
        kv_usage: Share of its KV cache in use, 0 to 1.
        age_s: How old the figures were when the report was sent.
        cache_tokens: The size of its KV cache in tokens (vLLM's
            ``num_gpu_blocks`` times ``block_size``): prefix placement keeps
            no more of its prompts than fit (an edge from before this field
            ignores it; docs/protocol.md, "Cache reports").
        cached_tokens: What its prefix cache holds now, in tokens, from the
            engine's KV cache events (None: it publishes none the node reads).
    """

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    age_s: float = 0.0
    cache_tokens: int | None = None
    cached_tokens: int | None = None


class InstanceLoad(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One instance's load on the node, across every edge that uses it.

    Attributes:
        instance: The instance's name.
        in_flight: Runs holding a slot.
        queued: Runs waiting for one.
        max_concurrency: Its slots.
        max_queue: Its queue bound.
        engine: The engine's own figures, when it publishes them.
    """

    instance: str
    in_flight: int
    queued: int
    max_concurrency: int
    max_queue: int
    engine: EngineLoad | None = None


class LoadReport(_Msg, frozen=True, kw_only=True, tag="load"):
    """The node's instances' live load; sent on change, coalesced, and again
    before ``Welcome.load_stale_s`` would make the last one stale. It is a
    hint for placement: the node's own admission decides."""

    instances: list[InstanceLoad]


NodeMessage = (
    Hello
    | CapabilitiesUpdate
    | RunEvents
    | Ping
    | Goodbye
    | LoadReport
    | ModelLoadResult
    | ModelControlResult
)


# --- edge -> node -------------------------------------------------------------


class Welcome(_Msg, frozen=True, kw_only=True, tag="welcome"):
    """The edge accepted the node; liveness parameters for both sides."""

    protocol_version: int
    node_id: str
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    # The largest frame the edge accepts from this node (0: an edge from
    # before this field; the node keeps its own limit).
    max_frame_bytes: int = 0
    # Load reports the edge takes a second (0: an edge from before
    # ``LoadReport``, which must get none), and the age past which it
    # ignores one: the node sends its report again before that.
    load_reports_per_s: float = 0.0
    load_stale_s: float = 0.0


class Assign(_Msg, frozen=True, kw_only=True, tag="assign"):
    """Run ``spec`` on ``instance``; send at most ``credit`` non-terminal events.

    ``collect``: nobody reads the run's events as they come (a non-streaming
    request): the node may hold them and merge consecutive text deltas,
    sending the first output at once, then what it holds every
    ``collect_flush_s`` or so (0: the node's default) and at the end, so the
    result costs a few messages instead of one per token while the edge's
    deadlines still see the run progress.
    """

    run_id: str
    instance: str
    spec: ExecutionSpec
    credit: int
    collect: bool = False
    collect_flush_s: float = 0.0


class Credit(_Msg, frozen=True, kw_only=True, tag="credit"):
    """The run's consumer took events: ``credit`` more may be sent."""

    run_id: str
    credit: int


class Cancel(_Msg, frozen=True, kw_only=True, tag="cancel"):
    run_id: str
    reason: CancelReason
    message: str = ""


class LoadModel(_Msg, frozen=True, kw_only=True, tag="load_model"):
    """Load the node's on-demand ``model`` (one it offered); the node answers
    one ``ModelLoadResult`` with the same ``request_id`` once it is ready or
    not, within ``node.model_load_timeout_s``."""

    request_id: str
    model: str


class ModelAction(enum.Enum):
    """What an operator does to a node's on-demand model (``ControlModel``)."""

    LOAD = "load"  # start its load now (not waited for)
    UNLOAD = "unload"  # unload it once its runs end
    PIN = "pin"  # never evict or idle-unload it; load it if it is not loaded
    UNPIN = "unpin"  # evictable again (the config's ``pinned`` returns at restart)


class ControlModel(_Msg, frozen=True, kw_only=True, tag="control_model"):
    """An operator's ``action`` on the node's on-demand ``model``; sent only
    to a node whose hello said ``model_controls``. Answered at once with one
    ``ModelControlResult`` of the same ``request_id``; ``by`` says who asked
    (for the node's log)."""

    request_id: str
    model: str
    action: ModelAction
    by: str = ""


EdgeMessage = Welcome | Assign | Credit | Cancel | Ping | LoadModel | ControlModel

_M = TypeVar("_M", NodeMessage, EdgeMessage)

_ENCODER: Final = msgspec.msgpack.Encoder()
_NODE_DECODER: Final = msgspec.msgpack.Decoder(NodeMessage)
_EDGE_DECODER: Final = msgspec.msgpack.Decoder(EdgeMessage)
_NODE_BATCH_DECODER: Final = msgspec.msgpack.Decoder(list[NodeMessage])
_EDGE_BATCH_DECODER: Final = msgspec.msgpack.Decoder(list[EdgeMessage])


def encode(message: NodeMessage | EdgeMessage) -> bytes:
    """Encode one message (a handshake frame, or an element of ``encode_batch``)."""
    return _ENCODER.encode(message)


def array_header(n: int) -> bytes:
    """The msgpack header of an array of ``n`` elements (msgpack spec, "array format")."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 0x10000:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def encode_batch(encoded: list[bytes]) -> bytes:
    """One frame of already encoded messages: a msgpack array of them.

    Each message is encoded once (``encode``); the frame is the array header
    and their bytes, so a driver can size frames without encoding twice.
    """
    return array_header(len(encoded)) + b"".join(encoded)


def decode_node_message(frame: bytes) -> NodeMessage:
    """Decode a frame the edge received.

    Raises:
        LinkProtocolError: Not a node message.
    """
    try:
        return _NODE_DECODER.decode(frame)
    except msgspec.DecodeError as exc:
        raise LinkProtocolError(f"bad frame from node: {exc}") from exc


def _decode_batch(
    decoder: msgspec.msgpack.Decoder[list[_M]], frame: bytes, sender: str
) -> list[_M]:
    try:
        batch = decoder.decode(frame)
    except msgspec.DecodeError as exc:
        raise LinkProtocolError(f"bad frame from {sender}: {exc}") from exc
    if not batch:
        raise LinkProtocolError("a frame with no messages")
    return batch


def decode_node_batch(frame: bytes) -> list[NodeMessage]:
    """Decode a frame of node messages (after the handshake).

    Raises:
        LinkProtocolError: Not a non-empty array of node messages.
    """
    return _decode_batch(_NODE_BATCH_DECODER, frame, "node")


def decode_edge_batch(frame: bytes) -> list[EdgeMessage]:
    """Decode a frame of edge messages (after the handshake).

    Raises:
        LinkProtocolError: Not a non-empty array of edge messages.
    """
    return _decode_batch(_EDGE_BATCH_DECODER, frame, "edge")


def decode_edge_message(frame: bytes) -> EdgeMessage:
    """Decode a frame the node received.

    Raises:
        LinkProtocolError: Not an edge message.
    """
    try:
        return _EDGE_DECODER.decode(frame)
    except msgspec.DecodeError as exc:
        raise LinkProtocolError(f"bad frame from edge: {exc}") from exc
