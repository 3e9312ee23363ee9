"""``iop.bench._client.sse_data``: the benchmarks' one SSE framing, sans-IO.

Every client of the benchmarks (the load generator, the platform's httpx
clients, the cancel trials) keeps the incomplete tail of what it read and
feeds it back with the next piece; whatever the pieces, the payloads must
come out the same and in order, comments and keep-alives skipped.

The backpressure runners' bare-socket readers have a deadline: a server that
never answers fails them (in virtual time, on a real loopback socket).
"""

from __future__ import annotations

import itertools

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from iop.bench._client import STREAM_DEADLINE_S, fast_stream, slow_reader, sse_data

STREAM = (
    b": keep-alive\n\n"
    b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n'
    b"data: [DONE]\n\n"
)
PAYLOADS = [
    b'{"choices":[{"delta":{"content":"a"}}]}',
    b'{"choices":[{"delta":{"content":"b"}}]}',
    b"[DONE]",
]


def feed(pieces: list[bytes]) -> tuple[list[bytes], bytes]:
    got: list[bytes] = []
    rest = b""
    for piece in pieces:
        payloads, rest = sse_data(rest + piece)
        got += payloads
    return got, rest


def test_a_whole_stream() -> None:
    assert feed([STREAM]) == (PAYLOADS, b"")


def test_byte_by_byte() -> None:
    assert feed([bytes([b]) for b in STREAM]) == (PAYLOADS, b"")


def test_an_incomplete_event_is_kept_not_given() -> None:
    got, rest = feed([STREAM + b'data: {"choices"'])
    assert got == PAYLOADS
    assert rest == b'data: {"choices"'


def test_event_and_id_lines_and_multi_line_data() -> None:
    # The Responses and Messages surfaces name their events; data may span lines.
    stream = (
        b'event: response.created\ndata: {"type":"response.created"}\n\n'
        b"id: 7\ndata:no space\ndata: second line\n\n"
        b"event: ping\n\n"
    )
    assert feed([stream]) == ([b'{"type":"response.created"}', b"no space\nsecond line"], b"")


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_any_cut(cuts: list[int]) -> None:
    points = [0, *sorted(cuts), len(STREAM)]
    pieces = [STREAM[a:b] for a, b in itertools.pairwise(points)]
    assert feed(pieces) == (PAYLOADS, b"")


async def _mute_server(nursery: trio.Nursery) -> int:
    """A server that accepts, reads the request and never answers: its port."""

    async def mute(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        await trio.sleep_forever()

    listeners = await nursery.start(trio.serve_tcp, mute, 0)
    port: int = listeners[0].socket.getsockname()[1]
    return port


async def test_the_backpressure_readers_fail_on_a_server_that_never_answers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A hung server fails the run (``STREAM_DEADLINE_S``) instead of hanging it."""
    async with trio.open_nursery() as nursery:
        port = await _mute_server(nursery)
        with trio.move_on_after(10 * STREAM_DEADLINE_S) as outer:
            with pytest.raises(trio.TooSlowError):
                await fast_stream("127.0.0.1", port, 5)
            with pytest.raises(trio.TooSlowError):
                await slow_reader("127.0.0.1", port, 5, read_bytes_per_s=0, hold_s=1.0)
        assert not outer.cancelled_caught
        nursery.cancel_scope.cancel()
