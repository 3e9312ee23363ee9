"""A tenant's limits: token buckets, budgets, and how a refusal says which.

Sans-IO (``now`` and ``wall`` are passed in). ``Bucket`` is a requests- or
tokens-per-minute bucket, ``Budget`` a spend per UTC period; ``RateLimited``
is the 429 of a request over one, and the ``headers_*`` functions write the
state of each limit as OpenAI's ``x-ratelimit-*`` and Anthropic's
``anthropic-ratelimit-*`` headers. The rules they serve are in
``iop/edge/tenancy/_tenants.py`` and docs/operations.md, "Tenants and limits".
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import cast

from iop.errors import ErrorCode, RequestError
from iop.ledger import Period, period_key

__all__ = [
    "Bucket",
    "Budget",
    "Limited",
    "RateLimited",
    "headers_anthropic",
    "headers_openai",
    "human_seconds",
    "rate_headers",
    "rebucket",
    "rebudget",
    "reset_duration",
    "retry_headers",
]


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


@dataclass(frozen=True, slots=True)
class Limited:
    """The state of one limit, for the response headers."""

    kind: str  # "requests" or "tokens"
    limit: int
    remaining: int
    reset_s: float


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


def rebucket(bucket: Bucket | None, limit: int, now: float) -> Bucket | None:
    """A tenant's bucket for ``limit`` (0: none), the live one kept when there is one."""
    if not limit:
        return None
    if bucket is None:
        return Bucket(limit)
    if bucket.capacity != limit:
        bucket.resize(limit, now)
    return bucket


def rebudget(budgets: dict[str, Budget], limits: Mapping[str, int]) -> dict[str, Budget]:
    """A tenant's budgets for ``limits`` (period -> micro-units), each live one
    kept with its spend and reservations (only its limit changes)."""
    out: dict[str, Budget] = {}
    for period, limit in limits.items():
        budget = budgets.get(period) or Budget(cast(Period, period), limit)
        budget.limit = limit
        out[period] = budget
    return out


def human_seconds(seconds: float) -> str:
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    return f"{seconds:.1f}s" if seconds < 60 else reset_duration(seconds)


def reset_duration(seconds: float) -> str:
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
        out[f"x-ratelimit-reset-{lim.kind}"] = reset_duration(lim.reset_s)
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


def retry_headers(exc: RateLimited, anthropic: bool) -> dict[str, str]:
    """The headers of a 429 for ``exc``, in the surface's family."""
    return {"Retry-After": exc.retry_after_header, **rate_headers(exc.limits, anthropic)}
