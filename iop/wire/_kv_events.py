"""vLLM's KV cache events, decoded, and what they say a cache holds (sans-IO).

vLLM started with ``--kv-events-config`` publishes every change of its
prefix cache (``vllm/distributed/kv_events.py``; docs/protocol.md, "vLLM's
KV cache events", has the versions and their URLs). Each ZeroMQ message is
three frames: the topic, the batch's sequence number (8 bytes, big-endian),
and a ``KVEventBatch`` encoded by msgspec's msgpack encoder:

=====================  ==========================================================
event                  fields (``type`` tags a map; the first item an array)
=====================  ==========================================================
``BlockStored``        block hashes, parent block hash (or nil), token ids,
                       block size, LoRA id, medium, LoRA name, extra keys,
                       group index, cache spec kind, sliding window
``BlockRemoved``       block hashes, medium, group index
``AllBlocksCleared``   (none)
=====================  ==========================================================

Two shapes are on the wire, and ``decode_kv_events`` reads both, each
struct on its own (a batch of one shape may carry events of the other):
until https://github.com/vllm-project/vllm/pull/42892 every struct was a
positional array (``array_like``) whose trailing fields were added one
release at a time; since, events are maps tagged by ``"type"``, and fields a
decoder does not know are skipped. Block hashes are integers or bytes
(``ExternalBlockHash``). ``encode_kv_events`` writes what vLLM's source
writes today (maps), byte for byte; the sim publishes with it.

``parse_live_frames`` and ``parse_replay_frames`` read the frames of the
PUB socket and of the ROUTER replay socket.

``CacheMirror`` applies decoded batches in sequence order and keeps what
placement needs: how many blocks the cache holds (stored less removed,
none after a clear), the block size, and how often it was cleared. It
counts the GPU's blocks only (``medium`` nil or ``"GPU"``): a KV connector
that offloads to CPU publishes its own blocks, which the engine's prefix
cache does not hold. It keeps counts, not the hashes: the edge names blocks
by rendered characters, not by the engine's tokens, so the engine's hashes
would name nothing it could look up (docs/operations.md, "What the caches
hold"). When events are lost (a gap in the numbers, a batch that cannot be
read, a publisher that started again) the count starts over from 0: an
undercount only makes the edge forget blocks early, where a count carried
on from a wrong base could make it claim blocks the engine dropped. The
count is clamped to 0 and never above the cache's size. A count of more
tokens than any cache holds (``MAX_CACHE_TOKENS``, a block size no engine
has) is no figure: the node's load report, which carries every instance's
figures in msgpack, must stay encodable whatever a server says.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import msgspec

from iop.wire._engine_load import MAX_CACHE_TOKENS

__all__ = [
    "MAX_KV_EVENTS_BYTES",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheMirror",
    "KVCacheEvent",
    "KVEventBatch",
    "decode_kv_events",
    "encode_kv_events",
    "parse_live_frames",
    "parse_replay_frames",
]

# The largest events payload read at once: a batch names each block once
# (a 32-byte hash and 16 token ids, ~100 bytes), so 4 MiB is some 40,000
# blocks, more than a scrape interval of a busy engine stores.
MAX_KV_EVENTS_BYTES: Final = 4 * 1024 * 1024

# vLLM's MEDIUM_GPU: the blocks of the engine's own prefix cache.
MEDIUM_GPU: Final = "GPU"

_BlockHash = int | bytes


# --- the events, as the rest of IOP sees them ---------------------------------------


class BlockStored(msgspec.Struct, frozen=True):
    """Blocks entered the prefix cache (a chain: each one's parent is the one before)."""

    block_hashes: list[_BlockHash]
    parent_block_hash: _BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, frozen=True):
    """Blocks left the prefix cache (evicted to make room, or freed)."""

    block_hashes: list[_BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True):
    """The whole prefix cache was reset (vLLM's ``/reset_prefix_cache``)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, frozen=True):
    """One published batch: when, what, and from which data parallel rank."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


# --- decoding: positional arrays (before vLLM's PR 42892) ----------------------------


class _ArrayStored(msgspec.Struct, frozen=True, array_like=True, tag="BlockStored"):
    # The fields in the order they were added; a release sends a prefix.
    block_hashes: list[_BlockHash]
    parent_block_hash: _BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Any = None
    group_idx: int | None = None


