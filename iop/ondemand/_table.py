"""Which on-demand models a node holds, and which to load and unload (sans-IO).

Theory of operation
-------------------
A node may start more models than fit its memory (``[[models]]``,
``node.memory_mib``). ``ModelTable`` keeps one ``Model`` record per
configured model and decides; it does no IO and reads no clock (every call
takes ``now``). Its caller (``iop.node._models``) starts and stops the
processes it is told to (``actions``) and tells it how that went
(``loaded``, ``load_failed``, ``unloaded``, ``exited``).

A model's states, every change made in ``ModelTable._enter`` against the
``TRANSITIONS`` table::

    COLD ──want──► LOADING ──loaded──► READY ──unload, runs going──► DRAINING
      ▲               │                  │ │                             │
      │          load_failed            │ └─idle, evicted, unload──┐  last run ends
      │               ▼                  │                          ▼    ▼
      │  want ◄─ FAILED ◄──exited────────┘                       UNLOADING
      └─────────────────────────────────────────unloaded─────────────┘

``want(name)`` is a run (or the edge) asking for a model: ``Ready`` (lease
it), ``Wait`` (a load or an unload is on its way: ask again after the next
change), or ``Refused`` with why. Wanting a cold model plans its load:

1. Its group (``[[model_groups]]``, llama-swap's ``groups``): with ``swap``
   the other loaded members must go; with ``exclusive`` every loaded model
   outside the group but those of ``persistent`` groups.
2. Memory: if the models that stay leave less than the model's
   ``memory_mib`` of ``node.memory_mib``, idle models are evicted, least
   recently used first, until it fits.

A model may be unloaded (1) or evicted (2) only if no run holds it (a
*lease*), it is not ``pinned``, it is not loading, and its last use (load
or run) is at least ``min_residency_s`` ago; if one that must go may not, or
no set of models that may go frees enough, the load is refused and the
reason names each model in the way and why. A refusal *lasts* (``Refused.pinned``
names the models) when pinned models alone are in the way: a group rule needs
one gone, or the budget less the pinned models' memory is less than the
model's; it passes otherwise (runs end, residencies run out). Otherwise the victims go
``UNLOADING`` and the model ``LOADING``, but its process starts only once
the memory of every model still resident (loading, ready, draining or
unloading) plus its own fits the budget, and the models unloaded for it
are gone (a group's ``swap`` means the two never run at once): the memory held never exceeds
``node.memory_mib`` (tests/ondemand/test_table.py checks it with
hypothesis). Concurrent wants of one model plan one load.

A failed load (or a ready model's process exiting) makes the model
``FAILED`` until ``retry_at``: ``model_retry_min_s``, doubled with each
failure in a row, at most ``model_retry_max_s``; a want before then is
refused with the failure's reason. A ready model with no lease and
``idle_ttl_s`` set is unloaded once it is idle that long, and a ``pinned``
model that is not loaded is wanted, at the start and again at each
``retry_at`` (``tick``, when ``next_deadline`` says).

Leases count per *life* (one load): a run that started on a life which then
exited releases nothing of the next one's.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass

from iop.errors import InvariantError

__all__ = [
    "TRANSITIONS",
    "Action",
    "Decision",
    "GroupSpec",
    "Model",
    "ModelSpec",
    "ModelState",
    "ModelTable",
    "Ready",
    "Refused",
    "StartLoad",
    "StartUnload",
    "Wait",
]


class ModelState(enum.Enum):
    """Where an on-demand model is; changes only in ``ModelTable._enter``."""

    COLD = "cold"  # not loaded: loads when wanted
    LOADING = "loading"  # its load is planned or its process starting
    READY = "ready"  # it serves runs
    DRAINING = "draining"  # to be unloaded once its runs end; takes no new ones
    UNLOADING = "unloading"  # its process is being stopped
    FAILED = "failed"  # its load failed (or it died): not loaded again before retry_at


_S = ModelState
TRANSITIONS: dict[ModelState, frozenset[ModelState]] = {
    _S.COLD: frozenset({_S.LOADING}),
    _S.LOADING: frozenset({_S.READY, _S.FAILED}),
    _S.READY: frozenset({_S.DRAINING, _S.UNLOADING, _S.FAILED}),
    _S.DRAINING: frozenset({_S.UNLOADING, _S.FAILED}),
    _S.UNLOADING: frozenset({_S.COLD}),
    _S.FAILED: frozenset({_S.LOADING}),
}
# States whose process holds (or is about to hold) memory.
_HOLDING = frozenset({_S.LOADING, _S.READY, _S.DRAINING, _S.UNLOADING})


@dataclass(frozen=True)
class GroupSpec:
    """A ``[[model_groups]]`` entry's rules."""

    name: str
    swap: bool = True
    exclusive: bool = True
    persistent: bool = False


