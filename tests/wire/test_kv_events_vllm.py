"""vLLM's KV cache events as vLLM's own structs encode them, byte for byte.

The classes below are vLLM's, copied from ``vllm/distributed/kv_events.py``
as three versions of that file declare them (docs/protocol.md, "vLLM's KV
cache events", has the URLs): the first release (everything a positional
array), the positional arrays with ``medium`` and ``data_parallel_rank``,
and the source since https://github.com/vllm-project/vllm/pull/42892 (no
``array_like``: every struct a map, events tagged by ``"type"``). Payloads
are encoded with ``msgspec.msgpack.Encoder()``, as vLLM's publisher thread
encodes them, and framed as it sends them: ``(topic, seq.to_bytes(8, "big"),
payload)``.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from iop.wire._kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_kv_events,
    encode_kv_events,
)

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


_PACK = msgspec.msgpack.Encoder()  # vLLM's publisher thread: self._pack.encode(event)
H1, H2 = b"\x01" * 32, b"\x02" * 32


def _frames(topic: str, seq: int, payload: bytes) -> list[bytes]:
    """As ZmqEventPublisher sends a batch: send_multipart((topic, seq, payload))."""
    return [topic.encode("utf-8"), seq.to_bytes(8, "big"), payload]


def test_the_first_releases_positional_batch_decodes() -> None:
    payload = _PACK.encode(
        V1KVEventBatch(
            ts=1.5,
            events=[
                V1BlockStored([11, 12], None, list(range(32)), 16, None),
                V1BlockRemoved([11]),
                V1AllBlocksCleared(),
            ],
        )
    )
    assert decode_kv_events(payload) == KVEventBatch(
        ts=1.5,
        events=[
            BlockStored([11, 12], None, list(range(32)), 16),
            BlockRemoved([11]),
            AllBlocksCleared(),
        ],
    )


def test_positional_events_with_medium_and_rank_decode() -> None:
    payload = _PACK.encode(
        V2KVEventBatch(
            ts=2.0,
            events=[
                V2BlockStored([H1, H2], None, list(range(32)), 16, 3, "GPU"),
                V2BlockRemoved([H1], "CPU"),
            ],
            data_parallel_rank=1,
        )
    )
    assert decode_kv_events(payload) == KVEventBatch(
        ts=2.0,
        events=[
            BlockStored([H1, H2], None, list(range(32)), 16, lora_id=3, medium="GPU"),
            BlockRemoved([H1], medium="CPU"),
        ],
        data_parallel_rank=1,
    )


def _v3_batch() -> V3KVEventBatch:
    return V3KVEventBatch(
        ts=3.25,
        events=[
            V3BlockStored([H1, H2], None, list(range(32)), 16, None, "GPU", None),
            V3BlockStored(
                [H2], H1, list(range(16)), 16, None, "GPU", None, [None], 0, "full_attention"
            ),
            V3BlockRemoved([H1], "GPU", 0),
            V3AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )


_V3_DECODED = KVEventBatch(
    ts=3.25,
    events=[
        BlockStored([H1, H2], None, list(range(32)), 16, medium="GPU"),
        BlockStored([H2], H1, list(range(16)), 16, medium="GPU", group_idx=0),
        BlockRemoved([H1], medium="GPU", group_idx=0),
        AllBlocksCleared(),
    ],
    data_parallel_rank=0,
)


def test_todays_map_events_decode() -> None:
    """What vLLM publishes since it dropped ``array_like`` (fails on a
    decoder that reads positional arrays only: every event is refused)."""
    assert decode_kv_events(_PACK.encode(_v3_batch())) == _V3_DECODED


def test_map_events_in_a_positional_batch_decode() -> None:
    """A vLLM 0.26.0 was seen sending map events in a positional batch
    (docs/protocol.md): each event's shape is read on its own."""
    batch = _v3_batch()
    events = [msgspec.Raw(_PACK.encode(e)) for e in batch.events]
    payload = _PACK.encode([batch.ts, events, batch.data_parallel_rank])
    assert decode_kv_events(payload) == _V3_DECODED


def test_unknown_fields_of_newer_versions_are_skipped() -> None:
    event = {"type": "BlockStored", **msgspec.structs.asdict(_v3_batch().events[0])}
    event["locality"] = "local"  # a field added after 0181ea3
    payload = _PACK.encode({"ts": 1.0, "events": [event], "future": [1, 2]})
    assert decode_kv_events(payload).events == [_V3_DECODED.events[0]]


def test_the_encoder_writes_vllms_bytes() -> None:
    """``encode_kv_events`` (the sim's publisher) writes what vLLM's own
    structs encode to, byte for byte."""
    assert encode_kv_events(_V3_DECODED) == _PACK.encode(
        V3KVEventBatch(
            ts=3.25,
            events=[
                V3BlockStored([H1, H2], None, list(range(32)), 16, None, "GPU", None),
                V3BlockStored([H2], H1, list(range(16)), 16, None, "GPU", None, None, 0),
                V3BlockRemoved([H1], "GPU", 0),
                V3AllBlocksCleared(),
            ],
            data_parallel_rank=0,
        )
    )


@pytest.mark.parametrize(
    "event",
    [
        {"type": "BlockStored", "block_hashes": [1]},  # a required field missing
        {"type": "BlockEvicted", "block_hashes": [1]},  # an unknown event
        {"block_hashes": [1], "medium": None},  # no tag
        {"type": "BlockRemoved", "block_hashes": "x", "medium": None},
        ["BlockRemoved", "x"],
        7,
    ],
)
def test_a_malformed_event_refuses_the_batch(event: object) -> None:
    with pytest.raises(ValueError, match="KV event batch"):
        decode_kv_events(_PACK.encode([1.0, [event], 0]))


def test_vllms_frames_carry_topic_sequence_and_payload() -> None:
    from iop.wire._kv_events import parse_live_frames

    payload = _PACK.encode(_v3_batch())
    assert parse_live_frames(_frames("kv-events", 7, payload), b"kv-events") == (7, payload)
    assert parse_live_frames(_frames("", 2**40, payload), b"") == (2**40, payload)
