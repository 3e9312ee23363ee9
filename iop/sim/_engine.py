"""The sim's engine model: a prefix (KV) cache, prefill time, a running batch.

So that routing by cache contents and engine load shows its effect on a
laptop, ``iop sim`` can model what makes a real engine's time to first
token and token rate move (every key is off by default, and the sim then
answers exactly as before):

* **a prefix cache** of ``kv_cache_blocks`` blocks of ``kv_block_tokens``
  tokens. A prompt is tokenized (the sim's toy tokenizer, on the rendered
  chat) and cut into full blocks; each block is named by a hash chained over
  the blocks before it, as vLLM's automatic prefix caching does
  (https://docs.vllm.ai/en/stable/design/prefix_caching.html), so a block
  is a hit only when the whole prefix up to it is the same. The leading run
  of cached blocks is the request's cached prefix; every full block of the
  prompt is then inserted (least recently used blocks go first when the
  cache is full). A request's ``cache_salt`` seeds the chain, as vLLM hashes
  it into the first block: requests of different salts (or one salted and
  one not) share no block;
* **prefill time**: the first token comes ``ttft_s`` plus the *uncached*
  prompt tokens over ``prefill_tokens_per_s`` after the request starts
  running;
* **a running batch** of at most ``max_num_seqs`` requests; the rest wait
  (``num_requests_waiting``) in arrival order, or, with
  ``scheduling_policy = "priority"``, by the request's ``priority`` (lower
  first) then arrival, and a request better than the worst running one
  preempts it when the batch is full (below);
* **decode slowed by concurrency**: each token's delay is stretched by
  ``1 + decode_slowdown * (running - 1)``.

What the engine shows a scraper is what vLLM's ``/metrics`` shows
(https://docs.vllm.ai/en/stable/usage/metrics/): ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (blocks the
running requests hold, over the cache's blocks: 0 to 1; a prefix that
several running requests share counts once, as vLLM's block pool shares
it), ``vllm:cache_config_info`` (the cache's shape: ``num_gpu_blocks`` and
``block_size`` labels, as vLLM publishes them), and the counters
``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits`` in tokens. The
response's usage says how many prompt tokens were cached
(``prompt_tokens_details.cached_tokens``, as vLLM with
``--enable-prompt-tokens-details``).

**The priority policy** models vLLM's ``--scheduling-policy priority``
(docs/operations.md, "Engine priority", has the facts and their sources):
each request carries an integer ``priority`` (lower is handled earlier,
default 0); waiting requests are served by (priority, arrival). When a
request arrives to a full batch and a running one is worse by (priority,
arrival), the worst running request (the latest arrival among ties) is
preempted: it stops producing tokens, goes back to waiting, and, seated
again, pays its first token's time again (ttft and prefill: vLLM's
*recompute* mode drops its KV blocks) and the token it was producing,
then goes on where it stopped. A streamed request just pauses; its client
sees a gap, no error. (vLLM's V0 scheduler preempted so for a waiting
request that did not fit the batch's budget, ``max_num_seqs`` included;
its V1 scheduler preempts the worst running request when the KV cache has
no room, and a full ``max_num_seqs`` batch makes a better request wait:
the sim's ``max_num_seqs`` stands for whichever limit the engine reaches.)

Sans-IO but for ``Engine.seat`` and ``Engine.work``, which wait for a place
in the batch and for engine time.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import trio

from iop.config import SimConfig
from iop.wire._kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    encode_kv_events,
)

__all__ = [
    "KV_EVENTS_ANSWER_BYTES",
    "KV_EVENT_BATCHES_KEPT",
    "Admission",
    "Engine",
    "PrefixCache",
    "Seat",
    "block_hashes",
]

_HASH_SEED: Final = b"iop-sim-prefix"
# Event batches kept for readers (one per request the engine admits, one per
# clear): a node reads them every second, so 4096 outlast seconds of a busy
# sim; a reader that fell further behind sees a gap in the numbers.
KV_EVENT_BATCHES_KEPT: Final = 4096
# The payloads of one answer of events_after: a batch carries its new
# blocks' token ids (a 2k-token prompt's are about 20 KB), and a node
# refuses a page past its load_scrape_max_bytes (1 MiB by default), after
# which it read no figure of the engine at all; half of that leaves room
# for the answer's framing.
KV_EVENTS_ANSWER_BYTES: Final = 512 * 1024


def block_hashes(token_ids: Sequence[int], block_tokens: int, salt: str = "") -> list[bytes]:
    """The chained hash of each full block of ``token_ids``: block i's hash
    covers every token before its end (and ``salt``), so equal hashes mean
    equal prefixes of equal salts."""
    out: list[bytes] = []
    parent = _HASH_SEED + salt.encode()
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        h = hashlib.blake2b(parent, digest_size=16)
        # The toy tokenizer's ids are the pieces' bytes: up to 8 of them.
        h.update(b"".join(t.to_bytes(8, "little") for t in token_ids[start : start + block_tokens]))
        parent = h.digest()
        out.append(parent)
    return out


class PrefixCache:
    """An LRU set of block hashes with room for ``capacity`` blocks.

    Every change is also published as vLLM publishes its KV cache events
    (``iop.wire._kv_events``): one batch per insert or clear, numbered from
    0, the last ``KV_EVENT_BATCHES_KEPT`` of them kept for ``events_after``
    (the HTTP page and the ZeroMQ publisher, ``iop.sim._kv_publisher``).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self._journal: deque[tuple[int, bytes]] = deque(maxlen=KV_EVENT_BATCHES_KEPT)
        self._next_seq = 0
        # Called after each batch is journaled (the ZeroMQ publisher waits on it).
        self.on_publish: Callable[[], None] | None = None

    @property
    def kept(self) -> int:
        """How many published batches the journal keeps."""
        return KV_EVENT_BATCHES_KEPT

    def __len__(self) -> int:
        return len(self._blocks)

    def cached_blocks(self, hashes: Sequence[bytes]) -> int:
        """How many of ``hashes``, from the first, are cached (the prefix hit)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(
        self, hashes: Sequence[bytes], token_ids: Sequence[int] = (), block_tokens: int = 0
    ) -> None:
        """Cache ``hashes`` as most recently used, evicting the least recently used.

        ``token_ids`` (the prompt's) and ``block_tokens`` go into the
        published ``BlockStored`` events, as vLLM's carry them.
        """
        if self.capacity <= 0:
            return
        stored: list[int] = []  # indices into hashes of the blocks new to the cache
        for i, h in enumerate(hashes):
            if h not in self._blocks:
                stored.append(i)
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        removed: list[bytes] = []
        while len(self._blocks) > self.capacity:
            removed.append(self._blocks.popitem(last=False)[0])
        events: list[KVCacheEvent] = []
        # One BlockStored per run of consecutive new blocks: an event is a
        # chain, each block's parent the one before it (as vLLM's are).
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, end = run[0], run[-1] + 1
            events.append(
                BlockStored(
                    block_hashes=[hashes[i] for i in run],
                    parent_block_hash=hashes[first - 1] if first > 0 else None,
                    token_ids=list(token_ids[first * block_tokens : end * block_tokens]),
                    block_size=block_tokens,
                    medium=MEDIUM_GPU,
                )
            )
        if removed:
            events.append(BlockRemoved(block_hashes=list(removed), medium=MEDIUM_GPU))
        self._publish(events)

    def clear(self) -> None:
        """Drop every block (vLLM's ``/reset_prefix_cache``)."""
        self._blocks.clear()
        self._publish([AllBlocksCleared()])

    def _publish(self, events: list[KVCacheEvent]) -> None:
        if events:
            # vLLM's publisher stamps its data parallel rank (0 without DP).
            batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)
            self._journal.append((self._next_seq, encode_kv_events(batch)))
            self._next_seq += 1
            if self.on_publish is not None:
                self.on_publish()

    def events_after(
        self, seq: int, limit: int, max_bytes: int = KV_EVENTS_ANSWER_BYTES
    ) -> list[tuple[int, bytes]]:
        """At most ``limit`` published batches numbered above ``seq``, oldest
        first (a gap in the numbers: older ones were dropped), of at most
        ``max_bytes`` together but at least one."""
        out: list[tuple[int, bytes]] = []
        size = 0
        for n, payload in self._journal:
            if n <= seq:
                continue
            size += len(payload)
            if len(out) >= limit or (out and size > max_bytes):
                break
            out.append((n, payload))
        return out


@dataclass(frozen=True)
class Admission:
    """What the engine decided for one request at its arrival."""

    prompt_tokens: int
    cached_tokens: int
    prefill_s: float
    blocks: int  # the request's footprint in the cache while it runs
    # The prompt's full blocks, shared with every running request of the
    # same prefix (``blocks`` counts them too; the rest are its own).
    shared: tuple[bytes, ...] = ()


@dataclass(eq=False)
class Seat:
    """One request's place in the engine: running, or waiting (first, or
    again after a preemption)."""

    priority: int
    arrival: int
    admission: Admission
    # What a preemption costs on resume: the first token's time again.
    recompute_s: float = 0.0
    running: bool = False
    preemptions: int = 0
    # Set (and replaced) whenever ``running`` flips.
    changed: trio.Event = field(default_factory=trio.Event)

    @property
    def order(self) -> tuple[int, int]:
        """Lower is served first (vLLM's (priority, arrival_time))."""
        return (self.priority, self.arrival)

    def _flip(self, running: bool) -> None:
        self.running = running
        done, self.changed = self.changed, trio.Event()
        done.set()


@dataclass
class Engine:
    """The sim server's one engine: its cache, its batch and its counters."""

    config: SimConfig
    cache: PrefixCache = field(init=False)
    running: int = 0
    waiting: int = 0
    # Blocks held by running requests that no other holds (their partial
    # prompt block and their output), and how many running requests hold
    # each shared prompt block: vLLM keeps one copy of a prefix's blocks
    # however many requests run on it (held_blocks).
    _own_blocks: int = 0
    _shared_blocks: Counter[bytes] = field(default_factory=Counter)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0  # vLLM's vllm:num_preemptions
    _batch: dict[Seat, None] = field(default_factory=dict)
    _queue: list[Seat] = field(default_factory=list)
    _arrivals: int = 0

    def __post_init__(self) -> None:
        self.cache = PrefixCache(self.config.kv_cache_blocks)

    @property
    def enabled(self) -> bool:
        """Whether any of the engine's keys is set (else requests bypass it)."""
        c = self.config
        return bool(
            c.kv_cache_blocks
            or c.prefill_tokens_per_s
            or c.max_num_seqs
            or c.decode_slowdown
            or c.scheduling_policy != "fcfs"
        )

    def admit(self, prompt_ids: Sequence[int], request_cfg: SimConfig, salt: str = "") -> Admission:
        """Look the prompt up in the cache, then cache its blocks.

        ``request_cfg`` (the server's config with the request's overrides)
        gives the prefill rate; the cache's shape is the server's. ``salt``:
        the request's ``cache_salt`` (empty: none).
        """
        block = max(1, self.config.kv_block_tokens)
        hashes = block_hashes(prompt_ids, block, salt)
        cached = self.cache.cached_blocks(hashes) * block if self.config.kv_cache_blocks else 0
        self.cache.insert(hashes, prompt_ids, block)
        total = len(prompt_ids)
        self.prefix_cache_queries += total
        self.prefix_cache_hits += cached
        rate = request_cfg.prefill_tokens_per_s
        prefill = (total - cached) / rate if rate > 0 else 0.0
        output = request_cfg.output_tokens + request_cfg.reasoning_tokens
        return Admission(
            prompt_tokens=total,
            cached_tokens=cached,
            prefill_s=prefill,
            blocks=math.ceil((total + output) / block),
            shared=tuple(hashes) if self.config.kv_cache_blocks else (),
        )

    @contextlib.asynccontextmanager
    async def seat(
        self, admission: Admission, *, priority: int = 0, recompute_s: float = 0.0
    ) -> AsyncIterator[Seat]:
        """A place in the engine for the request's lifetime: it is yielded
        once running (it waits while the batch is full); it may be preempted
        and seated again meanwhile (``Seat.running``; ``work``)."""
        seat = Seat(priority, self._arrivals, admission, recompute_s)
        self._arrivals += 1
        try:
            if (self._has_room() and not self._queue) or self._preempts(seat):
                self._start(seat)
            else:
                self._wait(seat)
                while not seat.running:
                    await seat.changed.wait()
            yield seat
        finally:
            if seat.running:
                self._stop(seat)
            elif seat in self._queue:
                self._queue.remove(seat)
                self.waiting -= 1
            self._fill()

    async def work(self, seat: Seat, delay_s: float) -> None:
        """Spend ``delay_s`` of engine time on ``seat``'s request: wait
        while it is preempted; a preemption costs the work in progress and,
        on resume, ``recompute_s`` (module docstring)."""
        todo = delay_s
        while True:
            while not seat.running:
                await seat.changed.wait()
            changed = seat.changed
            with trio.move_on_after(todo) as done:
                await changed.wait()
            if done.cancelled_caught:
                return
            todo = seat.recompute_s + delay_s  # preempted: its KV blocks are gone

    def _has_room(self) -> bool:
        limit = self.config.max_num_seqs
        return limit <= 0 or len(self._batch) < limit

    def _preempts(self, seat: Seat) -> bool:
        """With the priority policy, preempt the worst running request (by
        priority, then the latest arrival) for ``seat`` if it is better and
        comes before every waiting one; whether it did."""
        if self.config.scheduling_policy != "priority" or not self._batch:
            return False
        if self._queue and min(w.order for w in self._queue) < seat.order:
            return False
        victim = max(self._batch, key=lambda s: s.order)
        if victim.order <= seat.order:
            return False
        self._stop(victim)
        victim.preemptions += 1
        self.preemptions += 1
        self._wait(victim)
        return True

    def _wait(self, seat: Seat) -> None:
        self._queue.append(seat)
        self.waiting += 1

    def _start(self, seat: Seat) -> None:
        self._batch[seat] = None
        self.running += 1
        admission = seat.admission
        self._own_blocks += admission.blocks - len(admission.shared)
        self._shared_blocks.update(admission.shared)
        seat._flip(True)

    def _stop(self, seat: Seat) -> None:
        del self._batch[seat]
        self.running -= 1
        admission = seat.admission
        self._own_blocks -= admission.blocks - len(admission.shared)
        self._shared_blocks.subtract(admission.shared)
        for h in admission.shared:
            if self._shared_blocks[h] <= 0:
                del self._shared_blocks[h]
        seat._flip(False)

    def _fill(self) -> None:
        """Seat waiting requests while the batch has room: by arrival, or
        with the priority policy by (priority, arrival)."""
        while self._queue and self._has_room():
            if self.config.scheduling_policy == "priority":
                nxt = min(self._queue, key=lambda s: s.order)
                self._queue.remove(nxt)
            else:
                nxt = self._queue.pop(0)
            self.waiting -= 1
            self._start(nxt)

    def decode_factor(self, request_cfg: SimConfig) -> float:
        """How much the running batch stretches each token's delay now."""
        return 1.0 + request_cfg.decode_slowdown * max(0, self.running - 1)

    @property
    def held_blocks(self) -> int:
        """Blocks the running requests hold, a shared prefix's once (the
        numerator of ``kv_cache_usage_perc``, as vLLM counts it)."""
        return self._own_blocks + len(self._shared_blocks)

    @property
    def kv_cache_usage(self) -> float:
        """Blocks the running requests hold over the cache's blocks (0 to 1)."""
        if self.config.kv_cache_blocks <= 0:
            return 0.0
        return min(1.0, self.held_blocks / self.config.kv_cache_blocks)

    def metrics(self, model: str) -> bytes:
        """The engine's gauges and counters in Prometheus' text format, as vLLM names them."""
        label = '{model_name="' + model.replace("\\", "\\\\").replace('"', '\\"') + '"}'
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{label} {float(self.running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{label} {float(self.waiting)}",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{label} {self.kv_cache_usage}",
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of tokens.",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{label} {float(self.prefix_cache_queries)}",
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of tokens.",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{label} {float(self.prefix_cache_hits)}",
            "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{label} {float(self.preemptions)}",
        ]
        if self.config.kv_cache_blocks > 0:
            # vLLM's info gauge of its cache config: the shape is in the labels.
            info = (
                f'{{block_size="{max(1, self.config.kv_block_tokens)}",'
                f'enable_prefix_caching="True",'
                f'num_gpu_blocks="{self.config.kv_cache_blocks}"}}'
            )
            lines += [
                "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                "# TYPE vllm:cache_config_info gauge",
                f"vllm:cache_config_info{info} 1.0",
            ]
        return ("\n".join(lines) + "\n").encode()
