"""Prefix-aware placement (iop.edge.scheduler._prefix and the scheduler's ``prefix``
placement): prompt blocks, the bounded index, and where runs go, over
in-memory links in virtual time."""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from iop.config import SchedulerSettings
from iop.edge import open_edge_core
from iop.edge.scheduler._prefix import (
    ENTRY_BYTES,
    HOME_BYTES,
    REPLICA_BYTES,
    PrefixIndex,
    prompt_blocks,
)
from iop.events import CancelReason
from iop.protocol import EngineLoad, InstanceLoad, LoadReport
from iop.runtime import Run
from iop.sim._engine import PrefixCache
from iop.spec import ChatRequest, CompletionRequest, EmbeddingRequest, ExecutionSpec, Message
from tests.edge.test_core import FakeNode, caps, config, connect, drain_events, frame

SYSTEM = "You are the support agent of ACME. Answer briefly and politely. " * 20
# The index's tuning numbers, at the config's defaults.
COUNT_SLACK_S = SchedulerSettings().prefix_count_slack_s
DEMAND_GROWTH = 2 ** (1 / SchedulerSettings().prefix_demand_half_life)


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
    index = PrefixIndex(max_bytes=4 * ENTRY_BYTES + 2 * HOME_BYTES)  # two prompts' homes
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
            # The placement rules on their own; a run waits for a full home
            # in tests/edge/test_scheduler_home_wait.py.
            **{"prefix_wait_s": 0.0, **sched},  # type: ignore[arg-type]
        )
    )


def where(nodes: dict[str, FakeNode], run_id: str) -> str:
    """The node a run was assigned to."""
    return next(n for n, f in nodes.items() if run_id in f.assigned)


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
    index.trim(("n", "b"), 1, taken_at=2 * COUNT_SLACK_S, now=2 * COUNT_SLACK_S)
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


def test_reused_blocks_fill_a_cache_and_blocks_routed_once_half() -> None:
    """``fill``: an instance's reused blocks count whole, its blocks routed
    once half, over its bound; a block that leaves stops counting."""
    index = PrefixIndex(max_bytes=100 * ENTRY_BYTES)
    a = ("n", "a")
    assert index.fill(a) is None  # size unknown
    index.bound(a, 10)
    assert index.fill(a) == 0.0
    index.routed(a, [b"1", b"2", b"3", b"t1"])
    assert index.fill(a) == 4 / 20
    index.routed(a, [b"1", b"2", b"3", b"t2"])  # 1, 2, 3 reused; t1, t2 once
    assert index.fill(a) == (5 + 3) / 20
    # A count of more than half of them says nothing; of at most half, the
    # oldest go: t1, 1 and 2 (reused).
    index.trim(a, 3, taken_at=2 * COUNT_SLACK_S, now=2 * COUNT_SLACK_S)
    assert index.fill(a) == (5 + 3) / 20
    index.trim(a, 2, taken_at=2 * COUNT_SLACK_S, now=2 * COUNT_SLACK_S)
    assert index.fill(a) == (2 + 1) / 20
    index.bound(a, 0)
    assert index.fill(a) == 1.0  # no room at all
    index.bound(a, 2)
    index.routed(a, [b"x", b"x"])  # reused within one prompt: held once, reused once
    assert index.fill(a) == (1 + 1) / 4
    index.forget("n")
    assert index.fill(a) is None


