"""The node's sans-IO WebSocket client (``iop.node._wsframes``) against wsproto.

wsproto's server is the reference: it parses what the client sends, and
writes what the client parses. Fed whole, byte by byte and with hypothesis;
every framing rule and limit is crossed once.
"""

from __future__ import annotations

import base64
import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)

from iop.node._wsframes import (
    REFUSAL_BODY_MAX_BYTES,
    Accepted,
    BinaryMessage,
    ClientFrames,
    CloseReceived,
    PingReceived,
    Refused,
    Upgrade,
    WebSocketEvent,
    WebSocketFailure,
    mask,
)
from iop.node._wsframes import TextMessage as OurText

LIMIT = 1 << 20
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 §1.3


def _server() -> tuple[WSConnection, ClientFrames, bytes]:
    """A wsproto server that accepted our upgrade; our frames; what followed the head."""
    server = WSConnection(ConnectionType.SERVER)
    upgrade = Upgrade("edge.example:8080", "/v1/link?x=1")
    server.receive_data(upgrade.request())
    (request,) = list(server.events())
    assert isinstance(request, Request)
    assert (request.host, request.target) == ("edge.example:8080", "/v1/link?x=1")
    answer = upgrade.receive(server.send(AcceptConnection()))
    assert isinstance(answer, Accepted)
    return server, ClientFrames(LIMIT), answer.rest


def _events(server: WSConnection, data: bytes) -> list[Event]:
    server.receive_data(data)
    return list(server.events())


def _parse(frames: ClientFrames, data: bytes, *, bytewise: bool = False) -> list[WebSocketEvent]:
    out: list[WebSocketEvent] = []
    pieces = [data[i : i + 1] for i in range(len(data))] if bytewise else [data]
    for piece in pieces:
        frames.receive_data(piece)
        while (event := frames.next_event()) is not None:
            out.append(event)
    return out


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 125, 126, 127, 65535, 65536, 70001])
def test_a_binary_frame_of_each_length_form_is_what_wsproto_reads(size: int) -> None:
    server, frames, _ = _server()
    payload = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    wire = frames.binary(payload)
    assert wire[1] & 0x80  # masked (RFC 6455 §5.3)
    header = 2 + (0 if size < 126 else 2 if size < 65536 else 8)
    assert len(wire) == header + 4 + size
    (message,) = _events(server, wire)
    assert isinstance(message, BytesMessage)
    assert (message.data, message.message_finished) == (payload, True)


@settings(max_examples=200)
@given(st.binary(max_size=3000), st.binary(min_size=4, max_size=4))
def test_mask_is_the_bytewise_xor_and_its_own_inverse(payload: bytes, key: bytes) -> None:
    expected = bytes(b ^ key[i % 4] for i, b in enumerate(payload))
    assert mask(payload, key) == expected
    assert mask(expected, key) == payload


def test_a_payload_over_the_mask_slice_is_masked_whole() -> None:
    payload = bytes(range(251)) * 9000  # 2.2 MB: three slices, the last partial
    key = b"\x01\x80\xfe\x37"
    masked = mask(payload, key)
    assert len(masked) == len(payload)
    assert mask(masked, key) == payload
    assert masked[(1 << 20) + 5] == payload[(1 << 20) + 5] ^ key[1]


def test_frames_from_the_client_each_have_a_fresh_key() -> None:
    keys = {ClientFrames.binary(b"same")[2:6] for _ in range(64)}
    assert len(keys) > 60


@settings(max_examples=100)
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=5), st.booleans())
def test_server_messages_parse_whole_and_byte_by_byte(parts: list[bytes], bytewise: bool) -> None:
    """A fragmented binary message, a ping between fragments, a text message, a close."""
    server, frames, rest = _server()
    wire = rest
    for i, part in enumerate(parts):
        wire += server.send(BytesMessage(data=part, message_finished=i == len(parts) - 1))
        if i == 0:
            wire += server.send(Ping(payload=b"p"))
    wire += server.send(TextMessage(data="héllo"))
    wire += server.send(CloseConnection(code=4409, reason="replaced"))
    message, ping = BinaryMessage(b"".join(parts)), PingReceived(b"p")
    first = [ping, message] if len(parts) > 1 else [message, ping]
    assert _parse(frames, wire, bytewise=bytewise) == [
        *first,
        OurText("héllo"),
        CloseReceived(4409, "replaced"),
    ]


def test_a_pong_is_what_wsproto_reads_and_a_close_too() -> None:
    server, frames, _ = _server()
    (pong,) = _events(server, frames.pong(b"abc"))
    assert pong.payload == b"abc"  # type: ignore[attr-defined]
    (close,) = _events(server, frames.close(4400, "x" * 200))
    assert isinstance(close, CloseConnection)
    assert (close.code, close.reason) == (4400, "x" * 123)
    server2, frames2, _ = _server()
    (empty,) = _events(server2, frames2.close(None))
    assert isinstance(empty, CloseConnection)
    assert empty.code == 1005  # no status code (RFC 6455 §7.1.5)


def test_a_close_without_a_code_is_none() -> None:
    assert _parse(ClientFrames(LIMIT), b"\x88\x00") == [CloseReceived(None, "")]


def _raw(first: int, payload: bytes, *, length: bytes | None = None) -> bytes:
    if length is None:
        n = len(payload)
        length = bytes([n]) if n < 126 else b"\x7e" + struct.pack("!H", n)
    return bytes([first]) + length + payload


