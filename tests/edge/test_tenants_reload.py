"""A config reload's tenants (``Tenants.reconfigure``), the admin gate's keys
(``AdminGate.reconfigure``) and the edge core's whole step
(``EdgeCore.apply_config``): what stays live, what changes; and what
``POST /admin/reload`` answers, on a real socket."""

from __future__ import annotations

import hashlib
from decimal import Decimal

import msgspec
import pytest
import trio

from iop._reload import ReloadOutcome
from iop.config import EdgeConfig, TenancySettings, TenantSettings
from iop.edge import open_edge_core
from iop.edge.routes._admin_auth import AdminGate, Verdict
from iop.edge.tenancy._limits import RateLimited
from iop.edge.tenancy._tenants import ANONYMOUS, DEFAULT, Tenants
from iop.events import Usage
from tests.edge.test_app import config, edge

KEY_A = "iop-reload-key-a"
KEY_B = "iop-reload-key-b"
KEY_A2 = "iop-reload-key-a2"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def tenant(name: str, *keys: str, **limits: object) -> TenantSettings:
    return TenantSettings(name=name, key_sha256=[sha(k) for k in keys], **limits)  # type: ignore[arg-type]


def test_a_tenant_that_stays_keeps_its_levels_and_runs_and_takes_its_new_limits() -> None:
    t = Tenants(
        [
            tenant("a", KEY_A, requests_per_minute=60, tokens_per_minute=1000),
            tenant("b", KEY_B),
        ],
        [],
        TenancySettings(),
    )
    a = t.identify(KEY_A)
    assert a is not None
    first = t.admit(a, 100, now=0.0)  # requests 59 left, tokens 900
    t.reconfigure(
        [
            tenant(
                "a",
                KEY_A,
                KEY_A2,
                requests_per_minute=120,
                tokens_per_minute=500,
                max_concurrent_runs=1,
            )
        ],
        [],
        TenancySettings(),
        now=0.0,
    )
    assert t.identify(KEY_A) is a
    assert t.identify(KEY_A2) is a  # a key added
    assert a.running == 1
    assert a.requests is not None
    assert a.tokens is not None
    assert (a.requests.capacity, a.requests.level(0.0)) == (120, 59.0)  # the level stays
    assert a.tokens.level(0.0) == 500.0  # capped at the lowered limit
    assert a.requests.level(1.0) == 61.0  # refilled at the new 120 a minute
    # The new concurrency limit counts the run admitted before the reload.
    with pytest.raises(RateLimited, match="1 of 1 concurrent runs"):
        t.admit(a, 1, now=1.0)
    t.finish(first, Usage(input_tokens=10, output_tokens=10), now=1.0)
    assert a.running == 0
    assert a.tokens.level(1.0) == 500.0  # the refund is capped too
    t.admit(a, 1, now=1.0)


def test_a_removed_tenant_is_refused_while_its_run_is_settled() -> None:
    t = Tenants(
        [tenant("a", KEY_A), tenant("b", KEY_B, tokens_per_minute=100)], [], TenancySettings()
    )
    b = t.identify(KEY_B)
    assert b is not None
    ticket = t.admit(b, 50, now=0.0)
    t.reconfigure([tenant("a", KEY_A)], [], TenancySettings(), now=0.0)
    assert t.identify(KEY_B) is None
    assert "b" not in t.all
    t.finish(ticket, Usage(input_tokens=5, output_tokens=5), now=1.0)
    assert b.running == 0
    # Back in a later reload: a fresh tenant, its bucket full.
    t.reconfigure([tenant("b", KEY_B, tokens_per_minute=100)], [], TenancySettings(), now=2.0)
    again = t.identify(KEY_B)
    assert again is not None
    assert again is not b
    assert again.tokens is not None
    assert again.tokens.level(2.0) == 100.0


def test_a_limit_taken_away_and_given_back_and_the_open_edge() -> None:
    t = Tenants([], [], TenancySettings())
    assert t.open
    anonymous = t.identify("anything")
    assert anonymous is not None
    assert anonymous.name == ANONYMOUS
    t.reconfigure(
        [tenant("a", KEY_A, requests_per_minute=5)],
        ["iop-operator-key"],
        TenancySettings(default_max_tokens=7),
        now=0.0,
    )
    assert not t.open
    assert t.identify("anything") is None
    default = t.identify("iop-operator-key")
    assert default is not None
    assert default.name == DEFAULT
    assert t.tenancy.default_max_tokens == 7
    a = t.identify(KEY_A)
    assert a is not None
    assert a.requests is not None
    t.reconfigure([tenant("a", KEY_A)], ["iop-operator-key"], TenancySettings(), now=0.0)
    assert a.requests is None  # no limit now
    assert t.identify("iop-operator-key") is default  # the default tenant stays


