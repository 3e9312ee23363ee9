"""``iop.bench._client.sse_data``: the benchmarks' one SSE framing, sans-IO.

Every client of the benchmarks (the load generator, the platform's httpx
clients, the cancel trials) keeps the incomplete tail of what it read and
feeds it back with the next piece; whatever the pieces, the payloads must
come out the same and in order, comments and keep-alives skipped.
"""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from iop.bench._client import sse_data

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
