"""Client keys as tenants: who is asking, what they may use, and their limits.

Sans-IO: every method takes the time (``now``, seconds on any monotonic
clock) and nothing here awaits, so the rules are tested without a clock
(tests/edge/test_tenants.py).

Who is asking. A request's key is hashed (SHA-256) and looked up among the
configured tenants' digests (``[[tenants]] key_sha256``): the edge never
holds a tenant's key in clear. A key of ``server.api_keys`` is the tenant
``default`` (no limits, every model); with neither configured the edge is
open and every request is the tenant ``anonymous``.

The limits (docs/operations.md, "Tenants and limits"):

* requests per minute and tokens per minute are token buckets of capacity
  *limit*, refilled at *limit / 60* per second: a tenant may spend its
  minute at once, then gets a steady trickle. A request takes 1 from the
  request bucket and *reserves* its estimated tokens (prompt estimate plus
  ``max_tokens``) from the token bucket; when its run ends the reservation
  is settled against the usage the run reported (refunded, or charged
  further: a bucket may go below zero, and the tenant then waits for it to
  refill). A run cancelled after its first output is charged its prompt
  (``charged_usage``); a token count (``count_tokens``) takes a request and
  reserves no tokens;
* concurrent runs are a count, released when the run ends;
* budgets (``budget_per_day``, ``budget_per_month``) are currency per UTC
  period, in integer micro-units (``iop.ledger``): a request reserves the
  cost of its token reservation at its model's price (``[prices]``), the
  run's real cost is settled when it ends, and a tenant whose period is
  spent is refused until the period ends (``Budget``; docs/operations.md,
  "Usage and budgets"). A restarted edge takes each period's spend, and the
  last minute of its rate buckets, from the usage ledger (``restore``).

A request over a limit is refused with 429 before it reaches the queue:
``RateLimited`` says which limit, when to retry, and the state of each
bucket for the response headers (OpenAI's ``x-ratelimit-*``, Anthropic's
``anthropic-ratelimit-*``): the buckets, budgets and headers are in
``iop/edge/tenancy/_limits.py``, what a request reserves and a run is
charged in ``iop/edge/tenancy/_charges.py``.

Prefix caches (docs/operations.md, "Tenants and limits", "Prefix caches").
A cached prefix answers faster and says so (``cached_tokens``), so a tenant
that may hit another's cache can test guesses of its prompts. Every tenant
of an edge with several has a cache of its own: ``Tenants.cache_salt`` is
the run's ``ExecutionSpec.cache_salt``, which scopes the edge's affinity
and prefix index (``iop.edge.scheduler._placement``, ``iop.edge.scheduler._prefix``) and is sent
to backends that isolate per request (vLLM's ``cache_salt``). A salt is a
keyed BLAKE2b of the tenant's name (and of the client's own ``cache_salt``,
so a client may still split its tenant's cache, and can never name
another's), under ``tenancy.cache_salt_key`` or, when none is set, a fixed
public key, so that a tenant's salt is the same through every edge and
across restarts. Isolation does not rest on the key's secrecy: a client
never chooses the salt its run carries (its own is folded into its
tenant's), so no request through the edge can carry another tenant's. The
key keeps the salts from being computed by someone who reaches a backend
directly, without the edge; that needs the key set. Tenants with ``share_prefix_cache`` share one
unsalted cache, as does every run of an edge with one tenant (the open
edge's ``anonymous``, or ``default`` with no ``[[tenants]]``).
"""

from __future__ import annotations

import base64
import enum
import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

import msgspec

from iop.config import TenancySettings, TenantSettings
from iop.edge.scheduler import EVEN_SHARE, QueueShare
from iop.edge.tenancy._limits import (
    Bucket,
    Budget,
    Limited,
    RateLimited,
    human_seconds,
    rebucket,
    rebudget,
    reset_duration,
)
from iop.errors import ErrorCode, RequestError
from iop.events import Usage
from iop.ledger import UsageRecord, money, period_end
from iop.spec import (
    OperationRequest,
)

__all__ = [
    "ANONYMOUS",
    "DEFAULT",
    "Tenant",
    "Tenants",
    "Ticket",
    "Via",
    "digest",
    "no_access",
]

# The key salts are derived under when ``tenancy.cache_salt_key`` is empty
# (module docstring): public, so that every edge derives the same salts.
_PUBLIC_SALT_KEY: Final = b"iop-cache-salt-v1"