@given(
    ops=st.lists(
        st.one_of(
            st.tuples(
                st.just("route"),
                st.sampled_from("ab"),
                st.lists(st.sampled_from([b"1", b"2", b"3", b"4", b"5", b"6"]), max_size=5),
            ),
            st.tuples(st.just("bound"), st.sampled_from("ab"), st.integers(0, 6)),
            st.tuples(
                st.just("trim"),
                st.sampled_from("ab"),
                st.tuples(st.integers(0, 6), st.integers(0, 7)),
            ),
            st.tuples(st.just("forget"), st.just(""), st.just(0)),
        ),
        max_size=60,
    ),
    max_entries=st.integers(min_value=0, max_value=20),
)
def test_the_index_counts_reused_blocks_as_a_plain_lru_model_does(
    ops: list[tuple[str, str, object]], max_entries: int
) -> None:
    """The index against a model written plainly: one LRU list across
    instances (within the bytes, homes counted), one per instance (at most its
    bound), each block flagged when routed there again while held, and a
    prompt's first block homed where it first went, while held there, and
    moved where a prompt went when its demand evens the two instances'."""
    max_bytes = max_entries * ENTRY_BYTES
    index = PrefixIndex(max_bytes=max_bytes)
    order: list[tuple[str, bytes]] = []  # the global LRU, oldest first
    reused: dict[tuple[str, bytes], bool] = {}
    bounds: dict[str, int] = {}
    homes: dict[bytes, list[Any]] = {}  # first block -> [instance, its demand]
    unit = 1.0  # what a prompt adds to a demand now

    def demand(name: str) -> float:
        return sum(d for w, d in homes.values() if w == name)

    def drop(key: tuple[str, bytes]) -> None:
        order.remove(key)
        del reused[key]
        if key[1] in homes and homes[key[1]][0] == key[0]:
            del homes[key[1]]

    added: dict[str, list[tuple[int, int]]] = {}  # (step, blocks new to an instance then)

    def trim(name: str, bound: int) -> None:
        mine = [k for k in order if k[0] == name]
        for key in mine[: max(0, len(mine) - bound)]:
            drop(key)

    for step, (op, name, arg) in enumerate(ops):
        where = ("n", name)
        if op == "route":
            assert isinstance(arg, list)
            index.routed(where, arg, now=step)
            if max_entries:
                for block in arg:
                    key = (name, block)
                    was = key in reused
                    if was:
                        order.remove(key)
                    else:
                        added.setdefault(name, []).append((step, 1))
                    order.append(key)
                    reused[key] = was
                if name in bounds:
                    trim(name, bounds[name])
                if arg:
                    unit *= DEMAND_GROWTH
                    first, held = arg[0], (name, arg[0]) in reused
                    if first not in homes:
                        if held:
                            homes[first] = [name, unit]
                    else:
                        homes[first][1] += unit
                        home, mine = homes[first]
                        gap = demand(home) - demand(name)
                        if held and home != name and gap > mine * (1 + 1e-9):
                            homes[first][0] = name
                # Entries and homes within the bytes, least recently routed out first.
                while order and len(order) * ENTRY_BYTES + len(homes) * HOME_BYTES > max_bytes:
                    drop(order[0])
        elif op == "bound":
            assert isinstance(arg, int)
            index.bound(where, arg)
            bounds[name] = arg
            trim(name, arg)
        elif op == "trim":
            assert isinstance(arg, tuple)
            count, age = arg
            index.trim(where, count, taken_at=step - age, now=step)
            if age <= 5:  # the index's recent_s: an older count is ignored
                since = step - age - COUNT_SLACK_S
                later = sum(n for at, n in added.get(name, []) if at > since)
                if (count + later) * 2 <= len([k for k in order if k[0] == name]):
                    trim(name, count + later)
        else:
            index.forget("n")
            order.clear()
            reused.clear()
            bounds.clear()
            homes.clear()
            added.clear()
        for n in "ab":
            held = [k for k in order if k[0] == n]
            bound = bounds.get(n)
            if bound is None:
                assert index.fill(("n", n)) is None
            elif bound == 0:
                assert index.fill(("n", n)) == 1.0
            else:
                want = min(1.0, (len(held) + sum(reused[k] for k in held)) / (2 * bound))
                assert index.fill(("n", n)) == pytest.approx(want)
            for _, block in held:
                assert index.matched(("n", n), [block]) == 1
        assert len(index) == len(order)
        for block in [b"1", b"2", b"3", b"4", b"5", b"6"]:
            want_home = homes.get(block)
            assert index.home([block]) == (None if want_home is None else ("n", want_home[0]))


