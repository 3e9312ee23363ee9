"""The admin views' data: what ``/admin/nodes``, ``/admin/runs`` and the drain
answers show of the edge, built from its parts and masked.

Each view is a plain tree (the HTTP layer renders it as JSON) masked with
the edge's secrets: nodes report names, providers and models, strings the
edge does not control, and runs' timelines hold what clients sent. The
routes reach them through ``EdgeCore``'s methods of the same names.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Protocol

import msgspec
import trio

if TYPE_CHECKING:
    from iop._secrets import SecretMasker
    from iop.config import EdgeConfig
    from iop.edge._metrics import EdgeMetrics
    from iop.edge._timeline_export import TimelineExport
    from iop.edge.batches import Batches
    from iop.edge.runs import InstanceState, NodeRegistry
    from iop.edge.scheduler import Scheduler
    from iop.edge.tenancy._cluster import SharedLimits
    from iop.edge.tenancy._tenants import Tenants
    from iop.runtime import RunSupervisor
    from iop.timeline import Timeline, TimelineRing

__all__ = ["drain_view", "live_tasks", "routing_view", "run_view", "runs_view", "snapshot"]


class EdgeState(Protocol):
    """What the views read of the edge (``EdgeCore``)."""

    @property
    def config(self) -> EdgeConfig: ...
    @property
    def registry(self) -> NodeRegistry: ...
    @property
    def scheduler(self) -> Scheduler: ...
    @property
    def supervisor(self) -> RunSupervisor: ...
    @property
    def masker(self) -> SecretMasker: ...
    @property
    def metrics(self) -> EdgeMetrics: ...
    @property
    def tenants(self) -> Tenants: ...
    @property
    def cluster(self) -> SharedLimits | None: ...
    @property
    def timelines(self) -> TimelineRing: ...
    @property
    def export(self) -> TimelineExport | None: ...
    @property
    def draining(self) -> bool: ...
    @property
    def runs_started(self) -> int: ...
    @property
    def batches(self) -> Batches: ...

    def timeline(self, run_id: str) -> Timeline | None: ...


def live_tasks() -> int:
    """Trio tasks alive in this process: the root task and every task under it.

    A walk of the task tree (``trio.lowlevel.Task.child_nurseries``), for
    ``/admin/nodes``: a leak check (tests/e2e/test_chaos.py) compares it
    before and after a load, and an operator sees tasks that outlive their
    runs. Cost: one visit per task, only when the admin view is asked for.
    """
    root = trio.lowlevel.current_root_task()
    todo = [] if root is None else [root]
    count = 0
    while todo:
        task = todo.pop()
        count += 1
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return count


def drain_view(edge: EdgeState, node_id: str) -> dict[str, object]:
    """One node id's drain state (what drain and undrain answer)."""
    drained = edge.registry.drained.get(node_id)
    conn = edge.registry.nodes.get(node_id)
    return edge.masker.mask_tree(
        {
            "id": node_id,
            "drained": None if drained is None else msgspec.to_builtins(drained),
            "connected": conn is not None,
            "runs": 0 if conn is None else len(conn.runs),
        }
    )


def routing_view(edge: EdgeState) -> dict[str, object]:
    """The scheduler's policy, its weights and the prefix index's size."""
    s = edge.config.scheduler
    prefixes = edge.scheduler.prefixes
    placement = edge.scheduler.placement
    return {
        "placement": s.placement,
        "affinity": s.affinity,
        "failover": s.failover,
        "prefix_weight": s.prefix_weight,
        "load_weight": s.load_weight,
        "affinity_weight": s.affinity_weight,
        "balance_load_threshold": s.balance_load_threshold,
        "balance_rel_threshold": s.balance_rel_threshold,
        "max_queue": s.max_queue,
        "max_queue_delay_s": s.max_queue_delay_s,
        "queue_timeout_s": s.queue_timeout_s,
        "prefix_index": {
            "entries": len(prefixes),
            "max_entries": prefixes.max_entries,
            "evicted": prefixes.evicted,
            "bytes": prefixes.size_bytes,
            # Prompts' homes, their replicas now, and replicas made and
            # dropped so far (docs/operations.md, "What the caches hold").
            "homes": prefixes.home_count,
            "replicas": prefixes.replica_count,
            "replicas_made": placement.replicas_made,
            "replicas_dropped": placement.replicas_dropped,
            # Runs held for their prefix's homes, by how the hold ended
            # (docs/operations.md, "What the caches hold").
            "home_waits": dict(edge.scheduler.home_waits),
        },
        # Per instance: the blocks the index claims its cache holds, and the
        # bound its reported cache size sets (None: none reported).
        "prefix_held": {
            f"{node}/{inst}": {"blocks": blocks, "bound": bound}
            for (node, inst), blocks, bound in prefixes.held()
        },
    }


