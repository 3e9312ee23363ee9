"""The sim's prefix cache events over ZeroMQ, as vLLM publishes them.

vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``;
docs/protocol.md, "vLLM's KV cache events") sends each batch on a PUB socket
as ``(topic, seq.to_bytes(8, "big"), payload)``, numbered from 0, and keeps
the last ones for a ROUTER replay socket: a request ``(identity, "",
start)`` is answered with ``(identity, "", seq, payload)`` for every kept
batch numbered ``start`` or above, then ``(identity, "", -1 as 8 signed
bytes, "")``. ``publish_kv_events`` does the same with the batches the
sim's ``PrefixCache`` journals (encoded as vLLM's source encodes them,
``iop.wire._kv_events.encode_kv_events``), so a node reads the sim exactly
as it reads vLLM. PUB and ROUTER never block a sender: a subscriber that
does not keep up loses batches, as with vLLM.

``zmq`` is the ``kvevents`` extra, imported only when the sim publishes.
"""

from __future__ import annotations

import errno
import logging
from typing import Final

import trio
import zmq

from iop._zmq_trio import close_context, open_socket, receive_message, wait_for_message
from iop.config import SimConfig
from iop.errors import ListenError
from iop.sim._engine import PrefixCache
from iop.wire._kv_events import MAX_KV_EVENTS_BYTES

__all__ = ["publish_kv_events"]

log = logging.getLogger("iop.sim")

# vLLM's END_SEQ: the replay's end marker.
END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
# Batches sent per wake-up before other tasks run.
_SEND_BATCH: Final = 256
# The longest wait before the journal and the replay socket are looked at
# again (nothing is missed meanwhile: each wait ends on news).
_IDLE_S: Final = 5.0
# vLLM's PUB high-water mark (hwm = 100_000); a ROUTER request is one frame
# of 8 bytes, so a small bound does for what the replay socket reads.
_PUB_HWM: Final = 100_000
_REQUEST_BYTES: Final = 1024


async def publish_kv_events(
    cache: PrefixCache,
    cfg: SimConfig,
    *,
    task_status: trio.TaskStatus[tuple[str, str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Publish ``cache``'s batches on ``cfg.kv_events_endpoint`` (bound), and
    serve replays on ``cfg.kv_events_replay_endpoint`` if set, until cancelled.

    ``task_status`` receives the bound endpoints, PUB and ROUTER (the ports
    ZeroMQ picked for ``tcp://127.0.0.1:*``; "" for no ROUTER).

    Raises:
        ListenError: An endpoint cannot be bound.
    """
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = open_socket(ctx, zmq.PUB, max_bytes=MAX_KV_EVENTS_BYTES, max_queued=_PUB_HWM)
    router = open_socket(ctx, zmq.ROUTER, max_bytes=_REQUEST_BYTES, max_queued=_PUB_HWM)
    topic = cfg.kv_events_topic.encode("utf-8")
    try:
        _bind(pub, cfg.kv_events_endpoint)
        endpoint = str(pub.getsockopt_string(zmq.LAST_ENDPOINT))
        replay = ""
        if cfg.kv_events_replay_endpoint:
            _bind(router, cfg.kv_events_replay_endpoint)
            replay = str(router.getsockopt_string(zmq.LAST_ENDPOINT))
        log.info("sim: KV cache events published on %s (replays: %s)", endpoint, replay or "none")
        task_status.started((endpoint, replay))
        async with trio.open_nursery() as nursery:
            if cfg.kv_events_replay_endpoint:
                nursery.start_soon(_serve_replays, router, cache)
            await _publish(pub, cache, topic)
    finally:
        close_context(ctx, pub, router)


def _bind(sock: zmq.Socket[bytes], endpoint: str) -> None:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise ListenError(endpoint, exc.strerror, in_use=exc.errno == errno.EADDRINUSE) from exc


async def _publish(pub: zmq.Socket[bytes], cache: PrefixCache, topic: bytes) -> None:
    sent = -1
    while True:
        batches = cache.events_after(sent, _SEND_BATCH)
        if not batches:
            news = trio.Event()
            cache.on_publish = news.set
            with trio.move_on_after(_IDLE_S):
                await news.wait()
            continue
        for seq, payload in batches:
            # PUB drops at its high-water mark rather than block (vLLM's too).
            pub.send_multipart([topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
            sent = seq
        await trio.lowlevel.checkpoint()


async def _serve_replays(router: zmq.Socket[bytes], cache: PrefixCache) -> None:
    while True:
        with trio.move_on_after(_IDLE_S):
            await wait_for_message(router)
        frames = receive_message(router, 3)
        if frames is None:
            continue
        if len(frames) != 3 or len(frames[2]) != 8:
            # vLLM logs "Invalid replay request" and answers nothing.
            log.warning("sim: an invalid KV events replay request of %d frames", len(frames))
            continue
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in cache.events_after(start - 1, cache.kept):
            router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        router.send_multipart([client, b"", END_SEQ, b""], zmq.NOBLOCK)
        await trio.lowlevel.checkpoint()
