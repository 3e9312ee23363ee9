"""Prefix-aware placement: what each instance's prefix cache probably holds.

The edge cannot see a backend's KV cache, but it knows every prompt it sent
where. ``PrefixIndex`` remembers, per instance, the blocks of the prompts it
routed there, and a new prompt's expected cache hit on an instance is the
run of its leading blocks that instance saw: the approximate prefix tree of
SGLang's cache-aware router, kept as chained block hashes the way vLLM's
automatic prefix caching names KV blocks
(https://docs.vllm.ai/en/stable/design/prefix_caching.html), so that a block
matches only when everything before it matches too.

A prompt's blocks (``prompt_blocks``) are cut from its rendered messages
(role and text, tool calls and tool schemas first), ``scheduler.prefix_block_chars``
characters each (about a quarter as many tokens), with no tokenizer: an
approximation of the backend's blocks, which is all placement needs.

Per tenant: a prompt's blocks are seeded with its run's cache scope (the
run's ``cache_salt``, ``iop.edge.tenancy._tenants``), as vLLM seeds a salted
prompt's first block, so one tenant's prompt never matches what another
tenant's identical prompt left on an instance: placement cannot draw a
tenant's guess to the instance that holds another's prompt
(docs/operations.md, "Tenants and limits", "Prefix caches").

Bounded (production-stack #687: a prefix tree without a bound took its router
down): one least-recently-used map of (instance, block) across all
instances, at most ``scheduler.prefix_index_bytes`` over ``ENTRY_BYTES``
entries (measured: ``tests/edge/test_prefix.py``). A node that leaves takes
its entries along (``forget``).

What is cached, not what was routed: an engine's cache is far smaller than
the index, and every balance-rule fallback puts another copy of a prompt on
another instance, so without more the index keeps claiming prefixes the
engine evicted long ago and keeps sending their tenants there. A node's
load report carries each instance's cache size (``EngineLoad.cache_tokens``,
vLLM's ``vllm:cache_config_info``); the edge turns it into blocks of ours
(``scheduler.prefix_chars_per_token``) and ``bound`` keeps at most that many
per instance, least recently routed first: the engine's own eviction rule
(vLLM frees least recently used blocks first), so the index models it
(docs/operations.md, "What the caches hold"). Sans-IO.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

import msgspec

from iop.spec import ChatRequest, CompletionRequest, OperationRequest

__all__ = ["ENTRY_BYTES", "PrefixIndex", "cache_blocks", "prompt_blocks"]

# What one remembered (instance, block) costs in the index: the OrderedDict's
# node and entry, the key tuple, a 16-byte digest. Measured with
# tracemalloc in tests/edge/test_prefix.py (about 230 bytes on CPython 3.11);
# rounded up so that the configured cap is never exceeded.
ENTRY_BYTES: Final = 256

_SEED: Final = b"iop-prefix"
_Where = tuple[str, str]  # (node id, instance name)


def _rendered(request: OperationRequest) -> bytes | None:
    """What a backend's chat template would start from, in order; None: no prompt."""
    if isinstance(request, ChatRequest):
        parts: list[object] = [request.model]
        if request.tools:
            parts.append(request.tools)  # templates put tool schemas first
        for m in request.messages:
            parts.append([m.role, m.text(), m.tool_calls or []])
        return msgspec.json.encode(parts)
    if isinstance(request, CompletionRequest):
        return msgspec.json.encode([request.model, request.prompt])
    return None


def prompt_blocks(request: OperationRequest, block_chars: int, scope: str = "") -> list[bytes]:
    """The chained hashes of the full ``block_chars`` blocks of ``request``'s prompt.

    The JSON of the rendered messages grows at the end as a conversation
    does, so two turns of one conversation share their leading blocks.
    ``scope`` (the run's cache salt) seeds the chain: prompts of different
    scopes share no block; the empty scope is the shared cache.
    """
    text = _rendered(request)
    if text is None:
        return []
    out: list[bytes] = []
    parent = _SEED + scope.encode()
    for start in range(0, len(text) - block_chars + 1, block_chars):
        parent = hashlib.blake2b(
            parent + text[start : start + block_chars], digest_size=16
        ).digest()
        out.append(parent)
    return out


