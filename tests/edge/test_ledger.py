"""The usage ledger (iop.ledger, iop.edge.tenancy._ledger) and budgets (iop.edge.tenancy._tenants):
the store and the rules without a clock, the writer on a real SQLite file."""

from __future__ import annotations

import hashlib
import math
import re
import secrets
import sqlite3
import time
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import coredis
import pytest
import trio
import trio.lowlevel
from prometheus_client import CollectorRegistry

from iop.config import EdgeConfig, Price, TenancySettings, TenantSettings, UsageSettings
from iop.config import decode_config as decode
from iop.edge.routes._admin_page import render_admin_page
from iop.edge.tenancy._cluster_replies import BadReply, decode_budget
from iop.edge.tenancy._ledger import Ledger
from iop.edge.tenancy._limits import RateLimited
from iop.edge.tenancy._tenants import Tenants, Ticket
from iop.errors import ConfigError
from iop.events import Usage
from iop.ledger import (
    LedgerStore,
    Prices,
    UsageRecord,
    cost_micros,
    money,
    period_end,
    period_key,
    period_start,
    report_json,
    rows_csv,
    rows_table,
)
from tests._valkey import Valkey
from tests.edge.test_cluster import edge as cluster_edge


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def record(n: int, when: float, **kw: object) -> UsageRecord:
    fields: dict[str, object] = {
        "run_id": f"r{n}",
        "at": when,
        "tenant": "a",
        "model": "m",
        "operation": "chat",
        "outcome": "complete",
        "input_tokens": 10,
        "output_tokens": 5,
        "cost_micros": 7,
    }
    fields.update(kw)
    return UsageRecord(**fields)  # type: ignore[arg-type]


# --- money and periods --------------------------------------------------------------------


def test_cost_is_integer_micro_units_rounded_up() -> None:
    price = Price(input=Decimal("2.5"), output=Decimal("10"), cached_input=Decimal("1.25")).micros
    assert price == (2_500_000, 1_250_000, 10_000_000)
    # 1,000 input of which 400 cached, 100 output: 600*2.5 + 400*1.25 + 100*10 = 3,000 micros.
    assert (
        cost_micros(Usage(input_tokens=1000, cached_input_tokens=400, output_tokens=100), price)
        == 3000
    )
    # One token at 0.15 per million is 0.15 micro-units: rounded up to 1.
    assert cost_micros(Usage(output_tokens=1), Price(output=Decimal("0.15")).micros) == 1
    assert cost_micros(Usage(input_tokens=10**9), None) == 0
    assert money(1_250_000) == "1.250000"
    assert money(7) == "0.000007"


def test_prices_fall_back_to_star_then_nothing() -> None:
    prices = Prices({"a": Price(input=Decimal(1)), "*": Price(input=Decimal(2))})
    assert prices.cost("a", Usage(input_tokens=1_000_000)) == 1_000_000
    assert prices.cost("other", Usage(input_tokens=1_000_000)) == 2_000_000
    assert Prices({}).cost("a", Usage(input_tokens=5)) == 0


def test_periods_are_utc_days_and_calendar_months() -> None:
    t = at("2026-12-31T23:59:59")
    assert period_key("day", t) == "2026-12-31"
    assert period_key("month", t) == "2026-12"
    assert period_start("day", t) == at("2026-12-31T00:00:00")
    assert period_end("day", t) == at("2027-01-01T00:00:00")
    assert period_start("month", t) == at("2026-12-01T00:00:00")
    assert period_end("month", t) == at("2027-01-01T00:00:00")
    assert period_end("month", at("2026-02-10T12:00:00")) == at("2026-03-01T00:00:00")


@pytest.mark.parametrize(
    ("tenant", "error"),
    [
        ({"budget_per_day": "0.0000001"}, "at most 6 decimals"),
        ({"budget_per_day": -1}, "between 0 and"),
        ({"keys": [{"sha256": "a" * 64, "name": "has space"}]}, "key name"),
        ({"key_sha256": []}, "no key_sha256"),
        ({"budget_per_month": 1, "bogus": 1}, r"unknown key 'tenants\[0\]\.bogus'"),
    ],
)
def test_bad_budgets_prices_and_keys_are_refused(tenant: dict[str, object], error: str) -> None:
    data = {"tenants": [{"name": "a", "key_sha256": [sha("k")], **tenant}]}
    with pytest.raises(ConfigError, match=error):
        decode(data, EdgeConfig, source="edge.toml")


