"""Runs: supervised Trio tasks with exactly one terminal event.

Theory of operation
-------------------
A run is one task in a ``RunSupervisor``'s nursery. The task calls the
adapter's ``execute(spec, sink)`` inside the run's own cancel scope. The
adapter pushes events into ``sink``; the sink checks the event grammar
(``Start``, then output events, then at most one terminal), forwards each event into a
bounded memory channel (``RUN_EVENT_BUFFER``) read by the run's consumer, and
re-arms the run's deadline:

* before the first output, the deadline is ``start + first_token_timeout``;
* after it, ``last output + idle_timeout`` (moved at most every
  ``REARM_GRANULARITY_S``, so it may fire up to that much early);
* while the sink is blocked because the *consumer* is slow, only the total
  deadline applies: a slow reader is backpressure, not an idle backend;
* ``start + request_timeout`` caps all of them.

A run started with ``write_stall_timeout_s`` (the edge's runs, whose consumer
writes to an HTTP client) also bounds each wait of a blocked sink: a consumer
that takes no event for that long cancels the run with ``slow_client``, so a
client that stopped reading cannot hold the run, and its node slot, until the
total deadline (or forever, when there is none). The node does not use it:
its consumer is the credit-limited link, whose stalls are the edge's
backpressure and end when the edge's own run does.

Whatever ends the adapter, the run task produces the terminal event itself if
the adapter did not:

=================================  =============================================
adapter returned after a terminal  nothing more (the adapter's event stands)
adapter returned without one       ``Error`` (an adapter bug, code internal_error)
adapter raised ``RunAborted``      ``Cancelled`` with the error's reason
adapter raised ``IopError``        ``Error`` with the error's message/status/code
adapter raised anything else       ``Error`` (logged with traceback)
run cancelled (``Run.cancel``)     ``Cancelled`` with the caller's reason
a deadline expired                 ``Cancelled`` with the phase's timeout reason
the consumer stalled (edge)        ``Cancelled(SLOW_CLIENT)``
adapter raised while cancelled     ``Cancelled`` as above: the cancel wins, the
                                   error is logged (bare, or a group
                                   ``[Cancelled, SomeError]`` from a nursery)
the supervisor is shutting down    ``Cancelled(SHUTDOWN)``, delivered from a
                                   shielded scope, then ``Cancelled`` re-raised
=================================  =============================================

The rows are in precedence order from "adapter raised while cancelled" up:
an adapter's own terminal event always stands. Why the cancel wins over an
error raised during cancellation: the cancel is the cause and the error a
consequence of tearing the adapter down; reporting the error would turn a
client disconnect or a deadline into an internal error. Errors are handled
*outside* the run's cancel scope (``except*``): the scope strips the
``Cancelled`` from such a group and the rest must not escape the run task, or
it would take the supervisor's nursery, and every other run, down with it.

What a ``Cancelled`` run used (``Cancelled.usage``, always ``estimated``;
what the edge charges its tenant, docs/operations.md "Tenants and
limits"): its output, one token per streamed chunk, and its prompt once the
backend has read it. The backend has read the prompt when the run had its
first output (``Delta``, ``ReasoningDelta``, ``EmbeddingData`` or
``TokenCount``: the moment ``Run.first_output_at`` is set, which also
forbids failover): the backend answered, so the prompt was read and
prefilled, and no cancel after that takes it back. A run cancelled before
(queued, or waiting on the backend's first byte) used no prompt:

==================================  ===========================================
cancelled before the first output   no tokens
cancelled after it                  ``input_tokens``: the prompt's count the
                                    run's producer reported (a remote run's
                                    ``Cancelled``), else ``Run.prompt_tokens``
                                    (the starter's figure: the edge's
                                    admission estimate); ``output_tokens``:
                                    the chunks streamed
==================================  ===========================================

That holds for every ``Cancelled`` the run ends with: the runtime's own
(each ``Cancelled`` row of the first table) and one an adapter sends (the
edge's link executor passes on the node's, whose run does not know the
prompt's figure). Its prompt is counted once the first output reached this
run: at the edge, a node's output still on the link when the client left
does not count.

Cancelling the run's scope is what closes the adapter's upstream response:
httpx closes the TCP connection when its stream context exits, and that is
what makes vLLM or llama.cpp abort the generation.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Final, Protocol, cast

import msgspec
import trio

from iop.config import Deadlines
from iop.errors import ErrorCode, InvariantError, IopError, RunAborted
from iop.events import (
    Cancelled,
    CancelReason,
    Complete,
    Delta,
    EmbeddingData,
    Error,
    ReasoningDelta,
    RuntimeEvent,
    Start,
    TerminalEvent,
    TokenCount,
    Usage,
    is_terminal,
)
from iop.runtime._channel import OneToOneChannel
from iop.spec import ExecutionSpec
from iop.timeline import Stall, StallKind, Timeline, set_current_timeline

__all__ = [
    "RUN_EVENT_BUFFER",
    "EventSender",
    "Executor",
    "Outlet",
    "Run",
    "RunEvents",
    "RunSink",
    "RunState",
    "RunSupervisor",
    "collect_run",
    "open_run_supervisor",
]

log = logging.getLogger("iop.run")

# Small and bounded: with adaptive coalescing downstream, 8-16 was the fastest
# capacity in the trio-stack spike (docs/benchmarks.md, "Earlier measurements:
# The trio-stack spike"), and it caps the memory a run can
# hold whatever the backend's speed. A full channel blocks the adapter, which
# stops reading its socket: end-to-end backpressure.
RUN_EVENT_BUFFER: Final = 16

# A phase deadline that would move later by less than this is left where it
# is: a stream's idle deadline then moves about once per this interval, not
# on every token, and fires at most this much early.
REARM_GRANULARITY_S: Final = 0.05

# How long the terminal event of a run cancelled by shutdown may take to reach
# its consumer. Shielded, so it must be short.
SHUTDOWN_DELIVERY_GRACE_S: Final = 1.0
# How long a consumer that stopped reading may keep a finished run's task
# alive. After that the event is dropped (``Run.outcome`` still holds it) so a
# stuck consumer cannot pin the run task forever.
TERMINAL_DELIVERY_TIMEOUT_S: Final = 30.0

_OUTPUT_TYPES: Final = frozenset({Delta, ReasoningDelta, EmbeddingData, TokenCount})


class EventSender(Protocol):
    """Where an adapter pushes a run's events (a bounded channel underneath)."""

    async def send(self, event: RuntimeEvent) -> None: ...


