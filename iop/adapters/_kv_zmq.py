"""A ``vllm`` instance's KV cache events, read from vLLM's ZeroMQ publisher.

vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint":
"tcp://*:5558", "topic": "kv-events"}'`` publishes each batch of its prefix
cache's changes on a PUB socket, as ``[topic, seq, payload]``, and keeps the
last ones for a ROUTER replay socket (``iop.wire._kv_events``; docs/protocol.md,
"vLLM's KV cache events"). ``KVEventsSubscriber.run`` subscribes
(``kv_events_endpoint``, ``kv_events_topic``) and applies every batch to the
instance's ``CacheMirror``, whose count the load scrape reports
(``VllmAdapter.engine_load``), as it does for the sim's HTTP events.

Theory of operation. One task, Trio's loop, no thread: the sockets are
non-blocking and waited on through their descriptors (``iop._zmq_trio``).
Each wait has a deadline (``IDLE_RECHECK_S``; a replay's
``kv_events_replay_timeout_s``), and cancelling the task closes both
sockets. What a publisher sends cannot stop the node:

==============================  =============================================
it sends                        the node
==============================  =============================================
the next batch                  applies it
a frame over                    never sees it: libzmq disconnects the peer
``kv_events_max_bytes``         (``MAXMSGSIZE``) and reconnects; the batch is
                                lost (a gap, below)
not 3 frames, another topic,    skips it; if it was a batch, the next number
a number of other than 8 bytes  shows the gap
a payload that is no batch      the batch is lost: the count starts over
absurd counts                   no figure (``MAX_CACHE_TOKENS``, ``CacheMirror``)
a number past the next (a gap)  asks the replay socket for the missing ones
                                (``kv_events_replay_endpoint``, at most
                                ``kv_events_max_replay``); what is still
                                missing starts the count over
a number at or below the last   takes it as a publisher that started again
                                (one connection delivers in order): the
                                count starts over, and the missing first
                                batches are asked for as a gap
more than                       ZeroMQ drops the rest (``RCVHWM``): a gap
``kv_events_max_queued`` unread
==============================  =============================================

A connection libzmq dropped for good (it reconnects after network errors,
not after a protocol error such as an oversized frame: its monitor socket
tells) or a socket error is logged and the subscription opened again after
a backoff (1 s, doubling to 30 s, back to 1 s once a batch was applied);
failures and recoveries are logged once each, not per message.
"""

from __future__ import annotations

import logging
from typing import Final

import trio
import zmq

from iop._zmq_trio import (
    close_context,
    close_socket,
    open_socket,
    receive_message,
    wait_for_any,
    wait_for_message,
)
from iop.config import VllmInstance
from iop.wire._kv_events import (
    CacheMirror,
    decode_kv_events,
    parse_live_frames,
    parse_replay_frames,
)

__all__ = ["IDLE_RECHECK_S", "KVEventsSubscriber"]

log = logging.getLogger("iop.adapters.vllm")

# The longest wait for a message before the socket's events are read again.
# An idle engine publishes nothing for hours; the deadline only bounds the
# cost of a wake-up the edge-triggered descriptor might not give.
IDLE_RECHECK_S: Final = 5.0
# Frames kept of one message: a batch has 3, a replay answer at most 4.
_MAX_FRAMES: Final = 4
# Between attempts to open the subscription after a socket error.
_BACKOFF_MIN_S: Final = 1.0
_BACKOFF_MAX_S: Final = 30.0


