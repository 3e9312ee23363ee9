"""The edge's OpenAI chat-completions output, sans-IO: RuntimeEvents in, bytes out.

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
computed once per stream (trio-stack.md §5b: ~0.14 µs against ~0.7 µs for
dict + encode + framing). ``feed_many`` joins the bytes of several events so
the HTTP layer can coalesce what is queued into one send (§5e).

The wire format is OpenAI's (protocols.md §2.2): every choice carries
``"logprobs":null`` and ``"finish_reason":null`` until the finish chunk
``{"delta":{},"finish_reason":...}``; with ``stream_options.include_usage``
every chunk carries ``"usage":null`` and one last chunk with ``"choices":[]``
carries the usage. Errors after the headers are ``data: {"error": {...}}`` in
OpenAI's error shape, which the official SDK raises as ``APIError``, then
``data: [DONE]``.

The output policy
-----------------
``OutputPolicy`` is ``iop.config.OutputPolicy`` (per model in the edge's
config), re-exported here. What each field does in this module:

* ``strict``: reasoning is never sent (no ``reasoning_content``) and
  ``<think>...</think>`` blocks are stripped from the content. Without
  buffering the stripping is streaming-safe: like the tool filter, a trailing
  ``"<"``, ``"<thi"`` ... is held back until it is known not to be a tag.
* ``stream_buffer``: only with ``strict`` (ignored otherwise, as the seed's
  ``if outputPolicy.Strict && outputPolicy.StreamBuffer``): the whole run is
  buffered, normalised and sent at once. The client sees the role chunk, then
  nothing until the run ends: the HTTP layer should send ``keepalive()``
  meanwhile (``ChatCompletionStream.buffered`` says when).
* ``xml_completion_tool``: for agents that speak XML tools in the prompt,
  such as Cline or Roo Code, for which a plain-text answer is a protocol error
  that costs a retry. Only with ``strict``, and only where the whole text is
  known (buffered streams, non-streaming responses): a final text that is not
  blank, comes with no tool call (native or synthesised) and holds no XML
  tool call is sent as
  ``<{tool}>\n<result>\n{text}\n</result>\n</{tool}>`` (e.g.
  ``attempt_completion``). An "XML tool call" (:func:`has_xml_tool_call`) is
  a closed element with a lower-case snake_case name
  (``<read_file>...</read_file>``, as every Cline/Roo tool is named), or the
  configured tool's own element; ``<thinking>`` or ``<b>`` are not.
* ``text_tool_calls``: see ``shouldSynthesizeTextToolCalls`` below.

Decisions where seed 001 calls helpers it does not define
----------------------------------------------------------
* ``normalizeNativeToolCallsForResponse`` -> :func:`normalize_tool_calls`:
  calls keep their order and are re-indexed 0..n-1 (the SDK accumulates by
  ``index``, so indexes must be unique); a missing or repeated id becomes
  ``call_<run id>_<i>``; blank arguments become ``"{}"``, other arguments are
  passed as the backend produced them (even if not valid JSON: nothing is
  lost, and OpenAI documents that arguments may be invalid JSON); a name that
  matches a declared tool only case-insensitively, or with a ``functions.``
  prefix (and optionally a ``:<n>`` suffix, Kimi-K2 style), is mapped to the
  declared name; any other name is kept as it is.
* ``shouldSynthesizeTextToolCalls`` -> ``OutputPolicy.text_tool_calls``:
  ``"fallback"`` (default) synthesises only when ``Complete.text_tool_fallback``
  is set; ``"always"`` whenever the request has tools; ``"never"`` never. In
  every mode synthesis needs the request's tools: ``parse_tool_calls`` with no
  tools accepts any name, which would turn ordinary JSON answers into calls.
* ``normalizeCompletionOutput`` -> ``_resolve``: only under ``strict``:
  ``<think>...</think>`` blocks are removed from the content (tags matched
  ASCII case-insensitively; an unclosed ``<think>`` removes the rest of the
  text, since that is reasoning cut off by ``max_tokens``; a stray
  ``</think>`` is removed alone; whitespace right after a removed block is
  dropped), reasoning is dropped, and ``xml_completion_tool`` wraps the text
  (above). Streaming and buffered strict output use the same stripper, so
  they produce the same text. The wrapping is the last step, after tool-call
  synthesis: wrapping text that goes out with tool calls would make an XML
  agent finish while the calls are pending.
* ``finish_reason``: ``tool_calls`` whenever calls are sent (as the seed); a
  backend that says ``tool_calls`` but produced none (vLLM issues #50477,
  #53363: prose with ``finish_reason: "tool_calls"``) is reported as ``stop``
  so clients do not wait for calls that never come.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from typing import Final, assert_never

import msgspec

from iop.config import OutputPolicy
from iop.errors import InvariantError
from iop.events import (
    Cancelled,
    CancelReason,
    Complete,
    Delta,
    EmbeddingData,
    Error,
    FinishReason,
    ReasoningDelta,
    RuntimeEvent,
    Start,
    TokenCount,
    ToolCall,
    Usage,
)
from iop.spec import ChatRequest, Tool
from iop.wire import DONE, ToolTextFilter, parse_tool_calls, unstreamed_cleaned_text

__all__ = [
    "KEEPALIVE",
    "PREVIEW_CHARS",
    "ChatCompletionCollector",
    "ChatCompletionStream",
    "OutputPolicy",
    "StreamSummary",
    "cancel_message",
    "cancel_status",
    "error_body",
    "has_xml_tool_call",
    "normalize_tool_calls",
    "openai_error_type",
    "strip_think",
    "wrap_xml_completion",
]

KEEPALIVE: Final[bytes] = b": keep-alive\n\n"
"""An SSE comment: clients ignore it, proxies and idle timers see traffic."""

PREVIEW_CHARS: Final = 1000
"""Bound of the content/reasoning previews in the close log line (seed 001
logs ``previewString(s, 1000)``)."""


def _synthesises(policy: OutputPolicy, request: ChatRequest, complete: Complete) -> bool:
    """Seed 001's ``shouldSynthesizeTextToolCalls``: tool calls from this run's text?"""
    if not request.tools or policy.text_tool_calls == "never":
        return False
    return policy.text_tool_calls == "always" or complete.text_tool_fallback


# --- errors ------------------------------------------------------------------------


class _ErrorInfo(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None
    code: str | None


class _ErrorResponse(msgspec.Struct, frozen=True):
    error: _ErrorInfo


_encode: Final = msgspec.json.encode


def _scrub(text: str) -> str:
    """``text`` with lone surrogates (which UTF-8 cannot encode) replaced by ``?``."""
    return text.encode("utf-8", "replace").decode("utf-8")


def openai_error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status.

    429 is ``rate_limit_error``, any other 4xx ``invalid_request_error`` (what
    OpenAI sends for 400, 401, 404 alike, the ``code`` tells them apart), and
    everything else ``server_error``.
    """
    if status == 429:
        return "rate_limit_error"
    if 400 <= status <= 499:
        return "invalid_request_error"
    return "server_error"


