"""Adapters reading their engine's published load (httpx.MockTransport)."""

from __future__ import annotations

import httpx
import msgspec
import pytest
import trio

from iop.adapters import EngineLoadReader, OpenAICompatAdapter, SimAdapter, VllmAdapter
from iop.config import OpenAICompatInstance, SimConfig, SimInstance, VllmInstance
from iop.errors import BackendHTTPError, BackendProtocolError, BackendTimeout
from iop.sim._engine import Engine
from iop.wire import EngineFigures


def compat(engine: str, **kw: object) -> OpenAICompatInstance:
    return msgspec.convert(
        {"name": "i", "endpoint": "http://engine.test:8080/v1", "engine": engine, **kw},
        OpenAICompatInstance,
    )


def serving(routes: dict[str, httpx.Response]) -> tuple[httpx.MockTransport, list[str]]:
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return routes.get(request.url.path, httpx.Response(404, text="not found"))

    return httpx.MockTransport(handle), seen


async def test_vllm_reads_metrics_at_the_servers_root() -> None:
    page = (
        b"vllm:num_requests_running 2\nvllm:num_requests_waiting 1\nvllm:gpu_cache_usage_perc 0.3\n"
    )
    transport, seen = serving({"/metrics": httpx.Response(200, content=page)})
    cfg = msgspec.convert({"name": "v", "endpoint": "http://engine.test:8000/v1?x=1"}, VllmInstance)
    adapter = VllmAdapter(cfg, transport=transport)
    assert isinstance(adapter, EngineLoadReader)
    assert adapter.load_scrape_interval_s == 1.0
    assert await adapter.engine_load() == EngineFigures(running=2.0, waiting=1.0, kv_usage=0.3)
    assert seen == ["http://engine.test:8000/metrics"]


async def test_sglang_names() -> None:
    page = b"sglang:num_running_reqs 5\nsglang:num_queue_reqs 2\nsglang:token_usage 0.7\n"
    transport, _ = serving({"/metrics": httpx.Response(200, content=page)})
    adapter = OpenAICompatAdapter(compat("sglang"), transport=transport)
    assert await adapter.engine_load() == EngineFigures(running=5.0, waiting=2.0, kv_usage=0.7)


async def test_llamacpp_without_metrics_falls_back_to_slots() -> None:
    slots = b'[{"id":0,"is_processing":true},{"id":1,"is_processing":false}]'
    transport, seen = serving({"/slots": httpx.Response(200, content=slots)})
    adapter = OpenAICompatAdapter(compat("llamacpp"), transport=transport)
    assert await adapter.engine_load() == EngineFigures(running=1.0)
    assert await adapter.engine_load() == EngineFigures(running=1.0)
    # /metrics once (404: started without --metrics), then /slots only.
    assert [u.rsplit("/", 1)[1] for u in seen] == ["metrics", "slots", "slots"]


async def test_llamacpp_metrics_when_enabled() -> None:
    page = b"llamacpp:requests_processing 1\nllamacpp:requests_deferred 4\n"
    transport, _ = serving({"/metrics": httpx.Response(200, content=page)})
    adapter = OpenAICompatAdapter(compat("llamacpp"), transport=transport)
    assert await adapter.engine_load() == EngineFigures(running=1.0, waiting=4.0)


async def test_llamacpp_slots_garbage_fails_the_scrape() -> None:
    transport, _ = serving({"/slots": httpx.Response(200, content=b"<html>")})
    adapter = OpenAICompatAdapter(compat("llamacpp"), transport=transport)
    with pytest.raises(BackendProtocolError):
        await adapter.engine_load()


async def test_a_failing_page_is_a_backend_error() -> None:
    transport, _ = serving({"/metrics": httpx.Response(503, text="busy")})
    adapter = OpenAICompatAdapter(compat("vllm"), transport=transport)
    with pytest.raises(BackendHTTPError):
        await adapter.engine_load()


async def test_a_page_over_the_limit_fails_the_scrape() -> None:
    huge = b"# " + b"x" * 4096 + b"\n"
    transport, _ = serving({"/metrics": httpx.Response(200, content=huge)})
    adapter = OpenAICompatAdapter(compat("vllm", load_scrape_max_bytes=1024), transport=transport)
    with pytest.raises(BackendProtocolError, match="load_scrape_max_bytes"):
        await adapter.engine_load()


