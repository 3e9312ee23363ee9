"""Every adapter passes the conformance kit (iop.testing._conformance).

The matrix is harness x scenario; a scenario a harness cannot play is skipped
with the harness's reason. The kit is also tested against adapters that break
the protocol on purpose, so a green matrix means something.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import replace
from typing import Any

import pytest
import trio

from iop.events import CancelReason, Complete, Delta, Error, RuntimeEvent, Start
from iop.runtime import Executor, RunSink
from iop.spec import ExecutionSpec
from iop.testing import (
    CANCEL_LATENCIES,
    CHECKS,
    UPSTREAM_CLOSE_BOUND_S,
    ConformanceError,
    Harness,
    OpenAICompatHarness,
    Scenario,
    ScenarioCase,
    ScenarioUnsupported,
    SimHarness,
    Split,
    VllmHarness,
    check_cancel_mid_stream,
    check_plain_stream,
    check_reasoning,
    check_scenario,
    check_streamed_tool_calls,
    latency_summary,
)

HARNESSES: dict[str, Harness] = {
    "openai_compat": OpenAICompatHarness(),
    "vllm": VllmHarness(),
    "sim": SimHarness(),
}

# Runs of the cancellation check per harness for the latency figures.
LATENCY_RUNS = 10


async def _check(harness: Harness, scenario: Scenario) -> None:
    try:
        await check_scenario(harness, scenario)
    except ScenarioUnsupported as exc:
        # Collection skips what a harness declares unsupported; one that only
        # finds out while running fails here (pytest-trio's re-raise of a
        # skip inside the Trio run drops its reason).
        raise AssertionError(f"undeclared unsupported scenario: {exc}") from exc


def _cases() -> list[Any]:
    """Every harness x scenario; the ones a harness cannot play skip, saying why."""
    return [
        pytest.param(
            harness,
            scenario,
            id=f"{name}-{scenario.value}",
            marks=[pytest.mark.skip(reason=f"{name}: {why}")] if why is not None else [],
        )
        for name, harness in HARNESSES.items()
        for scenario in Scenario
        for why in [harness.unsupported(scenario)]
    ]


def test_every_scenario_has_a_check() -> None:
    assert set(CHECKS) == set(Scenario)


def test_every_skipped_case_says_why() -> None:
    reasons = [m.kwargs["reason"] for case in _cases() for m in case.marks]
    assert reasons, "the sim harness declares unsupported scenarios"
    assert all(r.startswith("sim: ") and len(r) > len("sim: ") for r in reasons), reasons


@pytest.mark.parametrize(("harness", "scenario"), _cases())
async def test_conformance(harness: Harness, scenario: Scenario) -> None:
    await _check(harness, scenario)


# --- the happy paths under every framing ------------------------------------------

SPLITS = {
    "bytewise": Split.bytewise(),
    "every-7": Split.every(7),
    **{f"random-{seed}": Split.random(seed) for seed in range(1, 6)},
}


@pytest.mark.parametrize("split", list(SPLITS.values()), ids=list(SPLITS))
@pytest.mark.parametrize("kind", ["openai_compat", "vllm"])
async def test_happy_paths_under_any_split(kind: str, split: Split) -> None:
    harness: Harness = (
        OpenAICompatHarness(split=split) if kind == "openai_compat" else VllmHarness(split=split)
    )
    await check_plain_stream(harness)
    await check_reasoning(harness)
    await check_streamed_tool_calls(harness)


@pytest.mark.parametrize(
    "transcript",
    ["llamacpp_stream.txt", "ollama_v1_stream.txt", "vllm_text_stream_with_usage.txt"],
)
@pytest.mark.parametrize("scenario", [Scenario.PLAIN_STREAM, Scenario.MISSING_DONE])
async def test_openai_compat_replays_other_servers(transcript: str, scenario: Scenario) -> None:
    await _check(OpenAICompatHarness(plain=(transcript, 0), seed=3), scenario)


# --- cancellation latency --------------------------------------------------------------


@pytest.mark.parametrize("name", list(HARNESSES))
async def test_cancel_latency(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    harness = HARNESSES[name]
    latencies = [await check_cancel_mid_stream(harness) for _ in range(LATENCY_RUNS)]
    summary = latency_summary(name)
    assert summary.count >= LATENCY_RUNS
    assert summary.max_s >= max(latencies)
    # Shown without -s: the lead reads these numbers from the test output.
    with capsys.disabled():
        print(
            f"\n[conformance] {name}: cancel -> upstream socket closed: "
            f"median {summary.median_s * 1000:.3f} ms, max {summary.max_s * 1000:.3f} ms "
            f"over {summary.count} runs"
        )


def test_latencies_are_recorded_per_harness() -> None:
    assert {m.harness for m in CANCEL_LATENCIES} <= set(HARNESSES)
    assert latency_summary("no-such-harness").count == 0


# --- the kit has teeth -------------------------------------------------------------------


class _Unsupported:
    """A harness that can play nothing (like a sim harness without sockets)."""

    name = "nothing"

    def unsupported(self, scenario: Scenario) -> str | None:
        return "this harness plays no scenario"

    def case(self, scenario: Scenario) -> AbstractAsyncContextManager[ScenarioCase]:
        raise AssertionError("must not be called")


async def test_unsupported_scenarios_are_reported() -> None:
    with pytest.raises(ScenarioUnsupported, match="plays no scenario") as info:
        await check_scenario(_Unsupported(), Scenario.CANCEL_MID_STREAM)
    assert info.value.reason == "this harness plays no scenario"


class _Wrapped:
    """A harness whose adapter is wrapped by ``wrap`` (to break it on purpose)."""

    def __init__(self, inner: Harness, wrap: type[_Broken]) -> None:
        self._inner = inner
        self._wrap = wrap
        self.name = f"broken-{inner.name}"

    def unsupported(self, scenario: Scenario) -> str | None:
        return self._inner.unsupported(scenario)

    @asynccontextmanager
    async def case(self, scenario: Scenario) -> AsyncIterator[ScenarioCase]:
        async with self._inner.case(scenario) as case:
            yield replace(case, adapter=self._wrap(case.adapter))


class _Broken:
    """An executor wrapping a real adapter, broken by its subclass."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner

    async def execute(self, spec: ExecutionSpec, send: RunSink) -> None:
        raise NotImplementedError


