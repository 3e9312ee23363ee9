"""What the vLLM adapter tells its backend of a run's objective priority
(``ExecutionSpec.priority``; docs/operations.md, "Engine priority"), read
off a ``FakeBackend`` on a loopback socket.

With ``engine_priority`` the run's priority goes as the body's ``priority``,
negated (vLLM serves lower values first), in place of any the client sent,
and the instance advertises it; without it nothing is added (vLLM refuses a
non-zero ``priority`` unless started with ``--scheduling-policy priority``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from iop.adapters.vllm import VllmAdapter
from iop.config import VllmInstance
from iop.events import Complete
from iop.runtime import collect_run
from iop.spec import ExecutionSpec
from iop.testing import CHAT_COMPLETIONS_PATH, FakeBackend, Reply, open_fake_backend
from tests.adapters.test_cache_salt import CHAT_SSE, DEADLINES, chat


@pytest.fixture
async def fb() -> AsyncIterator[FakeBackend]:
    async with open_fake_backend() as backend:
        backend.route(CHAT_COMPLETIONS_PATH, Reply.sse(CHAT_SSE))
        backend.route("/v1/models", Reply.json({"object": "list", "data": [{"id": "m"}]}))
        yield backend


async def body_of(fb: FakeBackend, *, engine_priority: bool, spec: ExecutionSpec) -> dict:  # type: ignore[type-arg]
    adapter = VllmAdapter(VllmInstance(name="v", endpoint=fb.url, engine_priority=engine_priority))
    try:
        events = await collect_run(adapter, spec, DEADLINES)
    finally:
        await adapter.aclose()
    assert isinstance(events[-1], Complete), events
    body: dict = json.loads(fb.requests[-1].body)  # type: ignore[type-arg]
    return body


async def test_the_runs_priority_goes_negated_and_wins_over_the_clients(fb: FakeBackend) -> None:
    spec = ExecutionSpec(run_id="r1", request=chat(priority=-99), priority=10)
    assert (await body_of(fb, engine_priority=True, spec=spec))["priority"] == -10
    low = ExecutionSpec(run_id="r2", request=chat(), priority=0)
    assert (await body_of(fb, engine_priority=True, spec=low))["priority"] == 0


async def test_without_engine_priority_nothing_is_added(fb: FakeBackend) -> None:
    spec = ExecutionSpec(run_id="r1", request=chat(), priority=10)
    assert "priority" not in await body_of(fb, engine_priority=False, spec=spec)


async def test_the_instance_advertises_it(fb: FakeBackend) -> None:
    for on in (True, False):
        adapter = VllmAdapter(VllmInstance(name="v", endpoint=fb.url, engine_priority=on))
        try:
            assert (await adapter.capabilities()).engine_priority is on
        finally:
            await adapter.aclose()
