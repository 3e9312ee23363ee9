"""Admission by tenant: a request reserves its estimated tokens and cost, and
its run's ticket is settled to what it used when the run ends.

``TenantAdmission.admit`` reserves a request's estimated tokens
(``estimate_tokens``) from its tenant's rate limits, by this edge's buckets
(``Tenants``) or by every edge's in Valkey (``SharedLimits``, with
``[cluster]``), and their cost (``[prices]``) from the tenant's budgets;
``hold`` keeps the run's ``Ticket`` until the run ends, and ``finish``
settles it where it was reserved to what the run was charged
(docs/operations.md, "Tenants and limits"). ``usage_record`` is the usage
ledger's line of a finished run (``iop.ledger``).
"""

from __future__ import annotations

import math
import time

import trio

from iop.config import BatchSettings, TenancySettings
from iop.edge.tenancy._charges import estimate_prompt_tokens, estimate_tokens
from iop.edge.tenancy._cluster import SharedLimits
from iop.edge.tenancy._limits import Bucket, RateLimited
from iop.edge.tenancy._tenants import Tenant, Tenants, Ticket
from iop.errors import ErrorCode, RequestError
from iop.events import Cancelled, Complete, Error, Usage
from iop.ledger import Prices, UsageRecord
from iop.runtime import Run
from iop.spec import OperationRequest

__all__ = ["TenantAdmission", "usage_record"]


