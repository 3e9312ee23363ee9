"""Shared limits in a real Valkey (iop.edge.tenancy._cluster): the Lua scripts' rules,
two edges at once, a dead edge's slots, and the fail-open share.

Each test has its own key prefix on the session's ``valkey-server``
(tests/conftest.py). Nothing waits on the wall clock: refill is shown by
moving a bucket's last-written time back in Valkey itself.
"""

from __future__ import annotations

import hashlib
import secrets
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import coredis
import pytest
import trio
from prometheus_client import CollectorRegistry

from iop.config import ClusterSettings, TenancySettings, TenantSettings
from iop.edge.tenancy._cluster import SharedLimits
from iop.edge.tenancy._limits import RateLimited
from iop.edge.tenancy._tenants import Tenants, Via
from iop.errors import ConfigError
from iop.events import Usage
from iop.testing import free_port
from tests._valkey import Valkey


def _tenant(**limits: int) -> TenantSettings:
    return TenantSettings(name="acme", key_sha256=[hashlib.sha256(b"k").hexdigest()], **limits)


@asynccontextmanager
async def edge(
    url: str,
    prefix: str,
    tenants: Sequence[TenantSettings],
    edge_id: str,
    **settings: float,
) -> AsyncIterator[SharedLimits]:
    """One edge's shared limits, its background task running."""
    cluster = ClusterSettings(valkey_url=url, key_prefix=prefix, **settings)  # type: ignore[arg-type]
    local = Tenants(tenants, [], TenancySettings())
    limits = SharedLimits(cluster, local, tenants, TenancySettings(), edge_id, CollectorRegistry())
    async with trio.open_nursery() as n:
        await n.start(limits.run)
        with trio.fail_after(5):
            while not limits.up and url.endswith("/0"):
                await trio.sleep(0.01)
        yield limits
        n.cancel_scope.cancel()


def _prefix() -> str:
    return f"t{secrets.token_hex(4)}:"


async def _admit_all(limits: SharedLimits, n: int, tokens: int = 0) -> tuple[int, int]:
    """Admit ``n`` requests at once; (admitted, refused)."""
    tenant = limits.tenants.all["acme"]
    counts = [0, 0]

    async def one() -> None:
        try:
            await limits.admit(tenant, tokens, trio.current_time())
        except RateLimited:
            counts[1] += 1
        else:
            counts[0] += 1

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)
    return counts[0], counts[1]


async def test_two_edges_share_one_request_bucket(valkey_server: Valkey) -> None:
    p = _prefix()
    tenants = [_tenant(requests_per_minute=10)]
    async with (
        edge(valkey_server.url, p, tenants, "a") as a,
        edge(valkey_server.url, p, tenants, "b") as b,
    ):
        results: list[tuple[int, int]] = []

        async def side(limits: SharedLimits) -> None:
            results.append(await _admit_all(limits, 15))

        async with trio.open_nursery() as n:
            n.start_soon(side, a)
            n.start_soon(side, b)
        # Exactly the limit across both (the server's clock refills 1 in 6 s).
        assert sum(r[0] for r in results) in (10, 11)
        assert sum(r[1] for r in results) == 30 - sum(r[0] for r in results)
        assert a.live_edges == 2 or b.live_edges == 2
        # The headers of a refusal tell the shared state.
        with pytest.raises(RateLimited) as info:
            await a.admit(a.tenants.all["acme"], 0, trio.current_time())
        assert info.value.limit == "requests"
        assert info.value.limits[0].remaining == 0


async def test_the_bucket_refills_at_limit_per_minute(valkey_server: Valkey) -> None:
    p = _prefix()
    async with edge(valkey_server.url, p, [_tenant(requests_per_minute=60)], "a") as a:
        assert await _admit_all(a, 61) in ((60, 1), (61, 0))
        assert await _admit_all(a, 1) in ((0, 1), (1, 0))
        # Two seconds ago, at 1 a second: two more.
        client = coredis.Redis.from_url(valkey_server.url)
        async with client:
            at = float(await client.hget(f"{p}b:acme", "ra"))
            await client.hset(f"{p}b:acme", {"ra": str(at - 2.0)})
        admitted, _ = await _admit_all(a, 3)
        assert admitted in (2, 3)


async def test_settle_gives_back_unused_tokens(valkey_server: Valkey) -> None:
    p = _prefix()
    async with edge(valkey_server.url, p, [_tenant(tokens_per_minute=1000)], "a") as a:
        tenant = a.tenants.all["acme"]
        first = await a.admit(tenant, 600, trio.current_time())
        assert first.via is Via.SHARED
        with pytest.raises(RateLimited) as info:
            await a.admit(tenant, 600, trio.current_time())
        assert info.value.limit == "tokens"
        a.finish(first, Usage(input_tokens=50, output_tokens=50), trio.current_time())
        with trio.fail_after(5):
            while a.pending:
                await trio.sleep(0.01)
        await a.admit(tenant, 600, trio.current_time())  # 500 came back
        # Larger than the limit itself: never.
        with pytest.raises(RateLimited) as info:
            await a.admit(tenant, 1001, trio.current_time())
        assert info.value.retry_after_s == float("inf")
        assert tenant.tokens_out == 50


