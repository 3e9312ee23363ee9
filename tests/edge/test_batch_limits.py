"""Batch lines and their tenant's limits (``[batches] tenant_limits``):
counted with the tenant's interactive requests (``shared``), or apart from
them under a token limit of their own (``separate``); budgets apply either
way (docs/operations.md, "Batches"). ``TenantAdmission`` on one edge, no
clock but the one given."""

from __future__ import annotations

from decimal import Decimal

import pytest
import trio
import trio.testing

from iop.config import BatchSettings, Price, TenancySettings, TenantSettings
from iop.edge.tenancy._admission import TenantAdmission
from iop.edge.tenancy._limits import RateLimited
from iop.edge.tenancy._tenants import Tenants
from iop.errors import RequestError
from iop.events import Usage
from iop.ledger import Prices
from iop.spec import ChatRequest, Message
from tests.edge.test_tenants import tenant

MODEL = "m"


def request(max_tokens: int = 100) -> ChatRequest:
    return ChatRequest(
        model=MODEL, messages=[Message(role="user", content="hi")], max_tokens=max_tokens
    )


def admission(batches: BatchSettings, settings: TenantSettings) -> TenantAdmission:
    tenancy = TenancySettings()
    prices = Prices({MODEL: Price(input=Decimal(1_000_000), output=Decimal(1_000_000))})
    return TenantAdmission(Tenants([settings], [], tenancy), None, prices, tenancy, batches)


async def test_shared_batch_lines_count_against_the_tenants_own_limits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adm = admission(BatchSettings(), tenant(requests_per_minute=2, max_concurrent_runs=5))
    a = adm.tenants.all["a"]
    await adm.admit(a, request(), batch=True)
    await adm.admit(a, request(), batch=True)
    with pytest.raises(RateLimited) as refused:
        await adm.admit(a, request())  # the interactive request finds the minute used
    assert refused.value.limit == "requests"


async def test_separate_batch_lines_leave_the_tenants_limits_to_its_requests(
    autojump_clock: trio.testing.MockClock,
) -> None:
    batches = BatchSettings(tenant_limits="separate", tokens_per_minute=1_000)
    adm = admission(batches, tenant(requests_per_minute=2, max_concurrent_runs=1))
    a = adm.tenants.all["a"]
    lines = [await adm.admit(a, request(), batch=True) for _ in range(5)]
    assert a.running == 0  # no concurrency slot of the tenant's taken
    interactive = await adm.admit(a, request())  # its requests and its slot are untouched
    assert a.running == 1
    # The batch's own minute: 5 of 1,000 tokens' worth reserved (about 101
    # each), so the next few fit and then the limit refuses, naming itself.
    refused: RateLimited | None = None
    for _ in range(10):
        try:
            lines.append(await adm.admit(a, request(), batch=True))
        except RateLimited as exc:
            refused = exc
            break
    assert refused is not None
    assert 5 < len(lines) < 15
    assert refused.limit == "batch_tokens"
    assert "batch lines" in str(refused)
    # A line that used less than it reserved gives the rest back.
    for ticket in lines:
        adm.settle(ticket, Usage(input_tokens=1, output_tokens=1))
    await adm.admit(a, request(), batch=True)
    adm.settle(interactive, Usage(input_tokens=1, output_tokens=1))
    assert a.running == 0
    assert a.tokens_in == len(lines) + 1  # every settled run still counts as usage


async def test_separate_batch_lines_still_spend_the_tenants_budget(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 1 per token: a budget of 150 takes one request's reservation (about
    # 101), not two.
    batches = BatchSettings(tenant_limits="separate")
    adm = admission(batches, tenant(budget_per_day=Decimal(150)))
    a = adm.tenants.all["a"]
    await adm.admit(a, request(), batch=True)
    with pytest.raises(RateLimited) as refused:
        await adm.admit(a, request(), batch=True)
    assert refused.value.limit.startswith("budget")


async def test_a_line_larger_than_the_batch_minute_is_an_error_not_a_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adm = admission(BatchSettings(tenant_limits="separate", tokens_per_minute=50), tenant())
    with pytest.raises(RequestError) as refused:
        await adm.admit(adm.tenants.all["a"], request(max_tokens=100), batch=True)
    assert refused.value.status == 400  # a 429 would be retried for ever
    assert "tokens_per_minute" in refused.value.message


def test_the_batch_limit_keys_are_checked() -> None:
    with pytest.raises(ValueError, match="tenant_limits"):
        BatchSettings(tenant_limits="apart")
    with pytest.raises(ValueError, match="tokens_per_minute"):
        BatchSettings(tenant_limits="separate", tokens_per_minute=-1)
    with pytest.raises(ValueError, match="tokens_per_minute"):
        BatchSettings(tokens_per_minute=1_000)  # only with separate limits
