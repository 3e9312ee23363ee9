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
``anthropic-ratelimit-*``: ``headers_openai``, ``headers_anthropic``).

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
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final, cast

import msgspec

from iop.api import estimate_input_tokens
from iop.config import TenancySettings, TenantSettings
from iop.edge.scheduler import EVEN_SHARE, QueueShare
from iop.errors import ErrorCode, RequestError
from iop.events import Cancelled, Complete, Error, Usage
from iop.ledger import Period, UsageRecord, money, period_end, period_key
from iop.spec import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    Operation,
    OperationRequest,
    TokenizeRequest,
)

__all__ = [
    "ANONYMOUS",
    "DEFAULT",
    "Bucket",
    "Budget",
    "Limited",
    "RateLimited",
    "Tenant",
    "Tenants",
    "Ticket",
    "Via",
    "charged_usage",
    "estimate_prompt_tokens",
    "estimate_tokens",
    "headers_anthropic",
    "headers_openai",
    "no_access",
    "rate_headers",
    "retry_headers",
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

# The chars-per-token ratio of iop.api.messages._tokens, for prompts that are
# not chat messages.
_CHARS_PER_TOKEN: Final = 4

# A salt is 32 bytes, 43 characters of URL-safe base64: vLLM asks for a salt
# "long enough to be unpredictable (e.g., 43 characters base64-encoded,
# corresponding to 256 bit)" (the field's description since
# https://github.com/vllm-project/vllm/pull/17045).
_SALT_BYTES: Final = 32
_SALT_PERSON: Final = b"iop-cache-salt"


class Bucket:
    """A token bucket of ``capacity``, refilled at ``capacity / 60`` per second.

    The level may go below zero (a settled run that used more than it
    reserved); it is never above ``capacity``.
    """

    __slots__ = ("_at", "_level", "capacity", "rate")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.rate = capacity / 60.0
        self._level = float(capacity)
        # Full from its first use: the constructor needs no clock.
        self._at: float | None = None

    def level(self, now: float) -> float:
        """The bucket's level at ``now``."""
        if self._at is None:
            self._at = now
        elif now > self._at:
            self._level = min(float(self.capacity), self._level + (now - self._at) * self.rate)
            self._at = now
        return self._level

    def wait_for(self, cost: float, now: float) -> float:
        """Seconds until ``cost`` can be taken (0: now). ``cost`` above the
        capacity can never be taken: ``math.inf``."""
        if cost > self.capacity:
            return math.inf
        short = cost - self.level(now)
        return 0.0 if short <= 0 else short / self.rate

    def take(self, cost: float, now: float) -> None:
        """Take ``cost`` (the caller checked ``wait_for``); may go below zero."""
        self._level = self.level(now) - cost

    def give(self, amount: float, now: float) -> None:
        """Give ``amount`` back (capped at the capacity)."""
        self._level = min(float(self.capacity), self.level(now) + amount)

    def until_full(self, now: float) -> float:
        """Seconds until the bucket is full again (OpenAI's "reset")."""
        return (self.capacity - self.level(now)) / self.rate

    def resize(self, capacity: int, now: float) -> None:
        """A new limit (a config reload): the level stays what it is, capped at
        the new capacity; from now on it refills at ``capacity / 60``."""
        level = self.level(now)
        self.capacity = capacity
        self.rate = capacity / 60.0
        self._level = min(float(capacity), level)


@dataclass(slots=True)
class Budget:
    """A tenant's spend in one UTC period (``day`` or ``month``), in micro-units.

    ``spent`` holds the settled cost of the period's runs plus the
    reservations of the runs still going; it starts again at 0 when the
    period changes (``roll``).
    """

    period: Period
    limit: int
    spent: int = 0
    key: str = ""  # the period ``spent`` is of (``iop.ledger.period_key``)

    def roll(self, wall: float) -> str:
        """Start the period holding ``wall`` if it is a new one; its key."""
        key = period_key(self.period, wall)
        if key != self.key:
            self.key = key
            self.spent = 0
        return key


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


@dataclass(frozen=True, slots=True)
class Limited:
    """The state of one limit, for the response headers."""

    kind: str  # "requests" or "tokens"
    limit: int
    remaining: int
    reset_s: float


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


class RateLimited(RequestError):
    """A request over one of its tenant's limits (429).

    Attributes:
        limit: Which limit: ``requests``, ``tokens`` or ``concurrency``
            (the one that frees up last, when several are crossed).
        retry_after_s: When the request could be admitted, at the earliest
            (``math.inf``: never, it is larger than the limit itself).
        limits: Every limit of the tenant, for the response headers.
    """

    def __init__(
        self, message: str, *, limit: str, retry_after_s: float, limits: tuple[Limited, ...]
    ) -> None:
        super().__init__(message, status=429, code=ErrorCode.RATE_LIMIT_EXCEEDED)
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.limits = limits

    @property
    def retry_after_header(self) -> str:
        """``Retry-After`` in whole seconds (at least 1)."""
        if math.isinf(self.retry_after_s):
            return "60"
        return str(max(1, math.ceil(self.retry_after_s)))


def estimate_tokens(request: OperationRequest, default_max_tokens: int) -> int:
    """What a request reserves against ``tokens_per_minute``: its prompt
    (``estimate_prompt_tokens``) plus the output it may produce."""
    prompt = estimate_prompt_tokens(request)
    if isinstance(request, ChatRequest):
        return prompt + (request.max_completion_tokens or request.max_tokens or default_max_tokens)
    if isinstance(request, CompletionRequest):
        return prompt + (request.max_tokens or default_max_tokens)
    return prompt


def estimate_prompt_tokens(request: OperationRequest) -> int:
    """A request's prompt, estimated as ``count_tokens`` does (docs/api.md,
    "count_tokens"): what it reserves, and what it is charged for its prompt
    when it is cancelled after its first output (``iop.runtime``'s
    ``Run.prompt_tokens``). A token count's is 0: it generates nothing, so
    it reserves and is charged no tokens."""
    if isinstance(request, ChatRequest):
        return estimate_input_tokens(request)
    if isinstance(request, CompletionRequest):
        prompt = request.prompt
        # A prompt of token ids is its length in tokens.
        return math.ceil(len(prompt) / _CHARS_PER_TOKEN) if isinstance(prompt, str) else len(prompt)
    if isinstance(request, EmbeddingRequest):
        return sum(
            math.ceil(len(i) / _CHARS_PER_TOKEN) if isinstance(i, str) else len(i)
            for i in request.inputs
        )
    assert isinstance(request, TokenizeRequest)
    return 0


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
            tenant.requests = _rebucket(tenant.requests, t.requests_per_minute, now)
            tenant.tokens = _rebucket(tenant.tokens, t.tokens_per_minute, now)
            tenant.max_concurrent = t.max_concurrent_runs
            tenant.share = QueueShare(t.name, PRIORITIES[t.priority], t.weight)
            tenant.isolated = not t.share_prefix_cache
            tenant.objective = t.objective
            tenant.budgets = _rebudget(tenant.budgets, t.budget_micros)
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
                    f"It renews in {_duration(wait)} (at the start of the next UTC "
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
                        f"limit {tenant.requests.capacity}. Please try again in {_human(wait)}.",
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
                        f"Please try again in {_human(wait)}.",
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
        tenant.running -= 1
        if usage is None:
            return
        tenant.tokens_in += usage.input_tokens
        tenant.tokens_out += usage.output_tokens
        if tenant.tokens is not None:
            used = usage.input_tokens + usage.output_tokens
            tenant.tokens.give(ticket.reserved_tokens - used, now)

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

    def share_of(self, name: str) -> QueueShare:
        """The queue share of the tenant ``name`` (an even one if unknown)."""
        tenant = self.all.get(name)
        return EVEN_SHARE if tenant is None else tenant.share

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


def charged_usage(outcome: object, operation: Operation) -> Usage | None:
    """What a run's tenant is charged: the usage a completed or cancelled run
    reported (a cancelled run's is its prompt once the backend had read it,
    and what it streamed: ``iop.runtime``, "What a ``Cancelled`` run used");
    nothing for a run that failed (the platform's failure, not the tenant's
    use) nor for a token count (it generates nothing); None (the
    reservation stands) when the outcome is unknown."""
    if isinstance(outcome, Complete | Cancelled):
        return Usage() if operation == "tokenize" else outcome.usage
    if isinstance(outcome, Error):
        return Usage()
    return None


def _rebucket(bucket: Bucket | None, limit: int, now: float) -> Bucket | None:
    """A tenant's bucket for ``limit`` (0: none), the live one kept when there is one."""
    if not limit:
        return None
    if bucket is None:
        return Bucket(limit)
    if bucket.capacity != limit:
        bucket.resize(limit, now)
    return bucket


def _rebudget(budgets: dict[str, Budget], limits: Mapping[str, int]) -> dict[str, Budget]:
    """A tenant's budgets for ``limits`` (period -> micro-units), each live one
    kept with its spend and reservations (only its limit changes)."""
    out: dict[str, Budget] = {}
    for period, limit in limits.items():
        budget = budgets.get(period) or Budget(cast(Period, period), limit)
        budget.limit = limit
        out[period] = budget
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


def _human(seconds: float) -> str:
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    return f"{seconds:.1f}s" if seconds < 60 else _duration(seconds)


def _duration(seconds: float) -> str:
    """OpenAI's reset format: ``12ms``, ``1s``, ``6m0s``, ``1h2m3s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    total = math.ceil(seconds)
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m}m{s}s"
    if m:
        return f"{m}m{s}s"
    return f"{s}s"


def headers_openai(limits: Iterable[Limited]) -> dict[str, str]:
    """OpenAI's rate-limit headers (https://platform.openai.com/docs/guides/rate-limits)."""
    out: dict[str, str] = {}
    for lim in limits:
        out[f"x-ratelimit-limit-{lim.kind}"] = str(lim.limit)
        out[f"x-ratelimit-remaining-{lim.kind}"] = str(lim.remaining)
        out[f"x-ratelimit-reset-{lim.kind}"] = _duration(lim.reset_s)
    return out


def headers_anthropic(limits: Iterable[Limited], wall: float | None = None) -> dict[str, str]:
    """Anthropic's rate-limit headers (https://docs.anthropic.com/en/api/rate-limits):
    each reset an RFC 3339 time."""
    wall = time.time() if wall is None else wall
    out: dict[str, str] = {}
    for lim in limits:
        at = datetime.fromtimestamp(wall + lim.reset_s, UTC).replace(microsecond=0)
        out[f"anthropic-ratelimit-{lim.kind}-limit"] = str(lim.limit)
        out[f"anthropic-ratelimit-{lim.kind}-remaining"] = str(lim.remaining)
        out[f"anthropic-ratelimit-{lim.kind}-reset"] = at.isoformat().replace("+00:00", "Z")
    return out


def rate_headers(limits: Iterable[Limited], anthropic: bool) -> dict[str, str]:
    """The rate-limit headers of a response, in the surface's family."""
    return headers_anthropic(limits) if anthropic else headers_openai(limits)


def no_access(model: str) -> RequestError:
    """A model the tenant may not use: as OpenAI answers a model the key
    cannot see, so a tenant learns nothing of the models it may not use."""
    return RequestError(
        f"The model `{model}` does not exist or you do not have access to it.",
        status=404,
        code=ErrorCode.MODEL_NOT_FOUND,
        param="model",
    )


def retry_headers(exc: RateLimited, anthropic: bool) -> dict[str, str]:
    """The headers of a 429 for ``exc``, in the surface's family."""
    return {"Retry-After": exc.retry_after_header, **rate_headers(exc.limits, anthropic)}
