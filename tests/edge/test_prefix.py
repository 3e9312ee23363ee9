"""Prefix-aware placement (iop.edge.scheduler._prefix and the scheduler's ``prefix``
placement): prompt blocks, the bounded index, and where runs go, over
in-memory links in virtual time."""

from __future__ import annotations

import tracemalloc

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from iop.config import SchedulerSettings
from iop.edge import open_edge_core
from iop.edge.scheduler._prefix import ENTRY_BYTES, PrefixIndex, prompt_blocks
from iop.events import CancelReason
from iop.sim._engine import PrefixCache
from iop.spec import ChatRequest, CompletionRequest, EmbeddingRequest, ExecutionSpec, Message
from tests.edge.test_core import caps, config, connect, drain_events

SYSTEM = "You are the support agent of ACME. Answer briefly and politely. " * 20


def chat(system: str, user: str) -> ChatRequest:
    return ChatRequest(
        model="m",
        messages=[Message(role="system", content=system), Message(role="user", content=user)],
    )


def test_turns_of_one_conversation_share_their_leading_blocks() -> None:
    a = prompt_blocks(chat(SYSTEM, "Where is my order?"), 64)
    b = prompt_blocks(chat(SYSTEM, "Can I return a toaster?"), 64)
    other = prompt_blocks(chat("You are a poet. " * 80, "Where is my order?"), 64)
    shared = 0
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    # Every block the system prompt fills; the turns differ only at the end.
    assert shared >= len(SYSTEM) // 64 - 1
    assert not set(a) & set(other)
    completion = CompletionRequest(model="m", prompt=SYSTEM)
    assert len(prompt_blocks(completion, 64)) == len(SYSTEM) // 64
    assert prompt_blocks(EmbeddingRequest(model="m", inputs=["x"]), 64) == []


def test_the_index_matches_leading_blocks_and_forgets_a_node() -> None:
    index = PrefixIndex(max_bytes=100 * ENTRY_BYTES)
    index.routed(("n1", "i"), [b"a", b"b", b"c"])
    assert index.matched(("n1", "i"), [b"a", b"b", b"x", b"c"]) == 2
    assert index.matched(("n2", "i"), [b"a"]) == 0
    index.forget("n1")
    assert len(index) == 0


def test_the_index_is_bounded_least_recently_routed_first() -> None:
    index = PrefixIndex(max_bytes=4 * ENTRY_BYTES)
    index.routed(("n", "i"), [b"1", b"2", b"3"])
    index.routed(("n", "i"), [b"1"])  # 1 is now the most recent
    index.routed(("n", "i"), [b"4", b"5"])  # 2 goes
    assert len(index) == 4
    assert index.evicted == 1
    assert index.matched(("n", "i"), [b"1"]) == 1
    assert index.matched(("n", "i"), [b"2"]) == 0
    assert PrefixIndex(max_bytes=ENTRY_BYTES - 1).max_entries == 0


def test_an_entry_costs_at_most_entry_bytes() -> None:
    index = PrefixIndex(max_bytes=10**9)
    blocks = prompt_blocks(
        ChatRequest(model="m", messages=[Message(role="user", content="x" * 64 * 5000)]), 64
    )
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    index.routed(("node-with-a-long-id", "instance"), blocks)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert len(index) == len(blocks) >= 4000
    assert grown / len(index) <= ENTRY_BYTES


def prefix_config(**sched: object) -> object:
    return config(
        scheduler=SchedulerSettings(
            max_queue=8,
            queue_timeout_s=5.0,
            placement="prefix",
            **sched,  # type: ignore[arg-type]
        )
    )


def spec(request: ChatRequest, run_id: str) -> ExecutionSpec:
    return ExecutionSpec(run_id=run_id, request=request)


async def test_a_shared_prefix_goes_back_to_the_instance_that_holds_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_edge_core(prefix_config()) as core, trio.open_nursery() as nursery:  # type: ignore[arg-type]
        a = await connect(core, nursery, [caps(slots=4)], "a")
        await connect(core, nursery, [caps(slots=4)], "b")
        runs = []
        for i, (system, user) in enumerate(
            [(SYSTEM, "one"), ("You are a poet. " * 80, "two"), (SYSTEM, "three"), (SYSTEM, "four")]
        ):
            runs.append(core.start_run(spec(chat(system, user), f"r{i}")))
            await trio.testing.wait_all_tasks_blocked()
        where = {r: ("a" if r in a.assigned else "b") for r in ("r0", "r1", "r2", "r3")}
        # The poet went to the idle instance; both later support turns followed
        # the first, although it was the busier one by then.
        assert where["r1"] != where["r0"]
        assert where["r2"] == where["r3"] == where["r0"]
        placed = runs[2].timeline.placements[0]
        assert placed.why.startswith("prefix: best score")
        assert set(placed.scores) == {"a/i0", "b/i0"}
        assert placed.scores[f"{where['r0']}/i0"] > placed.scores[f"{where['r1']}/i0"]
        for r in runs:
            r.cancel(CancelReason.CLIENT_DISCONNECT)
            await drain_events(r)
        nursery.cancel_scope.cancel()


