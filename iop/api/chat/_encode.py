"""OpenAI chat-completions output, sans-IO: RuntimeEvents in, bytes out.

Theory of operation
-------------------
A run's events (``iop.events``) become either an SSE stream of
``chat.completion.chunk`` objects (:class:`ChatCompletionStream`, a port of
seed 001's ``streamChatCompletion`` and ``streamBufferedChatCompletion``) or
one ``chat.completion`` body (:class:`ChatCompletionCollector`). Neither does
I/O: the HTTP layer feeds events and writes whatever bytes come back, so every
branch of the seed is testable without a server. Nothing here imports trio,
httpx or quart.

A stream goes through three states (``_State``)::

    FRESH --start()/feed()/fail()--> STREAMING --terminal event/fail()--> FINISHED

The role chunk ``{"role":"assistant","content":""}`` is always the first
chunk: ``start()`` sends it explicitly (e.g. together with the headers), or
the first ``feed()``/``fail()`` prepends it. ``keepalive()`` comments may go
out in any state but FINISHED. The terminal event (``Complete``, ``Error``,
``Cancelled``) or ``fail()`` ends the stream with ``data: [DONE]``; anything
fed after that is a bug and raises ``InvariantError``.

Per content delta (the hot path) the stream does no dict building: the SSE
line is ``prefix + msgspec.json.encode(text) + suffix`` with both byte strings
computed once per stream (~0.14 µs against ~0.7 µs for dict + encode +
framing; docs/benchmarks.md, "Earlier measurements: The trio-stack spike").
``feed_many`` joins the bytes of several events so the HTTP layer can
coalesce what is queued into one send (same section).

The wire format is OpenAI's (docs/api.md, "Chat Completions: The stream"):
every choice carries ``"logprobs":null`` and ``"finish_reason":null`` until
the finish chunk ``{"delta":{},"finish_reason":...}``; with
``stream_options.include_usage`` every chunk carries ``"usage":null`` and one
last chunk with ``"choices":[]`` carries the usage. Errors after the headers are ``data: {"error": {...}}`` in
OpenAI's error shape, which the official SDK raises as ``APIError``, then
``data: [DONE]``.

The output policy
-----------------
Strict mode, ``<think>`` stripping, the tool-text hold-back, tool calls
found in text, XML completion wrapping and buffered streams are applied by
``iop.api._output.OutputShaper``, the same for every surface; this module
only formats its shaped events (``iop.api._shaped``) as chat chunks. A
buffered stream (strict + ``stream_buffer``) sends the role chunk, then
nothing until the run ends: the HTTP layer sends ``keepalive()`` meanwhile
(``ChatCompletionStream.buffered`` says when). The collector uses a buffered
shaper, so a non-streaming answer is normalised whole.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Final

import msgspec

from iop.api._collect import ShapedCollector, openai_failure
from iop.api._openai_errors import error_body, scrub
from iop.api._output import OutputShaper
from iop.api._shaped import Shaped, ShapedDone, ShapedFailed, ShapedReasoning, ShapedText
from iop.config import OutputPolicy
from iop.errors import InvariantError
from iop.events import Delta, RuntimeEvent, ToolCall, Usage
from iop.spec import ChatRequest
from iop.wire import DONE

__all__ = [
    "KEEPALIVE",
    "ChatCompletionCollector",
    "ChatCompletionStream",
    "StreamSummary",
]

KEEPALIVE: Final[bytes] = b": keep-alive\n\n"
"""An SSE comment: clients ignore it, proxies and idle timers see traffic."""

_encode: Final = msgspec.json.encode


# --- encoding ------------------------------------------------------------------------


class _Function(msgspec.Struct, frozen=True, gc=False):
    name: str
    arguments: str


class _DeltaToolCall(msgspec.Struct, frozen=True, gc=False):
    index: int
    id: str
    type: str
    function: _Function


class _MessageToolCall(msgspec.Struct, frozen=True, gc=False):
    id: str
    type: str
    function: _Function


class _PromptTokensDetails(msgspec.Struct, frozen=True, gc=False):
    cached_tokens: int


class _CompletionTokensDetails(msgspec.Struct, frozen=True, gc=False):
    reasoning_tokens: int


class _Usage(msgspec.Struct, frozen=True, gc=False):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: _PromptTokensDetails
    completion_tokens_details: _CompletionTokensDetails


class _Message(msgspec.Struct, frozen=True):
    role: str
    content: str | None
    refusal: None = None
    tool_calls: list[_MessageToolCall] | msgspec.UnsetType = msgspec.UNSET
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET


class _Choice(msgspec.Struct, frozen=True):
    index: int
    message: _Message
    logprobs: None
    finish_reason: str


class _Completion(msgspec.Struct, frozen=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[_Choice]
    usage: _Usage


def _usage(usage: Usage) -> _Usage:
    return _Usage(
        prompt_tokens=usage.input_tokens,
        completion_tokens=usage.output_tokens,
        total_tokens=usage.total_tokens,
        prompt_tokens_details=_PromptTokensDetails(usage.cached_input_tokens),
        completion_tokens_details=_CompletionTokensDetails(usage.reasoning_tokens),
    )


def _encode_text(text: str) -> bytes:
    """JSON string literal for ``text``; lone surrogates (not UTF-8) become ``?``."""
    try:
        return _encode(text)
    except UnicodeEncodeError:
        return _encode(scrub(text))


def _failure_body(failed: ShapedFailed) -> bytes:
    return openai_failure(failed)[1]


# --- the stream ----------------------------------------------------------------------


class _State(enum.Enum):
    FRESH = enum.auto()
    """Nothing sent yet (keep-alives aside)."""
    STREAMING = enum.auto()
    """The role chunk is out; deltas flow."""
    FINISHED = enum.auto()
    """``[DONE]`` is out; nothing more may be sent."""


class StreamSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What the stream's close log line reports (seed 001's deferred log).

    Lengths are in characters. For a buffered stream they describe the
    normalised output (as the seed logs it), otherwise the raw text received
    (``iop.api._output.OutputStats``).

    Attributes:
        outcome: ``open`` (not finished), ``complete``, ``error``,
            ``cancelled`` or ``failed`` (``fail()`` was called).
        strict: ``OutputPolicy.strict``.
        stream_buffer: Whether the stream was buffered.
        xml_completion_tool: ``OutputPolicy.xml_completion_tool``.
        normalized: The buffered output was changed by the strict policy.
        finish_reason: The finish reason sent, if the run completed.
        tool_calls: How many tool calls were sent.
        content_len: Characters of content.
        reasoning_len: Characters of reasoning.
        content_preview: The content's head, at most ``PREVIEW_CHARS``.
        reasoning_preview: The reasoning's head, at most ``PREVIEW_CHARS``.
    """

    outcome: str
    strict: bool
    stream_buffer: bool
    xml_completion_tool: str
    normalized: bool
    finish_reason: str | None
    tool_calls: int
    content_len: int
    reasoning_len: int
    content_preview: str
    reasoning_preview: str


