"""The sim publishes its prefix cache's events over ZeroMQ as vLLM does
(``iop.sim._kv_publisher``): the frames of vLLM's ``ZmqEventPublisher``, and
payloads that vLLM's own structs (``tests/_vllm_kv_events.py``) decode and
encode back to the same bytes; replays answered as its ROUTER answers them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

import msgspec
import pytest
import trio
import zmq

from iop._zmq_trio import close_context, receive_message, wait_for_message
from iop.config import SimConfig
from iop.errors import ListenError
from iop.sim._engine import Engine, block_hashes
from iop.sim._kv_publisher import publish_kv_events
from tests._vllm_kv_events import END_SEQ, PACK, V3BlockStored, V3KVEventBatch

TOPIC: Final = "kv-events"
DEADLINE_S: Final = 10.0
VLLM: Final = msgspec.msgpack.Decoder(V3KVEventBatch)


def sim_config(**kw: object) -> SimConfig:
    return msgspec.convert(
        {
            "kv_cache_blocks": 8,
            "kv_block_tokens": 4,
            "kv_events_endpoint": "tcp://127.0.0.1:*",
            "kv_events_replay_endpoint": "tcp://127.0.0.1:*",
            "kv_events_topic": TOPIC,
            **kw,
        },
        SimConfig,
    )


@asynccontextmanager
async def publishing(engine: Engine, cfg: SimConfig) -> AsyncIterator[tuple[str, str]]:
    async with trio.open_nursery() as nursery:
        endpoints: tuple[str, str] = await nursery.start(publish_kv_events, engine.cache, cfg)
        yield endpoints
        nursery.cancel_scope.cancel()


async def receive(sock: zmq.Socket[bytes]) -> list[bytes]:
    with trio.fail_after(DEADLINE_S):
        while (message := receive_message(sock, 8)) is None:
            await wait_for_message(sock)
    return message


def insert(engine: Engine, n: int) -> None:
    tokens = list(range(100 * n, 100 * n + 8))
    engine.cache.insert(block_hashes(tokens, 4), tokens, 4)


async def test_the_sim_publishes_vllms_frames_and_bytes() -> None:
    engine = Engine(sim_config())
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        async with publishing(engine, sim_config()) as (endpoint, _):
            sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
            sub.connect(endpoint)
            # ZeroMQ's slow joiner: what is published before the
            # subscription arrives is dropped; clears until one is heard.
            with trio.fail_after(DEADLINE_S):
                while True:
                    engine.cache.clear()
                    with trio.move_on_after(0.05):
                        first = await receive(sub)
                        break
            insert(engine, 1)
            topic, seq_bytes, payload = await receive(sub)
    finally:
        close_context(ctx, sub)
    assert topic == TOPIC.encode()
    assert int.from_bytes(seq_bytes, "big") == int.from_bytes(first[1], "big") + 1
    # vLLM's structs read the payload, and write it back to the same bytes.
    batch = VLLM.decode(payload)
    assert PACK.encode(batch) == payload
    (event,) = batch.events
    assert isinstance(event, V3BlockStored)
    assert (len(event.block_hashes), event.block_size, event.medium) == (2, 4, "GPU")
    assert event.token_ids == list(range(100, 108))
    assert batch.data_parallel_rank == 0


async def test_the_sim_answers_a_replay_as_vllms_router() -> None:
    engine = Engine(sim_config())
    for n in range(3):
        insert(engine, n)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        async with publishing(engine, sim_config()) as (_, replay):
            dealer.connect(replay)
            dealer.send_multipart([b"", (1).to_bytes(8, "big")])
            answers = [await receive(dealer) for _ in range(3)]
            dealer.send_multipart([b"only one frame"])  # refused, as vLLM refuses it
            dealer.send_multipart([b"", (7).to_bytes(8, "big")])  # past the last: the end only
            after = await receive(dealer)
    finally:
        close_context(ctx, dealer)
    journal = engine.cache.events_after(0, 10)
    assert answers == [
        [b"", (1).to_bytes(8, "big"), journal[0][1]],
        [b"", (2).to_bytes(8, "big"), journal[1][1]],
        [b"", END_SEQ, b""],
    ]
    assert after == [b"", END_SEQ, b""]


async def test_an_endpoint_in_use_is_a_listen_error() -> None:
    engine = Engine(sim_config())
    async with publishing(engine, sim_config()) as (endpoint, _):
        with pytest.raises(ListenError, match=r"cannot listen on tcp://127\.0\.0\.1:"):
            await publish_kv_events(engine.cache, sim_config(kv_events_endpoint=endpoint))
