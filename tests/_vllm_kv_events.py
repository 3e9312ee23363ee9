"""vLLM's KV cache event structs, copied from ``vllm/distributed/kv_events.py``
as three versions of that file declare them (docs/protocol.md, "vLLM's KV
cache events", has the URLs), and its publisher's framing: what the tests
hold IOP's decoder, encoder and sim to, byte for byte.

* ``V1*``: the first release, every struct a positional array (``array_like``).
* ``V2*``: positional, with ``medium`` and ``data_parallel_rank`` (vLLM's
  subscriber example).
* ``V3*``: the source since https://github.com/vllm-project/vllm/pull/42892
  (at 0181ea3): no ``array_like``, every struct a map, events tagged by
  ``"type"``.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

# --- the first release: vllm/distributed/kv_events.py at b4e69e0 --------------------


class V1EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class V1KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class V1BlockStored(V1KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class V1BlockRemoved(V1KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]


class V1AllBlocksCleared(V1KVCacheEvent, tag="AllBlocksCleared"):
    pass


class V1KVEventBatch(V1EventBatch):
    events: list[V1BlockStored | V1BlockRemoved | V1AllBlocksCleared]


# --- positional, with medium and the data parallel rank (the subscriber example) -----


class V2EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class V2KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class V2BlockStored(V2KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class V2BlockRemoved(V2KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class V2AllBlocksCleared(V2KVCacheEvent, tag="AllBlocksCleared"):
    pass


class V2KVEventBatch(V2EventBatch):
    events: list[V2BlockStored | V2BlockRemoved | V2AllBlocksCleared]


# --- maps: vllm/distributed/kv_events.py at 0181ea3 ----------------------------------


class V3EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class V3KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class V3BlockStored(V3KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class V3BlockRemoved(V3KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class V3AllBlocksCleared(V3KVCacheEvent, tag="AllBlocksCleared"):
    pass


class V3KVEventBatch(V3EventBatch):
    events: list[V3BlockStored | V3BlockRemoved | V3AllBlocksCleared]


# vLLM's publisher thread: self._pack = msgspec.msgpack.Encoder(); self._pack.encode(batch)
PACK: Final = msgspec.msgpack.Encoder()
# ZmqEventPublisher.END_SEQ: the replay's end marker.
END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)


def frames(topic: str, seq: int, payload: bytes) -> list[bytes]:
    """As ZmqEventPublisher sends a batch: send_multipart((topic, seq, payload))."""
    return [topic.encode("utf-8"), seq.to_bytes(8, "big"), payload]
