"""HTTP/1.1 chunked transfer coding (RFC 9112 §7.1), the receiving side, sans-IO.

The node reads every backend's streamed answer as a chunked body, and an
engine (vLLM, the sim) writes each token in its own chunk: h11's reader
paid an event object, a state-machine step and a regular expression per
chunk, about 6 % of the node's CPU at paced c=32 (docs/benchmarks.md,
"Tokens per core at fleet scale"). ``ChunkedDecoder.feed`` takes what a
socket read returned and gives back the body bytes it completed, joined.

It accepts exactly what h11 0.16 accepts (``tests/wire/test_chunked.py``
checks it against h11 with hypothesis): a chunk size of 1 to 20 hex digits,
any chunk extension (``;`` up to the line's end, discarded), trailing spaces
or tabs before the CRLF, and a CRLF after each chunk's data. It stops at the
last chunk's line: the trailer section and what follows it are ``rest``,
which the caller hands to h11 (``iop.adapters._pool``), so trailers are
parsed and checked by h11 as before, and the connection's state ends where
h11 would have left it.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["CHUNK_LINE_MAX_BYTES", "ChunkedDecoder", "ChunkedError"]

# The longest chunk-size line (with its extensions) waited for: httpcore
# gives h11 this much for an incomplete event (``max_incomplete_event_size``
# of its HTTP/1.1 connection), and a server that sends a longer line is
# refused as h11 refuses it.
CHUNK_LINE_MAX_BYTES: Final = 100 * 1024
# h11's ``chunk_header`` (h11/_abnf.py): size, extensions, optional
# whitespace, CRLF; ``.`` stops at a bare LF, as there.
_CHUNK_LINE: Final = re.compile(rb"([0-9A-Fa-f]{1,20})(?:;.*)?[ \t]*\r\n")


class ChunkedError(ValueError):
    """The server broke the chunked framing (the message is h11's wording)."""


class ChunkedDecoder:
    """One chunked body, fed as it arrives.

    Args:
        max_line_bytes: The longest chunk-size line waited for.
    """

    __slots__ = ("_buf", "_footer", "_left", "done", "max_line_bytes", "rest")

    def __init__(self, max_line_bytes: int = CHUNK_LINE_MAX_BYTES) -> None:
        self.max_line_bytes = max_line_bytes
        self._buf = b""  # the unparsed part of a chunk-size line or footer
        self._left = 0  # data bytes of the current chunk not received yet
        self._footer = b""  # what is left of the CRLF after a chunk's data
        self.done = False  # the last chunk's line was read
        self.rest = b""  # after it: the trailer section and anything beyond

    @property
    def at_boundary(self) -> bool:
        """Whether everything fed so far ends exactly between two chunks."""
        return not self._buf and not self._left and not self._footer

    def feed(self, data: bytes) -> bytes:
        """The body bytes ``data`` completes (may be empty).

        Raises:
            ChunkedError: A chunk-size line that is malformed or longer than
                ``max_line_bytes``, or a chunk's data not followed by CRLF.
        """
        if self.done:
            self.rest += data
            return b""
        buf = self._buf + data if self._buf else data
        self._buf = b""
        n = len(buf)
        pos = 0
        out: list[bytes] = []
        while pos < n:
            left = self._left
            if left:
                end = min(n, pos + left)
                out.append(buf[pos:end] if pos or end < n else buf)
                self._left = left - (end - pos)
                pos = end
                if not self._left:
                    self._footer = b"\r\n"
                continue
            footer = self._footer
            if footer:
                got = buf[pos : pos + len(footer)]
                if got != footer[: len(got)]:
                    raise ChunkedError(
                        f"malformed chunk footer: {bytearray(got)!r} (expected {footer!r})"
                    )
                self._footer = footer[len(got) :]
                pos += len(got)
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                if n - pos > self.max_line_bytes:
                    raise ChunkedError("Receive buffer too long")
                self._buf = buf[pos:]
                break
            line = buf[pos : eol + 2]
            match = _CHUNK_LINE.fullmatch(line)
            if match is None:
                raise ChunkedError(f"illegal chunk header: {bytearray(line)!r}")
            pos = eol + 2
            size = int(match[1], 16)
            if size == 0:
                self.done = True
                self.rest = buf[pos:]
                break
            self._left = size
        return out[0] if len(out) == 1 else b"".join(out)
