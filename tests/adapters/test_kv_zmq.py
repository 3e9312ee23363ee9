"""A node following vLLM's KV cache events over real ZeroMQ sockets
(``iop.adapters._kv_zmq``), against a publisher that sends what vLLM's
``ZmqEventPublisher`` sends (``tests/_vllm_kv_events.py``), and against one
that sends what vLLM never would."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Final

import httpx
import msgspec
import pytest
import trio
import zmq

from iop._zmq_trio import close_context, receive_message, wait_for_message
from iop.adapters import VllmAdapter
from iop.adapters._kv_zmq import KVEventsSubscriber
from iop.config import SimConfig, VllmInstance
from iop.sim._engine import Engine
from iop.wire._kv_events import CacheMirror
from tests._vllm_kv_events import (
    END_SEQ,
    PACK,
    V3AllBlocksCleared,
    V3BlockRemoved,
    V3BlockStored,
    V3KVEventBatch,
    frames,
)

TOPIC: Final = "kv-events"
DEADLINE_S: Final = 10.0


def stored(*hashes: int, block_size: int = 16, medium: str = "GPU") -> V3KVEventBatch:
    tokens = [0] * min(block_size, 16) * len(hashes)
    event = V3BlockStored(list(hashes), None, tokens, block_size, None, medium, None)
    return V3KVEventBatch(ts=1.0, events=[event], data_parallel_rank=0)


def removed(*hashes: int) -> V3KVEventBatch:
    return V3KVEventBatch(
        ts=1.0, events=[V3BlockRemoved(list(hashes), "GPU")], data_parallel_rank=0
    )


class Publisher:
    """vLLM's ZmqEventPublisher, its sockets bound on loopback: an XPUB (a
    PUB that also tells the test when a subscriber joined) and a ROUTER
    answering replays as ``_service_replay`` does, from what was sent."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: list[tuple[int, bytes]] = []
        self.requests: list[int] = []

    async def joined(self) -> None:
        """Until a subscription to the topic arrives (ZeroMQ's slow joiner:
        what is sent before is dropped)."""
        with trio.fail_after(DEADLINE_S):
            while True:
                await wait_for_message(self.pub)
                message = receive_message(self.pub, 1)
                if message and message[0] == b"\x01" + TOPIC.encode():
                    return

    def send(self, seq: int, batch: Any) -> None:
        payload = PACK.encode(batch)
        self.buffer.append((seq, payload))
        self.pub.send_multipart(frames(TOPIC, seq, payload))

    def send_raw(self, message: list[bytes]) -> None:
        self.pub.send_multipart(message)

    async def serve_replay(self, *, answer: bool = True) -> None:
        """Answer one replay request as vLLM does (or take it and say nothing)."""
        with trio.fail_after(DEADLINE_S):
            await wait_for_message(self.router)
        message = receive_message(self.router, 3)
        assert message is not None
        client, empty, start_bytes = message
        assert empty == b""
        start = int.from_bytes(start_bytes, "big")
        self.requests.append(start)
        if not answer:
            return
        for seq, payload in self.buffer:
            if seq >= start:
                self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        self.router.send_multipart([client, b"", END_SEQ, b""])

    def close(self) -> None:
        close_context(self.ctx, self.pub, self.router)


def config(pub: Publisher, *, replay: bool = False, **kw: Any) -> VllmInstance:
    return msgspec.convert(
        {
            "name": "v",
            "endpoint": "http://engine.test:8000/v1",
            "kv_events_endpoint": pub.endpoint,
            "kv_events_topic": TOPIC,
            **({"kv_events_replay_endpoint": pub.replay_endpoint} if replay else {}),
            **kw,
        },
        VllmInstance,
    )


@asynccontextmanager
async def following(cfg: VllmInstance) -> AsyncIterator[KVEventsSubscriber]:
    sub = KVEventsSubscriber(cfg, CacheMirror())
    async with trio.open_nursery() as nursery:
        await nursery.start(sub.run)
        yield sub
        nursery.cancel_scope.cancel()