async def test_a_prefix_held_nowhere_goes_where_it_evicts_least_not_to_the_idlest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two instances with caches of 40 blocks. The support prompt's blocks
    are reused on a (its cache half full of them); b has a run of another
    edge's in flight (its node says so), so it is the busier. A poet's
    prompt, held nowhere, goes to b, whose cache has room, not to the idle
    a, where it would evict the support prefix that its prompts come back
    for; with no room term it went to a."""
    poet = "You are a poet. " * 10
    support = "Be brief. " * 30  # 300 characters: 20 blocks with the JSON around it
    for room_weight, expected in ((1.0, "b"), (0.0, "a")):
        cfg = prefix_config(
            prefix_block_chars=16, prefix_chars_per_token=4.0, room_weight=room_weight
        )
        async with open_edge_core(cfg) as core, trio.open_nursery() as nursery:  # type: ignore[arg-type]
            nodes = {n: await connect(core, nursery, [caps(slots=4)], n) for n in "ab"}
            runs = []
            for i, user in enumerate(["q0", "q1"]):
                run = core.start_run(spec(chat(support, user), f"r{i}"))
                runs.append(run)
                await trio.testing.wait_all_tasks_blocked()
                run.cancel(CancelReason.CLIENT_DISCONNECT)
                await drain_events(run)
            for name, node in nodes.items():
                # 160 tokens at 4 characters a token: 40 blocks of 16 characters.
                load = InstanceLoad(
                    instance="i0",
                    in_flight=1 if name == "b" else 0,
                    queued=0,
                    max_concurrency=4,
                    max_queue=0,
                    engine=EngineLoad(cache_tokens=160),
                )
                await node.chan.send(frame(LoadReport(instances=[load])))
            await trio.testing.wait_all_tasks_blocked()
            runs.append(core.start_run(spec(chat(poet, "q2"), "r2")))
            await trio.testing.wait_all_tasks_blocked()
            where = [next(n for n, f in nodes.items() if f"r{i}" in f.assigned) for i in range(3)]
            assert where[:2] == ["a", "a"]
            assert where[2] == expected
            placed = runs[2].timeline.placements[0]
            assert placed.why.startswith("prefix: best score")
            runs[2].cancel(CancelReason.CLIENT_DISCONNECT)
            await drain_events(runs[2])
            nursery.cancel_scope.cancel()


def test_a_first_block_is_homed_where_it_first_went_while_it_is_held_there() -> None:
    index = PrefixIndex(max_bytes=100 * ENTRY_BYTES)
    a, b = ("n", "a"), ("m", "b")
    assert index.home([]) is None
    index.routed(a, [b"1", b"2"])
    index.routed(b, [b"1", b"2", b"3"])  # a copy elsewhere: the home stays
    assert index.home([b"1", b"9"]) == a
    assert index.home([b"2"]) is None  # only a prompt's first block is homed
    index.bound(a, 1)  # a drops 1: the home is gone with it
    assert index.home([b"1"]) is None
    index.routed(b, [b"1"])
    assert index.home([b"1"]) == b
    index.forget("m")
    assert index.home([b"1"]) is None


async def test_a_copy_made_while_the_home_was_full_is_not_kept_warm(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The support prompt's home is b; in a burst b's 4 slots fill and one
    run makes a copy on a. Once both are idle, the next support prompt goes
    home to b (the copy on a is left to age out of a's cache); with no home
    weight the two copies tie and the registry's first, a, keeps its copy
    warm as a second home."""
    for home_weight, expected in ((0.5, "b"), (0.0, "a")):
        async with (
            open_edge_core(prefix_config(home_weight=home_weight)) as core,
            trio.open_nursery() as nursery,
        ):  # type: ignore[arg-type]
            nodes = {n: await connect(core, nursery, [caps(slots=4)], n) for n in "ab"}

            async def start(system: str, run_id: str) -> Run:
                run = core.start_run(spec(chat(system, run_id), run_id))
                await trio.testing.wait_all_tasks_blocked()
                return run

            other = await start("You are a poet. " * 80, "o0")
            burst = [await start(SYSTEM, f"s{i}") for i in range(6)]
            assert where(nodes, "o0") == "a"
            assert [where(nodes, f"s{i}") for i in range(6)] == ["b"] * 4 + ["a", "a"]
            for run in [other, *burst]:
                run.cancel(CancelReason.CLIENT_DISCONNECT)
                await drain_events(run)
            after = await start(SYSTEM, "s6")
            assert where(nodes, "s6") == expected
            after.cancel(CancelReason.CLIENT_DISCONNECT)
            await drain_events(after)
            nursery.cancel_scope.cancel()


