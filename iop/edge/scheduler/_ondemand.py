"""Models on demand, the edge's half: which node loads a model no node serves now.

Theory of operation
-------------------
A node offers its on-demand models (``[[models]]``) in its hello and in every
capabilities update (``ModelOffer``: state, memory, last load time), each as
an instance named after its model; the edge places runs on such an instance
only while its model is ``ready`` (``InstanceState.usable``). A run for a
model that no node serves now but some node offers waits in the scheduler's
queue (``Scheduler.acquire``) while one node loads it:

1. ``choose_load`` picks the node: one whose model is already loading
   (the run joins that load), else one with free memory for it, else one
   that can free enough by evicting idle models (ready, no run by the
   node's offer nor in flight from this edge, not pinned; the node picks
   which, least recently used first), by the offer's
   ``memory_mib`` against the node's budget (``Hello.memory_mib``) and what
   its loaded models hold. A node the edge backs off from for this model, or
   without room even after evictions, is no candidate.
2. ``ModelLoads.ask`` sends the node one ``LoadModel`` per (node, model)
   at a time: however many runs wait, on one edge or several (the node's
   table plans one load for all its edges' asks, ``iop.ondemand``).
3. The answer (``ModelLoads.answered``): ready, and the node's capabilities
   update (which comes first on the link) has made the instance usable, so
   the scheduler's dispatch places the waiters. Not ready: the edge backs
   off from that node for that model (``scheduler.model_load_backoff_s``)
   and the waiters try another node that offers it; with none left, a
   failed load ends them 503 ``model_load_failed`` naming the model, the
   node and the reason, and a refused one (the node would have to evict a
   model inside its ``min_residency_s``, or one a run holds) lets them wait
   and ask again when the backoff ends, so two edges never make a node swap
   models back and forth.
4. A refusal that lasts until an operator unpins a model: the node's answer
   names the pinned models in the way (``ModelLoadResult.pinned``), or the
   edge sees by the node's offers that its pinned models alone leave no room
   (``pinned_in_way``; it then asks nothing). When every node that offers
   the model failed or refuses so, its waiters (and new runs) end at once,
   503 ``model_load_refused`` naming the pinned models and the nodes; while
   one node may still load it, they wait. An older node names none: its
   refusals read as ones that pass.

A waiter waits at most ``scheduler.model_load_wait_s`` (or its TTFT deadline
if shorter), then ends 503 ``model_load_timeout`` with the last refusal.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from iop.errors import ErrorCode
from iop.protocol import ModelLoadResult, ModelOffer

if TYPE_CHECKING:
    from iop.edge.runs._nodes import InstanceState, NodeConnection

__all__ = [
    "FAILED_CODES",
    "Load",
    "LoadChoice",
    "ModelLoads",
    "choose_load",
    "load_rank",
    "pinned_in_way",
]

# States whose process holds (or is about to hold) its memory on the node
# (``iop.ondemand._table``, ``_HOLDING``).
_HOLDING: Final = frozenset({"loading", "ready", "draining", "unloading"})

# The codes of a load's answer that mean "it failed" (its waiters end with
# it), not "not now" (refused, draining: they wait, or go elsewhere).
FAILED_CODES: Final = frozenset({ErrorCode.MODEL_LOAD_FAILED, ErrorCode.MODEL_LOAD_TIMEOUT})

# The ranks of a node for a load, best first (``load_rank``).
RANK_LOADING: Final = 0  # its load is on its way: join it
RANK_FREE: Final = 1  # room for it without unloading anything
RANK_EVICTS: Final = 2  # room once idle models are evicted


@dataclass(frozen=True)
class LoadChoice:
    """Where a model is loaded, and why there."""

    conn: NodeConnection
    inst: InstanceState
    why: str


def load_rank(conn: NodeConnection, offer: ModelOffer) -> tuple[int, str] | None:
    """How good ``conn`` is for loading ``offer``'s model (lower is better)
    and why, or None when it has no room even after evicting idle models.

    A node that offered no budget (``memory_mib`` 0) has room for anything.
    """
    if offer.state == "loading":
        return RANK_LOADING, "its load is on its way"
    budget = conn.memory_mib
    if budget <= 0:
        return RANK_FREE, "no memory budget"
    held = 0
    idle = 0
    for inst, other in conn.offers():
        if other.model == offer.model or other.state not in _HOLDING:
            continue
        held += other.memory_mib
        # Idle by the node's offer and by this edge: a run this edge placed
        # there may not have reached the node yet, whose offer then still
        # says idle, and the load would evict the model it is on its way to.
        if other.state == "ready" and not (other.runs or inst.in_flight or other.pinned):
            idle += other.memory_mib
    free = budget - held
    need = offer.memory_mib
    if need <= free:
        return RANK_FREE, f"{free} MiB free of {budget}, needs {need}"
    if need <= free + idle:
        return RANK_EVICTS, f"{free} MiB free of {budget}, needs {need}: evicts idle models"
    return None


def pinned_in_way(conn: NodeConnection, offer: ModelOffer) -> tuple[str, ...]:
    """The pinned models of ``conn`` that alone leave no room for ``offer``'s
    model (its budget less their memory is less than the model's), by the
    node's offers: empty when it may load it once runs end and idle models
    go, or is loading it, or offered no budget."""
    budget = conn.memory_mib
    if offer.state == "loading" or budget <= 0:
        return ()
    pins = [
        other
        for _, other in conn.offers()
        if other.model != offer.model and other.pinned and other.state in _HOLDING
    ]
    if offer.memory_mib <= budget - sum(o.memory_mib for o in pins):
        return ()
    return tuple(o.model for o in pins)


def choose_load(
    candidates: Iterable[tuple[NodeConnection, InstanceState]],
) -> tuple[LoadChoice | None, list[str]]:
    """The best node to load a model on (``load_rank``, then the fewest runs
    in flight on it, then its id), and why each other candidate is none."""
    best: tuple[tuple[int, int, str], LoadChoice] | None = None
    why_not: list[str] = []
    for conn, inst in candidates:
        offer = inst.offer
        assert offer is not None  # candidates are offered models
        ranked = load_rank(conn, offer)
        if ranked is None:
            why_not.append(
                f"node {conn.node_id} has no room for {offer.model} ({offer.memory_mib} MiB "
                f"of {conn.memory_mib}, held by runs or pinned models)"
            )
            continue
        rank, why = ranked
        runs = sum(i.in_flight for i in conn.instances.values())
        order = (rank, runs, conn.node_id)
        if best is None or order < best[0]:
            best = (order, LoadChoice(conn, inst, why))
    return (None if best is None else best[1]), why_not


@dataclass(eq=False)
class _Backoff:
    until: float
    code: str
    message: str
    # A refusal's pinned models, when it lasts until one is unpinned.
    pinned: tuple[str, ...] = ()


@dataclass(eq=False)
class Load:
    """One ``LoadModel`` the edge sent and awaits the answer of."""

    node_id: str
    model: str
    request_id: str
    started: float
    # The link it was asked on: a node that reconnects is asked again on its new one.
    link: NodeConnection | None = None
    # The answer, once it came: ``ok`` or why not.
    result: ModelLoadResult | None = None


class ModelLoads:
    """The loads the edge asked nodes for, and the nodes it backs off from."""

    def __init__(self) -> None:
        self._inflight: dict[tuple[str, str], Load] = {}
        self._backoff: dict[tuple[str, str], _Backoff] = {}
        self._ids = itertools.count(1)
        # Counts for the edge's views: LoadModel messages sent, answers not ready.
        self.asked = 0
        self.failed = 0

    def backing_off(self, node_id: str, model: str, now: float) -> _Backoff | None:
        """The failure the edge backs off from ``model`` on ``node_id`` for, if any."""
        b = self._backoff.get((node_id, model))
        if b is None:
            return None
        if now >= b.until:
            del self._backoff[node_id, model]
            return None
        return b

    def next_retry(self, now: float) -> float:
        """When the earliest backoff ends (inf: none)."""
        return min((b.until for b in self._backoff.values() if b.until > now), default=math.inf)

    def ask(self, conn: NodeConnection, model: str, now: float) -> Load:
        """The load of ``model`` on ``conn``: the one on its way, or a new ``LoadModel``.

        Raises:
            InvariantError: The link is not open.
        """
        key = (conn.node_id, model)
        load = self._inflight.get(key)
        if load is None:
            request_id = f"load-{next(self._ids)}"
            conn.load_model(request_id, model)
            load = self._inflight[key] = Load(conn.node_id, model, request_id, now, conn)
            self.asked += 1
        return load

    def answered(self, node_id: str, result: ModelLoadResult, now: float, backoff_s: float) -> Load:
        """The node's answer to a load: the load ends; a failure starts a backoff."""
        key = (node_id, result.model)
        load = self._inflight.get(key)
        if load is not None and load.request_id == result.request_id:
            del self._inflight[key]
        else:  # an answer to an ask the edge forgot (its node's link was replaced)
            load = Load(node_id, result.model, result.request_id, now)
        load.result = result
        # Forget the backoffs that are over (at most one per node and model).
        for k in [k for k, b in self._backoff.items() if b.until <= now]:
            del self._backoff[k]
        if result.ok:
            self._backoff.pop(key, None)
        else:
            self.failed += 1
            pinned = result.pinned if result.code == ErrorCode.MODEL_LOAD_REFUSED else ()
            self._backoff[key] = _Backoff(now + backoff_s, result.code, result.message, pinned)
        return load

    def forget_link(self, conn: NodeConnection) -> list[Load]:
        """``conn``'s link is gone: the loads asked on it will not be answered."""
        gone = [k for k, load in self._inflight.items() if load.link is conn]
        return [self._inflight.pop(k) for k in gone]