async def test_a_silent_engine_times_out(autojump_clock: trio.testing.MockClock) -> None:
    class Silent(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            await trio.sleep_forever()
            raise AssertionError  # pragma: no cover

    adapter = OpenAICompatAdapter(compat("vllm", load_scrape_timeout_s=0.5), transport=Silent())
    with pytest.raises(BackendTimeout):
        await adapter.engine_load()


def test_no_engine_no_scrape() -> None:
    assert OpenAICompatAdapter(compat("none")).load_scrape_interval_s == 0.0
    sim = SimAdapter(msgspec.convert({"name": "s"}, SimInstance))
    assert not isinstance(sim, EngineLoadReader)


def test_bad_scrape_settings_are_refused() -> None:
    with pytest.raises(msgspec.ValidationError, match="load_scrape_interval_s"):
        compat("vllm", load_scrape_interval_s=-1)
    with pytest.raises(msgspec.ValidationError, match="load_scrape_max_bytes"):
        compat("vllm", load_scrape_max_bytes=10)
    with pytest.raises(msgspec.ValidationError, match="engine"):
        compat("tgi")


async def test_a_backend_with_no_metrics_page_keeps_its_connection() -> None:
    """A 404 to every scrape (a server that is not the engine it was said
    to be, or a fake one) must not cost a connection each time: its short
    body is read, and the connection goes back to the pool."""
    from iop.testing import open_fake_backend

    async with open_fake_backend() as fb:
        cfg = msgspec.convert({"name": "v", "endpoint": fb.url + "/v1"}, VllmInstance)
        adapter = VllmAdapter(cfg)
        try:
            for _ in range(3):
                with pytest.raises(BackendHTTPError):
                    await adapter.engine_load()
        finally:
            await adapter.aclose()
        assert [r.path for r in fb.requests] == ["/metrics"] * 3
        assert len(fb.connections) == 1


async def test_vllm_reads_the_cache_size_from_the_sims_metrics() -> None:
    """The sim's ``/metrics`` (its engine model) publishes vLLM's
    ``cache_config_info``; the vLLM adapter reads the cache size off it."""
    page = Engine(SimConfig(kv_cache_blocks=96, kv_block_tokens=16)).metrics("m")
    transport, _ = serving({"/metrics": httpx.Response(200, content=page)})
    cfg = msgspec.convert({"name": "v", "endpoint": "http://engine.test:8000/v1"}, VllmInstance)
    figures = await VllmAdapter(cfg, transport=transport).engine_load()
    assert figures.cache_tokens == 96 * 16
    assert figures.running == 0.0


async def test_vllm_reads_the_kv_events_the_server_serves_on_from_the_last() -> None:
    """With ``kv_events_path`` each scrape reads the batches after the last
    one it applied, and reports what the cache holds; garbage there fails
    the scrape as the engine's fault."""
    from iop.wire._kv_events import (
        AllBlocksCleared,
        BlockStored,
        KVEventBatch,
        encode_kv_events,
    )

    stored = encode_kv_events(
        KVEventBatch(ts=0.0, events=[BlockStored([1, 2], None, [0] * 32, 16)])
    )
    cleared = encode_kv_events(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
    pages = [
        msgspec.msgpack.encode([[0, stored]]),
        msgspec.msgpack.encode([[1, cleared]]),
        b"\x91\x01",
    ]
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, content=Engine(SimConfig(kv_cache_blocks=8)).metrics("m"))
        seen.append(str(request.url.query, "ascii"))
        return httpx.Response(200, content=pages[len(seen) - 1])

    cfg = msgspec.convert(
        {"name": "v", "endpoint": "http://engine.test:8000/v1", "kv_events_path": "/kv_events"},
        VllmInstance,
    )
    adapter = VllmAdapter(cfg, transport=httpx.MockTransport(handle))
    assert (await adapter.engine_load()).cached_tokens == 32
    assert (await adapter.engine_load()).cached_tokens == 0
    with pytest.raises(BackendProtocolError, match="/kv_events"):
        await adapter.engine_load()
    assert seen == ["after=-1", "after=0", "after=1"]
    with pytest.raises(msgspec.ValidationError, match="kv_events_path must start with /"):
        msgspec.convert(
            {"name": "v", "endpoint": "http://e.test/v1", "kv_events_path": "kv"}, VllmInstance
        )
