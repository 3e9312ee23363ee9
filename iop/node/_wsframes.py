"""The client end of a WebSocket (RFC 6455), sans-IO: the upgrade and the frames.

The node is the client of every link. This module turns what the node sends
into bytes and the edge's bytes into typed events; it does no IO (the IO is
``iop.node._ws``), so it is tested fed whole, byte by byte and against
wsproto as the reference (``tests/node/test_wsframes.py``).

Why our own and not wsproto's or trio-websocket's: the node sends one
frame per paced token, and through trio-websocket each cost wsproto's
framing, a per-byte mask, a ``trio.Lock`` taken with a schedule point even
when free and a reader task between the socket and the caller
(docs/benchmarks.md, "Tokens per core at fleet scale"). Here a frame is a
header and the payload XORed with its mask as one integer.

* **Upgrade** (RFC 6455 §4.1): ``Upgrade.request`` is the GET with a fresh
  ``Sec-WebSocket-Key``; ``Upgrade.receive`` parses the answer with h11 and
  returns ``Accepted`` (with the bytes that followed the head: the first
  frames) or ``Refused`` (status and a bounded body), or None for more.
  No extension or subprotocol is offered, so a server that names one is
  refused (RFC 6455 §4.1, "the client MUST Fail the WebSocket Connection").
* **Frames** (RFC 6455 §5.2): ``ClientFrames.binary``, ``.close`` and ``.pong`` are
  masked frames (RFC 6455 §5.3: a client masks every frame, with a fresh key from a
  strong source of entropy); ``receive_data`` / ``next_event`` parse the
  server's, which are never masked (RFC 6455 §5.1). A message may be fragmented
  (RFC 6455 §5.4) and control frames may come between its fragments.
* **Limits**: a message longer than ``max_message_bytes`` fails with 1009
  as soon as a header announces it, before its payload is buffered; a
  frame that breaks the framing rules fails with 1002, a text message or a
  close reason that is not UTF-8 with 1007 (``WebSocketFailure`` carries
  the code the client closes with).
"""

from __future__ import annotations

import base64
import hashlib
import os
import struct
from enum import IntEnum
from typing import Final

import h11
import msgspec

__all__ = [
    "CLOSE_ABNORMAL",
    "REFUSAL_BODY_MAX_BYTES",
    "Accepted",
    "BinaryMessage",
    "ClientFrames",
    "CloseReceived",
    "Opcode",
    "PingReceived",
    "Refused",
    "TextMessage",
    "Upgrade",
    "WebSocketEvent",
    "WebSocketFailure",
    "mask",
]

# The close code a side reports when the connection ended without a close
# frame (RFC 6455 §7.1.5); it is never sent.
CLOSE_ABNORMAL: Final = 1006
_CLOSE_PROTOCOL_ERROR: Final = 1002
_CLOSE_INVALID_DATA: Final = 1007
_CLOSE_TOO_BIG: Final = 1009
# The body of a refused upgrade kept for the error message (it shows 200
# characters): an edge's 401/403 body is one line.
REFUSAL_BODY_MAX_BYTES: Final = 4096
# RFC 6455 §1.3: the accept value is the SHA-1 of the key and this GUID.
_GUID: Final = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
# Above this a payload is masked in slices, so that masking a 32 MiB frame
# does not hold four 32 MiB integers at once (a multiple of 4: each slice
# starts at the key's first byte).
_MASK_SLICE_BYTES: Final = 1 << 20


class Opcode(IntEnum):
    """RFC 6455 §5.2, "Opcode"."""

    CONTINUATION = 0x0
    TEXT = 0x1
    BINARY = 0x2
    CLOSE = 0x8
    PING = 0x9
    PONG = 0xA


