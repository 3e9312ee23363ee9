"""The failover executor: one run on whichever node the scheduler picks.

An edge run is an ordinary ``iop.runtime`` run whose executor is remote:
``RemoteExecutor.execute`` asks the scheduler for a slot, queues ``Assign``
on the chosen node's link session, and waits. The node's events do not pass
through it: the link reader delivers each run's events straight into the
run's consumer channel (``RemoteRun.deliver`` → ``RunSink.push_nowait``,
which checks the event grammar and arms the run's deadlines; credit keeps
the channel, ``run_window + 2`` events, from ever filling), and the
consumer's reads return the credit (``iop.edge.runs._delivery`` has the
research mode without credit). So the edge gets the runtime's guarantees
for free: one terminal event per run, the wait timeouts (first token, idle,
total) as typed cancel reasons, and cancellation as structured scope
cancellation.

::

    HTTP handler ──start_run──► RunSupervisor task: RemoteExecutor.execute
                                   │ scheduler.acquire ─► Lease(node, instance)
                                   │ session.assign ──► link writer ──► node
                                   │ waits on RemoteRun.ended
    node ──► link reader ──► EdgeSession.receive ──► RemoteRun.deliver
                                   │ push_nowait ──► run.events ──► HTTP handler
                                   │ each event taken ──► session.consumed ──► Credit

When the edge run ends early (client gone, wait timeout, shutdown), the
executor's ``finally`` queues ``Cancel`` (nothing to wait for: the writer
sends it with the next frame); the node cancels its run and closing the
backend response makes the backend stop. How each attempt ended
(``AttemptEnd``, ``iop.edge.runs._attempt``) decides what comes next: an
attempt the node refused, or whose link died, before any output is retried
on another node, and one whose backend failed before any output on another
instance (failover, up to ``MAX_ATTEMPTS`` in all); one whose link died
after output ends the run with ``Cancelled(node_lost)``. Output is what the
node sent (``iop.edge.runs._attempt``): the surface's opening (SSE head,
``response.created``, ``message_start``) and keep-alives are the edge's own,
so a stream that sent them still fails over, and its client sees one
opening and the answer of the attempt that succeeded.

A sheddable run's attempt that has sent no output yet may be preempted by
the scheduler for a run of a higher objective priority
(``iop.edge.scheduler._scheduler``): it ends ``PREEMPTED``, its node gets
``Cancel`` (``explicit``), and the run is placed again, which costs no
failover attempt. The node may still be ending the preempted attempt, so
each later attempt goes on the link under an id of its own (``run_id~N``,
N the preemptions so far; the node keys every frame by it, the client's
answer keeps the run's id).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Final, Protocol, assert_never

import msgspec
import trio

from iop._secrets import SecretMasker, mask_event
from iop.config import EdgeConfig
from iop.edge.runs._attempt import AttemptEnd, RemoteRun, RunStart
from iop.edge.runs._delivery import DeliveryPolicy
from iop.edge.scheduler import Lease, QueueShare, Scheduler, affinity_key
from iop.errors import ErrorCode, InvariantError, RequestError, RunAborted
from iop.events import Cancelled, CancelReason, Error
from iop.protocol import COLLECT_FLUSH_S
from iop.runtime import RunSink
from iop.spec import ExecutionSpec
from iop.timeline import Placement
from iop.tracing import RunTrace

__all__ = ["MAX_ATTEMPTS", "RemoteExecutor", "RunHost"]

log = logging.getLogger("iop.edge")

# Attempts of one run across nodes (the first try plus failovers).
MAX_ATTEMPTS: Final = 3


class RunHost(Protocol):
    """What an executor reads of the edge (``EdgeCore``), at each run: a
    reload may have replaced any of it."""

    @property
    def config(self) -> EdgeConfig: ...

    @property
    def scheduler(self) -> Scheduler: ...

    @property
    def masker(self) -> SecretMasker: ...

    @property
    def delivery(self) -> DeliveryPolicy: ...


class _Retry(Exception):
    """This attempt failed before any output; try another node."""

    def __init__(
        self,
        node_id: str,
        why: str,
        error: Error | Cancelled | None = None,
        *,
        instance: str | None = None,
    ) -> None:
        super().__init__(why)
        self.node_id = node_id
        self.why = why
        # What the next attempts avoid: the node, or only this instance of
        # it when its backend failed (the node's other instances may serve).
        self.excluded: str | tuple[str, str] = node_id if instance is None else (node_id, instance)
        # What the node ended the attempt with (a refusal, or its queue
        # timeout): the run's outcome when no other node can take it.
        self.error = error


class _Preempted(Exception):
    """This attempt gave its slot to a run of a higher priority before any
    output; place the run again."""


class RemoteExecutor:
    """Executes one run on whichever node the scheduler picks."""

    __slots__ = (  # one per stream
        "_collect",
        "_collect_flush_s",
        "_core",
        "_share",
        "_started",
        "trace",
    )

    def __init__(self, core: RunHost, share: QueueShare, *, collect: bool = False) -> None:
        self._core = core
        # Where the run stands in the queue (``EdgeCore.queue_share``).
        self._share = share
        # The run's spans when the edge traces (iop.tracing): set by
        # ``EdgeCore.start_run`` once the run (and so its timeline) exists,
        # before its task starts.
        self.trace: RunTrace | None = None
        # Nobody reads the events as they come (``Assign.collect``).
        self._collect = collect
        # How long the node may hold them: an eighth of the idle deadline
        # (which then fires at most that much late), at most the node's default.
        idle = core.config.deadlines.idle_timeout_s
        self._collect_flush_s = COLLECT_FLUSH_S if idle is None else min(COLLECT_FLUSH_S, idle / 8)
        # Start reached the run's sink (from the first attempt that sent one);
        # a failover attempt's own Start is then not forwarded again.
        self._started = RunStart()

    async def execute(self, spec: ExecutionSpec, send: RunSink) -> None:
        core = self._core
        model, op = spec.model, spec.operation
        excluded: set[str | tuple[str, str]] = set()
        last: _Retry | None = None
        # A tenant's conversations and prefixes are its own: the run's cache
        # salt scopes them as it scopes the backend's cache (start_run).
        scope = spec.cache_salt
        share = self._share
        affinity = (
            affinity_key(spec.request, scope, session=share.session, tenant=share.tenant)
            if core.config.scheduler.affinity
            else None
        )
        prefix = core.scheduler.prompt_blocks(spec.request, scope)
        attempts = MAX_ATTEMPTS if core.config.scheduler.failover else 1
        attempt = 0  # failed attempts (failovers); preemptions are not counted
        preempted = 0
        while attempt < attempts:
            if last is not None and not core.scheduler.could_serve(model, frozenset(excluded), op):
                break  # no other node to fail over to: report what happened
            first = attempt == 0 and not preempted
            try:
                with send.queued():  # the queue wait is not the node's latency
                    lease = await core.scheduler.acquire(
                        model,
                        exclude=frozenset(excluded),
                        affinity=affinity,
                        operation=op,
                        # A failover's wait shows as the gap between placements.
                        timeline=send.timeline if first else None,
                        prefix=prefix,
                        share=share,
                        preemptions=preempted,
                    )
            except RunAborted:
                if last is not None and last.error is not None:
                    break  # report the node's own error rather than the wait
                raise
            link_id = spec.run_id if not preempted else f"{spec.run_id}~{preempted}"
            try:
                await self._attempt(lease, spec, send, len(send.timeline.placements) + 1, link_id)
                return
            except _Preempted:
                preempted += 1
                continue
            except _Retry as retry:
                attempt += 1
                last = retry
                excluded.add(retry.excluded)
                if attempts == 1:
                    then = ""  # failover is off
                elif attempt == attempts:  # counted already
                    then = f"; {attempts} attempts made, giving up"
                elif core.scheduler.could_serve(model, frozenset(excluded), op):
                    then = "; failing over"
                else:
                    then = "; no other instance serves the model, giving up"
                log.warning(
                    "run %s: attempt %d on node %s instance %s failed before output (%s)%s",
                    spec.run_id,
                    attempt,
                    retry.node_id,
                    lease.instance.caps.instance,
                    retry.why,
                    then,
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

    async def _attempt(
        self, lease: Lease, spec: ExecutionSpec, send: RunSink, number: int, run_id: str
    ) -> None:
        """One attempt on ``lease``'s instance, on the link as ``run_id``."""
        conn, instance = lease.conn, lease.instance.caps.instance
        placement = Placement(
            attempt=number,
            node=conn.node_id,
            instance=instance,
            at=trio.current_time(),
            why=lease.why,
            scores=lease.scores,
            candidates=lease.candidates,
        )
        rr = RemoteRun(run_id, send, self._core.masker, self._started, placement.at)
        ended = False  # the node is done with the run: nothing to cancel
        timeline = send.timeline
        timeline.placements.append(placement)
        # The node's run joins the trace: the attempt's span, or the client's
        # context passed on when the edge does not trace.
        traceparent = (
            self.trace.attempt(conn.node_id, instance, number, placement.at)
            if self.trace is not None
            else timeline.traceparent
        )
        if traceparent != spec.traceparent:
            spec = msgspec.structs.replace(spec, traceparent=traceparent)
        if lease.instance.caps.engine_priority:
            # Its engine schedules by priority: the run's, and whether it is
            # on an overflow seat (docs/operations.md, "Engine priority").
            spec = msgspec.structs.replace(spec, priority=lease.rank, overflow=lease.overflow)
        try:
            try:
                conn.assign(
                    rr,
                    instance,
                    spec,
                    self._core.delivery.credit,
                    collect=self._collect,
                    collect_flush_s=self._collect_flush_s,
                )
            except InvariantError as exc:
                raise _Retry(conn.node_id, "link closed before assign") from exc
            send.on_consumed(partial(conn.consume, run_id))
            lease.preempt = rr.preempt
            await rr.ended.wait()
            end = rr.end
            assert end is not None  # set with ``ended``
            # Every way an attempt ends (``iop.edge.runs._attempt``).
            match end:
                case AttemptEnd.COMPLETED:
                    ended = True
                    placement.result = "ran"
                case AttemptEnd.REFUSED:
                    ended = True
                    placement.result = f"retry: {rr.detail}"
                    raise _Retry(conn.node_id, rr.detail, rr.refusal)
                case AttemptEnd.FAILED:
                    ended = True
                    placement.result = f"retry: {rr.detail}"
                    raise _Retry(conn.node_id, rr.detail, rr.refusal, instance=instance)
                case AttemptEnd.VIOLATION:
                    # The node's run may still go on: cancelled below.
                    placement.result = "ran"
                    log.warning("node %s broke run %s: %s", conn.node_id, run_id, rr.detail)
                    raise RequestError(
                        f"node {conn.node_id} sent an invalid event sequence",
                        status=502,
                        code=ErrorCode.BAD_NODE_EVENTS,
                    )
                case AttemptEnd.LOST:
                    placement.result = f"lost: {rr.detail}"
                    raise _Retry(conn.node_id, rr.detail)
                case AttemptEnd.LOST_AFTER_OUTPUT:
                    placement.result = f"lost: {rr.detail}"
                    raise RunAborted(
                        self._core.masker.mask(rr.detail), reason=CancelReason.NODE_LOST
                    )
                case AttemptEnd.PREEMPTED:
                    # The node's run goes on until the Cancel below reaches it.
                    placement.result = "preempted"
                    raise _Preempted
                case _:
                    assert_never(end)
        finally:
            reason: CancelReason | None = None
            lease.preempt = None
            if not ended:
                reason = send.cancel_reason
                if rr.end is AttemptEnd.PREEMPTED:
                    reason = CancelReason.EXPLICIT
                if reason is CancelReason.SLOW_CLIENT:
                    # Nodes older than slow_client cannot decode it (a link
                    # protocol error would drop every run of the node); for
                    # the node it is a client that went away.
                    reason = CancelReason.CLIENT_DISCONNECT
                if placement.result is None:
                    placement.result = "cancelled"
            cancelled = conn.close_run(run_id, reason)
            # A preemption's Cancel is the edge's, not the run's: the run goes on.
            if cancelled and timeline.cancel_sent is None and rr.end is not AttemptEnd.PREEMPTED:
                timeline.cancel_sent = trio.current_time()
