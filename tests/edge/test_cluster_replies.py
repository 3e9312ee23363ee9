"""The cluster scripts' replies, decoded (iop.edge.tenancy._cluster_replies, sans-IO).

What a real Valkey answers decodes; anything else is ``BadReply`` and
nothing else: the edge maps that one exception to a fault (the wire-level
cases, through a proxy to a real server: tests/edge/test_cluster_faults.py).
"""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iop.edge.tenancy._cluster_replies import (
    MAX_LIVE_EDGES,
    BadReply,
    Reservation,
    decode_done,
    decode_heartbeat,
    decode_reserve,
)

ALL_LIMITS = {"requests": True, "tokens": True, "concurrency": True}

# RESERVE's reply as coredis returns it from Valkey: Lua numbers as RESP
# integers, tostring()'d numbers as bulk strings.
ADMITTED = [1, b"9", b"6", b"400", b"36", 1, b"0", b"0", 0]


def _reserve(*values: object) -> list[object]:
    return list(values)


def test_a_real_admission_decodes() -> None:
    r = decode_reserve(ADMITTED, **ALL_LIMITS)
    assert r == Reservation(
        admitted=True,
        requests_left=9.0,
        requests_refill_s=6.0,
        tokens_left=400.0,
        tokens_refill_s=36.0,
        running=1,
        requests_wait_s=0.0,
        tokens_wait_s=0.0,
        concurrency_full=False,
    )


def test_refusals_decode_with_their_reasons() -> None:
    too_large = _reserve(0, b"0", b"0", b"10", b"0.5", 0, b"0", b"-1", 0)
    assert decode_reserve(too_large, **ALL_LIMITS).tokens_wait_s == -1.0
    # Lua's tostring of small and large numbers.
    waits = _reserve(0, b"0.25", b"1e-05", b"1e+15", b"0", 3, b"5.9999", b"0", 1)
    r = decode_reserve(waits, **ALL_LIMITS)
    assert (r.requests_wait_s, r.tokens_left, r.concurrency_full) == (5.9999, 1e15, True)


@pytest.mark.parametrize(
    ("reply", "limits"),
    [
        # Admitted, yet a reason to wait.
        (_reserve(1, b"9", b"6", b"0", b"0", 1, b"2", b"0", 0), ALL_LIMITS),
        (_reserve(1, b"9", b"6", b"0", b"0", 1, b"0", b"0", 1), ALL_LIMITS),
        # Refused for no reason, or for a limit the tenant does not have.
        (_reserve(0, b"0", b"0", b"0", b"0", 0, b"0", b"0", 0), ALL_LIMITS),
        (
            _reserve(0, b"0", b"0", b"0", b"0", 0, b"3", b"0", 0),
            {"requests": False, "tokens": True, "concurrency": True},
        ),
        (
            _reserve(0, b"0", b"0", b"0", b"0", 0, b"0", b"-1", 0),
            {"requests": True, "tokens": False, "concurrency": True},
        ),
        (
            _reserve(0, b"0", b"0", b"0", b"0", 2, b"0", b"0", 1),
            {"requests": True, "tokens": True, "concurrency": False},
        ),
        # Out of range.
        (_reserve(2, b"9", b"6", b"0", b"0", 1, b"0", b"0", 0), ALL_LIMITS),
        (_reserve(0, b"0", b"0", b"0", b"0", 0, b"0", b"-0.5", 0), ALL_LIMITS),
        (_reserve(0, b"0", b"0", b"0", b"0", 0, b"-2", b"0", 1), ALL_LIMITS),
        (_reserve(1, b"9", b"inf", b"0", b"0", 1, b"0", b"0", 0), ALL_LIMITS),
        (_reserve(1, b"9", b"6", b"0", b"0", -1, b"0", b"0", 0), ALL_LIMITS),
        (_reserve(1, b"9" * 65, b"6", b"0", b"0", 1, b"0", b"0", 0), ALL_LIMITS),
        # Wrong kinds, count.
        (_reserve(True, b"9", b"6", b"0", b"0", 1, b"0", b"0", 0), ALL_LIMITS),
        (_reserve(1, 9, b"6", b"0", b"0", 1, b"0", b"0", 0), ALL_LIMITS),
        (_reserve(1, b"9", b"6", b"0", b"0", b"1", b"0", b"0", 0), ALL_LIMITS),
        (ADMITTED[:8], ALL_LIMITS),
        ([*ADMITTED, 0], ALL_LIMITS),
        (tuple(ADMITTED), ALL_LIMITS),
    ],
)
def test_a_reservation_of_another_shape_is_refused(reply: object, limits: dict[str, bool]) -> None:
    with pytest.raises(BadReply):
        decode_reserve(reply, **limits)


def test_the_live_edge_count_is_bounded() -> None:
    """A count past MAX_LIVE_EDGES is not a count (it would shrink every
    share to 1): a fault; the bound itself is a count."""
    assert decode_heartbeat(MAX_LIVE_EDGES) == MAX_LIVE_EDGES
    assert decode_heartbeat(1) == 1
    for bad in (MAX_LIVE_EDGES + 1, 0, -1, 10**40, True, b"1", 1.0, None, [1]):
        with pytest.raises(BadReply):
            decode_heartbeat(bad)


def test_done_is_the_integer_one() -> None:
    decode_done(1)
    for bad in (0, 2, True, b"1", b"OK", None, [1]):
        with pytest.raises(BadReply):
            decode_done(bad)


# What coredis can hand back from RESP3: integers, strings, nil, booleans,
# doubles, arrays, maps; nested.
_resp = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.binary(max_size=24)
    | st.sampled_from([b"nan", b"inf", b"-1", b"0", b"1e308", b"1_0", b" 1 "]),
    lambda inner: st.lists(inner, max_size=10) | st.dictionaries(st.binary(max_size=4), inner),
    max_leaves=8,
)


@settings(max_examples=100, deadline=None)
@given(
    reply=_resp | st.lists(_resp, min_size=9, max_size=9),
    limits=st.fixed_dictionaries(
        {"requests": st.booleans(), "tokens": st.booleans(), "concurrency": st.booleans()}
    ),
)
def test_any_reply_decodes_or_is_bad_reply(reply: object, limits: dict[str, bool]) -> None:
    for decode in (decode_heartbeat, decode_done):
        with contextlib.suppress(BadReply):
            decode(reply)
    try:
        r = decode_reserve(reply, **limits)
    except BadReply:
        return
    # What the edge then relies on: finite numbers, a refusal with a reason.
    assert r.admitted or (
        (limits["concurrency"] and r.concurrency_full)
        or (limits["requests"] and r.requests_wait_s > 0)
        or (limits["tokens"] and r.tokens_wait_s != 0)
    )
