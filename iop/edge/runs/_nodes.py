"""The edge's view of its nodes: one ``NodeConnection`` per live link, in a ``NodeRegistry``.

``NodeRegistry`` holds one ``NodeConnection`` per connected node id (a node
that reconnects replaces its old registration once that link is dead; a live
one is never taken over: ``iop.edge.runs._handshake``) and, for each, the
instances it advertised with the edge's own count of runs in flight on them.

Load reports: a node sends its instances' live load (``LoadReport``: runs
in flight and queued on the node across every edge, and the engine's own
figures when it publishes them), kept per instance as ``ReportedLoad``,
clamped so that an absurd report cannot overflow a score; placement reads
them as hints (``iop.edge.scheduler._placement``).

Operator drains (``NodeRegistry.drained``, by node id): a drained node is
no candidate for new runs, as one that said goodbye is not
(``NodeConnection.draining``), but the two stay apart: a goodbye belongs to
one link and ends with it, an operator's drain to the id, so it outlives the
node's reconnects until an operator undrains it. Runs already placed on a
drained node run to their end.

A connection hands its runs' events to them through its ``delivery``:
``DirectDelivery`` with per-run credit (the default), chosen once per link
(``iop.edge.runs._delivery``).
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

import msgspec
import trio

from iop.capabilities import Capabilities, ProviderStatus
from iop.edge.runs._attempt import RemoteRun, keep_node_timeline
from iop.edge.runs._model_controls import ModelStats, NodeModels
from iop.events import CancelReason
from iop.protocol import (
    RELEASED_RUNS_REMEMBERED,
    EdgeSession,
    InstanceLoad,
    ModelOffer,
    RunEventsReceived,
)
from iop.runtime import Backpressure
from iop.spec import ExecutionSpec
from iop.timeline import Timeline

__all__ = [
    "LOAD_FIGURE_CAP",
    "DirectDelivery",
    "InstanceState",
    "LinkDelivery",
    "NodeConnection",
    "NodeDrain",
    "NodeRegistry",
    "ReportedLoad",
]


def _nothing() -> None:
    pass


# A reported count above this is read as this: more runs than any instance
# holds, so an absurd report ranks its instance last without overflowing a
# score; the report is only a hint (the node's admission decides).
LOAD_FIGURE_CAP: Final = 1_000_000


def _count(value: int) -> int:
    return min(max(value, 0), LOAD_FIGURE_CAP)


def _figure(value: float | None, cap: float) -> float | None:
    """A reported engine figure within [0, cap]; None for NaN or none."""
    if value is None or math.isnan(value):
        return None
    return min(max(value, 0.0), cap)


@dataclass(eq=False, slots=True)
class ReportedLoad:
    """What a node last reported of one instance, made safe to score.

    Attributes:
        in_flight: Runs holding a slot on the node (every edge's).
        queued: Runs waiting in the node's queue.
        at: When the report came (edge clock).
        running: The engine's running requests (None: not published).
        waiting: The engine's waiting requests.
        kv_usage: The engine's KV-cache usage, 0 to 1.
        engine_at: When the engine's figures were taken (edge clock:
            the report's arrival less their age).
    """

    in_flight: int
    queued: int
    at: float
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    engine_at: float = -math.inf

    @classmethod
    def of(cls, load: InstanceLoad, now: float) -> ReportedLoad:
        """``load`` clamped: negative counts are 0, huge ones ``LOAD_FIGURE_CAP``,
        NaN figures unknown, a KV usage within 0..1, a NaN age stale."""
        out = cls(_count(load.in_flight), _count(load.queued), now)
        engine = load.engine
        if engine is not None:
            out.running = _figure(engine.running, LOAD_FIGURE_CAP)
            out.waiting = _figure(engine.waiting, LOAD_FIGURE_CAP)
            out.kv_usage = _figure(engine.kv_usage, 1.0)
            age = engine.age_s
            out.engine_at = -math.inf if math.isnan(age) else now - max(age, 0.0)
        return out


@dataclass(eq=False)
class InstanceState:
    node_id: str
    caps: Capabilities
    in_flight: int = 0
    # Of those, runs of sheddable objectives (the reserve's count:
    # iop.edge.scheduler._placement).
    sheddable_in_flight: int = 0
    # Of those, how many of each objective priority; and the runs on an
    # overflow seat beyond its slots (engine priority:
    # iop.edge.scheduler._placement).
    sheddable_ranks: Counter[int] = field(default_factory=Counter)
    overflow_in_flight: int = 0
    reported: ReportedLoad | None = None
    # An on-demand model of the node (``[[models]]``): its state and what a
    # load costs (``iop.edge.scheduler._ondemand``); None for an instance.
    offer: ModelOffer | None = None

    @property
    def usable(self) -> bool:
        """Whether runs may be placed on it now. An on-demand model only while
        it is ready: a run for one that is cold or loading waits at the edge
        for its load (``Scheduler.acquire``), not in the node's queue."""
        if self.offer is not None:
            return self.offer.state == "ready"
        return self.caps.provider_status is not ProviderStatus.UNAVAILABLE

    @property
    def free(self) -> int:
        return self.caps.max_concurrency - self.in_flight


class LinkDelivery(Protocol):
    """How a link's reader hands its runs' events to them (``iop.edge.runs._delivery``)."""

    @property
    def backpressure(self) -> Backpressure | None:
        """What makes the link's reader wait before it reads on (None: nothing)."""
        ...

    @property
    def held(self) -> Sequence[RunEventsReceived]:
        """The run events the link's reader holds back, in order."""
        ...

    def on_events(self, events: list[RunEventsReceived]) -> None:
        """A frame's run events, in order (the link reader: never blocks)."""
        ...

    def drop(self, run_id: str) -> None:
        """``run_id`` left the link: stop anything that waits for its consumer."""
        ...


class DirectDelivery:
    """Per-run credit (the default): each run's events go straight to its
    consumer, whose channel credit keeps from filling; the reader never waits."""

    __slots__ = ("_conn",)

    def __init__(self, conn: NodeConnection) -> None:
        self._conn = conn

    @property
    def backpressure(self) -> Backpressure | None:
        return None

    @property
    def held(self) -> Sequence[RunEventsReceived]:
        return ()

    def on_events(self, events: list[RunEventsReceived]) -> None:
        conn = self._conn
        for event in events:
            rr = conn.run_of(event)
            if rr is not None:
                back = rr.deliver(event.events)
                if back:
                    conn.consume(event.run_id, back)

    def drop(self, run_id: str) -> None:
        pass


@dataclass(eq=False)
class NodeConnection:
    """One live link to a node: its session, driver, instances and runs."""

    node_id: str
    session: EdgeSession
    instances: dict[str, InstanceState]
    connected_at: float
    software: str = ""
    peer: str = ""
    draining: bool = False
    goodbye: str = ""  # the reason of the node's goodbye, once it sent one
    # The memory its on-demand models share (``node.memory_mib``; 0: none offered).
    memory_mib: int = 0
    runs: dict[str, RemoteRun] = field(default_factory=dict)
    # Runs the edge cancelled, until the node's terminal (and timeline)
    # comes back; the last RELEASED_RUNS_REMEMBERED, as the session's.
    # (Only the timeline and when the Assign went: not the run and its request.)
    ending: OrderedDict[str, tuple[Timeline, float]] = field(default_factory=OrderedDict)
    cancel_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    close_code: int | None = None
    close_reason: str = ""
    # Set once the link's driver runs; wakes its writer.
    wake: Callable[[], None] = _nothing
    # How the link's reader hands events to the runs: chosen once per link
    # (``iop.edge.runs._delivery.DeliveryPolicy``).
    delivery: LinkDelivery = field(init=False)
    # Its on-demand models as last offered, and the operator's controls of
    # them (iop.edge.runs._model_controls).
    model_ops: NodeModels = field(default_factory=NodeModels)

    def __post_init__(self) -> None:
        self.delivery = DirectDelivery(self)

    def update_instances(self, caps: list[Capabilities]) -> None:
        """The node's new capabilities; an instance it still has keeps its state.

        The same ``InstanceState`` object, not a copy: the leases of runs in
        flight hold it, and their release must free the slot the scheduler
        counts now (a copy kept the count of its time, and an update during
        runs, e.g. a backend that died under them, left the instance full).
        """
        old = self.instances
        instances = {}
        for c in caps:
            inst = old.get(c.instance)
            if inst is None:
                inst = InstanceState(self.node_id, c)
            else:
                inst.caps = c
            instances[c.instance] = inst
        self.instances = instances

    def update_models(self, offers: list[ModelOffer] | None) -> None:
        """The node's on-demand models (None: it said nothing of them, e.g. an
        older node): each offer goes to the instance named after its model."""
        if offers is None:
            return
        by_name = {o.model: o for o in offers}
        for name, inst in self.instances.items():
            inst.offer = by_name.get(name)

    def offers(self) -> Iterator[tuple[InstanceState, ModelOffer]]:
        """Its on-demand models' instances with their offers."""
        for inst in self.instances.values():
            if inst.offer is not None:
                yield inst, inst.offer

    def load_model(self, request_id: str, model: str) -> None:
        """Ask the node to load its on-demand ``model`` (``EdgeSession.load_model``).

        Raises:
            InvariantError: The link is not open.
        """
        self.session.load_model(request_id, model)
        self.wake()

    def on_load(self, loads: list[InstanceLoad], now: float) -> None:
        """The node's load report: kept per instance it advertised (others ignored)."""
        instances = self.instances
        for load in loads:
            inst = instances.get(load.instance)
            if inst is not None:
                inst.reported = ReportedLoad.of(load, now)

    def assign(
        self,
        rr: RemoteRun,
        instance: str,
        spec: ExecutionSpec,
        credit: int,
        *,
        collect: bool = False,
        collect_flush_s: float = 0.0,
    ) -> None:
        """Put ``rr`` on the link and queue its ``Assign``.

        Raises:
            RequestError: 413, the request does not fit the node's frames.
            InvariantError: The link is not open.
        """
        self.session.assign(
            rr.run_id, instance, spec, credit, collect=collect, collect_flush_s=collect_flush_s
        )
        self.runs[rr.run_id] = rr
        self.wake()

    def consume(self, run_id: str, events: int) -> None:
        """The run's consumer took ``events``: credit goes back (half a window at a time)."""
        if self.session.consumed(run_id, events):
            self.wake()

    def close_run(self, run_id: str, reason: CancelReason | None) -> bool:
        """Take the run off the link; cancel it on the node unless it ended (``reason`` None).

        Returns:
            Whether a Cancel was queued for the node.
        """
        rr = self.runs.pop(run_id, None)
        if rr is not None:
            self.delivery.drop(run_id)
        if reason is not None and self.session.cancel(run_id, reason, "edge gave up on the run"):
            self.wake()
            if rr is not None:
                self.ending[run_id] = (rr.sink.timeline, rr.assigned_at)
                while len(self.ending) > RELEASED_RUNS_REMEMBERED:
                    self.ending.popitem(last=False)
            return True
        return False

    def on_events(self, events: list[RunEventsReceived]) -> None:
        self.delivery.on_events(events)

    @property
    def held(self) -> Sequence[RunEventsReceived]:
        """The run events the link's reader holds back (only without credit)."""
        return self.delivery.held

    def run_of(self, event: RunEventsReceived) -> RemoteRun | None:
        """The run ``event`` is for, once its node timeline is kept; None when
        the run is off the link (an ended run's timeline is kept all the same)."""
        rr = self.runs.get(event.run_id)
        if rr is not None:
            if event.timeline is not None:
                # Before the terminal ends the run and its timeline is kept.
                rr.node_timeline(event.timeline, trio.current_time())
        elif event.timeline is not None:
            ended = self.ending.pop(event.run_id, None)
            if ended is not None:
                keep_node_timeline(*ended, event.timeline, trio.current_time())
        return rr

    def lose_runs(self, message: str) -> int:
        """The link is gone: tell each run on it. Returns how many there were."""
        runs = list(self.runs.values())
        for rr in runs:
            self.delivery.drop(rr.run_id)
            rr.lose(message)
        return len(runs)

    def close(self, code: int, reason: str) -> None:
        """Ask the link's handler to close the link with ``code``."""
        if self.close_code is None:
            self.close_code, self.close_reason = code, reason
        self.cancel_scope.cancel()


class NodeDrain(msgspec.Struct, frozen=True, kw_only=True):
    """An operator's drain of a node id (``POST /admin/nodes/{id}/drain``).

    Attributes:
        reason: What the operator said, if anything.
        by: Who asked: how they were let in, and from where.
        since_unix: When (wall clock).
    """

    reason: str = ""
    by: str = ""
    since_unix: float = 0.0


class NodeRegistry:
    """Connected nodes by id (the handshake refuses an id whose link is alive),
    and the ids an operator drained (connected or not: module docstring)."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeConnection] = {}
        self.drained: dict[str, NodeDrain] = {}
        self.joined = trio.Event()  # set once any node has connected
        # On-demand models' loads, evictions, cold starts (/metrics).
        self.model_stats = ModelStats()

    def add(self, conn: NodeConnection) -> NodeConnection | None:
        """Register ``conn``; return the registration it replaces, if any."""
        old = self.nodes.get(conn.node_id)
        self.nodes[conn.node_id] = conn
        self.joined.set()
        return old

    def remove(self, conn: NodeConnection) -> bool:
        """Unregister ``conn`` if it is still the current one for its id."""
        if self.nodes.get(conn.node_id) is conn:
            del self.nodes[conn.node_id]
            return True
        return False

    def instances(self) -> Iterator[tuple[NodeConnection, InstanceState]]:
        for conn in self.nodes.values():
            for inst in conn.instances.values():
                yield conn, inst

    def models(self) -> dict[str, list[str]]:
        """Model -> node ids serving it (usable instances of live nodes), or
        offering to load it (their on-demand models, in any state: a run for
        one waits for its load, or is told why it failed)."""
        out: dict[str, list[str]] = {}
        for conn, inst in self.instances():
            if conn.draining or conn.node_id in self.drained:
                continue
            if not inst.usable and inst.offer is None:
                continue
            for t in inst.caps.targets:
                nodes = out.setdefault(t, [])
                if conn.node_id not in nodes:
                    nodes.append(conn.node_id)
        return out
