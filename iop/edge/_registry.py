"""The edge's view of its nodes, and the scheduler that places runs on them.

``NodeRegistry`` holds one ``NodeConnection`` per connected node id (a node
that reconnects replaces its old registration once that link is dead; a live
one is never taken over) and, for each, the instances
it advertised with the edge's own count of runs in flight on them.

``Scheduler`` places a run on the least-loaded instance that serves its model
and its operation (``Capabilities.operations``: chat, completion, embedding,
tokenize) and has a free slot (``in_flight < max_concurrency``), unless the run's
conversation was served before by an instance that still has a free slot:
then it goes there again (session affinity, so the backend's prefix cache
holds the prompt's head; see ``affinity_key``; a conversation is its
tenant's alone unless tenants share their caches). When none has, the run
waits in the queue, bounded by ``queue_timeout_s`` (->
``Cancelled(queue_timeout)``). Every change of capacity (a run ends, a node
joins or updates its capabilities) calls ``dispatch()``, which hands free
slots to waiters by class, then tenants' fair shares, then arrival (first
come first served with one tenant); waiters never poll.

Admission (``admit``, and ``acquire`` for a run that would have to wait):
a run that finds a free slot always starts; one that would have to queue is
refused at once with 429 ``queue_full`` (the HTTP layer adds Retry-After)
when the queue holds ``max_queue`` runs, or when it would wait
``max_queue_delay_s`` or more (``queue_delay``, estimated from how fast the
queue for its model drains). The second bound keeps an overloaded edge's
goodput at its capacity: past saturation the queue would otherwise fill to
``max_queue`` and every admitted run would wait ``max_queue`` / (runs
finished per second), seconds that clients (and their timeouts) spend on
runs that then fail late, while the excess is refused only once the count
is reached (docs/benchmarks.md, "Overload").

Waiters are kept by what they wait for (model, operation, excluded nodes),
each group in arrival order: a pick that fails for a group's oldest waiter
fails for all of them (they need a free slot on the same candidates), so a
dispatch costs one pick per group and per slot handed out, not one per
waiter. With one FIFO scanned whole, every finished run cost a pick for
each of up to ``max_queue`` waiters, and an overloaded edge spent its CPU
there.

Load reports: a node sends its instances' live load (``LoadReport``: runs
in flight and queued on the node across every edge, and the engine's own
figures when it publishes them). Placement scores an instance by the larger
of the edge's own count and the node's in-flight plus queued, plus the
engine's waiting requests (``Scheduler.occupancy``); with ``prefix``
placement the engine's KV-cache usage costs ``kv_weight``. A report is a
hint and only orders the candidates: a free slot is still the edge's own
count, so a report older than ``load_stale_s`` (ignored: the edge's own
count again), a missing one, or an absurd one (clamped, ``ReportedLoad``)
can never make an instance look full and hold runs back; the node's own
admission (``iop.node._slots``) refuses what it cannot take, and the run
fails over (docs/operations.md, "How a run is placed"). Reading stale or
missing metrics as saturation is the failure this avoids: llm-d's router
scored such endpoints as full, and when metrics collection failed across
the fleet it stopped dispatching altogether
(https://github.com/llm-d/llm-d-router/pull/2165).
Operator drains (``NodeRegistry.drained``, by node id): a drained node is
no candidate for new runs, as one that said goodbye is not
(``NodeConnection.draining``), but the two stay apart: a goodbye belongs to
one link and ends with it, an operator's drain to the id, so it outlives the
node's reconnects until an operator undrains it. Runs already placed on a
drained node run to their end; queued runs wait for other candidates (or for
the undrain).

Every waiter leaves the queue one way (``QueueExit``): placed, cancelled
(its run ended while it waited: the client left, a deadline, shutdown) or
timed out. The scheduler counts the exits and keeps the host's monotonic
time of the last one (``last_exit``): ``/metrics`` and ``/admin/nodes``
show them, and ``scripts/bench_stress.py`` times a queued run's cancel with
it on the clock it shares with the edge (docs/benchmarks.md,
"Cancellation").
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import logging
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final

import msgspec
import trio

from iop._secrets import SecretMasker, mask_event
from iop.capabilities import Capabilities, ProviderStatus
from iop.config import SchedulerSettings
from iop.edge.scheduler._prefix import PrefixIndex, prompt_blocks
from iop.errors import (
    RETRYABLE_CANCEL_REASONS,
    RETRYABLE_CODES,
    ErrorCode,
    InvariantError,
    IopError,
    RunAborted,
)
from iop.events import Cancelled, CancelReason, Error, RuntimeEvent, Start, is_terminal
from iop.protocol import RELEASED_RUNS_REMEMBERED, EdgeSession, InstanceLoad, RunEventsReceived
from iop.runtime import RunSink
from iop.spec import ChatRequest, CompletionRequest, ExecutionSpec, OperationRequest
from iop.timeline import NodeTimeline, Timeline

__all__ = [
    "Lease",
    "NodeConnection",
    "NodeDrain",
    "NodeRegistry",
    "QueueExit",
    "QueueExitAt",
    "RemoteRun",
    "ReportedLoad",
    "Scheduler",
    "affinity_key",
]

log = logging.getLogger("iop.edge.scheduler")


def _nothing() -> None:
    pass


class RemoteRun:
    """The edge's end of one attempt of a run on a node.

    The link reader delivers the node's events straight into the run's
    consumer channel (``deliver``, through the run's sink, never waiting:
    credit keeps the channel from filling), and wakes the run's executor,
    which only waits on ``done``, when the attempt is over: its terminal
    event went to the consumer, it failed in a way another node may not
    (``retry``), it broke the event grammar (``violation``) or the link was
    lost (``lost``).

    With per-run credit off (``link.run_window = 0``) nothing keeps the
    channel from filling: ``unread_limit`` is then how many events the
    consumer may leave unread, and ``deliver`` stops there and leaves the
    rest in ``leftover`` for the link reader to hold (``NodeConnection``).
    """

    __slots__ = (
        "assigned_at",
        "done",
        "hold",
        "leftover",
        "lost",
        "masker",
        "output",
        "retry",
        "run_id",
        "sink",
        "started",
        "unread_limit",
        "violation",
    )

    def __init__(
        self,
        run_id: str,
        sink: RunSink,
        masker: SecretMasker,
        started: list[bool],
        assigned_at: float = 0.0,
        unread_limit: int = 0,
    ) -> None:
        self.run_id = run_id
        self.unread_limit = unread_limit  # 0: credit keeps the channel from filling
        self.leftover: list[RuntimeEvent] | None = None
        # The link reader's wait for this run's consumer (cancelled when the run closes).
        self.hold: trio.CancelScope | None = None
        self.sink = sink
        # When the Assign went out (edge clock): the start of the round trip
        # the node's timeline is set against (NodeTimeline.on_edge_clock).
        self.assigned_at = assigned_at
        self.masker = masker
        # Shared by the run's attempts: whether a Start reached the consumer
        # (a failover attempt's own Start is not forwarded again).
        self.started = started
        self.done = trio.Event()
        self.output = False  # content, reasoning or a terminal reached the consumer
        self.retry: Error | Cancelled | None = None
        self.violation: str | None = None
        self.lost: str | None = None

    def deliver(self, events: list[RuntimeEvent]) -> int:
        """Hand the node's events to the run; return the credit to give back at once.

        A Start that is not forwarded (a failover attempt's) is not consumed
        by anyone, so its credit is returned here.
        """
        if self.done.is_set():
            return 0
        unconsumed = 0
        limit = self.unread_limit
        for i, ev in enumerate(events):
            if limit and not is_terminal(ev) and self.sink.unread >= limit:
                # No credit held the node back and the consumer is behind:
                # the rest waits, and so does the link (``NodeConnection``).
                self.leftover = events[i:]
                return unconsumed
            if isinstance(ev, Start):
                if self.started[0]:
                    unconsumed += 1
                    continue
                self.started[0] = True
            elif not self.output and (
                (isinstance(ev, Error) and ev.code in RETRYABLE_CODES)
                or (isinstance(ev, Cancelled) and ev.reason in RETRYABLE_CANCEL_REASONS)
            ):
                # The node refused or never ran it: another node may.
                self.retry = ev
                self.done.set()
                return unconsumed
            else:
                self.output = True
                # What a node sends is masked with the edge's secrets before
                # a client (or the admin views) can see it: a node or its
                # backend may echo one.
                ev = mask_event(ev, self.masker)
            try:
                self.sink.push_nowait(ev)
            except InvariantError as exc:
                self.violation = exc.message
                self.done.set()
                return unconsumed
            if is_terminal(ev):
                self.done.set()
        return unconsumed

    def node_timeline(self, node: NodeTimeline, now: float) -> None:
        """The node's side of the attempt arrived (with its terminal)."""
        _keep_node_timeline(self.sink.timeline, self.assigned_at, node, now)

    def unhold(self) -> None:
        """The run is off the link: the reader stops waiting for its consumer."""
        if self.hold is not None:
            self.hold.cancel()

    def lose(self, message: str) -> None:
        """The node's link is gone."""
        self.unhold()
        if not self.done.is_set():
            self.lost = message
            self.done.set()


def _keep_node_timeline(
    timeline: Timeline, assigned_at: float, node: NodeTimeline, now: float
) -> None:
    """Keep ``node`` in the run's ``timeline``, in the edge's clock."""
    moved = node.on_edge_clock(assigned_at, now, timeline.max_stalls)
    if moved is not None:
        timeline.node = moved


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
    reported: ReportedLoad | None = None

    @property
    def usable(self) -> bool:
        return self.caps.provider_status is not ProviderStatus.UNAVAILABLE

    @property
    def free(self) -> int:
        return self.caps.max_concurrency - self.in_flight


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
    # Per-run credit off: the events the link reader holds, in order, behind
    # a run whose consumer is behind (head-of-line blocking: ``release``).
    held: deque[RunEventsReceived] = field(default_factory=deque)

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
            rr.unhold()
        if reason is not None and self.session.cancel(run_id, reason, "edge gave up on the run"):
            self.wake()
            if rr is not None:
                self.ending[run_id] = (rr.sink.timeline, rr.assigned_at)
                while len(self.ending) > RELEASED_RUNS_REMEMBERED:
                    self.ending.popitem(last=False)
            return True
        return False

    def on_events(self, events: list[RunEventsReceived]) -> None:
        if self.held:
            self.held.extend(events)
            return
        for i, event in enumerate(events):
            rest = self._deliver(event)
            if rest is not None:
                self.held.append(rest)
                self.held.extend(events[i + 1 :])
                return

    def _deliver(self, event: RunEventsReceived) -> RunEventsReceived | None:
        """Deliver ``event``; return what its run's consumer has no room for."""
        rr = self.runs.get(event.run_id)
        if rr is not None:
            if event.timeline is not None:
                # Before the terminal ends the run and its timeline is kept.
                rr.node_timeline(event.timeline, trio.current_time())
            back = rr.deliver(event.events)
            if back:
                self.consume(event.run_id, back)
            if rr.leftover is not None:
                rest, rr.leftover = rr.leftover, None
                return RunEventsReceived(event.run_id, rest, event.finished)
        elif event.timeline is not None:
            ended = self.ending.pop(event.run_id, None)
            if ended is not None:
                _keep_node_timeline(*ended, event.timeline, trio.current_time())
        return None

    def is_held(self) -> bool:
        """The link reader must wait (``release``) before it reads the next frame."""
        return bool(self.held)

    async def release(self) -> None:
        """Deliver the held events, each run's once its consumer has room.

        Only with per-run credit off. A run that leaves the link (its
        client went away, ``slow_client``, a deadline) stops the wait and
        its held events are dropped; everything behind it on the link waits
        meanwhile: that is the head-of-line blocking credit prevents.
        """
        held = self.held
        while held:
            event = held[0]  # still held while the reader waits (``is_held``)
            rr = self.runs.get(event.run_id)
            if rr is not None and rr.unread_limit:
                with trio.CancelScope() as rr.hold:
                    await rr.sink.wait_unread_below(rr.unread_limit)
                rr.hold = None
            held.popleft()
            rest = self._deliver(event)
            if rest is not None:
                held.appendleft(rest)

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
    """Connected nodes by id (``EdgeCore`` refuses an id whose link is alive),
    and the ids an operator drained (connected or not: module docstring)."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeConnection] = {}
        self.drained: dict[str, NodeDrain] = {}
        self.joined = trio.Event()  # set once any node has connected

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
        """Model -> node ids serving it (usable instances of live nodes)."""
        out: dict[str, list[str]] = {}
        for conn, inst in self.instances():
            if conn.draining or conn.node_id in self.drained or not inst.usable:
                continue
            for t in inst.caps.targets:
                nodes = out.setdefault(t, [])
                if conn.node_id not in nodes:
                    nodes.append(conn.node_id)
        return out


# Messages of the conversation's head that make its affinity key: the system
# prompt and the first user turn. Agent loops and chats resend them on every
# turn, and they are what a backend's prefix cache holds.
AFFINITY_HEAD_MESSAGES: Final = 2
# The head of a legacy completion's prompt that makes its key: 2048
# characters (or 512 token ids) hold a shared instruction or few-shot
# preamble, what a prefix cache would reuse, and prompts that differ there
# spread across instances like unrelated conversations.
AFFINITY_PROMPT_HEAD_CHARS: Final = 2048
AFFINITY_PROMPT_HEAD_IDS: Final = 512
# Candidates a placement keeps for the run's timeline: every instance of a
# cluster of a few nodes; a bigger one's timeline must not grow with it.
PLACEMENT_CANDIDATES_KEPT: Final = 32


def affinity_key(request: OperationRequest, scope: str = "") -> str | None:
    """A stable key for the conversation ``request`` belongs to.

    The client's ``user`` field when set (an explicit session), else a hash
    of the model and the conversation's head messages (chat) or the prompt's
    head (legacy completions). Embeddings and token counts without ``user``
    have no conversation and no prefix to reuse: None. ``scope`` (the run's
    cache salt: its tenant's, ``iop.edge.tenancy._tenants``) comes first, so that
    another tenant's identical head or ``user`` is another conversation;
    the empty scope is the shared cache.
    """
    key = _unscoped_affinity_key(request)
    if key is None or not scope:
        return key
    return f"{len(scope)}:{scope}:{key}"  # the length keeps any scope unambiguous


def _unscoped_affinity_key(request: OperationRequest) -> str | None:
    user = getattr(request, "user", None)
    if user:
        return f"user:{request.model}:{user}"
    if isinstance(request, CompletionRequest):
        prompt = request.prompt
        cut = (
            prompt[:AFFINITY_PROMPT_HEAD_CHARS]
            if isinstance(prompt, str)
            else prompt[:AFFINITY_PROMPT_HEAD_IDS]
        )
        digest = hashlib.blake2b(msgspec.json.encode([request.model, cut]), digest_size=16)
        return "prompt:" + digest.hexdigest()
    if not isinstance(request, ChatRequest):
        return None
    head = msgspec.json.encode([request.model, request.messages[:AFFINITY_HEAD_MESSAGES]])
    return "head:" + hashlib.blake2b(head, digest_size=16).hexdigest()


@dataclass(eq=False)
class Lease:
    """A slot on one instance, held for the life of one attempt of a run."""

    conn: NodeConnection
    instance: InstanceState
    _scheduler: Scheduler
    released: bool = False
    # Why this instance (the run's timeline shows it): the rule that chose,
    # and with ``prefix`` placement each candidate's score.
    why: str = ""
    scores: dict[str, float] = field(default_factory=dict)
    # The instances it was chosen from: (node, instance, in flight, slots).
    candidates: list[tuple[str, str, int, int]] = field(default_factory=list)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.instance.in_flight -= 1
            self._scheduler.dispatch()


class QueueExit(enum.StrEnum):
    """How a run left the scheduler's queue."""

    PLACED = "placed"  # a slot was handed to it
    CANCELLED = "cancelled"  # its run ended while it waited (client gone, deadline, shutdown)
    TIMED_OUT = "timed_out"  # no slot within queue_timeout_s


class QueueExitAt(msgspec.Struct, frozen=True):
    """The last exit from the queue: how, and when on the host's monotonic clock.

    Attributes:
        how: The way it left.
        monotonic_s: ``time.monotonic()`` (CLOCK_MONOTONIC) at its removal,
            comparable with the same clock in any process on the host.
    """

    how: QueueExit
    monotonic_s: float


@dataclass(frozen=True, slots=True)
class QueueShare:
    """Whose a queued run is, for fair queueing (docs/operations.md, "Tenants and limits").

    Attributes:
        tenant: The run's tenant (``iop.edge.tenancy._tenants``).
        priority: Its class: 0 (high) is served before 1 (normal) before 2 (low).
        weight: Its tenant's share of its class (> 0).
    """

    tenant: str = ""
    priority: int = 1
    weight: float = 1.0


EVEN_SHARE: Final = QueueShare()
"""A run with no tenant: class normal, weight 1."""

# What a waiter waits for: a free slot for (model, operation) outside these
# nodes; and whose it is (class and tenant), so that a group is one tenant's
# runs in arrival order.
_WaitKey = tuple[str, str, frozenset[str], int, str]


@dataclass(eq=False)
class _Waiter:
    model: str
    exclude: frozenset[str]
    affinity: str | None = None
    operation: str = "chat"
    prefix: Sequence[bytes] = ()  # the prompt's blocks (iop.edge.scheduler._prefix)
    seq: int = 0  # arrival order across groups
    share: QueueShare = EVEN_SHARE
    # Virtual start and finish tags (start-time fair queueing, ``dispatch``).
    start: float = 0.0
    finish: float = 0.0
    queued_at: float = 0.0
    ahead: int = 0  # waiters of its group ahead of it when it came
    event: trio.Event = field(default_factory=trio.Event)
    lease: Lease | None = None

    @property
    def key(self) -> _WaitKey:
        return (self.model, self.operation, self.exclude, self.share.priority, self.share.tenant)


def _least_loaded(
    free: list[tuple[NodeConnection, InstanceState]],
    preferred: tuple[str, str] | None,
    occupancy: Callable[[InstanceState], float],
) -> tuple[NodeConnection, InstanceState, str]:
    """The conversation's instance if it is free, else the least loaded one."""
    best: tuple[float, NodeConnection, InstanceState] | None = None
    for conn, inst in free:
        if preferred == (conn.node_id, inst.caps.instance):
            # The instance that served this conversation before: its
            # prefix cache likely holds the prompt's head.
            return conn, inst, "affinity"
        load = occupancy(inst) / max(inst.caps.max_concurrency, 1)
        if best is None or load < best[0]:
            best = (load, conn, inst)
    assert best is not None
    _, conn, inst = best
    return conn, inst, "least-loaded"


class Scheduler:
    """Placement (least-loaded, prefix-aware or random) with a bounded FIFO
    queue and admission control."""

    def __init__(self, registry: NodeRegistry, settings: SchedulerSettings) -> None:
        self.registry = registry
        self.settings = settings
        # Runs that left the queue, by how; and the last one (module docstring).
        self.exits: dict[QueueExit, int] = dict.fromkeys(QueueExit, 0)
        self.last_exit: QueueExitAt | None = None
        # Waiters by what they wait for; each dict is an ordered set (arrival
        # order, O(1) removal of a waiter that gives up).
        self._groups: dict[_WaitKey, dict[_Waiter, None]] = {}
        self._queued = 0
        self._arrivals = itertools.count()
        # Fair queueing: each class's virtual time (the start tag of the
        # last waiter served) and each tenant's last finish tag in it. Keys
        # are config tenants: bounded.
        self._vtime: dict[int, float] = {}
        self._last_finish: dict[tuple[int, str], float] = {}
        # Waiters per (class, tenant): the queue's share rule (``_queue_full_for``).
        self._tenant_queued: dict[tuple[int, str], int] = {}
        # Conversation key -> (node, instance) that last served it; LRU-bounded.
        self._affinity: OrderedDict[str, tuple[str, str]] = OrderedDict()
        # What each instance's prefix cache probably holds (``placement = "prefix"``).
        self.prefixes = PrefixIndex(settings.prefix_index_bytes)
        self._random = random.Random()

    @property
    def queued(self) -> int:
        return self._queued

    def occupancy(self, inst: InstanceState, now: float) -> float:
        """The runs ``inst`` is busy with, as placement scores it.

        The larger of the edge's own count and the node's reported in-flight
        plus queued runs (the node may serve other edges), plus the engine's
        waiting requests; a report older than ``load_stale_s`` counts as
        none (the edge's own count), engine figures older than that too.
        """
        own = float(inst.in_flight)
        rep = inst.reported
        stale = self.settings.load_stale_s
        if rep is None or now - rep.at > stale:
            return own
        load = max(own, float(rep.in_flight + rep.queued))
        if rep.waiting is not None and now - rep.engine_at <= stale:
            load += rep.waiting
        return load

    def kv_usage(self, inst: InstanceState, now: float) -> float:
        """The engine's reported KV-cache usage (0 when unknown or stale)."""
        rep = inst.reported
        stale = self.settings.load_stale_s
        if rep is None or rep.kv_usage is None or now - min(rep.at, rep.engine_at) > stale:
            return 0.0
        return rep.kv_usage

    def is_stale(self, inst: InstanceState, now: float) -> bool:
        """Whether ``inst``'s report, or the engine figures in it, are too old
        to be used (``iop_load_stale_instances``); never reported: False."""
        rep = inst.reported
        if rep is None:
            return False
        stale = self.settings.load_stale_s
        if now - rep.at > stale:
            return True
        has_engine = rep.running is not None or rep.waiting is not None or rep.kv_usage is not None
        return has_engine and now - rep.engine_at > stale

    def stale_instances(self) -> int:
        """Instances whose load report is ignored as stale right now."""
        now = trio.current_time()
        return sum(1 for _, inst in self.registry.instances() if self.is_stale(inst, now))

    def queue_delay(
        self, model: str, operation: str = "chat", share: QueueShare = EVEN_SHARE
    ) -> float:
        """How long a run for ``model`` joining the queue now would wait: an estimate.

        FIFO makes it cheap: the oldest waiter of a group has seen every
        waiter that was ahead of it when it came (``ahead``) leave the queue
        in the ``age`` seconds it has waited, so the group drains at about
        ``ahead / age`` runs a second and a newcomer behind its ``n`` waiters
        would wait ``n * age / ahead``. (The oldest waiter's own age alone
        lags behind a growing queue: arrivals at 1.5x the drain rate make the
        tail wait three times as long as the head has.) A head that came to an
        empty queue has seen nothing leave: counted as one, an upper bound on
        the rate. 0 when nothing waits for ``model``.
        """
        now = trio.current_time()
        worst = 0.0
        for (m, op, _, priority, tenant), group in self._groups.items():
            # Its own tenant's groups: with fair queueing, that is the line
            # it joins (another tenant's flood is not ahead of it).
            if (m, op, priority, tenant) != (model, operation, share.priority, share.tenant):
                continue
            head = next(iter(group))
            age = now - head.queued_at
            worst = max(worst, len(group) * age / max(head.ahead, 1))
        return worst

    def _candidates(
        self, model: str, exclude: frozenset[str] = frozenset(), operation: str = "chat"
    ) -> Iterator[tuple[NodeConnection, InstanceState]]:
        """Instances that may run ``operation`` on ``model``: live, neither
        draining nor drained, not excluded, up, and advertising the operation."""
        drained = self.registry.drained
        for conn, inst in self.registry.instances():
            if conn.draining or conn.node_id in exclude or conn.node_id in drained:
                continue
            if not inst.usable:
                continue
            if model in inst.caps.targets and inst.caps.serves(operation):
                yield conn, inst

    def serves(self, model: str, operation: str = "chat") -> bool:
        return self.could_serve(model, frozenset(), operation)

    def prompt_blocks(self, request: OperationRequest, scope: str = "") -> list[bytes]:
        """``request``'s prompt blocks in ``scope`` (the run's cache salt)
        when placement looks at them, else none."""
        if self.settings.placement != "prefix":
            return []
        return prompt_blocks(request, self.settings.prefix_block_chars, scope)

    def _pick(
        self,
        model: str,
        exclude: frozenset[str],
        affinity: str | None = None,
        operation: str = "chat",
        prefix: Sequence[bytes] = (),
    ) -> Lease | None:
        free = [
            (conn, inst)
            for conn, inst in self._candidates(model, exclude, operation)
            if inst.free > 0
        ]
        if not free:
            return None
        # As plain tuples: the timeline's JSON formats them, when someone looks.
        candidates = [
            (c.node_id, i.caps.instance, i.in_flight, i.caps.max_concurrency)
            for c, i in free[:PLACEMENT_CANDIDATES_KEPT]
        ]
        preferred = self._affinity.get(affinity) if affinity is not None else None
        placement = self.settings.placement
        scores: dict[str, float] = {}
        if placement == "random":
            conn, inst = self._random.choice(free)
            why = "random"
        elif placement == "prefix":
            conn, inst, why, scores = self._by_prefix(free, prefix, preferred)
        else:
            now = trio.current_time()
            conn, inst, why = _least_loaded(free, preferred, lambda i: self.occupancy(i, now))
        inst.in_flight += 1
        where = (conn.node_id, inst.caps.instance)
        if affinity is not None:
            self._remember(affinity, where)
        if prefix:
            self.prefixes.routed(where, prefix)
        return Lease(conn, inst, self, why=why, scores=scores, candidates=candidates)

    def _by_prefix(
        self,
        free: list[tuple[NodeConnection, InstanceState]],
        prefix: Sequence[bytes],
        preferred: tuple[str, str] | None,
    ) -> tuple[NodeConnection, InstanceState, str, dict[str, float]]:
        """The best scored candidate: the expected cached share of the prompt,
        minus its load, plus affinity (weights in ``[scheduler]``); or the
        least loaded when the best is too much busier than the idlest.

        The balance rule weighs the instance the score chose against the
        idlest, not the busiest against the idlest (SGLang's cache-aware
        router's rule), and in shares of their slots (load, as the score
        has it), not in runs: one hot instance elsewhere is no reason to
        send a prompt away from the instance that holds its prefix, at the
        price of a whole prefill there and a second copy of the prefix in
        the caches; and 4 runs more is a pile on 8 slots but not on 64
        (docs/benchmarks.md, "Placement: prefix-aware against least-loaded").
        """
        s = self.settings
        now = trio.current_time()
        # Each candidate's load: its occupancy (the edge's count, or the
        # node's fresh report when larger) over its slots.
        loads = [self.occupancy(inst, now) / max(inst.caps.max_concurrency, 1) for _, inst in free]
        scores: dict[str, float] = {}
        best: tuple[float, int, NodeConnection, InstanceState] | None = None
        idlest: int | None = None
        for i, (conn, inst) in enumerate(free):
            where = (conn.node_id, inst.caps.instance)
            matched = self.prefixes.matched(where, prefix) / len(prefix) if prefix else 0.0
            load = loads[i]
            if idlest is None or load < loads[idlest]:
                idlest = i
            score = (
                s.prefix_weight * matched
                - s.load_weight * load
                - s.kv_weight * self.kv_usage(inst, now)
            )
            if where == preferred:
                score += s.affinity_weight
            scores[f"{where[0]}/{where[1]}"] = round(score, 4)
            # Ties go to the first candidate (the registry's order).
            if best is None or score > best[0]:
                best = (score, i, conn, inst)
        assert best is not None
        assert idlest is not None
        score, at, conn, inst = best
        chosen, least = loads[at], loads[idlest]
        if chosen - least > s.balance_load_threshold and chosen > least * s.balance_rel_threshold:
            idle = free[idlest][1]
            why = (
                f"least-loaded: in flight {self.occupancy(inst, now):g}/"
                f"{inst.caps.max_concurrency} against {self.occupancy(idle, now):g}/"
                f"{idle.caps.max_concurrency}"
            )
            conn, inst, _ = _least_loaded(free, None, lambda i: self.occupancy(i, now))
            return conn, inst, why, scores
        return conn, inst, f"prefix: best score {score:.3f} of {len(free)}", scores

    def _remember(self, key: str, where: tuple[str, str]) -> None:
        self._affinity[key] = where
        self._affinity.move_to_end(key)
        while len(self._affinity) > self.settings.affinity_entries:
            self._affinity.popitem(last=False)

    def could_serve(self, model: str, exclude: frozenset[str], operation: str = "chat") -> bool:
        """Whether any node outside ``exclude`` serves ``operation`` on ``model``
        (free or busy)."""
        return any(True for _ in self._candidates(model, exclude, operation))

    def admit(self, model: str, operation: str = "chat", share: QueueShare = EVEN_SHARE) -> None:
        """Refuse a run up front when it could only wait and the queue is full
        or too far behind (see the module's docstring).

        Raises:
            IopError: 429 ``queue_full`` (the HTTP layer adds Retry-After).
        """
        if not self._has_room(model, operation):
            self._refuse_if_behind(model, operation, share)

    def _queue_full_for(self, share: QueueShare) -> bool:
        """Whether a run of ``share``'s tenant may not join the queue for its size.

        Under ``max_queue`` anyone may. At it, a tenant still may while it
        holds fewer than an even part of ``max_queue`` among the tenants
        with runs queued (itself included): one tenant's flood cannot lock
        the others out of the queue. The even parts sum to ``max_queue``,
        so the queue never holds more than twice ``max_queue``.
        """
        limit = self.settings.max_queue
        if self._queued < limit:
            return False
        mine = (share.priority, share.tenant)
        tenants = len(self._tenant_queued) + (mine not in self._tenant_queued)
        return self._tenant_queued.get(mine, 0) >= limit / tenants

    def _refuse_if_behind(self, model: str, operation: str, share: QueueShare = EVEN_SHARE) -> None:
        """Raise 429 when a run for ``model`` may not join the queue now."""
        if self._queue_full_for(share):
            raise IopError(
                f"all nodes serving {model!r} are busy and the queue is full "
                f"({self.settings.max_queue} waiting)",
                status=429,
                code=ErrorCode.QUEUE_FULL,
            )
        limit = self.settings.max_queue_delay_s
        if limit:
            delay = self.queue_delay(model, operation, share)
            if delay >= limit:
                raise IopError(
                    f"all nodes serving {model!r} are busy and a run queued now would "
                    f"wait about {delay:.1f}s (scheduler.max_queue_delay_s={limit:g})",
                    status=429,
                    code=ErrorCode.QUEUE_FULL,
                )

    def _has_room(self, model: str, operation: str = "chat") -> bool:
        return any(inst.free > 0 for _, inst in self._candidates(model, operation=operation))

    async def acquire(
        self,
        model: str,
        *,
        exclude: frozenset[str] = frozenset(),
        affinity: str | None = None,
        operation: str = "chat",
        timeline: Timeline | None = None,
        prefix: Sequence[bytes] = (),
        share: QueueShare = EVEN_SHARE,
    ) -> Lease:
        """A slot for ``operation`` on ``model``, waiting in the queue if needed.

        ``timeline`` (the run's) gets when the run was admitted, or when it
        was queued, why, and when it left the queue with a slot. ``prefix``:
        the prompt's blocks, for ``prefix`` placement (``prompt_blocks``).
        ``share``: whose the run is, for the order in which waiters are
        served (``dispatch``).

        Raises:
            IopError: 429 when the queue is full or too far behind.
            RunAborted: ``queue_timeout`` when no slot came in time.
        """
        ahead = self._queued
        if not ahead:
            lease = self._pick(model, exclude, affinity, operation, prefix)
            if lease is not None:
                if timeline is not None:
                    timeline.admitted = trio.current_time()
                return lease
        self._refuse_if_behind(model, operation, share)
        waiter = _Waiter(
            model,
            exclude,
            affinity,
            operation,
            prefix,
            seq=next(self._arrivals),
            share=share,
            queued_at=trio.current_time(),
        )
        cls = share.priority
        waiter.start = max(
            self._vtime.get(cls, 0.0), self._last_finish.get((cls, share.tenant), 0.0)
        )
        waiter.finish = waiter.start + 1.0 / share.weight
        self._last_finish[cls, share.tenant] = waiter.finish
        group = self._groups.setdefault(waiter.key, {})
        waiter.ahead = len(group)
        group[waiter] = None
        self._queued += 1
        mine = (cls, share.tenant)
        self._tenant_queued[mine] = self._tenant_queued.get(mine, 0) + 1
        if timeline is not None:
            timeline.queued = waiter.queued_at
            timeline.why_queued = (
                f"{ahead} run(s) queued ahead"
                if ahead
                else self._busy_text(model, exclude, operation)
            )
        self.dispatch()
        try:
            with trio.move_on_after(self.settings.queue_timeout_s):
                await waiter.event.wait()
        except BaseException:
            # Cancelled while waiting: leave the queue, or give back a slot
            # that was handed over just before the cancellation landed.
            if waiter.lease is not None:
                waiter.lease.release()
            else:
                self._remove(waiter, QueueExit.CANCELLED)
            if timeline is not None:
                timeline.dequeued = trio.current_time()
            raise
        if waiter.lease is None:
            self._remove(waiter, QueueExit.TIMED_OUT)
            if timeline is not None:
                timeline.dequeued = trio.current_time()
            raise RunAborted(
                f"no capacity for model {model!r} within queue_timeout_s="
                f"{self.settings.queue_timeout_s:g}",
                reason=CancelReason.QUEUE_TIMEOUT,
            )
        if timeline is not None:
            timeline.dequeued = trio.current_time()
        return waiter.lease

    def _busy_text(self, model: str, exclude: frozenset[str], operation: str) -> str:
        """Why a run for ``model`` found no slot: each candidate's load."""
        loads = [
            f"{conn.node_id}/{inst.caps.instance} {inst.in_flight}/{inst.caps.max_concurrency}"
            for conn, inst in self._candidates(model, exclude, operation)
        ]
        return "every slot busy: " + ", ".join(loads[:8]) + (" ..." if len(loads) > 8 else "")

    def _remove(self, waiter: _Waiter, how: QueueExit) -> None:
        """Take a waiter out of the queue (one without a lease is always in it)."""
        group = self._groups[waiter.key]
        del group[waiter]
        tenant = (waiter.share.priority, waiter.share.tenant)
        left = self._tenant_queued[tenant] - 1
        if left:
            self._tenant_queued[tenant] = left
        else:
            del self._tenant_queued[tenant]
        if how is not QueueExit.PLACED and self._last_finish.get(tenant) == waiter.finish:
            # Its tenant's last waiter left unserved: it costs the tenant no turn.
            self._last_finish[tenant] = waiter.start
        self._queued -= 1
        if not group:
            del self._groups[waiter.key]
        self.exits[how] += 1
        self.last_exit = QueueExitAt(how, time.monotonic())

    def dispatch(self) -> None:
        """Hand free slots to waiters: classes in order, tenants by fair share.

        Each round takes, among the groups not yet known to be stuck, the
        oldest waiter of the group that comes first by (class, virtual
        finish tag, arrival): a higher class is always served first; within
        a class, start-time fair queueing (Goyal, Vin and Cheng, SIGCOMM
        1996, https://doi.org/10.1145/248156.248171) with every run costing
        one: a run's start tag is the larger of its class's virtual time
        and its tenant's previous finish tag, its finish tag the start plus
        ``1 / weight``, and serving a run moves the class's virtual time to
        its start tag. A tenant with a burst queued thus takes turns with
        the others in proportion to the weights, and one that was idle
        comes back at the present virtual time, with no credit saved up.
        With one tenant this is first come first served. A group whose
        oldest waiter finds no slot is stuck for the rest of this call (its
        other waiters need the same slots).
        """
        stuck: set[_WaitKey] = set()
        while self._queued:
            head: _Waiter | None = None
            for key, group in self._groups.items():
                if key in stuck:
                    continue
                first = next(iter(group))
                if head is None or (first.share.priority, first.finish, first.seq) < (
                    head.share.priority,
                    head.finish,
                    head.seq,
                ):
                    head = first
            if head is None:
                return
            lease = self._pick(head.model, head.exclude, head.affinity, head.operation, head.prefix)
            if lease is None:
                stuck.add(head.key)
                continue
            self._remove(head, QueueExit.PLACED)
            cls = head.share.priority
            self._vtime[cls] = max(self._vtime.get(cls, 0.0), head.start)
            head.lease = lease
            head.event.set()
