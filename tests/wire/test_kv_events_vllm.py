"""vLLM's KV cache events as vLLM's own structs encode them, byte for byte.

vLLM's structs, in three versions, are copied in ``tests/_vllm_kv_events.py``.
Payloads are encoded with ``msgspec.msgpack.Encoder()``, as vLLM's publisher
thread encodes them, and framed as it sends them: ``(topic,
seq.to_bytes(8, "big"), payload)`` live, ``(identity, "", seq, payload)``
then ``(identity, "", END_SEQ, "")`` on the replay socket.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop.wire._kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_kv_events,
    encode_kv_events,
    parse_live_frames,
    parse_replay_frames,
)
from tests._vllm_kv_events import (
    END_SEQ,
    PACK,
    V1AllBlocksCleared,
    V1BlockRemoved,
    V1BlockStored,
    V1KVEventBatch,
    V2BlockRemoved,
    V2BlockStored,
    V2KVEventBatch,
    V3AllBlocksCleared,
    V3BlockRemoved,
    V3BlockStored,
    V3KVEventBatch,
    frames,
)

H1, H2 = b"\x01" * 32, b"\x02" * 32


def test_the_first_releases_positional_batch_decodes() -> None:
    payload = PACK.encode(
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
    payload = PACK.encode(
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
    assert decode_kv_events(PACK.encode(_v3_batch())) == _V3_DECODED


def test_map_events_in_a_positional_batch_decode() -> None:
    """A vLLM 0.26.0 was seen sending map events in a positional batch
    (docs/protocol.md): each event's shape is read on its own."""
    batch = _v3_batch()
    events = [msgspec.Raw(PACK.encode(e)) for e in batch.events]
    payload = PACK.encode([batch.ts, events, batch.data_parallel_rank])
    assert decode_kv_events(payload) == _V3_DECODED


def test_unknown_fields_of_newer_versions_are_skipped() -> None:
    event = {"type": "BlockStored", **msgspec.structs.asdict(_v3_batch().events[0])}
    event["locality"] = "local"  # a field added after 0181ea3
    payload = PACK.encode({"ts": 1.0, "events": [event], "future": [1, 2]})
    assert decode_kv_events(payload).events == [_V3_DECODED.events[0]]


def test_the_encoder_writes_vllms_bytes() -> None:
    """``encode_kv_events`` (the sim's publisher) writes what vLLM's own
    structs encode to, byte for byte."""
    assert encode_kv_events(_V3_DECODED) == PACK.encode(
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
        decode_kv_events(PACK.encode([1.0, [event], 0]))


def test_vllms_frames_carry_topic_sequence_and_payload() -> None:
    payload = PACK.encode(_v3_batch())
    assert parse_live_frames(frames("kv-events", 7, payload), b"kv-events") == (7, payload)
    assert parse_live_frames(frames("", 2**40, payload), b"") == (2**40, payload)


@pytest.mark.parametrize(
    ("message", "why"),
    [
        ([b"kv-events", (1).to_bytes(8, "big")], "2 frames"),
        ([b"kv-events", (1).to_bytes(8, "big"), b"x", b"y"], "4 frames"),
        # ZeroMQ delivers by topic prefix: the topic is checked whole.
        ([b"kv-events-other", (1).to_bytes(8, "big"), b"x"], "topic"),
        ([b"kv-events", (1).to_bytes(4, "big"), b"x"], "4 bytes"),
        ([b"kv-events", b"", b"x"], "0 bytes"),
    ],
)
def test_what_is_not_a_live_batch_is_refused(message: list[bytes], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_live_frames(message, b"kv-events")


def test_replay_answers_as_a_dealer_reads_them() -> None:
    """vLLM's ROUTER answers ``(identity, "", seq, payload)``; the identity
    is taken by ZeroMQ, so a DEALER reads ``["", seq, payload]``. Newer vLLM
    puts the topic before the number; the end is ``END_SEQ`` and no payload."""
    payload = PACK.encode(_v3_batch())
    assert parse_replay_frames([b"", (5).to_bytes(8, "big"), payload]) == (5, payload)
    assert parse_replay_frames([b"", b"kv", (5).to_bytes(8, "big"), payload]) == (5, payload)
    assert parse_replay_frames([b"", END_SEQ, b""]) is None
    assert parse_replay_frames([b"", b"kv", END_SEQ, b""]) is None
    for bad in ([(5).to_bytes(8, "big"), payload], [b"", b"\x05", payload], [b""] * 5):
        with pytest.raises(ValueError, match=r"replay answer|sequence number"):
            parse_replay_frames(bad)


@given(st.binary(max_size=512))
def test_any_bytes_are_a_batch_or_a_value_error(payload: bytes) -> None:
    """What a publisher sends is never more than a refused batch."""
    try:
        batch = decode_kv_events(payload)
    except ValueError:
        return
    assert isinstance(batch, KVEventBatch)


@given(st.integers(0, 40))
def test_a_batch_cut_anywhere_is_refused(cut: int) -> None:
    payload = PACK.encode(_v3_batch())
    cut = min(cut, len(payload) - 1)
    with pytest.raises(ValueError, match="KV event batch"):
        decode_kv_events(payload[:cut])
    with pytest.raises(ValueError, match="KV event batch"):
        decode_kv_events(payload + payload[:cut] + b"\x00")  # trailing garbage
