"""The store behind previous_response_id: caps, TTL, LRU, and the expanded conversation."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

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
