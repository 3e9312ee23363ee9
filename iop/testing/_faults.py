"""Backend faults by SSE event, for the platform fixtures (sans-IO).

A ``Fault`` says how a backend misbehaves in a user's terms ("stall after 3
chunks", "reset the connection after 2"); ``Fault.reply(body)`` turns it into
the byte-level ``Reply`` a ``FakeBackend`` plays, cutting the body exactly at
the end of the N-th SSE event (``event_ends``). ``Fault.sim_overrides()`` is
the same fault for ``iop sim``, as its per-request ``iop_sim`` object, where
the sim has one. ``synthetic_stream(n)`` is a vLLM-shaped stream of ``n``
content chunks, for runs longer than a transcript (a slow reader needs more
bytes than the sockets between it and the edge buffer).
"""

from __future__ import annotations

import enum
import math
import re
from typing import Any, Final

import msgspec

from iop.testing._fake_backend import Reply, Split

__all__ = ["Fault", "FaultKind", "event_ends", "synthetic_stream"]

# An SSE event ends at a blank line (WHATWG HTML §9.2.6): LF LF, CRLF CRLF or CR CR.
_EVENT_END: Final = re.compile(rb"\r\n\r\n|\n\n|\r\r")


def event_ends(body: bytes) -> list[int]:
    """The offset just past each SSE event of ``body`` (past its blank line)."""
    return [m.end() for m in _EVENT_END.finditer(body)]


class FaultKind(enum.Enum):
    """What a ``Fault`` does."""

    NONE = "none"
    STALL = "stall"  # send nothing more after N events (for ``seconds``)
    TRUNCATE = "truncate"  # close the connection (FIN) after N events, body unfinished
    RESET = "reset"  # reset the connection (RST) after N events
    STALL_BEFORE_HEADERS = "stall_before_headers"  # no status line for ``seconds``
    HTTP_ERROR = "http_error"  # answer ``status`` with an OpenAI error body
    PACED = "paced"  # every event, ``seconds`` apart (a slow backend)
    STOP_READING = "stop_reading"  # read the request head, never its body