class _ArrayRemoved(msgspec.Struct, frozen=True, array_like=True, tag="BlockRemoved"):
    block_hashes: list[_BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class _ArrayCleared(msgspec.Struct, frozen=True, array_like=True, tag="AllBlocksCleared"):
    pass


class _ArrayBatch(msgspec.Struct, frozen=True, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


# --- decoding: maps (since) ----------------------------------------------------------


class _MapStored(msgspec.Struct, frozen=True, tag="BlockStored"):
    block_hashes: list[_BlockHash]
    parent_block_hash: _BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    group_idx: int | None = None


class _MapRemoved(msgspec.Struct, frozen=True, tag="BlockRemoved"):
    block_hashes: list[_BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class _MapCleared(msgspec.Struct, frozen=True, tag="AllBlocksCleared"):
    pass


class _MapBatch(msgspec.Struct, frozen=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


# --- encoding: vLLM's structs today (vllm/distributed/kv_events.py at 0181ea3) -------


class _OutStored(msgspec.Struct, omit_defaults=True, tag="BlockStored"):
    block_hashes: list[_BlockHash]
    parent_block_hash: _BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _OutRemoved(msgspec.Struct, omit_defaults=True, tag="BlockRemoved"):
    block_hashes: list[_BlockHash]
    medium: str | None
    group_idx: int | None = None


class _OutCleared(msgspec.Struct, omit_defaults=True, tag="AllBlocksCleared"):
    pass


class _OutBatch(msgspec.Struct, omit_defaults=True):
    ts: float
    events: list[_OutStored | _OutRemoved | _OutCleared]
    data_parallel_rank: int | None = None


_ARRAY_BATCH: Final = msgspec.msgpack.Decoder(_ArrayBatch)
_MAP_BATCH: Final = msgspec.msgpack.Decoder(_MapBatch)
_ARRAY_EVENT: Final = msgspec.msgpack.Decoder(_ArrayStored | _ArrayRemoved | _ArrayCleared)
_MAP_EVENT: Final = msgspec.msgpack.Decoder(_MapStored | _MapRemoved | _MapCleared)
_ENCODER: Final = msgspec.msgpack.Encoder()


def _is_array(first: int) -> bool:
    # msgpack's fixarray (0x90-0x9f), array 16 (0xdc) and array 32 (0xdd).
    return 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)


def _is_map(first: int) -> bool:
    # msgpack's fixmap (0x80-0x8f), map 16 (0xde) and map 32 (0xdf).
    return 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)


def _decode_event(raw: msgspec.Raw) -> KVCacheEvent:
    data = memoryview(raw)
    if not data:
        raise msgspec.DecodeError("an empty event")
    if _is_array(data[0]):
        event: Any = _ARRAY_EVENT.decode(data)
    elif _is_map(data[0]):
        event = _MAP_EVENT.decode(data)
    else:
        raise msgspec.DecodeError("an event is neither an array nor a map")
    if isinstance(event, _ArrayStored | _MapStored):
        return BlockStored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            group_idx=event.group_idx,
        )
    if isinstance(event, _ArrayRemoved | _MapRemoved):
        return BlockRemoved(
            block_hashes=event.block_hashes, medium=event.medium, group_idx=event.group_idx
        )
    return AllBlocksCleared()


def decode_kv_events(payload: bytes, max_bytes: int = MAX_KV_EVENTS_BYTES) -> KVEventBatch:
    """One published batch, in either shape (module docstring).

    Raises:
        ValueError: Not a batch of KV cache events (or over ``max_bytes``).
    """
    if len(payload) > max_bytes:
        raise ValueError(f"KV events payload of {len(payload)} bytes")
    try:
        if payload and _is_array(payload[0]):
            batch: _ArrayBatch | _MapBatch = _ARRAY_BATCH.decode(payload)
        elif payload and _is_map(payload[0]):
            batch = _MAP_BATCH.decode(payload)
        else:
            raise msgspec.DecodeError("neither an array nor a map")
        events = [_decode_event(raw) for raw in batch.events]
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a KV event batch: {exc}") from exc
    return KVEventBatch(ts=batch.ts, events=events, data_parallel_rank=batch.data_parallel_rank)


def _out(event: KVCacheEvent) -> _OutStored | _OutRemoved | _OutCleared:
    if isinstance(event, BlockStored):
        return _OutStored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=None,
            group_idx=event.group_idx,
        )
    if isinstance(event, BlockRemoved):
        return _OutRemoved(
            block_hashes=event.block_hashes, medium=event.medium, group_idx=event.group_idx
        )
    return _OutCleared()


