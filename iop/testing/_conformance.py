"""The adapter conformance kit: the same protocol checks for every adapter.

After ``trio.testing.check_two_way_stream``: the kit knows what a run must
look like, a *harness* knows how to make one adapter produce a given
situation. Every adapter is tested by the same checks.

Theory of operation
-------------------
A ``Scenario`` names a situation (a plain answer, a 5xx, a backend that stalls
mid-stream, a client that goes away...). A ``Harness`` turns a scenario into a
``ScenarioCase``: an adapter wired to a backend that behaves that way, the
``ExecutionSpec`` to run, the run's ``Deadlines``, what the backend will say
(``Expectation``), and ``upstream_closed`` to learn when the backend saw its
connection close. A harness that cannot produce a scenario says why
(``Harness.unsupported``) and the check raises ``ScenarioUnsupported``.

``check_<scenario>(harness)`` runs the case through the real runtime
(``iop.runtime``) and asserts protocol facts only: the event grammar (``Start``
first, exactly one terminal, last), the terminal's kind, status, code and
reason, and what the stream carried. Nothing in a check knows about HTTP, so a
harness for an in-process backend (the ``sim`` adapter) needs no
``FakeBackend``: its ``upstream_closed`` reports when its generator stopped.

The harnesses that ship (``OpenAICompatHarness``, ``VllmHarness``,
``SimHarness``) live in ``iop.testing._harnesses``: this module holds the
scenarios, the checks and the measurements, nothing that starts a backend.

The cancellation check measures the latency from ``Run.cancel`` to the backend
seeing its socket close and appends it to ``CANCEL_LATENCIES`` (also logged on
``iop.testing.conformance``).
"""

from __future__ import annotations

import enum
import json
import logging
import statistics
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Final, Protocol

import msgspec
import trio

from iop.config import Deadlines
from iop.errors import ErrorCode
from iop.events import (
    Cancelled,
    CancelReason,
    Complete,
    Delta,
    Error,
    FinishReason,
    ReasoningDelta,
    RuntimeEvent,
    Start,
    TerminalEvent,
)
from iop.runtime import Executor, collect_run, open_run_supervisor
from iop.spec import ExecutionSpec

__all__ = [
    "CANCEL_LATENCIES",
    "CHECKS",
    "DEADLINE_SLACK_S",
    "MAX_ERROR_MESSAGE_BYTES",
    "PROTOCOL_ERROR_CODES",
    "STALL_DEADLINE_S",
    "UPSTREAM_CLOSE_BOUND_S",
    "CancelLatency",
    "ConformanceError",
    "Expectation",
    "ExpectedToolCall",
    "Harness",
    "LatencySummary",
    "Scenario",
    "ScenarioCase",
    "ScenarioUnsupported",
    "UpstreamClosed",
    "check_backend_4xx",
    "check_backend_5xx",
    "check_cancel_mid_stream",
    "check_connection_refused",
    "check_malformed_chunk",
    "check_malformed_chunk_over_limit",
    "check_missing_done",
    "check_oversize_line",
    "check_plain_stream",
    "check_reasoning",
    "check_scenario",
    "check_stall_before_first_byte",
    "check_stall_mid_stream",
    "check_streamed_tool_calls",
    "check_truncated_stream",
    "latency_summary",
]

log = logging.getLogger("iop.testing.conformance")

# Deadline the harnesses give the stall scenarios: long enough that a loaded
# CI machine still delivers the deltas sent before a stall, short enough that
# the suite stays fast. Real clock: the backend is a real socket.
STALL_DEADLINE_S: Final = 0.25
# How late a deadline may fire and still pass. Generous on purpose: the check
# is about the reason, not about scheduler jitter on a busy machine.
DEADLINE_SLACK_S: Final = 5.0
# Longest accepted time from a run's cancellation to the backend seeing its
# socket close. Measured well under 1 ms on loopback (docs/benchmarks.md,
# "Earlier measurements: The trio-stack spike").
UPSTREAM_CLOSE_BOUND_S: Final = 2.0
# An error message relayed from a backend stays bounded whatever the body's
# size: a 4 KiB excerpt (seed 000/003) plus our prefix.
MAX_ERROR_MESSAGE_BYTES: Final = 4608
# A BackendProtocolError's codes: the class's own and the SSE decoder's
# more specific one for an oversize line.
PROTOCOL_ERROR_CODES: Final = frozenset(
    {ErrorCode.BACKEND_PROTOCOL_ERROR, ErrorCode.SSE_LINE_TOO_LONG}
)
# Deltas the cancellation check reads before cancelling.
CANCEL_AFTER_DELTAS: Final = 2