def error_body(
    message: str, *, type: str, code: str | None = None, param: str | None = None
) -> bytes:
    """OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``."""
    try:
        return _encode(_ErrorResponse(_ErrorInfo(message, type, param, code)))
    except UnicodeEncodeError:  # a lone surrogate in a relayed backend message
        return _encode(_ErrorResponse(_ErrorInfo(_scrub(message), type, param, code)))


_TIMEOUT_REASONS: Final = frozenset(
    {
        CancelReason.FIRST_TOKEN_TIMEOUT,
        CancelReason.IDLE_TIMEOUT,
        CancelReason.TOTAL_TIMEOUT,
        CancelReason.QUEUE_TIMEOUT,
    }
)

_CANCEL_MESSAGES: Final[dict[CancelReason, str]] = {
    CancelReason.CLIENT_DISCONNECT: "the client disconnected",
    CancelReason.NODE_LOST: "node disconnected",
    CancelReason.FIRST_TOKEN_TIMEOUT: "timed out waiting for the first token",
    CancelReason.IDLE_TIMEOUT: "timed out waiting for the next token",
    CancelReason.TOTAL_TIMEOUT: "the run exceeded its total time limit",
    CancelReason.QUEUE_TIMEOUT: "timed out waiting for capacity",
    CancelReason.EXPLICIT: "the run was cancelled",
    CancelReason.SHUTDOWN: "the server is shutting down",
    CancelReason.SLOW_CLIENT: "the client stopped reading its response",
}


