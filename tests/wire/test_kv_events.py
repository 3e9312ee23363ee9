"""vLLM's KV cache events (iop.wire._kv_events): decoding what vLLM publishes
and the count of cached blocks they give, sans-IO."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop.wire._kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheMirror,
    KVEventBatch,
    decode_kv_events,
    encode_kv_events,
)

# What vLLM's publisher puts on the wire for one batch, written out by hand
# from vllm/distributed/kv_events.py (array_like structs, class-name tags).
VLLM_PAYLOAD = msgspec.msgpack.encode(
    [
        1733380000.5,
        [
            ["BlockStored", [11, 12], None, list(range(32)), 16, None, "GPU"],
            ["BlockStored", [b"\x01" * 32], 12, list(range(16)), 16, None],  # older: no medium
            ["BlockRemoved", [11], "GPU"],
            ["BlockRemoved", [12]],
            ["AllBlocksCleared"],
        ],
    ]
)


def test_a_vllm_batch_decodes_old_and_new_fields_alike() -> None:
    batch = decode_kv_events(VLLM_PAYLOAD)
    assert batch.ts == 1733380000.5
    assert batch.data_parallel_rank is None
    stored, older, removed, removed_old, cleared = batch.events
    assert stored == BlockStored(
        block_hashes=[11, 12],
        parent_block_hash=None,
        token_ids=list(range(32)),
        block_size=16,
        medium="GPU",
    )
    assert isinstance(older, BlockStored)
    assert older.block_hashes == [b"\x01" * 32]
    assert (older.parent_block_hash, older.medium) == (12, None)
    assert removed == BlockRemoved(block_hashes=[11], medium="GPU")
    assert removed_old == BlockRemoved(block_hashes=[12])
    assert cleared == AllBlocksCleared()
    assert decode_kv_events(encode_kv_events(batch)) == batch


@pytest.mark.parametrize(
    "payload",
    [
        VLLM_PAYLOAD + b"\x00",  # trailing garbage
        VLLM_PAYLOAD[:-3],  # cut short
        msgspec.msgpack.encode([1.0, [["BlockEvicted", [1]]]]),  # an unknown event
        msgspec.msgpack.encode({"ts": 1.0}),  # a map without its events
        msgspec.msgpack.encode("BlockStored"),
        b"",
    ],
)
def test_what_is_not_a_batch_is_refused(payload: bytes) -> None:
    with pytest.raises(ValueError, match="KV event batch"):
        decode_kv_events(payload)


def test_the_count_follows_stores_removals_and_clears_in_sequence() -> None:
    mirror = CacheMirror(capacity_blocks=10)
    assert mirror.tokens is None  # nothing heard yet
    mirror.apply(0, KVEventBatch(ts=0.0, events=[BlockStored([1, 2, 3], None, [0] * 48, 16)]))
    assert (mirror.blocks, mirror.tokens) == (3, 48)
    mirror.apply(0, KVEventBatch(ts=0.0, events=[BlockStored([4], 3, [0] * 16, 16)]))  # a replay
    assert mirror.blocks == 3
    mirror.apply(1, KVEventBatch(ts=0.0, events=[BlockRemoved([1])]))
    assert mirror.blocks == 2
    mirror.apply(3, KVEventBatch(ts=0.0, events=[BlockStored(list(range(20)), None, [], 16)]))
    assert (mirror.gaps, mirror.blocks) == (1, 10)  # lost events: never above the cache's size
    mirror.apply(4, KVEventBatch(ts=0.0, events=[AllBlocksCleared(), BlockRemoved([7, 8])]))
    assert (mirror.blocks, mirror.tokens, mirror.clears) == (0, 0, 1)


_op = st.one_of(
    st.tuples(st.just("store"), st.lists(st.integers(0, 30), max_size=5, unique=True)),
    st.tuples(st.just("remove"), st.integers(0, 30)),
    st.tuples(st.just("clear"), st.none()),
)


@given(st.lists(_op, max_size=60))
def test_the_count_is_what_the_engine_holds_after_any_sequence(
    ops: list[tuple[str, object]],
) -> None:
    """An engine's cache as a set of hashes: it stores only what it lacks and
    removes only what it holds, and publishes each change; the mirror's count
    is the set's size after every batch (decoded from the wire)."""
    held: set[int] = set()
    mirror = CacheMirror()
    for seq, (op, arg) in enumerate(ops):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        if op == "store":
            new = [h for h in arg if h not in held]  # type: ignore[attr-defined]
            held.update(new)
            events.append(BlockStored(new, None, [0] * 4 * len(new), 4))
        elif op == "remove":
            if arg in held:
                held.discard(arg)  # type: ignore[arg-type]
                events.append(BlockRemoved([arg]))  # type: ignore[list-item]
        else:
            held.clear()
            events.append(AllBlocksCleared())
        mirror.apply(seq, decode_kv_events(encode_kv_events(KVEventBatch(ts=0.0, events=events))))
        assert mirror.blocks == len(held)


def test_blocks_offloaded_to_another_medium_are_not_the_gpus() -> None:
    """A KV connector that offloads to CPU publishes its blocks too; the
    engine's prefix cache (the GPU's) does not hold them."""
    mirror = CacheMirror()
    mirror.apply(0, KVEventBatch(ts=0.0, events=[BlockStored([1, 2], None, [], 16, medium="GPU")]))
    mirror.apply(1, KVEventBatch(ts=0.0, events=[BlockStored([3, 4], 2, [], 16, medium="CPU")]))
    mirror.apply(2, KVEventBatch(ts=0.0, events=[BlockRemoved([3], medium="CPU")]))
    assert mirror.blocks == 2
    mirror.apply(3, KVEventBatch(ts=0.0, events=[BlockRemoved([1], medium="GPU")]))
    assert mirror.blocks == 1


def test_lost_events_start_the_count_over() -> None:
    """After a gap, an unreadable batch or a restarted publisher the count is
    not carried on from a base that may be wrong: it starts from 0."""
    mirror = CacheMirror()
    stored = KVEventBatch(ts=0.0, events=[BlockStored([1, 2, 3], None, [], 16)])
    mirror.apply(0, stored)
    mirror.apply(2, KVEventBatch(ts=0.0, events=[BlockStored([4], None, [], 16)]))  # 1 lost
    assert (mirror.gaps, mirror.blocks) == (1, 1)
    mirror.lose(3)  # batch 3 arrived as garbage
    assert (mirror.gaps, mirror.blocks, mirror.last_seq) == (2, 0, 3)
    mirror.apply(4, stored)
    assert mirror.blocks == 3
    mirror.restart()  # the publisher numbers from 0 again
    assert (mirror.restarts, mirror.blocks, mirror.last_seq) == (1, 0, -1)
    mirror.apply(0, stored)
    assert (mirror.blocks, mirror.gaps) == (3, 2)


def test_a_full_cache_that_stores_and_evicts_in_one_batch_keeps_its_count() -> None:
    """The sim publishes an insert into its full cache as one batch, the new
    blocks stored and then the oldest removed: the cap applies to the count
    after the batch, not between its events (capped in between, the count
    lost the removed blocks twice and a full cache read as 2 of its 4)."""
    mirror = CacheMirror(capacity_blocks=4)
    mirror.apply(0, KVEventBatch(ts=0.0, events=[BlockStored([1, 2, 3, 4], None, [], 16)]))
    mirror.apply(
        1,
        KVEventBatch(ts=0.0, events=[BlockStored([5, 6], 4, [], 16), BlockRemoved([1, 2])]),
    )
    assert (mirror.blocks, mirror.tokens) == (4, 64)
