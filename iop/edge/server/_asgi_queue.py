"""The ASGI receive queue of each edge request, which tells a disconnect at once.

Hypercorn gives each request's ASGI app a trio memory channel
(``hypercorn/trio/task_group.py``, ``TaskGroup.spawn_app``: at most
``max_app_queue_size`` messages) and puts in it the request body's
``http.request`` messages, then ``http.disconnect`` when the client's
connection ends. On an edge that holds thousands of idle streams open, each
costs twice: the channel pair (1.8 KiB), and a task per request that does
nothing but wait in ``receive`` for ``http.disconnect`` to cancel the answer
(quart-trio's rule, and ``_surface_asgi``'s before this module), since
nothing else reads the queue once the body is in: 2 to 3 KiB more
(``docs/benchmarks.md``, "Memory", "Second pass").

Here an HTTP request's queue is an ``AppQueue``: a ``OneToOneChannel`` (one
sender, hypercorn's connection task; one receiver, the app) that also calls
a callback when hypercorn puts ``http.disconnect`` in it. ``_surface_asgi``
sets that callback to cancel the answer's scope once the body is read: the
same cancel the watcher task made, from hypercorn's task, one step sooner,
with no task. The queue reaches the app in the scope's ``extensions`` (the
ASGI spec's place for what a server adds) under ``APP_QUEUE``; an app that
finds none (another server) works as before.

A WebSocket's queue (the node link's) is an ``AppQueue`` too, which hypercorn
fills with ``put``: no schedule point while there is room, so the frames of
one socket read are all queued before the link reader runs, and it takes
them with ``receive_nowait`` in one wake-up (``iop.runtime._link``,
``MAX_FRAMES_PER_WAKE``; ``AsgiFrameChannel.receive_nowait``).

Hypercorn builds that channel in its per-connection task group
(``TaskGroup.spawn_app``); the edge's task group (``EdgeTaskGroup`` in
``iop/edge/server/_hypercorn.py``) builds an ``AppQueue`` instead, and only
the edge's own server uses it: other hypercorn servers in the process
(``iop up``'s sim) are untouched. ``tests/edge/test_asgi_queue.py`` serves
through real sockets, so a hypercorn that stops asking the task group for
the queue fails it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import trio
from hypercorn.typing import ASGIReceiveEvent

from iop.runtime._channel import OneToOneChannel

__all__ = ["APP_QUEUE", "AppQueue", "app_queue"]

_DISCONNECTS: Final = frozenset({"http.disconnect", "websocket.disconnect"})

APP_QUEUE: Final = "iop.app_queue"
"""The key of a request's ``AppQueue`` in its scope's ``extensions``."""


class AppQueue(OneToOneChannel[ASGIReceiveEvent]):
    """An HTTP request's ASGI messages, from hypercorn to the app."""

    __slots__ = ("_disconnected", "_on_disconnect")

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._disconnected = False
        self._on_disconnect: Callable[[], None] | None = None

    async def send(self, event: ASGIReceiveEvent) -> None:
        if event["type"] in _DISCONNECTS and self._sender is not None:
            # hypercorn's connection task waits on a full queue (a link
            # reader that stopped reading), and the app's own task puts the
            # disconnect as its close ends the stream (``WSStream.app_send``):
            # a second sender. The disconnect goes in beyond the capacity: a
            # stream puts it once, and the app must hear it.
            self._force(event)
            await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            await super().send(event)
        # After the message is in, so that hypercorn's task goes on as it
        # would with trio's channel: the cancel lands at the app's next
        # checkpoint, as the watcher task's did.
        if event["type"] == "http.disconnect" and not self._disconnected:
            self._disconnected = True
            if self._on_disconnect is not None:
                self._on_disconnect()

    async def put(self, event: ASGIReceiveEvent) -> None:
        """``send`` with no schedule point when there is room (a WebSocket's
        queue: ``EdgeTaskGroup.spawn_app``).

        hypercorn puts each message of a socket read in turn; with a schedule
        point after each, the link reader ran after the first, and the
        streams its events woke wrote before the next was in. Without, every
        message of the read is queued before the reader runs, and it takes
        them in one wake-up (``iop.runtime._link``). hypercorn's task still
        waits, and so yields, when the queue is full, and passes a schedule
        point at its next socket read: a read is at most 64 KiB.
        """
        try:
            self.send_nowait(event)
        except trio.WouldBlock:
            await self.send(event)

    def _force(self, event: ASGIReceiveEvent) -> None:
        if self._send_closed:
            raise trio.ClosedResourceError
        if self._receive_closed:
            raise trio.BrokenResourceError
        self._items.append(event)
        self._wake_receiver()

    def on_disconnect(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` when the client disconnects (at once if it has); None: don't.

        It runs in the task that puts ``http.disconnect`` in: it must neither
        block nor raise. Hypercorn puts it in at the end of every response
        too, from the app's task, inside the app's last ``send``, while it
        readies the connection for its next request: take the callback back
        (None) before that ``send``, or it cancels the app in the middle of
        hypercorn's bookkeeping.
        """
        self._on_disconnect = callback
        if callback is not None and self._disconnected:
            callback()


def app_queue(scope: dict[str, Any]) -> AppQueue | None:
    """The request's ``AppQueue``, when the edge's hypercorn made one."""
    extensions = scope.get("extensions")
    queue = extensions.get(APP_QUEUE) if extensions else None
    return queue if isinstance(queue, AppQueue) else None