def _summary(
    shaper: OutputShaper,
    policy: OutputPolicy,
    *,
    outcome: str,
    buffered: bool,
    done: ShapedDone | None,
) -> StreamSummary:
    stats = shaper.stats()
    return StreamSummary(
        outcome=outcome,
        strict=policy.strict,
        stream_buffer=buffered,
        xml_completion_tool=policy.xml_completion_tool,
        normalized=stats.normalized,
        finish_reason=done.finish_reason.value if done else None,
        tool_calls=len(done.calls) if done else 0,
        content_len=stats.content_len,
        reasoning_len=stats.reasoning_len,
        content_preview=stats.content_preview,
        reasoning_preview=stats.reasoning_preview,
    )


def _outcome(failed: ShapedFailed) -> str:
    return "error" if failed.reason is None else "cancelled"


class ChatCompletionStream:
    """One streaming chat completion: RuntimeEvents in, SSE bytes out.

    Args:
        completion_id: ``"chatcmpl-<run id>"``; the run id (the part after
            ``chatcmpl-``) also names synthesised tool-call ids.
        created: Unix time of the response, constant over the stream.
        model: The model name shown to the client.
        request: The client's request (tools, ``stream_options``).
        policy: The output policy.

    Every method returns the bytes to write now (possibly ``b""``). See the
    module docstring for the states and the wire format.
    """

    def __init__(
        self,
        completion_id: str,
        created: int,
        model: str,
        request: ChatRequest,
        policy: OutputPolicy | None = None,
    ) -> None:
        self._policy = policy = policy if policy is not None else OutputPolicy()
        # Chat chunks never repeat the whole text: the shaper need not keep it.
        self._shaper = OutputShaper(
            request, policy, completion_id.removeprefix("chatcmpl-"), keep_text=False
        )
        self._feed_delta = self._shaper.feed_delta  # bound once: the per-delta call
        self._state = _State.FRESH
        self._outcome = "open"
        self._done: ShapedDone | None = None
        self._include_usage = bool(request.stream_options and request.stream_options.include_usage)

        # Pre-encoded templates (docs/api.md, "Chat Completions: The stream"): only
        # the text is encoded per chunk.
        head = b"".join(
            (
                b'data: {"id":',
                _encode(completion_id),
                b',"object":"chat.completion.chunk","created":',
                str(int(created)).encode(),
                b',"model":',
                _encode_text(model),
                b',"choices":',
            )
        )
        self._tail = (b',"usage":null' if self._include_usage else b"") + b"}\n\n"
        self._head = head
        self._delta_pre = head + b'[{"index":0,"delta":'
        self._delta_post = b',"logprobs":null,"finish_reason":null}]' + self._tail
        self._content_pre = self._delta_pre + b'{"content":'
        self._reasoning_pre = self._delta_pre + b'{"reasoning_content":'
        self._text_post = b"}" + self._delta_post

    # -- state ------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """True once ``[DONE]`` was produced."""
        return self._state is _State.FINISHED

    @property
    def buffered(self) -> bool:
        """True when the whole run is buffered (strict + stream_buffer): the
        client sees nothing until the end, so keep-alives matter."""
        return self._shaper.buffered

    @property
    def tool_text_abandoned(self) -> bool:
        """The answer outgrew ``max_tool_text_chars``: tool calls are no longer
        parsed from its text (``OutputShaper``)."""
        return self._shaper.tool_text_abandoned

    def _check_open(self, what: str) -> None:
        if self._state is _State.FINISHED:
            raise InvariantError(f"{what} after the stream finished")

    # -- chunk builders -----------------------------------------------------------------

    def _tool_calls_chunk(self, calls: tuple[ToolCall, ...]) -> bytes:
        items = [
            _DeltaToolCall(c.index, c.id, "function", _Function(c.name, c.arguments)) for c in calls
        ]
        return b"".join(
            (self._delta_pre, b'{"tool_calls":', _encode(items), b"}", self._delta_post)
        )

    def _end(self, done: ShapedDone) -> bytes:
        """The tool calls, the finish chunk, the usage chunk if asked for, and ``[DONE]``."""
        self._done = done
        self._outcome = "complete"
        self._state = _State.FINISHED
        parts = [self._tool_calls_chunk(done.calls)] if done.calls else []
        parts += [
            self._head,
            b'[{"index":0,"delta":{},"logprobs":null,"finish_reason":',
            _encode(done.finish_reason.value),
            b"}]",
            self._tail,
        ]
        if self._include_usage:
            parts += [self._head, b'[],"usage":', _encode(_usage(done.usage)), b"}\n\n"]
        parts.append(DONE)
        return b"".join(parts)

    def _error(self, body: bytes, outcome: str) -> bytes:
        self._outcome = outcome
        self._state = _State.FINISHED
        return b"data: " + body + b"\n\n" + DONE

    def _format(self, shaped: list[Shaped]) -> bytes:
        """The bytes of shaped events."""
        out: list[bytes] = []
        for s in shaped:
            if isinstance(s, ShapedText):
                out.append(self._content_pre + _encode_text(s.text) + self._text_post)
            elif isinstance(s, ShapedReasoning):
                out.append(self._reasoning_pre + _encode_text(s.text) + self._text_post)
            elif isinstance(s, ShapedDone):
                out.append(self._end(s))
            else:
                out.append(self._error(_failure_body(s), _outcome(s)))
        return b"".join(out)

    # -- the API -------------------------------------------------------------------------

    def start(self) -> bytes:
        """The role chunk; must come first, and only once.

        Raises:
            InvariantError: If the stream already started.
        """
        if self._state is not _State.FRESH:
            raise InvariantError("start() called twice")
        self._state = _State.STREAMING
        return self._delta_pre + b'{"role":"assistant","content":""}' + self._delta_post

    def keepalive(self) -> bytes:
        """An SSE comment, e.g. while the run is queued, in prefill or buffered.

        Raises:
            InvariantError: If the stream finished.
        """
        self._check_open("keepalive()")
        return KEEPALIVE

    def fail(self, message: str, *, type: str = "run_error", code: str | None = None) -> bytes:
        """End the stream with an error (e.g. a wait timeout at the HTTP layer).

        Seed 001's ``writeSSEError``: an error object, then ``[DONE]``.

        Raises:
            InvariantError: If the stream finished.
        """
        self._check_open("fail()")
        prefix = self.start() if self._state is _State.FRESH else b""
        return prefix + self._error(error_body(message, type=type, code=code), "failed")

    def feed_many(self, events: Iterable[RuntimeEvent]) -> bytes:
        """The bytes of several events, joined (for one coalesced send)."""
        return b"".join([self.feed(event) for event in events])

    def feed(self, event: RuntimeEvent) -> bytes:
        """The bytes to write for one event.

        Raises:
            InvariantError: If the stream finished.
        """
        if self._state is not _State.STREAMING:
            self._check_open(f"feed({type(event).__name__})")
            return self.start() + self.feed(event)
        if isinstance(event, Delta):  # the hot path: no shaped event is built
            text = self._feed_delta(event.text)
            return self._content_pre + _encode_text(text) + self._text_post if text else b""
        return self._format(self._shaper.feed(event))

    def summary(self) -> StreamSummary:
        """What the close log line reports (seed 001's deferred ``logger.Info``)."""
        return _summary(
            self._shaper,
            self._policy,
            outcome=self._outcome,
            buffered=self._shaper.buffered,
            done=self._done,
        )


