"""Leases: a slot on one instance, held for the life of one attempt of a run.

``Scheduler`` hands one out when it places a run (at once, or to a waiter
in ``dispatch``); the attempt releases it when it ends, which frees the
slot and lets the scheduler hand it to the next waiter.

A lease of a sheddable run may be preempted (``Scheduler`` calls
``preempt`` for a waiter of a higher objective priority that finds no
slot): the attempt holding it sets ``preempt`` once it is on its node, and
the hook ends the attempt only if it has sent no output yet (it says
whether it did); the attempt then releases the lease as any attempt does.

A lease may be an *overflow* seat beyond the instance's slots (engine
priority: ``Placement.pick_overflow``); it releases that seat, not a slot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from iop.edge.runs._nodes import InstanceState, NodeConnection

__all__ = ["Lease"]


class Dispatcher(Protocol):
    """What a released slot is handed back to (``Scheduler``)."""

    def released(self, lease: Lease) -> None: ...


@dataclass(eq=False)
class Lease:
    """A slot on one instance, held for the life of one attempt of a run."""

    conn: NodeConnection
    instance: InstanceState
    _scheduler: Dispatcher
    released: bool = False
    # Why this instance (the run's timeline shows it): the rule that chose,
    # and with ``prefix`` placement each candidate's score.
    why: str = ""
    scores: dict[str, float] = field(default_factory=dict)
    # The instances it was chosen from: (node, instance, in flight, slots).
    candidates: list[tuple[str, str, int, int]] = field(default_factory=list)
    # Its run's objective: priority, and whether it may be shed.
    rank: int = 0
    sheddable: bool = False
    # It holds an overflow seat beyond the instance's slots (engine priority:
    # ``Placement.pick_overflow``).
    overflow: bool = False
    # Ends the attempt if it sent no output yet, and says whether it did
    # (set by the attempt while it may be preempted; module docstring).
    preempt: Callable[[], bool] | None = None

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.instance.in_flight -= 1
            if self.sheddable:
                self.instance.sheddable_in_flight -= 1
                self.instance.sheddable_ranks[self.rank] -= 1
            if self.overflow:
                self.instance.overflow_in_flight -= 1
            self._scheduler.released(self)