class TenantAdmission:
    """Tenants' admission and settlement (module docstring).

    ``prices`` and ``settings`` are the current config's (``reconfigure``).
    """

    def __init__(
        self,
        tenants: Tenants,
        cluster: SharedLimits | None,
        prices: Prices,
        settings: TenancySettings,
        batches: BatchSettings | None = None,
    ) -> None:
        self.tenants = tenants
        self.cluster = cluster
        self.prices = prices
        self.settings = settings
        self.batches = batches or BatchSettings()
        # Each tenant's batch lines' own tokens a minute (``[batches]
        # tenant_limits = "separate"``), on this edge (the edge that holds a
        # batch runs all of its lines).
        self._batch_tokens: dict[str, Bucket] = {}
        # The admitted runs' tickets, settled when each run ends (``finish``).
        self._tickets: dict[str, Ticket] = {}

    def reconfigure(self, prices: Prices, settings: TenancySettings) -> None:
        self.prices = prices
        self.settings = settings

    async def admit(
        self, tenant: Tenant, request: OperationRequest, key_name: str = "", *, batch: bool = False
    ) -> Ticket:
        """Admit ``request`` of ``tenant``: it reserves its estimated tokens
        (``estimate_tokens``) from the rate limits, by this edge's buckets or
        by every edge's in Valkey (``[cluster]``), and their cost from the
        tenant's budgets. A ``batch`` line under ``[batches] tenant_limits =
        "separate"`` reserves its tokens from its tenant's batch bucket
        instead (``_admit_apart``), and its cost from the same budgets.

        Raises:
            RateLimited: Over one of the tenant's limits or budgets.
            RequestError: 400, a batch line larger than its batch limit's minute.
        """
        tokens = estimate_tokens(request, self.settings.default_max_tokens)
        apart = batch and self.batches.tenant_limits == "separate"
        if not tenant.budgets:
            ticket = (
                self._admit_apart(tenant, tokens)
                if apart
                else await self._admit_rate(tenant, tokens)
            )
            ticket.key_name = key_name
            return ticket
        prompt = estimate_prompt_tokens(request)
        estimate = Usage(input_tokens=prompt, output_tokens=tokens - prompt)
        cost = self.prices.cost(request.model, estimate)
        wall = time.time()
        if self.cluster is None:
            # Checked, then taken after the rate limits: no await between.
            self.tenants.check_budget(tenant, cost, wall, trio.current_time())
            if apart:
                ticket = self._admit_apart(tenant, tokens)
            else:
                ticket = self.tenants.admit(tenant, tokens, trio.current_time())
            self.tenants.take_budget(ticket, cost, wall)
        else:
            # Every edge's spend, in Valkey: reserved first (a refusal takes
            # nothing), given back if the rate limits refuse.
            hold = Ticket(tenant, 0, ())
            await self.cluster.reserve_budget(hold, cost, wall, trio.current_time())
            try:
                if apart:
                    ticket = self._admit_apart(tenant, tokens)
                else:
                    ticket = await self.cluster.admit(tenant, tokens, trio.current_time())
            except BaseException:
                self.cluster.settle_budget(hold, 0, time.time())
                raise
            ticket.reserved_micros = hold.reserved_micros
            ticket.periods = hold.periods
            ticket.budget_shared = hold.budget_shared
        ticket.key_name = key_name
        return ticket

    def _admit_apart(self, tenant: Tenant, tokens: int) -> Ticket:
        """A batch line kept apart from its tenant's rate limits and
        concurrency: only the tenant's batch bucket (``[batches]
        tokens_per_minute``, if set) is asked for its ``tokens``.

        Raises:
            RateLimited: The batch lines' minute is used up (``batch_tokens``).
            RequestError: 400, the line reserves more than a whole minute.
        """
        limit = self.batches.tokens_per_minute
        bucket = None
        if limit:
            now = trio.current_time()
            bucket = self._batch_tokens.get(tenant.name)
            if bucket is None or bucket.capacity != limit:
                bucket = self._batch_tokens[tenant.name] = Bucket(limit)
            wait = bucket.wait_for(tokens, now)
            if math.isinf(wait):
                raise RequestError(
                    f"This batch line reserves {tokens} tokens (the prompt's estimate plus "
                    f"max_tokens), more than the {limit} a minute [batches] tokens_per_minute "
                    "gives a tenant's batch lines: lower max_tokens or shorten the prompt.",
                    status=400,
                    code=ErrorCode.RATE_LIMIT_EXCEEDED,
                )
            if wait > 0:
                tenant.refused += 1
                raise RateLimited(
                    f"Rate limit reached for tenant {tenant.name}'s batch lines on tokens per "
                    f"minute: limit {limit}, requested {tokens}.",
                    limit="batch_tokens",
                    retry_after_s=wait,
                    limits=(),
                )
            bucket.take(tokens, now)
        tenant.admitted += 1
        return Ticket(tenant, tokens, (), rated=False, batch_tokens=bucket)

    async def _admit_rate(self, tenant: Tenant, tokens: int) -> Ticket:
        if self.cluster is None:
            return self.tenants.admit(tenant, tokens, trio.current_time())
        return await self.cluster.admit(tenant, tokens, trio.current_time())

    def settle(self, ticket: Ticket, usage: Usage | None, cost: int | None = 0) -> None:
        """Settle ``ticket`` where it was reserved (once), and its budgets'
        reservation to ``cost`` (micro-units; None: the reservation stands)."""
        if ticket.settled:
            return
        now = trio.current_time()
        if ticket.periods:
            settled = None if usage is None else cost
            if self.cluster is None:
                self.tenants.settle_budget(ticket, settled, time.time())
            else:
                self.cluster.settle_budget(ticket, settled, time.time())
        if self.cluster is None or not ticket.rated:
            self.tenants.finish(ticket, usage, now)
        else:
            self.cluster.finish(ticket, usage, now)

    def hold(self, run: Run, ticket: Ticket) -> None:
        """``run`` was admitted with ``ticket``: settle it when the run ends."""
        run.timeline.tenant = ticket.tenant.name
        self._tickets[run.run_id] = ticket

    def finish(self, run: Run, charged: Usage | None) -> tuple[Ticket | None, int]:
        """``run`` ended, charged ``charged``: settle its ticket (if it was
        admitted with one) to its cost. Returns the ticket and the cost."""
        cost = self.prices.cost(run.spec.model, charged or Usage())
        ticket = self._tickets.pop(run.run_id, None)
        if ticket is not None:
            self.settle(ticket, charged, cost)
        return ticket, cost


def usage_record(run: Run, ticket: Ticket | None, charged: Usage | None, cost: int) -> UsageRecord:
    """The ledger's line of a finished run (``iop.ledger.UsageRecord``)."""
    timeline = run.timeline
    usage = charged or Usage()
    outcome = run.outcome
    reason = ""
    if isinstance(outcome, Cancelled):
        reason = outcome.reason.value
    elif isinstance(outcome, Error):
        reason = str(outcome.code)
    last = timeline.placements[-1] if timeline.placements else None
    ended = timeline.terminal if timeline.terminal is not None else trio.current_time()
    return UsageRecord(
        run_id=run.run_id,
        at=time.time(),
        tenant=ticket.tenant.name if ticket is not None else timeline.tenant,
        key_name=ticket.key_name if ticket is not None else "",
        model=run.spec.model,
        operation=run.spec.operation,
        node=last.node if last is not None else "",
        instance=last.instance if last is not None else "",
        input_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
        cached_tokens=usage.cached_input_tokens,
        outcome="complete"
        if isinstance(outcome, Complete)
        else "cancelled"
        if isinstance(outcome, Cancelled)
        else "error",
        reason=reason,
        duration_ms=max(0, round((ended - timeline.received) * 1000)),
        attempts=len(timeline.placements),
        cost_micros=cost,
    )
