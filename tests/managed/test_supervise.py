"""The supervisor of a backend IOP runs itself, over a fake process, in virtual time.

The process boundary (``ServeFn``: a life of the backend) is faked; the
supervisor's restarts, backoff, crash loop, operator restart and
cancellation are the real ones. The real llama.cpp server under the same
supervisor: ``tests/e2e/test_managed_backend.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from functools import partial

import msgspec
import pytest
import trio
import trio.lowlevel
import trio.testing

from iop.config import (
    DEFAULT_LLAMACPP_ALIAS,
    LlamaCppInstance,
    SuperviseSettings,
    UpConfig,
    decode_config,
)
from iop.errors import BackendUnavailable, ConfigError
from iop.managed import BackendState, RestartPolicy, Supervisor
from iop.managed._llamacpp_server import DEFAULT_ALIAS
from iop.managed._supervise import headline

SETTINGS = SuperviseSettings(restart_min_s=1.0, restart_max_s=8.0, crash_loop_exits=5)


# --- the policy (sans-IO) -------------------------------------------------------------


def test_the_delay_doubles_with_each_recent_exit_up_to_the_cap() -> None:
    policy = RestartPolicy(SuperviseSettings(restart_min_s=1.0, restart_max_s=5.0))
    assert [policy.ended(t) for t in (0.0, 1.0, 2.0, 3.0)] == [1.0, 2.0, 4.0, 5.0]


def test_the_nth_exit_inside_the_window_is_a_crash_loop() -> None:
    policy = RestartPolicy(SuperviseSettings(crash_loop_exits=3, crash_loop_window_s=60.0))
    assert policy.ended(0.0) is not None
    assert policy.ended(10.0) is not None
    assert policy.ended(20.0) is None  # the third within 60 s
    policy.reset()
    assert policy.ended(21.0) == 1.0  # the operator's restart starts the count again


def test_exits_age_out_of_the_window() -> None:
    policy = RestartPolicy(SuperviseSettings(crash_loop_exits=2, crash_loop_window_s=60.0))
    assert policy.ended(0.0) == 1.0
    # 60 s later the first exit is out: one recent exit, the first delay again.
    assert policy.ended(60.0) == 1.0
    assert policy.recent == 1
    assert policy.ended(61.0) is None


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"restart_min_s": 0.0}, "0 < restart_min_s"),
        ({"restart_min_s": 10.0, "restart_max_s": 5.0}, "restart_min_s <= restart_max_s"),
        ({"restart_max_s": 3601.0}, "<= 3600"),
        ({"crash_loop_exits": 0}, "crash_loop_exits must be 1..1000"),
        ({"crash_loop_exits": 1001}, "crash_loop_exits must be 1..1000"),
        ({"crash_loop_window_s": 0.0}, "crash_loop_window_s must be > 0"),
        ({"crash_loop_window_s": 86401.0}, "<= 86400"),
        ({"liveness_interval_s": -1.0}, "liveness_interval_s must be 0"),
        ({"liveness_timeout_s": 0.0}, "liveness_timeout_s must be > 0"),
        ({"liveness_failures": 0}, "liveness_failures must be 1..100"),
        ({"liveness_failures": 101}, "liveness_failures must be 1..100"),
    ],
)
def test_supervise_settings_refuse_values_past_their_bounds(
    values: dict[str, float], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        decode_config({"embedded": {"supervise": values}}, UpConfig, source="up.toml")


def test_a_typo_in_supervise_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'embedded\.supervise\.restart_mn_s'"):
        decode_config({"embedded": {"supervise": {"restart_mn_s": 1}}}, UpConfig, source="x")


def test_a_llamacpp_instance_serves_its_alias_with_its_slots() -> None:
    inst = msgspec.convert({"name": "l", "parallel": 3}, LlamaCppInstance)
    assert inst.targets == [DEFAULT_ALIAS]
    assert inst.max_concurrency == 3
    assert inst.operations == ["chat", "completion", "tokenize"]
    with_embeddings = msgspec.convert({"name": "l", "embeddings": True}, LlamaCppInstance)
    assert with_embeddings.operations == ["chat", "completion", "embedding", "tokenize"]
    # The sans-IO config cannot import the launcher's constant: they must agree.
    assert DEFAULT_LLAMACPP_ALIAS == DEFAULT_ALIAS


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"embedded": {"parallel": 0}}, "parallel must be >= 1"),
        ({"embedded": {"ctx": 2, "parallel": 4}}, "ctx 2 leaves no context for 4 slots"),
        (
            {"instances": [{"adapter": "llamacpp", "name": "l", "host": " "}]},
            "host must not be empty",
        ),
        (
            {"instances": [{"adapter": "llamacpp", "name": "l", "port": 70000}]},
            "port must be 0..65535",
        ),
        (
            {"instances": [{"adapter": "llamacpp", "name": "l", "ready_timeout_s": 0}]},
            "ready_timeout_s must be > 0",
        ),
    ],
)
def test_the_llamacpp_settings_fail_at_load_time(config: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        decode_config(config, UpConfig, source="up.toml")


def test_headline_drops_the_log_tail() -> None:
    exc = BackendUnavailable("it exited (code 1); last lines of its log:\n  boom\n  bang")
    assert headline(exc) == "it exited (code 1)"
    assert headline(ValueError("bad\nworse")) == "ValueError: bad"


# --- the supervisor over a fake process ------------------------------------------------


class FakeProcess:
    """The backend's lives: each start fails, or serves until the test kills it."""

    def __init__(self, *, failing: Container[int] = ()) -> None:
        self.failing = failing  # the numbers of the starts that fail (1 is the first)
        self.starts = 0
        self.started_at: list[float] = []
        self.cancelled = 0
        self._kill: trio.Event | None = None
        self.serving = trio.Event()

    async def serve(
        self, *, on_exit: Callable[[str], None], task_status: trio.TaskStatus[str]
    ) -> None:
        self.starts += 1
        self.started_at.append(trio.current_time())
        await trio.sleep(0.5)  # the model load
        if self.starts in self.failing:
            raise BackendUnavailable(
                f"start {self.starts} exited before it was ready; last lines of its log:\n  x"
            )
        self._kill = kill = trio.Event()
        task_status.started(f"http://backend/{self.starts}")
        self.serving.set()
        try:
            await kill.wait()
        except trio.Cancelled:
            self.cancelled += 1
            raise
        self.serving = trio.Event()
        on_exit(f"start {self.starts} was killed")
        await trio.lowlevel.checkpoint()  # its log is read
        raise BackendUnavailable(f"start {self.starts} was killed; last lines of its log:\n  y")

    def kill(self) -> None:
        assert self._kill is not None
        self._kill.set()