# --- non-streaming -------------------------------------------------------------------


class ChatCompletionCollector(ShapedCollector):
    """One non-streaming chat completion: RuntimeEvents in, one body out.

    Args:
        completion_id: ``"chatcmpl-<run id>"``.
        created: Unix time of the response.
        model: The model name shown to the client.
        request: The client's request.
        policy: The output policy (strict normalisation, XML wrapping and
            tool-call synthesis apply as for a buffered stream: the shaper is
            buffered).

    ``result()`` gives ``(200, chat.completion body)`` for a completed run, or
    ``(status, OpenAI error body)`` for an ``Error`` (its status; anything
    outside 400-599 becomes 500) or a ``Cancelled`` (``cancel_status``: 503
    node lost, 504 timeouts, 500 otherwise). The ending is
    ``iop.api._collect``'s.
    """

    def __init__(
        self,
        completion_id: str,
        created: int,
        model: str,
        request: ChatRequest,
        policy: OutputPolicy | None = None,
    ) -> None:
        self._completion_id = completion_id
        self._created = int(created)
        self._model = model
        self._policy = policy = policy if policy is not None else OutputPolicy()
        run_id = completion_id.removeprefix("chatcmpl-")
        super().__init__(OutputShaper(request, policy, run_id, buffered=True))
        self._done: ShapedDone | None = None
        self._outcome = "open"

    def feed_many(self, events: Iterable[RuntimeEvent]) -> None:
        """Take several events."""
        for event in events:
            self.feed(event)

    def _body(self, done: ShapedDone) -> bytes:
        self._done = done
        self._outcome = "complete"
        message = _Message(
            role="assistant",
            content=done.content or (None if done.calls else ""),
            tool_calls=[
                _MessageToolCall(c.id, "function", _Function(c.name, c.arguments))
                for c in done.calls
            ]
            if done.calls
            else msgspec.UNSET,
            reasoning_content=done.reasoning or msgspec.UNSET,
        )
        return _encode(
            _Completion(
                id=self._completion_id,
                object="chat.completion",
                created=self._created,
                model=self._model,
                choices=[_Choice(0, message, None, done.finish_reason.value)],
                usage=_usage(done.usage),
            )
        )

    def _failure(self, failed: ShapedFailed) -> tuple[int, bytes]:
        self._outcome = _outcome(failed)
        return openai_failure(failed)

    def summary(self) -> StreamSummary:
        """The same log fields as a stream's, for the non-streaming close line."""
        return _summary(
            self._shaper, self._policy, outcome=self._outcome, buffered=False, done=self._done
        )
