"""Prometheus metrics of the edge (``GET /metrics``).

Run metrics are recorded once per run when it ends (``EdgeMetrics.record``,
called from the run supervisor's ``on_finished``), so the hot path (chunk in,
chunk out) pays nothing for them. The run counter is the edge's one count of
outcomes: the admin view reads it too (``EdgeMetrics.outcomes``). Gauges
(queue depth, runs in flight, nodes, per-instance load, operator drains) and the scheduler's
count of queue exits are read at scrape time by a collector from the node
registry, the scheduler and the run supervisor it is given, so this module
knows nothing of ``EdgeCore``. Each
edge has its own registry: several edges in one process (tests) do not share
counters.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Final

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from iop.edge.runs._model_controls import LOAD_TIME_BUCKETS
from iop.events import Cancelled, Complete, Error, Usage

if TYPE_CHECKING:
    from iop._secrets import SecretMasker
    from iop.edge.runs import NodeRegistry
    from iop.edge.scheduler import Scheduler
    from iop.runtime import Run, RunSupervisor

__all__ = ["CONTENT_TYPE", "EdgeMetrics"]

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

# Time to first token spans a fast GPU (tens of ms) to a long prefill on a
# busy one (minutes); durations go further.
_TTFT_BUCKETS: Final = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_DURATION_BUCKETS: Final = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _LiveCollector(Collector):
    """Gauges read from the edge's registry, scheduler and runs when Prometheus scrapes."""

    def __init__(
        self, registry: NodeRegistry, scheduler: Scheduler, supervisor: RunSupervisor
    ) -> None:
        self._registry = registry
        self._scheduler = scheduler
        self._supervisor = supervisor

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "iop_nodes_connected", "Nodes with a live link.", value=len(self._registry.nodes)
        )
        yield GaugeMetricFamily(
            "iop_runs_in_flight", "Runs started and not ended.", value=len(self._supervisor.runs)
        )
        yield GaugeMetricFamily(
            "iop_queue_depth", "Runs waiting for capacity.", value=self._scheduler.queued
        )
        exits = CounterMetricFamily(
            "iop_queue_exits",
            "Runs that left the queue, by how (placed, cancelled while waiting, timed_out).",
            labels=["how"],
        )
        for how, n in self._scheduler.exits.items():
            exits.add_metric([how.value], n)
        yield exits
        refused = CounterMetricFamily(
            "iop_queue_refused",
            "Runs refused before they queued, by why (queue_full, queue_delay, deadline, shed).",
            labels=["why"],
        )
        for why, n in self._scheduler.refused.items():
            refused.add_metric([why], n)
        yield refused
        yield CounterMetricFamily(
            "iop_preemptions",
            "Sheddable runs that gave their slot to a run of a higher objective priority "
            "before any output, and were placed again.",
            value=self._scheduler.preempted,
        )
        home_waits = CounterMetricFamily(
            "iop_prefix_home_waits",
            "Runs held for the instances that hold their prompt's prefix "
            "(scheduler.prefix_wait_s), by how the hold ended (home, expired, left).",
            labels=["how"],
        )
        for ended, n in self._scheduler.home_waits.items():
            home_waits.add_metric([ended], n)
        yield home_waits
        yield CounterMetricFamily(
            "iop_priority_overflows",
            "Runs placed on an overflow seat beyond an instance's slots, for its engine "
            "to preempt a lower-priority run (scheduler.priority_overflow_slots).",
            value=self._scheduler.overflowed,
        )
        # Sessions as counts, never a label per session id (docs/operations.md,
        # "Sessions and objectives").
        yield CounterMetricFamily(
            "iop_queue_sessions_seen",
            "Sessions the queue began to track (a session key queued for the first time "
            "since it was last forgotten).",
            value=self._scheduler.sessions_seen,
        )
        yield CounterMetricFamily(
            "iop_queue_sessions_overflowed",
            "Queued runs whose session found no room under scheduler.max_sessions_per_tenant "
            "(they share the turn of their tenant's runs without a session).",
            value=self._scheduler.sessions_overflowed,
        )
        yield GaugeMetricFamily(
            "iop_queue_sessions",
            "Sessions with runs queued now.",
            value=self._scheduler.sessions_queued,
        )
        in_flight = GaugeMetricFamily(
            "iop_instance_in_flight",
            "Runs the edge has placed on each node instance.",
            labels=["node", "instance"],
        )
        slots = GaugeMetricFamily(
            "iop_instance_slots",
            "Concurrent runs each node instance accepts (max_concurrency).",
            labels=["node", "instance"],
        )
        up = GaugeMetricFamily(
            "iop_instance_available",
            "1 when the instance's provider status is not unavailable.",
            labels=["node", "instance"],
        )
        for conn, inst in self._registry.instances():
            labels = [conn.node_id, inst.caps.instance]
            in_flight.add_metric(labels, inst.in_flight)
            slots.add_metric(labels, inst.caps.max_concurrency)
            up.add_metric(labels, 1 if inst.usable else 0)
        yield in_flight
        yield slots
        yield up
        yield GaugeMetricFamily(
            "iop_load_stale_instances",
            "Instances whose node's load report, or the engine figures in it, is older "
            "than scheduler.load_stale_s: placed on the edge's own counts.",
            value=self._scheduler.stale_instances(),
        )
        drained = GaugeMetricFamily(
            "iop_node_drained",
            "1 while an operator has drained the node (POST /admin/nodes/{id}/drain), "
            "connected or not; 0 for a connected node that is not drained.",
            labels=["node"],
        )
        for node_id in sorted(self._registry.nodes.keys() | self._registry.drained.keys()):
            drained.add_metric([node_id], 1 if node_id in self._registry.drained else 0)
        yield drained
        yield from self._models()

    def _models(self) -> Iterator[Metric]:
        """On-demand models (iop.edge.runs._model_controls): label values are
        only the model names nodes offer, their configured ``[[models]]``."""
        counts = {
            "loads": "Loads of the on-demand model that succeeded, over all nodes.",
            "load_failures": "Its loads that failed, and loaded processes that exited.",
            "evictions": "Its unloads to make room for another model.",
            "cold_starts": "Ended runs that waited at the edge for a node to load the model.",
        }
        totals = sorted(self._registry.model_stats.totals.items())
        for what, doc in counts.items():
            family = CounterMetricFamily(f"iop_model_{what}", doc, labels=["model"])
            for model, t in totals:
                family.add_metric([model], getattr(t, what))
            yield family
        load_time = HistogramMetricFamily(
            "iop_model_load_seconds",
            "How long the on-demand model's good loads took (from the plan to ready).",
            labels=["model"],
        )
        for model, t in totals:
            cumulative, buckets = 0, []
            for bound, n in zip((*LOAD_TIME_BUCKETS, math.inf), t.load_buckets, strict=True):
                cumulative += n
                buckets.append(("+Inf" if bound == math.inf else f"{bound:g}", cumulative))
            load_time.add_metric([model], buckets, t.load_sum_s)
        yield load_time
        states = GaugeMetricFamily(
            "iop_model_nodes",
            "Connected nodes offering the on-demand model, by its state there "
            "(cold, loading, ready, draining, unloading, failed).",
            labels=["model", "state"],
        )
        by_state: dict[tuple[str, str], int] = {}
        for conn in self._registry.nodes.values():
            for offer in conn.model_ops.offers.values():
                key = (offer.model, offer.state)
                by_state[key] = by_state.get(key, 0) + 1
        for (model, state), n in sorted(by_state.items()):
            states.add_metric([model, state], n)
        yield states


