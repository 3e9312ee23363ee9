"""A sans-IO Server-Sent Events decoder and encoder (WHATWG HTML §9.2).

Theory of operation
-------------------
:class:`SSEDecoder` implements the "event stream interpretation" algorithm of
https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation
over raw bytes, without doing any I/O: the caller feeds whatever the transport
returned and gets back the events it completed.

The spec is written for a decoded character stream; we work on bytes and
decode only field values, which gives the same result because every byte the
parser looks at (CR, LF, ``:`` and space) is ASCII. ASCII bytes never occur
inside a multi-byte UTF-8 sequence, and Python's ``"replace"`` error handler
never folds an ASCII byte into a U+FFFD, so splitting before decoding is
exactly splitting after decoding. Only CR and LF end a line; U+2028, U+2029,
U+0085 and friends are data (``str.splitlines`` would be wrong here).

Per feed:

1. One leading UTF-8 BOM is dropped (held back while fewer than three bytes
   have arrived, so a BOM split across feeds is still recognised).
2. Line ends are normalised to LF *within the chunk*: CRLF and lone CR become
   LF. A chunk that ends with CR sets a "skip next LF" flag, so a CRLF split
   across two feeds counts as one line end (openai-python's
   ``_SSELineDecoder`` does the same).
3. The chunk is split on LF with one C-level ``bytes.split``. The first piece
   completes the pending partial line, the last piece (possibly empty) becomes
   the new partial line, and the rest are whole lines. The partial line never
   contains a terminator, so each byte is scanned for line ends exactly once:
   the previous scan always stopped at the end of the partial buffer.
4. Each complete line is interpreted per the spec: empty line dispatches,
   ``:`` starts a comment, otherwise the field name is the text before the
   first colon and the value the rest minus one leading space.

Non-standard fields: the spec ignores any field name it does not know, and
so does the decoder, unless the caller names it in ``surface_fields``. Each
such line is then returned, in stream order, as an ``SSEEvent`` whose
``field`` is the field's name and ``data`` its value, at the line itself and
without touching the event being built. llama.cpp builds before PR #16109
report a mid-stream failure as an ``error: {...}`` line followed by
``data: [DONE]`` (docs/architecture.md, "Backend streams"): a spec-conformant
reader sees a successful, empty stream.

At EOF (:meth:`SSEDecoder.close`) the incomplete trailing event is not
dispatched, as the spec requires; its pending data is returned instead so the
caller may be lenient about a final ``data: [DONE]`` with no blank line
(docs/architecture.md, "Facts about the backends: SSE framing").

Memory is bounded by ``max_line_bytes``: an unterminated line longer than that
(counted without its terminator, across any number of feeds) and a data
buffer longer than that both raise :class:`~iop.errors.BackendProtocolError`
with ``code="sse_line_too_long"``. After raising, the decoder is closed.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Final

import msgspec

from iop.errors import BackendProtocolError, ErrorCode, InvariantError

__all__ = [
    "DEFAULT_MAX_LINE_BYTES",
    "DONE",
    "SSEDecoder",
    "SSEEvent",
    "encode_comment",
    "encode_event",
]

# 16 MiB. Ollama and vLLM's Mistral tool parser send a whole tool call's
# arguments in one ``data:`` line, and Go's 64 KiB ``bufio.Scanner`` default
# is a known failure with those ("token too long"; docs/architecture.md,
# "Facts about the backends: SSE framing"), so the
# limit must be far above any real line. It exists only to bound the memory a
# single run can be made to buffer by a broken or hostile backend.
DEFAULT_MAX_LINE_BYTES: Final[int] = 16 * 1024 * 1024

DONE: Final[bytes] = b"data: [DONE]\n\n"

_BOM: Final[bytes] = b"\xef\xbb\xbf"
_STANDARD_FIELDS: Final = frozenset({"data", "event", "id", "retry"})


class SSEEvent(msgspec.Struct, frozen=True, gc=False):
    """One dispatched event, or one surfaced non-standard field line.

    Attributes:
        data: The data buffer, lines joined with LF, final LF removed.
        event: The event type; ``"message"`` when no (or an empty) ``event``
            field was given.
        id: The last event ID in force at dispatch (it persists across events
            until the server changes it); ``None`` when unset or reset by an
            empty ``id`` field.
        retry: The reconnection time in ms, only if this event's block carried
            a valid ``retry`` field.
        field: ``None`` for a dispatched event. For a line of a field named in
            the decoder's ``surface_fields``: the field's name (``data`` is
            then its value, and the other attributes keep their defaults).
    """

    data: str
    event: str = "message"
    id: str | None = None
    retry: int | None = None
    field: str | None = None


class SSEDecoder:
    """Incremental, sans-IO SSE decoder (see the module docstring).

    Args:
        max_line_bytes: Largest accepted line, in bytes, not counting its
            terminator; also the largest accepted data buffer (the sum over an
            event's ``data`` lines of value bytes plus one LF each).
        surface_fields: Non-standard field names to return instead of
            ignoring (see the module docstring); the standard ones (``data``,
            ``event``, ``id``, ``retry``) cannot be surfaced.

    Raises:
        ValueError: If ``max_line_bytes`` is not positive.
    """

    __slots__ = (
        "_block_retry",
        "_bom_buf",
        "_bom_pending",
        "_closed",
        "_data",
        "_data_bytes",
        "_event_type",
        "_id_buffer",
        "_last_event_id",
        "_max",
        "_partial",
        "_retry",
        "_skip_lf",
        "_surface",
    )

    def __init__(
        self,
        *,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        surface_fields: Collection[str] = (),
    ) -> None:
        if max_line_bytes <= 0:
            raise ValueError(f"max_line_bytes must be positive, got {max_line_bytes}")
        standard = _STANDARD_FIELDS.intersection(surface_fields)
        if standard:
            raise ValueError(f"standard SSE fields cannot be surfaced: {sorted(standard)}")
        self._max = max_line_bytes
        self._surface = frozenset(f.encode() for f in surface_fields)
        self._partial = bytearray()  # the current unterminated line, no CR/LF in it
        self._skip_lf = False  # the last chunk ended with CR: drop a leading LF
        self._bom_pending = True
        self._bom_buf = b""  # up to two bytes that may still become a BOM
        self._closed = False
        self._data: list[str] = []  # the spec's data buffer, one entry per line
        self._data_bytes = 0
        self._event_type = ""
        self._id_buffer = ""  # the spec's "last event ID buffer"
        self._last_event_id = ""  # the spec's "last event ID string"
        self._block_retry: int | None = None
        self._retry: int | None = None

    @property
    def last_event_id(self) -> str:
        """The last event ID string: the ID buffer as of the last dispatch.

        Per spec it is updated at every blank line (even one that dispatches
        nothing), not when the ``id`` field is read; ``""`` means none.
        """
        return self._last_event_id

    @property
    def retry(self) -> int | None:
        """The reconnection time (ms) from the last valid ``retry`` field, if any."""
        return self._retry

    def feed(self, data: bytes) -> list[SSEEvent]:
        """Feed bytes as they arrive (any split, even mid-UTF-8 or mid-CRLF).

        Args:
            data: The next bytes of the stream.

        Returns:
            The events completed by these bytes, in order (often empty).

        Raises:
            BackendProtocolError: ``code="sse_line_too_long"`` if a line or a
                data buffer exceeds ``max_line_bytes``; the decoder is then
                closed and events completed earlier in the same chunk are lost.
            InvariantError: If called after :meth:`close`.
        """
        if self._closed:
            raise InvariantError("SSEDecoder.feed() called after close()")
        if self._bom_pending:
            if self._bom_buf:
                data = self._bom_buf + data
            if len(data) < 3 and _BOM.startswith(data):
                self._bom_buf = data
                return []
            self._bom_pending = False
            self._bom_buf = b""
            if data.startswith(_BOM):
                data = data[3:]
        if not data:
            return []
        if self._skip_lf:
            self._skip_lf = False
            if data[0] == 0x0A:
                data = data[1:]
                if not data:
                    return []
        if b"\r" in data:
            self._skip_lf = data[-1] == 0x0D
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

        partial = self._partial
        limit = self._max
        if b"\n" not in data:
            if len(partial) + len(data) > limit:
                self._fail()
            partial += data
            return []

        lines = data.split(b"\n")
        if len(partial) + len(data) > limit and (
            len(partial) + len(lines[0]) > limit or max(map(len, lines)) > limit
        ):
            self._fail()
        if partial:
            partial += lines[0]
            lines[0] = bytes(partial)
            partial.clear()
        last = lines.pop()
        if last:
            partial += last

        events: list[SSEEvent] = []
        for line in lines:
            if not line:
                # Dispatch (the spec's "dispatch the event" steps).
                self._last_event_id = self._id_buffer
                if self._data:
                    d = self._data
                    events.append(
                        SSEEvent(
                            d[0] if len(d) == 1 else "\n".join(d),
                            self._event_type or "message",
                            self._id_buffer or None,
                            self._block_retry,
                        )
                    )
                    self._data = []
                    self._data_bytes = 0
                self._event_type = ""
                self._block_retry = None
                continue
            colon = line.find(b":")
            if colon == 0:
                continue  # comment
            if colon < 0:
                field = line
                value = b""
            else:
                field = line[:colon]
                start = colon + 1
                if line.startswith(b" ", start):
                    start += 1
                value = line[start:]
            if field == b"data":
                self._data_bytes += len(value) + 1
                if self._data_bytes > limit:
                    self._fail()
                self._data.append(value.decode("utf-8", "replace"))
            elif field == b"event":
                self._event_type = value.decode("utf-8", "replace")
            elif field == b"id":
                if b"\x00" not in value:
                    self._id_buffer = value.decode("utf-8", "replace")
            elif field == b"retry":
                retry = _parse_retry(value)
                if retry is not None:
                    self._retry = self._block_retry = retry
            elif field in self._surface:
                events.append(SSEEvent(value.decode("utf-8", "replace"), field=field.decode()))
            # Any other field name is ignored.
        return events

    def close(self) -> str | None:
        """Signal EOF.

        Per spec the incomplete trailing event is *not* dispatched. Its
        pending data buffer is returned instead (lines joined with LF, the
        trailing LF stripped), including a final unterminated ``data`` line,
        so a caller can be lenient about a final ``data: [DONE]`` that lacks
        its blank line. An unterminated ``id`` or ``retry`` line does not
        change :attr:`last_event_id` or :attr:`retry`. Calling ``close()``
        again returns ``None``.

        Returns:
            The pending data, or ``None`` if no data was pending.
        """
        if self._closed:
            return None
        self._closed = True
        pending = self._data
        line = self._bom_buf + bytes(self._partial)
        if line:
            colon = line.find(b":")
            if colon < 0 and line == b"data":
                pending.append("")
            elif colon > 0 and line[:colon] == b"data":
                start = colon + 1
                if line.startswith(b" ", start):
                    start += 1
                pending.append(line[start:].decode("utf-8", "replace"))
        self._reset()
        return "\n".join(pending) if pending else None

    def _fail(self) -> None:
        self._closed = True
        self._reset()
        raise BackendProtocolError(
            f"SSE line exceeds {self._max} bytes",
            code=ErrorCode.SSE_LINE_TOO_LONG,
        )

    def _reset(self) -> None:
        self._partial = bytearray()
        self._bom_buf = b""
        self._data = []
        self._data_bytes = 0


def _parse_retry(value: bytes) -> int | None:
    # bytes.isdigit() is ASCII-only; str.isdigit() would accept U+00B2 or U+FF13.
    if not value.isdigit():
        return None
    digits = value.lstrip(b"0") or b"0"
    try:
        return int(digits)
    except ValueError:  # more digits than sys.get_int_max_str_digits()
        return None


def _check_line(name: str, value: str) -> None:
    if "\n" in value or "\r" in value:
        raise ValueError(f"SSE {name} must not contain CR or LF: {value!r}")


def encode_event(
    data: str,
    *,
    event: str | None = None,
    id: str | None = None,
    retry: int | None = None,
) -> bytes:
    """Encode one event as UTF-8 bytes, terminated by a blank line.

    Fields are written as ``event``, ``id``, ``retry``, then one ``data:``
    line per line of ``data``; CR, LF and CRLF all separate lines of
    ``data`` (a decoder gives them back as LF).

    Args:
        data: The event data; may be empty or span several lines.
        event: The event type, or ``None`` to omit the field (``"message"``).
        id: The event ID, or ``None`` to omit the field; ``""`` resets the
            receiver's last event ID.
        retry: The reconnection time in ms, or ``None`` to omit the field.

    Returns:
        The encoded event.

    Raises:
        ValueError: If ``event`` or ``id`` contains CR or LF, ``id``
            contains NUL, or ``retry`` is negative.
    """
    head = ""
    if event is not None:
        _check_line("event", event)
        head = f"event: {event}\n"
    if id is not None:
        _check_line("id", id)
        if "\x00" in id:
            raise ValueError(f"SSE id must not contain NUL: {id!r}")
        head += f"id: {id}\n"
    if retry is not None:
        if retry < 0:
            raise ValueError(f"SSE retry must be a non-negative integer, got {retry}")
        head += f"retry: {int(retry)}\n"
    if "\r" in data:
        data = data.replace("\r\n", "\n").replace("\r", "\n")
    if "\n" in data:
        data = data.replace("\n", "\ndata: ")
    return f"{head}data: {data}\n\n".encode()


def encode_comment(text: str = "") -> bytes:
    """Encode a comment line and a blank line, e.g. for keep-alives.

    Args:
        text: The comment text; empty gives ``b":\\n\\n"``.

    Returns:
        ``b": text\\n\\n"``, or ``b":\\n\\n"`` for empty text.

    Raises:
        ValueError: If ``text`` contains CR or LF.
    """
    if not text:
        return b":\n\n"
    _check_line("comment", text)
    return f": {text}\n\n".encode()
