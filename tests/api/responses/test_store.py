"""The store behind previous_response_id: caps, TTL, LRU, and the expanded conversation."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iop.api import RunContext
from iop.api.responses import PREVIOUS_NOT_FOUND_STATUS, ResponsesSurface, ResponseStore
from iop.config import EdgeConfig, OutputPolicy, ResponsesSettings, decode_config
from iop.errors import ConfigError, RequestError
from iop.events import Complete, Delta, Error, ToolCall
from iop.spec import FunctionCall, Message, MessageToolCall


def _conv(text: str) -> tuple[Message, ...]:
    return (Message(role="user", content=text),)


def _size(text: str) -> int:
    return len(msgspec.json.encode(_conv(text)))


def test_get_returns_what_was_put_until_the_ttl_is_over() -> None:
    store = ResponseStore(max_entries=4, max_bytes=10_000, ttl_s=10)
    assert store.put("resp_a", _conv("a"), now=100.0)
    assert store.get("resp_a", now=109.9) == _conv("a")
    assert store.get("resp_a", now=110.0) is None
    assert len(store) == 0
    assert store.bytes == 0


def test_a_lookup_does_not_extend_the_ttl() -> None:
    store = ResponseStore(max_entries=4, max_bytes=10_000, ttl_s=10)
    store.put("resp_a", _conv("a"), now=0.0)
    for t in (3.0, 6.0, 9.0):
        assert store.get("resp_a", now=t) is not None
    assert store.get("resp_a", now=10.0) is None


def test_expired_entries_are_freed_by_any_later_call() -> None:
    store = ResponseStore(max_entries=4, max_bytes=10_000, ttl_s=10)
    store.put("resp_a", _conv("a"), now=0.0)
    store.put("resp_b", _conv("b"), now=5.0)
    store.put("resp_c", _conv("c"), now=12.0)  # a expired at 10
    assert "resp_a" not in store
    assert len(store) == 2
    assert store.get("unknown", now=15.0) is None  # b expired at 15
    assert ["resp_b" in store, "resp_c" in store] == [False, True]


def test_max_entries_evicts_the_least_recently_used() -> None:
    store = ResponseStore(max_entries=2, max_bytes=10_000, ttl_s=100)
    store.put("resp_a", _conv("a"), now=0.0)
    store.put("resp_b", _conv("b"), now=1.0)
    assert store.get("resp_a", now=2.0) is not None  # a is now the most recent
    store.put("resp_c", _conv("c"), now=3.0)
    assert "resp_b" not in store
    assert "resp_a" in store
    assert "resp_c" in store
    assert len(store) == 2


def test_max_bytes_evicts_until_the_new_entry_fits() -> None:
    one = _size("x" * 100)
    store = ResponseStore(max_entries=100, max_bytes=3 * one, ttl_s=100)
    for name in "abc":
        store.put(f"resp_{name}", _conv(name * 100), now=0.0)
    assert store.bytes == 3 * one
    store.put("resp_d", _conv("d" * 100), now=1.0)
    assert "resp_a" not in store
    assert store.bytes == 3 * one
    assert store.bytes <= store.max_bytes


def test_a_conversation_larger_than_the_budget_is_not_stored_and_evicts_nothing() -> None:
    store = ResponseStore(max_entries=100, max_bytes=_size("x" * 10), ttl_s=100)
    store.put("resp_small", _conv("x" * 10), now=0.0)
    assert not store.put("resp_big", _conv("y" * 11), now=0.0)
    assert "resp_big" not in store
    assert "resp_small" in store


def test_putting_an_id_again_replaces_it() -> None:
    store = ResponseStore(max_entries=2, max_bytes=10_000, ttl_s=100)
    store.put("resp_a", _conv("a"), now=0.0)
    store.put("resp_a", _conv("bb"), now=1.0)
    assert len(store) == 1
    assert store.bytes == _size("bb")
    assert store.get("resp_a", now=100.5) == _conv("bb")  # its ttl restarted at 1.0


@pytest.mark.parametrize("kwargs", [{"max_entries": 0}, {"max_bytes": 0}, {"ttl_s": 0}])
def test_store_bounds_must_be_positive(kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {"max_entries": 1, "max_bytes": 1, "ttl_s": 1.0, **kwargs}
    with pytest.raises(ValueError, match="must be"):
        ResponseStore(**args)


def test_responses_config_keys_and_their_checks() -> None:
    cfg = decode_config(
        {"responses": {"store_max_entries": 5, "store_max_bytes": 1000, "store_ttl_s": 30}},
        EdgeConfig,
        source="edge.toml",
    )
    assert cfg.responses == ResponsesSettings(
        store_max_entries=5, store_max_bytes=1000, store_ttl_s=30
    )
    assert EdgeConfig().responses == ResponsesSettings()
    for key in ("store_max_entries", "store_max_bytes", "store_ttl_s"):
        with pytest.raises(ConfigError, match=key):
            decode_config({"responses": {key: 0}}, EdgeConfig, source="edge.toml")
    with pytest.raises(ConfigError, match=r"unknown key 'responses\.ttl'"):
        decode_config({"responses": {"ttl": 1}}, EdgeConfig, source="edge.toml")
    surface = ResponsesSurface.from_settings(cfg.responses)
    assert (surface.store.max_entries, surface.store.max_bytes, surface.store.ttl_s) == (
        5,
        1000,
        30,
    )


# --- through the surface ---------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _run(
    surface: ResponsesSurface, run_id: str, body: dict[str, Any], *events: Any, stream: bool
) -> None:
    call = surface.parse(json.dumps({"model": "m", "stream": stream, **body}).encode(), {})
    ctx = RunContext(run_id=run_id, created=1_700_000_000, policy=OutputPolicy())
    if stream:
        enc = surface.stream(call, ctx)
        enc.start()
        enc.feed_many(events)
        assert enc.finished
    else:
        col = surface.collector(call, ctx)
        for e in events:
            col.feed(e)
        assert col.result()[0] == 200


@pytest.mark.parametrize("stream", [True, False])
def test_previous_response_id_expands_prior_input_and_output_before_the_new_input(
    stream: bool,
) -> None:
    clock = _Clock()
    surface = ResponsesSurface(
        ResponseStore(max_entries=8, max_bytes=1 << 20, ttl_s=60), clock=clock
    )
    call = ToolCall(id="call_1", name="shell", arguments='{"c":"ls"}')
    tools = [{"type": "function", "name": "shell", "parameters": {}, "strict": None}]
    _run(
        surface,
        "r1",
        {"input": "first", "instructions": "old rules", "tools": tools},
        Delta("calling"),
        Complete(tool_calls=(call,)),
        stream=stream,
    )
    _run(
        surface,
        "r2",
        {
            "input": [{"type": "function_call_output", "call_id": "call_1", "output": "a.txt"}],
            "previous_response_id": "resp_r1",
        },
        Delta("there is a.txt"),
        Complete(),
        stream=stream,
    )
    third = surface.parse(
        json.dumps(
            {
                "model": "m",
                "input": "thanks",
                "previous_response_id": "resp_r2",
                "instructions": "new",
            }
        ).encode(),
        {},
    )
    assert third.request.messages == [
        Message(role="system", content="new"),  # the old instructions are not carried over
        Message(role="user", content="first"),
        Message(
            role="assistant",
            content="calling",
            tool_calls=[
                MessageToolCall(
                    id="call_1", function=FunctionCall(name="shell", arguments='{"c":"ls"}')
                )
            ],
        ),
        Message(role="tool", tool_call_id="call_1", content="a.txt"),
        Message(role="assistant", content="there is a.txt"),
        Message(role="user", content="thanks"),
    ]


def test_store_false_is_not_stored_and_an_unknown_id_is_openais_error() -> None:
    clock = _Clock()
    surface = ResponsesSurface(
        ResponseStore(max_entries=8, max_bytes=1 << 20, ttl_s=60), clock=clock
    )
    _run(surface, "r1", {"input": "x", "store": False}, Delta("y"), Complete(), stream=True)
    assert len(surface.store) == 0
    with pytest.raises(RequestError) as info:
        surface.parse(
            json.dumps({"model": "m", "input": "z", "previous_response_id": "resp_r1"}).encode(), {}
        )
    err = info.value
    assert err.message == "Previous response with id 'resp_r1' not found."
    assert (err.status, err.param, err.code) == (
        PREVIOUS_NOT_FOUND_STATUS,
        "previous_response_id",
        "previous_response_not_found",
    )


def test_an_expired_response_is_not_found() -> None:
    clock = _Clock()
    surface = ResponsesSurface(
        ResponseStore(max_entries=8, max_bytes=1 << 20, ttl_s=60), clock=clock
    )
    _run(surface, "r1", {"input": "x"}, Delta("y"), Complete(), stream=False)
    clock.now += 59
    surface.parse(
        json.dumps({"model": "m", "input": "z", "previous_response_id": "resp_r1"}).encode(), {}
    )
    clock.now += 1
    with pytest.raises(RequestError, match="not found"):
        surface.parse(
            json.dumps({"model": "m", "input": "z", "previous_response_id": "resp_r1"}).encode(), {}
        )


def test_a_failed_response_is_not_stored() -> None:
    surface = ResponsesSurface(
        ResponseStore(max_entries=8, max_bytes=1 << 20, ttl_s=60), clock=_Clock()
    )
    call = surface.parse(b'{"model": "m", "input": "x", "stream": true}', {})
    enc = surface.stream(call, RunContext(run_id="r1", created=1, policy=OutputPolicy()))
    enc.start()
    enc.feed_many([Delta("part"), Error(message="boom")])
    assert enc.finished
    assert len(surface.store) == 0


def test_a_conversation_that_is_not_utf8_is_not_stored() -> None:
    store = ResponseStore(max_entries=2, max_bytes=10_000, ttl_s=100)
    assert not store.put("resp_a", _conv("a\ud800"), now=0.0)
    assert len(store) == 0


# --- tenants: each its own ids and its share -------------------------------------------


def test_a_tenant_never_gets_another_tenants_response() -> None:
    store = ResponseStore(max_entries=4, max_bytes=10_000, ttl_s=10, tenants=2)
    assert store.put("resp_a", _conv("a's"), now=0.0, tenant="a")
    assert store.get("resp_a", now=1.0, tenant="b") is None
    assert store.get("resp_a", now=1.0, tenant="a") == _conv("a's")
    assert store.usage("a") == (1, _size("a's"))
    assert store.usage("b") == (0, 0)
    # The same id under another tenant is another entry: neither replaces the other.
    assert store.put("resp_a", _conv("b's"), now=2.0, tenant="b")
    assert store.get("resp_a", now=3.0, tenant="a") == _conv("a's")
    assert store.get("resp_a", now=3.0, tenant="b") == _conv("b's")


def test_a_tenant_filling_the_store_does_not_evict_another_within_its_share() -> None:
    store = ResponseStore(max_entries=10, max_bytes=1 << 20, ttl_s=100, tenants=2)
    assert (store.share_entries, store.share_bytes) == (5, (1 << 20) // 2)
    for i in range(3):
        store.put(f"resp_b{i}", _conv(f"b{i}"), now=0.0, tenant="b")
    for i in range(50):
        assert store.put(f"resp_a{i}", _conv(f"a{i}"), now=1.0, tenant="a")
    assert all(store.get(f"resp_b{i}", now=2.0, tenant="b") for i in range(3))
    assert store.usage("a")[0] == 7  # the rest of the store, b's unused share lent
    assert len(store) == 10


def test_a_tenant_filling_the_bytes_does_not_evict_another_within_its_share() -> None:
    one = _size("x" * 100)
    store = ResponseStore(max_entries=100, max_bytes=4 * one, ttl_s=100, tenants=2)
    for i in range(2):
        store.put(f"resp_b{i}", _conv(str(i) * 100), now=0.0, tenant="b")
    for i in range(8):  # eight maximum-size requests
        assert store.put(f"resp_a{i}", _conv("a" * 100), now=1.0, tenant="a")
    assert all(store.get(f"resp_b{i}", now=2.0, tenant="b") for i in range(2))
    assert store.usage("a") == (2, 2 * one)
    assert store.bytes == 4 * one


def test_an_idle_tenants_share_is_lent_and_taken_back() -> None:
    store = ResponseStore(max_entries=10, max_bytes=1 << 20, ttl_s=100, tenants=2)
    for i in range(10):
        store.put(f"resp_a{i}", _conv(f"a{i}"), now=0.0, tenant="a")
    assert store.usage("a")[0] == 10  # alone, a has the whole store
    for i in range(5):
        store.put(f"resp_b{i}", _conv(f"b{i}"), now=1.0, tenant="b")
    # b's share came back from a, a's least recently used first.
    assert store.usage("a")[0] == store.usage("b")[0] == 5
    assert [f"resp_a{i}" in store.ids("a") for i in range(10)] == [False] * 5 + [True] * 5
    # Over its own share, b makes room from its own entries.
    store.put("resp_b5", _conv("b5"), now=2.0, tenant="b")
    assert store.usage("a")[0] == 5
    assert store.ids("b") == {f"resp_b{i}" for i in range(1, 6)}


def test_a_conversation_larger_than_its_tenants_share_is_not_stored() -> None:
    one = _size("x" * 100)
    store = ResponseStore(max_entries=100, max_bytes=2 * one + 1, ttl_s=100, tenants=2)
    assert store.share_bytes == one
    assert store.put("resp_fits", _conv("x" * 100), now=0.0, tenant="a")
    assert not store.put("resp_big", _conv("x" * 101), now=0.0, tenant="b")
    assert len(store) == 1


def test_more_tenants_than_configured_shrink_every_share() -> None:
    store = ResponseStore(max_entries=4, max_bytes=1 << 20, ttl_s=100, tenants=2)
    for name in "abcd":
        assert store.put(f"resp_{name}", _conv(name), now=0.0, tenant=name)
    assert store.share_entries == 1
    for name in "abcd":
        assert store.put(f"resp_{name}2", _conv(name), now=1.0, tenant=name)
        assert store.usage(name)[0] == 1
    assert len(store) == 4


@pytest.mark.parametrize(
    "kwargs", [{"tenants": 0}, {"max_entries": 2, "tenants": 3}, {"max_bytes": 2, "tenants": 3}]
)
def test_every_tenant_gets_a_share_of_at_least_one(kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {"max_entries": 10, "max_bytes": 10, "ttl_s": 1.0, **kwargs}
    with pytest.raises(ValueError, match="must be"):
        ResponseStore(**args)


_TENANTS = ("a", "b", "c")


@given(
    st.lists(
        st.tuples(
            st.sampled_from(_TENANTS),
            st.integers(0, 11),  # the response id, within its tenant
            st.integers(0, 40),  # text length
            st.booleans(),  # True: a lookup instead of a put
        ),
        max_size=60,
    ),
    st.integers(1, 12),
    st.integers(60, 600),
)
@settings(max_examples=150, deadline=None)
def test_shares_hold_and_the_caps_still_hold_in_total(
    ops: list[tuple[str, int, int, bool]], max_entries: int, max_bytes: int
) -> None:
    """A put of one tenant never evicts another's entries while the other is
    within its share; the caps hold in total; what is kept is what was put."""
    tenants = len(_TENANTS)
    max_entries = max(max_entries, tenants)
    store = ResponseStore(max_entries=max_entries, max_bytes=max_bytes, ttl_s=1000, tenants=tenants)
    kept: dict[tuple[str, str], tuple[Message, ...]] = {}
    for step, (tenant, n, length, lookup) in enumerate(ops):
        rid = f"resp_{n}"
        if lookup:
            assert store.get(rid, now=step, tenant=tenant) == kept.get((tenant, rid))
            continue
        before = {t: (store.usage(t), store.ids(t)) for t in _TENANTS if t != tenant}
        conv = _conv("x" * length)
        stored = store.put(rid, conv, now=step, tenant=tenant)
        assert stored == (len(msgspec.json.encode(conv)) <= store.share_bytes)
        kept.pop((tenant, rid), None)
        if stored:
            kept[(tenant, rid)] = conv
        for other, ((count, size), ids) in before.items():
            if count <= store.share_entries and size <= store.share_bytes:
                assert store.ids(other) == ids, (other, count, size)
        kept = {k: v for k, v in kept.items() if k[1] in store.ids(k[0])}
        assert len(store) == len(kept) <= max_entries
        assert store.bytes == sum(len(msgspec.json.encode(v)) for v in kept.values())
        assert store.bytes <= max_bytes
        assert sum(store.usage(t)[0] for t in _TENANTS) == len(store)


def test_through_the_surface_another_tenants_id_is_an_unknown_id() -> None:
    surface = ResponsesSurface(
        ResponseStore(max_entries=8, max_bytes=1 << 20, ttl_s=60, tenants=2), clock=_Clock()
    )
    call = surface.parse(b'{"model": "m", "input": "secret"}', {}, tenant="a")
    col = surface.collector(call, RunContext(run_id="r1", created=1, policy=OutputPolicy()))
    col.feed(Delta("kept"))
    col.feed(Complete())
    rid = json.loads(col.result()[1])["id"]

    def refused(tenant: str, previous: str) -> RequestError:
        body = json.dumps({"model": "m", "input": "z", "previous_response_id": previous})
        with pytest.raises(RequestError) as info:
            surface.parse(body.encode(), {}, tenant=tenant)
        return info.value

    taken, unknown = refused("b", rid), refused("b", "resp_never")
    assert taken.message == unknown.message.replace("resp_never", rid)
    assert (taken.status, taken.code, taken.param) == (unknown.status, unknown.code, unknown.param)
    again = surface.parse(
        json.dumps({"model": "m", "input": "z", "previous_response_id": rid}).encode(),
        {},
        tenant="a",
    )
    assert again.chat.messages[0] == Message(role="user", content="secret")


def test_the_edges_surface_gives_each_tenant_its_share_and_random_ids() -> None:
    settings_ = ResponsesSettings(store_max_entries=9, store_max_bytes=900)
    surface = ResponsesSurface.from_settings(settings_, tenants=3)
    assert (surface.store.share_entries, surface.store.share_bytes) == (3, 300)
    ids = set()
    for _ in range(2):
        call = surface.parse(b'{"model": "m", "input": "x"}', {}, tenant="a")
        col = surface.collector(call, RunContext(run_id="r1", created=1, policy=OutputPolicy()))
        col.feed(Complete())
        ids.add(json.loads(col.result()[1])["id"])
    assert len(ids) == 2  # one run id, two unrelated response ids
    assert all(rid.startswith("resp_") and "r1" not in rid for rid in ids)
