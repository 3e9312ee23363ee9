"""The stored responses behind ``previous_response_id`` (sans-IO, clock passed in).

A response created with ``store`` not false is kept as the conversation it
ends: the chat messages of its history (what its own ``previous_response_id``
expanded to, then its input; never its ``instructions``, which OpenAI does
not carry over) followed by its output as one assistant message. A later
request naming it continues that conversation (``iop.api.responses._request``
puts it before the new input). Keeping whole conversations, not links to a
parent, means one evicted response never breaks the chains built on it.

Every response belongs to the tenant that created it (``iop.edge.tenancy._tenants``;
the edge passes the tenant's name) and is found only by that tenant: another
tenant's id is looked up in the asking tenant's own entries, so it is
answered exactly as an id that was never issued.

The store lives in the edge's memory and is bounded three ways
(``iop.config.ResponsesSettings``, docs/operations.md "Limits and abuse"):

* ``max_entries`` responses at most;
* ``max_bytes`` in total, counted as each conversation's JSON size (an
  overestimate where conversations share messages);
* ``ttl_s`` seconds after it was stored a response is forgotten.

Shares (docs/operations.md, "Tenants and limits"). Of ``n`` tenants (the
edge's configured count, or more if more have entries at once), each is
guaranteed ``max_entries // n`` entries and ``max_bytes // n`` bytes: its
*share*. A tenant may hold more while the store has room (an idle tenant's
share is lent), but a put never evicts another tenant's entries while that
tenant is within its share. Over a cap, room is made by the tenant furthest
over its share in that cap (the one putting first on a tie), from its least
recently used entries (a lookup counts as a use). Such a tenant always
exists: the shares add up to at most the cap, so a store over a cap has a
tenant over its share, and a conversation larger than its tenant's share of
bytes is not stored at all (with ``n`` = 1 the share is the whole budget).

Expired entries are dropped on every call, oldest first, so memory held by
expired responses is freed without a timer. Nothing here reads a clock:
every call takes ``now`` (seconds, any monotonic origin).
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from iop.spec import Message

__all__ = ["ResponseStore"]

_encode = msgspec.json.encode


class _Entry(msgspec.Struct, frozen=True, gc=False):
    messages: tuple[Message, ...]
    size: int
    expires: float


class _Held:
    """One tenant's entries, least recently used first, and their bytes."""

    __slots__ = ("bytes", "lru")

    def __init__(self) -> None:
        self.lru: OrderedDict[str, _Entry] = OrderedDict()
        self.bytes = 0


class ResponseStore:
    """A bounded, expiring map of (tenant, response id) -> conversation, each
    tenant with its share (module docstring).

    Args:
        max_entries: Most responses kept (>= ``tenants``).
        max_bytes: Most bytes of conversation kept (>= ``tenants``).
        ttl_s: Seconds a response is kept after it was stored (> 0).
        tenants: How many tenants share the store (>= 1): each is guaranteed
            ``1/tenants`` of both caps.
    """

    def __init__(self, *, max_entries: int, max_bytes: int, ttl_s: float, tenants: int = 1) -> None:
        if max_entries < 1 or max_bytes < 1 or ttl_s <= 0:
            raise ValueError("max_entries and max_bytes must be >= 1 and ttl_s > 0")
        if tenants < 1 or max_entries < tenants or max_bytes < tenants:
            raise ValueError("tenants must be >= 1 and each tenant's share at least 1")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.tenants = tenants
        self._held: dict[str, _Held] = {}  # tenants with entries only
        # (tenant, id), stored first = expires first.
        self._by_age: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._count = 0
        self._bytes = 0

    def __len__(self) -> int:
        return self._count

    @property
    def bytes(self) -> int:
        """Bytes held, as counted against ``max_bytes``."""
        return self._bytes

    def __contains__(self, response_id: object) -> bool:
        """Whether ``response_id`` is held for the tenant ``""`` (one-tenant use)."""
        held = self._held.get("")
        return held is not None and response_id in held.lru

    def _sharers(self, tenant: str) -> int:
        return max(self.tenants, len(self._held) + (tenant not in self._held))

    @property
    def share_entries(self) -> int:
        """Entries each tenant is guaranteed (``max_entries // n``)."""
        return self.max_entries // max(self.tenants, len(self._held))

    @property
    def share_bytes(self) -> int:
        """Bytes each tenant is guaranteed (``max_bytes // n``)."""
        return self.max_bytes // max(self.tenants, len(self._held))

    def usage(self, tenant: str) -> tuple[int, int]:
        """``tenant``'s entries and bytes."""
        held = self._held.get(tenant)
        return (0, 0) if held is None else (len(held.lru), held.bytes)

    def ids(self, tenant: str) -> set[str]:
        """The response ids held for ``tenant``."""
        held = self._held.get(tenant)
        return set() if held is None else set(held.lru)

    def _drop(self, tenant: str, response_id: str) -> None:
        held = self._held[tenant]
        entry = held.lru.pop(response_id)
        del self._by_age[tenant, response_id]
        held.bytes -= entry.size
        self._bytes -= entry.size
        self._count -= 1
        if not held.lru:
            del self._held[tenant]

    def _expire(self, now: float) -> None:
        while self._by_age:
            key, expires = next(iter(self._by_age.items()))
            if expires > now:
                return
            self._drop(*key)

    def _victim(self, tenant: str, size: int, by_bytes: bool) -> str:
        """The tenant furthest over its share of a cap (counting the entry
        ``tenant`` puts), ``tenant`` itself on a tie; one with entries."""
        n = self._sharers(tenant)
        share = (self.max_bytes if by_bytes else self.max_entries) // n
        best, excess = tenant, None
        if tenant in self._held:
            held = self._held[tenant]
            excess = (held.bytes + size if by_bytes else len(held.lru) + 1) - share
        for name, held in self._held.items():
            over = (held.bytes if by_bytes else len(held.lru)) - share
            if excess is None or over > excess:
                best, excess = name, over
        return best

    def put(
        self, response_id: str, messages: tuple[Message, ...], *, now: float, tenant: str = ""
    ) -> bool:
        """Store a response's conversation for ``tenant``, evicting what the
        caps demand (module docstring).

        Returns:
            False when it is not stored: alone it exceeds its tenant's share
            of ``max_bytes``, or it holds text that is not UTF-8 (a lone
            surrogate).
        """
        self._expire(now)
        held = self._held.get(tenant)
        if held is not None and response_id in held.lru:
            self._drop(tenant, response_id)
        try:
            size = len(_encode(messages))
        except UnicodeEncodeError:  # a lone surrogate: it could not be sent to a backend either
            return False
        if size > self.max_bytes // self._sharers(tenant):
            return False
        while self._count and (
            self._count >= self.max_entries or self._bytes + size > self.max_bytes
        ):
            victim = self._victim(tenant, size, by_bytes=self._count < self.max_entries)
            self._drop(victim, next(iter(self._held[victim].lru)))
        held = self._held.setdefault(tenant, _Held())
        held.lru[response_id] = _Entry(messages, size, now + self.ttl_s)
        held.bytes += size
        self._by_age[tenant, response_id] = now + self.ttl_s
        self._bytes += size
        self._count += 1
        return True

    def get(self, response_id: str, *, now: float, tenant: str = "") -> tuple[Message, ...] | None:
        """The conversation a response of ``tenant`` ends, or None (unknown,
        expired, or another tenant's: the same answer)."""
        self._expire(now)
        held = self._held.get(tenant)
        entry = None if held is None else held.lru.get(response_id)
        if held is None or entry is None:
            return None
        held.lru.move_to_end(response_id)
        return entry.messages
