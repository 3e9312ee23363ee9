"""The sim's engine model (iop.sim._engine): the prefix cache, prefill time, the
running batch and vLLM's metrics, sans-IO and over a real loopback socket."""

from __future__ import annotations

import httpx
import msgspec
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from iop.config import SimConfig
from iop.sim import build_script, parse_chat_request, stream_plan
from iop.sim._engine import Admission, Engine, PrefixCache, block_hashes
from iop.sim._server import SimStats, _EngineRun, _stream_body
from tests.sim.test_sim_server import WAIT_S, chat, running_sim

ENGINE = SimConfig(
    ttft_s=0.01,
    output_tokens=4,
    kv_cache_blocks=256,
    kv_block_tokens=4,
    prefill_tokens_per_s=1000.0,
)


def test_blocks_are_named_by_their_whole_prefix() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = block_hashes([1, 2, 3, 4, 5, 6, 7, 9], 4)
    c = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2  # the 9th token is no full block
    assert a[0] == b[0]
    assert a[1] != b[1]
    # A different first block makes every later block different too.
    assert not set(a) & set(c)


def test_the_cache_evicts_the_least_recently_used_blocks() -> None:
    cache = PrefixCache(3)
    cache.insert([b"a", b"b", b"c"])
    assert cache.cached_blocks([b"a", b"b", b"c"]) == 3
    cache.insert([b"a"])  # a is now the most recent
    cache.insert([b"d"])  # b goes
    assert cache.cached_blocks([b"a"]) == 1
    assert cache.cached_blocks([b"a", b"b"]) == 1
    assert len(cache) == 3


@given(
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=40), min_size=1, max_size=8),
    capacity=st.integers(0, 12),
)
def test_a_hit_is_a_whole_number_of_leading_blocks(prompts: list[list[int]], capacity: int) -> None:
    engine = Engine(SimConfig(kv_cache_blocks=capacity, kv_block_tokens=4))
    for prompt in prompts:
        got = engine.admit(prompt, engine.config)
        assert got.cached_tokens % 4 == 0
        assert 0 <= got.cached_tokens <= len(prompt) // 4 * 4
        assert len(engine.cache) <= capacity
    assert engine.prefix_cache_hits <= engine.prefix_cache_queries == sum(map(len, prompts))


def test_a_repeated_prompt_is_cached_and_prefills_only_its_tail() -> None:
    engine = Engine(ENGINE)
    prompt = list(range(10))
    first = engine.admit(prompt, ENGINE)
    second = engine.admit(prompt, ENGINE)
    assert (first.cached_tokens, second.cached_tokens) == (0, 8)
    assert first.prefill_s == 10 / 1000.0
    assert second.prefill_s == 2 / 1000.0
    # A request holds its prompt and answer's blocks while it runs.
    assert second.blocks == 4  # ceil((10 + 4) / 4)


async def test_the_batch_is_bounded_and_its_usage_shown() -> None:
    engine = Engine(
        SimConfig(output_tokens=4, kv_cache_blocks=8, kv_block_tokens=4, max_num_seqs=1)
    )
    a = engine.admit(list(range(8)), engine.config)
    b = engine.admit(list(range(8)), engine.config)
    async with trio.open_nursery() as nursery:
        seated = trio.Event()
        release = trio.Event()

        async def hold() -> None:
            async with engine.seat(a):
                seated.set()
                await release.wait()

        async def second() -> None:
            async with engine.seat(b):
                pass

        nursery.start_soon(hold)
        await seated.wait()
        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        assert (engine.running, engine.waiting) == (1, 1)
        assert engine.kv_cache_usage == a.blocks / 8
        families = {f.name: f for f in text_string_to_metric_families(engine.metrics("m").decode())}
        assert families["vllm:num_requests_waiting"].samples[0].value == 1.0
        assert families["vllm:num_requests_running"].samples[0].labels == {"model_name": "m"}
        release.set()
    assert (engine.running, engine.waiting, engine.held_blocks) == (0, 0, 0)