async def test_too_much_load_on_the_warm_instance_turns_placement_to_least_loaded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = prefix_config(balance_load_threshold=0.25, balance_rel_threshold=1.5, load_weight=0.0)
    async with open_edge_core(cfg) as core, trio.open_nursery() as nursery:  # type: ignore[arg-type]
        a = await connect(core, nursery, [caps(slots=8)], "a")
        await connect(core, nursery, [caps(slots=8)], "b")
        runs = []
        for i in range(5):
            runs.append(core.start_run(spec(chat(SYSTEM, f"q{i}"), f"r{i}")))
            await trio.testing.wait_all_tasks_blocked()
        first = "a" if "r0" in a.assigned else "b"
        # With no weight on load the prefix wins until the loads are more
        # than a quarter of the 8 slots apart (3 runs, and more than 1.5
        # times): then the idle instance takes one.
        whys = [r.timeline.placements[0].why for r in runs]
        assert whys[3] == "least-loaded: in flight 3/8 against 0/8"
        assert ("a" if "r3" in a.assigned else "b") != first
        for r in runs:
            r.cancel(CancelReason.CLIENT_DISCONNECT)
            await drain_events(r)
        nursery.cancel_scope.cancel()


async def test_the_balance_rule_weighs_the_preferred_instance_not_the_busiest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Three instances of 8 slots, the default thresholds (half the slots,
    # and 1.5 times). One prefix piles 5 runs on a, the support prompt has
    # one run on b, c is idle: the cluster is out of balance (5 against 0),
    # but the support prompt's instance is not (1 against 0). Its next turn
    # goes to b, where its prefix is; the pile's next run goes to c.
    poet = "You are a poet. " * 80
    async with open_edge_core(prefix_config()) as core, trio.open_nursery() as nursery:  # type: ignore[arg-type]
        nodes = {n: await connect(core, nursery, [caps(slots=8)], n) for n in "abc"}
        runs = []
        for i, (system, user) in enumerate(
            [
                (poet, "p0"),
                (SYSTEM, "s0"),
                *[(poet, f"p{k}") for k in range(1, 5)],
                (SYSTEM, "s1"),
                (poet, "p5"),
            ]
        ):
            runs.append(core.start_run(spec(chat(system, user), f"r{i}")))
            await trio.testing.wait_all_tasks_blocked()
        where = [next(n for n, fake in nodes.items() if f"r{i}" in fake.assigned) for i in range(8)]
        assert where[:6] == ["a", "b", "a", "a", "a", "a"]
        assert where[6] == "b"
        assert runs[6].timeline.placements[0].why.startswith("prefix: best score")
        assert where[7] == "c"
        assert runs[7].timeline.placements[0].why == "least-loaded: in flight 5/8 against 0/8"
        # The scores that lost to the balance rule are still shown.
        assert set(runs[7].timeline.placements[0].scores) == {"a/i0", "b/i0", "c/i0"}
        for r in runs:
            r.cancel(CancelReason.CLIENT_DISCONNECT)
            await drain_events(r)
        nursery.cancel_scope.cancel()


async def test_the_balance_threshold_is_a_share_of_the_slots(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Two instances of 16 slots: one prompt's runs stay with its prefix
    # while they are up to half the slots (8 runs) ahead of the idle
    # instance; the tenth goes to the idle one. (A threshold of 4 runs,
    # right for 8 slots, gave up the cache at the sixth.)
    async with open_edge_core(prefix_config()) as core, trio.open_nursery() as nursery:  # type: ignore[arg-type]
        a = await connect(core, nursery, [caps(slots=16)], "a")
        await connect(core, nursery, [caps(slots=16)], "b")
        runs = []
        for i in range(10):
            runs.append(core.start_run(spec(chat(SYSTEM, f"q{i}"), f"r{i}")))
            await trio.testing.wait_all_tasks_blocked()
        assert [f"r{i}" in a.assigned for i in range(10)] == [True] * 9 + [False]
        assert runs[9].timeline.placements[0].why == "least-loaded: in flight 9/16 against 0/16"
        for r in runs:
            r.cancel(CancelReason.CLIENT_DISCONNECT)
            await drain_events(r)
        nursery.cancel_scope.cancel()


async def test_random_placement_uses_every_instance(autojump_clock: trio.testing.MockClock) -> None:
    cfg = config(scheduler=SchedulerSettings(max_queue=8, placement="random", affinity=False))
    async with open_edge_core(cfg) as core, trio.open_nursery() as nursery:
        a = await connect(core, nursery, [caps(slots=64)], "a")
        b = await connect(core, nursery, [caps(slots=64)], "b")
        core.scheduler.placement._random.seed(7)  # deterministic: both instances are drawn
        runs = [core.start_run(spec(chat(SYSTEM, f"q{i}"), f"r{i}")) for i in range(12)]
        await trio.testing.wait_all_tasks_blocked()
        assert a.assigned
        assert b.assigned
        assert {r.timeline.placements[0].why for r in runs} == {"random"}
        for r in runs:
            r.cancel(CancelReason.CLIENT_DISCONNECT)
            await drain_events(r)
        nursery.cancel_scope.cancel()


def test_placement_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="prefix_block_chars"):
        SchedulerSettings(prefix_block_chars=1)
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        SchedulerSettings(balance_rel_threshold=0.5)
    with pytest.raises(ValueError, match="balance_load_threshold"):
        SchedulerSettings(balance_load_threshold=-0.1)
    for chars in (0.4, 65.0):
        with pytest.raises(ValueError, match="prefix_chars_per_token"):
            SchedulerSettings(prefix_chars_per_token=chars)
    SchedulerSettings(prefix_chars_per_token=0.5)
    SchedulerSettings(prefix_chars_per_token=64.0)


def test_an_instance_keeps_no_more_blocks_than_its_cache_holds() -> None:
    """A reported cache size bounds what the index claims for that instance,
    least recently routed first; other instances keep theirs."""
    index = PrefixIndex(max_bytes=100 * ENTRY_BYTES)
    index.routed(("n", "a"), [b"1", b"2", b"3", b"4"])
    index.routed(("n", "b"), [b"1", b"2", b"3", b"4"])
    index.bound(("n", "a"), 2)
    assert index.matched(("n", "a"), [b"1"]) == 0
    assert index.matched(("n", "a"), [b"3", b"4"]) == 2
    index.routed(("n", "a"), [b"5"])  # 3 goes: the bound holds for what comes after
    assert index.matched(("n", "a"), [b"3"]) == 0
    assert index.matched(("n", "a"), [b"4", b"5"]) == 2
    assert index.matched(("n", "b"), [b"1", b"2", b"3", b"4"]) == 4
    assert len(index) == 6
    # A count from the engine's events trims once; what comes after may grow.
    index.trim(("n", "b"), 1)
    assert index.matched(("n", "b"), [b"4"]) == 1
    assert index.matched(("n", "b"), [b"3"]) == 0
    index.routed(("n", "b"), [b"6", b"7"])
    assert index.held() == [(("n", "a"), 2, 2), (("n", "b"), 3, None)]
    index.forget("n")
    assert len(index) == 0
    index.routed(("n", "a"), [b"1", b"2", b"3"])  # a new link starts unbounded
    assert len(index) == 3
    assert index.held() == [(("n", "a"), 3, None)]


@given(
    capacity=st.integers(min_value=0, max_value=8),
    prompts=st.lists(
        st.lists(st.sampled_from([b"a", b"b", b"c", b"d", b"e", b"f", b"g"]), max_size=6),
        max_size=40,
    ),
)
def test_the_index_never_claims_a_block_the_engine_evicted(
    capacity: int, prompts: list[list[bytes]]
) -> None:
    """An engine with an LRU block cache of ``capacity`` (the sim's
    ``PrefixCache``) caches every block of every prompt it is sent; once the
    index knows that capacity, every block it claims is one the engine holds
    (LRU's inclusion property: a smaller LRU cache fed the same sequence
    holds a subset), whatever the sequence."""
    engine = PrefixCache(capacity)
    index = PrefixIndex(max_bytes=1000 * ENTRY_BYTES)
    where = ("n", "i")
    index.bound(where, capacity)
    for blocks in prompts:
        engine.insert(blocks)
        index.routed(where, blocks)
        for block in {b for p in prompts for b in p}:
            if index.matched(where, [block]):
                assert engine.cached_blocks([block]) == 1
