"""The stored responses behind ``previous_response_id`` (sans-IO, clock passed in).

A response created with ``store`` not false is kept as the conversation it
ends: the chat messages of its history (what its own ``previous_response_id``
expanded to, then its input; never its ``instructions``, which OpenAI does
not carry over) followed by its output as one assistant message. A later
request naming it continues that conversation (``iop.api.responses._request``
puts it before the new input). Keeping whole conversations, not links to a
parent, means one evicted response never breaks the chains built on it.

The store lives in the edge's memory and is bounded three ways
(``iop.config.ResponsesSettings``, docs/operations.md "Limits and abuse"):

* ``max_entries`` responses at most;
* ``max_bytes`` in total, counted as each conversation's JSON size (an
  overestimate where conversations share messages; a conversation larger
  than the whole budget is not stored);
* ``ttl_s`` seconds after it was stored a response is forgotten.

Over a cap, the least recently used responses go first (a lookup counts as
a use). Expired entries are dropped on every call, oldest first, so memory
held by expired responses is freed without a timer. Nothing here reads a
clock: every call takes ``now`` (seconds, any monotonic origin).
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


class ResponseStore:
    """A bounded, expiring map of response id -> conversation (module docstring).

    Args:
        max_entries: Most responses kept (>= 1).
        max_bytes: Most bytes of conversation kept (>= 1).
        ttl_s: Seconds a response is kept after it was stored (> 0).
    """

    def __init__(self, *, max_entries: int, max_bytes: int, ttl_s: float) -> None:
        if max_entries < 1 or max_bytes < 1 or ttl_s <= 0:
            raise ValueError("max_entries and max_bytes must be >= 1 and ttl_s > 0")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._lru: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._by_age: OrderedDict[str, float] = OrderedDict()  # stored first = expires first
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def bytes(self) -> int:
        """Bytes held, as counted against ``max_bytes``."""
        return self._bytes

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._lru

    def _drop(self, response_id: str) -> None:
        entry = self._lru.pop(response_id)
        del self._by_age[response_id]
        self._bytes -= entry.size

    def _expire(self, now: float) -> None:
        while self._by_age:
            response_id, expires = next(iter(self._by_age.items()))
            if expires > now:
                return
            self._drop(response_id)

    def put(self, response_id: str, messages: tuple[Message, ...], *, now: float) -> bool:
        """Store a response's conversation, evicting what the caps demand.

        Returns:
            False when it is not stored: alone it exceeds ``max_bytes``, or it
            holds text that is not UTF-8 (a lone surrogate).
        """
        self._expire(now)
        if response_id in self._lru:
            self._drop(response_id)
        try:
            size = len(_encode(messages))
        except UnicodeEncodeError:  # a lone surrogate: it could not be sent to a backend either
            return False
        if size > self.max_bytes:
            return False
        while self._lru and (
            len(self._lru) >= self.max_entries or self._bytes + size > self.max_bytes
        ):
            self._drop(next(iter(self._lru)))
        self._lru[response_id] = _Entry(messages, size, now + self.ttl_s)
        self._by_age[response_id] = now + self.ttl_s
        self._bytes += size
        return True

    def get(self, response_id: str, *, now: float) -> tuple[Message, ...] | None:
        """The conversation a stored response ends, or None (unknown or expired)."""
        self._expire(now)
        entry = self._lru.get(response_id)
        if entry is None:
            return None
        self._lru.move_to_end(response_id)
        return entry.messages