class WebSocketFailure(Exception):
    """The server broke RFC 6455: the client closes with ``code`` (RFC 6455 §7.1.7)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class WebSocketEvent(msgspec.Struct, frozen=True):
    """What the server sent (don't subclass the subclasses)."""


class BinaryMessage(WebSocketEvent, frozen=True):
    data: bytes


class TextMessage(WebSocketEvent, frozen=True):
    text: str


class PingReceived(WebSocketEvent, frozen=True):
    """Answer with ``ClientFrames.pong(payload)`` (RFC 6455 §5.5.2)."""

    payload: bytes


class CloseReceived(WebSocketEvent, frozen=True):
    """The server's close frame: ``code`` None when it carried none (RFC 6455 §7.1.5)."""

    code: int | None
    reason: str


class Accepted(msgspec.Struct, frozen=True):
    """The server switched to WebSocket; ``rest`` is what followed the head."""

    rest: bytes


class Refused(msgspec.Struct, frozen=True):
    """The server answered the upgrade with ``status`` (its body cut to
    ``REFUSAL_BODY_MAX_BYTES``), or switched with a wrong handshake
    (``problem`` says what)."""

    status: int
    body: bytes
    problem: str = ""


def mask(payload: bytes | bytearray | memoryview, key: bytes) -> bytes:
    """``payload`` XORed with the 4-byte ``key`` repeated (RFC 6455 §5.3): as one integer,
    not byte by byte."""
    n = len(payload)
    if n > _MASK_SLICE_BYTES:
        view = memoryview(payload)
        return b"".join(
            mask(view[i : i + _MASK_SLICE_BYTES], key) for i in range(0, n, _MASK_SLICE_BYTES)
        )
    if n == 0:
        return b""
    keys = key * ((n + 3) >> 2)
    if len(keys) != n:
        keys = keys[:n]
    value = int.from_bytes(payload, "little") ^ int.from_bytes(keys, "little")
    return value.to_bytes(n, "little")


def _accept_value(key: bytes) -> bytes:
    return base64.b64encode(hashlib.sha1(key + _GUID).digest())


class Upgrade:
    """The opening handshake of one connection (RFC 6455 §4.1, RFC 6455 §4.2.2).

    Args:
        host: The ``Host`` header (the URL's authority without credentials).
        target: The request target (path and query).
    """

    def __init__(self, host: str, target: str) -> None:
        self.key = base64.b64encode(os.urandom(16))
        self._h11 = h11.Connection(our_role=h11.CLIENT)
        self._request = self._h11.send(
            h11.Request(
                method="GET",
                target=target,
                headers=[
                    ("Host", host),
                    ("Upgrade", "websocket"),
                    ("Connection", "Upgrade"),
                    ("Sec-WebSocket-Key", self.key.decode()),
                    ("Sec-WebSocket-Version", "13"),
                ],
            )
        ) + (self._h11.send(h11.EndOfMessage()) or b"")
        self._refused: h11.Response | None = None
        self._body = bytearray()

    def request(self) -> bytes:
        """The upgrade request's bytes."""
        return self._request

    def receive(self, data: bytes | bytearray) -> Accepted | Refused | None:
        """Feed what the server sent (``b""``: it closed the connection).

        Returns:
            The answer, or None while the head (or a refusal's body) is
            incomplete.

        Raises:
            WebSocketFailure: The connection ended before the answer, or the
                answer is not HTTP (``code`` 1006: nothing was agreed).
        """
        conn = self._h11
        if not data and self._refused is None:
            raise WebSocketFailure(CLOSE_ABNORMAL, "closed during the upgrade")
        conn.receive_data(bytes(data))
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise WebSocketFailure(CLOSE_ABNORMAL, f"bad answer to the upgrade: {exc}") from exc
            if event is h11.NEED_DATA:
                return None
            if isinstance(event, h11.InformationalResponse):
                if event.status_code == 101:
                    return self._switched(event)
                continue  # a 1xx other than 101: the answer is still to come
            if isinstance(event, h11.Response):
                self._refused = event
            elif isinstance(event, h11.Data):
                room = REFUSAL_BODY_MAX_BYTES - len(self._body)
                self._body += event.data[:room]
                if len(self._body) >= REFUSAL_BODY_MAX_BYTES and self._refused is not None:
                    return Refused(self._refused.status_code, bytes(self._body))
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                assert self._refused is not None
                return Refused(self._refused.status_code, bytes(self._body))

    def _switched(self, event: h11.InformationalResponse) -> Accepted | Refused:
        headers = {name.lower(): value for name, value in event.headers}
        problem = ""
        if headers.get(b"upgrade", b"").lower() != b"websocket":
            problem = "no Upgrade: websocket"
        elif b"upgrade" not in [
            t.strip().lower() for t in headers.get(b"connection", b"").split(b",")
        ]:
            problem = "no Connection: Upgrade"
        elif headers.get(b"sec-websocket-accept") != _accept_value(self.key):
            problem = "a wrong Sec-WebSocket-Accept"
        elif headers.get(b"sec-websocket-extensions") or headers.get(b"sec-websocket-protocol"):
            problem = "an extension or subprotocol the node did not offer"
        if problem:
            return Refused(101, b"", problem)
        rest, _ = self._h11.trailing_data
        return Accepted(bytes(rest))


def _header(opcode: int, n: int) -> bytes:
    """A final frame's header with the mask bit set, before its key (RFC 6455 §5.2)."""
    if n < 126:
        return bytes((0x80 | opcode, 0x80 | n))
    if n < 1 << 16:
        return struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
    return struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)


