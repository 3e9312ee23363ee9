"""The response body's framing (``iop.wire._http_body``): fed whole, byte by
byte and split at random, against h11's reader of the same bytes."""

from __future__ import annotations

import itertools

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iop.wire._http_body import MAX_LINE_BYTES, BodyFraming, BodyFramingError, BodyReader

SSE_EVENTS = [b'data: {"choices":[{"delta":{"content":"tok %d"}}]}\n\n' % i for i in range(5)]


def chunked(
    parts: list[bytes], *, trailer: bytes = b"", ext: bytes = b"", upper: bool = False
) -> bytes:
    size = b"%X" if upper else b"%x"
    out = b"".join(size % len(p) + b"%s\r\n%s\r\n" % (ext, p) for p in parts if p)
    return out + b"0\r\n" + trailer + b"\r\n"


def read_all(reader: BodyReader, pieces: list[bytes]) -> list[bytes]:
    out = [reader.feed(p) for p in pieces]
    return [o for o in out if o]


def h11_body(wire: bytes) -> bytes:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + wire)
    body = b""
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return body
        assert event is not h11.NEED_DATA, "h11 wants more"


def test_one_read_of_many_chunks_is_one_piece() -> None:
    reader = BodyReader(BodyFraming.CHUNKED)
    assert reader.feed(chunked(SSE_EVENTS)) == b"".join(SSE_EVENTS)
    assert reader.done


def test_a_read_ending_mid_chunk_returns_what_it_has() -> None:
    wire = chunked([b"hello world"])
    reader = BodyReader(BodyFraming.CHUNKED)
    assert reader.feed(wire[:6]) == b"hel"  # after the 3 bytes of "b\r\n"
    assert not reader.done
    assert reader.feed(wire[6:]) == b"lo world"
    assert reader.done


def test_byte_by_byte() -> None:
    wire = chunked(SSE_EVENTS, trailer=b"x-trailer: 1\r\n", ext=b";name=value")
    reader = BodyReader(BodyFraming.CHUNKED)
    assert b"".join(read_all(reader, [wire[i : i + 1] for i in range(len(wire))])) == b"".join(
        SSE_EVENTS
    )
    assert reader.done


@settings(max_examples=200, deadline=None)
@given(
    parts=st.lists(st.binary(min_size=1, max_size=300), max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=10),
    upper=st.booleans(),
)
def test_any_split_gives_h11s_body(parts: list[bytes], cuts: list[int], upper: bool) -> None:
    wire = chunked(parts, upper=upper)  # hex digits in either case
    points = sorted({min(c, len(wire)) for c in cuts} | {0, len(wire)})
    pieces = [wire[a:b] for a, b in itertools.pairwise(points)]
    reader = BodyReader(BodyFraming.CHUNKED)
    assert b"".join(read_all(reader, pieces)) == h11_body(wire) == b"".join(parts)
    assert reader.done


@pytest.mark.parametrize(
    "wire",
    [
        b"zz\r\nhello\r\n0\r\n\r\n",  # not hex
        b"\r\nhello\r\n",  # no size
        b"5\r\nhelloXX0\r\n\r\n",  # data not followed by CRLF
        b"5\r\nhello\rX",
        b"1" * 17 + b"\r\n",  # more hex digits than any real chunk
        b"0\r\n\r\nextra",  # bytes after the end
    ],
)
def test_broken_framing_is_an_error(wire: bytes) -> None:
    with pytest.raises(BodyFramingError):
        BodyReader(BodyFraming.CHUNKED).feed(wire)


def test_a_size_line_longer_than_the_limit_is_an_error() -> None:
    reader = BodyReader(BodyFraming.CHUNKED)
    with pytest.raises(BodyFramingError, match="exceeds"):
        reader.feed(b"5;" + b"x" * MAX_LINE_BYTES)
    reader = BodyReader(BodyFraming.CHUNKED)
    with pytest.raises(BodyFramingError, match="exceeds"):
        reader.feed(b"5;" + b"x" * MAX_LINE_BYTES + b"\r\n")


def test_eof_before_the_end_is_an_error() -> None:
    reader = BodyReader(BodyFraming.CHUNKED)
    reader.feed(b"5\r\nhel")
    with pytest.raises(BodyFramingError, match="complete message body"):
        reader.feed_eof()
    length = BodyReader(BodyFraming.LENGTH, 5)
    assert length.feed(b"hel") == b"hel"
    with pytest.raises(BodyFramingError):
        length.feed_eof()


def test_a_length_body() -> None:
    reader = BodyReader(BodyFraming.LENGTH, 5)
    assert reader.feed(b"he") == b"he"
    assert reader.feed(b"llo") == b"llo"
    assert reader.done
    with pytest.raises(BodyFramingError, match="after the response body"):
        reader.feed(b"x")
    with pytest.raises(BodyFramingError, match="Content-Length"):
        BodyReader(BodyFraming.LENGTH, 2).feed(b"abc")
    assert BodyReader(BodyFraming.LENGTH, 0).done
    assert BodyReader(BodyFraming.NONE).done


def test_a_body_until_close() -> None:
    reader = BodyReader(BodyFraming.CLOSE)
    assert reader.feed(b"abc") == b"abc"
    assert not reader.done
    reader.feed_eof()
    assert reader.done
    reader.feed_eof()  # again: nothing