class Scenario(enum.Enum):
    """A situation every adapter must handle."""

    PLAIN_STREAM = "plain_stream"
    REASONING = "reasoning"
    STREAMED_TOOL_CALLS = "streamed_tool_calls"
    BACKEND_4XX = "backend_4xx"
    BACKEND_5XX = "backend_5xx"
    CONNECTION_REFUSED = "connection_refused"
    STALL_BEFORE_FIRST_BYTE = "stall_before_first_byte"
    STALL_MID_STREAM = "stall_mid_stream"
    # The connection drops mid-body (chunked body never terminated).
    TRUNCATED_STREAM = "truncated_stream"
    # The body ends cleanly but without ``[DONE]``.
    MISSING_DONE = "missing_done"
    MALFORMED_CHUNK = "malformed_chunk"
    # The same malformed chunk with a tolerance of 0.
    MALFORMED_CHUNK_OVER_LIMIT = "malformed_chunk_over_limit"
    OVERSIZE_LINE = "oversize_line"
    CANCEL_MID_STREAM = "cancel_mid_stream"


class ScenarioUnsupported(Exception):
    """The harness cannot produce this scenario (a test should skip with ``reason``)."""

    def __init__(self, harness: str, scenario: Scenario, reason: str) -> None:
        super().__init__(f"{harness}: {scenario.value} unsupported: {reason}")
        self.reason = reason


class ConformanceError(AssertionError):
    """An adapter broke the protocol; the message says which fact."""


class ExpectedToolCall(msgspec.Struct, frozen=True):
    """A tool call the backend streams: its name and its arguments, decoded."""

    name: str
    arguments: Any


class Expectation(msgspec.Struct, frozen=True, kw_only=True):
    """What the harness's backend will send, for the checks to compare.

    Attributes:
        text: The answer's content, joined.
        reasoning: The reasoning, joined.
        finish_reason: The finish reason the backend reports.
        input_tokens: Prompt tokens the backend reports (None: no usage).
        output_tokens: Completion tokens the backend reports.
        tool_calls: The tool calls the backend streams.
        backend_status: The HTTP status of an error scenario.
        deltas_before_stall: Content deltas sent before a stall or a cut.
    """

    text: str | None = None
    reasoning: str | None = None
    finish_reason: FinishReason | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    tool_calls: tuple[ExpectedToolCall, ...] = ()
    backend_status: int | None = None
    deltas_before_stall: int = 0


UpstreamClosed = Callable[[float], Awaitable[float]]
"""``await upstream_closed(timeout_s)``: the ``trio.current_time()`` at which the
backend saw the run's connection close (raises ``trio.TooSlowError`` if it
did not within ``timeout_s`` seconds)."""


@dataclass(frozen=True, eq=False)
class ScenarioCase:
    """One scenario made concrete by a harness.

    Attributes:
        scenario: Which scenario.
        adapter: The adapter under test, connected to a backend that plays
            the scenario.
        spec: The run to execute.
        deadlines: The run's deadlines.
        expected: What the backend will send.
        upstream_closed: When the backend saw its connection close.
    """

    scenario: Scenario
    adapter: Executor
    spec: ExecutionSpec
    deadlines: Deadlines
    expected: Expectation
    upstream_closed: UpstreamClosed


class Harness(Protocol):
    """Makes one kind of adapter play each scenario."""

    @property
    def name(self) -> str:
        """Shown in test ids and measurements."""
        ...

    def unsupported(self, scenario: Scenario) -> str | None:
        """Why the harness cannot play ``scenario``, or None if it can."""
        ...

    def case(self, scenario: Scenario) -> AbstractAsyncContextManager[ScenarioCase]:
        """Set up the backend and adapter for ``scenario``; tear them down on exit."""
        ...


# --- measurements ---------------------------------------------------------------