@dataclass(frozen=True)
class ModelSpec:
    """What the table needs of a ``[[models]]`` entry."""

    name: str
    memory_mib: int
    pinned: bool = False
    idle_ttl_s: float = 0.0
    min_residency_s: float = 0.0
    group: GroupSpec | None = None


class Model:
    """One model's record.

    Attributes:
        spec: Its config.
        state: Where it is.
        leases: Runs holding it, in this life.
        life: Counts its loads; a lease names the life it holds.
        started: While ``LOADING``: its process was told to start.
        last_used: When it was last loaded, leased or released.
        loading_since: When its load was planned.
        last_load_s: How long its last good load took (0: none yet).
        failures: Failed loads (or exits) in a row.
        retry_at: While ``FAILED``: when it may load again.
        detail: Why it is failed, or what it is loading or unloading for.
        pinned: Kept loaded: ``spec.pinned``, until an operator says
            otherwise (``ModelTable.pin``).
        loads: Good loads so far (counters for the node's offers).
        load_failures: Failed loads, and exits of a loaded life.
        evictions: Unloads to make room for another model.
        cold_starts: Runs that found it not loaded (``ModelTable.cold_start``).
    """

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.pinned = spec.pinned
        self.loads = 0
        self.load_failures = 0
        self.evictions = 0
        self.cold_starts = 0
        self.state = ModelState.COLD
        self.leases = 0
        self.life = 0
        self.started = False
        self.last_used = -math.inf
        self.loading_since = 0.0
        self.last_load_s = 0.0
        self.failures = 0
        self.retry_at = -math.inf
        self.detail = ""
        # While LOADING: the models unloaded for it; it starts once they are gone.
        self.blockers: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.spec.name


# --- what the table tells its driver ------------------------------------------


@dataclass(frozen=True)
class StartLoad:
    """Start the model's process (its memory is free)."""

    model: str


@dataclass(frozen=True)
class StartUnload:
    """Stop the model's process; ``reason`` says why (idle, evicted for X, ...)."""

    model: str
    reason: str


Action = StartLoad | StartUnload


@dataclass(frozen=True)
class Ready:
    """The model serves: lease it."""


@dataclass(frozen=True)
class Wait:
    """A load or unload is on its way: want it again after the next change."""


@dataclass(frozen=True)
class Refused:
    """It cannot be loaded now; ``reason`` says why. ``failed``: its last
    load failed (the backoff); else other models are in the way. ``pinned``:
    the pinned models in the way when the refusal lasts until an operator
    unpins one (module docstring); empty when it passes."""

    reason: str
    failed: bool = False
    pinned: tuple[str, ...] = ()


Decision = Ready | Wait | Refused