class KVEventsSubscriber:
    """Follows one vLLM's KV event publisher into ``mirror`` (module docstring)."""

    def __init__(self, cfg: VllmInstance, mirror: CacheMirror) -> None:
        self.cfg = cfg
        self.mirror = mirror
        self.topic = cfg.kv_events_topic.encode("utf-8")
        # What happened, for tests and for the logs.
        self.applied = 0
        self.unreadable = 0
        self.replays = 0
        self.replayed = 0
        self._failing = False
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sub: zmq.Socket[bytes] | None = None
        self._dealer: zmq.Socket[bytes] | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Subscribe and apply batches until cancelled. ``task_status`` is
        told at once: ZeroMQ makes (and remakes) the connection in the
        background."""
        task_status.started()
        backoff = _BACKOFF_MIN_S
        while True:
            applied = self.applied
            try:
                await self._subscribe()
                why = "the connection was dropped"
            except zmq.ZMQError as exc:
                why = str(exc)
            if self.applied > applied:
                backoff = _BACKOFF_MIN_S
            self._bad(f"{why}; subscribing again in {backoff:g}s")
            await trio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)

    async def _subscribe(self) -> None:
        """Follow one subscription; return when libzmq dropped its
        connection for good (a protocol error, as a frame over
        ``MAXMSGSIZE``: libzmq reconnects after a network error but not
        after those), which its monitor socket tells."""
        ctx = self._ctx = zmq.Context()
        sub = self._sub = self._open(zmq.SUB)
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            sub.connect(self.cfg.kv_events_endpoint)
            if self.cfg.kv_events_replay_endpoint:
                self._open_dealer()
            while True:
                frames = receive_message(sub, _MAX_FRAMES)
                if frames is None:
                    with trio.move_on_after(IDLE_RECHECK_S):
                        await wait_for_any(sub, monitor)
                    if receive_message(monitor, 2) is not None:
                        return
                    continue
                await self._live(frames)
                # A publisher that floods the socket does not starve the node.
                await trio.lowlevel.checkpoint()
        finally:
            socks = [sub, monitor] if self._dealer is None else [sub, monitor, self._dealer]
            self._dealer = None
            close_context(ctx, *socks)

    def _open(self, kind: int) -> zmq.Socket[bytes]:
        assert self._ctx is not None
        return open_socket(
            self._ctx,
            kind,
            max_bytes=self.cfg.kv_events_max_bytes,
            max_queued=self.cfg.kv_events_max_queued,
        )

    def _open_dealer(self) -> zmq.Socket[bytes]:
        # A DEALER, not vLLM's example's REQ: a REQ socket takes one answer
        # per request, and the ROUTER answers a replay with one message per batch.
        dealer = self._dealer = self._open(zmq.DEALER)
        dealer.connect(self.cfg.kv_events_replay_endpoint)
        return dealer

    async def _live(self, frames: list[bytes]) -> None:
        try:
            seq, payload = parse_live_frames(frames, self.topic)
        except ValueError as exc:
            self._bad(f"a message that is not a batch ({exc})")
            return
        mirror = self.mirror
        if mirror.last_seq >= 0 and seq <= mirror.last_seq:
            self._bad(f"batch {seq} after batch {mirror.last_seq}: the publisher started again")
            mirror.restart()
        start = mirror.last_seq + 1
        if (
            seq > start
            and self._dealer is not None
            and seq - start <= self.cfg.kv_events_max_replay
        ):
            await self._replay(start, seq)
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_kv_events(payload, self.cfg.kv_events_max_bytes)
        except ValueError as exc:
            self.unreadable += 1
            self.mirror.lose(seq)
            self._bad(f"batch {seq}: {exc}")
            return
        self.mirror.apply(seq, batch)
        self.applied += 1
        if self._failing:
            self._failing = False
            log.info("instance %s: KV events are read again", self.cfg.name)

    async def _replay(self, start: int, until: int) -> None:
        """Ask for batches ``start`` .. ``until - 1`` and apply those that come
        within ``kv_events_replay_timeout_s``. vLLM answers with every batch
        it keeps from ``start`` on, then an end marker."""
        dealer = self._dealer
        assert dealer is not None
        self.replays += 1
        ended = False
        answers = 0
        with trio.move_on_after(self.cfg.kv_events_replay_timeout_s):
            try:
                dealer.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
            except zmq.Again:
                self._bad("the replay socket takes no request (not connected)")
                return
            while answers <= self.cfg.kv_events_max_replay:
                await wait_for_message(dealer)
                frames = receive_message(dealer, _MAX_FRAMES)
                if frames is None:
                    continue
                answers += 1
                try:
                    answer = parse_replay_frames(frames)
                except ValueError as exc:
                    self._bad(f"a replay answer that is not a batch ({exc})")
                    continue
                if answer is None:
                    ended = True
                    break
                rseq, payload = answer
                if self.mirror.last_seq < rseq < until:
                    self._apply(rseq, payload)
                    self.replayed += 1
                await trio.lowlevel.checkpoint()
        if not ended:
            # Answers still on their way would be read as the next replay's.
            log.info(
                "instance %s: the replay of KV events from batch %d did not end within %gs",
                self.cfg.name,
                start,
                self.cfg.kv_events_replay_timeout_s,
            )
            close_socket(dealer)
            self._open_dealer()

    def _bad(self, why: str) -> None:
        if not self._failing:
            self._failing = True
            log.warning(
                "instance %s: KV events from %s: %s. Further trouble is not logged "
                "until a batch is read again.",
                self.cfg.name,
                self.cfg.kv_events_endpoint,
                why,
            )
