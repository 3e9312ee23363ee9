"""The scheduler's queue: whose a waiting run is, and the ways it leaves.

A run that finds no free slot waits (``Scheduler.acquire``) as a
``_Waiter``, kept by what it waits for (model, operation, excluded nodes)
and whose it is (``QueueShare``: its level, i.e. objective priority and
tenant class, its tenant, whether it may be shed), each group a
``_Group``: its waiters in arrival order and in the order they are served
(deadline, then the session's fair share: docs/operations.md, "Sessions
and objectives"). Every waiter leaves the queue one way (``QueueExit``):
placed, cancelled (its run ended while it waited: the client left, a
deadline, shutdown), timed out, shed (evicted for a run that may not
be), or failed with its model's load (``iop.edge.scheduler._ondemand``).
A run held for its prefix's homes (``prefix_wait_s``) is a waiter too,
counted as any. The scheduler counts the exits and keeps the host's
monotonic time of the last one (``QueueExitAt``): ``/metrics`` and
``/admin/nodes`` show them, and ``scripts/bench_stress.py`` times a queued
run's cancel with it on the clock it shares with the edge
(docs/benchmarks.md, "Cancellation").
"""

from __future__ import annotations

import collections
import enum
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import msgspec
import trio

from iop.errors import IopError
from iop.timeline import Timeline

if TYPE_CHECKING:
    from iop.edge.scheduler._leases import Lease

__all__ = ["EVEN_SHARE", "Excluded", "QueueExit", "QueueExitAt", "QueueShare"]


class QueueExit(enum.StrEnum):
    """How a run left the scheduler's queue."""

    PLACED = "placed"  # a slot was handed to it
    CANCELLED = "cancelled"  # its run ended while it waited (client gone, deadline, shutdown)
    TIMED_OUT = "timed_out"  # no slot within queue_timeout_s
    SHED = "shed"  # a sheddable run evicted for one that is not (429)
    LOAD_FAILED = "load_failed"  # its model failed to load on every node that offers it (503)


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
    """Whose a queued run is, and what it asked for (docs/operations.md,
    "Tenants and limits" and "Sessions and objectives").

    Attributes:
        tenant: The run's tenant (``iop.edge.tenancy._tenants``).
        priority: Its tenant's class: 0 (high) is served before 1 (normal)
            before 2 (low), within one objective priority.
        weight: Its tenant's share of its class (> 0).
        session: The run's session key within its tenant ("" for none).
        rank: Its objective's priority: higher is served first.
        objective: Its objective's name ("" for none).
        sheddable: Its objective may be refused or evicted under overload.
        deadline_s: Its time-to-first-token deadline (None: none).
    """

    tenant: str = ""
    priority: int = 1
    weight: float = 1.0
    session: str = ""
    rank: int = 0
    objective: str = ""
    sheddable: bool = False
    deadline_s: float | None = None

    @property
    def level(self) -> _Level:
        """Its place in the strict order of the queue: objective priority
        (higher first), then the tenant's class."""
        return (-self.rank, self.priority)


EVEN_SHARE: Final = QueueShare()
"""A run with no tenant: class normal, weight 1."""

# Strict levels of the queue: (minus the objective's priority, the tenant's class).
_Level = tuple[int, int]

# What a run's failed attempts rule out: a node id (its link died, or it
# refused the run), or a (node id, instance) pair (that instance's backend
# failed before any output; the node's other instances may still serve).
Excluded = frozenset[str | tuple[str, str]]

# What a waiter waits for: a free slot for (model, operation) outside these
# nodes and instances; whose it is (level, tenant, sheddable), so that a
# group is one tenant's runs of one level; and the homes of its prefix it
# is held for (``prefix_wait_s``; none for most), so that a group's runs
# wait for the same slots.
_WaitKey = tuple[str, str, Excluded, _Level, str, bool, frozenset[tuple[str, str]]]