async def test_decode_slows_with_the_batch_and_prefill_delays_the_first_token(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = SimConfig(
        ttft_s=0.1,
        tokens_per_s=10.0,
        output_tokens=3,
        prefill_tokens_per_s=100.0,
        decode_slowdown=0.5,
    )
    engine = Engine(cfg)
    request = parse_chat_request(msgspec_encode(chat(stream=True)))
    script = build_script(request, cfg)
    plan = stream_plan(script, created=0, include_usage=False)
    admission = engine.admit(list(range(50)), cfg)  # 50 uncached tokens: 0.5 s of prefill
    engine.running = 1  # another request is running
    run = _EngineRun(engine, admission, cfg)
    times = []
    start = trio.current_time()
    async for _ in _stream_body(plan, SimStats(), run):
        times.append(trio.current_time() - start)
    # First frame: ttft + prefill. Next tokens: 0.1 s each, stretched by 1 + 0.5 * (2 - 1).
    assert abs(times[0] - 0.6) < 1e-9
    assert abs((times[2] - times[1]) - 0.15) < 1e-9


def msgspec_encode(body: object) -> bytes:
    import msgspec

    return msgspec.json.encode(body)


async def test_over_http_the_second_turn_reuses_the_first_ones_prefix() -> None:
    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    first = [system, {"role": "user", "content": "What is 2 + 2?"}]
    again = [system, {"role": "user", "content": "And 3 + 3?"}]
    async with running_sim(ENGINE) as (app, url), httpx.AsyncClient(timeout=WAIT_S) as client:
        answers = []
        for messages in (first, again):
            resp = await client.post(
                f"{url}/v1/chat/completions", json=chat(messages=messages, stream=False)
            )
            assert resp.status_code == 200
            answers.append(resp.json()["usage"])
        assert answers[0]["prompt_tokens_details"] == {"cached_tokens": 0}
        cached = answers[1]["prompt_tokens_details"]["cached_tokens"]
        # The whole system prompt's full blocks, not the new user turn.
        assert 0.8 * answers[1]["prompt_tokens"] < cached < answers[1]["prompt_tokens"]
        metrics = (await client.get(f"{url}/metrics")).text
        families = {f.name: f for f in text_string_to_metric_families(metrics)}
        assert families["vllm:prefix_cache_hits"].samples[0].value == cached
        assert app.engine.running == 0
        # The engine's shape is the server's: no request may change it.
        refused = await client.post(
            f"{url}/v1/chat/completions", json=chat(iop_sim={"kv_cache_blocks": 1})
        )
        assert refused.status_code == 400
        assert "kv_cache_blocks" in refused.json()["error"]["message"]
        # Nor where its cache's events go (iop/sim/_kv_publisher.py).
        refused = await client.post(
            f"{url}/v1/chat/completions",
            json=chat(iop_sim={"kv_events_endpoint": "tcp://127.0.0.1:5557"}),
        )
        assert refused.status_code == 400
        assert "kv_events_endpoint" in refused.json()["error"]["message"]


async def test_without_the_engine_keys_nothing_changes() -> None:
    async with running_sim() as (app, url), httpx.AsyncClient(timeout=WAIT_S) as client:
        resp = await client.post(f"{url}/v1/chat/completions", json=chat())
        assert resp.json()["usage"]["prompt_tokens_details"] is None
        assert not app.engine.enabled


def test_a_salt_keeps_equal_prompts_apart() -> None:
    """vLLM's ``cache_salt`` is hashed into the first block, so every block
    of a salted prompt differs from the same prompt's under another salt
    (https://docs.vllm.ai/en/latest/design/prefix_caching/)."""
    engine = Engine(ENGINE)
    prompt = list(range(10))
    assert engine.admit(prompt, ENGINE, salt="a").cached_tokens == 0
    assert engine.admit(prompt, ENGINE, salt="b").cached_tokens == 0
    assert engine.admit(prompt, ENGINE).cached_tokens == 0
    assert engine.admit(prompt, ENGINE, salt="a").cached_tokens == 8
    assert not set(block_hashes(prompt, 4, "a")) & set(block_hashes(prompt, 4, "b"))
    assert block_hashes(prompt, 4, "") == block_hashes(prompt, 4)


async def test_over_http_a_salt_is_its_own_cache_and_must_not_be_empty() -> None:
    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    messages = [system, {"role": "user", "content": "What is 2 + 2?"}]
    async with running_sim(ENGINE) as (_, url), httpx.AsyncClient(timeout=WAIT_S) as client:

        async def cached(**salt: object) -> int:
            resp = await client.post(
                f"{url}/v1/chat/completions", json=chat(messages=messages, **salt)
            )
            assert resp.status_code == 200, resp.text
            return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

        assert await cached(cache_salt="tenant-a") == 0
        assert await cached(cache_salt="tenant-b") == 0
        assert await cached() == 0
        assert await cached(cache_salt="tenant-a") > 0
        # vLLM's check (``check_cache_salt_support``): a non-empty string.
        for bad in ("", 7):
            refused = await client.post(
                f"{url}/v1/chat/completions", json=chat(messages=messages, cache_salt=bad)
            )
            assert refused.status_code == 400
            assert "cache_salt" in refused.json()["error"]["message"]


async def test_kv_cache_usage_counts_a_shared_prefix_once() -> None:
    """Two running requests of one prompt hold its prompt blocks once (vLLM
    shares a cached prefix's blocks between requests), plus each its own
    output blocks: usage is not the sum of their footprints."""
    engine = Engine(SimConfig(kv_cache_blocks=100, kv_block_tokens=4, output_tokens=4))
    a = engine.admit(list(range(16)), engine.config)  # 4 prompt blocks + 1 of output
    b = engine.admit(list(range(16)), engine.config)
    assert a.blocks == b.blocks == 5
    async with engine.seat(a), engine.seat(b):
        assert engine.held_blocks == 4 + 1 + 1
        assert engine.kv_cache_usage == 6 / 100
    assert engine.held_blocks == 0
    assert engine.kv_cache_usage == 0.0


@given(
    capacity=st.integers(min_value=1, max_value=6),
    prompts=st.lists(st.lists(st.integers(0, 3), max_size=24), max_size=25),
    clear_at=st.integers(min_value=-1, max_value=25),
)
def test_the_caches_events_name_exactly_what_it_holds(
    capacity: int, prompts: list[list[int]], clear_at: int
) -> None:
    """The sim publishes its cache's changes as vLLM's KV events: replayed
    in order, they name exactly the blocks it holds (none it evicted), and
    their count is its size."""
    from iop.wire._kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        CacheMirror,
        decode_kv_events,
    )

    cache = PrefixCache(capacity)
    for i, ids in enumerate(prompts):
        if i == clear_at:
            cache.clear()
        cache.insert(block_hashes(ids, 4), ids, 4)
    named: set[bytes] = set()
    mirror = CacheMirror()
    for seq, payload in cache.events_after(-1, 10_000):
        batch = decode_kv_events(payload)
        mirror.apply(seq, batch)
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == 4 * len(event.block_hashes)
                named.update(event.block_hashes)  # type: ignore[arg-type]
            elif isinstance(event, BlockRemoved):
                named.difference_update(event.block_hashes)  # type: ignore[arg-type]
            else:
                assert isinstance(event, AllBlocksCleared)
                named.clear()
    assert named == set(cache._blocks)
    assert mirror.blocks == len(cache)


