"""ChatStreamParser: real transcripts whole, byte by byte, split anywhere, with garbage."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from importlib.resources import files

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iop.errors import BackendProtocolError, BackendStreamError
from iop.events import Complete, Delta, FinishReason, ReasoningDelta
from iop.wire import ChatStreamParser, parse_error_body
from iop.wire._errors import excerpt, parse_error_value


def transcript(name: str) -> bytes:
    return (files("iop.testing") / "transcripts" / name).read_bytes()


def body_of_capture(name: str) -> bytes:
    """The SSE body of a captured curl -i transcript (after the header block)."""
    raw = transcript(name)
    start = raw.index(b"\n\ndata: ") + 2
    end = raw.index(b"data: [DONE]\n\n", start) + len(b"data: [DONE]\n\n")
    return raw[start:end]


Events = list[Delta | ReasoningDelta]


def run(
    data: bytes, pieces: Callable[[bytes], list[bytes]] = lambda b: [b], **kw: object
) -> tuple[Events, Complete]:
    parser = ChatStreamParser(label="t", **kw)  # type: ignore[arg-type]
    out: Events = []
    for piece in pieces(data):
        out.extend(parser.feed(piece))
        if parser.done:
            break
    else:
        parser.feed_eof()
    return out, parser.complete()


WHOLE = lambda b: [b]  # noqa: E731
BYTEWISE = lambda b: [b[i : i + 1] for i in range(len(b))]  # noqa: E731
SPLITTERS = {"whole": WHOLE, "bytewise": BYTEWISE}


def text(events: Events) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


def reasoning(events: Events) -> str:
    return "".join(e.text for e in events if isinstance(e, ReasoningDelta))


@pytest.mark.parametrize("split", SPLITTERS)
def test_vllm_text_stream_with_usage(split: str) -> None:
    events, done = run(transcript("vllm_text_stream_with_usage.txt"), SPLITTERS[split])
    assert text(events) == "Hello! How can I help you today?"
    assert done.finish_reason is FinishReason.STOP
    assert not done.usage.estimated
    assert done.usage.input_tokens > 0
    assert done.usage.output_tokens > 0


@pytest.mark.parametrize("split", SPLITTERS)
def test_vllm_reasoning_field(split: str) -> None:
    events, done = run(transcript("vllm_reasoning_stream_ge_v0.16.txt"), SPLITTERS[split])
    assert reasoning(events).startswith("\nOkay")
    assert text(events)
    assert done.finish_reason is FinishReason.STOP


@pytest.mark.parametrize("split", SPLITTERS)
def test_vllm_native_tool_calls(split: str) -> None:
    _events, done = run(transcript("vllm_tool_call_stream_hermes.txt"), SPLITTERS[split])
    assert done.finish_reason is FinishReason.TOOL_CALLS
    assert [c.name for c in done.tool_calls] == ["get_weather"]
    assert json.loads(done.tool_calls[0].arguments)["city"] == "Paris"
    assert done.tool_calls[0].id.startswith("chatcmpl-tool-")


@pytest.mark.parametrize("split", SPLITTERS)
def test_llamacpp_stream(split: str) -> None:
    events, done = run(transcript("llamacpp_stream.txt"), SPLITTERS[split])
    assert text(events).startswith("Hello!")
    assert done.finish_reason is FinishReason.STOP


@pytest.mark.parametrize("split", SPLITTERS)
def test_real_xllamacpp_stream_usage_and_timings(split: str) -> None:
    events, done = run(body_of_capture("real-xllamacpp-chat-stream.txt"), SPLITTERS[split])
    assert len(events) > 5
    assert done.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert done.usage.input_tokens > 0
    assert not done.usage.estimated


@pytest.mark.parametrize("split", SPLITTERS)
def test_ollama_role_on_every_delta(split: str) -> None:
    events, done = run(transcript("ollama_v1_stream.txt"), SPLITTERS[split])
    assert text(events).startswith("Hello!")
    assert done.finish_reason is FinishReason.STOP


def test_trailing_garbage_after_done_is_ignored() -> None:
    data = transcript("vllm_text_stream_with_usage.txt") + b"data: {garbage\n\nmore junk"
    events, _ = run(data)
    assert text(events) == "Hello! How can I help you today?"


def test_eof_without_done_is_an_error() -> None:
    data = transcript("vllm_text_stream_with_usage.txt")
    cut = data[: data.index(b"data: [DONE]")]
    with pytest.raises(
        BackendStreamError, match=r"ended without \[DONE\] \(finish_reason was 'stop'\)"
    ):
        run(cut)


def test_unterminated_final_done_is_accepted() -> None:
    # A final `data: [DONE]` missing its blank line (docs/architecture.md,
    # "Facts about the backends: SSE framing").
    data = transcript("vllm_text_stream_with_usage.txt").rstrip(b"\n")
    events, done = run(data)
    assert text(events) == "Hello! How can I help you today?"
    assert done.finish_reason is FinishReason.STOP


def test_trailing_garbage_before_eof_is_truncation() -> None:
    data = transcript("llamacpp_stream.txt")
    cut = data[: data.index(b"data: [DONE]")] + b'data: {"choi'
    with pytest.raises(BackendStreamError):
        run(cut)


def chunk(delta: dict[str, object], finish: str | None = None, **extra: object) -> bytes:
    obj = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def test_malformed_chunks_are_counted_up_to_the_limit() -> None:
    data = chunk({"content": "a"}) + b"data: {not json\n\n" + chunk({"content": "b"}) + DONE
    events, done = run(data)
    assert text(events) == "ab"
    assert done.malformed_chunks == 1
    with pytest.raises(BackendProtocolError, match="1 malformed chunks"):
        run(data, malformed_chunk_limit=0)


def test_wrong_types_count_as_malformed() -> None:
    data = chunk({"content": 5}) + DONE
    _, done = run(data)
    assert done.malformed_chunks == 1


def test_in_stream_error_object_vllm() -> None:
    data = chunk({"content": "a"}) + (
        b'data: {"error": {"message": "boom", "type": "InternalServerError", "param": null, "code": 500}}\n\n'
        + DONE
    )
    with pytest.raises(BackendStreamError, match="t stream error: boom") as info:
        run(data)
    assert info.value.status == 500


def test_in_stream_error_string_lemonade() -> None:
    data = b'data: {"error":"Internal server error during streaming"}\n\n'
    with pytest.raises(BackendStreamError, match="Internal server error during streaming"):
        run(data)


def test_sse_error_event() -> None:
    data = b'event: error\ndata: {"message": "kaput"}\n\n'
    with pytest.raises(BackendStreamError, match="kaput"):
        run(data)


@pytest.mark.parametrize("split", SPLITTERS)
def test_old_llamacpp_error_field_fails_the_run(split: str) -> None:
    # llama-server before PR #16109 wrote `error: {...}` (a non-standard SSE
    # field) and then [DONE]: a spec reader sees an empty success.
    data = transcript("llamacpp_pre16109_midstream_error.txt")
    parser = ChatStreamParser(label="t")
    out: Events = []

    def feed_all() -> None:
        for piece in SPLITTERS[split](data):
            out.extend(parser.feed(piece))
        parser.feed_eof()

    with pytest.raises(BackendStreamError) as info:
        feed_all()
    assert str(info.value) == "t stream error: Failed to decode the batch (synthetic message)"
    assert info.value.status == 500
    # The deltas before the error are returned, however the bytes were split.
    assert text(out) == "Hello! How"
    assert not parser.done


@pytest.mark.parametrize(
    "error",
    [
        b'data: {"error": {"message": "boom", "code": 500}}\n\n',
        b'event: error\ndata: {"message": "boom"}\n\n',
        b'error: {"code": 500, "message": "boom"}\n\n',
    ],
)
def test_the_deltas_before_an_error_in_the_same_piece_come_first(error: bytes) -> None:
    # One socket read may hold several events and the error after them: the
    # run must still send the deltas, then fail (a 200 and an SSE error on
    # the edge, not a bare 5xx).
    parser = ChatStreamParser(label="t")
    data = chunk({"content": "a"}) + chunk({"content": "b"}) + error + DONE
    assert text(parser.feed(data)) == "ab"
    assert parser.failed
    with pytest.raises(BackendStreamError, match="boom"):
        parser.feed_eof()
    # The stream stays failed: whatever came after the error counts for nothing.
    for call in (lambda: parser.feed(b""), parser.complete):
        with pytest.raises(BackendStreamError, match="boom"):
            call()


def test_an_error_with_nothing_before_it_is_raised_at_once() -> None:
    parser = ChatStreamParser(label="t")
    with pytest.raises(BackendStreamError, match="boom"):
        parser.feed(b'data: {"error": "boom"}\n\n' + DONE)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b'error: {"code":500,"message":"x"}', "x"),
        (b'error: {"error": {"message": "wrapped", "code": 503}}', "wrapped"),
        (b'error: "just a string"', "just a string"),
        (b"error: not json at all", "not json at all"),
        (b"error", "backend error"),
    ],
)
def test_error_field_shapes(line: bytes, message: str) -> None:
    with pytest.raises(BackendStreamError, match=f"t stream error: {message}"):
        run(line + b"\n\n" + DONE)


@pytest.mark.parametrize(
    ("raw", "mapped"), [("repetition", "length"), ("eos", "stop"), ("weird", "stop")]
)
def test_finish_reason_mapping(raw: str, mapped: str) -> None:
    _, done = run(chunk({"content": "a"}, raw) + DONE)
    assert done.finish_reason == mapped


@pytest.mark.parametrize("raw", ["abort", "error"])
def test_abort_finish_reason_is_an_error(raw: str) -> None:
    with pytest.raises(BackendStreamError, match=raw):
        run(chunk({"content": "a"}, raw) + DONE)


def test_usage_with_cached_and_reasoning_tokens() -> None:
    usage = {
        "prompt_tokens": 30,
        "total_tokens": 40,
        "completion_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 16},
        "completion_tokens_details": {"reasoning_tokens": 4},
    }
    data = (
        chunk({"content": "a"}, "stop")
        + b"data: "
        + json.dumps({"choices": [], "usage": usage}).encode()
        + b"\n\n"
        + DONE
    )
    _, done = run(data)
    assert (done.usage.input_tokens, done.usage.output_tokens) == (30, 10)
    assert (done.usage.cached_input_tokens, done.usage.reasoning_tokens) == (16, 4)


def test_sglang_top_level_reasoning_tokens_and_llamacpp_cache_n() -> None:
    usage = {"prompt_tokens": 5, "completion_tokens": 7, "reasoning_tokens": 3}
    data = (
        chunk({"content": "a"}, "stop")
        + b"data: "
        + json.dumps({"choices": [], "usage": usage, "timings": {"cache_n": 2}}).encode()
        + b"\n\n"
        + DONE
    )
    _, done = run(data)
    assert done.usage.reasoning_tokens == 3
    assert done.usage.cached_input_tokens == 2


def test_no_usage_is_estimated_from_chunks() -> None:
    data = (
        chunk({"reasoning_content": "r"}) + chunk({"content": "a"}) + chunk({"content": "b"}) + DONE
    )
    _, done = run(data)
    assert done.usage.estimated
    assert done.usage.output_tokens == 3
    assert done.usage.reasoning_tokens == 1


def test_reasoning_content_null_beside_reasoning() -> None:
    # vLLM 0.11.1-0.15 sends both fields, reasoning_content null on content deltas.
    data = chunk({"reasoning": "think", "reasoning_content": None}) + chunk(
        {"content": "x", "reasoning": None, "reasoning_content": None}
    )
    events, _ = run(data + DONE)
    assert events == [ReasoningDelta("think"), Delta("x")]


def test_choiceless_and_empty_frames_are_skipped() -> None:
    data = (
        b'data: {"choices": []}\n\n' + b"data:\n\n" + b": ping\n\n" + chunk({"content": "x"}) + DONE
    )
    events, done = run(data)
    assert events == [Delta("x")]
    assert done.malformed_chunks == 0


def test_oversize_line_is_a_protocol_error() -> None:
    data = chunk({"content": "x" * 5000}) + DONE
    with pytest.raises(BackendProtocolError, match="SSE line exceeds"):
        run(data, max_line_bytes=1024)


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=30))
def test_any_split_gives_the_same_result(cuts: list[int]) -> None:
    data = transcript("vllm_tool_call_stream_hermes.txt")
    points = sorted({c % (len(data) + 1) for c in cuts})

    def pieces(b: bytes) -> list[bytes]:
        bounds = [0, *points, len(b)]
        return [b[x:y] for x, y in itertools.pairwise(bounds)]

    assert run(data, pieces) == run(data)


@settings(max_examples=200, deadline=None)
@given(junk=st.binary(max_size=200))
def test_arbitrary_bytes_never_crash(junk: bytes) -> None:
    parser = ChatStreamParser(malformed_chunk_limit=1000)
    try:
        parser.feed(junk)
        parser.feed_eof()
    except (BackendStreamError, BackendProtocolError):
        pass


# --- error bodies ---------------------------------------------------------------

VLLM_NESTED = transcript("vllm_400_auto_tool_choice_body.json")


@pytest.mark.parametrize(
    ("body", "message", "code"),
    [
        (
            VLLM_NESTED,
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
            "400",
        ),
        (
            b'{"object":"error","message":"flat legacy","type":"BadRequestError","param":null,"code":400}',
            "flat legacy",
            "400",
        ),
        (
            b'{"error":{"code":400,"message":"\'messages\' is required","type":"invalid_request_error"}}',
            "'messages' is required",
            "400",
        ),
        (
            b'{"error":{"message":"model \'llama9\' not found","type":"not_found_error","param":null,"code":null}}',
            "model 'llama9' not found",
            None,
        ),
        (
            b'{"error": "No model loaded and no model specified in request"}',
            "No model loaded and no model specified in request",
            None,
        ),
        (b"<html>Bad Gateway</html>", "<html>Bad Gateway</html>", None),
        (b"", "", None),
    ],
)
def test_error_body_shapes(body: bytes, message: str, code: str | None) -> None:
    info = parse_error_body(body)
    assert info.message == message
    assert info.code == code


def test_lemonade_status_code_inside_error() -> None:
    info = parse_error_value({"message": "x", "type": "backend_error", "status_code": 503})
    assert info is not None
    assert info.status == 503


def test_excerpt_is_bounded() -> None:
    assert len(excerpt(b"x" * 100_000)) == 4096