def cache_blocks(cache_tokens: int, block_chars: int, chars_per_token: float) -> int:
    """How many of our ``block_chars`` blocks an engine cache of
    ``cache_tokens`` tokens holds (``scheduler.prefix_chars_per_token``)."""
    return max(0, int(cache_tokens * chars_per_token) // block_chars)


class PrefixIndex:
    """(instance, block) -> None, least recently used first, at most ``max_entries``,
    and per instance at most what its cache holds (``bound``)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_entries = max(0, max_bytes // ENTRY_BYTES)
        self._entries: OrderedDict[tuple[_Where, bytes], None] = OrderedDict()
        # The same entries per instance, in the same order: ``bound`` drops
        # an instance's oldest without a walk over every instance's.
        self._by_where: dict[_Where, OrderedDict[bytes, None]] = {}
        self._bounds: dict[_Where, int] = {}
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def matched(self, where: _Where, blocks: Sequence[bytes]) -> int:
        """How many of ``blocks``, from the first, ``where`` has seen."""
        held = self._by_where.get(where)
        if not held:
            return 0
        n = 0
        for block in blocks:
            if block not in held:
                break
            n += 1
        return n

    def routed(self, where: _Where, blocks: Sequence[bytes]) -> None:
        """``blocks`` went to ``where``: they are its most recent."""
        if self.max_entries == 0:
            return
        entries = self._entries
        held = self._by_where.setdefault(where, OrderedDict())
        for block in blocks:
            key = (where, block)
            entries[key] = None
            entries.move_to_end(key)
            held[block] = None
            held.move_to_end(block)
        self._trim(where, held)
        while len(entries) > self.max_entries:
            (w, block), _ = entries.popitem(last=False)
            del self._by_where[w][block]
            self.evicted += 1

    def bound(self, where: _Where, max_blocks: int) -> None:
        """``where``'s cache holds at most ``max_blocks`` of our blocks (its
        reported size): its least recently routed beyond that are gone.

        The engine evicts least recently used blocks too, and an LRU cache
        fed the same prompts holds a superset of a smaller one's, so within
        the bound the index claims only what the engine still holds
        (``tests/edge/test_prefix.py``).
        """
        self._bounds[where] = max(0, max_blocks)
        held = self._by_where.get(where)
        if held is not None:
            self._trim(where, held)

    def trim(self, where: _Where, max_blocks: int) -> None:
        """``where``'s cache held ``max_blocks`` of our blocks when it last
        said (its KV events' count): its least recently routed beyond that
        are gone now; what is routed after may be more (unlike ``bound``)."""
        held = self._by_where.get(where)
        if held is not None:
            self._trim(where, held, max(0, max_blocks))

    def _trim(
        self, where: _Where, held: OrderedDict[bytes, None], bound: int | None = None
    ) -> None:
        if bound is None:
            bound = self._bounds.get(where)
            if bound is None:
                return
        while len(held) > bound:
            block, _ = held.popitem(last=False)
            del self._entries[(where, block)]
            self.evicted += 1

    def held(self) -> list[tuple[_Where, int, int | None]]:
        """Per instance: the blocks claimed, and its bound (None: unbounded)."""
        wheres = self._by_where.keys() | self._bounds.keys()
        return [(w, len(self._by_where.get(w, ())), self._bounds.get(w)) for w in sorted(wheres)]

    def forget(self, node_id: str) -> None:
        """A node left: what its instances held is gone (a new link starts cold)."""
        for where in [w for w in self._by_where if w[0] == node_id]:
            for block in self._by_where.pop(where):
                del self._entries[(where, block)]
        for where in [w for w in self._bounds if w[0] == node_id]:
            del self._bounds[where]
