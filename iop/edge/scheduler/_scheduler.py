"""The scheduler: admission, the queue, and who gets a slot when one frees.

Placement: where a run goes, and the queue and admission in front of it.

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
slots to waiters by objective priority and tenant class, then the earliest
TTFT deadline, then tenants' fair shares, then sessions' fair shares within
a tenant, then arrival (first come first served with one tenant and no
session keys; docs/operations.md, "Sessions and objectives"); waiters
never poll.

A run for an on-demand model that no node serves now but one offers waits
in the same queue while one node loads it (``iop.edge.scheduler._ondemand``
chooses the node and keeps the loads and backoffs), bounded by
``model_load_wait_s`` instead of ``queue_timeout_s``; once the node says the
model is ready, dispatch places it as any waiter.

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
is reached (docs/benchmarks.md, "Overload"). Objectives add three
refusals (``_refuse_if_behind``): a sheddable run past
``shed_queue_fraction`` of the queue, a run whose predicted wait exceeds
its own TTFT deadline, and, instead of refusing a run that may not be shed
at a full queue, the eviction of a queued sheddable one.

Slots for runs that may not wait (docs/operations.md, "Sessions and
objectives"). Serving higher priorities first decides who gets the next
slot that frees, not when one frees: behind a sheddable flood holding every
slot, an interactive run waited up to a whole run's time (the hold of the
slot freed next; docs/benchmarks.md, "Objectives under overload"). Two
mechanisms bound that wait. A reserve: sheddable runs may not hold more
than an instance's slots but ``reserved_slot_fraction`` of them
(``Placement.fits``).
Preemption: a waiter that finds no slot (``dispatch``) takes the slot of a
running sheddable run of a lower objective priority that has sent no output
yet (``_preempt_for``): the lowest priority first, then the newest (least
work lost); its attempt is cancelled on its node and the run is placed
again (``acquire(preemptions=...)``), first of its level, never refused nor
shed for it, at most ``max_preemptions`` times; its client sees one answer.
Only objective priority preempts: a tenant's class or share never does,
and a run that may not be shed is never preempted. One preemption is on
its way at a time for the instances a waiter could use, so a burst of
waiters preempts one run each, not every run at once.

Engine priority (``priority_overflow_slots``; docs/operations.md, "Engine
priority"): the edge cannot take a slot back from a run that has sent
output, but an engine that schedules by priority can pause it. A run that
may not be shed and finds no free slot takes an *overflow* seat beyond
the slots of an instance that advertises ``engine_priority`` and holds
sheddable runs of a lower objective priority (``Placement.pick_overflow``),
before any preemption here: its Assign says so (``ExecutionSpec.overflow``)
and carries its priority, the node runs it at once, and the engine
preempts one of the lower runs for it; that one's client sees a pause, no
error. Counted in ``overflowed``.

Waiting for a prefix's home (``prefix_wait_s``; docs/operations.md, "What
the caches hold"): with ``prefix`` placement, a run whose prefix's homes
have no free slot (``Placement.pick`` answers ``HomeWait``) is *held*: it
queues as any waiter (its turn, ``max_queue``, cancellation), in a group
of its own keyed by those homes (``_WaitKey``), and dispatch offers it
only their slots, never preempting nor taking an overflow seat for it,
until ``prefix_wait_s`` has passed; then it is placed as any waiter. A
newcomer that finds only held runs queued is placed at once: they want
none of the slots that are free. Holds are counted in ``home_waits``.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Final, NoReturn

import trio

from iop.config import SchedulerSettings
from iop.edge.scheduler._leases import Lease
from iop.edge.scheduler._ondemand import FAILED_CODES, ModelLoads, choose_load, pinned_in_way
from iop.edge.scheduler._placement import HomeWait, Placement
from iop.edge.scheduler._prefix import PrefixIndex
from iop.edge.scheduler._queue import (
    EVEN_SHARE,
    Excluded,
    QueueExit,
    QueueExitAt,
    QueueShare,
    _Group,
    _Level,
    _Session,
    _Waiter,
    _WaitKey,
)
from iop.errors import ErrorCode, InvariantError, IopError, RunAborted
from iop.events import CancelReason
from iop.protocol import ModelLoadResult
from iop.spec import OperationRequest
from iop.timeline import ModelLoad, Timeline

if TYPE_CHECKING:
    from iop.edge.runs._nodes import InstanceState, NodeConnection, NodeRegistry

__all__ = ["REFUSALS", "Scheduler"]

# Why a run was refused before it queued (``Scheduler.refused``, a metrics label).
REFUSALS: Final = ("queue_full", "queue_delay", "deadline", "shed")


class Scheduler:
    """Admission, a fair queue and dispatch in front of ``Placement``."""

    def __init__(self, registry: NodeRegistry, settings: SchedulerSettings) -> None:
        self.registry = registry
        self._settings = settings
        # Runs that left the queue, by how; and the last one (module docstring).
        self.exits: dict[QueueExit, int] = dict.fromkeys(QueueExit, 0)
        self.last_exit: QueueExitAt | None = None
        # Waiters by what they wait for; each dict is an ordered set (arrival
        # order, O(1) removal of a waiter that gives up).
        self._groups: dict[_WaitKey, _Group] = {}
        self._queued = 0
        self._arrivals = itertools.count()
        # Fair queueing: each level's virtual time (the start tag of the
        # last turn served) and each tenant's last finish tag in it. Keys
        # are config tenants and objectives: bounded.
        self._vtime: dict[_Level, float] = {}
        self._last_finish: dict[tuple[_Level, str], float] = {}
        # Within a tenant, its sessions' (``session_fairness``): the
        # tenant's virtual time per level, and per tenant at most
        # ``max_sessions_per_tenant`` keyed sessions (LRU, those with runs
        # queued kept) plus the runs without a key, per level.
        self._svtime: dict[tuple[_Level, str], float] = {}
        self._sessions: dict[str, OrderedDict[tuple[_Level, str], _Session]] = {}
        self._unkeyed: dict[tuple[_Level, str], _Session] = {}
        self.sessions_seen = 0  # keyed sessions that began to be tracked
        self.sessions_overflowed = 0  # runs whose session found no room to be tracked
        self.sessions_queued = 0  # keyed sessions with runs queued now
        # Runs refused before they queued, by why (``_refuse_if_behind``).
        self.refused: dict[str, int] = dict.fromkeys(REFUSALS, 0)
        # Waiters per tenant: the queue's share rule (``_queue_full_for``).
        self._tenant_queued: dict[str, int] = {}
        # Which instance a run goes to, once it may have a slot.
        self.placement = Placement(registry, settings)
        # The on-demand models the edge asked nodes to load (``_ondemand``).
        self.loads = ModelLoads()
        # Leases of sheddable runs that may be preempted, oldest first; and
        # those preempted whose attempt has not released them yet.
        self._preemptible: dict[Lease, None] = {}
        self._preempting: dict[Lease, None] = {}
        # How many of those are of each objective priority: a waiter that no
        # preemptible run is below costs ``dispatch`` no look at them.
        self._preemptible_ranks: Counter[int] = Counter()
        self.preempted = 0  # runs preempted (module docstring)
        # Runs held for their prefix's homes now (``prefix_wait_s``), and
        # how holds ended: placed at home, the wait expired, the run left.
        self._holding = 0
        self.home_waits: dict[str, int] = {"home": 0, "expired": 0, "left": 0}
        self.overflowed = 0  # runs placed on an overflow seat (module docstring)

    @property
    def settings(self) -> SchedulerSettings:
        return self._settings

    @settings.setter
    def settings(self, settings: SchedulerSettings) -> None:
        """A reload's keys (``EdgeCore.apply_config``): placement reads them
        from the next run on too. The prefix index keeps the keys it was
        sized and tuned with (they need a restart)."""
        self._settings = self.placement.settings = settings

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def prefixes(self) -> PrefixIndex:
        return self.placement.prefixes

    def occupancy(self, inst: InstanceState, now: float) -> float:
        """``Placement.occupancy``."""
        return self.placement.occupancy(inst, now)

    def kv_usage(self, inst: InstanceState, now: float) -> float:
        """``Placement.kv_usage``."""
        return self.placement.kv_usage(inst, now)

    def is_stale(self, inst: InstanceState, now: float) -> bool:
        """``Placement.is_stale``."""
        return self.placement.is_stale(inst, now)

    def stale_instances(self) -> int:
        """``Placement.stale_instances``."""
        return self.placement.stale_instances()

    def prompt_blocks(self, request: OperationRequest, scope: str = "") -> list[bytes]:
        """``Placement.prompt_blocks``."""
        return self.placement.prompt_blocks(request, scope)

    def serves(self, model: str, operation: str = "chat") -> bool:
        """Whether a node serves ``operation`` on ``model``, or offers to load it."""
        return self.could_serve(model, frozenset(), operation)

    def could_serve(self, model: str, exclude: Excluded, operation: str = "chat") -> bool:
        """``Placement.could_serve``, or a node outside ``exclude`` offers the model."""
        return self.placement.could_serve(model, exclude, operation) or any(
            True for _ in self.offered(model, exclude, operation)
        )

    # --- models on demand (``iop.edge.scheduler._ondemand``) --------------------

    def offered(
        self, model: str, exclude: Excluded = frozenset(), operation: str = "chat"
    ) -> Iterator[tuple[NodeConnection, InstanceState]]:
        """The on-demand models of live nodes (neither draining nor drained,
        not excluded) that would serve ``operation`` on ``model`` once loaded."""
        drained = self.registry.drained
        for conn, inst in self.registry.instances():
            if inst.offer is None or conn.draining or conn.node_id in drained:
                continue
            if conn.node_id in exclude or (
                exclude and (conn.node_id, inst.caps.instance) in exclude
            ):
                continue
            if model in inst.caps.targets and inst.caps.serves(operation):
                yield conn, inst

    def needs_load(self, model: str, exclude: Excluded, operation: str = "chat") -> bool:
        """Whether a run for ``model`` must wait for a node to load it: no node
        serves it now, one offers it."""
        return not self.placement.could_serve(model, exclude, operation) and any(
            True for _ in self.offered(model, exclude, operation)
        )

    def _load_failure(self, model: str, exclude: Excluded, operation: str) -> IopError | None:
        """The 503 for a run of ``model`` when no node that offers it may load
        it soon: each failed to lately (the edge backs off from it), or has
        pinned models in the way (its refusal, or its offers), else None."""
        now = trio.current_time()
        failures = []
        refusals = []
        for conn, inst in self.offered(model, exclude, operation):
            backoff = self.loads.backing_off(conn.node_id, inst.caps.instance, now)
            if backoff is not None and backoff.code in FAILED_CODES:
                failures.append(f"node {conn.node_id}: {backoff.message}")
                continue
            assert inst.offer is not None  # offered
            pinned = pinned_in_way(conn, inst.offer) if backoff is None else backoff.pinned
            if not pinned:
                return None
            names = ", ".join(pinned)
            why = f" ({backoff.message})" if backoff is not None else ""
            refusals.append(
                f"node {conn.node_id}: pinned model{'s' if len(pinned) > 1 else ''} "
                f"{names} in the way{why}"
            )
        if refusals:
            return IopError(
                f"model {model!r} cannot be loaded on any node that offers it until an "
                f"operator unpins a model: {'; '.join([*refusals, *failures])}",
                status=503,
                code=ErrorCode.MODEL_LOAD_REFUSED,
            )
        if not failures:
            return None
        return IopError(
            f"model {model!r} failed to load on every node that offers it "
            f"(asked again after scheduler.model_load_backoff_s="
            f"{self.settings.model_load_backoff_s:g}s): {'; '.join(failures)}",
            status=503,
            code=ErrorCode.MODEL_LOAD_FAILED,
        )

    def _start_load(self, waiter: _Waiter) -> bool:
        """Have a node load ``waiter``'s model (or join a load on its way).

        Returns:
            False when no node may load it now (each backing off, or without
            room): ``waiter.load_why`` says why.
        """
        now = trio.current_time()
        candidates = []
        backoffs = []
        for conn, inst in self.offered(waiter.model, waiter.exclude, waiter.operation):
            backoff = self.loads.backing_off(conn.node_id, inst.caps.instance, now)
            if backoff is None:
                candidates.append((conn, inst))
            else:
                backoffs.append(
                    f"node {conn.node_id} is asked again in {backoff.until - now:.3g}s "
                    f"({backoff.message})"
                )
        choice, why_not = choose_load(candidates)
        if choice is None:
            waiter.load_at = None
            waiter.load_why = "; ".join([*backoffs, *why_not]) or "no node offers it"
            return False
        conn, name = choice.conn, choice.inst.caps.instance
        try:
            self.loads.ask(conn, name, now)
        except InvariantError:  # its link is closing: node_gone comes next
            waiter.load_at = None
            waiter.load_why = f"node {conn.node_id}'s link is closing"
            return False
        waiter.load_at = (conn.node_id, name)
        timeline = waiter.timeline
        if timeline is not None:
            if timeline.model_load is None:
                timeline.model_load = ModelLoad(node=conn.node_id, model=name, started=now)
            else:
                load = timeline.model_load
                load.node, load.model, load.ended, load.result = conn.node_id, name, None, None
            timeline.why_queued = (
                f"model {waiter.model!r} is loading on node {conn.node_id}: {choice.why}"
            )
        return True

    def _load_waiters(self) -> list[_Waiter]:
        return [w for g in self._groups.values() for w in g.members if w.load]

    def load_answered(self, conn: NodeConnection, result: ModelLoadResult) -> None:
        """The node's answer to the edge's ``LoadModel`` (``_ondemand`` docstring)."""
        now = trio.current_time()
        self.loads.answered(conn.node_id, result, now, self.settings.model_load_backoff_s)
        where = (conn.node_id, result.model)
        for waiter in self._load_waiters():
            if waiter.load_at != where:
                continue
            load = waiter.timeline.model_load if waiter.timeline is not None else None
            if load is not None:
                load.ended = now
                load.result = "ready" if result.ok else f"{result.code}: {result.message}"
            if result.ok:
                waiter.load_at = None
                continue
            waiter.load_why = f"node {conn.node_id}: {result.message}"
            self._reconsider(waiter)
        if not result.ok:
            # Those waiting with no load of their own on its way (none could
            # be asked for when they came) see the new backoff too.
            for waiter in self._load_waiters():
                if waiter.load_at is None:
                    waiter.nudge.set()
        self.dispatch()

    def _reconsider(self, waiter: _Waiter) -> None:
        """A waiter whose model is not loaded and whose load is not on its
        way: ask a node to load it; else, when every node that offers it
        failed to, or has pinned models in the way, end it (503); else
        (refused, or no room for now) it waits and asks again when a backoff
        ends or a node's models change."""
        if not self.needs_load(waiter.model, waiter.exclude, waiter.operation):
            return  # loaded (a slot is what it waits for now), or no longer offered
        if self._start_load(waiter):
            return
        failure = self._load_failure(waiter.model, waiter.exclude, waiter.operation)
        if failure is not None:
            self._remove(waiter, QueueExit.LOAD_FAILED)
            waiter.error = failure
            waiter.wake()
        else:
            waiter.nudge.set()  # its wait now ends with the new backoff

    def node_gone(self, conn: NodeConnection, reason: str) -> None:
        """``conn``'s link is gone: the runs waiting for its loads look elsewhere."""
        gone = {(load.node_id, load.model) for load in self.loads.forget_link(conn)}
        for waiter in self._load_waiters():
            if waiter.load_at in gone:
                waiter.load_at = None
                waiter.load_why = reason
                self._reconsider(waiter)

    async def _wait(self, waiter: _Waiter) -> None:
        """Until ``waiter`` is served, shed or failed; one that waits for a
        load asks again whenever a backoff ends, or when nudged."""
        while not waiter.event.is_set():
            if waiter.holding:
                with trio.move_on_at(waiter.home_until):
                    await waiter.event.wait()
                if waiter.event.is_set():
                    return
                # No slot at its homes in time: placed as any waiter.
                self._end_hold(waiter, "expired")
                self.dispatch()
                continue
            if not waiter.load:
                await waiter.event.wait()
                return
            waiter.nudge = trio.Event()
            with trio.move_on_at(self.loads.next_retry(trio.current_time())):
                await waiter.nudge.wait()
            if not waiter.event.is_set() and waiter.load_at is None:
                self._reconsider(waiter)

    def _pick(
        self,
        model: str,
        exclude: Excluded,
        affinity: str | None = None,
        operation: str = "chat",
        prefix: Sequence[bytes] = (),
        share: QueueShare = EVEN_SHARE,
        preemptions: int = 0,
        *,
        hold: bool = False,
        homes: frozenset[tuple[str, str]] = frozenset(),
    ) -> Lease | HomeWait | None:
        placed = self.placement.pick(
            model,
            exclude,
            affinity,
            operation,
            prefix,
            sheddable=share.sheddable,
            hold=hold,
            homes=homes,
        )
        if isinstance(placed, HomeWait):
            return placed
        overflow = False
        if placed is None and homes:
            return None  # held for its homes: no overflow seat elsewhere
        if placed is None and not share.sheddable:
            placed = self.placement.pick_overflow(model, exclude, operation, share.rank)
            overflow = placed is not None
            self.overflowed += overflow
        if placed is None:
            return None
        lease = Lease(
            placed.conn,
            placed.inst,
            self,
            why=placed.why,
            scores=placed.scores,
            candidates=placed.candidates,
            rank=share.rank,
            sheddable=share.sheddable,
            overflow=overflow,
        )
        if share.sheddable:
            placed.inst.sheddable_in_flight += 1
            placed.inst.sheddable_ranks[share.rank] += 1
            if preemptions < self.settings.max_preemptions:
                self._preemptible[lease] = None
                self._preemptible_ranks[share.rank] += 1
        return lease

    def _not_preemptible(self, lease: Lease) -> None:
        if self._preemptible.pop(lease, False) is None:
            self._preemptible_ranks[lease.rank] -= 1

    def released(self, lease: Lease) -> None:
        """``lease``'s slot is free: hand it on (``Lease.release``)."""
        self._not_preemptible(lease)
        self._preempting.pop(lease, None)
        self.dispatch()

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
        line = (model, operation, share.level, share.tenant)
        for (m, op, _, level, tenant, _, _), group in self._groups.items():
            # Its own tenant's groups of its level: with fair queueing, that
            # is the line it joins (another tenant's flood, or a lower
            # objective's, is not ahead of it).
            if (m, op, level, tenant) != line:
                continue
            head = group.oldest()
            age = now - head.queued_at
            worst = max(worst, len(group.members) * age / max(head.ahead, 1))
        return worst

    def admit(self, model: str, operation: str = "chat", share: QueueShare = EVEN_SHARE) -> None:
        """Refuse a run up front when it could only wait and the queue is full
        or too far behind (see the module's docstring).

        Raises:
            IopError: 429 ``queue_full`` (the HTTP layer adds Retry-After);
                503 ``model_load_failed`` or ``model_load_refused`` when no
                node that offers the model may load it soon.
        """
        if self.needs_load(model, frozenset(), operation):
            failure = self._load_failure(model, frozenset(), operation)
            if failure is not None:
                raise failure
            self._refuse_if_behind(model, operation, share, evict=False, estimate=False)
        elif not self.placement.has_room(model, operation, share.sheddable):
            self._refuse_if_behind(model, operation, share, evict=False)

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
        mine = share.tenant
        tenants = len(self._tenant_queued) + (mine not in self._tenant_queued)
        return self._tenant_queued.get(mine, 0) >= limit / tenants

    def _refuse_if_behind(
        self,
        model: str,
        operation: str,
        share: QueueShare = EVEN_SHARE,
        *,
        evict: bool = True,
        estimate: bool = True,
    ) -> None:
        """Raise 429 when a run for ``model`` may not join the queue now.

        In this order: a sheddable run once the queue holds
        ``shed_queue_fraction`` of ``max_queue``; a run the full queue has
        no room for, unless it may not be shed and a sheddable run of its
        level or lower is queued (that one is evicted, when ``evict``); a
        run that would wait ``max_queue_delay_s`` or longer, or longer
        than its own TTFT deadline (not with ``estimate`` False: a run
        waiting for a model's load, whose wait is the load's, not the
        queue's drain).
        """
        s = self.settings
        if share.sheddable and self._queued >= s.shed_queue_fraction * s.max_queue:
            self._refuse(
                "shed",
                f"all nodes serving {model!r} are busy and the queue holds {self._queued} "
                f"runs: objective {share.objective!r} is sheddable "
                f"(scheduler.shed_queue_fraction={s.shed_queue_fraction:g})",
            )
        if self._queue_full_for(share):
            victim = None if share.sheddable else self._shed_victim(share)
            if victim is None:
                self._refuse(
                    "queue_full",
                    f"all nodes serving {model!r} are busy and the queue is full "
                    f"({s.max_queue} waiting)",
                )
            elif evict:
                self._shed(victim)
        limit = s.max_queue_delay_s
        deadline = share.deadline_s
        if not estimate or (not limit and deadline is None):
            return
        delay = self.queue_delay(model, operation, share)
        if limit and delay >= limit:
            self._refuse(
                "queue_delay",
                f"all nodes serving {model!r} are busy and a run queued now would "
                f"wait about {delay:.1f}s (scheduler.max_queue_delay_s={limit:g})",
            )
        if deadline is not None and delay > deadline:
            self._refuse(
                "deadline",
                f"all nodes serving {model!r} are busy and a run queued now would "
                f"wait about {delay:.2f}s, past its time-to-first-token deadline "
                f"of {deadline:g}s",
            )

    def _refuse(self, why: str, message: str) -> NoReturn:
        self.refused[why] += 1
        raise IopError(message, status=429, code=ErrorCode.QUEUE_FULL)

    def _shed_victim(self, share: QueueShare) -> _Waiter | None:
        """The queued run to evict for ``share``'s: the newest sheddable run
        of the lowest level, if that is not above ``share``'s."""
        victim: _Waiter | None = None
        worst: _Level | None = None
        for (_, _, _, level, _, sheddable, _), group in self._groups.items():
            if sheddable and level >= share.level and (worst is None or level > worst):
                # A run that was preempted is not shed: its client waits for
                # the answer it was promised (module docstring).
                newest = next((w for w in reversed(group.members) if not w.resumed), None)
                if newest is not None:
                    victim, worst = newest, level
        return victim

    def _shed(self, waiter: _Waiter) -> None:
        """Evict ``waiter``: its ``acquire`` raises 429."""
        self._remove(waiter, QueueExit.SHED)
        waiter.shed = True
        waiter.wake()

    async def acquire(
        self,
        model: str,
        *,
        exclude: Excluded = frozenset(),
        affinity: str | None = None,
        operation: str = "chat",
        timeline: Timeline | None = None,
        prefix: Sequence[bytes] = (),
        share: QueueShare = EVEN_SHARE,
        preemptions: int = 0,
    ) -> Lease:
        """A slot for ``operation`` on ``model``, waiting in the queue if needed.

        ``timeline`` (the run's) gets when the run was admitted, or when it
        was queued, why, and when it left the queue with a slot. ``prefix``:
        the prompt's blocks, for ``prefix`` placement (``prompt_blocks``).
        ``share``: whose the run is, for the order in which waiters are
        served (``dispatch``). ``preemptions``: how often the run was
        preempted already; one that was is placed again first of its level,
        and never refused nor shed (module docstring).

        A run for an on-demand model no node serves now waits while a node
        loads it (``iop.edge.scheduler._ondemand``), at most
        ``model_load_wait_s`` or its TTFT deadline.

        Raises:
            IopError: 429 when the queue is full or too far behind; 503
                ``model_load_failed``, ``model_load_refused`` (pinned models
                in the way on every node that offers it) or
                ``model_load_timeout``.
            RunAborted: ``queue_timeout`` when no slot came in time.
        """
        ahead = self._queued
        held: HomeWait | None = None
        # Runs held for their prefix's homes want none of the slots free
        # now (they would have taken them): a newcomer is not behind them.
        if ahead == self._holding:
            # Held only while the queue has room: a run that may be placed
            # is not refused for a wait it chose.
            hold = ahead < self.settings.max_queue
            got = self._pick(
                model, exclude, affinity, operation, prefix, share, preemptions, hold=hold
            )
            if isinstance(got, HomeWait):
                held = got
            elif got is not None:
                if timeline is not None:
                    timeline.admitted = trio.current_time()
                return got
        load = held is None and self.needs_load(model, exclude, operation)
        if load:
            failure = self._load_failure(model, exclude, operation)
            if failure is not None:
                raise failure
        resumed = preemptions > 0
        if not resumed and held is None:
            self._refuse_if_behind(model, operation, share, estimate=not load)
        waiter = _Waiter(
            model,
            exclude,
            affinity,
            operation,
            prefix,
            seq=next(self._arrivals),
            share=share,
            queued_at=trio.current_time(),
            load=load,
            timeline=timeline,
            preemptions=preemptions,
        )
        if held is not None:
            waiter.homes, waiter.holding = held.homes, True
            waiter.home_until = waiter.queued_at + self.settings.prefix_wait_s
            self._holding += 1
        if resumed:
            waiter.deadline_at = -math.inf  # it had its turn: the next one of its level
        elif share.deadline_s is not None:
            waiter.deadline_at = waiter.queued_at + share.deadline_s
        mine = (share.level, share.tenant)
        start = max(self._vtime.get(share.level, 0.0), self._last_finish.get(mine, 0.0))
        finish = start + 1.0 / share.weight
        self._last_finish[mine] = finish
        self._join_session(waiter)
        group = self._groups.get(waiter.key)
        if group is None:
            group = self._groups[waiter.key] = _Group()
        waiter.ahead = len(group.members)
        group.add(waiter, (start, finish, waiter.seq))
        self._queued += 1
        self._tenant_queued[share.tenant] = self._tenant_queued.get(share.tenant, 0) + 1
        if timeline is not None:
            timeline.queued = waiter.queued_at
            if held is not None:
                timeline.why_queued = held.why
            elif ahead:
                timeline.why_queued = f"{ahead} run(s) queued ahead"
            else:
                timeline.why_queued = self._busy_text(model, exclude, operation, share.sheddable)
        timeout = self.settings.queue_timeout_s
        if load:
            timeout = self.settings.model_load_wait_s
            if share.deadline_s is not None:
                timeout = min(timeout, share.deadline_s)
            if not self._start_load(waiter) and timeline is not None:
                timeline.why_queued = f"model {model!r} is not loaded: {waiter.load_why}"
        self.dispatch()
        try:
            try:
                with trio.move_on_after(timeout):
                    await self._wait(waiter)
            except BaseException:
                # Cancelled while waiting: leave the queue, or give back a slot
                # that was handed over just before the cancellation landed.
                if waiter.lease is not None:
                    waiter.lease.release()
                elif not waiter.shed and waiter.error is None:
                    self._remove(waiter, QueueExit.CANCELLED)
                raise
            if waiter.error is not None:
                raise waiter.error
            if waiter.shed:
                raise IopError(
                    f"the queue for {model!r} is full: this run of sheddable objective "
                    f"{share.objective!r} was shed for one that may not be",
                    status=429,
                    code=ErrorCode.QUEUE_FULL,
                )
            if waiter.lease is None:
                self._remove(waiter, QueueExit.TIMED_OUT)
                if waiter.load and self.needs_load(model, exclude, operation):
                    raise IopError(
                        f"model {model!r} was not loaded within {timeout:g}s "
                        f"(scheduler.model_load_wait_s, or the run's deadline)"
                        + (f": {waiter.load_why}" if waiter.load_why else ""),
                        status=503,
                        code=ErrorCode.MODEL_LOAD_TIMEOUT,
                    )
                if waiter.load:  # loaded, but no slot came within the same wait
                    raise RunAborted(
                        f"no capacity for model {model!r} within {timeout:g}s of waiting "
                        "for its load and a slot (scheduler.model_load_wait_s)",
                        reason=CancelReason.QUEUE_TIMEOUT,
                    )
                raise RunAborted(
                    f"no capacity for model {model!r} within queue_timeout_s="
                    f"{self.settings.queue_timeout_s:g}",
                    reason=CancelReason.QUEUE_TIMEOUT,
                )
            return waiter.lease
        finally:
            # However it left the queue: placed, shed, timed out or cancelled.
            if timeline is not None:
                timeline.dequeued = now = trio.current_time()
                loaded = timeline.model_load
                if loaded is not None and loaded.ended is None:
                    loaded.ended = now
                    loaded.result = "ready" if waiter.lease is not None else "gave up"

    def _busy_text(
        self, model: str, exclude: Excluded, operation: str, sheddable: bool = False
    ) -> str:
        """Why a run for ``model`` found no slot: each candidate's load (for a
        sheddable run, with the slots reserved from it)."""
        loads = []
        reserved = False
        for conn, inst in self.placement.candidates(model, exclude, operation):
            load = (
                f"{conn.node_id}/{inst.caps.instance} {inst.in_flight}/{inst.caps.max_concurrency}"
            )
            reserve = self.placement.reserve(inst) if sheddable else 0
            reserved = reserved or reserve > 0
            loads.append(f"{load} ({reserve} reserved)" if reserve else load)
        why = "every slot busy"
        if reserved:
            why = "every slot busy or reserved for runs that may not be shed"
        return f"{why}: " + ", ".join(loads[:8]) + (" ..." if len(loads) > 8 else "")

    def _join_session(self, waiter: _Waiter) -> None:
        """Tag ``waiter`` within its tenant: its session's turn (module docstring)."""
        share = waiter.share
        s = self.settings
        mine = (share.level, share.tenant)
        key = share.session if s.session_fairness else ""
        state: _Session | None = None
        if key:
            table = self._sessions.setdefault(share.tenant, OrderedDict())
            state = table.get((share.level, key))
            if state is None and len(table) >= s.max_sessions_per_tenant:
                idle = next((k for k, v in table.items() if not v.queued), None)
                if idle is not None:
                    del table[idle]
            if state is None and len(table) < s.max_sessions_per_tenant:
                state = table[share.level, key] = _Session()
                self.sessions_seen += 1
            if state is None:
                self.sessions_overflowed += 1  # shares the unkeyed runs' turn
            else:
                table.move_to_end((share.level, key))
                if not state.queued:
                    self.sessions_queued += 1
        weight = 1.0
        if state is None:
            state = self._unkeyed.setdefault(mine, _Session())
            weight = s.unkeyed_session_weight
        state.queued += 1
        waiter.session = state
        waiter.sstart = max(self._svtime.get(mine, 0.0), state.last_finish)
        waiter.sfinish = waiter.sstart + 1.0 / weight
        state.last_finish = waiter.sfinish

    def _remove(self, waiter: _Waiter, how: QueueExit) -> None:
        """Take a waiter out of the queue (one without a lease is always in it)."""
        if waiter.holding:
            self._end_hold(waiter, "home" if how is QueueExit.PLACED else "left")
        group = self._groups[waiter.key]
        group.discard(waiter)
        tenant = (waiter.share.level, waiter.share.tenant)
        left = self._tenant_queued[tenant[1]] - 1
        if left:
            self._tenant_queued[tenant[1]] = left
        else:
            del self._tenant_queued[tenant[1]]
        session = waiter.session
        assert session is not None  # set when it joined
        session.queued -= 1
        if not session.queued and session is not self._unkeyed.get(tenant):
            self.sessions_queued -= 1
        if how is QueueExit.PLACED:
            # The group's oldest turn is taken, whichever of its runs takes it.
            start, _, _ = group.tags.popleft()
            self._vtime[tenant[0]] = max(self._vtime.get(tenant[0], 0.0), start)
            self._svtime[tenant] = max(self._svtime.get(tenant, 0.0), waiter.sstart)
        else:
            start, finish, _ = group.tags.pop()
            if self._last_finish.get(tenant) == finish:
                # Its tenant's last turn went unserved: it costs the tenant none.
                self._last_finish[tenant] = start
            if session.last_finish == waiter.sfinish:
                session.last_finish = waiter.sstart
        self._queued -= 1
        if not group.members:
            del self._groups[waiter.key]
        self.exits[how] += 1
        self.last_exit = QueueExitAt(how, time.monotonic())

    def _end_hold(self, waiter: _Waiter, how: str) -> None:
        """``waiter``'s hold for its prefix's homes ends (``home_waits``)."""
        waiter.holding = False
        self._holding -= 1
        self.home_waits[how] += 1
        if waiter.timeline is not None:
            held = min(trio.current_time(), waiter.home_until) - waiter.queued_at
            waiter.timeline.home_wait_ms = round(held * 1000, 3)

    def dispatch(self) -> None:
        """Hand free slots to waiters: levels in order, then deadlines, then
        tenants and sessions by fair share.

        Each round takes, among the groups not yet known to be stuck, the
        first waiter (``_Group.first``) of the group that comes first by
        (objective priority, tenant class, deadline, its tenant's virtual
        finish tag, its session's virtual finish tag, arrival): a higher
        level is always served first; within one, the earliest TTFT
        deadline (none: last); then start-time fair queueing (Goyal, Vin and Cheng, SIGCOMM
        1996, https://doi.org/10.1145/248156.248171) with every run costing
        one: a run's start tag is the larger of its class's virtual time
        and its tenant's previous finish tag, its finish tag the start plus
        ``1 / weight``, and serving a run moves the class's virtual time to
        its start tag. A tenant with a burst queued thus takes turns with
        the others in proportion to the weights, and one that was idle
        comes back at the present virtual time, with no credit saved up.
        With one tenant this is first come first served. Within a tenant,
        the same rule between its sessions (``session_fairness``): the
        tenant's turns go, in order, to its sessions' runs by their session
        tags, so an agent's burst of sub-agents takes turns with the
        tenant's other sessions instead of holding them all back. A group
        whose first waiter finds no slot is stuck for the rest of this call
        (its other waiters need the same slots).
        """
        stuck: set[_WaitKey] = set()
        while self._queued:
            head: _Waiter | None = None
            best: tuple[_Level, float, float, int] | None = None
            for key, group in self._groups.items():
                if key in stuck:
                    continue
                first = group.first()
                # The turn's tags, not the waiter's: session tags compare
                # only within a tenant (``_Group.first``).
                _, finish, seq = group.tags[0]
                order = (key[3], first.deadline_at, finish, seq)
                if best is None or order < best:
                    head, best = first, order
            if head is None:
                return
            lease = self._pick(
                head.model,
                head.exclude,
                head.affinity,
                head.operation,
                head.prefix,
                head.share,
                head.preemptions,
                homes=head.homes if head.holding else frozenset(),
            )
            assert not isinstance(lease, HomeWait)  # asked for no hold
            if lease is None:
                stuck.add(head.key)
                if head.holding:
                    continue  # it may go elsewhere once its hold ends: no preemption
                if head.load and head.load_at is None:
                    # Its model may have room now (a node's models changed).
                    self._reconsider(head)
                self._preempt_for(head)
                continue
            self._remove(head, QueueExit.PLACED)
            head.lease = lease
            head.wake()

    def _preempt_for(self, head: _Waiter) -> None:
        """Preempt a sheddable run for ``head``, which found no slot, if one
        of a lower objective priority on an instance ``head`` may use has
        sent no output yet (module docstring)."""
        rank = head.share.rank
        if not any(n and r < rank for r, n in self._preemptible_ranks.items()):
            return
        usable = {
            id(inst)
            for _, inst in self.placement.candidates(head.model, head.exclude, head.operation)
        }
        if any(id(lease.instance) in usable for lease in self._preempting):
            return  # a slot is on its way to where it may go
        while True:
            victim: Lease | None = None
            for lease in reversed(self._preemptible):  # the newest first
                inst = lease.instance
                # (A sheddable head fits where a sheddable victim was.)
                if lease.rank >= rank or lease.preempt is None or id(inst) not in usable:
                    continue
                if victim is None or lease.rank < victim.rank:
                    victim = lease
            if victim is None:
                return
            self._not_preemptible(victim)
            assert victim.preempt is not None
            if victim.preempt():
                self._preempting[victim] = None
                self.preempted += 1
                return
            # It has sent output: never preempted now; try the next.