def encode_kv_events(batch: KVEventBatch) -> bytes:
    """A batch as vLLM's source encodes it today (maps; the sim's publisher)."""
    return _ENCODER.encode(
        _OutBatch(
            ts=batch.ts,
            events=[_out(e) for e in batch.events],
            data_parallel_rank=batch.data_parallel_rank,
        )
    )


# --- frames ---------------------------------------------------------------------------

# The replay socket's "no more" marker: sequence number -1 (vLLM's END_SEQ).
_END_SEQ: Final = -1


def _seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"a sequence number of {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big")


def parse_live_frames(frames: Sequence[bytes], topic: bytes) -> tuple[int, bytes]:
    """A PUB message, ``[topic, seq, payload]``: its number and payload.

    ZeroMQ subscriptions match a prefix of the topic frame, so the topic is
    checked whole here.

    Raises:
        ValueError: Not three frames, another topic, or a sequence number
            that is not 8 bytes.
    """
    if len(frames) != 3:
        raise ValueError(f"a message of {len(frames)} frames, not 3")
    if frames[0] != topic:
        raise ValueError(f"topic {bytes(frames[0][:64])!r}, not {topic!r}")
    return _seq(frames[1]), frames[2]


def parse_replay_frames(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """A ROUTER replay answer as a DEALER reads it: ``["", seq, payload]``
    (or ``["", topic, seq, payload]``, as newer vLLM sends it); None for the
    end marker (sequence number -1, empty payload).

    Raises:
        ValueError: Not one of those shapes.
    """
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise ValueError(f"a replay answer of {len(frames)} frames")
    seq_frame, payload = frames[-2], frames[-1]
    if len(seq_frame) != 8:
        raise ValueError(f"a sequence number of {len(seq_frame)} bytes, not 8")
    if int.from_bytes(seq_frame, "big", signed=True) == _END_SEQ or not payload:
        return None
    return _seq(seq_frame), payload


# --- the count ------------------------------------------------------------------------


def _on_gpu(medium: str | None) -> bool:
    return medium is None or medium == MEDIUM_GPU


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
        # Times events were lost (a gap, an unreadable batch, a restart);
        # each one started the count over.
        self.gaps = 0
        self.restarts = 0
        self.last_seq = -1

    @property
    def tokens(self) -> int | None:
        """The tokens the cached blocks hold (None: no block size seen yet,
        or more than ``MAX_CACHE_TOKENS``: the events are not an engine's)."""
        if self.last_seq < 0 or (self.block_size <= 0 and self.blocks):
            return None
        tokens = self.blocks * self.block_size
        return tokens if tokens <= MAX_CACHE_TOKENS else None

    def follows(self, seq: int) -> bool:
        """Whether batch ``seq`` comes right after the last applied (or is the first)."""
        return self.last_seq < 0 or seq == self.last_seq + 1

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        """Batch ``seq`` (the publisher's sequence number); older ones are
        ignored, and one after a gap starts the count over."""
        if seq <= self.last_seq:
            return
        if not self.follows(seq):
            self._lost()
        self.last_seq = seq
        for event in batch.events:
            if isinstance(event, BlockStored):
                if not _on_gpu(event.medium):
                    continue
                self.blocks += len(event.block_hashes)
                if event.block_size > 0:
                    self.block_size = event.block_size
            elif isinstance(event, BlockRemoved):
                if _on_gpu(event.medium):
                    self.blocks -= len(event.block_hashes)
            else:
                self.blocks = 0
                self.clears += 1
            self.blocks = max(0, self.blocks)
        # After the batch, not between its events: an insert into a full
        # cache may store its new blocks before it removes the oldest.
        if self.capacity_blocks is not None:
            self.blocks = min(self.blocks, self.capacity_blocks)

    def lose(self, seq: int) -> None:
        """Batch ``seq`` arrived but could not be read: its events are lost."""
        if seq > self.last_seq:
            self._lost()
            self.last_seq = seq

    def restart(self) -> None:
        """The publisher numbers from 0 again (a restarted engine, whose
        cache starts empty): the next batch is taken as the first."""
        self.blocks = 0
        self.restarts += 1
        self.last_seq = -1

    def _lost(self) -> None:
        self.gaps += 1
        self.blocks = 0
