"""The scheduler's queue: whose a waiting run is, and the ways it leaves.

A run that finds no free slot waits (``Scheduler.acquire``) as a
``_Waiter``, kept by what it waits for (model, operation, excluded nodes)
and whose it is (``QueueShare``: class and tenant), each group in arrival
order. Every waiter leaves the queue one way (``QueueExit``): placed,
cancelled (its run ended while it waited: the client left, a deadline,
shutdown) or timed out. The scheduler counts the exits and keeps the host's
monotonic time of the last one (``QueueExitAt``): ``/metrics`` and
``/admin/nodes`` show them, and ``scripts/bench_stress.py`` times a queued
run's cancel with it on the clock it shares with the edge
(docs/benchmarks.md, "Cancellation").
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import msgspec
import trio

if TYPE_CHECKING:
    from iop.edge.scheduler._leases import Lease

__all__ = ["EVEN_SHARE", "QueueExit", "QueueExitAt", "QueueShare"]


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