async def wait_state(sup: Supervisor[str], state: BackendState) -> None:
    with trio.fail_after(600):  # virtual time
        while sup.state is not state:
            await trio.sleep(0.01)


async def test_a_backend_that_dies_is_restarted_after_the_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    proc = FakeProcess()
    ups: list[str] = []
    sup = Supervisor("llama", proc.serve, SETTINGS, on_up=ups.append)
    changes: list[tuple[BackendState, str]] = []
    sup.on_change = lambda: changes.append((sup.state, sup.detail))
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        assert sup.state is BackendState.UP
        first = sup.life
        assert first is not None

        proc.kill()
        await wait_state(sup, BackendState.DOWN)
        await wait_state(sup, BackendState.UP)
        nursery.cancel_scope.cancel()

    assert first.gone.is_set()
    assert first.reason == "start 1 was killed"
    assert ups == ["http://backend/1", "http://backend/2"]
    # Down at the exit, with the restart's delay once decided, then starting again.
    assert (BackendState.DOWN, "start 1 was killed") in changes
    assert (BackendState.DOWN, "start 1 was killed; restarting in 1s") in changes
    assert proc.started_at[1] - proc.started_at[0] == pytest.approx(0.5 + 1.0)


async def test_a_backend_that_cannot_start_is_a_crash_loop_until_the_operator_acts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    proc = FakeProcess(failing=range(1, 6))
    sup = Supervisor("llama", proc.serve, SETTINGS)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)  # returns after the first failed start
        assert sup.state is BackendState.DOWN
        assert sup.detail == "start 1 exited before it was ready; restarting in 1s"

        await wait_state(sup, BackendState.CRASH_LOOP)
        assert proc.starts == 5
        assert sup.detail == (
            "crash loop (5 exits in 300s), not restarted until SIGUSR1: "
            "start 5 exited before it was ready"
        )
        await trio.sleep(3600)  # no deadline ends a crash loop
        assert proc.starts == 5

        assert sup.restart()
        await wait_state(sup, BackendState.UP)
        assert proc.starts == 6
        assert not sup.restart()  # serving: nothing to restart
        nursery.cancel_scope.cancel()


async def test_the_backoff_doubles_and_the_operator_cuts_it_short(
    autojump_clock: trio.testing.MockClock,
) -> None:
    proc = FakeProcess(failing=range(1, 11))
    sup = Supervisor("llama", proc.serve, SETTINGS)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        while proc.starts < 4:
            await trio.sleep(0.01)
        gaps = [b - a - 0.5 for a, b in zip(proc.started_at, proc.started_at[1:], strict=False)]
        assert gaps == pytest.approx([1.0, 2.0, 4.0])
        await wait_state(sup, BackendState.DOWN)
        assert sup.detail.endswith("restarting in 8s")  # the cap
        before = trio.current_time()
        assert sup.restart()
        await wait_state(sup, BackendState.STARTING)
        assert trio.current_time() - before < 8.0
        nursery.cancel_scope.cancel()


async def test_a_crashing_service_is_an_exit_not_the_supervisors_end(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    calls = 0

    async def buggy(*, on_exit: Callable[[str], None], task_status: trio.TaskStatus[str]) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise KeyError("a bug")
        task_status.started("http://backend")
        await trio.sleep_forever()

    sup = Supervisor("llama", buggy, SETTINGS)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        assert sup.detail == "KeyError: 'a bug'; restarting in 1s"
        await wait_state(sup, BackendState.UP)
        nursery.cancel_scope.cancel()
    assert any("the backend's service crashed" in r.getMessage() for r in caplog.records)


async def test_cancelling_the_service_stops_the_backend_and_is_not_swallowed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    proc = FakeProcess()
    sup = Supervisor("llama", proc.serve, SETTINGS)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.serve)
            scope.cancel()
            await trio.sleep_forever()
    assert scope.cancelled_caught
    assert proc.cancelled == 1
    assert sup.state is BackendState.STOPPED


async def test_once_a_failed_start_is_reported_and_not_retried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    proc = FakeProcess(failing={1})
    sup = Supervisor("llama", proc.serve, SETTINGS)
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(sup.serve, once=True))
        assert sup.detail == "start 1 exited before it was ready"
    assert proc.starts == 1
    assert sup.state is BackendState.STOPPED
    assert sup.detail == "start 1 exited before it was ready"  # what a probe reports
