"""The on-demand models' decisions (``iop.ondemand._table``), sans-IO: a table of
transitions, eviction and refusal cases, and hypothesis over random sequences."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from iop.errors import InvariantError
from iop.ondemand import (
    TRANSITIONS,
    GroupSpec,
    ModelSpec,
    ModelState,
    ModelTable,
    Ready,
    Refused,
    StartLoad,
    StartUnload,
    Wait,
)

S = ModelState


def table(*specs: ModelSpec, budget: int = 100, **kw: Any) -> ModelTable:
    return ModelTable(specs, budget, retry_min_s=5.0, retry_max_s=40.0, **kw)


def load(t: ModelTable, name: str, now: float) -> None:
    """Want ``name`` and play its load to ready (asserting the table asks for it)."""
    assert t.want(name, now) == Wait()
    actions = t.actions()
    for a in actions:
        if isinstance(a, StartUnload):
            t.unloaded(a.model)
    assert StartLoad(name) in actions + t.actions()
    t.loaded(name, now)
    assert t.want(name, now) == Ready()


# --- the transition table -------------------------------------------------------------


def test_every_state_has_its_transitions_and_only_those() -> None:
    assert set(TRANSITIONS) == set(ModelState)
    assert TRANSITIONS[S.COLD] == {S.LOADING}
    assert TRANSITIONS[S.UNLOADING] == {S.COLD}
    # Nothing jumps from cold to ready, or from loading to unloading.
    assert S.READY not in TRANSITIONS[S.COLD]
    assert S.UNLOADING not in TRANSITIONS[S.LOADING]


CASES: list[tuple[str, list[str], ModelState]] = [
    ("a want plans a load", ["want"], S.LOADING),
    ("a load that serves is ready", ["want", "loaded"], S.READY),
    ("a failed load", ["want", "failed"], S.FAILED),
    ("an unload with no runs", ["want", "loaded", "unload"], S.UNLOADING),
    ("an unload with a run drains", ["want", "loaded", "lease", "unload"], S.DRAINING),
    (
        "the last run of a draining model",
        ["want", "loaded", "lease", "unload", "release"],
        S.UNLOADING,
    ),
    ("an unloaded model is cold", ["want", "loaded", "unload", "unloaded"], S.COLD),
    ("a process that dies", ["want", "loaded", "lease", "exited"], S.FAILED),
    ("a cold model loads again", ["want", "loaded", "unload", "unloaded", "want"], S.LOADING),
]


@pytest.mark.parametrize(("steps", "final"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_transitions(steps: list[str], final: ModelState) -> None:
    t = table(ModelSpec("a", 10))
    life = 0
    for step in steps:
        if step == "want":
            t.want("a", 0.0)
        elif step == "loaded":
            t.loaded("a", 0.0)
        elif step == "failed":
            t.load_failed("a", "boom", 0.0)
        elif step == "lease":
            life = t.lease("a", 0.0)
        elif step == "release":
            t.release("a", life, 0.0)
        elif step == "unload":
            assert t.unload("a", "operator")
        elif step == "unloaded":
            t.unloaded("a")
        elif step == "exited":
            t.exited("a", "killed", 0.0)
    assert t.models["a"].state is final


@pytest.mark.parametrize(
    "bad",
    [
        lambda t: t.loaded("a", 0.0),  # cold -> ready
        lambda t: t.unloaded("a"),  # cold -> cold
        lambda t: t.lease("a", 0.0),  # a lease of a cold model
    ],
)
def test_a_transition_outside_the_table_is_a_bug(bad: Any) -> None:
    with pytest.raises(InvariantError):
        bad(table(ModelSpec("a", 10)))


# --- wants, loads, eviction --------------------------------------------------------------


def test_concurrent_wants_of_a_cold_model_plan_one_load() -> None:
    t = table(ModelSpec("a", 10))
    assert [t.want("a", 0.0) for _ in range(5)] == [Wait()] * 5
    assert t.actions() == [StartLoad("a")]


def test_a_load_that_does_not_fit_evicts_the_least_recently_used_idle_model() -> None:
    t = table(ModelSpec("a", 40), ModelSpec("b", 40), ModelSpec("c", 40))
    load(t, "a", 1.0)
    load(t, "b", 2.0)
    t.release("a", t.lease("a", 3.0), 3.0)  # a used after b: b is older
    assert t.want("c", 4.0) == Wait()
    assert t.actions() == [StartUnload("b", "evicted for c")]
    # c starts only once b's memory is free.
    assert t.models["c"].state is S.LOADING
    assert not t.models["c"].started
    assert t.resident_mib() == 80
    t.unloaded("b")
    assert t.actions() == [StartLoad("c")]
    assert t.resident_mib() == 80


@pytest.mark.parametrize(
    ("spec_a", "hold", "why", "pinned"),
    [
        (ModelSpec("a", 60, pinned=True), False, "a (pinned)", ("a",)),
        (ModelSpec("a", 60), True, "a (1 run in flight)", ()),
        (ModelSpec("a", 60, min_residency_s=30), False, "a (used 10s ago, min_residency_s 30)", ()),
    ],
    ids=["pinned", "runs in flight", "min residency"],
)
def test_a_load_that_needs_a_model_that_must_stay_is_refused_naming_it(
    spec_a: ModelSpec, hold: bool, why: str, pinned: tuple[str, ...]
) -> None:
    t = table(spec_a, ModelSpec("b", 60))
    load(t, "a", 0.0)
    if hold:
        t.lease("a", 0.0)
    decision = t.want("b", 10.0)
    assert isinstance(decision, Refused)
    assert not decision.failed
    assert why in decision.reason
    # Only a pinned model makes the refusal last (until an operator unpins it).
    assert decision.pinned == pinned
    assert "needs 60 MiB of node.memory_mib 100" in decision.reason
    assert t.actions() == []
    assert t.models["a"].state is S.READY
    assert t.models["b"].state is S.COLD


def test_a_refusal_is_lasting_only_when_the_pinned_models_alone_leave_no_room() -> None:
    # p (pinned, 30) and q (min residency, 30) hold 60 of 100. b (50) would
    # fit once q goes: the refusal passes with q's residency. c (80) does
    # not fit beside p whatever goes: it lasts until p is unpinned.
    t = table(
        ModelSpec("p", 30, pinned=True),
        ModelSpec("q", 30, min_residency_s=30),
        ModelSpec("b", 50),
        ModelSpec("c", 80),
    )
    load(t, "p", 0.0)
    load(t, "q", 0.0)
    passing = t.want("b", 10.0)
    assert isinstance(passing, Refused)
    assert passing.pinned == ()
    lasting = t.want("c", 10.0)
    assert isinstance(lasting, Refused)
    assert lasting.pinned == ("p",)
    assert "p (pinned)" in lasting.reason


def test_a_group_rule_that_needs_a_pinned_model_gone_is_a_lasting_refusal() -> None:
    g = GroupSpec("g")
    t = table(ModelSpec("a", 10, group=g, pinned=True), ModelSpec("b", 10, group=g))
    load(t, "a", 0.0)
    refused = t.want("b", 1.0)
    assert isinstance(refused, Refused)
    assert refused.pinned == ("a",)
    assert "a (pinned)" in refused.reason


def test_past_min_residency_the_model_may_be_evicted() -> None:
    t = table(ModelSpec("a", 60, min_residency_s=30), ModelSpec("b", 60))
    load(t, "a", 0.0)
    assert t.want("b", 30.0) == Wait()
    assert t.actions() == [StartUnload("a", "evicted for b")]


def test_a_failed_load_is_refused_with_its_reason_until_its_backoff_ends_and_doubles() -> None:
    t = table(ModelSpec("a", 10))
    t.want("a", 0.0)
    assert t.load_failed("a", "exited with 1", 0.0) == 5.0
    refused = t.want("a", 4.0)
    assert isinstance(refused, Refused)
    assert refused.failed
    assert "model a failed to load: exited with 1" in refused.reason
    assert t.want("a", 5.0) == Wait()  # the backoff is over: a new load
    assert t.actions() == [StartLoad("a"), StartLoad("a")]
    assert t.load_failed("a", "again", 5.0) == 10.0
    t.want("a", 15.0)
    t.loaded("a", 16.0)
    t.unload("a", "x")
    t.unloaded("a")
    t.want("a", 17.0)
    assert t.load_failed("a", "after a good load", 17.0) == 5.0  # the count starts again


def test_an_idle_model_is_unloaded_after_its_ttl_and_never_while_held() -> None:
    t = table(ModelSpec("a", 10, idle_ttl_s=60), ModelSpec("p", 10, pinned=True))
    load(t, "a", 0.0)
    load(t, "p", 0.0)
    life = t.lease("a", 10.0)
    t.tick(1000.0)
    assert t.actions() == []  # held
    t.release("a", life, 1000.0)
    assert t.next_deadline() == 1060.0  # the pinned model has none
    t.tick(1059.0)
    assert t.actions() == []
    t.tick(1060.0)
    assert t.actions() == [StartUnload("a", "idle for 60s (idle_ttl_s 60)")]


def test_a_pinned_model_is_loaded_by_the_tick_and_again_after_each_retry() -> None:
    t = table(ModelSpec("p", 10, pinned=True))
    t.tick(0.0)
    assert t.actions() == [StartLoad("p")]
    assert t.load_failed("p", "boom", 1.0) == 5.0
    assert t.next_deadline() == 6.0  # its retry
    t.tick(5.9)
    assert t.actions() == []
    t.tick(6.0)
    assert t.actions() == [StartLoad("p")]
    t.loaded("p", 7.0)
    assert t.next_deadline() == math.inf
    t.tick(1000.0)
    assert t.actions() == []


def test_a_lease_of_a_life_that_ended_releases_nothing_of_the_next() -> None:
    t = table(ModelSpec("a", 10))
    load(t, "a", 0.0)
    old = t.lease("a", 0.0)
    t.exited("a", "killed", 0.0)
    t.want("a", 100.0)
    t.loaded("a", 100.0)
    t.lease("a", 100.0)
    t.release("a", old, 101.0)
    assert t.models["a"].leases == 1


def test_group_swap_unloads_the_other_member() -> None:
    g = GroupSpec("g", swap=True, exclusive=False)
    t = table(ModelSpec("a", 10, group=g), ModelSpec("b", 10, group=g), ModelSpec("c", 10))
    load(t, "a", 0.0)
    load(t, "c", 0.0)
    assert t.want("b", 1.0) == Wait()
    assert t.actions() == [StartUnload("a", "evicted for b")]
    assert t.models["c"].state is S.READY  # not in the group, not exclusive


def test_group_exclusive_unloads_other_groups_but_persistent_ones() -> None:
    g = GroupSpec("g", swap=False, exclusive=True)
    keep = GroupSpec("keep", exclusive=False, persistent=True)
    t = table(
        ModelSpec("a", 10, group=g),
        ModelSpec("b", 10, group=g),
        ModelSpec("e", 10, group=keep),
        ModelSpec("free", 10),
    )
    load(t, "a", 0.0)
    load(t, "e", 0.0)
    load(t, "free", 0.0)
    assert t.want("b", 1.0) == Wait()
    assert t.actions() == [StartUnload("free", "evicted for b")]
    assert t.models["a"].state is S.READY  # swap = false: members run together
    assert t.models["e"].state is S.READY  # persistent


def test_a_group_rule_that_needs_a_busy_model_refuses_the_load() -> None:
    g = GroupSpec("g")
    t = table(ModelSpec("a", 10, group=g), ModelSpec("b", 10, group=g))
    load(t, "a", 0.0)
    t.lease("a", 0.0)
    refused = t.want("b", 1.0)
    assert isinstance(refused, Refused)
    assert "a (1 run in flight)" in refused.reason


# --- properties --------------------------------------------------------------------------

# Few models, so that random steps often need an eviction; no min_residency_s
# and no idle ttl, so that nothing but a lease or a pin keeps a model.
SPECS = [
    ModelSpec("a", 40),
    ModelSpec("b", 50),
    ModelSpec("p", 20, pinned=True),
    ModelSpec("g", 30, idle_ttl_s=3, group=GroupSpec("g", exclusive=True)),
]
NAMES = [s.name for s in SPECS]

step = st.one_of(
    st.tuples(st.just("want"), st.sampled_from(NAMES)),
    st.tuples(st.just("lease"), st.sampled_from(NAMES)),
    st.tuples(st.just("release"), st.sampled_from(NAMES)),
    st.tuples(st.just("finish"), st.sampled_from(NAMES)),  # the driver finishes an action
    st.tuples(st.just("finish"), st.just("*")),  # ... or every action it was given
    st.tuples(st.just("fail"), st.sampled_from(NAMES)),
    st.tuples(st.just("exit"), st.sampled_from(NAMES)),
    st.tuples(st.just("unload"), st.sampled_from(NAMES)),
    st.tuples(st.just("tick"), st.just("")),
)


@settings(max_examples=1000, deadline=None)
@given(st.lists(step, max_size=80))
# The cases the random ones must never get wrong, always played: a held model
# and a pinned one in the way of a load that needs their memory.
@example(
    [("want", "a"), ("finish", "*"), ("lease", "a"), ("want", "p"), ("finish", "*"), ("want", "b")]
)
@example([("want", "p"), ("want", "a"), ("finish", "*"), ("lease", "a"), ("want", "b")])
@example(
    [("want", "a"), ("want", "p"), ("finish", "*"), ("want", "b"), ("finish", "*"), ("want", "g")]
)
def test_memory_never_exceeds_the_budget_and_held_or_pinned_models_stay(
    steps: list[tuple[str, str]],
) -> None:
    t = table(*SPECS, budget=100)
    now = 0.0
    leases: dict[str, list[int]] = {n: [] for n in NAMES}
    pending: list[StartLoad | StartUnload] = []
    for kind, name in steps:
        now += 1.0
        before = {n: (m.state, m.leases, m.spec.pinned) for n, m in t.models.items()}
        if kind == "want":
            t.want(name, now)
        elif kind == "lease" and t.models[name].state is S.READY:
            leases[name].append(t.lease(name, now))
        elif kind == "release" and leases[name]:
            t.release(name, leases[name].pop(), now)
        elif kind == "finish":
            for action in [a for a in pending if name in ("*", a.model)]:
                pending.remove(action)
                if isinstance(action, StartLoad) and t.models[action.model].state is S.LOADING:
                    t.loaded(action.model, now)
                elif isinstance(action, StartUnload):
                    t.unloaded(action.model)
        elif kind == "fail" and any(isinstance(a, StartLoad) and a.model == name for a in pending):
            pending[:] = [a for a in pending if a.model != name]
            t.load_failed(name, "boom", now)
        elif kind == "exit" and t.models[name].state in (S.READY, S.DRAINING):
            t.exited(name, "died", now)
            leases[name].clear()
        elif kind == "unload" and not t.models[name].spec.pinned:
            t.unload(name, "operator")
        elif kind == "tick":
            t.tick(now)
        actions = t.actions()
        pending.extend(actions)
        # The memory of every started process never passes the budget.
        assert t.resident_mib() <= t.budget_mib
        for action in actions:
            if isinstance(action, StartUnload):
                state, held, pinned = before[action.model]
                # Never a pinned model, never one a run holds.
                assert not pinned
                assert held == 0 or action.reason == "operator"
                assert state in (S.READY, S.DRAINING)
        for n, m in t.models.items():
            assert m.leases >= 0
            if m.spec.pinned and before[n][0] is S.READY:
                assert m.state in (S.READY, S.FAILED)  # only its own death ends it


# --- the operator's pin, and the counters the node offers ------------------------------


def test_an_operator_pin_keeps_a_model_from_eviction_and_loads_it() -> None:
    t = table(ModelSpec("a", 60), ModelSpec("b", 60))
    # Pinning a cold model plans its load, as a pinned model's start does.
    assert t.pin("a", True, 0.0) == Wait()
    assert t.actions() == [StartLoad("a")]
    t.loaded("a", 1.0)
    refused = t.want("b", 2.0)
    assert isinstance(refused, Refused)
    assert "a (pinned)" in refused.reason
    # Unpinned, it is evicted for b like any idle model.
    assert t.pin("a", False, 3.0) is None
    assert t.want("b", 3.0) == Wait()
    assert t.actions() == [StartUnload("a", "evicted for b")]
    assert t.models["a"].evictions == 1


def test_pinning_a_loaded_model_plans_nothing() -> None:
    t = table(ModelSpec("a", 60))
    load(t, "a", 0.0)
    assert t.pin("a", True, 1.0) is None
    assert t.actions() == []


def test_the_counters_count_loads_failures_evictions_and_cold_starts() -> None:
    t = table(ModelSpec("a", 60), ModelSpec("b", 60))
    t.cold_start("a")
    load(t, "a", 0.0)
    load(t, "b", 1.0)  # evicts a
    assert t.want("a", 2.0) == Wait()
    for act in t.actions():
        if isinstance(act, StartUnload):
            t.unloaded(act.model)
    t.load_failed("a", "boom", 3.0)
    a, b = t.models["a"], t.models["b"]
    assert (a.loads, a.load_failures, a.evictions, a.cold_starts) == (1, 1, 1, 1)
    assert (b.loads, b.load_failures, b.evictions, b.cold_starts) == (1, 0, 1, 0)