async def test_the_sim_serves_its_kv_events_and_resets_its_cache() -> None:
    """``GET /kv_events`` and ``POST /reset_prefix_cache`` over a real socket."""
    from iop.wire._kv_events import AllBlocksCleared, CacheMirror, decode_kv_events

    async with (
        running_sim(ENGINE) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client,
    ):
        words = [{"role": "user", "content": "a fairly long prompt of many words " * 4}]
        resp = await client.post("/v1/chat/completions", json=chat(messages=words, stream=False))
        assert resp.status_code == 200
        answer = await client.get("/kv_events", params={"after": -1})
        assert answer.headers["content-type"] == "application/msgpack"
        mirror = CacheMirror()
        for seq, payload in msgspec.msgpack.decode(answer.content):
            mirror.apply(seq, decode_kv_events(payload))
        assert mirror.blocks > 0
        assert (await client.post("/reset_prefix_cache")).status_code == 200
        answer = await client.get("/kv_events", params={"after": mirror.last_seq})
        ((seq, payload),) = msgspec.msgpack.decode(answer.content)
        assert decode_kv_events(payload).events == [AllBlocksCleared()]
        mirror.apply(seq, decode_kv_events(payload))
        assert mirror.blocks == 0
        assert (await client.get("/kv_events", params={"after": "x"})).status_code == 400