def test_a_home_moves_where_a_prompt_went_when_that_evens_the_demand() -> None:
    """Two prefixes homed on a; one's prompt goes to b (a was busy): its
    demand moves to b, since a held both and b none. The other's prompt
    then going to b does not move it: a would hold none and b both."""
    index = PrefixIndex(max_bytes=100 * ENTRY_BYTES)
    a, b = ("n", "a"), ("n", "b")
    index.routed(a, [b"1", b"x"])
    index.routed(a, [b"2", b"y"])
    index.routed(b, [b"1", b"z"])
    assert index.home([b"1"]) == b
    index.routed(b, [b"2", b"w"])
    assert index.home([b"2"]) == a
    # A prompt a did not keep (its bound dropped it) is homed where it goes next.
    index.bound(a, 1)
    assert index.home([b"2"]) is None
    index.routed(b, [b"2"])
    assert index.home([b"2"]) == b


def test_a_count_taken_before_the_latest_prompts_does_not_trim_them() -> None:
    """A node's count of what its engine holds was taken before the report
    left, and the node sends it again in each report until it reads the
    next: the prompts routed after it was taken may not be in it. A trim
    keeps those on top of the count, so a cache still filling up (its count
    below its size) does not make the index forget its oldest prefixes at
    every report (the 'nowhere' misses of docs/benchmarks.md, "Prefix
    placement on a skewed workload, caches reported")."""
    slack = COUNT_SLACK_S
    index = PrefixIndex(max_bytes=100 * ENTRY_BYTES, recent_s=5 * slack)
    a = ("n", "a")
    index.routed(a, [b"1", b"2", b"3"], now=0.0)
    index.routed(a, [b"4", b"5"], now=2 * slack)
    index.routed(a, [b"4", b"6"], now=3 * slack)  # 4 again: not new, 6 is
    # The count has 1, 2 and 3 only; 4, 5 and 6 were routed after it, or
    # so shortly before that they may not have reached the engine.
    index.trim(a, 3, taken_at=2.5 * slack, now=3.5 * slack)
    assert index.matched(a, [b"1", b"2", b"3"]) == 3
    index.trim(a, 3, taken_at=2.5 * slack, now=3.6 * slack)  # the same count again
    assert index.matched(a, [b"1", b"2", b"3"]) == 3
    index.trim(a, 3, taken_at=4.5 * slack, now=5 * slack)  # a count that has them all
    assert index.matched(a, [b"1"]) == 0
    assert [index.matched(a, [b]) for b in (b"4", b"5", b"6")] == [1, 1, 1]
    index.routed(a, [b"7"], now=6 * slack)
    index.trim(a, 0, taken_at=5.5 * slack, now=6.5 * slack)  # a reset: 7 may be after it
    assert len(index) == 1
    index.routed(a, [b"8"], now=7 * slack)
    index.trim(a, 0, taken_at=1.5 * slack, now=7 * slack)  # older than recent_s: ignored
    assert len(index) == 2


