"""OpenAI-compatible chat streams to RuntimeEvents (sans-IO).

Legacy ``/v1/completions`` streams parse the same way: a ``text_completion``
chunk's ``choices[0].text`` is a ``Delta`` (the rest of the stream, usage,
errors and ``[DONE]``, is the same as chat's).

``ChatStreamParser`` takes the bytes of a ``/v1/chat/completions`` streaming
response body as they arrive and returns typed events. It is the shared core
of every adapter that talks to an OpenAI-compatible server (seeds 000 and 003
had two copies of this loop), and it is where their weak spots are fixed:

* framing is the full WHATWG SSE algorithm (CR/LF/CRLF, comments, BOM), not
  "lines starting with ``data: ``";
* reasoning comes from ``reasoning_content`` or ``reasoning``;
* tool-call deltas are accumulated by index and id;
* usage keeps cached and reasoning tokens (vLLM, SGLang, llama.cpp timings);
* an in-stream error object, ``event: error`` or an ``error:`` field line
  (llama.cpp before PR #16109, which then sends ``[DONE]``) fails the run;
* a chunk that does not decode is counted, logged by the adapter, and
  tolerated up to a limit; past it the run fails (seed: silently skipped);
* the stream must end with ``[DONE]``: EOF without it is an error, never a
  silent success. The one leniency: a final ``data: [DONE]`` missing only its
  blank line counts (docs/architecture.md, "Facts about the backends: SSE
  framing").

Usage
-----
::

    parser = ChatStreamParser(label="vllm")
    for piece in body:                       # bytes, any split
        for event in parser.feed(piece):     # Delta / ReasoningDelta
            ...
        if parser.done:                      # [DONE] seen: stop reading
            break
    else:
        parser.feed_eof()                    # raises if [DONE] never came
    complete = parser.complete()
"""

from __future__ import annotations

from typing import Final

import msgspec

from iop.config import DEFAULT_MAX_LINE_BYTES, DEFAULT_MAX_TOOL_CALL_BYTES
from iop.errors import BackendProtocolError, BackendStreamError
from iop.events import Complete, Delta, FinishReason, ReasoningDelta, Usage
from iop.wire._chunks import ChatChunk, ChunkUsage
from iop.wire._errors import openai_error_code, parse_error_value
from iop.wire._sse import SSEDecoder
from iop.wire._toolcalls import ToolCallAccumulator

__all__ = ["DEFAULT_MALFORMED_CHUNK_LIMIT", "ChatStreamParser", "map_finish_reason"]

DEFAULT_MALFORMED_CHUNK_LIMIT: Final = 8

_DECODER: Final = msgspec.json.Decoder(ChatChunk)

_FINISH: Final[dict[str, FinishReason]] = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "tool_calls": FinishReason.TOOL_CALLS,
    "content_filter": FinishReason.CONTENT_FILTER,
    "function_call": FinishReason.FUNCTION_CALL,
    # vLLM's "repetition" detector stops a degenerate answer: closest is length.
    "repetition": FinishReason.LENGTH,
    # Ollama passes native done reasons through.
    "eos": FinishReason.STOP,
}


def map_finish_reason(raw: str) -> FinishReason:
    """Map a backend's finish reason onto OpenAI's; ``abort``/``error`` raise.

    Raises:
        BackendStreamError: vLLM and SGLang report a server-side abort or an
            internal error through the finish reason.
    """
    key = raw.strip().lower()
    if key in ("abort", "error"):
        raise BackendStreamError(f"backend ended the generation with finish_reason={key!r}")
    return _FINISH.get(key, FinishReason.STOP)