async def until(what: Callable[[], bool]) -> None:
    """Until ``what`` holds: the subscriber runs in this test's own loop."""
    with trio.fail_after(DEADLINE_S):
        while not what():
            await trio.sleep(0.01)


@pytest.fixture
async def pub() -> AsyncIterator[Publisher]:
    p = Publisher()
    yield p
    p.close()


async def test_vllms_batches_reach_the_count(pub: Publisher) -> None:
    async with following(config(pub)) as sub:
        await pub.joined()
        pub.send(0, stored(1, 2, 3))
        pub.send(1, removed(1))
        pub.send(2, V3KVEventBatch(ts=2.0, events=[V3AllBlocksCleared()]))
        pub.send(3, stored(4))
        await until(lambda: sub.mirror.last_seq == 3)
        assert (sub.mirror.blocks, sub.mirror.tokens, sub.mirror.clears) == (1, 16, 1)
        assert (sub.applied, sub.mirror.gaps) == (4, 0)


async def test_cancelling_closes_the_sockets(pub: Publisher) -> None:
    sub = KVEventsSubscriber(config(pub, replay=True), CacheMirror())
    async with trio.open_nursery() as nursery:
        await nursery.start(sub.run)
        await pub.joined()
        ctx = sub._ctx
        assert ctx is not None
        assert not ctx.closed
        nursery.cancel_scope.cancel()
    assert ctx.closed


async def test_garbage_and_misframed_messages_never_stop_it(pub: Publisher) -> None:
    async with following(config(pub)) as sub:
        await pub.joined()
        pub.send(0, stored(1, 2))
        pub.send_raw(frames(TOPIC, 1, b"\xc1 not msgpack"))  # a payload that is no batch
        pub.send_raw([TOPIC.encode(), b"\x00\x02", b"x"])  # a 2-byte number
        pub.send_raw([TOPIC.encode(), *[b"x"] * 50])  # 51 frames
        pub.send_raw(frames(TOPIC + "-other", 9, PACK.encode(stored(9))))  # a prefix match
        pub.send(2, stored(3))
        await until(lambda: sub.mirror.last_seq == 2)
        # Batch 1 was lost: the count started over from batch 2.
        assert (sub.unreadable, sub.mirror.gaps, sub.mirror.blocks) == (1, 1, 1)


async def test_a_frame_over_the_limit_is_never_read(pub: Publisher) -> None:
    """libzmq drops the connection of a peer sending more than
    ``kv_events_max_bytes`` (MAXMSGSIZE) before buffering it; the
    subscription comes back, and the lost batch is a gap."""
    async with following(config(pub, kv_events_max_bytes=4096)) as sub:
        await pub.joined()
        pub.send(0, stored(1))
        await until(lambda: sub.mirror.last_seq == 0)
        pub.send(1, stored(*range(2, 400)))  # ~7 KiB of hashes and token ids
        await pub.joined()  # it reconnected
        pub.send(2, stored(500))
        await until(lambda: sub.mirror.last_seq == 2)
        assert (sub.applied, sub.mirror.gaps, sub.mirror.blocks) == (2, 1, 1)


async def test_absurd_counts_are_no_figure(pub: Publisher) -> None:
    async with following(config(pub)) as sub:
        await pub.joined()
        pub.send(0, stored(1, 2, 3, block_size=2**40))
        await until(lambda: sub.mirror.last_seq == 0)
        assert sub.mirror.tokens is None


async def test_a_number_going_back_is_a_publisher_that_started_again(pub: Publisher) -> None:
    async with following(config(pub)) as sub:
        await pub.joined()
        for seq in range(5):
            pub.send(seq, stored(seq))
        await until(lambda: sub.mirror.last_seq == 4)
        assert sub.mirror.blocks == 5
        pub.send(0, stored(100))  # a restarted vLLM numbers from 0, its cache empty
        await until(lambda: sub.mirror.restarts == 1)
        await until(lambda: sub.mirror.last_seq == 0)
        assert sub.mirror.blocks == 1