def test_taking_an_admin_key_away_ends_every_session() -> None:
    gate = AdminGate(["iop-admin-key-1", "iop-admin-key-2"], session_s=60, failures_per_minute=3)
    session = gate.issue()
    gate.reconfigure(
        ["iop-admin-key-1", "iop-admin-key-2", "iop-admin-key-3"],
        session_s=60,
        failures_per_minute=3,
    )
    assert gate.session_valid(session)  # a key added: sessions go on
    assert gate.check(None, "Bearer iop-admin-key-3") is Verdict.ALLOWED
    gate.reconfigure(["iop-admin-key-1"], session_s=30, failures_per_minute=5)
    assert not gate.session_valid(session)
    assert gate.check(None, "Bearer iop-admin-key-2") is Verdict.DENIED
    assert gate.check(None, "Bearer iop-admin-key-1") is Verdict.ALLOWED
    assert (gate.session_s, gate.failures_per_minute) == (30, 5)
    assert gate.session_valid(gate.issue())


async def test_the_core_applies_a_reload_in_one_step() -> None:
    config = EdgeConfig(tenants=[tenant("a", KEY_A, requests_per_minute=10)])
    seen: list[EdgeConfig] = []
    async with open_edge_core(config) as core:
        core.reload_hooks.append(seen.append)
        a = core.tenants.identify(KEY_A)
        assert a is not None
        new = msgspec.structs.replace(
            config,
            tenants=[tenant("a", KEY_A, requests_per_minute=20), tenant("b", KEY_B)],
            scheduler=msgspec.structs.replace(config.scheduler, load_weight=3.0),
            server=msgspec.structs.replace(config.server, api_keys=["iop-new-operator-key"]),
        )
        core.apply_config(new)
        assert core.config is new
        assert core.scheduler.settings.load_weight == 3.0
        assert core.tenants.identify(KEY_A) is a
        assert core.tenants.identify(KEY_B) is not None
        assert seen == [new]
        # The new key is a secret now: masked wherever the edge relays text.
        assert core.masker.mask("key iop-new-operator-key") == "key ***"
        assert core.metrics.masker is core.masker
        await trio.lowlevel.checkpoint()


class _Reloads:
    """A stand-in for the CLI's reloader: answers what it is told to."""

    def __init__(self, outcome: ReloadOutcome) -> None:
        self.outcome = outcome
        self.via: list[str] = []

    async def reload(self, via: str) -> ReloadOutcome:
        self.via.append(via)
        return self.outcome


async def test_post_admin_reload_answers_the_plan_or_why_not() -> None:
    async with edge(config(admin_keys=["iop-reload-admin"]), with_node=False) as (h, _, c):
        admin = {"Authorization": "Bearer iop-reload-admin"}
        assert (await c.post("/admin/reload")).status_code == 401
        # No config file to re-read.
        resp = await c.post("/admin/reload", headers=admin)
        assert resp.status_code == 409
        assert resp.json()["error"]["code"] == "reload_unavailable"
        plan = ReloadOutcome(status="applied", source="edge.toml", applied=["tenants"])
        h.core.reloader = reloads = _Reloads(plan)
        resp = await c.post("/admin/reload", headers=admin)
        assert resp.status_code == 200
        assert resp.json() == msgspec.to_builtins(plan)
        assert reloads.via == ["POST /admin/reload by admin key from 127.0.0.1"]
        reloads.outcome = ReloadOutcome.refused("edge.toml", "edge.toml: unknown key 'x'")
        resp = await c.post("/admin/reload", headers=admin)
        assert resp.status_code == 422
        assert resp.json()["error"] == "edge.toml: unknown key 'x'"
        # A page of another site cannot make the edge reload.
        resp = await c.post("/admin/reload", headers={**admin, "Origin": "https://evil.example"})
        assert resp.status_code == 403
        assert len(reloads.via) == 2


def test_a_reload_keeps_a_budgets_spend_and_reservations_and_takes_its_new_limit() -> None:
    t = Tenants([tenant("a", KEY_A, budget_per_day=Decimal("1"))], [], TenancySettings())
    a = t.identify(KEY_A)
    assert a is not None
    wall = 1_780_000_000.0
    running = t.admit(a, 0, now=0.0)
    t.take_budget(running, 600_000, wall)  # 0.60 of 1.00 reserved
    t.reconfigure(
        [tenant("a", KEY_A, budget_per_day=Decimal("0.5"), budget_per_month=Decimal("10"))],
        [],
        TenancySettings(),
        now=0.0,
    )
    assert t.identify(KEY_A) is a
    day, month = a.budgets["day"], a.budgets["month"]
    assert (day.limit, day.spent) == (500_000, 600_000)  # over the lowered limit
    assert (month.limit, month.spent) == (10_000_000, 0)  # new: admitted runs not in it
    with pytest.raises(RateLimited):
        t.check_budget(a, 1, wall, 0.0)
    # The run admitted before settles against the budget it reserved from.
    t.settle_budget(running, 100_000, wall)
    assert day.spent == 100_000
    assert month.spent == 0
    t.check_budget(a, 1, wall, 0.0)
    # A budget taken out of the config is gone.
    t.reconfigure([tenant("a", KEY_A)], [], TenancySettings(), now=0.0)
    assert a.budgets == {}