@dataclass(eq=False, slots=True)
class _Session:
    """A session's fair-queueing state within its tenant and level."""

    last_finish: float = 0.0  # finish tag of its last waiter
    queued: int = 0  # its waiters in the queue


@dataclass(eq=False)
class _Waiter:
    model: str
    exclude: Excluded
    affinity: str | None = None
    operation: str = "chat"
    prefix: Sequence[bytes] = ()  # the prompt's blocks (iop.edge.scheduler._prefix)
    seq: int = 0  # arrival order across groups
    share: QueueShare = EVEN_SHARE
    # Session tags within its tenant (start-time fair queueing, ``dispatch``).
    sstart: float = 0.0
    sfinish: float = 0.0
    session: _Session | None = None
    deadline_at: float = math.inf  # queued_at + the TTFT deadline
    queued_at: float = 0.0
    ahead: int = 0  # waiters of its group ahead of it when it came
    shed: bool = False  # evicted for a run that may not be shed
    preemptions: int = 0  # times its run was preempted (``Scheduler._preempt_for``)
    event: trio.Event = field(default_factory=trio.Event)
    lease: Lease | None = None
    # It waits for a node to load its model (``iop.edge.scheduler._ondemand``):
    # the (node, model) whose load it awaits (None: none on its way now), the
    # last refusal, the run's timeline, and what ends it when the load fails.
    load: bool = False
    load_at: tuple[str, str] | None = None
    load_why: str = ""
    timeline: Timeline | None = None
    error: IopError | None = None
    # What a waiter for a load waits on: set with ``event``, and when a
    # load's answer changes when it should ask again (``Scheduler._wait``).
    nudge: trio.Event = field(default_factory=trio.Event)
    # Held for its prefix's homes (``Scheduler.acquire``, ``prefix_wait_s``):
    # which, until when, and whether it still is (the hold ended: it is
    # placed as any waiter, in the same group).
    homes: frozenset[tuple[str, str]] = frozenset()
    home_until: float = -math.inf
    holding: bool = False

    def wake(self) -> None:
        """It leaves the queue: placed, shed or failed."""
        self.event.set()
        self.nudge.set()

    @property
    def resumed(self) -> bool:
        """Its run was preempted: it queues again, never refused nor shed."""
        return self.preemptions > 0

    @property
    def key(self) -> _WaitKey:
        s = self.share
        return (
            self.model,
            self.operation,
            self.exclude,
            s.level,
            s.tenant,
            s.sheddable,
            self.homes,
        )


@dataclass(eq=False)
class _Group:
    """One group's waiters: in arrival order (``members``), in the order they
    are served (``_heap``: deadline, session finish tag, arrival), and the
    tenant's fair-queueing tags of its turns (``tags``: start, finish, arrival), which
    belong to the group's turns in arrival order, not to the waiter that
    takes a turn (so that the order within the tenant is the sessions')."""

    members: dict[_Waiter, None] = field(default_factory=dict)
    tags: collections.deque[tuple[float, float, int]] = field(default_factory=collections.deque)
    _heap: list[tuple[float, float, int, _Waiter]] = field(default_factory=list)

    def add(self, waiter: _Waiter, tag: tuple[float, float, int]) -> None:
        self.members[waiter] = None
        self.tags.append(tag)
        heapq.heappush(self._heap, (waiter.deadline_at, waiter.sfinish, waiter.seq, waiter))

    def discard(self, waiter: _Waiter) -> None:
        del self.members[waiter]
        # Left in the heap, skipped when on top; rebuilt when mostly gone.
        if len(self._heap) > 2 * len(self.members) + 16:
            self._heap = [e for e in self._heap if e[3] in self.members]
            heapq.heapify(self._heap)

    def first(self) -> _Waiter:
        """The waiter served next (the group is not empty)."""
        while self._heap[0][3] not in self.members:
            heapq.heappop(self._heap)
        return self._heap[0][3]

    def oldest(self) -> _Waiter:
        return next(iter(self.members))
