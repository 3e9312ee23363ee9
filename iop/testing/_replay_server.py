"""The fake backend as a process: a ``FakeBackend`` scripted over a control port.

``python -m iop.testing._replay_server --model M`` serves two loopback ports
in one trio run:

* the **backend** port: a ``FakeBackend`` (``iop.testing._fake_backend``)
  answering ``GET /v1/models`` with ``M`` and ``POST /v1/chat/completions``
  with the queued replies, else with the default one (a transcript replayed
  whole);
* the **control** port: another ``FakeBackend`` whose routes are handlers
  acting on the first. Its bodies are msgpack (which, unlike JSON, carries
  bytes and an infinite stall as they are):

  - ``POST /script``: a ``ScriptCommand``; queues replies for a path (or
    replaces its default);
  - ``GET /requests``: every request the backend received, each with what
    became of its connection (``RequestRecord``), times on the machine's
    monotonic clock (``time.monotonic()``, ``CLOCK_MONOTONIC``: the same in
    every process, so a test compares them with its own).

It prints ``iop fake backend on http://127.0.0.1:PORT/v1 control
http://127.0.0.1:PORT`` once both listen (``FAKE_READY``) and exits on
SIGTERM or SIGINT. The loopback platform (``iop.testing._platform``) runs it
as a real process, like ``iop sim``, so that the edge and node under test
talk to a backend over real sockets whatever the test's own event loop.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Final

import msgspec
import trio

from iop.testing._fake_backend import (
    CHAT_COMPLETIONS_PATH,
    MODELS_PATH,
    FakeBackend,
    RecordedRequest,
    Reply,
)
from iop.testing._transcripts import transcript_body

__all__ = [
    "CONTROL_REQUESTS",
    "CONTROL_SCRIPT",
    "DEFAULT_TRANSCRIPT",
    "FAKE_READY",
    "RequestRecord",
    "ScriptCommand",
    "main",
]

# Its start-up line: group 1 the backend's base URL, group 2 the control URL.
FAKE_READY: Final = r"iop fake backend on (http://\S+)/v1 control (http://\S+)"
CONTROL_SCRIPT: Final = "/script"
CONTROL_REQUESTS: Final = "/requests"
# What a chat request gets when nothing is queued: a plain vLLM stream with usage.
DEFAULT_TRANSCRIPT: Final = "vllm_text_stream_with_usage.txt"
DEFAULT_REPLY: Final = Reply.sse(transcript_body(DEFAULT_TRANSCRIPT))


class ScriptCommand(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /script``: what the backend answers on ``path`` next.

    Attributes:
        path: The request path (``/v1/chat/completions``).
        reset: First drop what is queued for ``path`` (and, for chat, put
            back the default transcript).
        replies: Queued, one per request, in order.
        default: Replaces the path's default reply (when not None).
    """

    path: str = CHAT_COMPLETIONS_PATH
    reset: bool = False
    replies: list[Reply] = []
    default: Reply | None = None


class RequestRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A request the backend received and what became of its connection.

    Attributes:
        index: Its position among all the requests received, from 0.
        method: ``GET``, ``POST``.
        path: The request path.
        body: The raw request body.
        received_at: ``time.monotonic()`` once the request was complete.
        connection: The id of the connection it came on.
        connection_state: That connection's state now (``ConnState`` value).
        closed_at: ``time.monotonic()`` when that connection ended, if it has.
        close_cause: Who ended it (``CloseCause`` value), if it has ended.
        closed_in: The state it was in when it ended (``stalled``, ``sending``...).
        body_bytes_sent: Response body bytes written on that connection so far.
        reading_stopped: A ``stop_reading`` reply stopped the connection's reads.
    """

    index: int
    method: str
    path: str
    body: bytes
    received_at: float
    connection: int
    connection_state: str
    closed_at: float | None = None
    close_cause: str | None = None
    closed_in: str | None = None
    body_bytes_sent: int = 0
    reading_stopped: bool = False


def _records(backend: FakeBackend) -> list[RequestRecord]:
    # trio's clock has its own offset; both clocks are monotonic, so one
    # difference converts every time stamp.
    offset = time.monotonic() - trio.current_time()
    out = []
    for i, req in enumerate(backend.requests):
        conn = req.connection
        assert conn is not None  # a FakeBackend's requests always have one
        out.append(
            RequestRecord(
                index=i,
                method=req.method,
                path=req.path,
                body=req.body,
                received_at=req.received_at + offset,
                connection=conn.id,
                connection_state=conn.state.value,
                closed_at=None if conn.closed_at is None else conn.closed_at + offset,
                close_cause=None if conn.close_cause is None else conn.close_cause.value,
                closed_in=None if conn.closed_in is None else conn.closed_in.value,
                body_bytes_sent=conn.body_bytes_sent,
                reading_stopped=conn.reading_stopped,
            )
        )
    return out


def _msgpack(payload: object) -> Reply:
    return Reply(
        headers=(("content-type", "application/msgpack"),), body=msgspec.msgpack.encode(payload)
    )


def _control(backend: FakeBackend, control: FakeBackend) -> None:
    def script(request: RecordedRequest) -> Reply:
        try:
            cmd = msgspec.msgpack.decode(request.body, type=ScriptCommand)
        except msgspec.DecodeError as exc:
            return Reply.text(f"bad script command: {exc}", status=400)
        if cmd.reset:
            backend.clear(cmd.path)
            if cmd.path == CHAT_COMPLETIONS_PATH:
                backend.route(cmd.path, DEFAULT_REPLY)
        if cmd.replies:
            backend.script(cmd.path, *cmd.replies)
        if cmd.default is not None:
            backend.route(cmd.path, cmd.default)
        return _msgpack({"queued": backend.pending(cmd.path)})

    control.route(CONTROL_SCRIPT, script)
    control.route(CONTROL_REQUESTS, lambda _request: _msgpack(_records(backend)))


async def serve(model: str) -> None:
    """Serve the backend and its control port until SIGTERM or SIGINT."""
    backend, control = FakeBackend(), FakeBackend()
    backend.route(
        MODELS_PATH, Reply.json({"object": "list", "data": [{"id": model, "object": "model"}]})
    )
    backend.route(CHAT_COMPLETIONS_PATH, DEFAULT_REPLY)
    _control(backend, control)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(backend.serve)
            control_url = await nursery.start(control.serve)
            print(f"iop fake backend on {url}/v1 control {control_url}", flush=True)
            async for _ in signals:
                break
            await backend.aclose()
            await control.aclose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m iop.testing._replay_server")
    parser.add_argument("--model", default="iop-fake", help="the model /v1/models lists")
    args = parser.parse_args(argv)
    trio.run(serve, args.model)
    sys.exit(0)


if __name__ == "__main__":
    main()