def _frame(opcode: int, payload: bytes) -> bytes:
    key = os.urandom(4)
    return b"".join((_header(opcode, len(payload)), key, mask(payload, key)))


def _valid_close_code(code: int) -> bool:
    """RFC 6455 §7.4: the codes an endpoint may send (1004 to 1006 and 1015 never go on the wire)."""
    return code in (1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011) or 3000 <= code <= 4999


class ClientFrames:
    """The frames of one client connection, both ways (module docstring).

    Args:
        max_message_bytes: The longest message accepted from the server
            (1009 above).
    """

    __slots__ = ("_buf", "_fragments", "_fragments_bytes", "_message_opcode", "max_message_bytes")

    def __init__(self, max_message_bytes: int) -> None:
        self.max_message_bytes = max_message_bytes
        self._buf = bytearray()
        # The message being reassembled (RFC 6455 §5.4): its opcode and fragments.
        self._message_opcode: int | None = None
        self._fragments: list[bytes] = []
        self._fragments_bytes = 0

    # -- what the client sends --------------------------------------------------------

    @staticmethod
    def binary(payload: bytes) -> bytes:
        """One binary message, one frame."""
        return _frame(Opcode.BINARY, payload)

    @staticmethod
    def text(text: str) -> bytes:
        """One text message (the link never sends one; a test may)."""
        return _frame(Opcode.TEXT, text.encode())

    @staticmethod
    def pong(payload: bytes) -> bytes:
        return _frame(Opcode.PONG, payload)

    @staticmethod
    def close(code: int | None, reason: str = "") -> bytes:
        """A close frame (without a body when ``code`` is None); ``reason`` is
        cut to the 123 bytes that fit (RFC 6455 §5.5)."""
        if code is None:
            return _frame(Opcode.CLOSE, b"")
        data = reason.encode()[:123].decode(errors="ignore").encode()
        return _frame(Opcode.CLOSE, struct.pack("!H", code) + data)

    # -- what the server sends --------------------------------------------------------

    def receive_data(self, data: bytes | bytearray) -> None:
        self._buf += data

    def next_event(self) -> WebSocketEvent | None:
        """The next complete event in what was received, or None for more.

        Raises:
            WebSocketFailure: The server broke the framing (1002), sent a
                message over the limit (1009) or text that is not UTF-8 (1007).
        """
        while True:
            buf = self._buf
            have = len(buf)
            if have < 2:
                return None
            b0, b1 = buf[0], buf[1]
            n = b1 & 0x7F
            start = 2
            if n == 126:
                if have < 4:
                    return None
                n = (buf[2] << 8) | buf[3]
                start = 4
            elif n == 127:
                if have < 10:
                    return None
                (n,) = struct.unpack_from("!Q", buf, 2)
                start = 10
                if n >> 63:
                    raise WebSocketFailure(
                        _CLOSE_PROTOCOL_ERROR, "a frame length with its top bit set"
                    )
            opcode = b0 & 0x0F
            fin = b0 & 0x80
            self._check(b0, b1, opcode, fin, n)
            end = start + n
            if have < end:
                return None
            payload = bytes(buf[start:end])
            del buf[:end]
            event = self._frame(opcode, fin, payload)
            if event is not None:
                return event

    def _check(self, b0: int, b1: int, opcode: int, fin: int, n: int) -> None:
        """A header's rules (RFC 6455 §5.2, RFC 6455 §5.4, RFC 6455 §5.5), checked before its payload is waited for."""
        if b0 & 0x70:
            raise WebSocketFailure(_CLOSE_PROTOCOL_ERROR, "a frame with reserved bits set")
        if b1 & 0x80:
            raise WebSocketFailure(_CLOSE_PROTOCOL_ERROR, "a masked frame from the server")
        if opcode >= 0x8:
            if opcode not in (Opcode.CLOSE, Opcode.PING, Opcode.PONG):
                raise WebSocketFailure(_CLOSE_PROTOCOL_ERROR, f"unknown opcode {opcode:#x}")
            if not fin or n > 125:
                raise WebSocketFailure(
                    _CLOSE_PROTOCOL_ERROR, "a control frame fragmented or over 125 bytes"
                )
            return
        if opcode == Opcode.CONTINUATION:
            if self._message_opcode is None:
                raise WebSocketFailure(_CLOSE_PROTOCOL_ERROR, "a continuation with no message")
        elif opcode in (Opcode.TEXT, Opcode.BINARY):
            if self._message_opcode is not None:
                raise WebSocketFailure(
                    _CLOSE_PROTOCOL_ERROR, "a new message inside a fragmented one"
                )
        else:
            raise WebSocketFailure(_CLOSE_PROTOCOL_ERROR, f"unknown opcode {opcode:#x}")
        if self._fragments_bytes + n > self.max_message_bytes:
            raise WebSocketFailure(
                _CLOSE_TOO_BIG, f"a message over the limit of {self.max_message_bytes} bytes"
            )

    def _frame(self, opcode: int, fin: int, payload: bytes) -> WebSocketEvent | None:
        if opcode == Opcode.PING:
            return PingReceived(payload)
        if opcode == Opcode.PONG:
            return None  # the node sends no pings (the link has its own heartbeat)
        if opcode == Opcode.CLOSE:
            return _close_event(payload)
        if opcode != Opcode.CONTINUATION:
            self._message_opcode = opcode
        if not fin:
            self._fragments.append(payload)
            self._fragments_bytes += len(payload)
            return None
        if self._fragments:
            self._fragments.append(payload)
            payload = b"".join(self._fragments)
            self._fragments = []
            self._fragments_bytes = 0
        kind, self._message_opcode = self._message_opcode, None
        if kind == Opcode.BINARY:
            return BinaryMessage(payload)
        try:
            return TextMessage(payload.decode())
        except UnicodeDecodeError:
            raise WebSocketFailure(
                _CLOSE_INVALID_DATA, "a text message that is not UTF-8"
            ) from None


def _close_event(payload: bytes) -> CloseReceived:
    """RFC 6455 §5.5.1: no body, or a 2-byte code and a UTF-8 reason."""
    if not payload:
        return CloseReceived(None, "")
    if len(payload) == 1:
        raise WebSocketFailure(_CLOSE_PROTOCOL_ERROR, "a close frame of one byte")
    (code,) = struct.unpack_from("!H", payload)
    if not _valid_close_code(code):
        raise WebSocketFailure(_CLOSE_PROTOCOL_ERROR, f"close code {code} may not be sent")
    try:
        reason = payload[2:].decode()
    except UnicodeDecodeError:
        raise WebSocketFailure(_CLOSE_INVALID_DATA, "a close reason that is not UTF-8") from None
    return CloseReceived(code, reason)