def test_a_page_of_kv_events_stays_within_its_byte_budget() -> None:
    """Batches of long prompts carry their token ids: 256 of them made a
    /kv_events answer of megabytes, past the node's page limit
    (``load_scrape_max_bytes``, 1 MiB), and the node's every scrape of that
    engine failed from then on. A page stops at its byte budget (at least
    one batch, so a reader always gets on), and the next page goes on."""
    from iop.sim._engine import KV_EVENTS_ANSWER_BYTES

    cache = PrefixCache(capacity=64)
    for i in range(40):
        ids = [(1 << 40) + i * 10_000 + t for t in range(2048)]  # toy ids: 9 bytes each
        cache.insert(block_hashes(ids, 16), ids, 16)
    page = cache.events_after(-1, 256, max_bytes=KV_EVENTS_ANSWER_BYTES)
    assert 1 <= len(page) < 40
    assert sum(len(p) for _, p in page) <= KV_EVENTS_ANSWER_BYTES
    assert cache.events_after(-1, 256, max_bytes=1)[0][0] == 0  # one, however big
    rest = cache.events_after(page[-1][0], 256, max_bytes=10**9)
    assert [n for n, _ in page + rest] == list(range(40))


# --- the priority scheduling policy (vLLM's --scheduling-policy priority) ------

POLICY = SimConfig(ttft_s=0.1, tokens_per_s=10.0, output_tokens=6, max_num_seqs=1)


async def _stream_times(
    engine: Engine, cfg: SimConfig, priority: int, times: list[float], text: list[str]
) -> None:
    """Stream one answer through ``engine`` at ``priority``; note when each
    frame came (from the engine's start) and the content it carried."""
    body = chat(stream=True, priority=priority)
    request = parse_chat_request(msgspec_encode(body))
    plan = stream_plan(build_script(request, cfg), created=0, include_usage=False)
    run = _EngineRun(engine, engine.admit(list(range(8)), cfg), cfg, priority=priority)
    async for frame in _stream_body(plan, SimStats(), run):
        times.append(trio.current_time())
        if frame.startswith(b"data: {"):
            delta = msgspec.json.decode(frame[6:])["choices"][0]["delta"]
            text.append(delta.get("content") or "")


async def _low_then_high(cfg: SimConfig) -> tuple[list[float], list[float], list[str], Engine]:
    """A priority-0 stream, then a priority -10 one 0.35 s later (after the
    first one's second token) on a batch of one."""
    engine = Engine(cfg)
    low: list[float] = []
    high: list[float] = []
    low_text: list[str] = []
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stream_times, engine, cfg, 0, low, low_text)
        await trio.sleep(0.35)
        nursery.start_soon(_stream_times, engine, cfg, -10, high, [])
    return [t - start for t in low], [t - start for t in high], low_text, engine