@pytest.mark.parametrize(
    ("wire", "code", "match"),
    [
        (_raw(0xC2, b"x"), 1002, "reserved bits"),
        (b"\x82\x81abcdx", 1002, "masked frame from the server"),
        (_raw(0x83, b""), 1002, "unknown opcode 0x3"),
        (_raw(0x8B, b""), 1002, "unknown opcode 0xb"),
        (_raw(0x09, b""), 1002, "control frame fragmented"),
        (_raw(0x89, b"x" * 126), 1002, "over 125 bytes"),
        (_raw(0x80, b"x"), 1002, "continuation with no message"),
        (_raw(0x02, b"a") + _raw(0x82, b"b"), 1002, "new message inside a fragmented one"),
        (_raw(0x88, b"\x03"), 1002, "one byte"),
        (_raw(0x88, struct.pack("!H", 1005)), 1002, "close code 1005"),
        (_raw(0x88, struct.pack("!H", 999)), 1002, "close code 999"),
        (_raw(0x88, struct.pack("!H", 1000) + b"\xff"), 1007, "reason that is not UTF-8"),
        (_raw(0x81, b"\xc3"), 1007, "text message that is not UTF-8"),
        (b"\x82\x7f" + struct.pack("!Q", 1 << 63), 1002, "top bit"),
    ],
)
def test_a_frame_that_breaks_rfc_6455_fails_with_its_close_code(
    wire: bytes, code: int, match: str
) -> None:
    frames = ClientFrames(LIMIT)
    with pytest.raises(WebSocketFailure, match=match) as info:
        _parse(frames, wire)
    assert info.value.code == code


def test_a_message_over_the_limit_fails_at_its_header_before_its_payload() -> None:
    frames = ClientFrames(1000)
    _parse(frames, _raw(0x82, b"x" * 1000))  # at the limit: fine
    frames.receive_data(b"\x82\x7f" + struct.pack("!Q", 1 << 40))  # a terabyte announced
    with pytest.raises(WebSocketFailure, match="over the limit of 1000") as info:
        frames.next_event()
    assert info.value.code == 1009


def test_fragments_count_together_against_the_limit() -> None:
    frames = ClientFrames(1000)
    _parse(frames, _raw(0x02, b"x" * 600))
    with pytest.raises(WebSocketFailure, match="over the limit") as info:
        _parse(frames, _raw(0x80, b"x" * 401))
    assert info.value.code == 1009


def test_the_upgrade_request_is_rfc_6455s() -> None:
    upgrade = Upgrade("h:1", "/")
    text = upgrade.request().decode()
    assert text.startswith("GET / HTTP/1.1\r\n")
    for header in ("upgrade: websocket", "connection: Upgrade", "sec-websocket-version: 13"):
        assert header.lower() in text.lower()
    assert f"\r\nsec-websocket-key: {upgrade.key.decode()}\r\n".lower() in text.lower()


def test_a_refused_upgrade_keeps_its_status_and_a_bounded_body() -> None:
    server = WSConnection(ConnectionType.SERVER)
    upgrade = Upgrade("h", "/")
    server.receive_data(upgrade.request())
    list(server.events())
    head = server.send(
        RejectConnection(status_code=401, headers=[(b"content-length", b"5000")], has_body=True)
    )
    assert upgrade.receive(head) is None
    body = server.send(RejectData(data=b"b" * 5000))
    answer = upgrade.receive(body)
    assert answer == Refused(401, b"b" * REFUSAL_BODY_MAX_BYTES)


def test_a_refusal_whose_body_ends_with_the_connection() -> None:
    upgrade = Upgrade("h", "/")
    assert upgrade.receive(b"HTTP/1.1 403 Forbidden\r\n\r\nno node") is None
    assert upgrade.receive(b"") == Refused(403, b"no node")


@pytest.mark.parametrize(
    ("header", "problem"),
    [
        (b"Sec-WebSocket-Accept: AAAA\r\n", "wrong Sec-WebSocket-Accept"),
        (b"Sec-WebSocket-Extensions: permessage-deflate\r\n", "extension"),
    ],
)
def test_a_switch_with_a_wrong_handshake_is_refused(header: bytes, problem: str) -> None:
    upgrade = Upgrade("h", "/")
    good = b"Sec-WebSocket-Accept: " + base64.b64encode(hashlib.sha1(upgrade.key + GUID).digest())
    good += b"\r\n"
    lines = header if b"Accept" in header else good + header
    wire = (
        b"HTTP/1.1 101 Switching\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n" + lines + b"\r\n"
    )
    answer = upgrade.receive(wire)
    assert isinstance(answer, Refused)
    assert problem in answer.problem


def test_the_frames_after_the_head_are_handed_on_fed_byte_by_byte() -> None:
    upgrade = Upgrade("h", "/")
    server = WSConnection(ConnectionType.SERVER)
    server.receive_data(upgrade.request())
    list(server.events())
    wire = server.send(AcceptConnection()) + server.send(BytesMessage(data=b"welcome"))
    for i in range(len(wire)):
        answer = upgrade.receive(wire[i : i + 1])
        if answer is not None:
            break
    assert isinstance(answer, Accepted)
    frames = ClientFrames(LIMIT)
    assert _parse(frames, answer.rest + wire[i + 1 :]) == [BinaryMessage(b"welcome")]


@pytest.mark.parametrize(
    ("data", "match"),
    [(b"", "closed during the upgrade"), (b"SSH-2.0-OpenSSH\r\n\r\n", "bad answer")],
)
def test_no_http_answer_fails_the_upgrade(data: bytes, match: str) -> None:
    with pytest.raises(WebSocketFailure, match=match):
        Upgrade("h", "/").receive(data)