class CancelLatency(msgspec.Struct, frozen=True):
    """Cancel -> backend saw its socket close, for one run."""

    harness: str
    seconds: float


class LatencySummary(msgspec.Struct, frozen=True):
    count: int
    median_s: float
    max_s: float


# Every measurement of check_cancel_mid_stream in this process, in order.
CANCEL_LATENCIES: Final[list[CancelLatency]] = []


def latency_summary(harness: str | None = None) -> LatencySummary:
    """Median and max of ``CANCEL_LATENCIES`` (for one harness, or all)."""
    values = [m.seconds for m in CANCEL_LATENCIES if harness is None or m.harness == harness]
    if not values:
        return LatencySummary(count=0, median_s=0.0, max_s=0.0)
    return LatencySummary(count=len(values), median_s=statistics.median(values), max_s=max(values))


# --- checks ---------------------------------------------------------------------


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise ConformanceError(message)


def _open_case(harness: Harness, scenario: Scenario) -> AbstractAsyncContextManager[ScenarioCase]:
    reason = harness.unsupported(scenario)
    if reason is not None:
        raise ScenarioUnsupported(harness.name, scenario, reason)
    return harness.case(scenario)


def _terminal(events: list[RuntimeEvent], *, start_required: bool = True) -> TerminalEvent:
    """Check the event grammar; return the terminal event."""
    _expect(bool(events), "the run produced no events")
    terminal = events[-1]
    _expect(
        isinstance(terminal, Complete | Error | Cancelled),
        f"last event is {type(terminal).__name__}, not a terminal",
    )
    assert isinstance(terminal, Complete | Error | Cancelled)
    extra = [e for e in events[:-1] if isinstance(e, Complete | Error | Cancelled)]
    _expect(not extra, f"more than one terminal event: {[*extra, terminal]}")
    # The grammar lets a run fail before its adapter reached the backend:
    # then the lone Error is the whole run.
    lone_error = not start_required and len(events) == 1 and isinstance(terminal, Error)
    if not lone_error:
        starts = [i for i, e in enumerate(events) if isinstance(e, Start)]
        _expect(starts == [0], f"Start must come first and once; event types: {_types(events)}")
    return terminal


def _types(events: list[RuntimeEvent]) -> list[str]:
    return [type(e).__name__ for e in events]