def cancel_status(reason: CancelReason) -> int:
    """The HTTP status a cancelled run is reported with.

    503 when the node was lost (the request may be retried elsewhere), 504 for
    every timeout (first token, idle, total, queue), 408 for a slow client
    (the server stopped waiting for it; it is not reading, so it is for logs
    and metrics), 500 for the rest (explicit cancel, shutdown, and a client
    disconnect nobody will read).
    """
    if reason is CancelReason.NODE_LOST:
        return 503
    if reason in _TIMEOUT_REASONS:
        return 504
    if reason is CancelReason.SLOW_CLIENT:
        return 408
    return 500


def cancel_message(event: Cancelled) -> str:
    """The client-facing message of a cancelled run: the event's, or its reason's."""
    return event.message or _CANCEL_MESSAGES.get(event.reason, f"run cancelled: {event.reason}")


def _error_status(status: int) -> int:
    return status if 400 <= status <= 599 else 500


# --- text normalisation --------------------------------------------------------------

_THINK_OPEN: Final = "<think>"
_THINK_CLOSE: Final = "</think>"
_ASCII_LOWER: Final = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def _partial_tag_len(folded: str, start: int, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``folded[start:]`` that is a proper tag prefix."""
    longest = max(len(t) for t in tags)
    for i in range(max(start, len(folded) - longest + 1), len(folded)):
        tail = folded[i:]
        if any(len(tail) < len(t) and t.startswith(tail) for t in tags):
            return len(folded) - i
    return 0


class _ThinkStripper:
    """Streaming-safe removal of ``<think>...</think>`` blocks.

    Like ``ToolTextFilter``, it holds back a trailing part of the text that
    could still become a tag (``"<"``, ``"</thi"``); everything inside a block
    is dropped. ``feed(all) + flush()`` equals ``strip_think(all)`` for every
    way of splitting ``all``.
    """

    __slots__ = ("_inside", "_skip_space", "_tail")

    def __init__(self) -> None:
        self._inside = False
        self._skip_space = False  # drop whitespace right after a removed block
        self._tail = ""  # held text: a possible tag prefix

    def feed(self, text: str) -> str:
        if not self._inside and not self._tail and not self._skip_space and "<" not in text:
            return text  # fast path: plain text outside any block
        s = self._tail + text
        self._tail = ""
        folded = s.translate(_ASCII_LOWER)
        out: list[str] = []
        pos = 0
        while True:
            if self._inside:
                end = folded.find(_THINK_CLOSE, pos)
                if end < 0:
                    keep = _partial_tag_len(folded, pos, (_THINK_CLOSE,))
                    self._tail = s[len(s) - keep :] if keep else ""
                    break
                pos = end + len(_THINK_CLOSE)
                self._inside = False
                self._skip_space = True
                continue
            opened = folded.find(_THINK_OPEN, pos)
            closed = folded.find(_THINK_CLOSE, pos)
            if opened < 0 and closed < 0:
                keep = _partial_tag_len(folded, pos, (_THINK_OPEN, _THINK_CLOSE))
                self._emit(out, s[pos : len(s) - keep])
                self._tail = s[len(s) - keep :] if keep else ""
                break
            if opened >= 0 and (closed < 0 or opened < closed):
                self._emit(out, s[pos:opened])
                pos = opened + len(_THINK_OPEN)
                self._inside = True
            else:  # a stray closer: drop the tag, keep the text before it
                self._emit(out, s[pos:closed])
                pos = closed + len(_THINK_CLOSE)
                self._skip_space = True
        return "".join(out)

    def _emit(self, out: list[str], piece: str) -> None:
        if self._skip_space:
            piece = piece.lstrip()
            if not piece:
                return
            self._skip_space = False
        if piece:
            out.append(piece)

    def flush(self) -> str:
        """End of text: release a held non-tag tail (an unclosed block is dropped)."""
        out: list[str] = []
        if not self._inside:
            self._emit(out, self._tail)
        self._inside, self._skip_space, self._tail = False, False, ""
        return "".join(out)


def strip_think(text: str) -> str:
    """Remove ``<think>...</think>`` blocks from ``text`` (see the module docstring)."""
    stripper = _ThinkStripper()
    return stripper.feed(text) + stripper.flush()


_XML_TOOL_CALL: Final = re.compile(r"<([a-z][a-z0-9]*(?:_[a-z0-9]+)+)\s*>.*?</\1\s*>", re.DOTALL)


def has_xml_tool_call(text: str, tool: str = "") -> bool:
    """True when ``text`` holds an XML tool call (a closed snake_case element or ``tool``)."""
    if _XML_TOOL_CALL.search(text):
        return True
    return bool(tool) and f"<{tool}>" in text and f"</{tool}>" in text


def wrap_xml_completion(text: str, tool: str) -> str:
    """Wrap ``text`` as an XML completion tool call (``OutputPolicy.xml_completion_tool``)."""
    return f"<{tool}>\n<result>\n{text.strip()}\n</result>\n</{tool}>"


# --- tool calls ----------------------------------------------------------------------

_FUNCTIONS_PREFIX: Final = "functions."
_INDEX_SUFFIX: Final = re.compile(r":\d+\Z")


def _declared_name(name: str, exact: frozenset[str], folded: dict[str, str]) -> str:
    if name in exact or not exact:
        return name
    bare = name.strip()
    if bare.casefold().startswith(_FUNCTIONS_PREFIX):
        bare = bare[len(_FUNCTIONS_PREFIX) :]
    for candidate in (bare, _INDEX_SUFFIX.sub("", bare)):
        if candidate in exact:
            return candidate
        hit = folded.get(candidate.casefold())
        if hit is not None:
            return hit
    return name


def normalize_tool_calls(
    calls: Sequence[ToolCall], tools: Sequence[Tool] | None, *, run_id: str
) -> tuple[ToolCall, ...]:
    """Native tool calls, made safe for an OpenAI client (seed's
    ``normalizeNativeToolCallsForResponse``; decisions in the module docstring).

    Args:
        calls: The calls of ``Complete.tool_calls``, in order.
        tools: The request's tools, to map near-miss names onto.
        run_id: Used for synthesised ids ``call_<run_id>_<i>``.

    Returns:
        The calls, indexed 0..n-1, each with a unique id, a name, and
        arguments that are never blank.
    """
    declared = [t.function.name for t in tools or ()]
    exact = frozenset(declared)
    folded: dict[str, str] = {}
    for name in declared:
        folded.setdefault(name.casefold(), name)
    seen: set[str] = set()
    out: list[ToolCall] = []
    for i, call in enumerate(calls):
        call_id = call.id.strip()
        if not call_id or call_id in seen:
            call_id = f"call_{run_id}_{i}"
        seen.add(call_id)
        out.append(
            ToolCall(
                id=call_id,
                name=_declared_name(call.name, exact, folded),
                arguments=call.arguments if call.arguments.strip() else "{}",
                index=i,
            )
        )
    return tuple(out)


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
        return _encode(_scrub(text))


def _preview(parts: list[str]) -> str:
    text = "".join(parts)
    return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 3] + "..."


# --- resolving a finished run ----------------------------------------------------------


class _Resolved(msgspec.Struct, frozen=True, gc=False):
    content: str
    reasoning: str
    calls: tuple[ToolCall, ...]
    finish_reason: str
    normalized: bool


def _finish_reason(complete: Complete, calls: tuple[ToolCall, ...]) -> str:
    if calls:
        return FinishReason.TOOL_CALLS.value
    if complete.finish_reason is FinishReason.TOOL_CALLS:
        return FinishReason.STOP.value
    return complete.finish_reason.value


def _resolve(
    text: str,
    reasoning: str,
    complete: Complete,
    request: ChatRequest,
    policy: OutputPolicy,
    run_id: str,
) -> _Resolved:
    """The final answer of a run whose whole text is known (buffered, non-streaming).

    The branches of seed 001's ``streamBufferedChatCompletion``: native calls
    (text sent with them), else synthesised calls (cleaned text sent with
    them), else the text; under ``strict`` the text is normalised first.
    """
    normalized = False
    if policy.strict:
        stripped = strip_think(text)
        normalized = stripped != text or bool(reasoning)
        text, reasoning = stripped, ""
    calls: tuple[ToolCall, ...] = ()
    content = text
    if complete.tool_calls:
        calls = normalize_tool_calls(complete.tool_calls, request.tools, run_id=run_id)
    elif _synthesises(policy, request, complete):
        parsed = parse_tool_calls(text, request.tools, id_prefix=f"call_{run_id}_")
        if parsed.calls:
            calls, content = parsed.calls, parsed.content
    tool = policy.xml_completion_tool
    if (
        policy.strict
        and tool
        and not calls
        and content.strip()
        and not has_xml_tool_call(content, tool)
    ):
        content = wrap_xml_completion(content, tool)
        normalized = True
    return _Resolved(content, reasoning, calls, _finish_reason(complete, calls), normalized)


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
    normalised output (as the seed logs it), otherwise the raw text received.

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


class _TextLog:
    """Length and head of a text, keeping the whole text only when asked."""

    __slots__ = ("head", "keep", "length", "parts", "room")

    def __init__(self, *, keep: bool) -> None:
        self.keep = keep
        self.parts: list[str] = []  # the whole text (keep) or its head
        self.length = 0
        self.room = PREVIEW_CHARS

    def add(self, text: str) -> None:
        self.length += len(text)
        if self.keep:
            self.parts.append(text)
        elif self.room > 0:
            self.parts.append(text[: self.room])
            self.room -= len(text)

    def text(self) -> str:
        return "".join(self.parts)

    def forget(self) -> None:
        """Stop keeping the whole text; keep its head, as ``keep=False`` does."""
        head = "".join(self.parts)[:PREVIEW_CHARS]
        self.keep = False
        self.parts = [head]
        self.room = PREVIEW_CHARS - len(head)


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
        self._request = request
        self._run_id = completion_id.removeprefix("chatcmpl-")
        self._state = _State.FRESH
        self._outcome = "open"
        self._finish_reason: str | None = None
        self._tool_call_count = 0
        self._normalized = False
        self._include_usage = bool(request.stream_options and request.stream_options.include_usage)
        self._buffered = policy.strict and policy.stream_buffer
        tools = bool(request.tools)
        # The tool filter only exists when the request has tools (seed:
        # ``if len(req.Tools) > 0``); the full text is kept only when it may
        # be parsed for tool calls, or buffered. Otherwise a run's memory here
        # is constant: lengths and previews.
        self._filter = ToolTextFilter() if tools and not self._buffered else None
        self._stripper = _ThinkStripper() if policy.strict and not self._buffered else None
        self._content = _TextLog(keep=tools or self._buffered)
        self._reasoning = _TextLog(keep=self._buffered)
        # What tool parsing sees (only with the filter): the raw text, or the
        # think-stripped text under strict.
        self._source = self._content.parts if self._stripper is None else []
        self._emitted: list[str] = []  # content sent, kept only with the filter
        self._resolved: _Resolved | None = None
        # Past this much content, tool calls are no longer parsed from text
        # (policy.max_tool_text_chars): the kept text is what costs memory.
        self._tool_text_limit = policy.max_tool_text_chars
        self.tool_text_abandoned = False

        # Pre-encoded templates (trio-stack.md §5b): only the text is encoded per chunk.
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
        return self._buffered

    def _check_open(self, what: str) -> None:
        if self._state is _State.FINISHED:
            raise InvariantError(f"{what} after the stream finished")

    # -- chunk builders -----------------------------------------------------------------

    def _content_chunk(self, text: str) -> bytes:
        return self._content_pre + _encode_text(text) + self._text_post

    def _send_content(self, text: str) -> bytes:
        """A content chunk for text the client has not seen (b"" when empty)."""
        if not text:
            return b""
        if self._filter is not None:
            self._emitted.append(text)
        return self._content_chunk(text)

    def _tool_calls_chunk(self, calls: tuple[ToolCall, ...]) -> bytes:
        self._tool_call_count = len(calls)
        items = [
            _DeltaToolCall(c.index, c.id, "function", _Function(c.name, c.arguments)) for c in calls
        ]
        return b"".join(
            (self._delta_pre, b'{"tool_calls":', _encode(items), b"}", self._delta_post)
        )

    def _end(self, finish_reason: str, usage: Usage) -> bytes:
        """The finish chunk, the usage chunk if asked for, and ``[DONE]``."""
        self._finish_reason = finish_reason
        self._outcome = "complete"
        self._state = _State.FINISHED
        parts = [
            self._head,
            b'[{"index":0,"delta":{},"logprobs":null,"finish_reason":',
            _encode(finish_reason),
            b"}]",
            self._tail,
        ]
        if self._include_usage:
            parts += [self._head, b'[],"usage":', _encode(_usage(usage)), b"}\n\n"]
        parts.append(DONE)
        return b"".join(parts)

    def _error(
        self, message: str, type: str, code: str | None, outcome: str, *, param: str | None = None
    ) -> bytes:
        self._outcome = outcome
        self._state = _State.FINISHED
        body = error_body(message, type=type, code=code, param=param)
        return b"data: " + body + b"\n\n" + DONE

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
        return prefix + self._error(message, type, code, "failed")

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
        if isinstance(event, Delta):
            text = event.text
            if not text:  # seed: ``if event.GetDelta() == "" { continue }``
                return b""
            self._content.add(text)
            if self._buffered:
                return b""
            if self._stripper is not None:
                text = self._stripper.feed(text)
                if not text:
                    return b""
            if self._filter is not None:
                if self._stripper is not None:
                    self._source.append(text)
                text = self._filter.append(text)
                if self._content.length > self._tool_text_limit:
                    text += self._abandon_tool_text()
                if not text:
                    return b""
                if self._filter is not None:
                    self._emitted.append(text)
            return self._content_pre + _encode_text(text) + self._text_post
        if isinstance(event, ReasoningDelta):
            if not event.text:
                return b""
            self._reasoning.add(event.text)
            if self._policy.strict:  # buffered implies strict
                return b""
            return self._reasoning_pre + _encode_text(event.text) + self._text_post
        if isinstance(event, Complete):
            if self._buffered:
                return self._complete_buffered(event)
            return self._complete(event)
        if isinstance(event, Error):
            return self._error(
                event.message or "run failed",
                openai_error_type(_error_status(event.status)),
                event.code,
                "error",
                param=event.param,
            )
        if isinstance(event, Cancelled):
            return self._error(
                cancel_message(event),
                openai_error_type(cancel_status(event.reason)),
                event.reason.value,
                "cancelled",
            )
        if isinstance(event, Start | EmbeddingData | TokenCount):
            return b""  # a chat run has no other operation's output
        assert_never(event)

    def _abandon_tool_text(self) -> str:
        """The answer outgrew ``max_tool_text_chars``: release what the filter
        holds, stop keeping the text, and stream the rest as plain text (native
        tool calls in ``Complete`` still go out)."""
        assert self._filter is not None
        held = self._filter.flush()
        self._filter = None
        self._source, self._emitted = [], []
        self._content.forget()
        self.tool_text_abandoned = True
        return held

    def _complete(self, complete: Complete) -> bytes:
        """Seed 001's ``case "complete"`` of ``streamChatCompletion``."""
        out: list[bytes] = []
        flt = self._filter
        if self._stripper is not None and (rest := self._stripper.flush()):
            if flt is not None:
                self._source.append(rest)
                rest = flt.append(rest)
            out.append(self._send_content(rest))
        calls: tuple[ToolCall, ...] = ()
        if complete.tool_calls:
            # ``if len(nativeToolCalls) > 0``: pending text first, then the calls.
            if flt is not None:
                out.append(self._send_content(flt.flush()))
            calls = normalize_tool_calls(
                complete.tool_calls, self._request.tools, run_id=self._run_id
            )
        elif flt is not None and _synthesises(self._policy, self._request, complete):
            # ``else if toolTextFilter != nil && shouldSynthesizeTextToolCalls(...)``
            parsed = parse_tool_calls(
                "".join(self._source), self._request.tools, id_prefix=f"call_{self._run_id}_"
            )
            if parsed.calls:
                calls = parsed.calls
                remaining = unstreamed_cleaned_text(parsed.content, "".join(self._emitted))
                out.append(self._send_content(remaining))
            else:
                out.append(self._send_content(flt.flush()))
        elif flt is not None:
            # ``else if toolTextFilter != nil``: release what was held back.
            out.append(self._send_content(flt.flush()))
        if calls:
            out.append(self._tool_calls_chunk(calls))
        out.append(self._end(_finish_reason(complete, calls), complete.usage))
        return b"".join(out)

    def _complete_buffered(self, complete: Complete) -> bytes:
        """Seed 001's ``streamBufferedChatCompletion``, once the run is done."""
        resolved = _resolve(
            self._content.text(),
            self._reasoning.text(),
            complete,
            self._request,
            self._policy,
            self._run_id,
        )
        self._resolved = resolved
        self._normalized = resolved.normalized
        out: list[bytes] = []
        if resolved.content:
            out.append(self._content_chunk(resolved.content))
        if resolved.calls:
            out.append(self._tool_calls_chunk(resolved.calls))
        out.append(self._end(resolved.finish_reason, complete.usage))
        return b"".join(out)

    def summary(self) -> StreamSummary:
        """What the close log line reports (seed 001's deferred ``logger.Info``)."""
        if self._resolved is not None:
            content, reasoning = self._resolved.content, self._resolved.reasoning
            content_len, reasoning_len = len(content), len(reasoning)
            content_preview, reasoning_preview = _preview([content]), _preview([reasoning])
        else:
            content_len, reasoning_len = self._content.length, self._reasoning.length
            content_preview = _preview(self._content.parts)
            reasoning_preview = _preview(self._reasoning.parts)
        return StreamSummary(
            outcome=self._outcome,
            strict=self._policy.strict,
            stream_buffer=self._buffered,
            xml_completion_tool=self._policy.xml_completion_tool,
            normalized=self._normalized,
            finish_reason=self._finish_reason,
            tool_calls=self._tool_call_count,
            content_len=content_len,
            reasoning_len=reasoning_len,
            content_preview=content_preview,
            reasoning_preview=reasoning_preview,
        )


# --- non-streaming -------------------------------------------------------------------


class ChatCompletionCollector:
    """One non-streaming chat completion: RuntimeEvents in, one body out.

    Args:
        completion_id: ``"chatcmpl-<run id>"``.
        created: Unix time of the response.
        model: The model name shown to the client.
        request: The client's request.
        policy: The output policy (strict normalisation, XML wrapping and
            tool-call synthesis apply as for a buffered stream).

    ``result()`` gives ``(200, chat.completion body)`` for a completed run, or
    ``(status, OpenAI error body)`` for an ``Error`` (its status; anything
    outside 400-599 becomes 500) or a ``Cancelled`` (``cancel_status``: 503
    node lost, 504 timeouts, 500 otherwise).
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
        self._request = request
        self._policy = policy if policy is not None else OutputPolicy()
        self._run_id = completion_id.removeprefix("chatcmpl-")
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._result: tuple[int, bytes] | None = None
        self._resolved: _Resolved | None = None
        self._outcome = "open"

    @property
    def finished(self) -> bool:
        """True once a terminal event was fed."""
        return self._result is not None

    def feed(self, event: RuntimeEvent) -> None:
        """Take one event.

        Raises:
            InvariantError: If a terminal event was already fed.
        """
        if self._result is not None:
            raise InvariantError(f"feed({type(event).__name__}) after the run finished")
        if isinstance(event, Delta):
            if event.text:
                self._content.append(event.text)
        elif isinstance(event, ReasoningDelta):
            if event.text:
                self._reasoning.append(event.text)
        elif isinstance(event, Complete):
            self._result = (200, self._body(event))
            self._outcome = "complete"
        elif isinstance(event, Error):
            status = _error_status(event.status)
            message = event.message or "run failed"
            body = error_body(
                message, type=openai_error_type(status), code=event.code, param=event.param
            )
            self._result = (status, body)
            self._outcome = "error"
        elif isinstance(event, Cancelled):
            status = cancel_status(event.reason)
            body = error_body(
                cancel_message(event), type=openai_error_type(status), code=event.reason.value
            )
            self._result = (status, body)
            self._outcome = "cancelled"

    def feed_many(self, events: Iterable[RuntimeEvent]) -> None:
        """Take several events."""
        for event in events:
            self.feed(event)

    def _body(self, complete: Complete) -> bytes:
        resolved = _resolve(
            "".join(self._content),
            "".join(self._reasoning),
            complete,
            self._request,
            self._policy,
            self._run_id,
        )
        self._resolved = resolved
        message = _Message(
            role="assistant",
            content=resolved.content or (None if resolved.calls else ""),
            tool_calls=[
                _MessageToolCall(c.id, "function", _Function(c.name, c.arguments))
                for c in resolved.calls
            ]
            if resolved.calls
            else msgspec.UNSET,
            reasoning_content=resolved.reasoning or msgspec.UNSET,
        )
        return _encode(
            _Completion(
                id=self._completion_id,
                object="chat.completion",
                created=self._created,
                model=self._model,
                choices=[_Choice(0, message, None, resolved.finish_reason)],
                usage=_usage(complete.usage),
            )
        )

    def result(self) -> tuple[int, bytes]:
        """``(status, body)`` of the response.

        Raises:
            InvariantError: If no terminal event was fed yet.
        """
        if self._result is None:
            raise InvariantError("result() before the run finished")
        return self._result

    def summary(self) -> StreamSummary:
        """The same log fields as a stream's, for the non-streaming close line."""
        resolved = self._resolved
        content = resolved.content if resolved else "".join(self._content)
        reasoning = resolved.reasoning if resolved else "".join(self._reasoning)
        return StreamSummary(
            outcome=self._outcome,
            strict=self._policy.strict,
            stream_buffer=False,
            xml_completion_tool=self._policy.xml_completion_tool,
            normalized=resolved.normalized if resolved else False,
            finish_reason=resolved.finish_reason if resolved else None,
            tool_calls=len(resolved.calls) if resolved else 0,
            content_len=len(content),
            reasoning_len=len(reasoning),
            content_preview=_preview([content]),
            reasoning_preview=_preview([reasoning]),
        )