class ModelTable:
    """The node's on-demand models; see the module docstring.

    Args:
        specs: The models.
        budget_mib: ``node.memory_mib``.
        retry_min_s: ``node.model_retry_min_s``.
        retry_max_s: ``node.model_retry_max_s``.
    """

    def __init__(
        self,
        specs: Iterable[ModelSpec],
        budget_mib: int,
        *,
        retry_min_s: float = 5.0,
        retry_max_s: float = 300.0,
    ) -> None:
        self.models = {s.name: Model(s) for s in specs}
        self.budget_mib = budget_mib
        self._retry_min_s = retry_min_s
        self._retry_max_s = retry_max_s
        self._actions: list[Action] = []

    # --- reading ----------------------------------------------------------------

    def resident_mib(self) -> int:
        """Memory held by the processes started and not yet gone."""
        return sum(
            m.spec.memory_mib
            for m in self.models.values()
            if m.state in _HOLDING and (m.state is not _S.LOADING or m.started)
        )

    def actions(self) -> list[Action]:
        """What the driver must do now (each action once)."""
        out, self._actions = self._actions, []
        return out

    def next_deadline(self) -> float:
        """When ``tick`` has something to do next (an idle model's ttl, a
        failed pinned model's retry): inf if never."""
        when = math.inf
        for m in self.models.values():
            if self._idle_candidate(m):
                when = min(when, m.last_used + m.spec.idle_ttl_s)
            elif m.pinned and m.state is _S.FAILED:
                when = min(when, m.retry_at)
        return when

    # --- a run or the edge wants a model ----------------------------------------

    def want(self, name: str, now: float) -> Decision:
        """A run (or the edge) wants ``name``: see the module docstring."""
        m = self.models[name]
        if m.state is _S.READY:
            return Ready()
        if m.state in (_S.LOADING, _S.DRAINING, _S.UNLOADING):
            return Wait()
        if m.state is _S.FAILED and now < m.retry_at:
            return Refused(
                f"model {name} failed to load: {m.detail}; retried in "
                f"{m.retry_at - now:.3g}s at the earliest",
                failed=True,
            )
        return self._plan(m, now)

    def _plan(self, m: Model, now: float) -> Decision:
        victims: list[Model] = []
        blocked: list[str] = []
        pinned: list[str] = []
        for other in self._conflicts(m):
            why = self._why_kept(other, now)
            if why:
                blocked.append(f"{other.name} ({why})")
                if other.pinned:
                    pinned.append(other.name)
            else:
                victims.append(other)
        if blocked:
            group = m.spec.group.name if m.spec.group else ""
            return Refused(
                f"model {m.name} may not run with models of group {group!r} rules "
                f"that cannot be unloaded now: {', '.join(blocked)}",
                pinned=tuple(pinned),
            )
        staying = [
            o
            for o in self.models.values()
            if o.state in (_S.LOADING, _S.READY) and o not in victims
        ]
        free = self.budget_mib - sum(o.spec.memory_mib for o in staying)
        need = m.spec.memory_mib
        if need > free:
            movable = sorted(
                (o for o in staying if o.state is _S.READY and not self._why_kept(o, now)),
                key=lambda o: o.last_used,
            )
            for o in movable:
                if need <= free:
                    break
                victims.append(o)
                free += o.spec.memory_mib
            if need > free:
                kept = [f"{o.name} ({self._why_kept(o, now)})" for o in staying if o not in victims]
                pins = [o for o in staying if o.pinned]
                lasting = need > self.budget_mib - sum(o.spec.memory_mib for o in pins)
                return Refused(
                    f"model {m.name} needs {need} MiB of node.memory_mib {self.budget_mib}; "
                    f"{max(0, free)} MiB can be freed, the rest is held by: "
                    f"{', '.join(kept) or 'nothing'}",
                    pinned=tuple(o.name for o in pins) if lasting else (),
                )
        for v in victims:
            v.evictions += 1
            self._unload(v, f"evicted for {m.name}")
        self._enter(m, _S.LOADING)
        m.started = False
        m.loading_since = now
        m.blockers = tuple(v.name for v in victims)
        m.detail = f"evicting {', '.join(v.name for v in victims)}" if victims else ""
        self._start_pending()
        return Wait()

    def _conflicts(self, m: Model) -> list[Model]:
        """Models ``m``'s group rules say must go before it loads."""
        group = m.spec.group
        if group is None:
            return []
        out = []
        for o in self.models.values():
            if o is m or o.state not in (_S.LOADING, _S.READY):
                continue
            og = o.spec.group
            same = og is not None and og.name == group.name
            if (same and group.swap) or (
                not same and group.exclusive and not (og is not None and og.persistent)
            ):
                out.append(o)
        return out

    def _why_kept(self, m: Model, now: float) -> str:
        """Why ``m`` may not be unloaded for another model now ("" if it may)."""
        if m.pinned:
            return "pinned"
        if m.state is _S.LOADING:
            return "loading"
        if m.leases:
            return f"{m.leases} run{'s' if m.leases > 1 else ''} in flight"
        if now - m.last_used < m.spec.min_residency_s:
            return f"used {now - m.last_used:.3g}s ago, min_residency_s {m.spec.min_residency_s:g}"
        return ""

    def _start_pending(self) -> None:
        """Start the planned loads whose memory is free now, in plan order."""
        resident = self.resident_mib()
        pending = sorted(
            (m for m in self.models.values() if m.state is _S.LOADING and not m.started),
            key=lambda m: m.loading_since,
        )
        for m in pending:
            gone = all(self.models[b].state is not _S.UNLOADING for b in m.blockers)
            if gone and resident + m.spec.memory_mib <= self.budget_mib:
                m.started = True
                resident += m.spec.memory_mib
                self._actions.append(StartLoad(m.name))

    # --- leases -------------------------------------------------------------------

    def lease(self, name: str, now: float) -> int:
        """A run holds ``name`` (which is ``READY``); returns the life it holds."""
        m = self.models[name]
        if m.state is not _S.READY:
            raise InvariantError(f"lease of model {name} while {m.state.value}")
        m.leases += 1
        m.last_used = now
        return m.life

    def release(self, name: str, life: int, now: float) -> None:
        """A run that held ``name``'s ``life`` ended."""
        m = self.models[name]
        if life != m.life:
            return  # that life is over; its leases went with it
        if m.leases <= 0:
            raise InvariantError(f"release of model {name} that has no lease")
        m.leases -= 1
        m.last_used = now
        if m.state is _S.DRAINING and not m.leases:
            self._unload(m, m.detail or "drained")

    # --- the operator, the clock ---------------------------------------------------

    def unload(self, name: str, reason: str) -> bool:
        """Unload ``name`` once its runs end (``DRAINING`` meanwhile).

        Returns:
            False when it is not loaded (nothing to do).
        """
        m = self.models[name]
        if m.state is not _S.READY:
            return False
        if m.leases:
            self._enter(m, _S.DRAINING)
            m.detail = reason
        else:
            self._unload(m, reason)
        return True

    def pin(self, name: str, pinned: bool, now: float) -> Decision | None:
        """An operator pins (or unpins) ``name`` until the node restarts.

        A pinned model is never evicted nor unloaded when idle, and is
        wanted when it is not loaded (as at start).

        Returns:
            The want of a pinned model that is cold (or failed and past its
            ``retry_at``): its load planned, or why it cannot be; else None.
        """
        m = self.models[name]
        m.pinned = pinned
        if pinned and m.state in (_S.COLD, _S.FAILED) and now >= m.retry_at:
            return self.want(name, now)
        return None

    def cold_start(self, name: str) -> None:
        """A run found ``name`` not loaded and waits for its load (counted)."""
        self.models[name].cold_starts += 1

    def _idle_candidate(self, m: Model) -> bool:
        return m.state is _S.READY and not m.leases and not m.pinned and m.spec.idle_ttl_s > 0

    def tick(self, now: float) -> None:
        """Unload the models idle for their ``idle_ttl_s``; want the pinned
        ones not loaded (cold, or failed and past ``retry_at``)."""
        for m in self.models.values():
            if self._idle_candidate(m) and now - m.last_used >= m.spec.idle_ttl_s:
                self._unload(
                    m, f"idle for {now - m.last_used:.3g}s (idle_ttl_s {m.spec.idle_ttl_s:g})"
                )
        for m in self.models.values():
            if m.pinned and m.state in (_S.COLD, _S.FAILED) and now >= m.retry_at:
                self.want(m.name, now)  # a refusal: wanted again at the next tick

    def _unload(self, m: Model, reason: str) -> None:
        self._enter(m, _S.UNLOADING)
        m.detail = reason
        self._actions.append(StartUnload(m.name, reason))

    # --- what the driver saw -------------------------------------------------------

    def loaded(self, name: str, now: float) -> None:
        """``name``'s process serves."""
        m = self.models[name]
        self._enter(m, _S.READY)
        m.loads += 1
        m.life += 1
        m.leases = 0
        m.failures = 0
        m.detail = ""
        m.last_used = now
        m.last_load_s = max(0.0, now - m.loading_since)

    def load_failed(self, name: str, reason: str, now: float) -> float:
        """``name``'s load failed; returns the wait before it may load again."""
        return self._failed(self.models[name], reason, now)

    def exited(self, name: str, reason: str, now: float) -> float:
        """``name``'s process ended on its own while ready or draining (its
        runs' leases go with it); returns the wait before it may load again."""
        m = self.models[name]
        m.leases = 0
        m.life += 1  # the leases of the life that ended release nothing
        return self._failed(m, reason, now)

    def _failed(self, m: Model, reason: str, now: float) -> float:
        self._enter(m, _S.FAILED)
        m.started = False
        m.failures += 1
        m.load_failures += 1
        delay = float(min(self._retry_max_s, self._retry_min_s * 2.0 ** (m.failures - 1)))
        m.retry_at = now + delay
        m.detail = reason
        self._start_pending()
        return delay

    def unloaded(self, name: str) -> None:
        """``name``'s process is gone after ``StartUnload``: its memory is free."""
        m = self.models[name]
        self._enter(m, _S.COLD)
        m.leases = 0
        self._start_pending()

    def _enter(self, m: Model, state: ModelState) -> None:
        """The one place a model's state changes."""
        if state not in TRANSITIONS[m.state]:
            raise InvariantError(f"model {m.name}: {m.state.value} -> {state.value}")
        m.state = state