def snapshot(edge: EdgeState) -> dict[str, object]:
    """The admin view: nodes, instances, load, drains, routing, runs."""
    now = time.time()
    drained = edge.registry.drained

    def drained_view(node_id: str) -> object:
        mark = drained.get(node_id)
        return None if mark is None else msgspec.to_builtins(mark)

    nodes = []
    for conn in edge.registry.nodes.values():
        nodes.append(
            {
                "id": conn.node_id,
                "software": conn.software,
                # host:port of its link, or "in-process" (iop up's own node).
                "peer": conn.peer,
                "connected_for_s": round(now - conn.connected_at, 1),
                "draining": conn.draining,
                "drained": drained_view(conn.node_id),
                "runs": sorted(conn.runs),
                "instances": [
                    {
                        **msgspec.to_builtins(i.caps),
                        "in_flight": i.in_flight,
                        "reported": _reported_view(edge.scheduler, i),
                    }
                    for i in conn.instances.values()
                ],
                # Its on-demand models (docs/operations.md, "Operator controls").
                **conn.model_ops.view(trio.current_time()),
            }
        )
    runs = [
        {
            "run_id": r.run_id,
            "model": r.spec.model,
            "state": r.state.value,
            "age_s": round(trio.current_time() - r.started_at, 3),
        }
        for r in edge.supervisor.runs.values()
    ]
    tenants = edge.tenants.snapshot(trio.current_time())
    if edge.cluster is not None:
        edge.cluster.tenant_limits(tenants)
    # Nodes report names, providers and models: strings the edge does not control.
    return edge.masker.mask_tree(
        {
            "draining": edge.draining,
            "nodes": nodes,
            "queued": edge.scheduler.queued,
            "queue": _queue_view(edge.scheduler),
            # Every drained id, connected or not (it stays drained when it comes back).
            "drained": {node_id: drained_view(node_id) for node_id in sorted(drained)},
            "routing": routing_view(edge),
            "runs": runs,
            "runs_started": edge.runs_started,
            "tasks": live_tasks(),
            "outcomes": edge.metrics.outcomes(),
            "tenants": tenants,
            "cluster": None if edge.cluster is None else edge.cluster.snapshot(),
            # The batches this process runs, with their progress (every tenant's).
            "batches": edge.batches.live_view(),
        }
    )


def _reported_view(scheduler: Scheduler, inst: InstanceState) -> dict[str, object] | None:
    """What the node last reported of ``inst``'s load, how old, and
    whether placement uses it (None: never reported)."""
    rep = inst.reported
    if rep is None:
        return None
    now = trio.current_time()
    engine = None
    if rep.engine_at > -math.inf:
        engine = {
            "running": rep.running,
            "waiting": rep.waiting,
            "kv_usage": rep.kv_usage,
            "age_s": round(now - rep.engine_at, 3),
        }
    return {
        "in_flight": rep.in_flight,
        "queued": rep.queued,
        "age_s": round(now - rep.at, 3),
        "engine": engine,
        "stale": scheduler.is_stale(inst, now),
        "occupancy": scheduler.occupancy(inst, now),
    }


def _queue_view(scheduler: Scheduler) -> dict[str, object]:
    """How runs left the queue, and the last one's time on the host's
    monotonic clock (``Scheduler.last_exit``); the runs refused before they
    queued, by why; and the sessions the queue tracks (counts, never ids)."""
    last = scheduler.last_exit
    return {
        "exits": {how.value: n for how, n in scheduler.exits.items()},
        "last_exit": None if last is None else msgspec.to_builtins(last),
        "refused": dict(scheduler.refused),
        "preempted": scheduler.preempted,
        "priority_overflows": scheduler.overflowed,
        "sessions": {
            "seen": scheduler.sessions_seen,
            "queued": scheduler.sessions_queued,
            "overflowed": scheduler.sessions_overflowed,
        },
    }


def runs_view(edge: EdgeState, limit: int) -> dict[str, object]:
    """``GET /admin/runs``: live runs and the ``limit`` newest finished ones."""
    recent: list[dict[str, object]] = []
    for timeline in edge.timelines.newest_first():
        if len(recent) >= limit:
            break
        recent.append(timeline.summary())
    export = None
    if edge.export is not None:
        export = {
            "path": str(edge.export.path),
            "written": edge.export.written,
            "dropped": edge.export.dropped,
            "rotations": edge.export.rotations,
        }
    return edge.masker.mask_tree(
        {
            "live": [r.timeline.summary() for r in edge.supervisor.runs.values()],
            "recent": recent,
            "kept": len(edge.timelines),
            "capacity": edge.timelines.capacity,
            "export": export,
        }
    )


def run_view(edge: EdgeState, run_id: str) -> dict[str, object] | None:
    """``GET /admin/runs/{id}``: one run's whole timeline (None: not kept)."""
    timeline = edge.timeline(run_id)
    return None if timeline is None else edge.masker.mask_tree(timeline.to_json())
