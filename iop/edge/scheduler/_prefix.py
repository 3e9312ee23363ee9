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
instances, within ``scheduler.prefix_index_bytes`` at ``ENTRY_BYTES`` an
entry, ``HOME_BYTES`` a home and ``REPLICA_BYTES`` a replica (measured:
``tests/edge/test_prefix.py``; without the homes, prompts of one block took
it to 1.8 times the cap). A node that leaves takes its entries and homes
along (``forget``).

What is cached, not what was routed: an engine's cache is far smaller than
the index, and every balance-rule fallback puts another copy of a prompt on
another instance, so without more the index keeps claiming prefixes the
engine evicted long ago and keeps sending their tenants there. A node's
load report carries each instance's cache size (``EngineLoad.cache_tokens``,
vLLM's ``vllm:cache_config_info``); the edge turns it into blocks of ours
(``scheduler.prefix_chars_per_token``) and ``bound`` keeps at most that many
per instance, least recently routed first: the engine's own eviction rule
(vLLM frees least recently used blocks first), so the index models it
(docs/operations.md, "What the caches hold"). Where the node reads the
engine's KV events, its count of the blocks held (``EngineLoad.cached_tokens``)
trims the index too (``trim``), less what was routed after it was taken.

How full each cache is with what matters (``fill``): a block routed to an
instance again while the index held it there is *reused* (a prefix that
prompts share); a block routed once is either a new prefix not yet proven
or a prompt's unique tail on its way out of the LRU. Placement weighs a
prompt's blocks that an instance does not hold by how full that
instance's cache is (``scheduler.room_weight``): a prefix that is nowhere
goes where it evicts the least that is reused, instead of to the least
loaded instance, whose full cache would evict another prefix that its
prompts come back for, a miss that begets the next one
(docs/benchmarks.md, "Prefix placement on a skewed workload, caches
reported"). And which copy a prompt uses: prompts that start alike have a
home (``home``), preferred over a copy made while it was busy
(``scheduler.home_weight``), that moves only when that evens the homes'
demand. And a prefix that keeps more of its home busy than one instance
carries without running full has more homes, replicas (``homes_wanted``,
``add_home``, ``drop_home``; ``scheduler.replica_load``): from its share
of the recent prompts and the runs in flight they found (``runs``), with
hysteresis (``scheduler.replica_drop``); placement chooses where, and
spreads the prefix's runs over its homes by load (``_placement.py``).
Sans-IO.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Final

import msgspec

from iop.config import SchedulerSettings
from iop.spec import ChatRequest, CompletionRequest, OperationRequest

__all__ = [
    "ENTRY_BYTES",
    "HOME_BYTES",
    "REPLICA_BYTES",
    "PrefixIndex",
    "cache_blocks",
    "prompt_blocks",
]

# What one remembered (instance, block) costs in the index: the OrderedDict's
# node and entry, the key tuple, a 16-byte digest. Measured with
# tracemalloc in tests/edge/test_prefix.py (about 230 bytes on CPython 3.11);
# rounded up so that the configured cap is never exceeded.
ENTRY_BYTES: Final = 256

# What one home costs (``home``): its entry in the homes' dict, the object,
# its demand and its list of instances; and a replica, its place in that
# list (the first grows it to four places: 56 to 64 bytes). Measured with
# tracemalloc in tests/edge/test_prefix.py (about 230 bytes a home on
# CPython 3.11), rounded up so that the configured cap is never exceeded.
HOME_BYTES: Final = 256
REPLICA_BYTES: Final = 96

_SEED: Final = b"iop-prefix"
# The tuning numbers' defaults are the config's (``[scheduler]``).
_DEFAULTS: Final = SchedulerSettings()
# Demands are kept in units that grow by the decay's factor a prompt; past
# this they are divided back down (every ~300,000 prompts at the default
# half-life), far from overflow.
_DEMAND_RESCALE: Final = 1e90
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


class _Home:
    """Where prompts that start with one block go (the first home, then its
    replicas), and their demand."""

    __slots__ = ("demand", "wheres")

    def __init__(self, where: _Where, demand: float) -> None:
        self.wheres = [where]
        self.demand = demand


class PrefixIndex:
    """(instance, block) -> None, least recently used first, within
    ``max_bytes`` with the homes, and per instance at most what its cache
    holds (``bound``)."""

    def __init__(
        self,
        max_bytes: int,
        recent_s: float = _DEFAULTS.load_stale_s,
        *,
        count_slack_s: float = _DEFAULTS.prefix_count_slack_s,
        demand_half_life: int = _DEFAULTS.prefix_demand_half_life,
        trim_share: float = _DEFAULTS.prefix_trim_share,
    ) -> None:
        self.max_bytes = max(0, max_bytes)
        self.max_entries = self.max_bytes // ENTRY_BYTES
        self._entries: OrderedDict[tuple[_Where, bytes], None] = OrderedDict()
        # The same entries per instance, in the same order: ``bound`` drops
        # an instance's oldest without a walk over every instance's. The
        # value: whether the block was routed there again while held (reused).
        self._by_where: dict[_Where, OrderedDict[bytes, bool]] = {}
        # Per instance, how many of its blocks are reused.
        self._reused: dict[_Where, int] = {}
        # Per instance, (when, how many) blocks new to it were routed in the
        # last ``recent_s``: an engine's count taken before may lack them.
        self.recent_s = recent_s
        self.count_slack_s = count_slack_s
        self.trim_share = trim_share
        self._added: dict[_Where, deque[tuple[float, int]]] = {}
        # A prompt's first block -> its homes and demand (``home``), while
        # one of them holds that block; per instance, its homes' demand
        # (a prefix's split evenly over its homes); how many replicas.
        self._homes: dict[bytes, _Home] = {}
        self._demand: dict[_Where, float] = {}
        self._replicas = 0
        # What one routed prompt adds to a demand now: it grows by
        # ``_growth`` a prompt, so every older addition weighs less in
        # proportion (an exponential decay without a walk over the homes).
        self._growth = 2 ** (1 / demand_half_life)
        self._unit = 1.0
        # Every prompt's, in the same units: their count, and the runs in
        # flight each found (``runs``: a prefix's share of the prompts
        # times the runs in flight, by Little's law its own runs).
        self._total = 0.0
        self._busy = 0.0
        self._bounds: dict[_Where, int] = {}
        self.evicted = 0

    @property
    def size_bytes(self) -> int:
        """What the index is charged: its entries, homes and replicas."""
        return (
            len(self._entries) * ENTRY_BYTES
            + len(self._homes) * HOME_BYTES
            + self._replicas * REPLICA_BYTES
        )

    @property
    def home_count(self) -> int:
        return len(self._homes)

    @property
    def replica_count(self) -> int:
        return self._replicas

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

    def routed(
        self, where: _Where, blocks: Sequence[bytes], now: float = 0.0, busy: float = 0.0
    ) -> None:
        """``blocks`` went to ``where`` at ``now``: they are its most recent.
        ``busy``: the runs in flight then, this one counted."""
        if self.max_entries == 0:
            return
        entries = self._entries
        held = self._by_where.setdefault(where, OrderedDict())
        reused = added = 0
        for block in blocks:
            key = (where, block)
            entries[key] = None
            entries.move_to_end(key)
            was = held.get(block)
            if was is None:
                added += 1
            elif not was:
                reused += 1
            held[block] = was is not None
            held.move_to_end(block)
        if reused:
            self._reused[where] = self._reused.get(where, 0) + reused
        if added:
            log = self._added.setdefault(where, deque())
            log.append((now, added))
            while log[0][0] < now - self.recent_s:
                log.popleft()
        self._trim(where, held)
        if blocks:
            self._settle(where, blocks[0], blocks[0] in held, busy)
        self._evict()

    def _evict(self) -> None:
        """The least recently routed entries go while the index is over its bytes."""
        entries = self._entries
        while entries and self.size_bytes > self.max_bytes:
            (w, block), _ = entries.popitem(last=False)
            self._drop(w, block, self._by_where[w].pop(block))

    def _settle(self, where: _Where, first: bytes, held: bool, busy: float) -> None:
        """A prompt that starts with ``first`` went to ``where``: count it
        to its home's demand, and home it there if it has no home yet, or,
        if ``where`` is none of its homes, move the busiest of them there
        when that brings the two instances' demand closer."""
        self._unit *= self._growth
        if self._unit > _DEMAND_RESCALE:
            self._rescale()
        unit = self._unit
        self._total += unit
        self._busy += unit * busy
        demand = self._demand
        home = self._homes.get(first)
        if home is None:
            if held:
                self._homes[first] = _Home(where, unit)
                demand[where] = demand.get(where, 0.0) + unit
            return
        home.demand += unit
        wheres = home.wheres
        for w in wheres:
            demand[w] = demand.get(w, 0.0) + unit / len(wheres)
        if held and where not in wheres:
            # Another instance took it (its homes were busy, or held less
            # of it): moving a demand d from A to B evens them iff A - B > d.
            # A replica's prompts are its home's, never a spill.
            at = max(range(len(wheres)), key=lambda i: demand.get(wheres[i], 0.0))
            part = home.demand / len(wheres)
            mine = demand.get(where, 0.0)
            if demand.get(wheres[at], 0.0) - mine > part:
                demand[wheres[at]] -= part
                demand[where] = mine + part
                wheres[at] = where

    def _rescale(self) -> None:
        for home in self._homes.values():
            home.demand /= self._unit
        for where in self._demand:
            self._demand[where] /= self._unit
        self._total /= self._unit
        self._busy /= self._unit
        self._unit = 1.0

    def _spread(self, home: _Home, sign: float) -> None:
        """Add (1) or take back (-1) ``home``'s demand on its instances."""
        part = sign * home.demand / len(home.wheres)
        for w in home.wheres:
            self._demand[w] = max(0.0, self._demand.get(w, 0.0) + part)

    def _drop(self, where: _Where, block: bytes, was_reused: bool) -> None:
        """``block`` left ``where``'s part of the index."""
        if was_reused:
            self._reused[where] -= 1
        self._unhome(where, block)
        self.evicted += 1

    def _unhome(self, where: _Where, block: bytes) -> None:
        """``where`` no longer holds ``block``: it is no home of it; and
        the home is gone when no instance left in it holds the block."""
        home = self._homes.get(block)
        if home is None or where not in home.wheres:
            return
        self._spread(home, -1)
        home.wheres.remove(where)
        if any(block in self._by_where.get(w, ()) for w in home.wheres):
            self._replicas -= 1
            self._spread(home, 1)
        else:
            del self._homes[block]
            self._replicas -= len(home.wheres)

    def homes(self, blocks: Sequence[bytes]) -> list[_Where]:
        """The homes of prompts that start with ``blocks``' first block:
        ``home``, then its replicas (``add_home``), oldest first."""
        home = self._homes.get(blocks[0]) if blocks else None
        return [] if home is None else list(home.wheres)

    def prompts(self, blocks: Sequence[bytes]) -> float:
        """The recent count of the prompts that start as ``blocks`` do,
        since they were homed (it halves every ``demand_half_life``)."""
        home = self._homes.get(blocks[0]) if blocks else None
        return 0.0 if home is None else home.demand / self._unit

    def runs(self, blocks: Sequence[bytes]) -> float:
        """How many runs the prompts that start as ``blocks`` do keep in
        flight: their share of the recent prompts times the runs in flight
        the recent prompts found (each weighed as in the demand)."""
        home = self._homes.get(blocks[0]) if blocks else None
        if home is None or self._total <= 0:
            return 0.0
        return home.demand * self._busy / (self._total * self._total)

    def homes_wanted(
        self,
        blocks: Sequence[bytes],
        slots: int,
        load: float,
        drop: float,
        min_prompts: int,
    ) -> int:
        """How many homes the prompts that start as ``blocks`` do want:
        one more than they have when their ``runs`` per home are more than
        ``load`` of a home's ``slots`` (and they were seen ``min_prompts``
        times, rounded); one fewer when, with one fewer, their runs per home
        would be below ``drop`` times that; 0: they have no home.
        """
        home = self._homes.get(blocks[0]) if blocks else None
        if home is None:
            return 0
        have = len(home.wheres)
        cap = load * slots
        if cap <= 0:
            return 1
        runs = self.runs(blocks)
        if have > 1 and runs / (have - 1) < cap * drop:
            return have - 1
        if runs / have > cap and self.prompts(blocks) >= min_prompts - 0.5:
            return have + 1
        return have

    def add_home(self, blocks: Sequence[bytes], where: _Where) -> bool:
        """``where`` is a home too (a replica) of the prompts that start as
        ``blocks`` do, which have a home; False: it already is, or they
        have none. It stays one while a home holds the first block."""
        home = self._homes.get(blocks[0]) if blocks else None
        if home is None or where in home.wheres:
            return False
        self._spread(home, -1)
        home.wheres.append(where)
        self._spread(home, 1)
        self._replicas += 1
        self._evict()
        return True

    def drop_home(self, blocks: Sequence[bytes]) -> _Where | None:
        """The newest replica of the prompts that start as ``blocks`` do is
        no home of theirs any more (its copy ages out of its cache unless
        prompts come back to it while the homes are busy): which, if any."""
        home = self._homes.get(blocks[0]) if blocks else None
        if home is None or len(home.wheres) < 2:
            return None
        self._spread(home, -1)
        where = home.wheres.pop()
        self._spread(home, 1)
        self._replicas -= 1
        return where

    def home(self, blocks: Sequence[bytes]) -> _Where | None:
        """The home of prompts that start with ``blocks``' first block.

        It is the instance the first such prompt went to, for as long as it
        holds that block (then the next one such a prompt goes to), unless a
        prompt went elsewhere (its home was busy) and moving the prompts'
        demand (their recent count) there evens the two instances' demand:
        then the home moves. Placement prefers the home among instances
        that hold as much of a prompt, so that a copy made elsewhere while
        the home was busy is not kept warm as a second home, and a home
        whose prompts keep it busy gives some of them away.
        """
        home = self._homes.get(blocks[0]) if blocks else None
        return None if home is None else home.wheres[0]

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

    def trim(self, where: _Where, max_blocks: int, taken_at: float, now: float) -> None:
        """``where``'s cache held ``max_blocks`` of our blocks when it last
        said (its KV events' count): its least recently routed beyond that
        are gone now; what is routed after may be more (unlike ``bound``).

        The count was taken at ``taken_at`` (before the report left, and a
        node sends one count again in each report until it reads the next):
        the blocks new to ``where`` routed after it, or up to
        ``count_slack_s`` before it, may not be in it, and are kept on top
        of it. Without them a cache still filling up (its
        count below its size) lost its oldest prefixes from the index at
        every report while the engine still held them. A count older than
        ``recent_s`` says nothing of what was routed since: it is ignored.

        And a count is a coarse signal: it trims only when it leaves at most
        ``trim_share`` (half) of what the index claims there (a reset, or other traffic that
        took the cache); within that the size bound (``bound``) models the
        engine's LRU. Trimmed at every report, the index still forgot
        prefixes that the engine held: 3.0-3.7 % misses against 2.0 % without
        the trim on the skewed workload (docs/benchmarks.md, "Prefix
        placement on a skewed workload, caches reported").
        """
        if taken_at < now - self.recent_s:
            return
        held = self._by_where.get(where)
        if held is None:
            return
        since = taken_at - self.count_slack_s
        later = sum(n for at, n in self._added.get(where, ()) if at > since)
        kept = max(0, max_blocks) + later
        if kept > self.trim_share * len(held):
            return
        self._trim(where, held, kept)

    def _trim(
        self, where: _Where, held: OrderedDict[bytes, bool], bound: int | None = None
    ) -> None:
        if bound is None:
            bound = self._bounds.get(where)
            if bound is None:
                return
        while len(held) > bound:
            block, was_reused = held.popitem(last=False)
            del self._entries[(where, block)]
            self._drop(where, block, was_reused)

    def fill(self, where: _Where) -> float | None:
        """How full ``where``'s cache is with blocks that matter, 0 to 1:
        its reused blocks count whole, the blocks routed there once half
        (a new prefix, or a unique tail that the LRU drops first), over its
        bound; None while its size is unknown."""
        bound = self._bounds.get(where)
        if bound is None:
            return None
        if bound == 0:
            return 1.0
        held = len(self._by_where.get(where, ()))
        return min(1.0, (held + self._reused.get(where, 0)) / (2 * bound))

    def held(self) -> list[tuple[_Where, int, int | None]]:
        """Per instance: the blocks claimed, and its bound (None: unbounded)."""
        wheres = self._by_where.keys() | self._bounds.keys()
        return [(w, len(self._by_where.get(w, ())), self._bounds.get(w)) for w in sorted(wheres)]

    def forget(self, node_id: str) -> None:
        """A node left: what its instances held is gone (a new link starts cold)."""
        for where in [w for w in self._by_where if w[0] == node_id]:
            for block in self._by_where.pop(where):
                del self._entries[(where, block)]
                self._unhome(where, block)
            self._reused.pop(where, None)
            self._demand.pop(where, None)
            self._added.pop(where, None)
        for where in [w for w in self._bounds if w[0] == node_id]:
            del self._bounds[where]
        # Replicas made there that never held their prefix go too.
        for home in self._homes.values():
            gone = [w for w in home.wheres if w[0] == node_id]
            if gone:
                self._spread(home, -1)
                home.wheres = [w for w in home.wheres if w[0] != node_id]
                self._replicas -= len(gone)
                self._spread(home, 1)