class ChatStreamParser:
    """Incremental parser of one OpenAI-compatible streaming response.

    Args:
        label: Names the backend kind in error messages (``vllm``, ...).
        max_line_bytes: Longest SSE line accepted.
        malformed_chunk_limit: Chunks that fail to decode before the stream
            is declared broken.
        tool_id_prefix: Prefix of ids synthesised for tool calls without one.
        max_tool_call_bytes: Largest total size of the streamed tool calls
            (ids, names, arguments) kept until the end of the stream.
    """

    def __init__(
        self,
        *,
        label: str = "backend",
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        malformed_chunk_limit: int = DEFAULT_MALFORMED_CHUNK_LIMIT,
        tool_id_prefix: str = "call_",
        max_tool_call_bytes: int = DEFAULT_MAX_TOOL_CALL_BYTES,
    ) -> None:
        self._label = label
        # llama.cpp before PR #16109 sent a mid-stream failure as an
        # ``error:`` field line, then [DONE]: ask the decoder for it.
        self._sse = SSEDecoder(max_line_bytes=max_line_bytes, surface_fields=("error",))
        self._malformed_limit = malformed_chunk_limit
        self._tools = ToolCallAccumulator(id_prefix=tool_id_prefix, max_bytes=max_tool_call_bytes)
        self._usage: ChunkUsage | None = None
        self._cached_from_timings: int | None = None
        self._finish_raw: str | None = None
        self.done = False
        # The error that ended the stream (raised again by every call).
        self._error: BackendStreamError | BackendProtocolError | None = None
        self.malformed_chunks = 0
        self.last_malformed: str = ""
        self.content_chunks = 0
        self.reasoning_chunks = 0

    def feed(self, data: bytes) -> list[Delta | ReasoningDelta]:
        """Consume body bytes; return the content and reasoning deltas they complete.

        One read may hold several events and then the backend's error:
        the events completed before the error are returned, and the error
        is raised by the next call (``failed`` is then true).

        Raises:
            BackendStreamError: The backend reported an error in the stream.
            BackendProtocolError: A line was too long, too many chunks were
                malformed, or the tool calls grew past their limit.
        """
        if self._error is not None:
            raise self._error
        out: list[Delta | ReasoningDelta] = []
        if self.done:
            return out
        try:
            for sse in self._sse.feed(data):
                if sse.field == "error" or sse.event == "error":
                    raise self._stream_error(sse.data)
                payload = sse.data
                if payload.strip() == "[DONE]":
                    self.done = True
                    return out
                if not payload.strip():
                    continue  # empty `data:` frames exist in the wild; skip them
                self._handle(payload, out)
        except (BackendStreamError, BackendProtocolError) as exc:
            self._error = exc
            if not out:
                raise
            # The events before the error go out first (``failed``).
        return out

    @property
    def failed(self) -> bool:
        """The stream failed. The error is raised by every call from now
        on; when ``feed`` returned events completed before it, by the next:
        a caller sends those, then calls ``feed_eof`` to raise it."""
        return self._error is not None

    def feed_eof(self) -> None:
        """The body ended. Raises unless ``[DONE]`` was seen.

        Raises:
            BackendStreamError: The stream ended without ``[DONE]``.
        """
        if self._error is not None:
            raise self._error
        if self.done:
            return
        pending = self._sse.close()
        if pending is not None and pending.strip() == "[DONE]":
            self.done = True
            return
        seen = f" (finish_reason was {self._finish_raw!r})" if self._finish_raw else ""
        raise BackendStreamError(f"{self._label} stream ended without [DONE]{seen}")

    def _stream_error(self, payload: str) -> BackendStreamError:
        """The error of an ``event: error`` event or an ``error:`` field line.

        The value is an error object (llama.cpp's old ``{"code", "message",
        "type"}``), one wrapped in ``{"error": ...}``, a JSON string, or text.
        """
        value = _loads_any(payload)
        if isinstance(value, dict) and "error" in value:
            value = value["error"]
        return self._error_from_value(value, payload.strip() or "error event")

    def _error_from_value(self, value: object, fallback: str) -> BackendStreamError:
        info = parse_error_value(value)
        msg = info.message if info else fallback
        status = info.status if info and info.status else 502
        openai = openai_error_code(info, status) if info else None
        error = BackendStreamError(
            f"{self._label} stream error: {msg}",
            status=status,
            code=openai.code if openai else None,
        )
        error.param = openai.param if openai else None
        return error

    def _handle(self, payload: str, out: list[Delta | ReasoningDelta]) -> None:
        try:
            chunk = _DECODER.decode(payload)
        except msgspec.DecodeError as exc:
            self.malformed_chunks += 1
            self.last_malformed = f"{exc}: {payload[:200]!r}"
            if self.malformed_chunks > self._malformed_limit:
                raise BackendProtocolError(
                    f"{self._label} sent {self.malformed_chunks} malformed chunks "
                    f"(limit {self._malformed_limit}); last: {self.last_malformed}"
                ) from exc
            return
        if chunk.error is not None:
            raise self._error_from_value(chunk.error, str(chunk.error))
        if chunk.usage is not None:
            self._usage = chunk.usage
        if chunk.timings is not None:
            cache_n = chunk.timings.get("cache_n")
            if isinstance(cache_n, int):
                self._cached_from_timings = cache_n
        if not chunk.choices:
            return
        choice = chunk.choices[0]
        if choice.finish_reason:
            self._finish_raw = choice.finish_reason
        delta = choice.delta
        if delta is None:
            if choice.text:  # a legacy completions chunk
                self.content_chunks += 1
                out.append(Delta(choice.text))
            return
        if delta.tool_calls:
            self._tools.add(delta.tool_calls)
        reasoning = delta.reasoning_text()
        if reasoning:
            self.reasoning_chunks += 1
            out.append(ReasoningDelta(reasoning))
        if delta.content:
            self.content_chunks += 1
            out.append(Delta(delta.content))

    def usage(self) -> Usage:
        """The usage the backend reported, or an estimate from the stream."""
        u = self._usage
        if u is None:
            # Seed: when the backend sends no usage, count the output. Servers
            # stream about one token per chunk, so chunks are the estimate.
            return Usage(
                output_tokens=self.content_chunks + self.reasoning_chunks,
                reasoning_tokens=self.reasoning_chunks,
                cached_input_tokens=self._cached_from_timings or 0,
                estimated=True,
            )
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else None
        reasoning = (
            u.completion_tokens_details.reasoning_tokens if u.completion_tokens_details else None
        )
        return Usage(
            input_tokens=u.prompt_tokens or 0,
            output_tokens=u.completion_tokens or 0,
            cached_input_tokens=cached or self._cached_from_timings or 0,
            reasoning_tokens=reasoning or u.reasoning_tokens or 0,
        )

    def complete(self, *, text_tool_fallback: bool = False) -> Complete:
        """The terminal event for a stream that ended with ``[DONE]``.

        Raises:
            BackendStreamError: The stream did not end properly, or the
                backend's finish reason says it aborted.
        """
        if self._error is not None:
            raise self._error
        if not self.done:
            raise BackendStreamError(f"{self._label} stream ended without [DONE]")
        finish = map_finish_reason(self._finish_raw) if self._finish_raw else FinishReason.STOP
        calls = self._tools.calls()
        if calls and finish is FinishReason.STOP:
            finish = FinishReason.TOOL_CALLS
        return Complete(
            finish_reason=finish,
            usage=self.usage(),
            tool_calls=calls,
            text_tool_fallback=text_tool_fallback,
            malformed_chunks=self.malformed_chunks,
        )


def _loads_any(text: str) -> object:
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text
