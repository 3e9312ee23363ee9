"""The edge's core: node links, remote runs, scheduling, drain.

Theory of operation
-------------------
An edge run is an ordinary ``iop.runtime`` run whose executor is remote:
``RemoteExecutor.execute`` asks the scheduler for a slot, queues ``Assign``
on the chosen node's link session, and waits. The node's events do not pass
through it: the link reader delivers each run's events straight into the
run's consumer channel (``RemoteRun.deliver`` → ``RunSink.push_nowait``,
which checks the event grammar and arms the run's deadlines; credit keeps
the channel, ``run_window + 2`` events, from ever filling), and the
consumer's reads return the credit. (With ``link.run_window = 0`` there is
no credit: a run whose channel holds ``RUN_BUFFER_WITHOUT_CREDIT`` unread
events makes the link reader wait, ``NodeConnection.release``, and every run
on that node waits with it.) So the edge gets the runtime's
guarantees for free: one terminal event per run, the wait timeouts (first
token, idle, total) as typed cancel reasons, and cancellation as structured
scope cancellation.

::

    HTTP handler ──start_run──► RunSupervisor task: RemoteExecutor.execute
                                   │ scheduler.acquire ─► Lease(node, instance)
                                   │ session.assign ──► link writer ──► node
                                   │ waits on RemoteRun.done
    node ──► link reader ──► EdgeSession.receive ──► RemoteRun.deliver
                                   │ push_nowait ──► run.events ──► HTTP handler
                                   │ each event taken ──► session.consumed ──► Credit

When the edge run ends early (client gone, wait timeout, shutdown), the
executor's ``finally`` queues ``Cancel`` (nothing to wait for: the writer
sends it with the next frame); the node cancels its run and closing the
backend response makes the backend stop. When a node's link dies, every run
on it is told (``RemoteRun.lose``): a run that has produced nothing yet is
retried on another node (failover); one that has is ended with
``Cancelled(node_lost)``.

The link is driven by ``iop.runtime.LinkDriver`` over a ``FrameChannel``
(WebSocket in production, ``iop.testing.memory_link_pair`` in tests): one
reader, one writer, no other task per link.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Final

import msgspec
import trio

from iop._reload import Reloading
from iop._secrets import SecretMasker, edge_secrets, mask_event
from iop.config import MAX_LOAD_REPORTS_PER_S, EdgeConfig, LinkSettings
from iop.edge._metrics import EdgeMetrics
from iop.edge._registry import (
    EVEN_SHARE,
    InstanceState,
    Lease,
    NodeConnection,
    NodeDrain,
    NodeRegistry,
    RemoteRun,
    Scheduler,
    affinity_key,
)
from iop.edge._timeline_export import TimelineExport
from iop.edge.server._tls import EdgeTLS
from iop.edge.tenancy._cluster import SharedLimits, default_edge_id
from iop.edge.tenancy._ledger import Ledger
from iop.edge.tenancy._tenants import (
    Tenant,
    Tenants,
    Ticket,
    charged_usage,
    estimate_prompt_tokens,
    estimate_tokens,
)
from iop.errors import (
    ConfigError,
    ErrorCode,
    InvariantError,
    LinkAuthError,
    LinkError,
    LinkLimitError,
    LinkProtocolError,
    RequestError,
    RunAborted,
)
from iop.events import Cancelled, CancelReason, Complete, Error, Usage
from iop.ledger import Prices, UsageRecord
from iop.protocol import (
    CLOSE_BAD_TOKEN,
    CLOSE_GOING_AWAY,
    CLOSE_HEARTBEAT,
    CLOSE_ID_IN_USE,
    CLOSE_NORMAL,
    CLOSE_PROTOCOL,
    CLOSE_REPLACED,
    COLLECT_FLUSH_S,
    UNLIMITED_CREDIT,
    CapabilitiesChanged,
    EdgeLinkEvent,
    EdgeSession,
    FrameChannel,
    LinkClosed,
    LoadReported,
    NodeCredentials,
    NodeDraining,
    NodeJoined,
    RunEventsReceived,
    close_code,
    close_reason,
)
from iop.runtime import (
    LinkClock,
    LinkDriver,
    PeerSilent,
    Run,
    RunSink,
    RunSupervisor,
    open_run_supervisor,
)
from iop.spec import ExecutionSpec, OperationRequest
from iop.timeline import Placement, Timeline, TimelineRing
from iop.tracing import RunTrace, Tracing

__all__ = ["EdgeCore", "RemoteExecutor", "open_edge_core"]

log = logging.getLogger("iop.edge")

# How long the timeline export may take to write its last lines at exit.
EXPORT_FLUSH_S: Final = 5.0

# How long cancelled runs may take to end on a drain.
CANCEL_SEND_TIMEOUT_S: Final = 1.0
# Our side of closing a link (shielded cleanup, so it must be short): a peer
# that stopped reading must not keep a handler, or a drain, waiting.
CLOSE_TIMEOUT_S: Final = 1.0
# The codes no peer sends (RFC 6455, section 7.4.1): what they say happened,
# for a log line that would otherwise repeat the code as its reason.
_CLOSE_MEANING: Final[dict[int | None, str]] = {
    1005: "closed without a status code",
    1006: "the connection dropped without a close frame",
}
# Attempts of one run across nodes (the first try plus failovers).
MAX_ATTEMPTS: Final = 3
# With per-run credit off (``link.run_window = 0``): events a run's consumer
# may leave unread before the link's reader waits for it (and so every run
# on the link does). The default window's size, so that credit on and off
# hold the same per run and differ only in who waits.
RUN_BUFFER_WITHOUT_CREDIT: Final = 64


# How a 400 names an operation a model does not serve.
_OP_NOUNS: Final = {
    "chat": "chat completions",
    "completion": "text completions",
    "embedding": "embeddings",
    "tokenize": "token counts",
}


def _nothing() -> None:
    pass


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


class _NodeIdInUse(LinkError):
    """A second connection presented the id of a node whose link is alive."""


async def _close(chan: FrameChannel, code: int, reason: str) -> None:
    """Close ``chan`` within ``CLOSE_TIMEOUT_S``, even while being cancelled."""
    with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
        await chan.aclose(code, close_reason(reason))


class _Retry(Exception):
    """This attempt failed before any output; try another node."""

    def __init__(self, node_id: str, why: str, error: Error | Cancelled | None = None) -> None:
        super().__init__(why)
        self.node_id = node_id
        self.why = why
        # What the node ended the attempt with (a refusal, or its queue
        # timeout): the run's outcome when no other node can take it.
        self.error = error


@dataclass(frozen=True)
class ModelEntry:
    id: str
    nodes: tuple[str, ...]


class RemoteExecutor:
    """Executes one run on whichever node the scheduler picks."""

    __slots__ = ("_collect", "_collect_flush_s", "_core", "_started", "_trace")  # one per stream

    def __init__(
        self, core: EdgeCore, *, collect: bool = False, trace: RunTrace | None = None
    ) -> None:
        self._core = core
        # The run's spans when the edge traces (iop.tracing).
        self._trace = trace
        # Nobody reads the events as they come (``Assign.collect``).
        self._collect = collect
        # How long the node may hold them: an eighth of the idle deadline
        # (which then fires at most that much late), at most the node's default.
        idle = core.config.deadlines.idle_timeout_s
        self._collect_flush_s = COLLECT_FLUSH_S if idle is None else min(COLLECT_FLUSH_S, idle / 8)
        # Start reached the run's sink (from the first attempt that sent one);
        # a failover attempt's own Start is then not forwarded again.
        self._started = [False]

    async def execute(self, spec: ExecutionSpec, send: RunSink) -> None:
        core = self._core
        model, op = spec.model, spec.operation
        excluded: set[str] = set()
        last: _Retry | None = None
        # A tenant's conversations and prefixes are its own: the run's cache
        # salt scopes them as it scopes the backend's cache (start_run).
        scope = spec.cache_salt
        affinity = affinity_key(spec.request, scope) if core.config.scheduler.affinity else None
        prefix = core.scheduler.prompt_blocks(spec.request, scope)
        share = core.tenants.share_of(send.timeline.tenant)
        attempts = MAX_ATTEMPTS if core.config.scheduler.failover else 1
        for attempt in range(attempts):
            if last is not None and not core.scheduler.could_serve(model, frozenset(excluded), op):
                break  # no other node to fail over to: report what happened
            try:
                with send.queued():  # the queue wait is not the node's latency
                    lease = await core.scheduler.acquire(
                        model,
                        exclude=frozenset(excluded),
                        affinity=affinity,
                        operation=op,
                        # A failover's wait shows as the gap between placements.
                        timeline=send.timeline if attempt == 0 else None,
                        prefix=prefix,
                        share=share,
                    )
            except RunAborted:
                if last is not None and last.error is not None:
                    break  # report the node's own error rather than the wait
                raise
            try:
                await self._attempt(lease, spec, send, attempt + 1)
                return
            except _Retry as retry:
                last = retry
                excluded.add(retry.node_id)
                log.warning(
                    "run %s: attempt %d on node %s failed before output (%s)%s",
                    spec.run_id,
                    attempt + 1,
                    retry.node_id,
                    retry.why,
                    "; failing over" if attempt + 1 < attempts else "",
                )
            finally:
                lease.release()
        assert last is not None
        if isinstance(last.error, Cancelled):
            # The node's queue timeout: the run's own outcome (a run cancels
            # by raising; its Cancelled comes from the runtime).
            raise RunAborted(core.masker.mask(last.error.message), reason=last.error.reason)
        if last.error is not None:
            await send.send(mask_event(last.error, core.masker))
            return
        raise RunAborted(core.masker.mask(last.why), reason=CancelReason.NODE_LOST)

    async def _attempt(self, lease: Lease, spec: ExecutionSpec, send: RunSink, number: int) -> None:
        conn, instance = lease.conn, lease.instance.caps.instance
        window = self._core.config.link.run_window
        credit = window or UNLIMITED_CREDIT
        run_id = spec.run_id
        placement = Placement(
            attempt=number,
            node=conn.node_id,
            instance=instance,
            at=trio.current_time(),
            why=lease.why,
            scores=lease.scores,
            candidates=lease.candidates,
        )
        rr = RemoteRun(
            run_id,
            send,
            self._core.masker,
            self._started,
            placement.at,
            unread_limit=0 if window else RUN_BUFFER_WITHOUT_CREDIT,
        )
        ended = False  # the node is done with the run: nothing to cancel
        timeline = send.timeline
        timeline.placements.append(placement)
        # The node's run joins the trace: the attempt's span, or the client's
        # context passed on when the edge does not trace.
        traceparent = (
            self._trace.attempt(conn.node_id, instance, number, placement.at)
            if self._trace is not None
            else timeline.traceparent
        )
        if traceparent != spec.traceparent:
            spec = msgspec.structs.replace(spec, traceparent=traceparent)
        try:
            try:
                conn.assign(
                    rr,
                    instance,
                    spec,
                    credit,
                    collect=self._collect,
                    collect_flush_s=self._collect_flush_s,
                )
            except InvariantError as exc:
                raise _Retry(conn.node_id, "link closed before assign") from exc
            send.on_consumed(partial(conn.consume, run_id))
            await rr.done.wait()
            if rr.lost is not None:
                placement.result = f"lost: {rr.lost}"
                raise self._lost(conn, rr.lost, rr.output)
            ended = True
            if rr.retry is not None:
                placement.result = f"retry: {rr.retry.message}"
                raise _Retry(conn.node_id, rr.retry.message, rr.retry)
            placement.result = "ran"
            if rr.violation is not None:
                ended = False
                log.warning("node %s broke run %s: %s", conn.node_id, run_id, rr.violation)
                raise RequestError(
                    f"node {conn.node_id} sent an invalid event sequence",
                    status=502,
                    code=ErrorCode.BAD_NODE_EVENTS,
                )
        finally:
            reason: CancelReason | None = None
            if not ended:
                reason = send.cancel_reason
                if reason is CancelReason.SLOW_CLIENT:
                    # Nodes older than slow_client cannot decode it (a link
                    # protocol error would drop every run of the node); for
                    # the node it is a client that went away.
                    reason = CancelReason.CLIENT_DISCONNECT
                if placement.result is None:
                    placement.result = "cancelled"
            if conn.close_run(run_id, reason) and timeline.cancel_sent is None:
                timeline.cancel_sent = trio.current_time()

    def _lost(self, conn: NodeConnection, message: str, output: bool) -> Exception:
        """What a run does when its node's link is gone: fail over, or end node_lost."""
        if not output:
            return _Retry(conn.node_id, message)
        return RunAborted(self._core.masker.mask(message), reason=CancelReason.NODE_LOST)


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
        # Client keys, their tenants and limits; the admitted runs' tickets,
        # settled when each run ends (``record_outcome``).
        self.tenants = Tenants(config.tenants, config.server.api_keys, config.tenancy)
        # What a node's hello may present; each handshake reads the current
        # set, which a config reload replaces (``set_node_credentials``).
        self.node_credentials = node_credentials(config.link)
        self._tickets: dict[str, Ticket] = {}
        # What runs cost ([prices]), and the ledger every finished run is
        # written to ([usage] ledger_path; open_edge_core runs it).
        self.prices = Prices(config.prices)
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
        # The timelines of recent finished runs, and their export (open_edge_core runs it).
        self.timelines = TimelineRing(config.timelines.recent)
        self.export = export
        self.tracing = tracing
        self._traces: dict[str, RunTrace] = {}
        # One timer for every link's liveness and pings (``open_edge_core`` runs it).
        self.link_clock = LinkClock(config.link.heartbeat_timeout_s)
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
        self.config = config
        self.set_node_credentials(config.link)
        self.scheduler.settings = config.scheduler
        self.prices = Prices(config.prices)
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
        self, spec: ExecutionSpec, *, collect: bool = False, ticket: Ticket | None = None
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

        Raises:
            RequestError: 404 unknown model, 503 draining or no node, 429 queue full.
        """
        if self.draining:
            raise RequestError("the server is shutting down", status=503, code=ErrorCode.DRAINING)
        model, op = spec.model, spec.operation
        if not self.scheduler.serves(model, op):
            if self._advertised(model) and not self._advertised(model, op):
                # Listed, but by no instance for this operation (a chat model
                # asked for embeddings): the client's mistake, said as such.
                raise RequestError(
                    f"The model `{model}` does not serve {_OP_NOUNS.get(op, op)}.",
                    status=400,
                    code=ErrorCode.OPERATION_NOT_SUPPORTED,
                    param="model",
                )
            if not self.registry.nodes:
                raise RequestError(
                    "no inference node is connected", status=503, code=ErrorCode.NO_NODES
                )
            blocked = self._why_unavailable(model)
            if blocked:
                # Known (or maybe served by a backend that is down and never
                # listed its models): a retryable 503 that says why, not
                # "does not exist".
                raise RequestError(
                    f"model `{model}` is temporarily unavailable: {'; '.join(blocked)}",
                    status=503,
                    code=ErrorCode.MODEL_UNAVAILABLE,
                    param="model",
                )
            raise RequestError(
                f"The model `{model}` does not exist or no node serves it.",
                status=404,
                code=ErrorCode.MODEL_NOT_FOUND,
                param="model",
            )
        self.scheduler.admit(model, op, EVEN_SHARE if ticket is None else ticket.tenant.share)
        if ticket is not None:
            # The tenant's own prefix cache, on the edge and on the backend
            # (iop.edge.tenancy._tenants, "Prefix caches").
            salt = self.tenants.cache_salt(ticket.tenant, spec.request)
            if salt:
                spec = msgspec.structs.replace(spec, cache_salt=salt)
        self.runs_started += 1
        window = self.config.link.run_window or RUN_BUFFER_WITHOUT_CREDIT
        trace = None
        executor = RemoteExecutor(self, collect=collect)
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
        timeline.max_stalls = self.config.timelines.max_stalls
        if ticket is not None:
            # Before the run's task starts: its queue share is its tenant's.
            self.hold_ticket(run, ticket)
        if self.tracing is not None:
            trace = self.tracing.request(timeline, spec.traceparent, f"{op} {model}")
            executor._trace = self._traces[spec.run_id] = trace
            timeline.traceparent = trace.traceparent
        else:
            timeline.traceparent = spec.traceparent
        return run

    def _advertised(self, model: str, operation: str | None = None) -> bool:
        """Whether a connected instance lists ``model`` (for ``operation``), up or not."""
        return any(
            model in inst.caps.targets and (operation is None or inst.caps.serves(operation))
            for _, inst in self.registry.instances()
        )

    def _why_unavailable(self, model: str) -> list[str]:
        """Why no instance can take ``model`` now, one phrase per instance that might.

        An instance might serve it if it advertises it, or if it is
        unavailable without having listed any model (its backend was down
        since the node started). Empty: no instance might, the model is unknown.
        """
        why: list[str] = []
        for conn, inst in self.registry.instances():
            caps = inst.caps
            listed = model in caps.targets
            if not listed and (caps.targets or inst.usable):
                continue
            name = f"{conn.node_id}/{caps.instance}"
            drained = self.registry.drained.get(conn.node_id)
            if drained is not None:
                said = f" ({drained.reason})" if drained.reason else ""
                why.append(f"node {conn.node_id} is drained by an operator{said}")
            elif conn.draining:
                why.append(f"node {conn.node_id} is draining")
            elif not inst.usable:
                cause = caps.provider_detail or "no reason given"
                maybe = "" if listed else " (its models are unknown)"
                why.append(f"instance {name}{maybe} is unavailable: {cause}")
        return list(dict.fromkeys(why))  # one "node X is draining" (or drained) per node

    async def admit(self, tenant: Tenant, request: OperationRequest, key_name: str = "") -> Ticket:
        """Admit ``request`` of ``tenant``: it reserves its estimated tokens
        (``estimate_tokens``) from the rate limits, by this edge's buckets or
        by every edge's in Valkey (``[cluster]``), and their cost from the
        tenant's budgets.

        Raises:
            RateLimited: Over one of the tenant's limits or budgets.
        """
        tokens = estimate_tokens(request, self.config.tenancy.default_max_tokens)
        if not tenant.budgets:
            ticket = await self._admit_rate(tenant, tokens)
            ticket.key_name = key_name
            return ticket
        prompt = estimate_prompt_tokens(request)
        estimate = Usage(input_tokens=prompt, output_tokens=tokens - prompt)
        cost = self.prices.cost(request.model, estimate)
        wall = time.time()
        if self.cluster is None:
            # Checked, then taken after the rate limits: no await between.
            self.tenants.check_budget(tenant, cost, wall, trio.current_time())
            ticket = self.tenants.admit(tenant, tokens, trio.current_time())
            self.tenants.take_budget(ticket, cost, wall)
        else:
            # Every edge's spend, in Valkey: reserved first (a refusal takes
            # nothing), given back if the rate limits refuse.
            hold = Ticket(tenant, 0, ())
            await self.cluster.reserve_budget(hold, cost, wall, trio.current_time())
            try:
                ticket = await self.cluster.admit(tenant, tokens, trio.current_time())
            except BaseException:
                self.cluster.settle_budget(hold, 0, time.time())
                raise
            ticket.reserved_micros = hold.reserved_micros
            ticket.periods = hold.periods
            ticket.budget_shared = hold.budget_shared
        ticket.key_name = key_name
        return ticket

    async def _admit_rate(self, tenant: Tenant, tokens: int) -> Ticket:
        if self.cluster is None:
            return self.tenants.admit(tenant, tokens, trio.current_time())
        return await self.cluster.admit(tenant, tokens, trio.current_time())

    def settle(self, ticket: Ticket, usage: Usage | None, cost: int | None = 0) -> None:
        """Settle ``ticket`` where it was reserved (once), and its budgets'
        reservation to ``cost`` (micro-units; None: the reservation stands)."""
        if ticket.settled:
            return
        now = trio.current_time()
        if ticket.periods:
            settled = None if usage is None else cost
            if self.cluster is None:
                self.tenants.settle_budget(ticket, settled, time.time())
            else:
                self.cluster.settle_budget(ticket, settled, time.time())
        if self.cluster is None:
            self.tenants.finish(ticket, usage, now)
        else:
            self.cluster.finish(ticket, usage, now)

    def hold_ticket(self, run: Run, ticket: Ticket) -> None:
        """``run`` was admitted with ``ticket``: settle it when the run ends."""
        run.timeline.tenant = ticket.tenant.name
        self._tickets[run.run_id] = ticket

    def record_outcome(self, run: Run) -> None:
        """Count a finished run (the metrics' run counter, which /admin reads too)
        and keep its timeline."""
        now = trio.current_time()
        charged = charged_usage(run.outcome, run.spec.operation)
        self.metrics.record(run, now, charged)
        cost = self.prices.cost(run.spec.model, charged or Usage())
        ticket = self._tickets.pop(run.run_id, None)
        if ticket is not None:
            self.settle(ticket, charged, cost)
        if self.ledger is not None:
            self.ledger.add(self._usage_record(run, ticket, charged, cost))
        self.timelines.add(run.timeline)
        if self.export is not None:
            self.export.add(run.timeline)
        trace = self._traces.pop(run.run_id, None)
        if trace is not None:
            trace.finish()

    @staticmethod
    def _usage_record(
        run: Run, ticket: Ticket | None, charged: Usage | None, cost: int
    ) -> UsageRecord:
        """The ledger's line of a finished run (``iop.ledger.UsageRecord``)."""
        timeline = run.timeline
        usage = charged or Usage()
        outcome = run.outcome
        reason = ""
        if isinstance(outcome, Cancelled):
            reason = outcome.reason.value
        elif isinstance(outcome, Error):
            reason = str(outcome.code)
        last = timeline.placements[-1] if timeline.placements else None
        ended = timeline.terminal if timeline.terminal is not None else trio.current_time()
        return UsageRecord(
            run_id=run.run_id,
            at=time.time(),
            tenant=ticket.tenant.name if ticket is not None else timeline.tenant,
            key_name=ticket.key_name if ticket is not None else "",
            model=run.spec.model,
            operation=run.spec.operation,
            node=last.node if last is not None else "",
            instance=last.instance if last is not None else "",
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cached_tokens=usage.cached_input_tokens,
            outcome="complete"
            if isinstance(outcome, Complete)
            else "cancelled"
            if isinstance(outcome, Cancelled)
            else "error",
            reason=reason,
            duration_ms=max(0, round((ended - timeline.received) * 1000)),
            attempts=len(timeline.placements),
            cost_micros=cost,
        )

    def timeline(self, run_id: str) -> Timeline | None:
        """The timeline of a live run, else of a recent finished one."""
        run = self.supervisor.runs.get(run_id)
        return run.timeline if run is not None else self.timelines.get(run_id)

    # --- node links -------------------------------------------------------------

    def set_node_credentials(self, link: LinkSettings) -> None:
        """Accept ``link``'s node credentials from the next handshake on (a
        config reload), and close (4401) every open link whose credential is
        gone or changed: a revoked token loses its links at once, the other
        nodes keep theirs (``docs/operations.md``, "TLS and node credentials").
        """
        credentials = node_credentials(link)
        self.node_credentials = credentials
        log.info("node credentials: %d accepted", len(credentials))
        for conn in list(self.registry.nodes.values()):
            held = conn.session.credential
            if held is not None and not credentials.admits(held, conn.node_id):
                log.warning(
                    "node %s: credential %s revoked: closing its link (4401)",
                    conn.node_id,
                    held.name,
                )
                conn.close(CLOSE_BAD_TOKEN, f"credential {held.name} revoked")

    async def handle_link(
        self,
        chan: FrameChannel,
        peer: str = "",
        *,
        on_open: Callable[[int], None] | None = None,
    ) -> None:
        """Serve one node connection until it closes. Never raises (but Cancelled).

        Args:
            chan: The connection.
            peer: Who is at the other end (address), for logs.
            on_open: Called with the frame limit after the hello once the
                node is accepted, so a transport that enforces the limit
                while buffering (hypercorn) can raise it from the hello's.
        """
        link = self.config.link
        session = EdgeSession(
            tokens=self.node_credentials,
            heartbeat_interval_s=link.heartbeat_interval_s,
            heartbeat_timeout_s=link.heartbeat_timeout_s,
            now=trio.current_time(),
            max_hello_bytes=link.max_hello_bytes,
            max_frame_bytes=self.config.link_frame_bytes,
            control_rate_per_s=link.control_rate_per_s,
            control_burst=link.control_burst,
            # A quarter of the budget the reports share with pings and
            # capability updates: a node at this rate never runs it dry.
            load_reports_per_s=min(MAX_LOAD_REPORTS_PER_S, link.control_rate_per_s / 4),
            load_stale_s=self.config.scheduler.load_stale_s,
        )
        who = peer or "?"
        try:
            opened = await self._handshake(chan, session, who, on_open)
        except LinkClosed as exc:
            log.info("node link from %s closed during handshake: %s", who, exc)
            return
        except LinkAuthError as exc:
            log.warning("refusing node from %s: %s", who, exc)
            await _close(chan, CLOSE_BAD_TOKEN, exc.message)
            return
        except _NodeIdInUse as exc:
            log.warning("refusing node from %s: %s", who, exc)
            await _close(chan, CLOSE_ID_IN_USE, exc.message)
            return
        except LinkLimitError as exc:
            log.warning("refusing node link from %s: %s (close %d)", who, exc, exc.close_code)
            await _close(chan, exc.close_code, exc.message)
            return
        except LinkProtocolError as exc:
            log.warning("refusing node link from %s: %s", who, exc)
            await _close(chan, CLOSE_PROTOCOL, exc.message)
            return
        if opened is None:
            log.warning(
                "node link from %s: no hello within %gs", who, self.config.link.hello_timeout_s
            )
            await _close(chan, CLOSE_PROTOCOL, "no hello")
            return
        conn = opened
        conn.peer = who
        try:
            # Again, with no wait before the registration: two newcomers
            # with one id may both have passed the check before the welcome.
            self._check_id_free(conn.node_id, who)
        except _NodeIdInUse as exc:
            log.warning("refusing node from %s: %s", who, exc)
            await _close(chan, CLOSE_ID_IN_USE, exc.message)
            return
        await self._serve_connection(chan, session, conn)

    async def _handshake(
        self,
        chan: FrameChannel,
        session: EdgeSession,
        peer: str,
        on_open: Callable[[int], None] | None,
    ) -> NodeConnection | None:
        with trio.move_on_after(self.config.link.hello_timeout_s):
            frame = await chan.receive()
            (event,) = session.receive(frame, trio.current_time())
            assert isinstance(event, NodeJoined)
            hello = event.hello
            self._check_id_free(hello.node_id, peer)
            if on_open is not None:
                # Before the welcome: the node may answer it with a big frame at once.
                on_open(session.max_frame_bytes)
            await chan.send(session.welcome())
            conn = NodeConnection(
                node_id=hello.node_id,
                session=session,
                instances={},
                connected_at=time.time(),
                software=hello.software,
            )
            conn.update_instances(hello.instances)
            return conn
        return None

    def _check_id_free(self, node_id: str, peer: str) -> None:
        """Refuse a node id whose link is alive: it must not be taken over.

        A registered link is alive until its liveness deadline (last frame
        plus ``heartbeat_timeout_s``) has passed; a node pings every
        ``heartbeat_interval_s``, so a live node is never near it. A link
        past its deadline is dead (the link clock is about to close it) and a
        reconnecting node may replace it.

        Raises:
            _NodeIdInUse: The id is served by a live link.
        """
        old = self.registry.nodes.get(node_id)
        if old is None:
            return
        now = trio.current_time()
        if now < old.session.liveness_deadline:
            raise _NodeIdInUse(
                f"node id {node_id!r} is in use by a live link from {old.peer or '?'} "
                f"(last heard {now - old.session.last_seen:.1f}s ago); "
                "each node needs its own node.id"
            )

    async def _serve_connection(
        self, chan: FrameChannel, session: EdgeSession, conn: NodeConnection
    ) -> None:
        old = self.registry.add(conn)
        if old is not None:
            # _check_id_free let it in: the old link is past its deadline.
            log.warning(
                "node %s reconnected from %s: replacing its previous link from %s "
                "(silent for %.1fs)",
                conn.node_id,
                conn.peer or "?",
                old.peer or "?",
                trio.current_time() - old.session.last_seen,
            )
            old.close(CLOSE_REPLACED, "replaced by a new connection")
        credential = session.credential
        log.info(
            "node %s connected from %s with credential %s: %s",
            conn.node_id,
            conn.peer or "?",
            credential.name if credential is not None else "?",
            ", ".join(
                f"{i.caps.instance}({i.caps.adapter}, {i.caps.provider_status}, "
                f"targets={list(i.caps.targets)}, slots={i.caps.max_concurrency})"
                for i in conn.instances.values()
            )
            or "no instances",
        )
        driver = LinkDriver(
            chan,
            session,
            partial(self._on_link_events, conn),
            peer=f"node {conn.node_id}",
            clock=self.link_clock,
            backpressure=conn if self.config.link.run_window == 0 else None,
        )
        conn.wake = driver.wake
        self.scheduler.dispatch()
        try:
            with conn.cancel_scope:
                await driver.run()
        except PeerSilent:
            log.warning(
                "node %s silent for %.1fs: declaring it lost",
                conn.node_id,
                trio.current_time() - session.last_seen,
            )
            if conn.close_code is None:
                conn.close_code, conn.close_reason = CLOSE_HEARTBEAT, "heartbeat timeout"
        except LinkClosed as closed:
            if conn.close_code is None:
                reason = closed.reason or _CLOSE_MEANING.get(closed.close_code, "no reason given")
                conn.close_code, conn.close_reason = closed.close_code, reason
        except LinkProtocolError as exc:
            code = close_code(exc)
            log.warning("node %s broke the protocol: %s (close %d)", conn.node_id, exc, code)
            conn.close_code, conn.close_reason = code, close_reason(str(exc))
        finally:
            if self.registry.remove(conn):
                # A new link of this node starts cold (iop.edge.scheduler._prefix).
                self.scheduler.prefixes.forget(conn.node_id)
            session.close()
            conn.wake = _nothing
            reason = conn.close_reason or "link closed"
            affected = len(conn.runs)
            for rr in list(conn.runs.values()):
                rr.lose(f"node {conn.node_id} lost: {reason}")
            await _close(chan, conn.close_code or CLOSE_NORMAL, conn.close_reason)
            self._log_disconnect(conn, affected)
            self.scheduler.dispatch()

    @staticmethod
    def _log_disconnect(conn: NodeConnection, affected: int) -> None:
        """INFO for a clean end (1000/1001, or a goodbye then close), else WARNING."""
        code = conn.close_code
        if code is None and conn.draining:
            # The node said goodbye and the connection dropped without a close frame.
            level, how = logging.INFO, f"left after its goodbye ({conn.goodbye or 'draining'})"
        elif code is None:
            level, how = logging.WARNING, "closed the link without a goodbye"
        elif code in (CLOSE_NORMAL, CLOSE_GOING_AWAY):
            level, how = logging.INFO, f"closed cleanly ({code} {conn.close_reason or 'normal'})"
        else:
            level, how = logging.WARNING, f"lost ({code} {conn.close_reason or 'no reason'})"
        log.log(
            level,
            "node %s disconnected: %s; %d run(s) affected",
            conn.node_id,
            how,
            affected,
        )

    def _on_link_events(self, conn: NodeConnection, events: list[EdgeLinkEvent]) -> None:
        """A frame's events (the link reader: never blocks)."""
        runs: list[RunEventsReceived] = []
        for event in events:
            if isinstance(event, RunEventsReceived):
                runs.append(event)
            elif isinstance(event, CapabilitiesChanged):
                conn.update_instances(event.instances)
                log.info("node %s updated its capabilities", conn.node_id)
                self.scheduler.dispatch()
            elif isinstance(event, LoadReported):
                conn.on_load(event.instances, event.at)
            elif isinstance(event, NodeDraining):
                conn.draining = True
                conn.goodbye = event.reason
                log.info("node %s is draining: %s", conn.node_id, event.reason)
        if runs:
            conn.on_events(runs)

    # --- admin / lifecycle --------------------------------------------------------

    def known_node(self, node_id: str) -> bool:
        """Whether ``node_id`` is connected or drained (what drain and undrain act on)."""
        return node_id in self.registry.nodes or node_id in self.registry.drained

    def drain_node(self, node_id: str, *, reason: str = "", by: str = "") -> bool:
        """An operator's drain of ``node_id``: no new runs go there until
        ``undrain_node``, across its reconnects; its runs go on to their end.

        Returns:
            Whether it changed anything (False: already drained, kept as it was).

        Raises:
            KeyError: No node of that id is connected or drained.
        """
        if not self.known_node(node_id):
            raise KeyError(node_id)
        if node_id in self.registry.drained:
            return False
        self.registry.drained[node_id] = NodeDrain(reason=reason, by=by, since_unix=time.time())
        conn = self.registry.nodes.get(node_id)
        log.warning(
            "node %s drained by %s%s: no new runs go there; %d run(s) on it go on",
            node_id,
            by or "?",
            f" ({reason})" if reason else "",
            0 if conn is None else len(conn.runs),
        )
        return True

    def undrain_node(self, node_id: str, *, by: str = "") -> bool:
        """Undo ``drain_node``: ``node_id`` takes runs again (queued ones first).

        Returns:
            Whether it changed anything (False: it was not drained).

        Raises:
            KeyError: No node of that id is connected or drained.
        """
        if not self.known_node(node_id):
            raise KeyError(node_id)
        if self.registry.drained.pop(node_id, None) is None:
            return False
        log.warning("node %s undrained by %s: it takes runs again", node_id, by or "?")
        self.scheduler.dispatch()
        return True

    def drain_view(self, node_id: str) -> dict[str, object]:
        """One node id's drain state (what drain and undrain answer)."""
        drained = self.registry.drained.get(node_id)
        conn = self.registry.nodes.get(node_id)
        return self.masker.mask_tree(
            {
                "id": node_id,
                "drained": None if drained is None else msgspec.to_builtins(drained),
                "connected": conn is not None,
                "runs": 0 if conn is None else len(conn.runs),
            }
        )

    def routing_view(self) -> dict[str, object]:
        """The scheduler's policy, its weights and the prefix index's size."""
        s = self.config.scheduler
        prefixes = self.scheduler.prefixes
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
            },
        }

    def snapshot(self) -> dict[str, object]:
        """The admin view: nodes, instances, load, drains, routing, runs."""
        now = time.time()
        drained = self.registry.drained

        def drained_view(node_id: str) -> object:
            mark = drained.get(node_id)
            return None if mark is None else msgspec.to_builtins(mark)

        nodes = []
        for conn in self.registry.nodes.values():
            nodes.append(
                {
                    "id": conn.node_id,
                    "software": conn.software,
                    "connected_for_s": round(now - conn.connected_at, 1),
                    "draining": conn.draining,
                    "drained": drained_view(conn.node_id),
                    "runs": sorted(conn.runs),
                    "instances": [
                        {
                            **msgspec.to_builtins(i.caps),
                            "in_flight": i.in_flight,
                            "reported": self._reported_view(i),
                        }
                        for i in conn.instances.values()
                    ],
                }
            )
        runs = [
            {
                "run_id": r.run_id,
                "model": r.spec.model,
                "state": r.state.value,
                "age_s": round(trio.current_time() - r.started_at, 3),
            }
            for r in self.supervisor.runs.values()
        ]
        tenants = self.tenants.snapshot(trio.current_time())
        if self.cluster is not None:
            self.cluster.tenant_limits(tenants)
        # Nodes report names, providers and models: strings the edge does not control.
        return self.masker.mask_tree(
            {
                "draining": self.draining,
                "nodes": nodes,
                "queued": self.scheduler.queued,
                "queue": self._queue_view(),
                # Every drained id, connected or not (it stays drained when it comes back).
                "drained": {node_id: drained_view(node_id) for node_id in sorted(drained)},
                "routing": self.routing_view(),
                "runs": runs,
                "runs_started": self.runs_started,
                "tasks": live_tasks(),
                "outcomes": self.metrics.outcomes(),
                "tenants": tenants,
                "cluster": None if self.cluster is None else self.cluster.snapshot(),
            }
        )

    def _reported_view(self, inst: InstanceState) -> dict[str, object] | None:
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
            "stale": self.scheduler.is_stale(inst, now),
            "occupancy": self.scheduler.occupancy(inst, now),
        }

    def _queue_view(self) -> dict[str, object]:
        """How runs left the queue, and the last one's time on the host's
        monotonic clock (``Scheduler.last_exit``)."""
        sched = self.scheduler
        last = sched.last_exit
        return {
            "exits": {how.value: n for how, n in sched.exits.items()},
            "last_exit": None if last is None else msgspec.to_builtins(last),
        }

    def runs_view(self, limit: int) -> dict[str, object]:
        """``GET /admin/runs``: live runs and the ``limit`` newest finished ones."""
        recent: list[dict[str, object]] = []
        for timeline in self.timelines.newest_first():
            if len(recent) >= limit:
                break
            recent.append(timeline.summary())
        export = None
        if self.export is not None:
            export = {
                "path": str(self.export.path),
                "written": self.export.written,
                "dropped": self.export.dropped,
                "rotations": self.export.rotations,
            }
        return self.masker.mask_tree(
            {
                "live": [r.timeline.summary() for r in self.supervisor.runs.values()],
                "recent": recent,
                "kept": len(self.timelines),
                "capacity": self.timelines.capacity,
                "export": export,
            }
        )

    def run_view(self, run_id: str) -> dict[str, object] | None:
        """``GET /admin/runs/{id}``: one run's whole timeline (None: not kept)."""
        timeline = self.timeline(run_id)
        return None if timeline is None else self.masker.mask_tree(timeline.to_json())

    async def drain(self, timeout_s: float) -> None:
        """Refuse new runs, let in-flight ones finish for ``timeout_s``, cancel the rest."""
        self.draining = True
        if self.supervisor.runs:
            log.info(
                "draining: waiting up to %gs for %d run(s)", timeout_s, len(self.supervisor.runs)
            )
        with trio.move_on_after(timeout_s):
            await self.supervisor.wait_idle()
        if self.supervisor.runs:
            log.warning("drain: cancelling %d run(s) still going", len(self.supervisor.runs))
            self.supervisor.cancel_all(CancelReason.SHUTDOWN)
            with trio.move_on_after(CANCEL_SEND_TIMEOUT_S * 2):
                await self.supervisor.wait_idle()
        for conn in list(self.registry.nodes.values()):
            conn.close(CLOSE_GOING_AWAY, "edge shutting down")


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


def node_credentials(link: LinkSettings) -> NodeCredentials:
    """The node credentials ``link`` configures: its shared tokens and its
    ``[[link.nodes]]`` (``iop.protocol._credentials``)."""
    return NodeCredentials(
        shared=link.node_tokens,
        nodes=((n.name, n.token_sha256, n.node_ids) for n in link.nodes),
    )
