"""A ``llamacpp`` instance's runs when its server dies: ``backend_lost``, not a stream error.

The server is ``FakeBackend`` (a real HTTP server on loopback) and its
process a fake ``ServeFn`` that reports the fake's URL and "dies" when told,
in the order a real death takes: the sockets close first, the process is
seen gone after. The real llama.cpp server killed mid-stream:
``tests/e2e/test_managed_backend.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from iop.capabilities import ProviderStatus
from iop.config import Deadlines, LlamaCppInstance, SuperviseSettings
from iop.errors import BackendUnavailable, ErrorCode
from iop.events import Delta, Error, RuntimeEvent
from iop.managed import BackendState, LlamaCppEndpoint, ManagedLlamaCppAdapter
from iop.runtime import collect_run, new_run_id, open_run_supervisor
from iop.spec import ChatRequest, ExecutionSpec, Message
from iop.testing import (
    CHAT_COMPLETIONS_PATH,
    MODELS_PATH,
    FakeBackend,
    Reply,
    open_fake_backend,
    synthetic_stream,
)

ALIAS = "SmolLM2-135M-Instruct"
# Restarts far apart: each test sees one death and the state after it.
CFG = LlamaCppInstance(
    name="llama",
    supervise=SuperviseSettings(restart_min_s=600.0, restart_max_s=600.0, liveness_interval_s=0),
)
DEADLINES = Deadlines(first_token_timeout_s=10, idle_timeout_s=10, request_timeout_s=30)
KILLED = "the embedded llama.cpp server (pid 4242) exited unexpectedly: killed by SIGKILL"


class FakeServerProcess:
    """One life of the 'server' at ``url``: it serves until ``die`` is set."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.die = trio.Event()

    async def serve(
        self, *, on_exit: Callable[[str], None], task_status: trio.TaskStatus[LlamaCppEndpoint]
    ) -> None:
        task_status.started(
            LlamaCppEndpoint(
                url=self.url, model="m.gguf", alias=ALIAS, pid=4242, load_s=0.1, startup_s=0.2
            )
        )
        await self.die.wait()
        on_exit(KILLED)
        raise BackendUnavailable(f"{KILLED}; last lines of its log:\n  (the tail)")


def spec() -> ExecutionSpec:
    request = ChatRequest(model=ALIAS, messages=[Message(role="user", content="hi")])
    return ExecutionSpec(run_id=new_run_id(), request=request)


async def stream_then(
    adapter: ManagedLlamaCppAdapter, fault: Callable[[], None]
) -> list[RuntimeEvent]:
    """Run one chat; after its second delta, do ``fault``; every event of the run."""
    events: list[RuntimeEvent] = []
    async with open_run_supervisor() as runs:
        run = runs.start_run(adapter, spec(), DEADLINES)
        async with run.events:
            async for ev in run.events:
                events.append(ev)
                if isinstance(ev, Delta) and sum(isinstance(e, Delta) for e in events) == 2:
                    fault()
    return events


async def test_a_run_whose_server_dies_under_it_ends_backend_lost() -> None:
    async with open_fake_backend() as fb, trio.open_nursery() as nursery:
        # The role chunk and three content chunks, then the server goes
        # silent mid-stream.
        body = synthetic_stream(20)
        silent_at = len(b"".join(event + b"\n\n" for event in body.split(b"\n\n")[:4]))
        fb.script(CHAT_COMPLETIONS_PATH, Reply.sse(body, stall_after_bytes=silent_at))
        proc = FakeServerProcess(fb.url)
        adapter = ManagedLlamaCppAdapter(CFG, serve=proc.serve)
        await nursery.start(adapter.supervisor.serve)

        async def kill() -> None:
            await fb.aclose()  # the kernel closes the dead server's sockets ...
            proc.die.set()  # ... and then the process is seen gone

        events = await stream_then(adapter, lambda: nursery.start_soon(kill))
        assert adapter.supervisor.state is not BackendState.UP
        nursery.cancel_scope.cancel()
    await adapter.aclose()

    terminal = events[-1]
    assert isinstance(terminal, Error), terminal
    assert (terminal.status, terminal.code) == (503, ErrorCode.BACKEND_LOST)
    assert terminal.message == f"instance llama: {KILLED}"
    assert sum(isinstance(e, Delta) for e in events) >= 2


async def test_a_broken_stream_from_a_server_that_lives_is_the_runs_own_error() -> None:
    async with open_fake_backend() as fb, trio.open_nursery() as nursery:
        fb.script(CHAT_COMPLETIONS_PATH, Reply.sse(synthetic_stream(20), truncate_after_bytes=1000))
        proc = FakeServerProcess(fb.url)
        adapter = ManagedLlamaCppAdapter(CFG, serve=proc.serve)
        await nursery.start(adapter.supervisor.serve)
        events = await stream_then(adapter, lambda: None)
        assert adapter.supervisor.state is BackendState.UP
        nursery.cancel_scope.cancel()
    await adapter.aclose()

    terminal = events[-1]
    assert isinstance(terminal, Error), terminal
    assert terminal.code == ErrorCode.BACKEND_STREAM_ERROR


def serve_models(fb: FakeBackend) -> None:
    fb.route(MODELS_PATH, Reply.json({"object": "list", "data": [{"id": ALIAS}]}))


async def test_while_the_server_is_down_the_instance_says_why_and_refuses_runs() -> None:
    async with open_fake_backend() as fb, trio.open_nursery() as nursery:
        serve_models(fb)
        proc = FakeServerProcess(fb.url)
        adapter = ManagedLlamaCppAdapter(CFG, serve=proc.serve)
        await nursery.start(adapter.supervisor.serve)
        up = await adapter.capabilities()
        proc.die.set()
        with trio.fail_after(5):
            while adapter.supervisor.state is BackendState.UP:
                await trio.sleep(0.01)
        down = await adapter.capabilities()
        probe = await adapter.probe(ALIAS)
        refused = (await collect_run(adapter, spec(), DEADLINES))[-1]
        nursery.cancel_scope.cancel()
    await adapter.aclose()

    assert (up.adapter, up.provider_status, up.targets) == (
        "llamacpp",
        ProviderStatus.AVAILABLE,
        (ALIAS,),
    )
    assert down.provider_status is ProviderStatus.UNAVAILABLE
    assert down.provider_detail == f"{KILLED}; restarting in 600s"
    assert down.targets == (ALIAS,)  # a known model, unavailable: a 503, not a 404
    assert probe.status is ProviderStatus.UNAVAILABLE
    assert isinstance(refused, Error), refused
    assert (refused.status, refused.code) == (503, ErrorCode.BACKEND_UNAVAILABLE)
    assert refused.message == f"instance llama: {KILLED}; restarting in 600s"
