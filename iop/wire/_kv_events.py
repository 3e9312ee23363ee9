"""vLLM's KV cache events, decoded, and what they say a cache holds (sans-IO).

vLLM started with ``--kv-events-config`` publishes every change of its
prefix cache (``vllm/distributed/kv_events.py``; the subscriber example,
https://docs.vllm.ai/en/stable/examples/online_serving/kv_events_subscriber/):
each message is a ``KVEventBatch``, msgpack-encoded by msgspec as an array
(``array_like``), whose events are arrays led by their class name (a
msgspec tag):

=====================  ==========================================================
event                  fields, in order
=====================  ==========================================================
``BlockStored``        block hashes, parent block hash (or nil), token ids,
                       block size, LoRA id (or nil), medium (or nil; newer)
``BlockRemoved``       block hashes, medium (or nil; newer)
``AllBlocksCleared``   (none)
=====================  ==========================================================

A batch is ``[ts, [events...], data_parallel_rank?]``. Block hashes are
integers or bytes depending on the version (``ExternalBlockHash``). vLLM
sends them over ZeroMQ PUB as ``(topic, sequence number, payload)``; the
sim (``iop/sim/_engine.py``) serves the same payloads over HTTP
(``GET /kv_events``), with their sequence numbers.

``CacheMirror`` applies decoded batches in sequence order and keeps what
placement needs: how many blocks the cache holds (stored less removed,
none after a clear), the block size, and how often it was cleared. It
keeps counts, not the hashes: the edge names blocks by rendered
characters, not by the engine's tokens, so the engine's hashes would name
nothing it could look up (docs/operations.md, "What the caches hold"). A gap in
the sequence numbers (events lost) is counted; the count goes on from the
next batch, clamped to 0 and never above the cache's size. A count of
more tokens than any cache holds (``MAX_CACHE_TOKENS``, a block size no
engine has) is no figure: the node's load report, which carries every
instance's figures in msgpack, must stay encodable whatever a server says.
"""

from __future__ import annotations

from typing import Final

import msgspec

from iop.wire._engine_load import MAX_CACHE_TOKENS

__all__ = [
    "MAX_KV_EVENTS_BYTES",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheMirror",
    "KVCacheEvent",
    "KVEventBatch",
    "decode_kv_events",
    "encode_kv_events",
]

# The largest events payload read at once: a batch names each block once
# (a 16-byte hash and 16 token ids, ~100 bytes), so 4 MiB is some 40,000
# blocks, more than a scrape interval of a busy engine stores.
MAX_KV_EVENTS_BYTES: Final = 4 * 1024 * 1024

_BlockHash = int | bytes


class _KVCacheEvent(msgspec.Struct, frozen=True, array_like=True, tag=True):
    pass


class BlockStored(_KVCacheEvent, frozen=True):
    """Blocks entered the prefix cache (a chain: each one's parent is the one before)."""

    block_hashes: list[_BlockHash]
    parent_block_hash: _BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(_KVCacheEvent, frozen=True):
    """Blocks left the prefix cache (evicted to make room, or freed)."""

    block_hashes: list[_BlockHash]
    medium: str | None = None


class AllBlocksCleared(_KVCacheEvent, frozen=True):
    """The whole prefix cache was reset (vLLM's ``/reset_prefix_cache``)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, frozen=True, array_like=True):
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


_DECODER: Final = msgspec.msgpack.Decoder(KVEventBatch)
_ENCODER: Final = msgspec.msgpack.Encoder()


def decode_kv_events(payload: bytes) -> KVEventBatch:
    """One published batch.

    Raises:
        ValueError: Not a batch of KV cache events (or over ``MAX_KV_EVENTS_BYTES``).
    """
    if len(payload) > MAX_KV_EVENTS_BYTES:
        raise ValueError(f"KV events payload of {len(payload)} bytes")
    try:
        return _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a KV event batch: {exc}") from exc


def encode_kv_events(batch: KVEventBatch) -> bytes:
    """A batch as vLLM publishes it (the sim's events endpoint)."""
    return _ENCODER.encode(batch)


class CacheMirror:
    """How much an engine's prefix cache holds, from its events in order.

    ``capacity_blocks`` (the engine's ``num_gpu_blocks``, when known) caps
    the count after each batch, so lost events cannot make it claim more
    than fits.
    """

    def __init__(self, capacity_blocks: int | None = None) -> None:
        self.capacity_blocks = capacity_blocks
        self.blocks = 0
        self.block_size = 0
        self.clears = 0
        self.gaps = 0
        self.last_seq = -1

    @property
    def tokens(self) -> int | None:
        """The tokens the cached blocks hold (None: no block size seen yet,
        or more than ``MAX_CACHE_TOKENS``: the events are not an engine's)."""
        if self.last_seq < 0 or (self.block_size <= 0 and self.blocks):
            return None
        tokens = self.blocks * self.block_size
        return tokens if tokens <= MAX_CACHE_TOKENS else None

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        """Batch ``seq`` (the publisher's sequence number); older ones are ignored."""
        if seq <= self.last_seq:
            return
        if self.last_seq >= 0 and seq != self.last_seq + 1:
            self.gaps += 1
        self.last_seq = seq
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.blocks += len(event.block_hashes)
                if event.block_size > 0:
                    self.block_size = event.block_size
            elif isinstance(event, BlockRemoved):
                self.blocks -= len(event.block_hashes)
            else:
                self.blocks = 0
                self.clears += 1
            self.blocks = max(0, self.blocks)
        # After the batch, not between its events: an insert into a full
        # cache may store its new blocks before it removes the oldest.
        if self.capacity_blocks is not None:
            self.blocks = min(self.blocks, self.capacity_blocks)