class RunSink(EventSender, Protocol):
    """The sender the runtime hands to executors; it also knows a cancel's reason."""

    @property
    def cancel_reason(self) -> CancelReason: ...

    def queued(self) -> contextlib.AbstractContextManager[None]: ...

    @property
    def timeline(self) -> Timeline:
        """The run's timeline, for the executor's part of it."""
        ...

    def push_nowait(self, event: RuntimeEvent) -> None:
        """``send`` for a producer that must never wait (the edge's link reader).

        The run's consumer channel must have room: its producer's credit
        guarantees it (``start_run(buffer=...)``).
        """
        ...

    def on_consumed(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(n)`` as the consumer takes non-terminal events (``n`` at a time:
        half the ``stall_at`` window, when credit is due)."""
        ...

    @property
    def unread(self) -> int:
        """Non-terminal events pushed with ``push_nowait`` the consumer did not take yet."""
        ...

    async def wait_unread_below(self, limit: int) -> None:
        """Wait until fewer than ``limit`` events are unread (for a producer
        without credit: the edge's link reader with per-run credit off)."""
        ...


class Outlet(Protocol):
    """Where a run's events go when its consumer is not a memory channel.

    ``trio.MemorySendChannel`` is one; the node's link is another (each
    event is queued in the link session, the producer waits while the run's
    backlog is full).
    """

    def send_nowait(self, event: RuntimeEvent) -> None:
        """Raises ``trio.WouldBlock`` when full, ``trio.BrokenResourceError`` when gone."""
        ...

    async def send(self, event: RuntimeEvent) -> None: ...

    def close(self) -> None: ...


class RunEvents:
    """The consumer's end of a run: its events, in order, ending after the terminal.

    A memory channel's receiving end (``OneToOneChannel``) that also tells the
    run what was taken, so a remote producer's credit comes back as the
    consumer reads (``RunSink.on_consumed``) and a consumer that stalls is
    noticed.
    """

    __slots__ = ("_channel", "_taken")

    def __init__(self, channel: OneToOneChannel[RuntimeEvent]) -> None:
        self._channel = channel
        self._taken: Callable[[RuntimeEvent], None] | None = None

    async def receive(self) -> RuntimeEvent:
        ev = await self._channel.receive()
        if self._taken is not None:
            self._taken(ev)
        return ev

    def receive_nowait(self) -> RuntimeEvent:
        ev = self._channel.receive_nowait()
        if self._taken is not None:
            self._taken(ev)
        return ev

    def interrupt_receive(self) -> bool:
        """Wake a ``receive`` that waits for an event: it raises
        ``trio.WouldBlock`` (``OneToOneChannel.interrupt_receive``)."""
        return self._channel.interrupt_receive()

    def close(self) -> None:
        self._channel.close_receive()

    async def aclose(self) -> None:
        self._channel.close_receive()
        await trio.lowlevel.checkpoint()

    def statistics(self) -> trio.MemoryChannelStatistics:
        return self._channel.statistics()

    def __aiter__(self) -> RunEvents:
        return self

    async def __anext__(self) -> RuntimeEvent:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> RunEvents:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class Executor(Protocol):
    """The part of an adapter the runtime needs (adapters take any EventSender)."""

    async def execute(self, spec: ExecutionSpec, send: RunSink) -> None: ...


class RunState(enum.Enum):
    """Life of a run; transitions happen only in ``_RunSink`` and ``_drive``."""

    PENDING = "pending"  # created, adapter not called yet
    STARTED = "started"  # adapter emitted Start
    STREAMING = "streaming"  # first output seen
    DONE = "done"  # terminal event produced


class _Phase(enum.Enum):
    FIRST_TOKEN = CancelReason.FIRST_TOKEN_TIMEOUT
    IDLE = CancelReason.IDLE_TIMEOUT
    TOTAL = CancelReason.TOTAL_TIMEOUT
    # The consumer holds a full window and takes nothing (push_nowait runs).
    STALLED = CancelReason.SLOW_CLIENT


def _after(t: float, delay: float | None) -> float:
    return math.inf if delay is None else t + delay


class Run:
    """Handle of one run: its events, its cancellation, its outcome.

    Attributes:
        spec: What is being run.
        events: Receive side of the run's bounded event channel. It ends
            (``EndOfChannel``) right after the terminal event.
        prompt_tokens: The prompt's tokens a cancel after the first output
            charges (the module docstring, "What a ``Cancelled`` run used").
    """

    # Slots: an edge or a node holds one per open stream.
    __slots__ = (
        "_cancel_message",
        "_cancel_reason",
        "_done",
        "_events",
        "_scope",
        "_settled",
        "deadlines",
        "first_output_at",
        "on_outcome",
        "outcome",
        "prompt_tokens",
        "spec",
        "started_at",
        "state",
        "timeline",
        "write_stall_timeout_s",
    )

    def __init__(
        self,
        spec: ExecutionSpec,
        deadlines: Deadlines,
        events: RunEvents | None,
        *,
        write_stall_timeout_s: float | None = None,
        prompt_tokens: int = 0,
    ) -> None:
        self.spec = spec
        self.deadlines = deadlines
        self.write_stall_timeout_s = write_stall_timeout_s
        # What the prompt counts if the run is cancelled after its first
        # output (the module docstring's second table).
        self.prompt_tokens = prompt_tokens
        self._events = events
        self.state = RunState.PENDING
        self.outcome: TerminalEvent | None = None
        self.started_at = trio.current_time()
        self.first_output_at: float | None = None
        self._scope = trio.CancelScope()
        self._cancel_reason: CancelReason | None = None
        self._cancel_message = ""
        self._settled = False
        # Made by the first ``wait`` (few runs are waited for this way).
        self._done: trio.Event | None = None
        # What happened to the run and when (iop.timeline).
        self.timeline = Timeline(
            run_id=spec.run_id,
            model=spec.model,
            operation=spec.operation,
            received=self.started_at,
            received_unix=time.time(),
        )
        # Called once with the outcome, as soon as it is decided (before the
        # consumer has it), in the run's task: it must neither block nor raise.
        self.on_outcome: Callable[[TerminalEvent], None] | None = None

    @property
    def run_id(self) -> str:
        return self.spec.run_id

    def _decided(self, outcome: TerminalEvent) -> None:
        """The run's outcome is ``outcome``: it is DONE (the consumer may not have it yet).

        Its usage is ``Usage.bounded``: what a backend (or a node) reports is
        counted by ``on_outcome`` (metrics, ledger, limits), which a negative
        or absurd count must not break.
        """
        if isinstance(outcome, Complete | Cancelled):
            usage = outcome.usage.bounded()
            if usage is not outcome.usage:
                outcome = msgspec.structs.replace(outcome, usage=usage)
        self.state = RunState.DONE
        self.outcome = outcome
        self.timeline.end(trio.current_time(), outcome)
        if self.on_outcome is not None:
            self.on_outcome(outcome)

    @property
    def events(self) -> RunEvents:
        """The run's events (not for a run started with an ``outlet``)."""
        if self._events is None:
            raise InvariantError(f"run {self.run_id} delivers to an outlet, not to run.events")
        return self._events

    def cancel(self, reason: CancelReason, message: str = "") -> None:
        """Cancel the run. The first reason given wins; a finished run ignores it."""
        if self.state is RunState.DONE or self._cancel_reason is not None:
            return
        self._cancel_reason = reason
        self._cancel_message = message
        self.timeline.cancel(trio.current_time(), reason)
        self._scope.cancel()

    async def wait(self) -> TerminalEvent:
        """Wait until the run's terminal event is decided, and return it.

        This does not wait for the consumer to have read it."""
        if self._settled:
            await trio.lowlevel.checkpoint()
        else:
            if self._done is None:
                self._done = trio.Event()
            await self._done.wait()
        assert self.outcome is not None
        return self.outcome

    def _settle(self) -> None:
        """The terminal event is decided: ``wait`` returns."""
        self._settled = True
        if self._done is not None:
            self._done.set()


class _RunSink:
    """The ``EventSender`` handed to an adapter: checks grammar, arms deadlines."""

    __slots__ = (
        "_consumed",
        "_first_token_from",
        "_held",
        "_phase",
        "_report_every",
        "_room",
        "_run",
        "_send",
        "_stall",
        "_stall_at",
        "_stalled",
        "_unreported",
        "output_chunks",
        "pending_terminal",
        "total_deadline",
    )

    def __init__(self, run: Run, send: Outlet, *, stall_at: int | None = None) -> None:
        self._run = run
        self._send = send
        self._phase = _Phase.FIRST_TOKEN
        self.output_chunks = 0
        self.pending_terminal: TerminalEvent | None = None
        self.total_deadline = _after(run.started_at, run.deadlines.request_timeout_s)
        self._first_token_from = run.started_at
        # push_nowait's consumer: events it holds, and at how many it counts
        # as stalled (its producer is out of credit).
        self._stall_at = stall_at
        self._stalled = False
        self._stall: Stall | None = None  # the timeline's record of the current one
        self._held = 0
        self._consumed: Callable[[int], None] | None = None
        # Taken events not yet reported to ``on_consumed``'s callback: it is
        # told half a window at a time (when credit goes back), not per event.
        self._unreported = 0
        self._report_every = max(1, (stall_at or 2) // 2)
        self._room: trio.Event | None = None  # set when the consumer takes an event
        self._arm(_after(run.started_at, run.deadlines.first_token_timeout_s), _Phase.FIRST_TOKEN)
        if run._events is not None and stall_at is not None:
            run._events._taken = self._taken

    @property
    def timeline(self) -> Timeline:
        return self._run.timeline

    @property
    def phase_reason(self) -> CancelReason:
        return self._phase.value

    @property
    def cancel_reason(self) -> CancelReason:
        """Why the run is being cancelled: the caller's reason, else the deadline's."""
        return self._run._cancel_reason or self._phase.value

    @contextlib.contextmanager
    def queued(self) -> Iterator[None]:
        """Wrap a wait for capacity: the first-token deadline stops meanwhile
        and restarts when the wait ends. Queueing is not the backend's
        latency; the queue has its own timeout and the total deadline still
        counts from the run's start."""
        run = self._run
        if run.state not in (RunState.PENDING, RunState.STARTED):
            yield
            return
        run._scope.deadline = self.total_deadline
        self._phase = _Phase.TOTAL
        try:
            yield
        finally:
            self._first_token_from = trio.current_time()
            first = _after(self._first_token_from, run.deadlines.first_token_timeout_s)
            self._arm(first, _Phase.FIRST_TOKEN)

    def _arm(self, phase_deadline: float, phase: _Phase) -> None:
        if phase_deadline < self.total_deadline:
            scope = self._run._scope
            if (
                phase is self._phase
                and 0.0 <= phase_deadline - scope.deadline < REARM_GRANULARITY_S
            ):
                # The idle deadline of a stream moves with every token; moving
                # it by less than this is not worth trio's deadline bookkeeping.
                return
            self._phase = phase
            scope.deadline = phase_deadline
        else:
            self._phase = _Phase.TOTAL
            self._run._scope.deadline = self.total_deadline

    def _admit(self, event: RuntimeEvent) -> RuntimeEvent:
        """Check ``event`` against the grammar and move the run's state; the
        event to forward (a ``Cancelled`` with the prompt it used)."""
        run = self._run
        state = run.state
        if state is RunState.DONE or self.pending_terminal is not None:
            raise InvariantError(f"run {run.run_id}: event {type(event).__name__} after terminal")
        # Exact types, not isinstance: the event types have no subclasses,
        # and isinstance against a msgspec Struct class is several times
        # slower (``iop.events.is_terminal``); this runs once per event.
        kind = type(event)
        if kind is Start:
            if state is not RunState.PENDING:
                raise InvariantError(f"run {run.run_id}: second start event")
            run.state = RunState.STARTED
        elif state is RunState.PENDING and kind is not Error:
            raise InvariantError(f"run {run.run_id}: {type(event).__name__} before start")
        elif kind in _OUTPUT_TYPES:
            if kind is Delta or kind is ReasoningDelta:
                self.output_chunks += 1  # about one token each (partial usage)
            if state is RunState.STARTED:
                run.state = RunState.STREAMING
                run.first_output_at = run.timeline.first_output = trio.current_time()
        else:  # terminal: the run is DONE only once the consumer has it
            if kind is Cancelled:
                event = self._with_prompt(cast(Cancelled, event))
            self.pending_terminal = cast(TerminalEvent, event)
        return event

    def _with_prompt(self, cancelled: Cancelled) -> Cancelled:
        """``cancelled`` charged the prompt, if the run had output and its
        producer did not count the prompt itself."""
        prompt = self._run.prompt_tokens
        if self._run.first_output_at is None or cancelled.usage.input_tokens or not prompt:
            return cancelled
        usage = msgspec.structs.replace(cancelled.usage, input_tokens=prompt, estimated=True)
        return msgspec.structs.replace(cancelled, usage=usage)

    def _sent(self) -> None:
        """The event reached the consumer's side: re-arm the phase's deadline."""
        run = self._run
        if self.pending_terminal is not None:
            run._decided(self.pending_terminal)
        elif run.state is RunState.STREAMING:
            self._arm(_after(trio.current_time(), run.deadlines.idle_timeout_s), _Phase.IDLE)
        elif run.state is RunState.STARTED:
            first = _after(self._first_token_from, run.deadlines.first_token_timeout_s)
            self._arm(first, _Phase.FIRST_TOKEN)

    async def send(self, event: RuntimeEvent) -> None:
        run = self._run
        event = self._admit(event)
        try:
            # Still a cancellation point, but no schedule point while the
            # channel has room: the producer keeps going and the consumer
            # wakes to a batch it can coalesce into one write or one frame.
            # (``send`` would yield on every event: one write per token.)
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                self._send.send_nowait(event)
            except trio.WouldBlock:
                # Blocked on a slow consumer: only the total deadline applies,
                # and the write-stall bound when the run has one.
                run._scope.deadline = self.total_deadline
                self._phase = _Phase.TOTAL
                stall = run.write_stall_timeout_s
                record = run.timeline.stall_began(StallKind.CREDIT, trio.current_time())
                with trio.move_on_after(math.inf if stall is None else stall) as waited:
                    await self._send.send(event)
                if record is not None:
                    record.end = trio.current_time()
                if waited.cancelled_caught:
                    run.cancel(
                        CancelReason.SLOW_CLIENT,
                        f"the client accepted no data for write_stall_timeout_s={stall:g}",
                    )
                    await trio.lowlevel.checkpoint()  # raises Cancelled: the run scope is cancelled
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            if self.pending_terminal is None:
                # The consumer went away without cancelling the run (or just
                # before doing so): nobody reads this run any more.
                run.cancel(CancelReason.CLIENT_DISCONNECT, "the run's consumer went away")
                await trio.lowlevel.checkpoint()  # raises Cancelled: the run scope is cancelled
                raise
        self._sent()

    def push_nowait(self, event: RuntimeEvent) -> None:
        run = self._run
        event = self._admit(event)
        try:
            self._send.send_nowait(event)
        except trio.WouldBlock:
            raise InvariantError(
                f"run {run.run_id}: the consumer's channel is full (its producer "
                "sent more than its credit)"
            ) from None
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            if self.pending_terminal is None:
                run.cancel(CancelReason.CLIENT_DISCONNECT, "the run's consumer went away")
            return
        self._sent()
        if is_terminal(event):
            return
        self._held += 1
        # Out of credit: everything the producer was given is either unread
        # or read but not yet reported back (credit goes back half a window
        # at a time).
        if (
            not self._stalled
            and self._stall_at is not None
            and self._held + self._unreported >= self._stall_at
        ):
            self._stalled = True
            now = trio.current_time()
            self._stall = run.timeline.stall_began(StallKind.CREDIT, now, self._stall_at)
            # The consumer holds a whole window: the producer is out of
            # credit. Backpressure, not an idle backend: only the total
            # deadline and the write-stall bound apply until it reads.
            stall = run.write_stall_timeout_s
            self._arm(_after(now, stall), _Phase.STALLED)

    def on_consumed(self, callback: Callable[[int], None]) -> None:
        self._consumed = callback
        self._unreported = 0  # a new attempt: what was taken before was the old one's

    @property
    def unread(self) -> int:
        return self._held

    async def wait_unread_below(self, limit: int) -> None:
        while self._held >= limit:
            self._room = room = trio.Event()
            await room.wait()

    def _taken(self, event: RuntimeEvent) -> None:
        """The consumer took ``event`` (``RunEvents`` calls this)."""
        if is_terminal(event):
            return
        self._held -= 1
        room = self._room
        if room is not None:
            self._room = None
            room.set()
        self._unreported += 1
        reported = False
        if self._unreported >= self._report_every and self._consumed is not None:
            self._consumed(self._unreported)
            self._unreported = 0
            reported = True
        if self._stalled and self.pending_terminal is None:
            run = self._run
            now = trio.current_time()
            if reported:
                # Credit went back: the producer may send again.
                self._stalled = False
                if self._stall is not None:
                    self._stall.end, self._stall = now, None
                self._arm(_after(now, run.deadlines.idle_timeout_s), _Phase.IDLE)
            else:
                # Reading, but not yet a half window: still only the stall bound.
                self._arm(_after(now, run.write_stall_timeout_s), _Phase.STALLED)

    def partial_usage(self) -> Usage:
        """What the run used so far (the module docstring, "What a
        ``Cancelled`` run used")."""
        run = self._run
        read = run.first_output_at is not None
        return Usage(
            input_tokens=run.prompt_tokens if read else 0,
            output_tokens=self.output_chunks,
            estimated=True,
        )


def _error_from(exc: BaseException) -> Error:
    leaf = exc
    while isinstance(leaf, BaseExceptionGroup) and leaf.exceptions:
        found = next((e for e in leaf.exceptions if isinstance(e, IopError)), None)
        leaf = found if found is not None else leaf.exceptions[0]
    if isinstance(leaf, IopError):
        return Error(message=leaf.message, status=leaf.status, code=leaf.code, param=leaf.param)
    return Error(
        message=f"internal error: {type(leaf).__name__}", status=500, code=ErrorCode.INTERNAL_ERROR
    )


async def _drive(
    run: Run,
    executor: Executor,
    send: Outlet,
    logger: logging.Logger = log,
    *,
    stall_at: int | None = None,
) -> None:
    """Execute one run to its single terminal event. Never raises (but Cancelled)."""
    sink = _RunSink(run, send, stall_at=stall_at)
    set_current_timeline(run.timeline)  # this task is the run's (iop.timeline.current_timeline)
    terminal: TerminalEvent | None = None
    aborted: Cancelled | None = None
    failure: BaseException | None = None
    finished_normally = False
    try:
        try:
            with run._scope:
                try:
                    await executor.execute(run.spec, sink)
                except RunAborted as exc:
                    aborted = Cancelled(
                        reason=exc.reason,
                        message=exc.message,
                        usage=sink.partial_usage(),
                    )
                except Exception as exc:
                    failure = exc
        except* Exception as group:
            # What the run's scope left of a group [Cancelled, SomeError]: the
            # adapter (or a task of its nursery) raised while it was being
            # cancelled. Handled here, outside the scope, so that it never
            # reaches the supervisor's nursery and its other runs. A Cancelled
            # from outside (shutdown) in the same group is re-raised by
            # ``except*`` itself, after this handler.
            failure = group
        terminal = _decide(run, sink, aborted, failure)
        finished_normally = True
    finally:
        if not finished_normally and run.state is not RunState.DONE and terminal is None:
            # Cancelled from outside (supervisor shutdown) or a BaseException:
            # still give the consumer its one terminal event, then let it go.
            if failure is not None:
                log.warning("run %s: adapter raised during shutdown: %r", run.run_id, failure)
            terminal = sink.pending_terminal or Cancelled(
                reason=CancelReason.SHUTDOWN,
                message="the server is shutting down",
                usage=sink.partial_usage(),
            )
        if terminal is not None:
            run._decided(terminal)
            run._settle()  # delivery below may still wait on the consumer
            grace = TERMINAL_DELIVERY_TIMEOUT_S if finished_normally else SHUTDOWN_DELIVERY_GRACE_S
            with trio.move_on_after(grace, shield=not finished_normally) as delivery:
                # BrokenResourceError: nobody is listening any more.
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await send.send(terminal)
            if delivery.cancelled_caught:
                log.warning("run %s: consumer did not take the terminal event", run.run_id)
        run._settle()
        send.close()
        _log_outcome(run, logger)


def _decide(
    run: Run, sink: _RunSink, aborted: Cancelled | None, failure: BaseException | None
) -> TerminalEvent | None:
    """The run's terminal event once ``execute`` is over (None: already delivered).

    Precedence, as in the module's table: the adapter's own terminal, then a
    ``RunAborted``, then the cancel (caller's reason or deadline) over any
    error raised while being cancelled, then the error, then "returned
    without a terminal".
    """
    if run.state is RunState.DONE or sink.pending_terminal is not None:
        if failure is not None:
            log.warning("run %s: adapter raised after its terminal event: %r", run.run_id, failure)
        # A terminal cut off while the consumer was slow is still the outcome.
        return None if run.state is RunState.DONE else sink.pending_terminal
    if aborted is not None:
        return aborted
    if run._scope.cancel_called:
        # The cancel is the cause; an error from the adapter's cleanup is a
        # consequence. Reporting it instead would turn a client disconnect
        # or a deadline into an internal error.
        if failure is not None:
            log.warning(
                "run %s: adapter raised while being cancelled: %r",
                run.run_id,
                failure,
                exc_info=None if isinstance(failure, IopError) else failure,
            )
        reason = run._cancel_reason or sink.phase_reason
        # A deadline's cancel: when it was due (a caller's cancel is recorded already).
        run.timeline.cancel(min(trio.current_time(), run._scope.deadline), reason)
        message = run._cancel_message or _default_cancel_message(reason, run)
        return Cancelled(reason=reason, message=message, usage=sink.partial_usage())
    if failure is not None:
        if not isinstance(failure, IopError):
            log.error("run %s: adapter crashed", run.run_id, exc_info=failure)
        return _error_from(failure)
    return Error(
        message="adapter returned without a terminal event",
        status=500,
        code=ErrorCode.INTERNAL_ERROR,
    )


_CANCEL_MESSAGES: Final = {
    CancelReason.CLIENT_DISCONNECT: "the client disconnected",
    CancelReason.NODE_LOST: "the node running this request was lost",
    CancelReason.QUEUE_TIMEOUT: "no capacity became free in time",
    CancelReason.EXPLICIT: "the request was cancelled",
    CancelReason.SHUTDOWN: "the server is shutting down",
    CancelReason.SLOW_CLIENT: "the client stopped reading its response",
}


def _default_cancel_message(reason: CancelReason, run: Run) -> str:
    d = run.deadlines
    if reason is CancelReason.SLOW_CLIENT and run.write_stall_timeout_s is not None:
        return (
            f"the client accepted no data for write_stall_timeout_s={run.write_stall_timeout_s:g}"
        )
    if reason is CancelReason.FIRST_TOKEN_TIMEOUT:
        return f"no output within first_token_timeout_s={d.first_token_timeout_s}"
    if reason is CancelReason.IDLE_TIMEOUT:
        return f"backend silent for idle_timeout_s={d.idle_timeout_s}"
    if reason is CancelReason.TOTAL_TIMEOUT:
        return f"run exceeded request_timeout_s={d.request_timeout_s}"
    return _CANCEL_MESSAGES[reason]


def _log_outcome(run: Run, log: logging.Logger) -> None:
    o = run.outcome
    now = trio.current_time()
    ttft = "-" if run.first_output_at is None else f"{run.first_output_at - run.started_at:.3f}"
    if isinstance(o, Complete):
        log.info(
            "run %s complete finish=%s out_tokens=%d ttft_s=%s dur_s=%.3f",
            run.run_id,
            o.finish_reason,
            o.usage.output_tokens,
            ttft,
            now - run.started_at,
        )
    elif isinstance(o, Cancelled):
        log.info("run %s cancelled reason=%s ttft_s=%s", run.run_id, o.reason, ttft)
    elif isinstance(o, Error):
        log.info("run %s error status=%d code=%s: %s", run.run_id, o.status, o.code, o.message)


class RunSupervisor:
    """Owns the nursery every run of a process lives in.

    Use ``open_run_supervisor()``; runs still going when it closes are
    cancelled with ``CancelReason.SHUTDOWN`` and still get their terminal event.
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        *,
        on_finished: Callable[[Run], None] | None = None,
        logger: str = "iop.run",
    ) -> None:
        self._nursery = nursery
        self._log = logging.getLogger(logger)
        self._on_finished = on_finished
        self.runs: dict[str, Run] = {}
        self._idle = trio.Event()
        self._idle.set()

    def start_run(
        self,
        executor: Executor,
        spec: ExecutionSpec,
        deadlines: Deadlines,
        *,
        buffer: int = RUN_EVENT_BUFFER,
        write_stall_timeout_s: float | None = None,
        outlet: Outlet | None = None,
        stall_at: int | None = None,
        prompt_tokens: int = 0,
    ) -> Run:
        """Start a run as a task of the supervisor's nursery and return its handle.

        Args:
            buffer: Capacity of the run's event channel (``run.events``).
            write_stall_timeout_s: Longest wait of the run's sink on a consumer
                that takes nothing; then the run is cancelled with
                ``slow_client``. None: no bound (the total deadline applies).
            outlet: Deliver the events there instead of to ``run.events``.
            stall_at: For a producer that uses ``push_nowait`` (and so never
                waits): with this many events unread the consumer counts as
                stalled (only the total deadline and ``write_stall_timeout_s``
                apply until it reads).
            prompt_tokens: What the prompt counts in the usage of a run
                cancelled after its first output (``Run.prompt_tokens``).
        """
        if spec.run_id in self.runs:
            raise InvariantError(f"run id {spec.run_id} is already running")
        events: RunEvents | None = None
        if outlet is None:
            channel = OneToOneChannel[RuntimeEvent](buffer)
            outlet, events = channel, RunEvents(channel)
        run = Run(
            spec,
            deadlines,
            events,
            write_stall_timeout_s=write_stall_timeout_s,
            prompt_tokens=prompt_tokens,
        )
        self.runs[spec.run_id] = run
        if self._idle.is_set():
            self._idle = trio.Event()
        self._nursery.start_soon(
            self._supervise, run, executor, outlet, stall_at, name=f"run:{spec.run_id}"
        )
        return run

    async def _supervise(
        self, run: Run, executor: Executor, send: Outlet, stall_at: int | None
    ) -> None:
        try:
            await _drive(run, executor, send, self._log, stall_at=stall_at)
        finally:
            self.runs.pop(run.run_id, None)
            if not self.runs:
                self._idle.set()
            if self._on_finished is not None:
                self._on_finished(run)

    async def wait_idle(self) -> None:
        """Wait until no run is in flight."""
        while self.runs:
            await self._idle.wait()

    def cancel_all(self, reason: CancelReason) -> None:
        for run in list(self.runs.values()):
            run.cancel(reason)


@asynccontextmanager
async def open_run_supervisor(
    *, on_finished: Callable[[Run], None] | None = None, logger: str = "iop.run"
) -> AsyncIterator[RunSupervisor]:
    """Open a supervisor; on exit, wait for its runs (cancel them first if leaving by error).

    Args:
        on_finished: Called (synchronously) with each run once it has ended.
        logger: Logger of the one line each run logs when it ends.
    """
    async with trio.open_nursery() as nursery:
        yield RunSupervisor(nursery, on_finished=on_finished, logger=logger)


async def collect_run(
    executor: Executor,
    spec: ExecutionSpec,
    deadlines: Deadlines | None = None,
) -> list[RuntimeEvent]:
    """Run to completion and return every event (for tools, tests and the CLI)."""
    events: list[RuntimeEvent] = []
    async with open_run_supervisor() as sup:
        run = sup.start_run(executor, spec, deadlines or Deadlines())
        async with run.events:
            async for ev in run.events:
                events.append(ev)
    return events


def new_run_id() -> str:
    """A fresh run id: 32 hex chars, like vLLM's completion ids."""
    return uuid.uuid4().hex
