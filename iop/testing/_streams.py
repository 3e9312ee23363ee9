"""What a client saw of one streamed answer, and the assertions about it (sans-IO).

A ``ClientStream`` is filled by the platforms' clients (``feed`` with the
bytes as they arrive, ``finish`` at the end) or by a test's own client from
the raw bytes (``ClientStream.from_bytes``). It decodes the SSE events with
IOP's own decoder (``iop.wire._sse``) and keeps the Chat Completions facts a
test asserts on: the chunks, the text, every ``finish_reason``, every error
event, whether ``[DONE]`` came, and how the stream ended (the server closed
it, the client hung up, the transport failed).

A run's *terminal event* as a client sees it is a choice's ``finish_reason``
or an error event: exactly one of them, last but for a usage chunk, is how
every run must end (``assert_one_terminal``).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any, Final

from iop.wire import SSEDecoder

__all__ = ["ClientStream", "StreamEnd", "assert_one_terminal", "chat_body", "count_terminals"]

# The data of the event that ends an OpenAI stream.
DONE: Final = "[DONE]"
# The most events a failure message shows.
_SHOWN_EVENTS: Final = 6


def chat_body(model: str, prompt: str, *, stream: bool = True, **body: Any) -> dict[str, Any]:
    """A Chat Completions body: ``prompt`` as the one user message, ``body`` on top."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "stream": stream,
        **body,
    }


class StreamEnd(enum.Enum):
    """How a client's stream ended."""

    OPEN = "open"  # not yet
    CLOSED = "closed"  # the server ended the body
    HUNG_UP = "hung_up"  # the client closed it early (``hang_up_after``, the test chose to)
    TRANSPORT_ERROR = "transport_error"  # the connection failed mid-body


@dataclass
class ClientStream:
    """One streamed answer as the client received it.

    Attributes:
        status: The HTTP status.
        events: Every decoded event: a JSON object, or ``"[DONE]"``.
        started_at: ``time.monotonic()`` when the request was sent.
        ended_at: ``time.monotonic()`` when the stream ended (any way).
        end: How it ended.
        error: What the transport said, for ``TRANSPORT_ERROR``.
        body_bytes: Body bytes received.
        content_chunks: Chunks that carried content.
        sse: Whether the answer was an event stream (an error refused before
            the stream began is a JSON body, its one event).
    """

    status: int = 0
    events: list[Any] = field(default_factory=list)
    started_at: float = 0.0
    ended_at: float | None = None
    end: StreamEnd = StreamEnd.OPEN
    error: str = ""
    body_bytes: int = 0
    content_chunks: int = 0
    sse: bool = True
    _decoder: SSEDecoder = field(default_factory=SSEDecoder, repr=False)

    @classmethod
    def from_bytes(cls, body: bytes, *, status: int = 200) -> ClientStream:
        """A finished stream from a whole body."""
        stream = cls(status=status)
        stream.feed(body)
        stream.finish(StreamEnd.CLOSED, at=0.0)
        return stream

    def feed(self, data: bytes, *, max_content_chunks: int | None = None) -> int:
        """Decode ``data``; returns how many events it completed.

        ``max_content_chunks``: a client that hangs up after that many
        content chunks reads no further, even when one network read brought
        more (the edge writes what it holds at once: a short answer's
        chunks, its terminal and ``[DONE]`` can come in one read)."""
        self.body_bytes += len(data)
        n = 0
        for ev in self._decoder.feed(data):
            if max_content_chunks is not None and self.content_chunks >= max_content_chunks:
                break
            if ev.field is not None:
                continue
            if ev.data == DONE:
                self.events.append(DONE)
            else:
                try:
                    obj = json.loads(ev.data)
                except ValueError:
                    obj = {"_unparsed": ev.data}
                self.events.append(obj)
                if _has_content(obj):
                    self.content_chunks += 1
            n += 1
        return n

    def take(self, data: bytes, hang_up_after: int | None, *, at: float) -> bool:
        """Feed one read; True when the client hangs up now (``hang_up_after``
        content chunks seen; what else the read brought is not read)."""
        self.feed(data, max_content_chunks=hang_up_after)
        if hang_up_after is not None and self.content_chunks >= hang_up_after:
            self.finish(StreamEnd.HUNG_UP, at=at)
            return True
        return False

    def feed_body(self, body: bytes) -> None:
        """A whole non-stream answer (a JSON error before the stream began): one event."""
        self.sse = False
        self.body_bytes += len(body)
        try:
            self.events.append(json.loads(body))
        except ValueError:
            self.events.append({"_unparsed": body.decode("utf-8", "replace")})

    def finish(self, end: StreamEnd, *, at: float, error: str = "") -> None:
        """Record how and when the stream ended (the first call wins)."""
        if self.end is StreamEnd.OPEN:
            self.end, self.ended_at, self.error = end, at, error

    # --- what it carried -----------------------------------------------------

    @property
    def chunks(self) -> list[dict[str, Any]]:
        """The ``chat.completion.chunk`` objects."""
        return [e for e in self.events if isinstance(e, dict) and "error" not in e]

    @property
    def errors(self) -> list[dict[str, Any]]:
        """The error events' ``error`` objects."""
        return [e["error"] for e in self.events if isinstance(e, dict) and "error" in e]

    @property
    def done(self) -> bool:
        """Whether ``[DONE]`` arrived."""
        return DONE in self.events

    @property
    def text(self) -> str:
        """The content deltas, joined."""
        return "".join(
            c.get("delta", {}).get("content") or ""
            for chunk in self.chunks
            for c in chunk.get("choices") or ()
        )

    @property
    def finish_reasons(self) -> list[str]:
        """Every ``finish_reason`` received, in order."""
        return [
            c["finish_reason"]
            for chunk in self.chunks
            for c in chunk.get("choices") or ()
            if c.get("finish_reason")
        ]

    @property
    def finish_reason(self) -> str | None:
        """The last ``finish_reason``, if any."""
        reasons = self.finish_reasons
        return reasons[-1] if reasons else None

    @property
    def usage(self) -> dict[str, Any] | None:
        """The usage object, if a chunk carried one."""
        found = [c["usage"] for c in self.chunks if c.get("usage")]
        return found[-1] if found else None

    def describe(self) -> str:
        """A short account of the stream for failure messages."""
        shown = [_short(e) for e in self.events[-_SHOWN_EVENTS:]]
        more = len(self.events) - len(shown)
        head = f"... {more} earlier event(s), then " if more > 0 else ""
        how = self.end.value + (f" ({self.error})" if self.error else "")
        return (
            f"HTTP {self.status}, {len(self.events)} event(s), {self.body_bytes} body bytes, "
            f"ended: {how}; {head}last: {shown}"
        )