@pytest.mark.parametrize(
    ("usage", "error"),
    [
        ({"flush_interval_s": 0}, "flush_interval_s must be between"),
        ({"flush_interval_s": 61}, "flush_interval_s must be between"),
        ({"buffer": 99}, "buffer must be between"),
        ({"buffer": 1_000_001}, "buffer must be between"),
    ],
)
def test_usage_settings_are_bounded(usage: dict[str, object], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        decode({"usage": usage}, EdgeConfig, source="edge.toml")
    with pytest.raises(ConfigError, match="at most 6 decimals"):
        decode({"prices": {"m": {"input": "0.0000001"}}}, EdgeConfig, source="edge.toml")


# --- the store --------------------------------------------------------------------------


def test_store_reports_by_day_tenant_model_and_sums_spend(tmp_path: Path) -> None:
    store = LedgerStore(tmp_path / "usage.db")
    day1, day2 = at("2026-12-03T10:00:00"), at("2026-12-04T10:00:00")
    store.append(
        [
            record(1, day1),
            record(2, day1, tenant="b", key_name="ci"),
            record(3, day2, model="n", cached_tokens=3),
            record(4, day2, outcome="cancelled", reason="client_disconnected"),
        ]
    )
    rows = store.report(("day", "tenant", "model"))
    assert [(r.day, r.tenant, r.model, r.runs) for r in rows] == [
        ("2026-12-03", "a", "m", 1),
        ("2026-12-03", "b", "m", 1),
        ("2026-12-04", "a", "m", 1),
        ("2026-12-04", "a", "n", 1),
    ]
    (total,) = store.report(())
    assert (total.runs, total.input_tokens, total.output_tokens, total.cached_tokens) == (
        4,
        40,
        20,
        3,
    )
    assert total.cost_micros == 28
    assert [r.key_name for r in store.report(("key_name",))] == ["", "ci"]
    assert store.spent(day2) == {"a": 14}
    assert [r.run_id for r in store.since(day2)] == ["r3", "r4"]
    assert store.report(("tenant",), tenant="b", since=day1, until=day2)[0].runs == 1
    body = report_json(rows, ("day", "tenant", "model"))
    assert body["total"] == {
        "runs": 4,
        "input_tokens": 40,
        "output_tokens": 20,
        "cached_tokens": 3,
        "cost_micros": 28,
        "cost": "0.000028",
    }
    assert rows_csv(rows, ("day", "tenant", "model")).splitlines()[1] == (
        "2026-12-03,a,m,1,10,5,0,0.000007"
    )
    assert rows_table(rows, ("day",)).splitlines()[-1].split() == [
        "total", "4", "40", "20", "3", "0.000028"
    ]  # fmt: skip
    store.close()
    # Read-only beside a writer, as `iop usage` opens it; a missing file is an error.
    reader = LedgerStore(tmp_path / "usage.db", readonly=True)
    assert reader.report(())[0].runs == 4
    reader.close()
    with pytest.raises(sqlite3.OperationalError):
        LedgerStore(tmp_path / "none.db", readonly=True)


# --- the writer --------------------------------------------------------------------------


def _ledger(path: Path, *, buffer: int = 100, flush: float = 0.05) -> Ledger:
    settings = UsageSettings(ledger_path=str(path), buffer=buffer, flush_interval_s=flush)
    return Ledger(settings, CollectorRegistry())


async def test_a_graceful_stop_writes_everything_queued(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path / "u.db", buffer=1000, flush=60.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(ledger.run)
        for n in range(500):
            ledger.add(record(n, 1e9))
        # The flush interval (60 s) has not passed: closing writes them all.
        ledger.close()
    store = LedgerStore(tmp_path / "u.db")
    assert store.report(())[0].runs == 500
    assert ledger.written._value.get() == 500


async def test_records_are_committed_each_flush_interval(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path / "u.db", flush=0.05)
    async with trio.open_nursery() as nursery:
        await nursery.start(ledger.run)
        ledger.add(record(1, 1e9))
        with trio.fail_after(10):
            while ledger.written._value.get() < 1:
                await trio.sleep(0.01)
        # Committed while the writer goes on: another connection sees it.
        assert LedgerStore(tmp_path / "u.db", readonly=True).report(())[0].runs == 1
        rows = await ledger.report(("tenant",))
        assert [(r.tenant, r.runs) for r in rows] == [("a", 1)]
        nursery.cancel_scope.cancel()


async def test_a_full_buffer_drops_and_counts(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path / "u.db", buffer=100)
    # The writer is not running (a stalled disk): the 101st record is dropped.
    for n in range(101):
        ledger.add(record(n, 1e9))
    assert ledger.dropped._value.get() == 1
    async with trio.open_nursery() as nursery:
        await nursery.start(ledger.run)
        ledger.close()
    assert LedgerStore(tmp_path / "u.db").report(())[0].runs == 100
    # After the stop, nothing more is taken (and nothing waits).
    ledger.add(record(200, 1e9))
    assert ledger.dropped._value.get() == 2


async def test_a_cancelled_writer_still_writes_what_is_queued(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path / "u.db", flush=60.0)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(ledger.run)
            for n in range(3):
                ledger.add(record(n, 1e9))
            await trio.lowlevel.checkpoint()
            scope.cancel()
    assert LedgerStore(tmp_path / "u.db").report(())[0].runs == 3


# --- budgets ----------------------------------------------------------------------------


def _tenants(**limits: object) -> Tenants:
    t = decode(
        {
            "name": "a",
            "key_sha256": [sha("ka")],
            "keys": [{"sha256": sha("kb"), "name": "ci"}],
            **limits,
        },
        TenantSettings,
        source="t",
    )
    return Tenants([t], [], TenancySettings())


def test_key_names_come_from_keys_or_the_digest() -> None:
    tenants = _tenants()
    assert tenants.key_name("kb") == "ci"
    assert tenants.key_name("ka") == f"sha256:{sha('ka')[:12]}"
    assert tenants.identify("kb") is tenants.all["a"]
    assert tenants.key_name("nope") == ""


def test_a_budget_reserves_settles_and_refuses_until_the_day_ends() -> None:
    tenants = _tenants(budget_per_day="0.001")  # 1,000 micro-units a day
    tenant = tenants.all["a"]
    wall = at("2026-12-04T23:00:00")
    tenants.check_budget(tenant, 600, wall, 0.0)
    first = tenants.admit(tenant, 10, 0.0)
    tenants.take_budget(first, 600, wall)
    # 600 reserved: another 600 does not fit, 400 does.
    with pytest.raises(RateLimited) as refused:
        tenants.check_budget(tenant, 600, wall, 0.0)
    assert refused.value.limit == "budget_day"
    assert refused.value.retry_after_s == 3600.0
    assert refused.value.status == 429
    assert "0.000600 of 0.001000 per day" in refused.value.message
    tenants.check_budget(tenant, 400, wall, 0.0)
    # Settled at its real cost, 100: 900 left.
    tenants.finish(first, Usage(), 1.0)
    tenants.settle_budget(first, 100, wall)
    assert tenant.budgets["day"].spent == 100
    tenants.check_budget(tenant, 900, wall, 1.0)
    second = tenants.admit(tenant, 10, 1.0)
    tenants.take_budget(second, 900, wall)
    tenants.settle_budget(second, 1000, wall)  # it cost more than it reserved
    with pytest.raises(RateLimited, match="spent or reserved"):
        tenants.check_budget(tenant, 0, wall, 1.0)  # spent: even a free request waits
    # The next UTC day starts afresh.
    tenants.check_budget(tenant, 1000, at("2026-12-05T00:00:00"), 2.0)
    with pytest.raises(RateLimited) as too_large:
        tenants.check_budget(tenant, 1001, wall, 2.0)
    assert math.isinf(too_large.value.retry_after_s)


def test_a_reservation_of_yesterday_is_charged_to_today_without_a_refund() -> None:
    tenants = _tenants(budget_per_day="1", budget_per_month="1")
    tenant = tenants.all["a"]
    ticket = tenants.admit(tenant, 1, 0.0)
    tenants.take_budget(ticket, 500, at("2026-12-04T23:59:59"))
    tenants.settle_budget(ticket, 200, at("2026-12-05T00:00:01"))
    assert tenant.budgets["day"].spent == 200  # today's: the cost, no refund of yesterday's
    assert tenant.budgets["month"].spent == 200  # same month: 500 reserved, settled to 200


def test_a_restart_restores_budgets_and_rate_windows() -> None:
    tenants = _tenants(budget_per_day="1", tokens_per_minute=100, requests_per_minute=10)
    tenant = tenants.all["a"]
    wall = at("2026-12-04T12:00:00")
    # Ten runs of 8 tokens, 30 to 21 s before the restart.
    recent = [record(n, wall - 30 + n, input_tokens=4, output_tokens=4) for n in range(10)]
    tenants.restore({"day": {"a": 999_000}, "month": {"a": 5}}, recent, wall, 1000.0)
    assert tenant.budgets["day"].spent == 999_000
    with pytest.raises(RateLimited):
        tenants.check_budget(tenant, 1001, wall, 1000.0)
    # 80 tokens and 10 requests in the last minute, refilled by half a minute
    # since: neither window is whole again.
    assert tenant.tokens is not None
    assert tenant.tokens.level(1000.0) < 100
    assert tenant.requests is not None
    assert tenant.requests.level(1000.0) < 10
    with pytest.raises(RateLimited, match="tokens per minute"):
        tenants.admit(tenant, 90, 1000.0)


# --- budgets shared in Valkey ----------------------------------------------------------------


async def test_two_edges_share_a_budget_in_valkey(valkey_server: Valkey) -> None:
    prefix = f"t{secrets.token_hex(4)}:"
    settings = [TenantSettings(name="acme", key_sha256=[sha("k")], budget_per_day=Decimal("0.001"))]
    wall = time.time()
    async with (
        cluster_edge(valkey_server.url, prefix, settings, "a") as a,
        cluster_edge(valkey_server.url, prefix, settings, "b") as b,
    ):
        on_a = Ticket(a.tenants.all["acme"], 0, ())
        await a.reserve_budget(on_a, 600, wall, 0.0)
        assert on_a.budget_shared
        # Edge b sees a's reservation: 600 more do not fit in 1,000.
        with pytest.raises(RateLimited) as refused:
            await b.reserve_budget(Ticket(b.tenants.all["acme"], 0, ()), 600, wall, 0.0)
        assert refused.value.limit == "budget_day"
        assert "0.000600 of 0.001000" in refused.value.message
        # a's run cost 100: settled in Valkey, b may now reserve 900.
        a.settle_budget(on_a, 100, wall)
        with trio.fail_after(5):
            while a.pending:
                await trio.sleep(0.01)
        on_b = Ticket(b.tenants.all["acme"], 0, ())
        await b.reserve_budget(on_b, 900, wall, 0.0)
        with pytest.raises(RateLimited, match="spent or reserved"):
            await a.reserve_budget(Ticket(a.tenants.all["acme"], 0, ()), 0, wall, 0.0)
        client = coredis.Redis.from_url(valkey_server.url)
        async with client:
            key = f"{prefix}u:acme:{period_key('day', wall)}"
            assert await client.get(key) == b"1000"
            # It expires a day after the UTC day ends.
            ttl = await client.ttl(key)
            assert period_end("day", wall) - wall < ttl <= period_end("day", wall) - wall + 86401


# --- the admin page ---------------------------------------------------------------------------


def test_the_admin_page_plots_tokens_and_cost_a_day() -> None:
    days = [
        {"day": "2026-12-03", "runs": 2, "input_tokens": 30, "output_tokens": 10,
         "cost_micros": 1_500_000, "cost": "1.500000"},
        {"day": "2026-12-04", "runs": 1, "input_tokens": 10, "output_tokens": 10,
         "cost_micros": 3_000_000, "cost": "3.000000"},
    ]  # fmt: skip
    page = render_admin_page({}, usage=days).decode()
    assert "<h2>Usage (last 30 days, UTC)</h2>" in page
    assert page.count("<svg class='usage'") == 2
    # Each day a bar, its value in its tooltip; the highest is full height.
    assert "<title>2026-12-03: 40</title>" in page
    assert "<title>2026-12-04: 20</title>" in page
    assert "<title>2026-12-04: 3.000000</title>" in page
    assert "highest: 3.000000" in page
    heights = re.findall(r"<rect class='tokens'[^>]* height='([0-9.]+)'", page)
    assert [float(h) for h in heights] == [76.0, 38.0]
    assert "<script" not in page
    # No ledger: no section.
    assert "Usage (last" not in render_admin_page({}).decode()


@pytest.mark.parametrize(
    "reply",
    [
        None,
        [1],
        [1, b"5", b"6"],
        [2, b"5"],
        [True, b"5"],
        [1, 5],
        [1, b"five"],
        [1, b"1" * 65],
        [1, b"10000000000000000000"],
    ],
)
def test_a_budget_reply_of_the_wrong_shape_is_a_fault(reply: object) -> None:
    with pytest.raises(BadReply):
        decode_budget(reply, periods=1)


def test_a_budget_reply_decodes() -> None:
    assert decode_budget([1, b"5", b"-3"], periods=2) == (True, [5, -3])
    assert decode_budget([0, b"1000"], periods=1) == (False, [1000])
