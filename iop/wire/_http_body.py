"""A sans-IO reader of an HTTP/1.1 response body's framing (RFC 9112 §6-7).

``BodyReader`` takes the bytes that follow a response head, as the socket
returns them, and gives back the body's bytes without the framing: for a
chunked body, every chunk completed by this read *joined into one piece*;
for a ``Content-Length`` body, up to that many bytes; for a body delimited
by the connection's close, everything until EOF.

Why not h11's reader: the node reads a backend's streamed answer, where
vLLM, llama.cpp and ``iop sim`` write each SSE event as its own HTTP chunk.
h11 returns one ``Data`` event per chunk, through its state machine and
header validation, about 10 µs a chunk on the benchmark machine
(docs/benchmarks.md, "Per chunk and non-streaming (second pass)"); this
reader scans each read once with ``bytes.find`` and returns one piece per
read, however many chunks it held. h11 still writes the request and reads
the response head (``iop.adapters._pool``).

Framing errors (a chunk size that is not hex, a chunk not followed by CRLF,
a size line or trailer longer than ``MAX_LINE_BYTES``, bytes after the end
of a ``Content-Length`` body, EOF before the end) raise
``BodyFramingError``; the connection must then be closed.

Chunk extensions (``;name=value``) and trailer fields are read and dropped,
as h11 does.
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = ["MAX_LINE_BYTES", "BodyFraming", "BodyFramingError", "BodyReader"]

# A chunk-size line (hex size, extensions) or a trailer field longer than
# this is a broken or hostile server; h11 allows 16 KiB for a whole head.
MAX_LINE_BYTES: Final = 16 * 1024

_HEX: Final = b"0123456789abcdefABCDEF"
_MAX_HEX_DIGITS: Final = 16  # 2**64 bytes: no real chunk comes near


class BodyFramingError(Exception):
    """The body's framing is broken: the connection cannot be reused."""


class BodyFraming(enum.Enum):
    """How the end of a response body is known (RFC 9112 §6.3)."""

    NONE = "none"  # 1xx, 204, 304, or the answer to HEAD: no body
    CHUNKED = "chunked"
    LENGTH = "length"
    CLOSE = "close"  # until the server closes the connection


class _Chunk(enum.Enum):
    SIZE = "size"  # reading a chunk-size line
    DATA = "data"  # reading a chunk's data
    DATA_END = "data_end"  # the CRLF after a chunk's data
    TRAILER = "trailer"  # the trailer fields after the last chunk
    DONE = "done"


class BodyReader:
    """The framing of one response body (module docstring).

    Args:
        framing: How the body ends.
        length: The ``Content-Length`` (``BodyFraming.LENGTH`` only).
    """

    __slots__ = ("_buf", "_framing", "_left", "_state", "done")

    def __init__(self, framing: BodyFraming, length: int = 0) -> None:
        self._framing = framing
        self._left = length  # LENGTH: bytes still to come; CHUNKED: of this chunk
        self._buf = b""  # CHUNKED: an incomplete size line, trailer or CRLF
        self._state = _Chunk.SIZE
        self.done = framing is BodyFraming.NONE or (framing is BodyFraming.LENGTH and length == 0)

    def feed(self, data: bytes) -> bytes:
        """The body bytes that ``data`` completes (maybe empty).

        Raises:
            BodyFramingError: Broken framing, or bytes after the body's end.
        """
        if self.done:
            if data:
                raise BodyFramingError("the server sent bytes after the response body")
            return b""
        framing = self._framing
        if framing is BodyFraming.CHUNKED:
            return self._chunked(data)
        if framing is BodyFraming.LENGTH:
            if len(data) > self._left:
                raise BodyFramingError("the server sent more than its Content-Length")
            self._left -= len(data)
            self.done = self._left == 0
            return data
        return data  # CLOSE: everything, until EOF

    def feed_eof(self) -> None:
        """The server closed the connection.

        Raises:
            BodyFramingError: The body had not ended (only a CLOSE body
                ends with EOF).
        """
        if self.done:
            return
        if self._framing is BodyFraming.CLOSE:
            self.done = True
            return
        raise BodyFramingError(
            "peer closed connection without sending complete message body"
            f" ({self._framing.value} body)"
        )

    def _chunked(self, data: bytes) -> bytes:
        if self._buf:
            data = self._buf + data
            self._buf = b""
        out: list[bytes] = []
        pos = 0
        end = len(data)
        state = self._state
        while pos < end:
            if state is _Chunk.DATA:
                take = min(self._left, end - pos)
                out.append(data[pos : pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    state = _Chunk.DATA_END
            elif state is _Chunk.DATA_END:
                if end - pos < 2:
                    if data[pos:] != b"\r":
                        raise BodyFramingError("a chunk's data is not followed by CRLF")
                    break
                if data[pos : pos + 2] != b"\r\n":
                    raise BodyFramingError("a chunk's data is not followed by CRLF")
                pos += 2
                state = _Chunk.SIZE
            else:  # SIZE or TRAILER: a line
                nl = data.find(b"\n", pos)
                if nl < 0:
                    if end - pos > MAX_LINE_BYTES:
                        raise BodyFramingError(f"a chunk line exceeds {MAX_LINE_BYTES} bytes")
                    break
                if nl - pos > MAX_LINE_BYTES:
                    raise BodyFramingError(f"a chunk line exceeds {MAX_LINE_BYTES} bytes")
                line = data[pos:nl]
                pos = nl + 1
                if line.endswith(b"\r"):
                    line = line[:-1]
                if state is _Chunk.TRAILER:
                    if not line:
                        state = _Chunk.DONE
                        self.done = True
                        if pos < end:
                            raise BodyFramingError("the server sent bytes after the response body")
                        break
                    continue  # a trailer field: dropped
                size = _chunk_size(line)
                if size == 0:
                    state = _Chunk.TRAILER
                    continue
                stop = pos + size
                if stop + 2 <= end:
                    # The whole chunk and its CRLF are here (the usual case:
                    # one read holds whole SSE events): no trip through DATA.
                    if data[stop : stop + 2] != b"\r\n":
                        raise BodyFramingError("a chunk's data is not followed by CRLF")
                    out.append(data[pos:stop])
                    pos = stop + 2
                    continue
                self._left = size
                state = _Chunk.DATA
        if pos < end:
            self._buf = data[pos:]
        self._state = state
        if not out:
            return b""
        return out[0] if len(out) == 1 else b"".join(out)


def _chunk_size(line: bytes) -> int:
    digits = line.split(b";", 1)[0] if b";" in line else line
    digits = digits.strip(b" \t")
    # Only hex digits: int(..., 16) alone would take "0x1f", "+1f" or "1_f".
    if not digits or len(digits) > _MAX_HEX_DIGITS or digits.translate(None, _HEX):
        raise BodyFramingError(f"invalid chunk size line: {line[:40]!r}")
    return int(digits, 16)