def _has_content(obj: Any) -> bool:
    if not isinstance(obj, dict):
        return False
    return any((c.get("delta") or {}).get("content") for c in obj.get("choices") or ())


def _short(event: Any) -> str:
    text = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
    return text if len(text) <= 160 else text[:157] + "..."


def count_terminals(stream: ClientStream) -> tuple[int, list[str]]:
    """The terminal events of ``stream``: how many, and each named
    (``finish_reason=stop``, ``error=<code>``)."""
    names = []
    for event in stream.events:
        if not isinstance(event, dict):
            continue
        if "error" in event:
            err = event["error"] or {}
            names.append(f"error={err.get('code') or err.get('type') or '?'}")
            continue
        for choice in event.get("choices") or ():
            if choice.get("finish_reason"):
                names.append(f"finish_reason={choice['finish_reason']}")
    return len(names), names


def assert_one_terminal(stream: ClientStream, *, kind: str | None = None) -> str:
    """Assert that ``stream`` ended with exactly one terminal event.

    A terminal event is a ``finish_reason`` or an error event; after it only a
    usage chunk and ``[DONE]`` may follow, and ``[DONE]`` must come. An answer
    refused before its stream began (a 4xx or 5xx JSON body) is one error.

    Args:
        stream: What the client received.
        kind: Also require this terminal: ``"finish"`` (any finish reason),
            ``"error"``, or an exact name (``"finish_reason=stop"``,
            ``"error=backend_protocol_error"``).

    Returns:
        The terminal's name, e.g. ``"finish_reason=stop"``.

    Raises:
        AssertionError: With what the stream carried instead.
    """
    __tracebackhide__ = True  # pytest: show the caller's line
    n, names = count_terminals(stream)
    if n != 1:
        found = ", ".join(names) if names else "none"
        raise AssertionError(
            f"expected exactly one terminal event (a finish_reason or an error), "
            f"found {n}: {found}. Stream: {stream.describe()}"
        )
    name = names[0]
    if stream.sse and not stream.done:
        raise AssertionError(f"terminal {name} but no [DONE] after it. Stream: {stream.describe()}")
    tail = _after_terminal(stream)
    if tail:
        raise AssertionError(
            f"events after the terminal {name} (only usage and [DONE] may follow): "
            f"{[_short(e) for e in tail]}"
        )
    if kind is not None and not (
        name == kind or name.startswith(("finish_reason=" if kind == "finish" else f"{kind}=",))
    ):
        raise AssertionError(
            f"expected a terminal {kind!r}, the run ended with {name}. Stream: {stream.describe()}"
        )
    return name


def _after_terminal(stream: ClientStream) -> list[Any]:
    seen = False
    tail = []
    for event in stream.events:
        if seen:
            usage_only = isinstance(event, dict) and not event.get("choices") and "usage" in event
            if event != DONE and not usage_only:
                tail.append(event)
            continue
        if isinstance(event, dict) and (
            "error" in event or any(c.get("finish_reason") for c in event.get("choices") or ())
        ):
            seen = True
    return tail