class Fault(msgspec.Struct, frozen=True, kw_only=True):
    """How the backend misbehaves on one request. Use the constructors.

    Attributes:
        kind: What it does.
        after_chunks: SSE events sent before the stall, truncation or reset.
        seconds: Length of a stall (infinite: until the client leaves), or
            the pause between events of a paced stream.
        status: The HTTP status of an ``http_error``, or of the early answer
            of a ``stop_reading`` (0: none, it stalls).
    """

    kind: FaultKind = FaultKind.NONE
    after_chunks: int = 0
    seconds: float = math.inf
    status: int = 500

    @classmethod
    def none(cls) -> Fault:
        """No fault: the body whole, at once."""
        return cls()

    @classmethod
    def stall(cls, after_chunks: int, seconds: float = math.inf) -> Fault:
        """Send ``after_chunks`` events, then nothing for ``seconds`` (then the rest)."""
        return cls(kind=FaultKind.STALL, after_chunks=after_chunks, seconds=seconds)

    @classmethod
    def truncate(cls, after_chunks: int) -> Fault:
        """Send ``after_chunks`` events, then close the connection (FIN) mid-body."""
        return cls(kind=FaultKind.TRUNCATE, after_chunks=after_chunks)

    @classmethod
    def reset(cls, after_chunks: int) -> Fault:
        """Send ``after_chunks`` events, then reset the connection (RST)."""
        return cls(kind=FaultKind.RESET, after_chunks=after_chunks)

    @classmethod
    def stall_before_headers(cls, seconds: float = math.inf) -> Fault:
        """Accept the request, then send no byte for ``seconds``."""
        return cls(kind=FaultKind.STALL_BEFORE_HEADERS, seconds=seconds)

    @classmethod
    def http_error(cls, status: int = 500) -> Fault:
        """Answer ``status`` with an OpenAI-shaped error body."""
        return cls(kind=FaultKind.HTTP_ERROR, status=status)

    @classmethod
    def paced(cls, seconds: float) -> Fault:
        """Send one event every ``seconds`` (a slow backend)."""
        return cls(kind=FaultKind.PACED, seconds=seconds)

    @classmethod
    def stop_reading(cls, *, answer_status: int = 0, seconds: float = math.inf) -> Fault:
        """Read the request head, then never the body (``FakeBackend`` only).

        With ``answer_status`` (413, say) the backend answers at once, its body
        unread, as a server with a smaller body limit does; without, it stalls
        for ``seconds``. Either way it then closes the connection (RST). A
        request body larger than the sockets' buffers (megabytes) blocks the
        node's writes until its write timeout.
        """
        return cls(kind=FaultKind.STOP_READING, status=answer_status, seconds=seconds)

    def _cut(self, body: bytes) -> int:
        ends = event_ends(body)
        if self.after_chunks < 0:
            raise ValueError("after_chunks must be >= 0")
        if self.after_chunks > len(ends):
            raise ValueError(f"the body has {len(ends)} SSE events, fewer than {self.after_chunks}")
        return ends[self.after_chunks - 1] if self.after_chunks else 0

    def reply(self, body: bytes) -> Reply:
        """The ``Reply`` that plays ``body`` (an SSE body) with this fault."""
        kind = self.kind
        events = Split.at(*event_ends(body))
        if kind is FaultKind.NONE:
            return Reply.sse(body)
        if kind is FaultKind.STALL:
            return Reply.sse(
                body, split=events, stall_after_bytes=self._cut(body), stall_s=self.seconds
            )
        if kind in (FaultKind.TRUNCATE, FaultKind.RESET):
            return Reply.sse(
                body,
                split=events,
                truncate_after_bytes=self._cut(body),
                reset=kind is FaultKind.RESET,
            )
        if kind is FaultKind.STALL_BEFORE_HEADERS:
            return Reply.sse(body, stall_before_headers=True, stall_s=self.seconds)
        if kind is FaultKind.PACED:
            return Reply.sse(body, split=events, delay_s=self.seconds)
        if kind is FaultKind.STOP_READING:
            if not self.status:
                return Reply.sse(
                    body, stall_before_headers=True, stall_s=self.seconds, stop_reading=True
                )
            return _error_reply(self.status, stop_reading=True)
        return _error_reply(self.status)

    def sim_overrides(self) -> dict[str, Any]:
        """This fault as ``iop sim``'s per-request ``iop_sim`` object.

        Raises:
            ValueError: The sim has no such fault (a reset, a timed stall, a
                stall before headers of a streamed answer, an HTTP status
                other than 500, 429 and 401).
        """
        kind = self.kind
        if kind is FaultKind.NONE:
            return {}
        if kind is FaultKind.STALL and math.isinf(self.seconds):
            return {"failure": "stall_mid_stream", "fail_after_tokens": self.after_chunks}
        if kind is FaultKind.TRUNCATE:
            return {"failure": "truncate", "fail_after_tokens": self.after_chunks}
        if kind is FaultKind.HTTP_ERROR and self.status in (500, 429, 401):
            return {"failure": f"http_{self.status}"}
        if kind is FaultKind.PACED and self.seconds > 0:
            return {"tokens_per_s": 1.0 / self.seconds}
        raise ValueError(f"iop sim cannot play {self!r}; use the fake backend")


def _error_reply(status: int, **options: Any) -> Reply:
    message = f"iop.testing: injected HTTP {status}"
    error = {"error": {"message": message, "type": "server_error", "code": status}}
    return Reply.json(error, status=status, **options)


def synthetic_stream(chunks: int, *, text: str = "tok ", model: str = "iop-fake") -> bytes:
    """A vLLM-shaped chat stream: a role chunk, ``chunks`` content chunks of
    ``text``, a ``stop`` chunk, a usage chunk and ``[DONE]``."""

    def event(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = {
            "id": "chatcmpl-iop-testing",
            "object": "chat.completion.chunk",
            "created": 1755600000,
            "model": model,
            "choices": [choice],
            **extra,
        }
        return b"data: " + msgspec.json.encode(obj) + b"\n\n"

    usage = {"prompt_tokens": 8, "completion_tokens": chunks, "total_tokens": 8 + chunks}
    parts = [event({"role": "assistant", "content": ""})]
    parts += [event({"content": text})] * chunks
    parts.append(event({"content": ""}, "stop"))
    tail = {"id": "chatcmpl-iop-testing", "object": "chat.completion.chunk", "created": 1755600000}
    parts.append(
        b"data: "
        + msgspec.json.encode({**tail, "model": model, "choices": [], "usage": usage})
        + b"\n\n"
    )
    parts.append(b"data: [DONE]\n\n")
    return b"".join(parts)
