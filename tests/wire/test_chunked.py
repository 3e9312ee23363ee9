"""The chunked decoder (``iop.wire._chunked``) against h11, the reference.

``decode_ours`` does what the node's body reader does (``iop.adapters._pool``):
the decoder up to the last chunk's line, then h11 for the trailer section.
``decode_h11`` is h11 alone. For any bytes, split anywhere, both must give
the same body bytes and the same outcome: the end, more wanted, or an error.
"""

from __future__ import annotations

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iop.wire._chunked import CHUNK_LINE_MAX_BYTES, ChunkedDecoder, ChunkedError

HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
LIMIT = 200  # a small line limit, so that hypothesis crosses it


def _h11_after_head(limit: int) -> h11.Connection:
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=limit)
    conn.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(HEAD)
    assert isinstance(conn.next_event(), h11.Response)
    return conn


def _drain(conn: h11.Connection, out: list[bytes]) -> str | None:
    """Read h11's events into ``out``; the outcome, or None for more.

    The data of a read that ends in an error is dropped, as the node's
    reader drops it (the error is raised, not the data returned)."""
    got: list[bytes] = []
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                out += got
                return None
            if isinstance(event, h11.Data):
                got.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                out += got
                return "end"
    except h11.RemoteProtocolError:
        return "error"


def decode_h11(pieces: list[bytes], limit: int = LIMIT) -> tuple[bytes, str]:
    conn = _h11_after_head(limit)
    out: list[bytes] = []
    for piece in pieces:
        conn.receive_data(piece)
        if (outcome := _drain(conn, out)) is not None:
            return b"".join(out), outcome
    return b"".join(out), "more"


def decode_ours(pieces: list[bytes], limit: int = LIMIT) -> tuple[bytes, str]:
    decoder = ChunkedDecoder(limit)
    out: list[bytes] = []
    tail: h11.Connection | None = None
    for piece in pieces:
        got: list[bytes] = []
        if tail is None:
            try:
                got.append(decoder.feed(piece))
            except ChunkedError:
                return b"".join(out), "error"
            if not decoder.done:
                out += got
                continue
            tail = _h11_after_head(limit)
            piece = b"0\r\n" + decoder.rest
        tail.receive_data(piece)
        outcome = _drain(tail, got)
        if outcome == "error":
            return b"".join(out), outcome
        out += got
        if outcome is not None:
            return b"".join(out), outcome
    return b"".join(out), "more"


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` cut at ``cuts`` (no empty piece: ``b""`` is h11's end of stream)."""
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    return [p for p in pieces if p]


_chunk = st.tuples(
    st.binary(min_size=1, max_size=40),
    st.sampled_from(["", ";a=b", ";x", '; q="1;2"', ";", ";\r"]),
    st.sampled_from(["", " ", "\t ", "  "]),
    st.sampled_from(["lower", "upper", "zeros"]),
)


def _body(chunks: list[tuple[bytes, str, str, str]], trailer: bytes, last: bytes) -> bytes:
    out = b""
    for data, ext, ows, case in chunks:
        size = f"{len(data):x}"
        size = size.upper() if case == "upper" else "00" + size if case == "zeros" else size
        out += f"{size}{ext}{ows}\r\n".encode() + data + b"\r\n"
    return out + last + trailer


@settings(max_examples=400)
@given(
    st.lists(_chunk, max_size=6),
    st.sampled_from([b"\r\n", b"X-T: 1\r\n\r\n", b"bad trailer\r\n\r\n", b"\n", b""]),
    st.sampled_from([b"0\r\n", b"000;e\r\n", b"0 \r\n"]),
    st.lists(st.integers(min_value=0, max_value=10_000), max_size=8),
)
def test_well_formed_bodies_decode_as_h11_decodes_them(
    chunks: list[tuple[bytes, str, str, str]], trailer: bytes, last: bytes, cuts: list[int]
) -> None:
    wire = _body(chunks, trailer, last)
    assert decode_ours(_split(wire, cuts)) == decode_h11(_split(wire, cuts))


@settings(max_examples=600)
@given(
    st.lists(_chunk, max_size=4),
    st.integers(min_value=0, max_value=400),
    st.binary(min_size=1, max_size=6),
    st.lists(st.integers(min_value=0, max_value=10_000), max_size=6),
)
def test_damaged_bodies_fail_or_not_as_h11_does(
    chunks: list[tuple[bytes, str, str, str]], at: int, junk: bytes, cuts: list[int]
) -> None:
    """Bytes overwritten anywhere: sizes, CRLFs, data, the last chunk."""
    wire = bytearray(_body(chunks, b"\r\n", b"0\r\n"))
    at %= len(wire)
    wire[at : at + len(junk)] = junk
    assert decode_ours(_split(bytes(wire), cuts)) == decode_h11(_split(bytes(wire), cuts))


@settings(max_examples=300)
@given(st.binary(max_size=300), st.lists(st.integers(min_value=0, max_value=400), max_size=5))
def test_arbitrary_bytes_decode_as_h11_decodes_them(wire: bytes, cuts: list[int]) -> None:
    assert decode_ours(_split(wire, cuts)) == decode_h11(_split(wire, cuts))


@pytest.mark.parametrize(
    "wire",
    [
        b"5\r\nhello\r\n0\r\n\r\n",
        b"5;ext=1 \r\nhello\r\n3\r\nabc\r\n0\r\nX: y\r\n\r\ntrailing garbage",
        b"ffffffffffffffffffff\r\n" + b"x" * 10,  # 20 hex digits: accepted, data waited for
        b"1fffffffffffffffffff0\r\n",  # 21 digits: refused
        b"-1\r\n",
        b"5\r\nhelloXY",
        b"5\r\nhello\n0\r\n\r\n",
        b"\r\n",
        b"5 ;x\r\nhello\r\n",
        b"5\n\r\nhello\r\n",
    ],
)
def test_fed_whole_and_byte_by_byte(wire: bytes) -> None:
    expected = decode_h11([wire])
    assert decode_ours([wire]) == expected
    assert decode_ours([wire[i : i + 1] for i in range(len(wire))]) == decode_h11(
        [wire[i : i + 1] for i in range(len(wire))]
    )


def test_a_chunk_size_line_over_the_limit_is_refused_before_its_end() -> None:
    decoder = ChunkedDecoder()
    decoder.feed(b"5;" + b"e" * (CHUNK_LINE_MAX_BYTES - 2))  # at the limit: waits
    with pytest.raises(ChunkedError, match="Receive buffer too long"):
        decoder.feed(b"e")


def test_one_piece_per_feed_and_the_rest_after_the_last_chunk() -> None:
    decoder = ChunkedDecoder()
    assert decoder.feed(b"1\r\na\r\n1\r\nb\r\n1\r") == b"ab"
    assert not decoder.at_boundary
    assert decoder.feed(b"\nc\r\n") == b"c"
    assert decoder.at_boundary
    assert decoder.feed(b"0;last\r\nX: 1\r\n") == b""
    assert decoder.done
    assert decoder.feed(b"\r\n") == b""
    assert decoder.rest == b"X: 1\r\n\r\n"