ANONYMOUS: Final = "anonymous"
"""The tenant of every request when the edge has no keys at all."""
DEFAULT: Final = "default"
"""The tenant of the keys in ``server.api_keys``."""

# A tenant's ``priority`` as the scheduler's class number (0 is served first).
PRIORITIES: Final = {"high": 0, "normal": 1, "low": 2}

# A salt is 32 bytes, 43 characters of URL-safe base64: vLLM asks for a salt
# "long enough to be unpredictable (e.g., 43 characters base64-encoded,
# corresponding to 256 bit)" (the field's description since
# https://github.com/vllm-project/vllm/pull/17045).
_SALT_BYTES: Final = 32
_SALT_PERSON: Final = b"iop-cache-salt"


@dataclass(slots=True)
class Tenant:
    """One tenant's live state: its settings, buckets, runs and counters."""

    name: str
    models: frozenset[str]
    requests: Bucket | None
    tokens: Bucket | None
    max_concurrent: int
    share: QueueShare = EVEN_SHARE
    # Its runs' objective when a request names none ("" for the edge's default).
    objective: str = ""
    # Among several tenants, the objectives its requests may name (None:
    # those no higher in priority than its own; ``EdgeCore.queue_share``).
    objectives: frozenset[str] | None = None
    # Its prompts get a prefix cache of their own (``Tenants.cache_salt``).
    isolated: bool = False
    # Its budgets by period; empty: none.
    budgets: dict[str, Budget] = field(default_factory=dict)
    running: int = 0
    # Counters since the edge started (the admin page and /metrics).
    admitted: int = 0
    refused: int = 0
    tokens_in: int = 0
    tokens_out: int = 0

    def may_use(self, model: str) -> bool:
        return not self.models or model in self.models

    def visible(self, models: Iterable[str]) -> list[str]:
        """Of ``models``, those this tenant may use."""
        return [m for m in models if self.may_use(m)]


class Via(enum.Enum):
    """Where a ticket's reservation was made, so it is settled there."""

    LOCAL = "local"  # this edge's buckets (``Tenants``): one edge, no cluster
    SHARED = "shared"  # Valkey's (``iop.edge.tenancy._cluster``): every edge's
    FAIL_OPEN = "fail_open"  # this edge's share while Valkey is unreachable


@dataclass(slots=True)
class Ticket:
    """An admitted request: what it reserved, settled once by ``Tenants.finish``
    (or by ``iop.edge.tenancy._cluster.SharedLimits.finish`` when not ``LOCAL``)."""

    tenant: Tenant
    reserved_tokens: int
    limits: tuple[Limited, ...]
    settled: bool = False
    via: Via = Via.LOCAL
    # SHARED: the ticket holds one of the tenant's concurrency slots in Valkey.
    holds_slot: bool = False
    # FAIL_OPEN: the ticket of the local share it was admitted by.
    inner: Ticket | None = None
    # The cost reserved from the tenant's budgets (micro-units), and the
    # period of each budget it was reserved in.
    reserved_micros: int = 0
    periods: dict[str, str] = field(default_factory=dict)
    # The reservation is in Valkey's budgets (``iop.edge.tenancy._cluster``).
    budget_shared: bool = False
    # The name of the key the request came with (the usage ledger's).
    key_name: str = ""
    # Taken from the tenant's rate limits and concurrency (False: a batch line
    # under ``[batches] tenant_limits = "separate"``, which took none of them).
    rated: bool = True
    # That line's own bucket (``TenantAdmission``): what it reserved is
    # settled there.
    batch_tokens: Bucket | None = None


def digest(key: str) -> str:
    """The SHA-256 of a key, as ``key_sha256`` holds it."""
    return hashlib.sha256(key.encode()).hexdigest()