class EdgeMetrics:
    """The edge's metrics registry and its run counters.

    Args:
        nodes: The edge's nodes and instances (gauges).
        scheduler: Its queue (``iop_queue_depth``).
        supervisor: Its runs in flight.
        masker: The edge's secrets, masked in what ``render`` returns.
    """

    def __init__(
        self,
        nodes: NodeRegistry,
        scheduler: Scheduler,
        supervisor: RunSupervisor,
        masker: SecretMasker,
    ) -> None:
        self.masker = masker
        self._nodes = nodes
        self.registry = CollectorRegistry(auto_describe=True)
        self.runs = Counter(
            "iop_runs",
            "Runs ended, by model and outcome (complete, error or cancelled) and reason "
            "(the error code or the cancel reason).",
            ["model", "outcome", "reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "iop_run_ttft_seconds",
            "Time from a run's start (queue included) to its first output, as the edge saw it.",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.duration = Histogram(
            "iop_run_duration_seconds",
            "Time from a run's start to its end.",
            ["model", "outcome"],
            buckets=_DURATION_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "iop_tokens",
            "Tokens of completed runs, by model and kind (input, output, cached_input, reasoning).",
            ["model", "kind"],
            registry=self.registry,
        )
        # Tenants: names from the edge's config only (iop.config.TenantSettings),
        # so the label sets are bounded by the config.
        self.tenant_runs = Counter(
            "iop_tenant_runs",
            "Runs ended, by tenant and outcome (complete, error or cancelled).",
            ["tenant", "outcome"],
            registry=self.registry,
        )
        self.tenant_tokens = Counter(
            "iop_tenant_tokens",
            "Tokens charged to tenants by their ended runs (what their limits count), "
            "by tenant and kind (input, output).",
            ["tenant", "kind"],
            registry=self.registry,
        )
        self.tenant_refused = Counter(
            "iop_tenant_rate_limited",
            "Requests refused with 429 by their tenant's limits, by tenant and limit "
            "(requests, tokens, concurrency).",
            ["tenant", "limit"],
            registry=self.registry,
        )
        self.registry.register(_LiveCollector(nodes, scheduler, supervisor))

    def record(self, run: Run, now: float, charged: Usage | None) -> None:
        """Count one ended run (called once per run, off the hot path), and
        for its tenant what it was ``charged`` (``iop.edge.tenancy._charges.charged_usage``)."""
        model = run.spec.model
        o = run.outcome
        if isinstance(o, Complete):
            outcome, reason = "complete", o.finish_reason.value
            u = o.usage
            for kind, n in (
                ("input", u.input_tokens),
                ("output", u.output_tokens),
                ("cached_input", u.cached_input_tokens),
                ("reasoning", u.reasoning_tokens),
            ):
                if n:
                    self.tokens.labels(model, kind).inc(n)
        elif isinstance(o, Error):
            outcome, reason = "error", o.code
        elif isinstance(o, Cancelled):
            outcome, reason = "cancelled", o.reason.value
        else:
            outcome, reason = "unknown", ""
        self.runs.labels(model, outcome, reason).inc()
        tenant = run.timeline.tenant
        if tenant:
            self.tenant_runs.labels(tenant, outcome).inc()
            if charged is not None:
                if charged.input_tokens:
                    self.tenant_tokens.labels(tenant, "input").inc(charged.input_tokens)
                if charged.output_tokens:
                    self.tenant_tokens.labels(tenant, "output").inc(charged.output_tokens)
        load = run.timeline.model_load
        if load is not None:
            # Once per run, under the node's model name (a configured [[models]]).
            self._nodes.model_stats.cold_start(load.model)
        self.duration.labels(model, outcome).observe(max(0.0, now - run.started_at))
        if run.first_output_at is not None:
            self.ttft.labels(model).observe(max(0.0, run.first_output_at - run.started_at))

    def outcomes(self) -> dict[str, int]:
        """Ended runs by outcome, over all models, for the admin view.

        Keys: ``complete``, ``error:<code>``, ``cancelled:<reason>``, in the
        order each first happened (the counter keeps its label sets in that
        order).
        """
        counts: dict[str, int] = {}
        for metric in self.runs.collect():
            for sample in metric.samples:
                if not sample.name.endswith("_total"):
                    continue  # the counter's _created timestamps
                outcome, reason = sample.labels["outcome"], sample.labels["reason"]
                key = outcome if outcome == "complete" or not reason else f"{outcome}:{reason}"
                counts[key] = counts.get(key, 0) + int(sample.value)
        return counts

    def render(self) -> bytes:
        """The registry in Prometheus' text format, the edge's secrets masked.

        Label values (node ids, instance names, models) come from nodes,
        which may echo a secret; a client chooses none of them (``model`` is
        one a node serves, ``tenant`` a configured name: docs/operations.md,
        "Tenants and limits"). Who may scrape: ``iop.edge.routes._admin_auth``.
        """
        text = generate_latest(self.registry)
        if not self.masker:
            return text
        return self.masker.mask(text.decode()).encode()
