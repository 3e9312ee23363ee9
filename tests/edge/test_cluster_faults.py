"""Valkey answering wrong, or late: the edge fails open and comes back.

A real ``valkey-server`` behind ``tests/_resp_proxy.py``, which forwards
faithfully until told to answer a script itself with bytes Valkey (or
whatever listens on its port) could send: a reply of another shape, an
error, a nil, a huge integer, garbage that is not RESP, a reply that never
ends. Whatever it sends, ``SharedLimits`` never raises anything but
``RateLimited`` and never stops: it turns to its local share (the gauge and
the counter say so, one log line explains), and counts in Valkey again once
the proxy answers well. And a Valkey paused under an admission (SIGSTOP)
is counted in again one probe after it resumes, not one heartbeat.

Waits poll a state with a deadline; no duration is asserted.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import signal
import socket
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Final

import coredis
import pytest
import trio
from prometheus_client import CollectorRegistry

from iop.config import ClusterSettings, TenancySettings, TenantSettings
from iop.edge.tenancy._cluster import SharedLimits
from iop.edge.tenancy._cluster_scripts import HEARTBEAT, LEAVE, RESERVE, RESYNC, SETTLE
from iop.edge.tenancy._tenants import RateLimited, Tenants, Ticket, Via
from iop.events import Usage
from tests._resp_proxy import FAULTS, RespProxy, scripts_rule
from tests._valkey import Valkey

LOGGER: Final = "iop.edge.cluster"


def _tenant(**limits: int) -> TenantSettings:
    return TenantSettings(name="acme", key_sha256=[hashlib.sha256(b"k").hexdigest()], **limits)


@pytest.fixture
def proxy(valkey_server: Valkey) -> Iterator[RespProxy]:
    p = RespProxy(valkey_server.port)
    p.start()
    try:
        yield p
    finally:
        p.stop()


@asynccontextmanager
async def shared(
    url: str, tenants: Sequence[TenantSettings], **settings: float
) -> AsyncIterator[SharedLimits]:
    """One edge's shared limits, its background task running (up or not)."""
    cluster = ClusterSettings(
        valkey_url=url,
        key_prefix=f"t{secrets.token_hex(4)}:",
        **settings,  # type: ignore[arg-type]
    )
    local = Tenants(tenants, [], TenancySettings())
    limits = SharedLimits(cluster, local, tenants, TenancySettings(), "a", CollectorRegistry())
    async with trio.open_nursery() as n:
        await n.start(limits.run)
        yield limits
        n.cancel_scope.cancel()


async def _until(limits: SharedLimits, *, up: bool, deadline: float = 15.0) -> None:
    with trio.fail_after(deadline):
        await limits.wait_until(up=up)


async def _settled(limits: SharedLimits) -> None:
    """Until every settlement is written (polled: no event says so)."""
    with trio.fail_after(15):
        while limits.pending:
            await trio.sleep(0.01)


async def _admit(limits: SharedLimits, tokens: int = 0) -> Ticket:
    return await limits.admit(limits.tenants.all["acme"], tokens, trio.current_time())


async def _admit_all(limits: SharedLimits, n: int) -> tuple[int, int]:
    counts = [0, 0]
    for _ in range(n):
        try:
            await _admit(limits)
        except RateLimited:
            counts[1] += 1
        else:
            counts[0] += 1
    return counts[0], counts[1]


def _fault_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.levelno == logging.WARNING and "fail open" in r.getMessage()
    ]


