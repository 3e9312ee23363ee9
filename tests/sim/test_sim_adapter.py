"""The in-process ``sim`` adapter through the real runtime, in virtual time."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from iop.adapters import build_adapter
from iop.adapters.sim import SimAdapter
from iop.capabilities import ProviderStatus
from iop.config import Deadlines, SimConfig, SimInstance
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
)
from iop.runtime import collect_run, open_run_supervisor
from iop.sim import AUTO_TOOL_CHOICE_ERROR, build_script
from iop.spec import ChatRequest, ExecutionSpec, FunctionDef, Message, Tool

WEATHER = Tool(
    function=FunctionDef(
        name="get_weather",
        parameters={"type": "object", "properties": {"city": {"type": "string"}}},
    )
)
TIGHT = Deadlines(first_token_timeout_s=5.0, idle_timeout_s=3.0, request_timeout_s=None)


def adapter(**sim: Any) -> SimAdapter:
    return SimAdapter(SimInstance(name="sim0", sim=SimConfig(**sim)))


def spec(run_id: str = "r1", **kw: Any) -> ExecutionSpec:
    request = ChatRequest(model="iop-sim", messages=[Message(role="user", content="hi")], **kw)
    return ExecutionSpec(run_id=run_id, request=request)


def text(events: list[RuntimeEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


def terminal(events: list[RuntimeEvent]) -> RuntimeEvent:
    assert isinstance(events[0], Start | Error)
    return events[-1]


async def test_plain_answer(autojump_clock: trio.testing.MockClock) -> None:
    a = adapter(output_tokens=10, ttft_s=1.0, tokens_per_s=10)
    t0 = trio.current_time()
    events = await collect_run(a, spec())
    assert events[0] == Start(target="iop-sim")
    assert sum(isinstance(e, Delta) for e in events) == 10
    done = terminal(events)
    assert isinstance(done, Complete)
    script = build_script(spec().request, a.cfg.sim)
    assert text(events) == script.content
    assert done.finish_reason is FinishReason.STOP
    assert done.usage.input_tokens == script.prompt_tokens
    assert done.usage.output_tokens == 11
    assert done.tool_calls == ()
    assert not done.text_tool_fallback
    # TTFT, 9 more tokens and the end-of-sequence token at 10 tokens/s.
    assert trio.current_time() - t0 == pytest.approx(1.0 + 10 * 0.1)
    assert a.active_runs == 0


async def test_reasoning(autojump_clock: trio.testing.MockClock) -> None:
    events = await collect_run(adapter(output_tokens=2, reasoning_tokens=3), spec())
    kinds = [type(e) for e in events]
    assert kinds == [Start, ReasoningDelta, ReasoningDelta, ReasoningDelta, Delta, Delta, Complete]
    done = events[-1]
    assert isinstance(done, Complete)
    assert done.usage.reasoning_tokens == 3


async def test_native_tool_call(autojump_clock: trio.testing.MockClock) -> None:
    a = adapter()
    events = await collect_run(a, spec(tools=[WEATHER]))
    done = terminal(events)
    assert isinstance(done, Complete)
    assert done.finish_reason is FinishReason.TOOL_CALLS
    script_call = build_script(spec(tools=[WEATHER]).request, a.cfg.sim).tool_call
    assert script_call is not None
    (call,) = done.tool_calls
    assert (call.id, call.name, call.arguments, call.index) == (
        script_call.id,
        "get_weather",
        script_call.arguments,
        0,
    )
    assert text(events) == ""


async def test_text_tool_mode_is_just_content(autojump_clock: trio.testing.MockClock) -> None:
    events = await collect_run(adapter(tool_mode="text"), spec(tools=[WEATHER]))
    done = terminal(events)
    assert isinstance(done, Complete)
    assert done.tool_calls == ()
    assert not done.text_tool_fallback
    assert text(events).startswith('<tool_call>{"name": "get_weather"')


async def test_max_tokens_finishes_length(autojump_clock: trio.testing.MockClock) -> None:
    events = await collect_run(adapter(output_tokens=50), spec(max_tokens=7))
    done = terminal(events)
    assert isinstance(done, Complete)
    assert done.finish_reason is FinishReason.LENGTH
    assert sum(isinstance(e, Delta) for e in events) == 7
    assert done.usage.output_tokens == 7


@pytest.mark.parametrize(("failure", "status"), [("http_500", 500), ("http_429", 429)])
async def test_http_failures(
    autojump_clock: trio.testing.MockClock, failure: str, status: int
) -> None:
    events = await collect_run(adapter(failure=failure), spec())
    assert isinstance(events[0], Start)
    done = terminal(events)
    assert isinstance(done, Error)
    assert done.status == status
    # A 429 gets OpenAI's code, as from the HTTP adapters (iop.wire._errors).
    assert done.code == ("rate_limit_exceeded" if status == 429 else "backend_http_error")
    assert f"sim returned {status}" in done.message


async def test_midstream_error(autojump_clock: trio.testing.MockClock) -> None:
    events = await collect_run(
        adapter(output_tokens=20, failure="midstream_error", fail_after_tokens=5), spec()
    )
    assert sum(isinstance(e, Delta) for e in events) == 5
    done = terminal(events)
    assert isinstance(done, Error)
    assert done.code == "backend_stream_error"
    assert done.status == 500
    assert "injected mid-stream error" in done.message


async def test_truncate(autojump_clock: trio.testing.MockClock) -> None:
    events = await collect_run(
        adapter(output_tokens=20, failure="truncate", fail_after_tokens=3), spec()
    )
    assert sum(isinstance(e, Delta) for e in events) == 3
    done = terminal(events)
    assert isinstance(done, Error)
    assert done.message == "sim stream ended without [DONE]"


async def test_stall_before_first_byte_hits_first_token_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    t0 = trio.current_time()
    events = await collect_run(adapter(failure="stall_before_first_byte"), spec(), TIGHT)
    done = terminal(events)
    assert isinstance(done, Cancelled)
    assert done.reason is CancelReason.FIRST_TOKEN_TIMEOUT
    assert trio.current_time() - t0 == pytest.approx(5.0)


async def test_stall_mid_stream_hits_idle_deadline(autojump_clock: trio.testing.MockClock) -> None:
    a = adapter(output_tokens=20, failure="stall_mid_stream", fail_after_tokens=4)
    events = await collect_run(a, spec(), TIGHT)
    assert sum(isinstance(e, Delta) for e in events) == 4
    done = terminal(events)
    assert isinstance(done, Cancelled)
    assert done.reason is CancelReason.IDLE_TIMEOUT
    assert a.active_runs == 0


async def test_malformed_chunk_is_counted(autojump_clock: trio.testing.MockClock) -> None:
    events = await collect_run(adapter(output_tokens=6, failure="malformed_chunk"), spec())
    done = terminal(events)
    assert isinstance(done, Complete)
    assert done.malformed_chunks == 1
    assert sum(isinstance(e, Delta) for e in events) == 6


async def test_refused_tools_are_vllms_400(autojump_clock: trio.testing.MockClock) -> None:
    events = await collect_run(adapter(auto_tool_choice=False), spec(tools=[WEATHER]))
    done = terminal(events)
    assert isinstance(done, Error)
    assert done.status == 400
    assert AUTO_TOOL_CHOICE_ERROR in done.message


async def test_per_request_overrides(autojump_clock: trio.testing.MockClock) -> None:
    events = await collect_run(
        adapter(output_tokens=50), spec(extra_body={"iop_sim": {"failure": "http_429"}})
    )
    done = terminal(events)
    assert isinstance(done, Error)
    assert done.status == 429
    bad = await collect_run(adapter(), spec(extra_body={"iop_sim": {"nope": 1}}))
    done = terminal(bad)
    assert isinstance(done, Error)
    assert done.status == 400
    assert "iop_sim" in done.message


async def test_cancellation_stops_the_generation(autojump_clock: trio.testing.MockClock) -> None:
    a = adapter(output_tokens=1000, tokens_per_s=10)
    async with open_run_supervisor() as sup:
        run = sup.start_run(a, spec(), Deadlines())
        seen: list[RuntimeEvent] = []
        async with run.events:
            async for ev in run.events:
                seen.append(ev)
                if len(seen) == 4:
                    assert a.active_runs == 1
                    run.cancel(CancelReason.CLIENT_DISCONNECT)
        done = seen[-1]
        assert isinstance(done, Cancelled)
        assert done.reason is CancelReason.CLIENT_DISCONNECT
        assert a.active_runs == 0
    assert sum(isinstance(e, Delta) for e in seen) < 10


async def test_concurrent_runs_are_counted(autojump_clock: trio.testing.MockClock) -> None:
    a = adapter(output_tokens=5, tokens_per_s=1)
    peak = 0

    async def one(i: int) -> None:
        events = await collect_run(a, spec(run_id=f"r{i}"))
        assert isinstance(events[-1], Complete)

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(one, i)
        await trio.sleep(1.5)
        peak = a.active_runs
    assert peak == 3
    assert a.active_runs == 0


async def test_capabilities_and_probe() -> None:
    a = build_adapter(SimInstance(name="s", sim=SimConfig(model="tiny"), max_concurrency=3))
    assert isinstance(a, SimAdapter)
    assert a.name == "s"
    caps = await a.capabilities()
    assert caps.adapter == "sim"
    assert caps.targets == ("tiny",)
    assert caps.max_concurrency == 3
    assert caps.provider_status is ProviderStatus.AVAILABLE
    assert (await a.probe()).status is ProviderStatus.AVAILABLE
    assert (await a.probe("tiny")).status is ProviderStatus.AVAILABLE
    other = await a.probe("other")
    assert other.status is ProviderStatus.UNAVAILABLE
    assert "other" in other.detail
    await a.aclose()
    await a.aclose()