async def test_concurrency_is_released_and_a_dead_edges_slots_expire(
    valkey_server: Valkey,
) -> None:
    p = _prefix()
    tenants = [_tenant(max_concurrent_runs=2)]
    async with (
        edge(valkey_server.url, p, tenants, "a") as a,
        edge(valkey_server.url, p, tenants, "b") as b,
    ):
        held = [await a.admit(a.tenants.all["acme"], 0, trio.current_time()) for _ in range(2)]
        with pytest.raises(RateLimited) as info:
            await b.admit(b.tenants.all["acme"], 0, trio.current_time())
        assert info.value.limit == "concurrency"
        a.finish(held[0], Usage(), trio.current_time())
        with trio.fail_after(5):
            while a.pending:
                await trio.sleep(0.01)
        freed = await b.admit(b.tenants.all["acme"], 0, trio.current_time())
        assert freed.holds_slot
        # Edge a dies holding a slot: its membership key expires (here:
        # deleted, as the TTL would), and b may use the slot.
        with pytest.raises(RateLimited):
            await b.admit(b.tenants.all["acme"], 0, trio.current_time())
        client = coredis.Redis.from_url(valkey_server.url)
        async with client:
            await client.delete([f"{p}m:a"])
        await b.admit(b.tenants.all["acme"], 0, trio.current_time())


async def test_a_slot_taken_by_a_timed_out_reservation_is_given_back(
    valkey_server: Valkey,
) -> None:
    """Valkey may take a slot for a reservation whose answer came too late:
    once it answers again, the edge rewrites its slots to its tickets'."""
    p = _prefix()
    async with edge(valkey_server.url, p, [_tenant(max_concurrent_runs=2)], "a") as a:
        tenant = a.tenants.all["acme"]
        held = await a.admit(tenant, 0, trio.current_time())
        client = coredis.Redis.from_url(valkey_server.url)
        async with client:
            # As a late reservation would leave it: one slot more in Valkey.
            await client.hincrby(f"{p}c:acme", "a", 1)
            with pytest.raises(RateLimited):
                await a.admit(tenant, 0, trio.current_time())
            a._resync = True
            a._wake.set()
            with trio.fail_after(5):
                while a._resync:
                    await trio.sleep(0.01)
            assert await client.hget(f"{p}c:acme", "a") == b"1"
        await a.admit(tenant, 0, trio.current_time())
        a.finish(held, Usage(), trio.current_time())


async def test_fail_open_to_a_local_share_and_back(tmp_path: Path) -> None:
    """Valkey killed: each edge admits its share (limit / live edges); back
    up: shared counters again. Never an exception other than RateLimited."""
    v = Valkey(tmp_path)
    v.start()
    p = _prefix()
    tenants = [_tenant(requests_per_minute=20)]
    try:
        async with (
            edge(v.url, p, tenants, "a", retry_interval_s=0.05) as a,
            edge(v.url, p, tenants, "b", retry_interval_s=0.05) as b,
        ):
            # Both edges counted (each heartbeat sees the other's on its next).
            with trio.fail_after(10):
                while a.live_edges < 2:
                    a._wake.set()
                    await trio.sleep(0.05)
            assert await _admit_all(a, 1) == (1, 0)
            v.kill()
            admitted, refused = await _admit_all(a, 15)
            assert not a.up
            assert a.gauge_up._value.get() == 0
            assert (admitted, refused) == (10, 5)  # 20 / 2 live edges
            assert a.fail_open._value.get() == 15
            v.start()
            with trio.fail_after(10):
                while not a.up:
                    await trio.sleep(0.02)
            # Shared again: 1 of 20 was taken before the outage; Valkey
            # restarted empty, so the buckets are full.
            admitted, _ = await _admit_all(a, 5)
            assert admitted == 5
            assert a.fail_open._value.get() == 15
            assert b is not None
    finally:
        v.kill()


async def test_valkey_never_there_admits_by_the_local_share(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/1"  # nobody listens
    async with edge(url, _prefix(), [_tenant(requests_per_minute=3)], "a") as a:
        assert not a.up
        assert await _admit_all(a, 5) == (3, 2)
        ticket = a.tenants.all["acme"]
        assert ticket.running == 3


async def test_without_coredis_the_config_error_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "coredis", None)
    with pytest.RaisesGroup(
        pytest.RaisesExc(ConfigError, match=r"pip install 'iop-platform\[cluster\]'"),
        flatten_subgroups=True,
    ):
        async with edge("redis://127.0.0.1:1/0", _prefix(), [_tenant(requests_per_minute=1)], "a"):
            pass


def test_the_admin_page_says_whose_limits_it_shows() -> None:
    from iop.edge.routes._admin_page import render_admin_page

    up = {"edge_id": "edge-<a>", "valkey_up": True, "live_edges": 2, "pending_settlements": 0}
    page = render_admin_page({"cluster": up}).decode()
    assert "shared in Valkey by 2 live edge(s)" in page
    assert "edge-&lt;a&gt;" in page
    down = {**up, "valkey_up": False}
    assert "local share (limit / 2 live edges)" in render_admin_page({"cluster": down}).decode()
    assert "Valkey" not in render_admin_page({"cluster": None}).decode()