class Tenants:
    """Every tenant of the edge, found by key, admitted and settled.

    Args:
        tenants: ``[[tenants]]`` of the edge's config.
        api_keys: ``server.api_keys``: the tenant ``default``.
        tenancy: ``[tenancy]``.
    """

    def __init__(
        self,
        tenants: Sequence[TenantSettings],
        api_keys: Sequence[str],
        tenancy: TenancySettings,
    ) -> None:
        self.tenancy = tenancy
        self.open = not tenants and not api_keys
        self._by_digest: dict[str, Tenant] = {}
        self._key_names: dict[str, str] = {}
        self.all: dict[str, Tenant] = {}
        self.reconfigure(tenants, api_keys, tenancy, now=0.0)

    def reconfigure(
        self,
        tenants: Sequence[TenantSettings],
        api_keys: Sequence[str],
        tenancy: TenancySettings,
        *,
        now: float,
    ) -> None:
        """Take the tenants of a reloaded config (docs/operations.md, "Reloading").

        A tenant that stays (by name) keeps its live state: its buckets'
        levels (capped at a lowered limit), its running count and its
        counters; only its keys, models, limits and cache isolation change.
        A tenant that is gone is forgotten: its keys are refused from now on,
        while its admitted runs go on and are settled on the state they hold.
        Nothing awaits: a request is identified either before or after the
        change.
        """
        before = self.all
        self.tenancy = tenancy
        self.open = not tenants and not api_keys
        by_digest: dict[str, Tenant] = {}
        key_names: dict[str, str] = {}
        everyone: dict[str, Tenant] = {}
        # What salts are keyed with: the configured secret, or a fixed public
        # key (module docstring: isolation comes from clients never choosing
        # their salt; the key's secrecy only matters against someone who can
        # reach a backend directly).
        self._salt_key = hashlib.sha256(
            tenancy.cache_salt_key.encode() or _PUBLIC_SALT_KEY
        ).digest()
        if self.open:
            everyone[ANONYMOUS] = before.get(ANONYMOUS) or _unlimited(ANONYMOUS)
        if api_keys:
            default = everyone[DEFAULT] = before.get(DEFAULT) or _unlimited(DEFAULT)
            # Among tenants, ``default`` is one more; alone, it has nobody to
            # be kept from.
            default.isolated = bool(tenants)
            for key in api_keys:
                by_digest[digest(key)] = default
        for t in tenants:
            tenant = before.get(t.name)
            if tenant is None:
                tenant = Tenant(
                    name=t.name, models=frozenset(), requests=None, tokens=None, max_concurrent=0
                )
            tenant.models = frozenset(t.models)
            tenant.requests = rebucket(tenant.requests, t.requests_per_minute, now)
            tenant.tokens = rebucket(tenant.tokens, t.tokens_per_minute, now)
            tenant.max_concurrent = t.max_concurrent_runs
            tenant.share = QueueShare(t.name, PRIORITIES[t.priority], t.weight)
            tenant.isolated = not t.share_prefix_cache
            tenant.objective = t.objective
            tenant.objectives = None if t.objectives is None else frozenset(t.objectives)
            tenant.budgets = rebudget(tenant.budgets, t.budget_micros)
            everyone[t.name] = tenant
            for d in t.key_sha256:
                by_digest[d] = tenant
                key_names[d] = f"sha256:{d[:12]}"
            for k in t.keys:
                by_digest[k.sha256] = tenant
                key_names[k.sha256] = k.name
        self.all = everyone
        self._by_digest = by_digest
        self._key_names = key_names

    def identify(self, key: str) -> Tenant | None:
        """The tenant of ``key``; None for a missing or wrong key.

        The lookup is by the key's SHA-256: its timing can tell an attacker
        about digests, from which no key can be found."""
        if self.open:
            return self.all[ANONYMOUS]
        if not key:
            return None
        return self._by_digest.get(digest(key))

    def key_name(self, key: str) -> str:
        """The ledger's name of ``key`` (``TenantKey.name``; ``sha256:`` and
        12 digits of an unnamed one's digest; empty for ``server.api_keys``
        and the open edge)."""
        if self.open or not key:
            return ""
        return self._key_names.get(digest(key), "")

    # --- budgets --------------------------------------------------------------

    def check_budget(self, tenant: Tenant, cost: int, wall: float, now: float) -> None:
        """Refuse a request of ``tenant`` reserving ``cost`` micro-units if a
        budget of its is spent or cannot hold it; nothing is taken.

        Raises:
            RateLimited: ``limit`` is ``budget_day`` or ``budget_month``;
                ``retry_after_s`` is the end of the period.
        """
        waits: list[tuple[float, str, str]] = []
        for budget in tenant.budgets.values():
            budget.roll(wall)
            if budget.spent < budget.limit and budget.spent + cost <= budget.limit:
                continue
            wait = max(0.0, period_end(budget.period, wall) - wall)
            if cost > budget.limit:
                message = (
                    f"Request too large for tenant {tenant.name}'s budget per "
                    f"{budget.period}: its reservation costs {money(cost)}, the budget is "
                    f"{money(budget.limit)}. Lower max_tokens or shorten the prompt."
                )
                wait = math.inf
            else:
                message = (
                    f"Budget reached for tenant {tenant.name}: {money(budget.spent)} of "
                    f"{money(budget.limit)} per {budget.period} spent or reserved. "
                    f"It renews in {reset_duration(wait)} (at the start of the next UTC "
                    f"{budget.period})."
                )
            waits.append((wait, f"budget_{budget.period}", message))
        if waits:
            tenant.refused += 1
            wait, limit, message = max(waits)
            raise RateLimited(
                message, limit=limit, retry_after_s=wait, limits=self.limits(tenant, now)
            )

    def take_budget(self, ticket: Ticket, cost: int, wall: float) -> None:
        """Reserve ``cost`` from the budgets of ``ticket``'s tenant (checked by
        ``check_budget``)."""
        ticket.reserved_micros = cost
        for budget in ticket.tenant.budgets.values():
            ticket.periods[budget.period] = budget.roll(wall)
            budget.spent += cost

    def settle_budget(self, ticket: Ticket, cost: int | None, wall: float) -> None:
        """Settle ``ticket``'s reservation to the run's ``cost`` (None: the
        reservation stands). A reservation of an earlier period is not
        given back to the new one."""
        for budget in ticket.tenant.budgets.values():
            key = budget.roll(wall)
            reserved = ticket.periods.pop(budget.period, None)
            if reserved is None:
                continue  # admitted before the tenant had this budget
            charged = ticket.reserved_micros if cost is None else cost
            # The reservation was taken from this period's spend: replace it.
            budget.spent += charged - ticket.reserved_micros if reserved == key else charged

    def restore(
        self,
        spent: dict[str, dict[str, int]],
        recent: Sequence[UsageRecord],
        wall: float,
        now: float,
    ) -> None:
        """Take the usage ledger's state at start (``iop.edge.tenancy._ledger.Restored``):
        each budget's spend in its current period, and the last minute's
        runs replayed into the rate buckets (each run took 1 request and its
        tokens when it ended)."""
        for tenant in self.all.values():
            for budget in tenant.budgets.values():
                budget.roll(wall)
                budget.spent = spent.get(budget.period, {}).get(tenant.name, 0)
        for record in recent:
            ran = self.all.get(record.tenant)
            if ran is None:
                continue
            # Its end on this process's clock; the buckets refill from there.
            at = min(now, now - (wall - record.at))
            for bucket, cost in ((ran.requests, 1), (ran.tokens, record.tokens)):
                if bucket is not None:
                    bucket.take(cost, at)

    def limits(self, tenant: Tenant, now: float) -> tuple[Limited, ...]:
        """The state of ``tenant``'s rate limits now."""
        out: list[Limited] = []
        for kind, bucket in (("requests", tenant.requests), ("tokens", tenant.tokens)):
            if bucket is not None:
                out.append(
                    Limited(
                        kind,
                        bucket.capacity,
                        max(0, math.floor(bucket.level(now))),
                        bucket.until_full(now),
                    )
                )
        return tuple(out)

    def admit(self, tenant: Tenant, tokens: int, now: float) -> Ticket:
        """Admit one request of ``tenant`` that reserves ``tokens``.

        Raises:
            RateLimited: Over a limit: nothing is taken.
        """
        waits: list[tuple[float, str, str]] = []
        if tenant.max_concurrent and tenant.running >= tenant.max_concurrent:
            waits.append(
                (
                    1.0,
                    "concurrency",
                    f"Rate limit reached for tenant {tenant.name}: {tenant.running} of "
                    f"{tenant.max_concurrent} concurrent runs in use.",
                )
            )
        if tenant.requests is not None:
            wait = tenant.requests.wait_for(1, now)
            if wait > 0:
                waits.append(
                    (
                        wait,
                        "requests",
                        f"Rate limit reached for tenant {tenant.name} on requests per minute: "
                        f"limit {tenant.requests.capacity}. Please try again in {human_seconds(wait)}.",
                    )
                )
        if tenant.tokens is not None:
            wait = tenant.tokens.wait_for(tokens, now)
            if math.isinf(wait):
                waits.append(
                    (
                        wait,
                        "tokens",
                        f"Request too large for tenant {tenant.name} on tokens per minute: "
                        f"limit {tenant.tokens.capacity}, requested {tokens} (the prompt's "
                        "estimate plus max_tokens). Lower max_tokens or shorten the prompt.",
                    )
                )
            elif wait > 0:
                waits.append(
                    (
                        wait,
                        "tokens",
                        f"Rate limit reached for tenant {tenant.name} on tokens per minute: "
                        f"limit {tenant.tokens.capacity}, requested {tokens}. "
                        f"Please try again in {human_seconds(wait)}.",
                    )
                )
        if waits:
            tenant.refused += 1
            wait, limit, message = max(waits)
            raise RateLimited(
                message, limit=limit, retry_after_s=wait, limits=self.limits(tenant, now)
            )
        if tenant.requests is not None:
            tenant.requests.take(1, now)
        if tenant.tokens is not None:
            tenant.tokens.take(tokens, now)
        tenant.running += 1
        tenant.admitted += 1
        return Ticket(tenant, tokens, self.limits(tenant, now))

    def finish(self, ticket: Ticket, usage: Usage | None, now: float) -> None:
        """Settle ``ticket`` once its run ended, with the usage it reported
        (None: none; the reservation stands). A second call does nothing."""
        if ticket.settled:
            return
        ticket.settled = True
        tenant = ticket.tenant
        if ticket.rated:
            tenant.running -= 1
        if usage is None:
            return
        tenant.tokens_in += usage.input_tokens
        tenant.tokens_out += usage.output_tokens
        used = usage.input_tokens + usage.output_tokens
        bucket = tenant.tokens if ticket.rated else ticket.batch_tokens
        if bucket is not None:
            bucket.give(ticket.reserved_tokens - used, now)

    def cache_salt(self, tenant: Tenant, request: OperationRequest) -> str:
        """The cache salt of a run of ``tenant`` (``ExecutionSpec.cache_salt``).

        Empty for a tenant that shares its cache. Else a keyed digest of the
        tenant's name and the client's own ``cache_salt`` (any JSON value, or
        none): the same for every run of the tenant with the same client
        salt, and never another tenant's (module docstring).
        """
        if not tenant.isolated:
            return ""
        extra = getattr(request, "extra_body", None) or {}
        mac = hashlib.blake2b(
            msgspec.json.encode([tenant.name, extra.get("cache_salt")]),
            key=self._salt_key,
            digest_size=_SALT_BYTES,
            person=_SALT_PERSON,
        )
        return base64.urlsafe_b64encode(mac.digest()).rstrip(b"=").decode()

    def snapshot(self, now: float) -> list[dict[str, object]]:
        """Every tenant's state, for ``/admin/tenants`` and the admin page."""
        out: list[dict[str, object]] = []
        for t in self.all.values():
            limits = {
                lim.kind: {"limit": lim.limit, "remaining": lim.remaining}
                for lim in self.limits(t, now)
            }
            out.append(
                {
                    "name": t.name,
                    "models": sorted(t.models),
                    "priority": next(k for k, v in PRIORITIES.items() if v == t.share.priority),
                    "weight": t.share.weight,
                    "running": t.running,
                    "max_concurrent_runs": t.max_concurrent,
                    "limits": limits,
                    "admitted": t.admitted,
                    "refused": t.refused,
                    "tokens_in": t.tokens_in,
                    "tokens_out": t.tokens_out,
                    **(
                        {
                            "budgets": {
                                b.period: {"limit_micros": b.limit, "spent_micros": b.spent}
                                for b in t.budgets.values()
                            }
                        }
                        if t.budgets
                        else {}
                    ),
                }
            )
        return out


def _unlimited(name: str, *, isolated: bool = False) -> Tenant:
    return Tenant(
        name=name,
        models=frozenset(),
        requests=None,
        tokens=None,
        max_concurrent=0,
        share=QueueShare(name),
        isolated=isolated,
    )


def no_access(model: str) -> RequestError:
    """A model the tenant may not use: as OpenAI answers a model the key
    cannot see, so a tenant learns nothing of the models it may not use."""
    return RequestError(
        f"The model `{model}` does not exist or you do not have access to it.",
        status=404,
        code=ErrorCode.MODEL_NOT_FOUND,
        param="model",
    )
