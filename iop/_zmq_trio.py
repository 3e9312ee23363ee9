"""ZeroMQ sockets on Trio: waiting for a message, reading it bounded, closing.

pyzmq's sockets are used non-blocking on Trio's own loop, no thread. A
ZeroMQ socket's file descriptor (``ZMQ_FD``) is edge-triggered: it becomes
readable when the socket's state *changed*, not while a message waits, and
it is reset when ``ZMQ_EVENTS`` is read
(http://api.zeromq.org/4-3:zmq-getsockopt, ``ZMQ_FD``). So a reader reads
``ZMQ_EVENTS`` before each wait and after each wake-up, and drains with
``NOBLOCK`` until it is out of messages (``zmq.Again``); never waits on the
descriptor while ``POLLIN`` is set.

``zmq`` is the ``kvevents`` extra (``iop._extras``): only the modules that
need it import this one, when a config asks for it.
"""

from __future__ import annotations

from typing import cast

import trio
import zmq

__all__ = [
    "close_context",
    "close_socket",
    "open_socket",
    "receive_message",
    "wait_for_any",
    "wait_for_message",
]


def open_socket(
    ctx: zmq.Context[zmq.Socket[bytes]],
    kind: int,
    *,
    max_bytes: int,
    max_queued: int,
) -> zmq.Socket[bytes]:
    """A socket that drops what it cannot deliver at close (``LINGER`` 0),
    disconnects a peer sending a frame over ``max_bytes`` (``MAXMSGSIZE``,
    checked by libzmq before the frame is buffered) and queues at most
    ``max_queued`` messages each way (``RCVHWM``, ``SNDHWM``)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.RCVHWM, max_queued)
    sock.setsockopt(zmq.SNDHWM, max_queued)
    return sock


async def wait_for_message(sock: zmq.Socket[bytes]) -> None:
    """Return once ``sock`` has a message to read (callers bound the wait
    with ``trio.move_on_after``)."""
    # Reading ZMQ_EVENTS resets the descriptor, so each wake-up is followed
    # by a fresh read of the events (module docstring).
    while not _events(sock) & zmq.POLLIN:
        await trio.lowlevel.wait_readable(sock.fileno())


async def wait_for_any(*socks: zmq.Socket[bytes]) -> None:
    """Return once one of ``socks`` has a message to read."""
    async with trio.open_nursery() as nursery:
        for sock in socks:

            async def one(sock: zmq.Socket[bytes] = sock) -> None:
                await wait_for_message(sock)
                nursery.cancel_scope.cancel()

            nursery.start_soon(one)


def _events(sock: zmq.Socket[bytes]) -> int:
    return cast(int, sock.getsockopt(zmq.EVENTS))


def receive_message(sock: zmq.Socket[bytes], max_frames: int) -> list[bytes] | None:
    """The next message of ``sock``, without waiting; None when there is
    none. A message of more than ``max_frames`` frames is read to its end
    (ZeroMQ delivers a message whole) and its frames past the first
    ``max_frames`` dropped as they are read."""
    try:
        first = sock.recv(zmq.NOBLOCK)
    except zmq.Again:
        return None
    frames = [first]
    while sock.getsockopt(zmq.RCVMORE):
        frame = sock.recv(zmq.NOBLOCK)
        if len(frames) <= max_frames:
            frames.append(frame)
    return frames


def close_socket(sock: zmq.Socket[bytes]) -> None:
    """Close ``sock`` now (idempotent), Trio told first (``close_context``)."""
    if not sock.closed:
        trio.lowlevel.notify_closing(sock.fileno())
        sock.close(linger=0)


def close_context(ctx: zmq.Context[zmq.Socket[bytes]], *socks: zmq.Socket[bytes]) -> None:
    """Close ``socks`` and ``ctx`` at once (``LINGER`` 0: nothing left to send
    holds them). Idempotent. Trio is told first that their descriptors go
    away (``trio.lowlevel.notify_closing``), so no task waits on a closed one."""
    for sock in socks:
        close_socket(sock)
    if not ctx.closed:
        ctx.destroy(linger=0)