def _text(events: list[RuntimeEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


def _reasoning(events: list[RuntimeEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, ReasoningDelta))


def _as_complete(terminal: TerminalEvent) -> Complete:
    _expect(isinstance(terminal, Complete), f"expected Complete, got {terminal!r}")
    assert isinstance(terminal, Complete)
    return terminal


def _as_error(terminal: TerminalEvent) -> Error:
    _expect(isinstance(terminal, Error), f"expected Error, got {terminal!r}")
    assert isinstance(terminal, Error)
    return terminal


def _as_cancelled(terminal: TerminalEvent, reason: CancelReason) -> Cancelled:
    _expect(isinstance(terminal, Cancelled), f"expected Cancelled({reason}), got {terminal!r}")
    assert isinstance(terminal, Cancelled)
    _expect(terminal.reason is reason, f"expected reason {reason}, got {terminal.reason}")
    return terminal


def _check_usage(complete: Complete, expected: Expectation) -> None:
    usage = complete.usage
    if expected.output_tokens is None:
        _expect(usage.output_tokens > 0, f"no usage reported or estimated: {usage!r}")
        return
    _expect(
        (usage.input_tokens, usage.output_tokens)
        == (expected.input_tokens, expected.output_tokens),
        f"usage {usage!r} != backend's input={expected.input_tokens} "
        f"output={expected.output_tokens}",
    )
    _expect(not usage.estimated, "usage the backend reported must not be flagged estimated")


async def _run(case: ScenarioCase) -> list[RuntimeEvent]:
    return await collect_run(case.adapter, case.spec, case.deadlines)


async def check_plain_stream(harness: Harness) -> None:
    """Deltas in order, joined equal to the answer; ``Complete`` with usage."""
    async with _open_case(harness, Scenario.PLAIN_STREAM) as case:
        events = await _run(case)
    complete = _as_complete(_terminal(events))
    _expect(
        _text(events) == case.expected.text, f"text {_text(events)!r} != {case.expected.text!r}"
    )
    _expect(not _reasoning(events), "a plain answer produced reasoning")
    if case.expected.finish_reason is not None:
        _expect(
            complete.finish_reason is case.expected.finish_reason,
            f"finish {complete.finish_reason} != {case.expected.finish_reason}",
        )
    _expect(complete.malformed_chunks == 0, "a clean stream reported malformed chunks")
    _expect(not complete.tool_calls, "a plain answer reported tool calls")
    _check_usage(complete, case.expected)


async def check_reasoning(harness: Harness) -> None:
    """Reasoning arrives as ``ReasoningDelta``s, the answer as ``Delta``s."""
    async with _open_case(harness, Scenario.REASONING) as case:
        events = await _run(case)
    complete = _as_complete(_terminal(events))
    _expect(
        any(isinstance(e, ReasoningDelta) for e in events),
        "no ReasoningDelta in a reasoning stream",
    )
    if case.expected.reasoning is not None:
        _expect(
            _reasoning(events) == case.expected.reasoning,
            f"reasoning {_reasoning(events)!r} != {case.expected.reasoning!r}",
        )
    _expect(
        _text(events) == case.expected.text, f"text {_text(events)!r} != {case.expected.text!r}"
    )
    _check_usage(complete, case.expected)


async def check_streamed_tool_calls(harness: Harness) -> None:
    """Streamed tool-call deltas end up as ``Complete.tool_calls`` with JSON arguments."""
    async with _open_case(harness, Scenario.STREAMED_TOOL_CALLS) as case:
        events = await _run(case)
    complete = _as_complete(_terminal(events))
    calls = complete.tool_calls
    expected = case.expected.tool_calls
    _expect(bool(calls), "no tool calls in Complete")
    _expect(
        [c.name for c in calls] == [e.name for e in expected],
        f"tool names {[c.name for c in calls]} != {[e.name for e in expected]}",
    )
    for call, want in zip(calls, expected, strict=True):
        try:
            arguments = json.loads(call.arguments)
        except ValueError as exc:
            raise ConformanceError(
                f"arguments of {call.name} are not JSON: {call.arguments!r}"
            ) from exc
        _expect(arguments == want.arguments, f"arguments {arguments!r} != {want.arguments!r}")
        _expect(bool(call.id), f"tool call {call.name} has no id")
    _expect([c.index for c in calls] == list(range(len(calls))), "tool call indexes must be 0..n-1")
    if case.expected.finish_reason is not None:
        _expect(
            complete.finish_reason is case.expected.finish_reason,
            f"finish {complete.finish_reason} != {case.expected.finish_reason}",
        )


async def check_backend_4xx(harness: Harness) -> None:
    """A 4xx becomes an ``Error`` with that status and a bounded message."""
    async with _open_case(harness, Scenario.BACKEND_4XX) as case:
        events = await _run(case)
    error = _as_error(_terminal(events))
    _expect(
        error.status == case.expected.backend_status,
        f"status {error.status} != backend's {case.expected.backend_status}",
    )
    _expect(bool(error.message.strip()), "empty error message")
    size = len(error.message.encode())
    _expect(size <= MAX_ERROR_MESSAGE_BYTES, f"error message of {size} bytes is not bounded")


async def check_backend_5xx(harness: Harness) -> None:
    """A 5xx becomes an ``Error`` with a 5xx status."""
    async with _open_case(harness, Scenario.BACKEND_5XX) as case:
        events = await _run(case)
    error = _as_error(_terminal(events))
    _expect(500 <= error.status < 600, f"status {error.status} is not a 5xx")
    _expect(bool(error.message.strip()), "empty error message")
    _expect(len(error.message.encode()) <= MAX_ERROR_MESSAGE_BYTES, "error message not bounded")


async def check_connection_refused(harness: Harness) -> None:
    """An unreachable backend is ``Error(503, backend_unavailable)``."""
    async with _open_case(harness, Scenario.CONNECTION_REFUSED) as case:
        events = await _run(case)
    error = _as_error(_terminal(events, start_required=False))
    _expect(error.status == 503, f"status {error.status} != 503")
    _expect(
        error.code == ErrorCode.BACKEND_UNAVAILABLE,
        f"code {error.code!r} != {ErrorCode.BACKEND_UNAVAILABLE.value!r}",
    )


async def _upstream_close_latency(case: ScenarioCase, since: float) -> float | None:
    """Seconds from ``since`` until the backend saw its connection close, or
    None if it did not within ``UPSTREAM_CLOSE_BOUND_S``.

    It only measures: checks assert after leaving the case, so that a failure
    is not wrapped in the exception group of the harness's nursery.
    """
    try:
        closed_at = await case.upstream_closed(UPSTREAM_CLOSE_BOUND_S)
    except trio.TooSlowError:
        return None
    return max(0.0, closed_at - since)


def _expect_upstream_closed(latency: float | None) -> float:
    _expect(
        latency is not None and latency <= UPSTREAM_CLOSE_BOUND_S,
        f"the backend did not see its connection close within {UPSTREAM_CLOSE_BOUND_S}s"
        + ("" if latency is None else f" (it took {latency:.3f}s)"),
    )
    assert latency is not None
    return latency


async def check_stall_before_first_byte(harness: Harness) -> None:
    """A backend silent before its first byte: ``Cancelled(first_token_timeout)``,
    and the backend sees its connection close."""
    async with _open_case(harness, Scenario.STALL_BEFORE_FIRST_BYTE) as case:
        started = trio.current_time()
        events = await _run(case)
        elapsed = trio.current_time() - started
        latency = await _upstream_close_latency(case, started)
    deadline = case.deadlines.first_token_timeout_s
    _expect(deadline is not None, "the harness must set first_token_timeout_s")
    assert deadline is not None
    cancelled = _as_cancelled(_terminal(events), CancelReason.FIRST_TOKEN_TIMEOUT)
    _expect_upstream_closed(latency)
    _expect(not _text(events), "deltas from a backend that sent nothing")
    _expect(
        deadline <= elapsed <= deadline + DEADLINE_SLACK_S,
        f"cancelled after {elapsed:.3f}s, deadline {deadline}s",
    )
    _expect(bool(cancelled.message), "Cancelled without a message")


async def check_stall_mid_stream(harness: Harness) -> None:
    """A backend silent mid-stream: the deltas before the stall, then
    ``Cancelled(idle_timeout)``, and the backend sees its connection close."""
    async with _open_case(harness, Scenario.STALL_MID_STREAM) as case:
        started = trio.current_time()
        events = await _run(case)
        latency = await _upstream_close_latency(case, started)
    _expect(case.deadlines.idle_timeout_s is not None, "the harness must set idle_timeout_s")
    _as_cancelled(_terminal(events), CancelReason.IDLE_TIMEOUT)
    _expect_upstream_closed(latency)
    deltas = [e for e in events if isinstance(e, Delta)]
    _expect(
        len(deltas) == case.expected.deltas_before_stall,
        f"{len(deltas)} deltas before the stall, backend sent {case.expected.deltas_before_stall}",
    )


async def check_truncated_stream(harness: Harness) -> None:
    """A connection dropped mid-body is an ``Error`` (backend_stream_error), never success."""
    async with _open_case(harness, Scenario.TRUNCATED_STREAM) as case:
        events = await _run(case)
    error = _as_error(_terminal(events))
    _expect(
        error.code == ErrorCode.BACKEND_STREAM_ERROR,
        f"code {error.code!r} != {ErrorCode.BACKEND_STREAM_ERROR.value!r}",
    )
    _expect(error.status == 502, f"status {error.status} != 502")
    deltas = [e for e in events if isinstance(e, Delta)]
    _expect(
        len(deltas) == case.expected.deltas_before_stall,
        f"{len(deltas)} deltas before the cut, backend sent {case.expected.deltas_before_stall}",
    )


async def check_missing_done(harness: Harness) -> None:
    """A body that ends without ``[DONE]`` is an ``Error`` that says so."""
    async with _open_case(harness, Scenario.MISSING_DONE) as case:
        events = await _run(case)
    error = _as_error(_terminal(events))
    _expect("[DONE]" in error.message, f"error does not mention [DONE]: {error.message!r}")
    _expect(
        error.code == ErrorCode.BACKEND_STREAM_ERROR,
        f"code {error.code!r} != {ErrorCode.BACKEND_STREAM_ERROR.value!r}",
    )


async def check_malformed_chunk(harness: Harness) -> None:
    """One undecodable chunk is skipped, counted and reported in ``Complete``."""
    async with _open_case(harness, Scenario.MALFORMED_CHUNK) as case:
        events = await _run(case)
    complete = _as_complete(_terminal(events))
    _expect(complete.malformed_chunks == 1, f"malformed_chunks {complete.malformed_chunks} != 1")
    _expect(
        _text(events) == case.expected.text, f"text {_text(events)!r} != {case.expected.text!r}"
    )


async def check_malformed_chunk_over_limit(harness: Harness) -> None:
    """Past the tolerance, a malformed chunk fails the run (backend_protocol_error)."""
    async with _open_case(harness, Scenario.MALFORMED_CHUNK_OVER_LIMIT) as case:
        events = await _run(case)
    error = _as_error(_terminal(events))
    _expect(error.code == ErrorCode.BACKEND_PROTOCOL_ERROR, f"code {error.code!r}")


async def check_oversize_line(harness: Harness) -> None:
    """A line over the limit fails the run with a protocol error instead of buffering it."""
    async with _open_case(harness, Scenario.OVERSIZE_LINE) as case:
        events = await _run(case)
    error = _as_error(_terminal(events))
    _expect(error.code in PROTOCOL_ERROR_CODES, f"code {error.code!r} not a protocol error")
    _expect(error.status == 502, f"status {error.status} != 502")


async def check_cancel_mid_stream(harness: Harness) -> float:
    """Cancel after a few deltas: ``Cancelled(client_disconnect)`` and the
    backend sees its socket close. Returns (and records) that latency."""
    async with _open_case(harness, Scenario.CANCEL_MID_STREAM) as case:
        events: list[RuntimeEvent] = []
        cancelled_at: float | None = None
        measured: float | None = None
        async with open_run_supervisor() as supervisor:
            run = supervisor.start_run(case.adapter, case.spec, case.deadlines)
            async with run.events:
                async for event in run.events:
                    events.append(event)
                    deltas = sum(isinstance(e, Delta) for e in events)
                    if cancelled_at is None and deltas >= CANCEL_AFTER_DELTAS:
                        cancelled_at = trio.current_time()
                        run.cancel(CancelReason.CLIENT_DISCONNECT)
        if cancelled_at is not None:
            measured = await _upstream_close_latency(case, cancelled_at)
    _expect(cancelled_at is not None, f"fewer than {CANCEL_AFTER_DELTAS} deltas arrived")
    _as_cancelled(_terminal(events), CancelReason.CLIENT_DISCONNECT)
    latency = _expect_upstream_closed(measured)
    CANCEL_LATENCIES.append(CancelLatency(harness=harness.name, seconds=latency))
    log.info("%s: cancel -> upstream socket closed in %.3f ms", harness.name, latency * 1000)
    return latency


Check = Callable[[Harness], Awaitable[object]]

CHECKS: Final[Mapping[Scenario, Check]] = {
    Scenario.PLAIN_STREAM: check_plain_stream,
    Scenario.REASONING: check_reasoning,
    Scenario.STREAMED_TOOL_CALLS: check_streamed_tool_calls,
    Scenario.BACKEND_4XX: check_backend_4xx,
    Scenario.BACKEND_5XX: check_backend_5xx,
    Scenario.CONNECTION_REFUSED: check_connection_refused,
    Scenario.STALL_BEFORE_FIRST_BYTE: check_stall_before_first_byte,
    Scenario.STALL_MID_STREAM: check_stall_mid_stream,
    Scenario.TRUNCATED_STREAM: check_truncated_stream,
    Scenario.MISSING_DONE: check_missing_done,
    Scenario.MALFORMED_CHUNK: check_malformed_chunk,
    Scenario.MALFORMED_CHUNK_OVER_LIMIT: check_malformed_chunk_over_limit,
    Scenario.OVERSIZE_LINE: check_oversize_line,
    Scenario.CANCEL_MID_STREAM: check_cancel_mid_stream,
}


async def check_scenario(harness: Harness, scenario: Scenario) -> None:
    """Run the check of ``scenario`` against ``harness``.

    Raises:
        ScenarioUnsupported: The harness cannot play it.
        ConformanceError: The adapter broke the protocol.
    """
    await CHECKS[scenario](harness)
