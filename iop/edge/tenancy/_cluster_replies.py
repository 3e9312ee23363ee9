"""The cluster scripts' replies, checked at the boundary (sans-IO).

Whatever answers on Valkey's port, its reply is foreign data: each script
of ``iop.edge.tenancy._cluster`` has one decoder here that turns the reply into a
typed value or refuses it with ``BadReply``, which the caller treats as it
treats a socket error (the edge fails open to its local share). Nothing
past these decoders calls ``int()`` on a reply or unpacks one.

The values are as coredis returns them with ``decode_responses`` off over
RESP3 (``HELLO 3``; the scripts never call ``redis.setresp``): a Lua number
is a RESP integer (``int``), a Lua string a bulk string (``bytes``), a Lua
table an array (``list``); Valkey scripts reference, "Conversion between
Lua and RESP" (https://valkey.io/topics/lua-api/). RESP3 also has booleans,
doubles, maps and nil (``bool``, ``float``, ``dict``, ``None``): no script
returns them, so each is a wrong shape. ``bool`` is an ``int`` to Python,
hence the exact type checks.
"""

from __future__ import annotations

import math
from typing import Final

import msgspec

__all__ = [
    "MAX_LIVE_EDGES",
    "BadReply",
    "Reservation",
    "decode_budget",
    "decode_done",
    "decode_heartbeat",
    "decode_reserve",
]

# The most live edges a heartbeat may count. A deployment runs a handful of
# edges (each holds a connection to the one Valkey); a count past this is
# not a count, and taken as one it would shrink every fail-open share
# (limit / live edges) to 1.
MAX_LIVE_EDGES: Final = 1024

# A number the reserve script sends as a string (``tostring`` of a Lua
# number: at most 17 significant digits and an exponent, well under this).
_MAX_NUMBER_BYTES: Final = 64


class BadReply(Exception):
    """A script's reply is not of the shape that script returns."""


class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    """``RESERVE``'s reply: the decision and the buckets as Valkey left them.

    Attributes:
        admitted: Whether 1 request, the tokens and a slot were taken.
        requests_left: The request bucket's level (0 when the tenant has no
            requests limit).
        requests_refill_s: Seconds until the request bucket is full.
        tokens_left: The token bucket's level.
        tokens_refill_s: Seconds until the token bucket is full.
        running: The concurrency slots live edges hold for the tenant.
        requests_wait_s: Refused for requests: seconds until one is back.
        tokens_wait_s: Refused for tokens: seconds until enough are back;
            -1: the request asks for more than the limit itself.
        concurrency_full: Refused because every slot is held.
    """

    admitted: bool
    requests_left: float
    requests_refill_s: float
    tokens_left: float
    tokens_refill_s: float
    running: int
    requests_wait_s: float
    tokens_wait_s: float
    concurrency_full: bool


def _describe(value: object) -> str:
    if isinstance(value, list):
        return f"an array of {len(value)}"
    if isinstance(value, bytes):
        return f"a string of {len(value)} bytes"
    if value is None:
        return "nil"
    if type(value) is int:
        return f"the integer {value}" if abs(value) < 10**18 else "a huge integer"
    return f"a {type(value).__name__}"


def _integer(value: object, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise BadReply(f"{what}: {_describe(value)}, not an integer in [{low}, {high}]")
    return value


def _flag(value: object, what: str) -> bool:
    return _integer(value, what, 0, 1) == 1


def _number(value: object, what: str, low: float = 0.0) -> float:
    """A Lua number sent as a string: finite and at least ``low``."""
    if type(value) is not bytes or len(value) > _MAX_NUMBER_BYTES:
        raise BadReply(f"{what}: {_describe(value)}, not a number as a string")
    try:
        number = float(value)
    except ValueError:
        raise BadReply(f"{what}: {value!r} is not a number") from None
    if not math.isfinite(number) or number < low:
        bound = f" >= {low}" if math.isfinite(low) else ""
        raise BadReply(f"{what}: {value!r} is not a finite number{bound}")
    return number


def decode_heartbeat(reply: object) -> int:
    """``HEARTBEAT``'s reply: the live edges, this one counted (1..MAX_LIVE_EDGES).

    Raises:
        BadReply: Anything else.
    """
    return _integer(reply, "live edges", 1, MAX_LIVE_EDGES)


def decode_done(reply: object) -> None:
    """``SETTLE``'s, ``RESYNC``'s and ``LEAVE``'s reply: the integer 1.

    Raises:
        BadReply: Anything else.
    """
    _integer(reply, "done", 1, 1)


# A period's spend in micro-units: budgets are at most 10^12 currency units
# (``iop.config.MAX_MONEY``), 10^18 micro-units; a settlement may take the
# spend below 0 by what it gives back, never by more than a budget.
_MAX_MICROS: Final = 10**18


def decode_budget(reply: object, *, periods: int) -> tuple[bool, list[int]]:
    """``BUDGET_RESERVE``'s reply: whether the cost was taken, and each
    period's spend as Valkey left it (integers sent as strings).

    Raises:
        BadReply: Anything else.
    """
    if type(reply) is not list or len(reply) != 1 + periods:
        raise BadReply(f"budget: {_describe(reply)}, not an array of {1 + periods}")
    ok = _flag(reply[0], "budget taken")
    spent: list[int] = []
    for value in reply[1:]:
        if type(value) is not bytes or len(value) > _MAX_NUMBER_BYTES:
            raise BadReply(f"budget spent: {_describe(value)}, not an integer as a string")
        try:
            number = int(value)
        except ValueError:
            raise BadReply(f"budget spent: {value!r} is not an integer") from None
        if not -_MAX_MICROS <= number <= _MAX_MICROS:
            raise BadReply(f"budget spent: {value!r} is out of range")
        spent.append(number)
    return ok, spent


def decode_reserve(
    reply: object, *, requests: bool, tokens: bool, concurrency: bool
) -> Reservation:
    """``RESERVE``'s reply (nine values), for a tenant with the given limits.

    A refusal must name a limit the tenant has (that is all the edge can
    answer the client with), and an admission none.

    Raises:
        BadReply: Another shape, a value out of its range, or a decision
            its reasons contradict.
    """
    if type(reply) is not list or len(reply) != 9:
        raise BadReply(f"reservation: {_describe(reply)}, not an array of 9")
    ok, rl, rr, tl, tr, running, wr, wt, wc = reply
    r = Reservation(
        admitted=_flag(ok, "admitted"),
        requests_left=_number(rl, "requests left", -math.inf),
        requests_refill_s=_number(rr, "requests refill"),
        tokens_left=_number(tl, "tokens left", -math.inf),
        tokens_refill_s=_number(tr, "tokens refill"),
        running=_integer(running, "running", 0, 2**63 - 1),
        requests_wait_s=_number(wr, "requests wait"),
        tokens_wait_s=_number(wt, "tokens wait", -1.0),
        concurrency_full=_flag(wc, "concurrency full"),
    )
    if -1.0 < r.tokens_wait_s < 0.0:
        raise BadReply(f"tokens wait: {r.tokens_wait_s} is neither -1 nor >= 0")
    reasons = (
        (concurrency and r.concurrency_full)
        or (requests and r.requests_wait_s > 0)
        or (tokens and r.tokens_wait_s != 0)
    )
    waits = r.concurrency_full or r.requests_wait_s > 0 or r.tokens_wait_s != 0
    if r.admitted and waits:
        raise BadReply("reservation: admitted, with a reason to wait")
    if not r.admitted and not reasons:
        raise BadReply("reservation: refused, naming no limit the tenant has")
    return r