class _SwallowsErrors(_Broken):
    """Turns every failure into a silent success (the seed's old sin)."""

    async def execute(self, spec: ExecutionSpec, send: RunSink) -> None:
        try:
            await self.inner.execute(spec, send)
        except Exception:
            await send.send(Complete())


class _DropsDeltas(_Broken):
    """Loses every other delta."""

    async def execute(self, spec: ExecutionSpec, send: RunSink) -> None:
        kept = 0

        class Filter:
            @property
            def cancel_reason(self) -> CancelReason:
                return send.cancel_reason

            async def send(self, event: RuntimeEvent) -> None:
                nonlocal kept
                if isinstance(event, Delta):
                    kept += 1
                    if kept % 2 == 0:
                        return
                await send.send(event)

        await self.inner.execute(spec, Filter())


class _ErrorsWithoutStatus(_Broken):
    """Reports every backend failure as a 500, whatever the backend said."""

    async def execute(self, spec: ExecutionSpec, send: RunSink) -> None:
        await send.send(Start())
        await send.send(Error(message="x" * 10_000, status=500))


class _IgnoresCancellation(_Broken):
    """Shields its upstream from cancellation for a while."""

    async def execute(self, spec: ExecutionSpec, send: RunSink) -> None:
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + UPSTREAM_CLOSE_BOUND_S + 0.2
            await self.inner.execute(spec, send)
        await trio.lowlevel.checkpoint()  # now let the run's cancellation in


@pytest.mark.parametrize(
    ("wrap", "scenario"),
    [
        (_SwallowsErrors, Scenario.TRUNCATED_STREAM),
        (_SwallowsErrors, Scenario.MISSING_DONE),
        (_SwallowsErrors, Scenario.BACKEND_5XX),
        (_DropsDeltas, Scenario.PLAIN_STREAM),
        (_DropsDeltas, Scenario.STALL_MID_STREAM),
        (_ErrorsWithoutStatus, Scenario.BACKEND_4XX),
        (_ErrorsWithoutStatus, Scenario.CONNECTION_REFUSED),
    ],
    ids=lambda v: v.__name__.strip("_") if isinstance(v, type) else v.value,
)
async def test_broken_adapters_fail_the_kit(wrap: type[_Broken], scenario: Scenario) -> None:
    with pytest.raises(ConformanceError):
        await check_scenario(_Wrapped(VllmHarness(), wrap), scenario)


async def test_an_upstream_left_open_fails_the_cancellation_check() -> None:
    with pytest.raises(ConformanceError, match="did not see its connection close"):
        await check_cancel_mid_stream(_Wrapped(VllmHarness(), _IgnoresCancellation))