@pytest.mark.parametrize("fault", FAULTS.values(), ids=FAULTS.keys())
async def test_a_heartbeat_answered_wrong_fails_open_then_back(
    proxy: RespProxy, fault: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    # A heartbeat every 0.2 s, a probe every 0.05 s while down.
    async with shared(
        proxy.url,
        [_tenant(requests_per_minute=4)],
        membership_ttl_s=0.6,
        retry_interval_s=0.05,
        command_timeout_s=0.5,
    ) as a:
        await _until(a, up=True)
        proxy.answer(scripts_rule([HEARTBEAT], fault))
        await _until(a, up=False)
        assert a.gauge_up._value.get() == 0
        # The local share, exactly: 4 / 1 live edge.
        assert await _admit_all(a, 5) == (4, 1)
        assert a.fail_open._value.get() == 5
        (line,) = _fault_lines(caplog)
        assert "heartbeat" in line
        assert a.live_edges == 1

        proxy.answer(None)
        await _until(a, up=True)
        assert a.gauge_up._value.get() == 1
        assert (await _admit(a)).via is Via.SHARED
        assert a.fail_open._value.get() == 5


@pytest.mark.parametrize("fault", FAULTS.values(), ids=FAULTS.keys())
async def test_an_admission_answered_wrong_fails_open_then_back(
    proxy: RespProxy, fault: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with shared(
        proxy.url,
        [_tenant(requests_per_minute=3, tokens_per_minute=1000, max_concurrent_runs=5)],
        retry_interval_s=0.05,
        command_timeout_s=0.5,
    ) as a:
        assert a.up
        proxy.answer(scripts_rule([RESERVE], fault))
        ticket = await _admit(a, 10)
        assert ticket.via is Via.FAIL_OPEN
        assert not a.up
        assert a.gauge_up._value.get() == 0
        assert a.fail_open._value.get() == 1
        (line,) = _fault_lines(caplog)
        assert "reserve" in line
        # Up and down again as each probe succeeds and each reservation
        # fails: still the one share, never more than its limit.
        assert await _admit_all(a, 3) == (2, 1)
        a.finish(ticket, Usage(input_tokens=1, output_tokens=1), trio.current_time())

        proxy.answer(None)
        await _until(a, up=True)
        assert (await _admit(a)).via is Via.SHARED
        assert a.fail_open._value.get() == 4


SETTLE_FAULTS: Final = ["array-for-integer", "nil", "error", "garbage", "never-ends"]


@pytest.mark.parametrize("fault", SETTLE_FAULTS)
async def test_a_settlement_answered_wrong_is_written_once_valkey_answers_well(
    proxy: RespProxy, fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with shared(
        proxy.url,
        [_tenant(tokens_per_minute=1000)],
        retry_interval_s=0.05,
        command_timeout_s=0.5,
    ) as a:
        ticket = await _admit(a, 600)
        assert ticket.via is Via.SHARED
        proxy.answer(scripts_rule([SETTLE], FAULTS[fault]))
        a.finish(ticket, Usage(input_tokens=50, output_tokens=50), trio.current_time())
        await _until(a, up=False)
        assert a.pending == 1
        (line,) = _fault_lines(caplog)
        assert "settle" in line
        proxy.answer(None)
        await _until(a, up=True)
        await _settled(a)
        # 500 tokens came back in Valkey.
        assert (await _admit(a, 600)).via is Via.SHARED


@pytest.mark.parametrize("fault", ["array-for-integer", "garbage", "never-ends"])
async def test_a_resync_answered_wrong_is_retried(
    proxy: RespProxy, fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with shared(
        proxy.url, [_tenant(max_concurrent_runs=2)], retry_interval_s=0.05, command_timeout_s=0.5
    ) as a:
        await _admit(a)
        proxy.answer(scripts_rule([RESYNC], FAULTS[fault]))
        a._resync = True
        a._wake.set()
        await _until(a, up=False)
        assert a._resync
        proxy.answer(None)
        await _until(a, up=True)
        with trio.fail_after(15):
            while a._resync:
                await trio.sleep(0.01)


@pytest.mark.parametrize("fault", ["array-for-integer", "huge-integer", "garbage", "never-ends"])
async def test_an_edge_starting_on_wrong_answers_starts_on_its_share(
    proxy: RespProxy, fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The first leave and heartbeat, before the edge serves: no crash at start."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    proxy.answer(scripts_rule([LEAVE, HEARTBEAT], FAULTS[fault]))
    async with shared(
        proxy.url, [_tenant(requests_per_minute=2)], retry_interval_s=0.05, command_timeout_s=0.5
    ) as a:
        assert not a.up
        assert await _admit_all(a, 3) == (2, 1)
        proxy.answer(None)
        await _until(a, up=True)
        assert (await _admit(a)).via is Via.SHARED


async def test_back_in_valkey_one_probe_after_a_pause(tmp_path: Path) -> None:
    """Valkey paused under an admission, then resumed: the edge counts in
    Valkey again at its next probe (every retry_interval_s), not at its
    next heartbeat (every membership_ttl_s / 3: here 200 s, past the
    deadline)."""
    v = Valkey(tmp_path)
    v.start()
    assert v.proc is not None
    try:
        async with shared(
            v.url,
            [_tenant(requests_per_minute=100)],
            membership_ttl_s=600.0,
            retry_interval_s=0.05,
            command_timeout_s=0.5,
        ) as a:
            assert (await _admit(a)).via is Via.SHARED
            os.kill(v.proc.pid, signal.SIGSTOP)
            try:
                assert (await _admit(a)).via is Via.FAIL_OPEN
                assert not a.up
            finally:
                os.kill(v.proc.pid, signal.SIGCONT)
            await _until(a, up=True, deadline=30.0)
            assert (await _admit(a)).via is Via.SHARED
    finally:
        v.kill()


async def test_an_edge_that_stops_leaves_on_a_client_of_its_own(valkey_server: Valkey) -> None:
    """The last round trip (``leave``) runs on a fresh client in a shielded
    scope: the loop's own client is cancelled with the edge."""
    async with shared(valkey_server.url, [_tenant(max_concurrent_runs=2)]) as a:
        await _until(a, up=True)
        await _admit(a)
        prefix = a.settings.key_prefix
    client = coredis.Redis.from_url(valkey_server.url)
    async with client:
        assert await client.exists([f"{prefix}m:a"]) == 0
        assert await client.zcard(f"{prefix}members") == 0
        assert await client.hget(f"{prefix}c:acme", "a") is None


async def test_cancelled_while_connecting_is_no_fault(caplog: pytest.LogCaptureFixture) -> None:
    """coredis turns a cancellation that lands while it sets a connection up
    into its ConnectionError: the edge stopping then is not a Valkey fault
    (no "Valkey failed" line), and the cancellation goes through."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    # Accepts connections (the kernel's backlog) and never answers.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        with trio.move_on_after(0.3) as scope:
            async with shared(
                url, [_tenant(requests_per_minute=1)], command_timeout_s=5, connect_timeout_s=5
            ):
                pass
    assert scope.cancelled_caught
    assert not [r for r in caplog.records if "Valkey failed" in r.getMessage()]
