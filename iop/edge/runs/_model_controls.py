"""The operator's side of a node's on-demand models: what it offers, the
admin's load, unload, pin and unpin, and the counts behind the metrics.

A node with ``[[models]]`` lists them in its hello and in each capabilities
update (``ModelOffer``: state, memory, counters; docs/protocol.md, "Models
on demand"). ``NodeModels`` keeps a connection's last offers, its memory
budget and whether it takes the operator's controls (``Hello.model_controls``:
an older node would close the link on the unknown message, so it is never
sent one); the admin views read it (``view``).

``NodeModels.control`` sends one ``ControlModel`` and waits for its
``ModelControlResult``: the node answers at once (a load is started, not
waited for), so the wait is bounded by the link's ``heartbeat_timeout_s``,
past which the link itself would be declared dead; a link that closes first
ends the wait with ``None`` at once (``close``).

``ModelStats`` (one per edge, in the ``NodeRegistry``) adds up, per model,
the increase of each node's counters between two offers: loads (and their
load times, from ``load_s``), failed loads, evictions; and the cold starts:
each ended run that waited at the edge for a node to load its model, once
(``cold_start``, from the run's timeline: the edge places runs only on a
model that is ready, so the wait is the edge's; the node's own count, of
runs placed on a model it unloaded meanwhile, is in the admin view). Model
names come only from nodes' offers, which list their configured
``[[models]]`` (never a name a client sent), so the metrics' label sets are
bounded by the nodes' configs. A node's counters restart at 0 when it does;
a link's first offers are its baseline (a reconnect counts nothing twice).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import trio

from iop.protocol import EdgeSession, ModelAction, ModelControlResult, ModelOffer

__all__ = ["LOAD_TIME_BUCKETS", "ModelStats", "ModelTotals", "NodeModels"]

# A model's load spans a small model from page cache (seconds) to a large one
# from network storage (many minutes).
LOAD_TIME_BUCKETS: Final = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# States whose process holds memory of the node's budget (iop.ondemand._table).
_HOLDING: Final = frozenset({"loading", "ready", "draining", "unloading"})

_request_ids = itertools.count(1)


@dataclass(eq=False)
class ModelTotals:
    """One model's counts over every node, since the edge started."""

    loads: int = 0
    load_failures: int = 0
    evictions: int = 0
    cold_starts: int = 0
    # Load times: a cumulative histogram's buckets (LOAD_TIME_BUCKETS, +Inf
    # last) and sum.
    load_buckets: list[int] = field(default_factory=lambda: [0] * (len(LOAD_TIME_BUCKETS) + 1))
    load_sum_s: float = 0.0

    def observe_load(self, seconds: float, times: int) -> None:
        seconds = max(0.0, seconds) if math.isfinite(seconds) else 0.0
        self.load_buckets[bisect.bisect_left(LOAD_TIME_BUCKETS, seconds)] += times
        self.load_sum_s += seconds * times


class ModelStats:
    """The edge's per-model counts (module docstring), read by ``/metrics``."""

    def __init__(self) -> None:
        self.totals: dict[str, ModelTotals] = {}

    def add(self, before: ModelOffer, after: ModelOffer) -> None:
        """Count what a node's counters of one model rose by between two offers.

        A counter that fell is a node that restarted behind a live link's
        back (it cannot: its link is new) or lies: nothing is counted.
        """
        t = self.totals.setdefault(after.model, ModelTotals())
        loads = after.loads - before.loads
        if loads > 0:
            t.loads += loads
            # Loads between two offers: each took about the last one's time.
            t.observe_load(after.load_s, loads)
        t.load_failures += max(0, after.load_failures - before.load_failures)
        t.evictions += max(0, after.evictions - before.evictions)

    def cold_start(self, model: str) -> None:
        """A run ended that had waited at the edge for a node to load ``model``
        (its timeline's ``model_load``: ``iop.edge.scheduler._ondemand``)."""
        self.totals.setdefault(model, ModelTotals()).cold_starts += 1

    def known(self, model: str) -> None:
        """``model`` is offered: its series exist (at 0) from now on."""
        self.totals.setdefault(model, ModelTotals())


@dataclass(eq=False)
class _Pending:
    done: trio.Event = field(default_factory=trio.Event)
    result: ModelControlResult | None = None


class NodeModels:
    """One connection's on-demand models, as its node last offered them.

    Args:
        offers: The hello's models.
        memory_mib: The node's ``node.memory_mib``.
        controls: Whether the node takes ``ControlModel``.
        now: When the offers came (trio clock).
    """

    def __init__(
        self,
        offers: list[ModelOffer] | None = None,
        memory_mib: int = 0,
        *,
        controls: bool = False,
        now: float = 0.0,
    ) -> None:
        self.offers = {o.model: o for o in offers or []}
        self.memory_mib = memory_mib
        self.controls = controls
        self.at = now
        self._pending: dict[str, _Pending] = {}

    def update(self, offers: list[ModelOffer], now: float, stats: ModelStats) -> None:
        """The node's new offers; ``stats`` counts what rose since the last."""
        for o in offers:
            before = self.offers.get(o.model)
            if before is None:
                stats.known(o.model)
            else:
                stats.add(before, o)
        self.offers = {o.model: o for o in offers}
        self.at = now

    def answer(self, result: ModelControlResult) -> None:
        """The node's answer to a ``control`` (the session checked it answers one)."""
        pending = self._pending.pop(result.request_id, None)
        if pending is not None:
            pending.result = result
            pending.done.set()

    def close(self) -> None:
        """The link closed: every ``control`` still waiting ends with None."""
        pending, self._pending = self._pending, {}
        for p in pending.values():
            p.done.set()

    async def control(
        self,
        session: EdgeSession,
        wake: Callable[[], None],
        model: str,
        action: ModelAction,
        *,
        by: str,
        timeout_s: float,
    ) -> ModelControlResult | None:
        """Send ``action`` on ``model`` to the node; its answer, or None if the
        link closed or ``timeout_s`` passed first.

        Raises:
            InvariantError: The node takes no controls (``controls``) or the
                link is not open.
        """
        request_id = f"admin-{next(_request_ids)}"
        pending = _Pending()
        session.control_model(request_id, model, action, by=by)
        self._pending[request_id] = pending
        wake()
        try:
            with trio.move_on_after(timeout_s):
                await pending.done.wait()
        finally:
            self._pending.pop(request_id, None)
        return pending.result

    def view(self, now: float) -> dict[str, object]:
        """What ``/admin/nodes`` shows of them: each model's state and memory,
        and the node's memory used of its budget."""
        since = max(0.0, now - self.at)
        models = []
        for o in self.offers.values():
            # Every field, defaults too (the offer's encoding omits them).
            entry = {f: getattr(o, f) for f in o.__struct_fields__}
            if o.state == "loading":
                entry["loading_for_s"] = round(o.loading_s + since, 1)
            if o.state == "failed":
                entry["retry_in_s"] = round(max(0.0, o.retry_in_s - since), 1)
            models.append(entry)
        used = sum(o.memory_mib for o in self.offers.values() if o.state in _HOLDING)
        return {
            "memory_mib": {"used": used, "budget": self.memory_mib},
            "controls": self.controls,
            "models": models,
        }