async def test_a_gap_is_filled_from_the_replay_socket(pub: Publisher) -> None:
    async with following(config(pub, replay=True)) as sub:
        await pub.joined()
        pub.send(0, stored(1))
        await until(lambda: sub.mirror.last_seq == 0)
        # Batches 1 and 2 are published while nobody listens (kept for replay).
        payloads = [PACK.encode(stored(2)), PACK.encode(stored(3))]
        pub.buffer += list(enumerate(payloads, start=1))
        pub.send(3, stored(4))
        await pub.serve_replay()
        await until(lambda: sub.mirror.last_seq == 3)
        assert pub.requests == [1]
        assert (sub.replayed, sub.mirror.gaps, sub.mirror.blocks) == (2, 0, 4)


async def test_first_contact_mid_stream_asks_for_the_start(pub: Publisher) -> None:
    """A node that starts after vLLM asks for what it kept from batch 0."""
    pub.buffer += [(0, PACK.encode(stored(1))), (1, PACK.encode(stored(2)))]
    async with following(config(pub, replay=True)) as sub:
        await pub.joined()
        pub.send(2, stored(3))
        await pub.serve_replay()
        await until(lambda: sub.mirror.last_seq == 2)
        assert pub.requests == [0]
        assert (sub.mirror.gaps, sub.mirror.blocks) == (0, 3)


async def test_a_gap_without_replay_starts_the_count_over(pub: Publisher) -> None:
    async with following(config(pub)) as sub:
        await pub.joined()
        pub.send(0, stored(1, 2))
        pub.send(5, stored(3))
        await until(lambda: sub.mirror.last_seq == 5)
        assert (sub.replays, sub.mirror.gaps, sub.mirror.blocks) == (0, 1, 1)


async def test_a_gap_past_the_replay_limit_is_not_asked_for(pub: Publisher) -> None:
    async with following(config(pub, replay=True, kv_events_max_replay=3)) as sub:
        await pub.joined()
        pub.send(0, stored(1))
        pub.send(4, stored(2))  # 3 missing: asked for
        await pub.serve_replay()
        await until(lambda: sub.mirror.last_seq == 4)
        pub.send(9, stored(3))  # 4 missing: not
        await until(lambda: sub.mirror.last_seq == 9)
        assert (pub.requests, sub.replays) == ([1], 1)


async def test_a_replay_that_does_not_answer_times_out_and_the_next_one_works(
    pub: Publisher,
) -> None:
    cfg = config(pub, replay=True, kv_events_replay_timeout_s=0.2)
    async with following(cfg) as sub:
        await pub.joined()
        pub.send(0, stored(1))
        pub.send(2, stored(2))
        await pub.serve_replay(answer=False)
        await until(lambda: sub.mirror.last_seq == 2)
        assert (sub.mirror.gaps, sub.mirror.blocks) == (1, 1)
        pub.buffer.append((3, PACK.encode(stored(3))))
        pub.send(4, stored(4))
        await pub.serve_replay()
        await until(lambda: sub.mirror.last_seq == 4)
        assert pub.requests == [1, 3]
        assert (sub.mirror.gaps, sub.mirror.blocks) == (1, 3)


def vllm(**kw: Any) -> VllmInstance:
    return msgspec.convert({"name": "v", "endpoint": "http://e.test:8000/v1", **kw}, VllmInstance)


EP: Final = {"kv_events_endpoint": "tcp://gpu-1:5557"}


@pytest.mark.parametrize(
    ("keys", "error"),
    [
        ({"kv_events_max_bytes": 1023}, "kv_events_max_bytes must be 1024.."),
        ({"kv_events_max_bytes": 256 * 2**20 + 1}, "kv_events_max_bytes must be 1024.."),
        ({"kv_events_max_queued": 0}, "kv_events_max_queued must be 1..100000"),
        ({"kv_events_max_queued": 100_001}, "kv_events_max_queued must be 1..100000"),
        ({"kv_events_replay_timeout_s": 0}, "kv_events_replay_timeout_s must be > 0"),
        ({"kv_events_replay_timeout_s": 60.5}, "kv_events_replay_timeout_s must be > 0"),
        ({"kv_events_max_replay": -1}, "kv_events_max_replay must be 0..1000000"),
        ({"kv_events_max_replay": 1_000_001}, "kv_events_max_replay must be 0..1000000"),
        ({"kv_events_endpoint": "tcp://*:5557"}, "name the publisher's host"),
        ({"kv_events_endpoint": "http://gpu-1:5557"}, "tcp://host:port or ipc://path"),
        ({"kv_events_endpoint": "tcp://gpu-1"}, "tcp://host:port"),
        ({"kv_events_path": "/kv_events"}, "choose one"),
        ({"load_scrape_interval_s": 0}, "needs load_scrape_interval_s > 0"),
    ],
)
def test_kv_events_keys_are_bounded(keys: dict[str, Any], error: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=re.escape(error)):
        vllm(**{**EP, **keys})


