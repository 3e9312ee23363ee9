"""Tests of the WHATWG SSE decoder/encoder (iop.wire._sse)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from importlib.resources import files

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iop.errors import BackendProtocolError, InvariantError
from iop.wire._chunks import ChatChunk
from iop.wire._sse import (
    DEFAULT_MAX_LINE_BYTES,
    DONE,
    SSEDecoder,
    SSEEvent,
    encode_comment,
    encode_event,
)

GARBAGE = b"data: trailing garbage, never terminated"


def _feed_all(chunks: Iterable[bytes], **kwargs: int) -> tuple[list[SSEEvent], str | None]:
    dec = SSEDecoder(**kwargs)
    events: list[SSEEvent] = []
    for chunk in chunks:
        events.extend(dec.feed(chunk))
    return events, dec.close()


def _bytewise(stream: bytes) -> list[bytes]:
    return [stream[i : i + 1] for i in range(len(stream))]


def decode_three_ways(stream: bytes, *, two_piece_splits: bool = True) -> list[SSEEvent]:
    """Decode a whole stream (ending on a complete event) three ways, check they agree.

    1. fed whole, 2. fed byte by byte, 3. fed whole with an unterminated line
    appended (which must not become an event, but is returned by close()).
    With ``two_piece_splits`` the stream is also fed split at every offset.
    """
    whole, tail = _feed_all([stream])
    assert tail is None
    bytewise, tail = _feed_all(_bytewise(stream))
    assert bytewise == whole
    assert tail is None
    garbage, tail = _feed_all([stream + GARBAGE])
    assert garbage == whole
    assert tail == "trailing garbage, never terminated"
    garbage_bytewise, tail = _feed_all(_bytewise(stream + GARBAGE))
    assert garbage_bytewise == whole
    assert tail == "trailing garbage, never terminated"
    if two_piece_splits:
        for i in range(1, len(stream)):
            assert _feed_all([stream[:i], stream[i:]])[0] == whole, i
    return whole


def ev(
    data: str, event: str = "message", id: str | None = None, retry: int | None = None
) -> SSEEvent:
    return SSEEvent(data=data, event=event, id=id, retry=retry)


# --------------------------------------------------------------------------- BOM


def test_bom_ignored() -> None:
    assert decode_three_ways(b"\xef\xbb\xbfdata: x\n\n") == [ev("x")]


def test_bom_split_across_feeds() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"\xef") == []
    assert dec.feed(b"") == []
    assert dec.feed(b"\xbb") == []
    assert dec.feed(b"\xbfdata: x\n") == []
    assert dec.feed(b"\n") == [ev("x")]


def test_only_one_bom_ignored() -> None:
    # The second BOM is part of the field name "\ufeffdata", an unknown field.
    assert decode_three_ways(b"\xef\xbb\xbf\xef\xbb\xbfdata: x\n\ndata: y\n\n") == [ev("y")]


def test_bom_later_in_stream_is_data() -> None:
    assert decode_three_ways(b"data: \xef\xbb\xbfx\n\n") == [ev("\ufeffx")]


def test_partial_bom_prefix_is_kept() -> None:
    # b"\xef\xbb" then ":" is not a BOM: the line is a field named U+FFFD.
    assert decode_three_ways(b"\xef\xbb:x\ndata: y\n\n") == [ev("y")]
    dec = SSEDecoder()
    assert dec.feed(b"\xef\xbb") == []
    assert dec.close() is None


# --------------------------------------------------------------------------- line ends


@pytest.mark.parametrize(
    "stream",
    [
        pytest.param(b"data: a\ndata: b\n\ndata: c\n\n", id="LF"),
        pytest.param(b"data: a\rdata: b\r\rdata: c\r\r", id="CR"),
        pytest.param(b"data: a\r\ndata: b\r\n\r\ndata: c\r\n\r\n", id="CRLF"),
        pytest.param(b"data: a\rdata: b\r\n\ndata: c\n\r", id="mixed"),
    ],
)
def test_line_endings(stream: bytes) -> None:
    assert decode_three_ways(stream) == [ev("a\nb"), ev("c")]


def test_crlf_split_across_feeds_is_one_line_end() -> None:
    # If the LF after the split CR counted as a second line end, "a" would be
    # dispatched alone by the resulting blank line.
    dec = SSEDecoder()
    assert dec.feed(b"data: a\r") == []
    assert dec.feed(b"\ndata: b\r") == []
    assert dec.feed(b"\n") == []
    assert dec.feed(b"\r") == [ev("a\nb")]  # a blank line (CR, then a split CRLF's LF)
    assert dec.feed(b"\n") == []  # the LF of that CRLF: no second blank line
    assert dec.feed(b"data: c\n\n") == [ev("c")]


def test_cr_at_end_of_feed_followed_by_cr() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: a\r") == []
    assert dec.feed(b"\r") == [ev("a")]


def test_skip_lf_only_applies_to_the_next_byte() -> None:
    # The CR ends "data: a"; the next feed does not start with LF, so nothing
    # is skipped and "data: b" is a line of its own.
    dec = SSEDecoder()
    assert dec.feed(b"data: a\r") == []
    assert dec.feed(b"data: b\n\n") == [ev("a\nb")]


@pytest.mark.parametrize("sep", ["\u2028", "\u2029", "\u0085", "\x0b", "\x0c", "\x1c"])
def test_unicode_line_separators_do_not_split(sep: str) -> None:
    stream = f"data: a{sep}b\n\n".encode()
    assert decode_three_ways(stream) == [ev(f"a{sep}b")]


# --------------------------------------------------------------------------- comments


@pytest.mark.parametrize("comment", [b":", b": ping", b": ping - 2025-01-01 00:00:00.000000"])
def test_comments_ignored(comment: bytes) -> None:
    stream = comment + b"\ndata: a\n" + comment + b"\ndata: b\n\n"
    assert decode_three_ways(stream) == [ev("a\nb")]


@pytest.mark.parametrize("block", [b":\n\n", b": ping\n\n", b": ping\r\n\r\n", b":\r\r"])
def test_comment_only_block_is_no_event(block: bytes) -> None:
    assert decode_three_ways(block * 3) == []
    assert decode_three_ways(block + b"data: x\n\n" + block) == [ev("x")]


def test_comment_between_lines_does_not_dispatch() -> None:
    assert decode_three_ways(b"data: a\n: keep-alive\ndata: b\n\n") == [ev("a\nb")]


# --------------------------------------------------------------------------- fields


def test_multi_line_data() -> None:
    assert decode_three_ways(b"data: one\ndata: two\ndata: three\n\n") == [ev("one\ntwo\nthree")]


def test_no_space_after_colon() -> None:
    assert decode_three_ways(b"data:x\n\n") == [ev("x")]


def test_two_spaces_after_colon_keeps_one() -> None:
    assert decode_three_ways(b"data:  x\n\n") == [ev(" x")]


def test_trailing_spaces_kept() -> None:
    assert decode_three_ways(b"data: x  \n\n") == [ev("x  ")]


def test_split_at_first_colon_only() -> None:
    assert decode_three_ways(b'data: {"a": "b:c"}\n\n') == [ev('{"a": "b:c"}')]


def test_line_without_colon_is_field_with_empty_value() -> None:
    assert decode_three_ways(b"data\n\n") == [ev("")]
    assert decode_three_ways(b"data\ndata\n\n") == [ev("\n")]
    assert decode_three_ways(b"data: a\ndata\n\n") == [ev("a\n")]


def test_field_names_are_case_sensitive() -> None:
    assert decode_three_ways(b"Data: x\n\nDATA: y\n\n") == []


@pytest.mark.parametrize(
    "line",
    [
        pytest.param(b'error: {"message":"boom","code":500}', id="llama.cpp-old-error"),
        pytest.param(b'ChatCompletionChunk: {"id":"x","choices":[]}', id="FastFlowLM"),
        pytest.param(b"foo", id="bare-unknown"),
        pytest.param(b"data : x", id="space-before-colon"),
    ],
)
def test_unknown_fields_ignored(line: bytes) -> None:
    assert decode_three_ways(line + b"\n\n") == []
    assert decode_three_ways(line + b"\ndata: y\n\n") == [ev("y")]


LLAMACPP_OLD_ERROR = (
    b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
    b'error: {"code":500,"message":"slot failed","type":"server_error"}\n\n'
    b"data: [DONE]\n\n"
)


def _decode_surfacing(chunks: Iterable[bytes]) -> list[SSEEvent]:
    dec = SSEDecoder(surface_fields=("error",))
    events: list[SSEEvent] = []
    for chunk in chunks:
        events.extend(dec.feed(chunk))
    assert dec.close() is None
    return events


def test_surfaced_field_is_returned_in_stream_order() -> None:
    want = [
        ev('{"choices":[{"index":0,"delta":{"content":"Hi"}}]}'),
        SSEEvent('{"code":500,"message":"slot failed","type":"server_error"}', field="error"),
        ev("[DONE]"),
    ]
    assert _decode_surfacing([LLAMACPP_OLD_ERROR]) == want
    assert _decode_surfacing(_bytewise(LLAMACPP_OLD_ERROR)) == want
    for i in range(1, len(LLAMACPP_OLD_ERROR)):
        assert _decode_surfacing([LLAMACPP_OLD_ERROR[:i], LLAMACPP_OLD_ERROR[i:]]) == want, i
    # Without asking for it the line is ignored, as the spec says.
    assert decode_three_ways(LLAMACPP_OLD_ERROR) == [want[0], want[2]]


def test_surfaced_field_does_not_touch_the_event_being_built() -> None:
    stream = b"data: a\nerror:x\ndata: b\n\n"
    assert _decode_surfacing([stream]) == [SSEEvent("x", field="error"), ev("a\nb")]


def test_surfaced_field_without_colon_or_value() -> None:
    assert _decode_surfacing([b"error\n\n"]) == [SSEEvent("", field="error")]


def test_surfaced_field_line_counts_towards_the_limit() -> None:
    dec = SSEDecoder(max_line_bytes=8, surface_fields=("error",))
    with pytest.raises(BackendProtocolError):
        dec.feed(b"error: 0123456789\n")


def test_standard_fields_cannot_be_surfaced() -> None:
    with pytest.raises(ValueError, match="standard SSE fields"):
        SSEDecoder(surface_fields=("data",))


def test_event_error() -> None:
    stream = b'event: error\ndata: {"error": {"message": "x"}}\n\n'
    assert decode_three_ways(stream) == [ev('{"error": {"message": "x"}}', event="error")]


def test_event_type_reset_after_dispatch() -> None:
    assert decode_three_ways(b"event: a\ndata: 1\n\ndata: 2\n\n") == [
        ev("1", event="a"),
        ev("2"),
    ]


def test_event_type_reset_by_empty_dispatch() -> None:
    assert decode_three_ways(b"event: a\n\ndata: 2\n\n") == [ev("2")]


def test_empty_event_type_is_message() -> None:
    assert decode_three_ways(b"event:\ndata: x\n\nevent\ndata: y\n\n") == [ev("x"), ev("y")]


def test_last_event_type_wins() -> None:
    assert decode_three_ways(b"event: a\nevent: b\ndata: x\n\n") == [ev("x", event="b")]


def test_empty_data_frame_is_an_event_with_empty_data() -> None:
    assert decode_three_ways(b"data: \n\n") == [ev("")]
    assert decode_three_ways(b"data:\n\n") == [ev("")]


# --------------------------------------------------------------------------- id


def test_id_persists_across_events() -> None:
    dec = SSEDecoder()
    events = dec.feed(b"id: 1\ndata: a\n\ndata: b\n\n")
    assert events == [ev("a", id="1"), ev("b", id="1")]
    assert dec.last_event_id == "1"
    assert decode_three_ways(b"id: 1\ndata: a\n\ndata: b\n\n") == events


def test_id_with_nul_ignored() -> None:
    stream = b"id: 1\ndata: a\n\nid: 2\x003\ndata: b\n\n"
    assert decode_three_ways(stream) == [ev("a", id="1"), ev("b", id="1")]


@pytest.mark.parametrize("reset", [b"id", b"id:", b"id: "])
def test_id_reset(reset: bytes) -> None:
    stream = b"id: 7\ndata: a\n\n" + reset + b"\ndata: b\n\n"
    assert decode_three_ways(stream) == [ev("a", id="7"), ev("b")]
    dec = SSEDecoder()
    dec.feed(stream)
    assert dec.last_event_id == ""


def test_last_event_id_updates_at_dispatch_even_without_data() -> None:
    dec = SSEDecoder()
    assert dec.last_event_id == ""
    assert dec.feed(b"id: 7\n") == []
    assert dec.last_event_id == ""  # the buffer is set, the string only at dispatch
    assert dec.feed(b"\n") == []
    assert dec.last_event_id == "7"


# --------------------------------------------------------------------------- retry


def test_retry_valid() -> None:
    dec = SSEDecoder()
    assert SSEDecoder().retry is None
    events = dec.feed(b"retry: 3000\ndata: a\n\ndata: b\n\n")
    assert events == [ev("a", retry=3000), ev("b")]
    assert dec.retry == 3000
    assert decode_three_ways(b"retry: 3000\ndata: a\n\ndata: b\n\n") == events


def test_retry_without_data_sets_reconnection_time_only() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"retry: 10\n\ndata: x\n\n") == [ev("x")]
    assert dec.retry == 10


def test_retry_leading_zeros_and_huge() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"retry: 0007\ndata: x\n\n") == [ev("x", retry=7)]
    dec.feed(b"retry: " + b"0" * 10_000 + b"5\n\n")
    assert dec.retry == 5
    dec.feed(b"retry: " + b"9" * 10_000 + b"\n\n")  # beyond int's str-digit limit: ignored
    assert dec.retry == 5


@pytest.mark.parametrize(
    "value",
    ["3s", "-1", "+1", "1.5", " 1", "1 ", "", "\uff13", "\u00b2", "\u0663", "0x10"],
)
def test_retry_invalid_ignored(value: str) -> None:
    dec = SSEDecoder()
    dec.feed(b"retry: 5\n\n")
    stream = f"retry: {value}\ndata: x\n\n".encode()
    assert dec.feed(stream) == [ev("x")]
    assert dec.retry == 5
    assert decode_three_ways(stream) == [ev("x")]


# --------------------------------------------------------------------------- encoding


def test_invalid_utf8_replaced() -> None:
    assert decode_three_ways(b"data: \xff\xfe x \xe2\x82\n\n") == [ev("\ufffd\ufffd x \ufffd")]


def test_multibyte_char_split_across_feeds() -> None:
    dec = SSEDecoder()
    raw = "data: héllo €😀\n\n".encode()
    events: list[SSEEvent] = []
    for b in _bytewise(raw):
        events += dec.feed(b)
    assert events == [ev("héllo €😀")]


# --------------------------------------------------------------------------- EOF / close


def test_eof_mid_event_not_dispatched_close_returns_pending() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: a\ndata: [DONE]") == []
    assert dec.close() == "a\n[DONE]"


@pytest.mark.parametrize(
    ("stream", "pending"),
    [
        (b"data: [DONE]", "[DONE]"),
        (b"data: [DONE]\n", "[DONE]"),
        (b"data: [DONE]\r", "[DONE]"),
        (b"data:[DONE]", "[DONE]"),
        (b"data", ""),
        (b"data: x\n\ndata: [DONE]\r\n", "[DONE]"),
        (b"data: x\n\n", None),
        (b"data: x\n\nevent: y", None),
        (b"data: x\n\n: comment", None),
        (b"", None),
        (b"id: 3\nretry: 9", None),
    ],
)
def test_close_returns_pending_data(stream: bytes, pending: str | None) -> None:
    for chunks in ([stream], _bytewise(stream)):
        dec = SSEDecoder()
        for chunk in chunks:
            dec.feed(chunk)
        assert dec.close() == pending


def test_unterminated_lines_do_not_change_id_or_retry_at_close() -> None:
    dec = SSEDecoder()
    dec.feed(b"id: 1\nretry: 5\n\nid: 2\nretry: 6")
    assert dec.close() is None
    assert dec.last_event_id == "1"
    assert dec.retry == 5


def test_feed_after_close_raises() -> None:
    dec = SSEDecoder()
    dec.feed(b"data: x\n\n")
    assert dec.close() is None
    with pytest.raises(InvariantError):
        dec.feed(b"data: y\n\n")
    assert dec.close() is None  # idempotent


# --------------------------------------------------------------------------- line limit

LIMIT = 16


@pytest.mark.parametrize("bytewise", [False, True], ids=["whole", "bytewise"])
@pytest.mark.parametrize("term", [b"\n", b"\r", b"\r\n"], ids=["LF", "CR", "CRLF"])
def test_line_of_exactly_the_limit_is_accepted(bytewise: bool, term: bytes) -> None:
    # The limit counts the line's content, not its terminator.
    line = b"data: " + b"x" * (LIMIT - 6)
    assert len(line) == LIMIT
    stream = line + term + term
    chunks = _bytewise(stream) if bytewise else [stream]
    events, tail = _feed_all(chunks, max_line_bytes=LIMIT)
    assert events == [ev("x" * (LIMIT - 6))]
    assert tail is None


@pytest.mark.parametrize("bytewise", [False, True], ids=["whole", "bytewise"])
@pytest.mark.parametrize("terminated", [False, True])
def test_line_over_the_limit_raises(bytewise: bool, terminated: bool) -> None:
    line = b"data: " + b"x" * (LIMIT - 5)
    stream = b"data: ok\n\n" + line + (b"\n\n" if terminated else b"")
    dec = SSEDecoder(max_line_bytes=LIMIT)
    chunks = _bytewise(stream) if bytewise else [stream]
    fed = 0

    def feed_all() -> None:
        nonlocal fed
        for chunk in chunks:
            dec.feed(chunk)
            fed += len(chunk)

    with pytest.raises(BackendProtocolError) as info:
        feed_all()
    assert info.value.code == "sse_line_too_long"
    assert info.value.status == 502
    assert str(info.value) == f"SSE line exceeds {LIMIT} bytes"
    if bytewise:
        # Raised on the byte that made the line too long: nothing more was buffered.
        assert fed == len(b"data: ok\n\n") + LIMIT
    with pytest.raises(InvariantError):
        dec.feed(b"\n")  # the decoder is closed after the error
    assert dec.close() is None


def test_long_comment_and_unknown_lines_count_too() -> None:
    for line in (b":" + b"x" * LIMIT, b"x" * (LIMIT + 1)):
        with pytest.raises(BackendProtocolError):
            SSEDecoder(max_line_bytes=LIMIT).feed(line + b"\n")


def test_data_buffer_limit() -> None:
    # Data buffer size = sum of (value bytes + 1 LF) over the data lines.
    seven = b"data:" + b"a" * 7 + b"\n"  # 8 bytes of data buffer
    events, _ = _feed_all([seven * 2 + b"\n"], max_line_bytes=LIMIT)
    assert events == [ev("aaaaaaa\naaaaaaa")]
    for chunks in ([seven * 2 + b"data:\n\n"], _bytewise(seven * 2 + b"data:\n\n")):
        with pytest.raises(BackendProtocolError) as info:
            _feed_all(chunks, max_line_bytes=LIMIT)
        assert info.value.code == "sse_line_too_long"
    # The budget is per event: it resets at dispatch.
    events, _ = _feed_all([(seven * 2 + b"\n") * 3], max_line_bytes=LIMIT)
    assert len(events) == 3


def test_default_limit_is_16_mib_and_enforced_across_many_feeds() -> None:
    assert DEFAULT_MAX_LINE_BYTES == 16 * 1024 * 1024
    dec = SSEDecoder()
    piece = b"x" * 65536
    for _ in range(DEFAULT_MAX_LINE_BYTES // len(piece)):
        assert dec.feed(piece) == []
    with pytest.raises(BackendProtocolError, match="16777216"):
        dec.feed(b"x")


def test_big_line_under_default_limit_is_fine() -> None:
    args = '{"code": "' + "y" * (1 << 20) + '"}'
    raw = b"data: " + args.encode() + b"\n\n"
    dec = SSEDecoder()
    events: list[SSEEvent] = []
    for i in range(0, len(raw), 1000):
        events += dec.feed(raw[i : i + 1000])
    assert events == [ev(args)]


def test_invalid_limit() -> None:
    with pytest.raises(ValueError, match="positive"):
        SSEDecoder(max_line_bytes=0)


# --------------------------------------------------------------------------- encoder


def test_encode_event_simple() -> None:
    assert encode_event("hi") == b"data: hi\n\n"
    assert encode_event("") == b"data: \n\n"


def test_encode_event_all_fields() -> None:
    raw = encode_event("x", event="error", id="42", retry=1000)
    assert raw == b"event: error\nid: 42\nretry: 1000\ndata: x\n\n"
    assert decode_three_ways(raw) == [ev("x", event="error", id="42", retry=1000)]


@pytest.mark.parametrize("text", ["a\nb\nc", "a\rb\rc", "a\r\nb\r\nc", "a\r\nb\nc"])
def test_encode_event_multi_line(text: str) -> None:
    raw = encode_event(text)
    assert raw == b"data: a\ndata: b\ndata: c\n\n"
    assert decode_three_ways(raw) == [ev("a\nb\nc")]


def test_encode_event_keeps_leading_space_and_unicode_separators() -> None:
    text = "  lead\u2028sep\n"
    assert decode_three_ways(encode_event(text)) == [ev(text)]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"event": "a\nb"},
        {"event": "a\r"},
        {"id": "1\n"},
        {"id": "\r1"},
        {"id": "1\x002"},
        {"retry": -1},
    ],
)
def test_encode_event_rejects(kwargs: dict[str, str | int]) -> None:
    with pytest.raises(ValueError, match="SSE"):
        encode_event("x", **kwargs)  # type: ignore[arg-type]


def test_encode_comment() -> None:
    assert encode_comment() == b":\n\n"
    assert encode_comment("ping") == b": ping\n\n"
    assert decode_three_ways(encode_comment() + encode_comment("ping")) == []
    for bad in ("a\nb", "a\r"):
        with pytest.raises(ValueError, match="CR or LF"):
            encode_comment(bad)


def test_done_constant() -> None:
    assert DONE == b"data: [DONE]\n\n"
    assert decode_three_ways(DONE) == [ev("[DONE]")]


# --------------------------------------------------------------------------- transcripts


def _transcript(name: str) -> bytes:
    return (files("iop.testing") / "transcripts" / name).read_bytes()


def test_vllm_transcript_byte_by_byte() -> None:
    raw = _transcript("vllm_text_stream_with_usage.txt")
    events = decode_three_ways(raw, two_piece_splits=False)
    assert all(e.event == "message" and e.id is None and e.retry is None for e in events)
    assert events[-1] == ev("[DONE]")
    chunks = [msgspec.json.decode(e.data, type=ChatChunk) for e in events[:-1]]
    assert len(chunks) == 12
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    text = "".join(d.content or "" for d in deltas if d is not None)
    assert text == "Hello! How can I help you today?"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10


@pytest.mark.parametrize(
    "name",
    [
        "hermes_text_tool_call_in_content_vllm.txt",
        "llamacpp_stream.txt",
        "ollama_v1_stream.txt",
        "vllm_reasoning_stream_ge_v0.16.txt",
        "vllm_tool_call_stream_hermes.txt",
    ],
)
def test_other_sse_transcripts(name: str) -> None:
    raw = _transcript(name)
    events = decode_three_ways(raw, two_piece_splits=False)
    assert events[-1] == ev("[DONE]")
    assert len(events) == raw.count(b"\ndata: ") + 1
    for e in events[:-1]:
        msgspec.json.decode(e.data)
    crlf = raw.replace(b"\n", b"\r\n")
    assert decode_three_ways(crlf, two_piece_splits=False) == events


# --------------------------------------------------------------------------- properties

_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def _reference_decode(
    raw: bytes, surface: frozenset[str] = frozenset()
) -> tuple[list[SSEEvent], str, int | None]:
    """A direct, slow transcription of the spec over a decoded string
    (plus the fields in ``surface``, returned where they occur)."""
    text = raw.decode("utf-8", "replace")
    if text.startswith("\ufeff"):
        text = text[1:]
    lines = _LINE_BREAK.split(text)[:-1]  # the last piece is unterminated: dropped
    events: list[SSEEvent] = []
    data, event_type, id_buffer, last_id = "", "", "", ""
    block_retry: int | None = None
    retry: int | None = None
    for line in lines:
        if line == "":
            last_id = id_buffer
            if data:
                events.append(
                    ev(data[:-1], event_type or "message", id_buffer or None, block_retry)
                )
            data, event_type, block_retry = "", "", None
            continue
        if line.startswith(":"):
            continue
        field, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if field == "data":
            data += value + "\n"
        elif field == "event":
            event_type = value
        elif field == "id":
            if "\x00" not in value:
                id_buffer = value
        elif field == "retry" and value and all(c in "0123456789" for c in value):
            retry = block_retry = int(value)
        elif field in surface:
            events.append(SSEEvent(value, field=field))
    return events, last_id, retry


_SSE_TOKENS = st.sampled_from(
    [
        b"data",
        b"error",
        b"event",
        b"id",
        b"retry",
        b":",
        b": ",
        b" ",
        b"\r",
        b"\n",
        b"\r\n",
        b"\n\n",
        b"12",
        b"x",
        b"\x00",
        b"\xef\xbb\xbf",
        b"\xef",
        b"\xbb\xbf",
        b"\xff",
        b"\xc3\xa9",
        b"\xe2\x80\xa8",
    ]
)
_SSE_BYTES = st.lists(_SSE_TOKENS | st.binary(max_size=3), max_size=60).map(b"".join)


def _partition(raw: bytes, cuts: Sequence[int]) -> list[bytes]:
    points = sorted({c % (len(raw) + 1) for c in cuts})
    bounds = [0, *points, len(raw)]
    return [raw[a:b] for a, b in itertools.pairwise(bounds)]


_Outcome = tuple[list[SSEEvent], str | None, str | None, str, int | None]


def _run(chunks: Iterable[bytes], limit: int, surface: Sequence[str] = ()) -> _Outcome:
    """Decode; return (events, error code or None, close(), last_event_id, retry)."""
    dec = SSEDecoder(max_line_bytes=limit, surface_fields=surface)
    events: list[SSEEvent] = []
    try:
        for chunk in chunks:
            events += dec.feed(chunk)
    except BackendProtocolError as exc:
        return events, exc.code, None, "", None
    return events, None, dec.close(), dec.last_event_id, dec.retry


@settings(max_examples=300)
@given(raw=_SSE_BYTES, cuts=st.lists(st.integers(min_value=0), max_size=20))
def test_splitting_invariance_and_reference(raw: bytes, cuts: list[int]) -> None:
    whole = _run([raw], DEFAULT_MAX_LINE_BYTES)
    assert whole[1] is None
    assert _run(_partition(raw, cuts), DEFAULT_MAX_LINE_BYTES) == whole
    assert _run(_bytewise(raw), DEFAULT_MAX_LINE_BYTES) == whole
    ref_events, ref_last_id, ref_retry = _reference_decode(raw)
    assert whole[0] == ref_events
    assert whole[3] == ref_last_id
    assert whole[4] == ref_retry


@settings(max_examples=300)
@given(raw=_SSE_BYTES, cuts=st.lists(st.integers(min_value=0), max_size=20))
def test_surfaced_fields_splitting_invariance_and_reference(raw: bytes, cuts: list[int]) -> None:
    surface = ("error",)
    whole = _run([raw], DEFAULT_MAX_LINE_BYTES, surface)
    assert whole[1] is None
    assert _run(_partition(raw, cuts), DEFAULT_MAX_LINE_BYTES, surface) == whole
    assert _run(_bytewise(raw), DEFAULT_MAX_LINE_BYTES, surface) == whole
    ref_events, ref_last_id, ref_retry = _reference_decode(raw, frozenset(surface))
    assert whole[0] == ref_events
    assert (whole[3], whole[4]) == (ref_last_id, ref_retry)
    # Surfacing only adds items: the dispatched events are the spec's.
    plain = _run([raw], DEFAULT_MAX_LINE_BYTES)[0]
    assert [e for e in whole[0] if e.field is None] == plain


@settings(max_examples=300)
@given(
    raw=_SSE_BYTES,
    cuts=st.lists(st.integers(min_value=0), max_size=20),
    limit=st.integers(min_value=1, max_value=24),
)
def test_splitting_invariance_with_small_limit(raw: bytes, cuts: list[int], limit: int) -> None:
    whole = _run([raw], limit)
    unlimited = _run([raw], DEFAULT_MAX_LINE_BYTES)[0]
    for chunks in (_partition(raw, cuts), _bytewise(raw)):
        split = _run(chunks, limit)
        if whole[1] is not None:
            # Both raise; events returned before the error are a prefix of the
            # full decode (fed whole, the failing feed returns none).
            assert whole[1] == split[1] == "sse_line_too_long"
            assert split[0] == unlimited[: len(split[0])]
        else:
            assert split == whole
            assert whole[0] == unlimited


_NO_BREAK = st.text().map(lambda s: s.replace("\r", "").replace("\n", ""))


@st.composite
def _event_specs(draw: st.DrawFn) -> tuple[str, str | None, str | None, int | None]:
    pieces = st.text(max_size=8) | st.sampled_from(["\r", "\n", "\r\n"])
    data = "".join(draw(st.lists(pieces, max_size=10)))
    event = draw(st.none() | _NO_BREAK)
    id_ = draw(st.none() | _NO_BREAK.map(lambda s: s.replace("\x00", "")))
    retry = draw(st.none() | st.integers(min_value=0, max_value=10**12))
    return data, event, id_, retry


@given(specs=st.lists(_event_specs(), max_size=8), cuts=st.lists(st.integers(min_value=0)))
def test_round_trip(
    specs: list[tuple[str, str | None, str | None, int | None]], cuts: list[int]
) -> None:
    raw = b"".join(encode_event(d, event=e, id=i, retry=r) for d, e, i, r in specs)
    expected: list[SSEEvent] = []
    last_id = ""
    for data, event, id_, retry in specs:
        if id_ is not None:
            last_id = id_
        normalised = data.replace("\r\n", "\n").replace("\r", "\n")
        expected.append(ev(normalised, event or "message", last_id or None, retry))
    events, tail = _feed_all(_partition(raw, cuts))
    assert events == expected
    assert tail is None