async def test_priority_a_better_arrival_preempts_the_running_one_which_resumes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = msgspec.structs.replace(POLICY, scheduling_policy="priority")
    low, high, low_text, engine = await _low_then_high(cfg)
    # The better request runs at once: its first token one TTFT after it came.
    assert abs(high[0] - 0.45) < 1e-9
    # The preempted one sent nothing while the other ran (0.35 .. 1.05 s)...
    assert not [t for t in low if 0.35 < t < high[-1]]
    # ... then paid its prefill again (ttft 0.1 s) and the token it lost,
    # and went on where it stopped: its whole answer, each token once.
    after = [t for t in low if t >= high[-1]]
    assert abs(after[0] - (high[-1] + 0.1 + 0.1)) < 1e-9
    _, _, unloaded_text, _ = await _low_then_high(POLICY)
    assert "".join(low_text) == "".join(unloaded_text)
    assert len(low) == len(high)
    assert engine.preemptions == 1
    families = {f.name: f for f in text_string_to_metric_families(engine.metrics("m").decode())}
    assert families["vllm:num_preemptions"].samples[0].value == 1.0
    assert (engine.running, engine.waiting) == (0, 0)


async def test_fcfs_a_better_arrival_waits_for_the_batch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    low, high, _, engine = await _low_then_high(POLICY)
    # No preemption: the second waits for the first to end.
    assert high[0] > low[-1]
    assert engine.preemptions == 0


async def test_priority_the_worst_and_then_the_newest_is_preempted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = SimConfig(max_num_seqs=3, scheduling_policy="priority")
    engine = Engine(cfg)
    admission = engine.admit([1, 2, 3], cfg)
    async with (
        engine.seat(admission, priority=0) as older,
        engine.seat(admission, priority=0) as newer,
        engine.seat(admission, priority=-5) as better,
    ):
        assert older.running
        assert newer.running
        assert better.running
        async with engine.seat(admission, priority=-10) as best:
            # The newest of the worst priority gave its place.
            assert best.running
            assert not newer.running
            assert older.running
            assert better.running
            assert (engine.running, engine.waiting) == (3, 1)
            # A request no better than the worst running waits, preempting none.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_enter_and_leave, engine, admission, 0)
                await trio.testing.wait_all_tasks_blocked()
                assert engine.preemptions == 1
                assert (engine.running, engine.waiting) == (3, 2)
                nursery.cancel_scope.cancel()
        # The best left: the preempted one runs again before the later arrival.
        assert newer.running
    assert (engine.running, engine.waiting, engine.held_blocks) == (0, 0, 0)


async def _enter_and_leave(engine: Engine, admission: Admission, priority: int) -> None:
    async with engine.seat(admission, priority=priority):
        pass


async def test_over_http_priority_needs_the_priority_policy() -> None:
    """vLLM refuses a non-zero ``priority`` unless started with
    ``--scheduling-policy priority`` (docs/operations.md, "Engine priority")."""
    fcfs = SimConfig(ttft_s=0.0, output_tokens=2, max_num_seqs=2)
    async with running_sim(fcfs) as (_, url), httpx.AsyncClient(timeout=WAIT_S) as client:
        refused = await client.post(f"{url}/v1/chat/completions", json=chat(priority=-10))
        assert refused.status_code == 400
        assert refused.json()["error"]["message"] == (
            "Got priority -10 but Priority scheduling is not enabled."
        )
        ok = await client.post(f"{url}/v1/chat/completions", json=chat(priority=0))
        assert ok.status_code == 200
    policy = msgspec.structs.replace(fcfs, scheduling_policy="priority")
    async with running_sim(policy) as (_, url), httpx.AsyncClient(timeout=WAIT_S) as client:
        ok = await client.post(f"{url}/v1/chat/completions", json=chat(priority=-10))
        assert ok.status_code == 200
        bad = await client.post(f"{url}/v1/chat/completions", json=chat(priority="high"))
        assert bad.status_code == 400