def test_kv_events_keys_at_their_bounds() -> None:
    for keys in (
        {"kv_events_max_bytes": 1024, "kv_events_max_queued": 1, "kv_events_max_replay": 0},
        {
            "kv_events_max_bytes": 256 * 2**20,
            "kv_events_max_queued": 100_000,
            "kv_events_replay_timeout_s": 60,
            "kv_events_max_replay": 1_000_000,
        },
        {"kv_events_endpoint": "ipc:///run/vllm/kv-events", "kv_events_replay_endpoint": ""},
        {"kv_events_replay_endpoint": "tcp://gpu-1:5558"},
    ):
        vllm(**{**EP, **keys})
    with pytest.raises(msgspec.ValidationError, match="needs kv_events_endpoint"):
        vllm(kv_events_replay_endpoint="tcp://gpu-1:5558")


def test_the_sim_binds_what_a_node_connects_to() -> None:
    cfg = msgspec.convert({"kv_events_endpoint": "tcp://*:5557"}, SimConfig)
    assert cfg.kv_events_endpoint == "tcp://*:5557"
    msgspec.convert({"kv_events_endpoint": "tcp://127.0.0.1:*"}, SimConfig)
    with pytest.raises(msgspec.ValidationError, match="needs kv_events_endpoint"):
        msgspec.convert({"kv_events_replay_endpoint": "tcp://*:5558"}, SimConfig)


async def test_the_subscription_holds_at_most_max_queued(pub: Publisher) -> None:
    """``kv_events_max_queued`` is the SUB socket's ZMQ_RCVHWM, past which
    ZeroMQ drops messages (the gap is then handled as any other)."""
    async with following(config(pub, kv_events_max_queued=7, kv_events_max_bytes=5000)) as sub:
        await pub.joined()
        sock = sub._sub
        assert sock is not None
        assert (sock.getsockopt(zmq.RCVHWM), sock.getsockopt(zmq.MAXMSGSIZE)) == (7, 5000)


async def test_the_vllm_adapter_reports_what_its_subscription_counted(pub: Publisher) -> None:
    """``VllmAdapter.follow_kv_events`` feeds the mirror its load scrape
    reports (``cached_tokens``), capped at the cache's size from ``/metrics``."""
    page = Engine(SimConfig(kv_cache_blocks=4, kv_block_tokens=16)).metrics("m")
    transport = httpx.MockTransport(lambda _: httpx.Response(200, content=page))
    adapter = VllmAdapter(config(pub), transport=transport)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(adapter.follow_kv_events)
            await pub.joined()
            assert (await adapter.engine_load()).cached_tokens is None  # nothing heard yet
            pub.send(0, stored(1, 2))
            await until(lambda: adapter._kv_mirror.last_seq == 0)
            assert (await adapter.engine_load()).cached_tokens == 32
            pub.send(1, stored(3, 4, 5, 6, 7))
            await until(lambda: adapter._kv_mirror.last_seq == 1)
            assert (await adapter.engine_load()).cached_tokens == 4 * 16  # the cache's size
            nursery.cancel_scope.cancel()
    finally:
        await adapter.aclose()
    plain = VllmAdapter(vllm())
    with trio.fail_after(DEADLINE_S):
        await plain.follow_kv_events()  # no endpoint: returns at once
    await plain.aclose()
