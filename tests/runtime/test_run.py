"""The run runtime: one terminal event per run, whatever happens (virtual time)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from iop.config import Deadlines
from iop.errors import BackendHTTPError
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
    TokenCount,
    Usage,
    is_terminal,
)
from iop.runtime import EventSender, RunState, collect_run, open_run_supervisor
from iop.spec import ChatRequest, ExecutionSpec, Message

SPEC = ExecutionSpec(
    run_id="r1", request=ChatRequest(model="m", messages=[Message(role="user", content="hi")])
)
NO_DEADLINES = Deadlines(first_token_timeout_s=None, idle_timeout_s=None, request_timeout_s=None)


class ScriptedAdapter:
    """An executor whose behaviour is a coroutine function of the sender."""

    def __init__(self, body: Callable[[EventSender], Awaitable[None]]) -> None:
        self.body = body
        self.finished = False
        self.cancelled = False

    async def execute(self, spec: ExecutionSpec, send: EventSender) -> None:
        try:
            await self.body(send)
            self.finished = True
        except trio.Cancelled:
            self.cancelled = True
            raise


def script(*events: RuntimeEvent, pause: float = 0.0) -> ScriptedAdapter:
    async def body(send: EventSender) -> None:
        for ev in events:
            if pause:
                await trio.sleep(pause)
            await send.send(ev)

    return ScriptedAdapter(body)


def terminals(events: list[RuntimeEvent]) -> list[RuntimeEvent]:
    return [e for e in events if is_terminal(e)]


async def test_happy_path_events_in_order() -> None:
    adapter = script(Start(target="m"), ReasoningDelta("r"), Delta("a"), Delta("b"), Complete())
    events = await collect_run(adapter, SPEC, NO_DEADLINES)
    assert events == [Start(target="m"), ReasoningDelta("r"), Delta("a"), Delta("b"), Complete()]


async def test_iop_error_becomes_error_event() -> None:
    async def body(send: EventSender) -> None:
        await send.send(Start())
        raise BackendHTTPError("vllm returned 400: nope", backend_status=400)

    events = await collect_run(ScriptedAdapter(body), SPEC, NO_DEADLINES)
    assert events == [
        Start(),
        Error(message="vllm returned 400: nope", status=400, code="backend_http_error"),
    ]


async def test_error_before_start_is_the_only_event() -> None:
    async def body(send: EventSender) -> None:
        raise BackendHTTPError("boom", backend_status=503)

    events = await collect_run(ScriptedAdapter(body), SPEC, NO_DEADLINES)
    assert events == [Error(message="boom", status=503, code="backend_http_error")]


async def test_adapter_crash_is_internal_error(caplog: pytest.LogCaptureFixture) -> None:
    async def body(send: EventSender) -> None:
        await send.send(Start())
        raise KeyError("bug")

    events = await collect_run(ScriptedAdapter(body), SPEC, NO_DEADLINES)
    assert events[-1] == Error(
        message="internal error: KeyError", status=500, code="internal_error"
    )
    assert "adapter crashed" in caplog.text


async def test_exception_group_from_adapter_nursery_uses_the_iop_leaf() -> None:
    async def body(send: EventSender) -> None:
        await send.send(Start())
        async with trio.open_nursery() as n:

            async def fail() -> None:
                raise BackendHTTPError("inner", backend_status=429)

            n.start_soon(fail)

    events = await collect_run(ScriptedAdapter(body), SPEC, NO_DEADLINES)
    assert events[-1] == Error(message="inner", status=429, code="backend_http_error")


async def test_return_without_terminal_is_an_error() -> None:
    events = await collect_run(script(Start(), Delta("x")), SPEC, NO_DEADLINES)
    assert events[-1] == Error(
        message="adapter returned without a terminal event", status=500, code="internal_error"
    )


async def test_delta_before_start_is_rejected() -> None:
    events = await collect_run(script(Delta("x"), Complete()), SPEC, NO_DEADLINES)
    assert len(events) == 1
    assert isinstance(events[0], Error)
    assert "before start" in events[0].message


async def test_second_start_is_rejected() -> None:
    events = await collect_run(script(Start(), Start(), Complete()), SPEC, NO_DEADLINES)
    assert events[0] == Start()
    assert isinstance(events[1], Error)
    assert "second start" in events[1].message


async def test_second_terminal_is_rejected_and_first_stands(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events = await collect_run(
        script(Start(), Complete(), Error(message="late")), SPEC, NO_DEADLINES
    )
    assert events == [Start(), Complete()]
    assert "after its terminal event" in caplog.text


async def test_first_token_timeout(autojump_clock: trio.testing.MockClock) -> None:
    async def body(send: EventSender) -> None:
        await send.send(Start())
        await trio.sleep(10)
        await send.send(Delta("late"))

    adapter = ScriptedAdapter(body)
    d = Deadlines(first_token_timeout_s=5, idle_timeout_s=100, request_timeout_s=1000)
    events = await collect_run(adapter, SPEC, d)
    assert events[0] == Start()
    assert isinstance(events[-1], Cancelled)
    assert events[-1].reason is CancelReason.FIRST_TOKEN_TIMEOUT
    assert adapter.cancelled
    assert trio.current_time() == pytest.approx(5.0)


async def test_idle_timeout_after_first_token(autojump_clock: trio.testing.MockClock) -> None:
    async def body(send: EventSender) -> None:
        await send.send(Start())
        await send.send(Delta("a"))
        await trio.sleep(3)
        await send.send(Delta("b"))
        await trio.sleep(30)
        await send.send(Complete())

    d = Deadlines(first_token_timeout_s=1, idle_timeout_s=10, request_timeout_s=1000)
    events = await collect_run(ScriptedAdapter(body), SPEC, d)
    assert events[:3] == [Start(), Delta("a"), Delta("b")]
    last = events[-1]
    assert isinstance(last, Cancelled)
    assert last.reason is CancelReason.IDLE_TIMEOUT
    assert last.usage.output_tokens == 2
    assert last.usage.estimated


async def test_total_timeout_caps_a_steady_stream(autojump_clock: trio.testing.MockClock) -> None:
    async def body(send: EventSender) -> None:
        await send.send(Start())
        while True:
            await trio.sleep(1)
            await send.send(Delta("x"))

    d = Deadlines(first_token_timeout_s=5, idle_timeout_s=5, request_timeout_s=20)
    events = await collect_run(ScriptedAdapter(body), SPEC, d)
    last = events[-1]
    assert isinstance(last, Cancelled)
    assert last.reason is CancelReason.TOTAL_TIMEOUT
    assert trio.current_time() == pytest.approx(20.0)


async def test_slow_consumer_is_not_an_idle_backend(autojump_clock: trio.testing.MockClock) -> None:
    # The adapter is fast, the consumer takes 50 s per event with a 10 s idle
    # deadline: time blocked on the consumer is backpressure, not idleness.
    n = 40
    adapter = script(Start(), *[Delta(str(i)) for i in range(n)], Complete())
    d = Deadlines(first_token_timeout_s=10, idle_timeout_s=10, request_timeout_s=None)
    got: list[RuntimeEvent] = []
    async with open_run_supervisor() as sup:
        run = sup.start_run(adapter, SPEC, d, buffer=1)
        async with run.events:
            async for ev in run.events:
                got.append(ev)
                await trio.sleep(50)
    assert got[-1] == Complete()
    assert len(got) == n + 2


async def test_consumer_that_stops_reading_is_a_slow_client(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adapter = script(Start(), *[Delta("x")] * 100, Complete(), pause=0.01)
    async with open_run_supervisor() as sup:
        run = sup.start_run(adapter, SPEC, NO_DEADLINES, buffer=4, write_stall_timeout_s=5.0)
        told: list[RuntimeEvent] = []
        run.on_outcome = told.append
        await run.events.receive()  # Start, then the client stops reading
        outcome = await run.wait()
        decided_at = trio.current_time()
        run.events.close()
    # The run's owner hears the outcome once, when it is decided (the edge
    # closes a slow client's connection then).
    assert told == [outcome]
    assert isinstance(outcome, Cancelled)
    assert outcome.reason is CancelReason.SLOW_CLIENT
    assert outcome.message == "the client accepted no data for write_stall_timeout_s=5"
    assert adapter.cancelled
    # Virtual time: the channel filled after a few deltas, then 5 s of nothing.
    assert 5.0 <= decided_at < 6.0


async def test_on_outcome_hears_an_adapter_terminal_once() -> None:
    async with open_run_supervisor() as sup:
        run = sup.start_run(script(Start(), Delta("x"), Complete()), SPEC, NO_DEADLINES)
        told: list[RuntimeEvent] = []
        run.on_outcome = told.append
        got = [ev async for ev in run.events]
    assert told == [Complete()]
    assert terminals(got) == [Complete()]


async def test_slow_but_reading_consumer_is_not_a_slow_client(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adapter = script(Start(), *[Delta("x")] * 10, Complete())
    got: list[RuntimeEvent] = []
    async with open_run_supervisor() as sup:
        run = sup.start_run(adapter, SPEC, NO_DEADLINES, buffer=1, write_stall_timeout_s=5.0)
        async with run.events:
            async for ev in run.events:
                got.append(ev)
                await trio.sleep(4.0)  # slow, but never 5 s without taking one
    assert got[-1] == Complete()


async def test_without_write_stall_timeout_a_stalled_consumer_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adapter = script(Start(), *[Delta("x")] * 10, Complete())
    d = Deadlines(first_token_timeout_s=None, idle_timeout_s=None, request_timeout_s=100)
    async with open_run_supervisor() as sup:
        run = sup.start_run(adapter, SPEC, d, buffer=1)
        await run.events.receive()
        outcome = await run.wait()
        run.events.close()
    assert isinstance(outcome, Cancelled)
    assert outcome.reason is CancelReason.TOTAL_TIMEOUT


async def test_explicit_cancel_mid_stream(autojump_clock: trio.testing.MockClock) -> None:
    async def body(send: EventSender) -> None:
        await send.send(Start())
        while True:
            await send.send(Delta("x"))
            await trio.sleep(1)

    adapter = ScriptedAdapter(body)
    async with open_run_supervisor() as sup:
        run = sup.start_run(adapter, SPEC, NO_DEADLINES)
        got: list[RuntimeEvent] = []
        async with run.events:
            async for ev in run.events:
                got.append(ev)
                if len(got) == 4:
                    run.cancel(CancelReason.CLIENT_DISCONNECT, "client went away")
                    run.cancel(CancelReason.NODE_LOST)  # the first reason wins
    assert adapter.cancelled
    last = got[-1]
    assert last == Cancelled(
        reason=CancelReason.CLIENT_DISCONNECT,
        message="client went away",
        usage=last.usage if isinstance(last, Cancelled) else None,  # type: ignore[arg-type]
    )
    assert run.state is RunState.DONE
    assert await run.wait() == last


async def test_cancel_after_complete_is_ignored() -> None:
    async with open_run_supervisor() as sup:
        run = sup.start_run(script(Start(), Complete()), SPEC, NO_DEADLINES)
        outcome = await run.wait()
        run.cancel(CancelReason.EXPLICIT)
        async with run.events:
            events = [ev async for ev in run.events]
    assert outcome == Complete()
    assert events == [Start(), Complete()]


# --- what a cancelled run used (the module docstring's second table) ---------------


async def _cancelled_usage(
    body: Callable[[EventSender], Awaitable[None]],
    *,
    cancel_after: int,
    reason: CancelReason = CancelReason.CLIENT_DISCONNECT,
) -> Usage:
    """The usage of a run of ``body`` (prompt 2,404 tokens) the consumer
    cancels once it has taken ``cancel_after`` events."""
    async with open_run_supervisor() as sup:
        run = sup.start_run(ScriptedAdapter(body), SPEC, NO_DEADLINES, prompt_tokens=2404)
        got = 0
        async with run.events:
            async for _ev in run.events:
                got += 1
                if got == cancel_after:
                    run.cancel(reason)
    outcome = run.outcome
    assert isinstance(outcome, Cancelled)
    return outcome.usage


async def _streams_forever(send: EventSender) -> None:
    await send.send(Start())
    while True:
        await send.send(Delta("x"))
        await trio.sleep(1)


@pytest.mark.parametrize(
    "reason", [CancelReason.CLIENT_DISCONNECT, CancelReason.SLOW_CLIENT, CancelReason.EXPLICIT]
)
async def test_a_cancel_after_the_first_output_used_the_prompt(
    autojump_clock: trio.testing.MockClock, reason: CancelReason
) -> None:
    usage = await _cancelled_usage(_streams_forever, cancel_after=2, reason=reason)
    assert usage == Usage(input_tokens=2404, output_tokens=1, estimated=True)


async def test_a_cancel_before_the_first_output_used_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def waits(send: EventSender) -> None:
        await send.send(Start())  # the adapter is about to call its backend
        await trio.sleep_forever()

    usage = await _cancelled_usage(waits, cancel_after=1)
    assert usage == Usage(estimated=True)


async def test_a_first_output_of_any_kind_means_the_prompt_was_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def embeds(send: EventSender) -> None:
        await send.send(Start())
        await send.send(EmbeddingData.of(0, [1.0]))
        await trio.sleep_forever()

    usage = await _cancelled_usage(embeds, cancel_after=2)
    assert usage == Usage(input_tokens=2404, estimated=True)


async def test_a_deadline_after_the_first_output_used_the_prompt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def body(send: EventSender) -> None:
        await send.send(Start())
        await send.send(Delta("a"))
        await trio.sleep_forever()

    d = Deadlines(first_token_timeout_s=1, idle_timeout_s=10, request_timeout_s=None)
    async with open_run_supervisor() as sup:
        run = sup.start_run(ScriptedAdapter(body), SPEC, d, prompt_tokens=7)
        outcome = await run.wait()
    assert outcome == Cancelled(
        reason=CancelReason.IDLE_TIMEOUT,
        message="backend silent for idle_timeout_s=10",
        usage=Usage(input_tokens=7, output_tokens=1, estimated=True),
    )


@pytest.mark.parametrize(
    ("reported", "charged"),
    [
        # A node's run does not know the prompt: the edge's figure fills in.
        (Usage(output_tokens=3, estimated=True), 2404),
        # A producer that counted the prompt keeps its count.
        (Usage(input_tokens=2500, output_tokens=3), 2500),
    ],
)
async def test_a_cancelled_passed_on_after_output_carries_the_prompt(
    reported: Usage, charged: int
) -> None:
    remote = Cancelled(reason=CancelReason.IDLE_TIMEOUT, usage=reported)
    adapter = script(Start(), Delta("a"), remote)
    async with open_run_supervisor() as sup:
        run = sup.start_run(adapter, SPEC, NO_DEADLINES, prompt_tokens=2404)
        async with run.events:
            events = [ev async for ev in run.events]
    assert events[-1] == run.outcome
    assert isinstance(run.outcome, Cancelled)
    assert run.outcome.reason is CancelReason.IDLE_TIMEOUT
    assert run.outcome.usage.input_tokens == charged
    assert run.outcome.usage.output_tokens == 3


async def test_a_cancelled_passed_on_before_output_carries_no_prompt() -> None:
    remote = Cancelled(reason=CancelReason.QUEUE_TIMEOUT)
    async with open_run_supervisor() as sup:
        run = sup.start_run(script(Start(), remote), SPEC, NO_DEADLINES, prompt_tokens=2404)
        assert await run.wait() == remote


async def test_shutdown_delivers_cancelled_and_propagates(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def body(send: EventSender) -> None:
        await send.send(Start())
        await trio.sleep_forever()

    got: list[RuntimeEvent] = []
    with trio.move_on_after(5):
        async with open_run_supervisor() as sup:
            run = sup.start_run(ScriptedAdapter(body), SPEC, NO_DEADLINES)
            async with run.events:
                async for ev in run.events:
                    got.append(ev)
    # The consumer loop was cancelled too, so read what was delivered since.
    assert run.outcome is not None
    assert isinstance(run.outcome, Cancelled)
    assert run.outcome.reason is CancelReason.SHUTDOWN


async def test_consumer_gone_ends_the_run() -> None:
    async def body(send: EventSender) -> None:
        await send.send(Start())
        while True:
            await send.send(Delta("x"))

    adapter = ScriptedAdapter(body)
    async with open_run_supervisor() as sup:
        run = sup.start_run(adapter, SPEC, NO_DEADLINES, buffer=0)
        await run.events.receive()
        await run.events.aclose()  # the consumer leaves without cancelling
        outcome = await run.wait()
    assert isinstance(outcome, Cancelled)
    assert outcome.reason is CancelReason.CLIENT_DISCONNECT
    assert adapter.cancelled


def _spec(run_id: str) -> ExecutionSpec:
    return ExecutionSpec(run_id=run_id, request=SPEC.request)


async def _cleanup_crashes_in_nursery(send: EventSender) -> None:
    """An adapter whose helper task raises while the run is being cancelled:
    its nursery raises a group [Cancelled, RuntimeError]."""
    await send.send(Start())
    await send.send(Delta("x"))

    async def helper() -> None:
        try:
            await trio.sleep_forever()
        finally:
            raise RuntimeError("cleanup failed")

    async with trio.open_nursery() as n:
        n.start_soon(helper)
        await trio.sleep_forever()


async def _cleanup_crashes_in_finally(send: EventSender) -> None:
    """An adapter whose own ``finally`` raises while it is being cancelled."""
    await send.send(Start())
    try:
        await trio.sleep_forever()
    finally:
        raise RuntimeError("cleanup failed")


@pytest.mark.parametrize(
    "body", [_cleanup_crashes_in_nursery, _cleanup_crashes_in_finally], ids=["group", "finally"]
)
async def test_adapter_raising_during_cancellation_ends_as_cancelled(
    body: Callable[[EventSender], Awaitable[None]],
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with open_run_supervisor() as sup:
        run = sup.start_run(ScriptedAdapter(body), SPEC, NO_DEADLINES)
        await run.events.receive()  # Start
        run.cancel(CancelReason.CLIENT_DISCONNECT, "client disconnected")
        async with run.events:
            rest = [ev async for ev in run.events]
    # The cancel is what ended the run; the cleanup's error is only logged.
    assert rest[-1] == run.outcome
    assert isinstance(run.outcome, Cancelled)
    assert run.outcome.reason is CancelReason.CLIENT_DISCONNECT
    assert "raised while being cancelled" in caplog.text
    assert "cleanup failed" in caplog.text


@pytest.mark.parametrize(
    "body", [_cleanup_crashes_in_nursery, _cleanup_crashes_in_finally], ids=["group", "finally"]
)
async def test_adapter_raising_on_deadline_keeps_the_timeout_reason(
    body: Callable[[EventSender], Awaitable[None]], autojump_clock: trio.testing.MockClock
) -> None:
    d = Deadlines(first_token_timeout_s=5, idle_timeout_s=3, request_timeout_s=None)
    events = await collect_run(ScriptedAdapter(body), SPEC, d)
    last = events[-1]
    assert isinstance(last, Cancelled)
    assert last.reason in (CancelReason.IDLE_TIMEOUT, CancelReason.FIRST_TOKEN_TIMEOUT)


async def test_cleanup_crash_of_one_run_leaves_its_siblings_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sibling_events: list[RuntimeEvent] = []
    async with open_run_supervisor() as sup:
        crashing = sup.start_run(ScriptedAdapter(_cleanup_crashes_in_nursery), SPEC, NO_DEADLINES)
        sibling = sup.start_run(
            script(Start(), *[Delta("s")] * 5, Complete(), pause=1.0), _spec("r2"), NO_DEADLINES
        )
        async with trio.open_nursery() as n:

            async def read_sibling() -> None:
                async with sibling.events:
                    async for ev in sibling.events:
                        sibling_events.append(ev)

            n.start_soon(read_sibling)
            await crashing.events.receive()  # Start
            await trio.sleep(2.5)  # the sibling is mid-stream
            crashing.cancel(CancelReason.CLIENT_DISCONNECT)
            crashing.events.close()
    assert isinstance(crashing.outcome, Cancelled)
    assert crashing.outcome.reason is CancelReason.CLIENT_DISCONNECT
    assert sibling_events == [Start(), *[Delta("s")] * 5, Complete()]


async def test_cleanup_crash_during_shutdown_still_propagates_only_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.move_on_after(5) as outer:
        async with open_run_supervisor() as sup:
            run = sup.start_run(ScriptedAdapter(_cleanup_crashes_in_nursery), SPEC, NO_DEADLINES)
            async with run.events:
                async for _ in run.events:
                    pass
    assert outer.cancelled_caught
    assert isinstance(run.outcome, Cancelled)
    assert run.outcome.reason is CancelReason.SHUTDOWN


async def test_duplicate_run_id_is_refused() -> None:
    async def body(send: EventSender) -> None:
        await send.send(Start())
        await trio.sleep_forever()

    async with open_run_supervisor() as sup:
        run = sup.start_run(ScriptedAdapter(body), SPEC, NO_DEADLINES)
        with pytest.raises(Exception, match="already running"):
            sup.start_run(ScriptedAdapter(body), SPEC, NO_DEADLINES)
        sup.cancel_all(CancelReason.SHUTDOWN)
    assert isinstance(run.outcome, Cancelled)


# --- property: exactly one terminal event, whatever the adapter does -------------

ACTIONS = st.lists(
    st.sampled_from(
        [
            "start",
            "delta",
            "reasoning",
            "embedding",
            "token_count",
            "complete",
            "error",
            "sleep",
            "raise",
            "crash",
            # Raise from cleanup, which runs while the run is being cancelled
            # when a cancel or deadline lands in the sleep: bare, and from a
            # helper task (a group [Cancelled, RuntimeError]).
            "sleep_then_raise_in_finally",
            "sleep_in_nursery_helper_raises_in_finally",
        ]
    ),
    max_size=8,
)


@settings(max_examples=150, deadline=None)
@given(
    actions=ACTIONS,
    cancel_at=st.one_of(st.none(), st.floats(min_value=0, max_value=12)),
    first=st.one_of(st.none(), st.floats(min_value=0.5, max_value=8)),
    idle=st.one_of(st.none(), st.floats(min_value=0.5, max_value=8)),
    total=st.one_of(st.none(), st.floats(min_value=0.5, max_value=30)),
    consumer_delay=st.sampled_from([0.0, 0.5, 3.0]),
)
def test_exactly_one_terminal_event_property(
    actions: list[str],
    cancel_at: float | None,
    first: float | None,
    idle: float | None,
    total: float | None,
    consumer_delay: float,
) -> None:
    async def body(send: EventSender) -> None:
        for a in actions:
            if a == "start":
                await send.send(Start())
            elif a == "delta":
                await send.send(Delta("d"))
            elif a == "reasoning":
                await send.send(ReasoningDelta("r"))
            elif a == "embedding":
                await send.send(EmbeddingData.of(0, [0.5]))
            elif a == "token_count":
                await send.send(TokenCount(count=3))
            elif a == "complete":
                await send.send(Complete())
            elif a == "error":
                await send.send(Error(message="e"))
            elif a == "sleep":
                await trio.sleep(2)
            elif a == "raise":
                raise BackendHTTPError("x", backend_status=500)
            elif a == "sleep_then_raise_in_finally":
                try:
                    await trio.sleep(2)
                finally:
                    raise RuntimeError("cleanup")
            elif a == "sleep_in_nursery_helper_raises_in_finally":

                async def helper() -> None:
                    try:
                        await trio.sleep(2)
                    finally:
                        raise RuntimeError("cleanup")

                async with trio.open_nursery() as n:
                    n.start_soon(helper)
                    await trio.sleep(2)
            else:
                raise RuntimeError("crash")

    async def main() -> tuple[list[RuntimeEvent], object]:
        got: list[RuntimeEvent] = []
        d = Deadlines(first_token_timeout_s=first, idle_timeout_s=idle, request_timeout_s=total)
        async with open_run_supervisor() as sup:
            run = sup.start_run(ScriptedAdapter(body), SPEC, d, buffer=1)
            async with trio.open_nursery() as n:
                if cancel_at is not None:

                    async def canceller() -> None:
                        await trio.sleep(cancel_at)
                        run.cancel(CancelReason.EXPLICIT)

                    n.start_soon(canceller)
                async with run.events:
                    async for ev in run.events:
                        got.append(ev)
                        await trio.sleep(consumer_delay)
                n.cancel_scope.cancel()
        return got, run.outcome

    import logging

    logging.disable(logging.CRITICAL)
    try:
        got, outcome = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        logging.disable(logging.NOTSET)
    terms = terminals(got)
    assert len(terms) == 1, got
    assert got[-1] is terms[0]
    assert outcome == terms[0]
    # Grammar: Start (if any) comes first; without it, the terminal is alone.
    starts = [i for i, e in enumerate(got) if isinstance(e, Start)]
    assert starts in ([], [0])
    if not starts:
        assert len(got) == 1


async def test_embedding_and_token_count_are_output(autojump_clock: trio.testing.MockClock) -> None:
    """They end the first-token phase like a delta does, and pass in order."""
    adapter = script(
        Start(), EmbeddingData.of(0, [1.0]), TokenCount(count=2), Complete(), pause=3.0
    )
    d = Deadlines(first_token_timeout_s=7.0, idle_timeout_s=4.0, request_timeout_s=None)
    events = await collect_run(adapter, SPEC, d)
    # An event every 3 s: the embedding (6 s) is inside the first-token
    # deadline, and from then on only the idle one applies (the token count
    # at 9 s would be past the first-token deadline).
    assert events == [Start(), EmbeddingData.of(0, [1.0]), TokenCount(count=2), Complete()]


async def test_queue_wait_does_not_count_towards_first_token(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from iop.runtime import RunSink

    class Queued:
        async def execute(self, spec: ExecutionSpec, send: RunSink) -> None:
            with send.queued():
                await trio.sleep(8)  # waiting for a slot
            await send.send(Start())
            await trio.sleep(4)
            await send.send(Delta("x"))
            await send.send(Complete())

    d = Deadlines(first_token_timeout_s=5, idle_timeout_s=5, request_timeout_s=100)
    events = await collect_run(Queued(), SPEC, d)
    assert events[-1] == Complete()


async def test_wait_returns_when_decided_not_when_delivered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def body(send: EventSender) -> None:
        await send.send(Start())
        await trio.sleep_forever()

    async with open_run_supervisor() as sup:
        run = sup.start_run(ScriptedAdapter(body), SPEC, NO_DEADLINES, buffer=0)
        await run.events.receive()  # Start
        run.cancel(CancelReason.EXPLICIT)
        outcome = await run.wait()  # nobody reads the terminal yet
        assert isinstance(outcome, Cancelled)
        assert await run.events.receive() == outcome
