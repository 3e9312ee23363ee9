"""Models on demand with the real llama.cpp server (xllamacpp + SmolLM2-135M).

Two on-demand models of the packaged GGUF under two names with different
``ctx`` (so two different server processes), and a node budget for one:
loading the second unloads the first. Skipped where the real backend cannot
run, failed instead under ``IOP_REQUIRE_REAL_BACKEND=1``
(``tests/e2e/_platform.py``, ``require_real_backend``).
"""

from __future__ import annotations

import logging

import httpx
import msgspec
import pytest
import trio

from iop.config import LlamaCppModel, NodeSection
from iop.managed import ManagedLlamaCppAdapter
from iop.node._models import ModelManager
from iop.ondemand import ModelState
from tests.e2e._platform import require_real_backend

# A model load of the 135M model takes 0.5-6 s here; a minute is a stuck one.
LOAD_TIMEOUT_S = 60.0


def smol(name: str, ctx: int) -> LlamaCppModel:
    return msgspec.convert(
        {
            "engine": "llamacpp",
            "name": name,
            "memory_mib": 600,
            "ctx": ctx,
            "parallel": 1,
            "cache_ram_mib": 0,
            "supervise": {"liveness_interval_s": 0},
        },
        LlamaCppModel,
    )


async def n_ctx(client: httpx.AsyncClient, url: str) -> int:
    resp = await client.get(f"{url}/props")
    resp.raise_for_status()
    return int(resp.json()["default_generation_settings"]["n_ctx"])


async def test_loading_a_second_model_over_the_budget_unloads_the_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    require_real_backend()
    caplog.set_level(logging.INFO, "iop.node.models")
    mgr = ModelManager(
        [smol("smol-a", 512), smol("smol-b", 1024)], [], NodeSection(memory_mib=1000)
    )
    async with trio.open_nursery() as nursery, httpx.AsyncClient(timeout=5.0) as client:
        await nursery.start(mgr.serve)
        lease = await mgr.acquire("smol-a", LOAD_TIMEOUT_S)
        assert isinstance(lease.adapter, ManagedLlamaCppAdapter)
        life = lease.adapter.supervisor.life
        assert life is not None
        assert life.endpoint is not None
        url_a = life.endpoint.url
        caps = await lease.adapter.capabilities()
        assert caps.provider_status == "available"
        assert caps.targets == ("smol-a",)  # the server answers to the model's name
        assert await n_ctx(client, url_a) == 512
        mgr.release(lease)

        lease = await mgr.acquire("smol-b", LOAD_TIMEOUT_S)
        assert mgr.table.models["smol-a"].state is ModelState.COLD
        assert mgr.table.models["smol-b"].state is ModelState.READY
        life = lease.adapter.supervisor.life  # type: ignore[attr-defined]
        url_b = life.endpoint.url
        # Another process: its own context size.
        assert await n_ctx(client, url_b) == 1024
        if url_b != url_a:  # the kernel may hand a's freed port to b
            # The first server is gone: it was stopped before b started.
            with pytest.raises(httpx.ConnectError):
                await client.get(f"{url_a}/health")
        mgr.release(lease)
        nursery.cancel_scope.cancel()
    messages = [r.getMessage() for r in caplog.records]
    assert "model smol-a: unloading: evicted for smol-b" in messages
    assert any(
        m.startswith("model smol-b: loading (600 MiB of 1000; evicting smol-a)") for m in messages
    )
