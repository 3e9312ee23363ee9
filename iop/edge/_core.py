"""The edge's core: the owner of one edge process's pieces, and what the routes call.

``EdgeCore`` builds and holds the edge's parts and wires them together; each
job lives in the room named for it:

* where a run is placed (queue, leases, affinity, admission to the queue):
  ``iop.edge.scheduler``;
* the edge's half of a run (the failover executor, each attempt, the node
  connections and registry, the link handshake, drains):
  ``iop.edge.runs``;
* tenants, their admission and settlement, the limits edges share, the
  usage ledger: ``iop.edge.tenancy``;
* the admin views' data: ``iop.edge._views``; metrics:
  ``iop.edge._metrics``; timelines' export: ``iop.edge._timeline_export``.

A run starts here (``start_run``): refused up front when no instance may
serve it or the queue is full, then started on the run supervisor with a
``RemoteExecutor``. When it ends (``record_outcome``) it is counted, its
tenant's ticket settled, its ledger line written and its timeline kept.
A reload (``apply_config``) swaps the config in one synchronous step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Final

import msgspec
import trio

from iop._reload import Reloading
from iop._secrets import SecretMasker, edge_secrets
from iop.api import OBJECTIVE_HEADERS
from iop.config import EdgeConfig, LinkSettings, Objective
from iop.edge import _views
from iop.edge._metrics import EdgeMetrics
from iop.edge._timeline_export import TimelineExport
from iop.edge.batches import Batches
from iop.edge.runs import (
    KeepaliveClock,
    NodeLinks,
    NodeRegistry,
    RemoteExecutor,
    delivery_policy,
    drain_node,
    drain_runs,
    undrain_node,
)
from iop.edge.scheduler import EVEN_SHARE, QueueShare, Scheduler
from iop.edge.scheduler._admission import refuse_unservable
from iop.edge.server._tls import EdgeTLS
from iop.edge.tenancy._admission import TenantAdmission, usage_record
from iop.edge.tenancy._charges import charged_usage, estimate_prompt_tokens
from iop.edge.tenancy._cluster import SharedLimits, default_edge_id
from iop.edge.tenancy._ledger import Ledger
from iop.edge.tenancy._tenants import Tenant, Tenants, Ticket
from iop.errors import ConfigError, ErrorCode, RequestError
from iop.events import CancelReason, Usage
from iop.ledger import Prices
from iop.protocol import FrameChannel
from iop.runtime import LinkClock, LocalFrameChannel, Run, RunSupervisor, open_run_supervisor
from iop.spec import ExecutionSpec, OperationRequest, Routing
from iop.timeline import Timeline, TimelineRing
from iop.tracing import RunTrace, Tracing

__all__ = ["EdgeCore", "open_edge_core"]

# How long the timeline export may take to write its last lines at exit.
EXPORT_FLUSH_S: Final = 5.0


@dataclass(frozen=True)
class ModelEntry:
    id: str
    nodes: tuple[str, ...]


class EdgeCore:
    """Nodes, scheduler and runs of one edge process."""

    def __init__(
        self,
        config: EdgeConfig,
        supervisor: RunSupervisor,
        *,
        export: TimelineExport | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.config = config
        self.registry = NodeRegistry()
        self.scheduler = Scheduler(self.registry, config.scheduler)
        self.supervisor = supervisor
        self.draining = False
        self.started_at = time.time()
        self.runs_started = 0
        # Client API keys and node tokens: masked in whatever the edge relays
        # from nodes to clients, /admin, /admin/nodes and /metrics.
        self.masker = SecretMasker(value for value, _ in edge_secrets(config))
        self.metrics = EdgeMetrics(self.registry, self.scheduler, supervisor, self.masker)
        # Client keys, their tenants and limits.
        self.tenants = Tenants(config.tenants, config.server.api_keys, config.tenancy)
        # The ledger every finished run is written to ([usage] ledger_path;
        # open_edge_core runs it).
        self.ledger: Ledger | None = None
        if config.usage.ledger_path:
            self.ledger = Ledger(config.usage, self.metrics.registry)
        # With [cluster] valkey_url: the limits every edge shares (open_edge_core runs it).
        self.cluster: SharedLimits | None = None
        if config.cluster.valkey_url:
            self.cluster = SharedLimits(
                config.cluster,
                self.tenants,
                config.tenants,
                config.tenancy,
                config.cluster.edge_id or default_edge_id(config.server.port),
                self.metrics.registry,
            )
        # Requests admitted by their tenants, what runs cost ([prices]), and
        # the admitted runs' tickets, settled when each run ends (``record_outcome``).
        self.admission = TenantAdmission(
            self.tenants, self.cluster, Prices(config.prices), config.tenancy, config.batches
        )
        # OpenAI's Batch API on this edge's nodes ([batches]; open_edge_core
        # runs it, the routes bind how a line runs).
        self.batches = Batches(
            config.batches,
            config.batches.store_path(config.usage.ledger_path),
            self.metrics.registry,
            lambda: self.config.batch_objective(),
        )
        # The timelines of recent finished runs, and their export (open_edge_core runs it).
        self.timelines = TimelineRing(config.timelines.recent)
        self.export = export
        self.tracing = tracing
        self._traces: dict[str, RunTrace] = {}
        # One timer for every link's liveness and pings (``open_edge_core`` runs it).
        self.link_clock = LinkClock(config.link.heartbeat_timeout_s)
        # One timer for every open stream's keep-alives (``open_edge_core`` runs it).
        self.keepalives = KeepaliveClock()
        # How node events reach runs: per-run credit, or none (research);
        # ``link.run_window`` needs a restart, so this is chosen once.
        self.delivery = delivery_policy(config.link)
        # The node links: handshake, registration, events; each handshake
        # reads the current node credentials (``set_node_credentials``).
        self.links = NodeLinks(
            config, self.registry, self.scheduler, self.link_clock, self.delivery
        )
        # What serves POST /admin/reload (the CLI sets it: it knows the file),
        # and what else holds a live key: called by ``apply_config``.
        self.reloader: Reloading | None = None
        self.reload_hooks: list[Callable[[EdgeConfig], None]] = []
        # The listeners' TLS contexts (set by serve_edge), read again on
        # every reload.
        self.tls: EdgeTLS | None = None

    def apply_config(self, config: EdgeConfig) -> None:
        """Run with a reloaded config, whose keys that need a restart are the
        running ones (``iop._reload.plan_reload``).

        One synchronous step, so no request sees half of it. What is in
        flight keeps what it started with: a run its deadlines, node and
        tenant's ticket; a node link the token it was admitted with and its
        limits. What starts next gets the new config: a request's key is
        looked up in the new tenants, a run placed by the new weights, a link
        admitted by the new tokens.
        """
        # First: what can refuse the reload does so before anything changed.
        if (self.tls is not None) != EdgeTLS.enabled(config):
            how = "off" if self.tls is not None else "on"
            raise ConfigError(f"server.tls_certfile: turning TLS {how} needs a restart")
        if self.tls is not None:
            # A certificate that cannot be loaded refuses the reload; the old
            # contexts stay (EdgeTLS.reload).
            self.tls.reload(config)
        now = trio.current_time()
        self.config = self.links.config = config
        self.set_node_credentials(config.link)
        self.scheduler.settings = config.scheduler
        self.admission.reconfigure(Prices(config.prices), config.tenancy)
        self.tenants.reconfigure(config.tenants, config.server.api_keys, config.tenancy, now=now)
        if self.cluster is not None:
            self.cluster.reconfigure(config.tenants, config.tenancy, now)
        # New keys and tokens are masked too; old ones stay masked.
        self.masker = self.metrics.masker = self.masker.with_secrets(
            value for value, _ in edge_secrets(config)
        )
        for hook in self.reload_hooks:
            hook(config)
        # A longer queue or new shares may let waiting runs go.
        self.scheduler.dispatch()

    # --- runs -----------------------------------------------------------------

    def models(self) -> list[ModelEntry]:
        return [ModelEntry(m, tuple(nodes)) for m, nodes in sorted(self.registry.models().items())]

    def start_run(
        self,
        spec: ExecutionSpec,
        *,
        collect: bool = False,
        ticket: Ticket | None = None,
        objective: Objective | None = None,
    ) -> Run:
        """Admit and start a run on the cluster.

        Args:
            spec: The run.
            ticket: The client's admission by its tenant (``iop.edge.tenancy._tenants``),
                settled when the run ends; its tenant's share orders the queue,
                and its tenant's cache salt keeps the run's prefix cache apart.
            collect: The caller reads the events only to build one answer
                (a non-streaming request): the node may send them in a few
                merged messages instead of one per token (``Assign.collect``).
            objective: The objective the edge itself gives the run (a batch
                line's, ``EdgeConfig.batch_objective``), over whatever the
                request or its tenant name.

        Raises:
            RequestError: 404 unknown model, 503 draining or no node, 429 queue full.
        """
        if self.draining:
            raise RequestError("the server is shutting down", status=503, code=ErrorCode.DRAINING)
        model, op = spec.model, spec.operation
        refuse_unservable(self.registry, self.scheduler, model, op)
        share = self.queue_share(spec.request, ticket, objective)
        self.scheduler.admit(model, op, share)
        routing = getattr(spec.request, "routing", None)
        if routing is not None:
            # The edge's alone: the node and the backend never see it.
            request = msgspec.structs.replace(spec.request, routing=None)
            spec = msgspec.structs.replace(spec, request=request)
        if ticket is not None:
            # The tenant's own prefix cache, on the edge and on the backend
            # (iop.edge.tenancy._tenants, "Prefix caches").
            salt = self.tenants.cache_salt(ticket.tenant, spec.request)
            if salt:
                spec = msgspec.structs.replace(spec, cache_salt=salt)
        self.runs_started += 1
        window = self.delivery.run_buffer
        trace = None
        executor = RemoteExecutor(self, share, collect=collect)
        run = self.supervisor.start_run(
            executor,
            spec,
            self.config.deadlines,
            # The link reader delivers without waiting: room for a whole
            # window of credit, the terminal, and a failover's Start.
            buffer=window + 2,
            stall_at=window,
            write_stall_timeout_s=self.config.server.write_stall_timeout,
            # What a cancel after the first output charges for the prompt:
            # the estimate admission reserved (docs/operations.md, "Tenants
            # and limits").
            prompt_tokens=estimate_prompt_tokens(spec.request),
        )
        timeline = run.timeline
        timeline.stream = not collect
        timeline.session = share.session
        timeline.session_from = "" if routing is None else routing.session_from
        timeline.objective = share.objective
        timeline.max_stalls = self.config.timelines.max_stalls
        if ticket is not None:
            # Before the run's task starts: its queue share is its tenant's.
            self.admission.hold(run, ticket)
        if self.tracing is not None:
            trace = self.tracing.request(timeline, spec.traceparent, f"{op} {model}")
            executor.trace = self._traces[spec.run_id] = trace
            timeline.traceparent = trace.traceparent
        else:
            timeline.traceparent = spec.traceparent
        return run

    def queue_share(
        self, request: OperationRequest, ticket: Ticket | None, given: Objective | None = None
    ) -> QueueShare:
        """Where ``request`` stands in the queue: its tenant's share, its
        session and its objective (docs/operations.md, "Sessions and objectives").

        The objective is the one the request names (``x-iop-objective``),
        else its tenant's, else ``scheduler.default_objective``; a
        ``x-llm-d-slo-ttft-ms`` header overrides its deadline. An objective
        the edge ``given`` (a batch line's) is taken as it is.

        Raises:
            RequestError: 400 when the request names an objective the
                config does not have.
        """
        share = EVEN_SHARE if ticket is None else ticket.tenant.share
        routing = getattr(request, "routing", None)
        if not isinstance(routing, Routing):
            routing = Routing()
        name = (
            routing.objective
            or (ticket.tenant.objective if ticket is not None else "")
            or self.config.scheduler.default_objective
        )
        objective = self.config.objective(name) if name else None
        if given is not None:
            name, objective, routing = (
                given.name,
                given,
                msgspec.structs.replace(routing, objective=""),
            )
        if name and objective is None:
            known = ", ".join(repr(o.name) for o in self.config.objectives) or "none"
            header = routing.objective_from or OBJECTIVE_HEADERS[0]
            raise RequestError(
                f"Unknown objective {name!r} (header '{header}'): this "
                f"server's objectives are {known}.",
                status=400,
                code=ErrorCode.INVALID_VALUE,
                param=header,
            )
        if routing.objective and ticket is not None and objective is not None:
            self._may_name(ticket.tenant, objective, routing.objective_from)
        deadline = routing.ttft_deadline_s
        if deadline is None and objective is not None:
            deadline = objective.ttft_deadline_s
        return dataclasses.replace(
            share,
            session=routing.session,
            rank=0 if objective is None else objective.priority,
            objective=name,
            sheddable=objective is not None and objective.sheddable,
            deadline_s=deadline,
        )

    def _may_name(self, tenant: Tenant, objective: Objective, header: str) -> None:
        """Refuse (400) an objective ``tenant``'s request may not name.

        Objective priority is weighed before a tenant's class and fair share,
        so among several tenants a client naming the top objective on every
        request would starve its neighbours: it may name only the objectives
        its tenant lists (``[[tenants]] objectives``), or, unlisted, those no
        higher than its tenant's own. With one tenant there is nobody to
        starve.
        """
        if len(self.tenants.all) < 2:
            return
        if tenant.objectives is not None:
            allowed = objective.name in tenant.objectives or objective.name == tenant.objective
        else:
            own = self.config.objective(tenant.objective or self.config.scheduler.default_objective)
            allowed = objective.priority <= (own.priority if own is not None else 0)
        if not allowed:
            raise RequestError(
                f"Objective {objective.name!r} (header '{header or OBJECTIVE_HEADERS[0]}') is "
                f"above what tenant {tenant.name!r} may ask for: its operator lists the "
                "objectives it may name ([[tenants]] objectives).",
                status=400,
                code=ErrorCode.INVALID_VALUE,
                param=header or OBJECTIVE_HEADERS[0],
            )

    async def admit(
        self, tenant: Tenant, request: OperationRequest, key_name: str = "", *, batch: bool = False
    ) -> Ticket:
        """Admit ``request`` of ``tenant`` (``TenantAdmission.admit``; ``batch``:
        a batch line, under ``[batches] tenant_limits``).

        Raises:
            RateLimited: Over one of the tenant's limits or budgets.
        """
        return await self.admission.admit(tenant, request, key_name, batch=batch)

    def settle(self, ticket: Ticket, usage: Usage | None, cost: int | None = 0) -> None:
        """Settle ``ticket`` where it was reserved (``TenantAdmission.settle``)."""
        self.admission.settle(ticket, usage, cost)

    def record_outcome(self, run: Run) -> None:
        """Count a finished run (the metrics' run counter, which /admin reads too)
        and keep its timeline."""
        now = trio.current_time()
        charged = charged_usage(run.outcome, run.spec.operation)
        self.metrics.record(run, now, charged)
        ticket, cost = self.admission.finish(run, charged)
        if self.ledger is not None:
            self.ledger.add(usage_record(run, ticket, charged, cost))
        self.timelines.add(run.timeline)
        if self.export is not None:
            self.export.add(run.timeline)
        trace = self._traces.pop(run.run_id, None)
        if trace is not None:
            trace.finish()

    def timeline(self, run_id: str) -> Timeline | None:
        """The timeline of a live run, else of a recent finished one."""
        run = self.supervisor.runs.get(run_id)
        return run.timeline if run is not None else self.timelines.get(run_id)

    # --- node links -------------------------------------------------------------

    def set_node_credentials(self, link: LinkSettings) -> None:
        """Accept ``link``'s node credentials from the next handshake on, and
        close (4401) every open link whose credential is gone or changed
        (``NodeLinks.set_credentials``)."""
        self.links.set_credentials(link)

    async def handle_link(
        self,
        chan: FrameChannel,
        peer: str = "",
        *,
        on_open: Callable[[int], None] | None = None,
    ) -> None:
        """Serve one node connection until it closes (``NodeLinks.handle``).
        Never raises (but Cancelled)."""
        await self.links.handle(chan, peer, on_open=on_open)

    def open_local_link(self) -> AbstractAsyncContextManager[LocalFrameChannel]:
        """A link from a node in this process (``iop up``'s own), over memory
        instead of a socket (``NodeLinks.open_local``)."""
        return self.links.open_local()

    # --- admin / lifecycle --------------------------------------------------------

    def drain_node(self, node_id: str, *, reason: str = "", by: str = "") -> bool:
        """An operator's drain of ``node_id`` (``iop.edge.runs._drains``).

        Raises:
            KeyError: No node of that id is connected or drained.
        """
        return drain_node(self.registry, node_id, reason=reason, by=by)

    def undrain_node(self, node_id: str, *, by: str = "") -> bool:
        """Undo ``drain_node`` (``iop.edge.runs._drains``).

        Raises:
            KeyError: No node of that id is connected or drained.
        """
        return undrain_node(self.registry, self.scheduler, node_id, by=by)

    def drain_view(self, node_id: str) -> dict[str, object]:
        """One node id's drain state (what drain and undrain answer)."""
        return _views.drain_view(self, node_id)

    def snapshot(self) -> dict[str, object]:
        """The admin view: nodes, instances, load, drains, routing, runs."""
        return _views.snapshot(self)

    def runs_view(self, limit: int) -> dict[str, object]:
        """``GET /admin/runs``: live runs and the ``limit`` newest finished ones."""
        return _views.runs_view(self, limit)

    def run_view(self, run_id: str) -> dict[str, object] | None:
        """``GET /admin/runs/{id}``: one run's whole timeline (None: not kept)."""
        return _views.run_view(self, run_id)

    async def drain(self, timeout_s: float) -> None:
        """Refuse new runs, let in-flight ones finish for ``timeout_s``, cancel the rest."""
        self.draining = True
        await drain_runs(self.supervisor, self.registry, timeout_s)


@asynccontextmanager
async def open_edge_core(config: EdgeConfig) -> AsyncIterator[EdgeCore]:
    """An ``EdgeCore`` with its run supervisor; runs left at exit are cancelled."""
    core: EdgeCore | None = None

    def finished(run: Run) -> None:
        if core is not None:
            core.record_outcome(run)

    export = TimelineExport(config.timelines) if config.timelines.export_path else None
    tracing = Tracing.from_settings(config.tracing, "iop-edge")
    async with trio.open_nursery() as services:
        if export is not None:
            services.start_soon(export.run, name="timeline-export")
        try:
            async with (
                open_run_supervisor(on_finished=finished, logger="iop.edge.run") as sup,
                trio.open_nursery() as links,
            ):
                core = EdgeCore(config, sup, export=export, tracing=tracing)
                if core.ledger is not None:
                    # Before the edge serves: budgets and rate windows restored.
                    ledger = core.ledger
                    await services.start(ledger.run, name="usage ledger")
                    restored = ledger.restored
                    core.tenants.restore(
                        restored.spent, restored.recent, restored.at, trio.current_time()
                    )
                links.start_soon(core.link_clock.run, name="edge link clock")
                links.start_soon(core.keepalives.run, name="edge keep-alive clock")
                # Cancelled with the links, before the supervisor closes: the
                # lines in flight end unwritten and run again at the next start.
                await links.start(core.batches.run, name="batches")
                if core.cluster is not None:
                    await links.start(core.cluster.run, name="edge cluster")
                try:
                    yield core
                finally:
                    sup.cancel_all(CancelReason.SHUTDOWN)
                    links.cancel_scope.cancel()
        finally:
            # Every run has ended (and queued its line): write what is left.
            if export is not None:
                export.close()
            if core is not None and core.ledger is not None:
                core.ledger.close()
            services.cancel_scope.deadline = trio.current_time() + EXPORT_FLUSH_S
            if tracing is not None:
                await tracing.aclose(config.tracing.export_timeout_s + 1.0)