async def test_the_balance_rule_sends_a_run_to_another_copy_before_an_empty_instance(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The poet's home a piles up; the balance rule sent one run to b, which
    now holds a copy. The next poet run that the rule sends away from a goes
    to that copy on b (busy with 1 of 8, within the threshold of the idle c),
    not to c, where it would be a whole prefill and a third copy."""
    poet = "You are a poet. " * 80
    cfg = prefix_config(home_weight=0.6)
    async with open_edge_core(cfg) as core, trio.open_nursery() as nursery:  # type: ignore[arg-type]
        nodes = {n: await connect(core, nursery, [caps(slots=8)], n) for n in "abc"}
        runs = []
        for k in range(7):
            runs.append(core.start_run(spec(chat(poet, f"p{k}"), f"r{k}")))
            await trio.testing.wait_all_tasks_blocked()
        placed = [where(nodes, f"r{k}") for k in range(7)]
        assert placed[:6] == ["a"] * 5 + ["b"]
        assert runs[5].timeline.placements[0].why == "least-loaded: in flight 5/8 against 0/8"
        assert placed[6] == "b"
        assert runs[6].timeline.placements[0].why == (
            "balance: in flight 5/8 against 0/8; best of the rest"
        )
        for r in runs:
            r.cancel(CancelReason.CLIENT_DISCONNECT)
            await drain_events(r)
        nursery.cancel_scope.cancel()


# --------------------------------------------------------------------------- replicas


def hot_index(**kw: Any) -> PrefixIndex:
    return PrefixIndex(max_bytes=10_000 * ENTRY_BYTES, **kw)


def wanted(index: PrefixIndex, blocks: list[bytes], slots: int = 4) -> int:
    """The homes the default replica keys want for ``blocks`` on ``slots``-slot homes."""
    s = SchedulerSettings()
    return index.homes_wanted(blocks, slots, s.replica_load, s.replica_drop, s.replica_min_prompts)


async def test_a_prefix_whose_demand_fills_its_home_gets_a_replica_before_the_home_runs_full(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One prompt's runs pile up on its home a (4 slots; runs stay in
    flight). Once its recent prompts say it keeps more than ``replica_load``
    of a's slots busy (an eighth: half a run), b becomes a second home,
    while a still has a free slot. The next run, which the balance rule
    sends away from a, warms b; from then on the prompt's runs go to the
    less loaded of its homes, so b stays warm. With ``replica_load = 0``
    the copy on b is a spill that a's home bonus outweighs: the prompt's
    next run goes back to a, the busier."""
    for replica_load, after in ((0.125, "b"), (0.0, "a")):
        cfg = prefix_config(replica_load=replica_load, replica_min_prompts=3)
        async with open_edge_core(cfg) as core, trio.open_nursery() as nursery:  # type: ignore[arg-type]
            nodes = {n: await connect(core, nursery, [caps(slots=4)], n) for n in "abc"}
            blocks = core.scheduler.placement.prompt_blocks(chat(SYSTEM, "q"))

            async def start(run_id: str) -> Run:
                run = core.start_run(spec(chat(SYSTEM, run_id), run_id))
                await trio.testing.wait_all_tasks_blocked()
                return run

            runs = [await start(f"r{k}") for k in range(3)]
            assert [where(nodes, f"r{k}") for k in range(3)] == ["a"] * 3
            homes = core.scheduler.prefixes.homes(blocks)
            assert homes == [("a", "i0"), ("b", "i0")][: 2 if replica_load else 1]
            runs.append(await start("r3"))
            assert where(nodes, "r3") == "b"
            why = runs[3].timeline.placements[0].why
            assert why == "least-loaded: in flight 3/4 against 0/4"
            runs[0].cancel(CancelReason.CLIENT_DISCONNECT)
            await drain_events(runs[0])
            runs.append(await start("r4"))  # a has 2 of 4 busy, b 1
            assert where(nodes, "r4") == after
            assert runs[4].timeline.placements[0].why.startswith("prefix: best score")
            for r in runs[1:]:
                r.cancel(CancelReason.CLIENT_DISCONNECT)
                await drain_events(r)
            nursery.cancel_scope.cancel()


async def test_a_replica_is_chosen_where_it_evicts_least(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Three instances with caches of 40 blocks. a's cache is half full of
    the support prompt's reused blocks; c's is empty, but c is busier (a run
    of another edge's, its node says). The poet's prompts go to b, and their
    demand soon wants a second home: it is c, where the copy evicts nothing
    that prompts come back for. With no room term the poet's home is a (the
    first of the idle), beside the support prefix, and its replica the idle
    b, whatever either evicts."""
    poet = "You are a poet. " * 10
    support = "Be brief. " * 60  # 600 characters: 19 blocks of 32 with the JSON around it
    for room_weight, home, replica in ((1.0, "b", "c"), (0.0, "a", "b")):
        cfg = prefix_config(
            prefix_block_chars=32,
            prefix_chars_per_token=8.0,
            room_weight=room_weight,
            replica_load=0.125,
            replica_min_prompts=1,
        )
        async with open_edge_core(cfg) as core, trio.open_nursery() as nursery:  # type: ignore[arg-type]
            nodes = {n: await connect(core, nursery, [caps(slots=4)], n) for n in "abc"}

            async def start(system: str, run_id: str) -> Run:
                run = core.start_run(spec(chat(system, run_id), run_id))
                await trio.testing.wait_all_tasks_blocked()
                return run

            for k in range(2):
                run = await start(support, f"s{k}")
                run.cancel(CancelReason.CLIENT_DISCONNECT)
                await drain_events(run)
            assert where(nodes, "s0") == where(nodes, "s1") == "a"
            for name, node in nodes.items():
                # 160 tokens at 8 characters a token: 40 blocks of 32 characters.
                load = InstanceLoad(
                    instance="i0",
                    in_flight=1 if name == "c" else 0,
                    queued=0,
                    max_concurrency=4,
                    max_queue=0,
                    engine=EngineLoad(cache_tokens=160),
                )
                await node.chan.send(frame(LoadReport(instances=[load])))
            await trio.testing.wait_all_tasks_blocked()
            blocks = core.scheduler.placement.prompt_blocks(chat(poet, "p"))
            first = await start(poet, "p0")
            assert where(nodes, "p0") == home
            assert core.scheduler.prefixes.homes(blocks) == [(home, "i0")]
            second = await start(poet, "p1")
            assert where(nodes, "p1") == home
            assert core.scheduler.prefixes.homes(blocks) == [(home, "i0"), (replica, "i0")]
            for run in (first, second):
                run.cancel(CancelReason.CLIENT_DISCONNECT)
                await drain_events(run)
            nursery.cancel_scope.cancel()


def test_a_replica_is_dropped_when_demand_falls_not_before() -> None:
    """A prefix that keeps more than a quarter of its home's 4 slots busy
    (one run: its share of the recent prompts times the runs in flight)
    wants a second home; it keeps it until one home would carry less than
    half that, so a demand between the two neither makes nor drops one."""
    index = hot_index()
    a, b, c = ("n", "a"), ("n", "b"), ("n", "c")
    hot = [b"hot", b"tail"]
    for _ in range(16):  # every prompt the hot one's, 1.5 runs in flight
        index.routed(a, hot, busy=1.5)
    assert index.prompts(hot) == pytest.approx(16, rel=0.01)
    assert index.runs(hot) == pytest.approx(1.5)
    assert wanted(index, hot) == 2
    assert index.add_home(hot, b)
    assert not index.add_home(hot, b)  # already one
    assert index.homes(hot) == [a, b]
    assert wanted(index, hot) == 2  # 0.75 runs a home: no third
    # Other prompts come: the hot one's share falls. At 0.75 runs (between
    # half a run and one) a prefix with one home wants no second, and one
    # with two keeps it.
    other = 0
    while index.runs(hot) > 0.75:
        index.routed(c, [b"o%d" % other], busy=1.5)
        other += 1
    assert wanted(index, hot) == 2
    assert index.drop_home(hot) == b
    assert index.homes(hot) == [a]
    assert wanted(index, hot) == 1
    index.add_home(hot, b)
    while index.runs(hot) >= 0.5:
        index.routed(c, [b"o%d" % other], busy=1.5)
        other += 1
    assert wanted(index, hot) == 1
    assert index.drop_home(hot) == b
    assert index.drop_home(hot) is None  # the first home stays
    assert index.homes(hot) == [a]


def test_a_prefix_seen_a_few_times_gets_no_replica() -> None:
    """Two prompts of a prefix are no evidence of its share: below
    ``replica_min_prompts`` recent prompts it wants its one home."""
    index = hot_index()
    a = ("n", "a")
    index.routed(a, [b"x"], busy=16.0)
    index.routed(a, [b"x"], busy=16.0)
    assert index.runs([b"x"]) == pytest.approx(16.0)
    assert wanted(index, [b"x"]) == 1
    assert index.homes_wanted([b"x"], 8, 0.125, 0.5, 2) == 2
    assert index.homes_wanted([b"x"], 8, 0.0, 0.5, 2) == 1  # replicas off
    assert index.homes_wanted([b"nowhere"], 8, 0.125, 0.5, 2) == 0


def test_a_replicas_runs_are_not_counted_as_misses_by_the_index() -> None:
    """A prompt that goes to a replica is its home's, not a spill from a
    busy home: the home does not move. The same prompt to an instance that
    is no home of it moves the home there (a's demand, two prefixes, is
    more than the hot one's above b's)."""
    for replicated in (True, False):
        index = hot_index()
        a, b = ("n", "a"), ("n", "b")
        hot, cold = [b"hot", b"t"], [b"cold", b"t"]
        for _ in range(4):
            index.routed(a, hot)
            index.routed(a, cold)
        if replicated:
            index.add_home(hot, b)
        index.routed(b, hot)
        assert index.homes(hot) == ([a, b] if replicated else [b])
        assert index.homes(cold) == [a]


def test_a_replica_that_loses_the_prefix_stops_being_a_home() -> None:
    """Homes are instances that hold the prefix's first block (or are about
    to: a new replica): one that evicts it is no home; when the primary
    does, the replica is the home; a node that leaves takes its homes."""
    index = hot_index()
    a, b = ("n", "a"), ("m", "b")
    hot = [b"hot", b"t"]
    index.routed(a, hot)
    index.add_home(hot, b)
    index.routed(b, hot)
    index.bound(a, 0)
    assert index.homes(hot) == [b]
    index.bound(a, 10)
    index.routed(a, hot)
    index.add_home(hot, a)
    assert index.homes(hot) == [b, a]
    index.forget("m")
    assert index.homes(hot) == [a]
    # A replica that never held it goes with its node too.
    index.add_home(hot, b)
    index.forget("m")
    assert index.homes(hot) == [a]


def test_a_home_costs_at_most_home_bytes() -> None:
    index = PrefixIndex(max_bytes=10**9)
    prompts = [[b"%015d" % i] for i in range(4000)]
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for blocks in prompts:
        index.routed(("node-with-a-long-id", "instance"), blocks)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert len(index) == index.home_count == 4000
    assert grown / 4000 <= ENTRY_BYTES + HOME_BYTES
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for blocks in prompts:
        index.add_home(blocks, ("another-node", "instance"))
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert index.replica_count == 4000
    assert grown / 4000 <= REPLICA_BYTES


def test_homes_count_in_the_index_bytes() -> None:
    """Prompts of one block each make one home each: the index holds no more
    of them than ``prefix_index_bytes`` pays for with their homes (without:
    ENTRY_BYTES a prompt, about 1.8 times the cap in memory)."""
    cap = 10 * (ENTRY_BYTES + HOME_BYTES)
    index = PrefixIndex(max_bytes=cap)
    for i in range(40):
        index.routed(("n", "a"), [b"p%d" % i])
    assert len(index) == index.home_count == 10
    assert index.size_bytes <= cap
    assert index.homes([b"p39"]) == [("n", "a")]
    assert index.homes([b"p29"]) == []
    index.add_home([b"p39"], ("n", "b"))  # a replica costs its place too
    assert index.size_bytes <= cap
    assert len(index) == 9


def test_a_demand_halves_every_half_life_prompts() -> None:
    """``prefix_demand_half_life``: a prompt's weight in its home's demand
    halves every so many prompts routed after it."""
    for half_life in (4, 1024):
        index = hot_index(demand_half_life=half_life)
        index.routed(("n", "a"), [b"x"])
        for i in range(4):
            index.routed(("n", "a"), [b"y%d" % i])
        assert index.prompts([b"x"]) == pytest.approx(0.5 if half_life == 4 else 1, rel=0.01)


def test_a_count_trims_only_below_its_share_of_the_claims() -> None:
    """``prefix_trim_share``: a count of what an engine holds trims the
    index when it leaves at most that share of what the index claims there
    (a half by default; 1: at any count below the claims)."""
    for share, left in ((0.5, 4), (1.0, 3)):
        index = hot_index(trim_share=share)
        a = ("n", "a")
        index.routed(a, [b"1", b"2", b"3", b"4"], now=0.0)
        index.trim(a, 3, taken_at=10.0, now=10.0)
        assert len(index) == left


async def test_a_reloaded_placement_places_the_next_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``[scheduler]`` is live on a reload (docs/configuration.md): the next
    run is placed by the new keys, not by those the edge started with."""
    cfg = config(scheduler=SchedulerSettings(max_queue=8, placement="least_loaded"))
    async with open_edge_core(cfg) as core, trio.open_nursery() as nursery:
        await connect(core, nursery, [caps(slots=4)], "a")
        runs = [core.start_run(spec(chat(SYSTEM, "q0"), "r0"))]
        await trio.testing.wait_all_tasks_blocked()
        core.apply_config(prefix_config(replica_load=0.5))  # type: ignore[arg-type]
        assert core.scheduler.placement.settings.replica_load == 0.5
        runs.append(core.start_run(spec(chat(SYSTEM, "q1"), "r1")))
        await trio.testing.wait_all_tasks_blocked()
        whys = [r.timeline.placements[0].why for r in runs]
        assert whys[0] == "least-loaded"
        assert whys[1].startswith("prefix: best score")
        for r in runs:
            r.cancel(CancelReason.CLIENT_DISCONNECT)
            await drain_events(r)
        nursery.cancel_scope.cancel()


async def test_a_replica_is_dropped_at_placement_when_its_prefix_cools(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The support prompt's runs piled up on a and made b a replica. Then
    forty other prompts come, one at a time: the support prompt's share of
    the recent prompts falls, and at its next run placement drops the
    replica; the admin view counts one made and one dropped."""
    cfg = prefix_config(replica_load=0.125, replica_min_prompts=3)
    async with open_edge_core(cfg) as core, trio.open_nursery() as nursery:  # type: ignore[arg-type]
        nodes = {n: await connect(core, nursery, [caps(slots=4)], n) for n in "abc"}
        blocks = core.scheduler.placement.prompt_blocks(chat(SYSTEM, "q"))

        async def start(system: str, run_id: str) -> Run:
            run = core.start_run(spec(chat(system, run_id), run_id))
            await trio.testing.wait_all_tasks_blocked()
            return run

        async def stop(run: Run) -> None:
            run.cancel(CancelReason.CLIENT_DISCONNECT)
            await drain_events(run)
            for node in nodes.values():  # the fake nodes' inboxes are bounded
                while True:
                    try:
                        node.assigns.receive_nowait()
                    except trio.WouldBlock:
                        break

        piled = [await start(SYSTEM, f"s{k}") for k in range(3)]
        assert core.scheduler.prefixes.homes(blocks) == [("a", "i0"), ("b", "i0")]
        for run in piled:
            await stop(run)
        for k in range(40):
            await stop(await start(f"You are poet number {k}. " * 40, f"p{k}"))
        assert core.scheduler.prefixes.homes(blocks) == [("a", "i0"), ("b", "i0")]
        last = await start(SYSTEM, "s3")
        assert where(nodes, "s3") == "a"
        assert core.scheduler.prefixes.homes(blocks) == [("a", "i0")]
        index = core.snapshot()["routing"]["prefix_index"]  # type: ignore[index]
        assert (index["replicas_made"], index["replicas_dropped"], index["replicas"]) == (1, 1, 0)
        await stop(last)
        nursery.cancel_scope.cancel()


@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["route", "add", "drop", "bound", "forget"]),
            st.sampled_from([("n", "a"), ("n", "b"), ("m", "c")]),
            st.lists(st.sampled_from([b"1", b"2", b"3", b"4"]), min_size=1, max_size=3),
            st.integers(0, 4),
        ),
        max_size=60,
    ),
    max_entries=st.integers(min_value=0, max_value=16),
)
def test_homes_and_replicas_keep_their_books_whatever_happens(
    ops: list[tuple[str, tuple[str, str], list[bytes], int]], max_entries: int
) -> None:
    """Replicas made and dropped among routes, bounds and nodes leaving: the
    index stays within its bytes, every home has an instance that holds its
    block, the replicas counted are the homes' beyond the first, and each
    instance's demand is its homes' shares."""
    index = PrefixIndex(max_bytes=max_entries * (ENTRY_BYTES + HOME_BYTES // 2))
    for op, where, blocks, n in ops:
        if op == "route":
            index.routed(where, blocks, busy=float(n))
        elif op == "add":
            index.add_home(blocks, where)
        elif op == "drop":
            index.drop_home(blocks)
        elif op == "bound":
            index.bound(where, n)
        else:
            index.forget(where[0])
        assert index.size_bytes <= index.max_bytes
        homes = index._homes
        assert index.replica_count == sum(len(h.wheres) - 1 for h in homes.values())
        shares: dict[tuple[str, str], float] = {}
        for block, home in homes.items():
            assert home.wheres
            assert len(set(home.wheres)) == len(home.wheres)
            assert any(index.matched(w, [block]) for w in home.wheres)
            for w in home.wheres:
                shares[w] = shares.get(w, 0.0) + home.demand / len(home.wheres)
        for w in index._demand.keys() | shares.keys():
            want = shares.get(w, 0.0)
            assert index._demand.get(w, 0.0) == pytest.approx(want, rel=1e-6, abs=1e-6)
