"""The output policy, applied once for every surface: RuntimeEvents in, shaped events out.

``OutputShaper`` turns one run's ``RuntimeEvent`` s into the shaped events of
``iop.api._shaped`` (``ShapedText``, ``ShapedReasoning``, then exactly one of
``ShapedDone`` / ``ShapedFailed``). Every surface's encoder and collector
formats those, so strict mode, ``<think>`` stripping, tool calls found in
text and XML completion wrapping behave the same whatever API the client
speaks. Sans-IO: no trio, httpx or quart.

The pipeline, per content delta::

    Delta -> [think stripper] -> [tool-text filter] -> ShapedText

Both stages hold back text that may still be markup with the one hold-back
mechanism, ``iop.wire.HoldBack`` (the stripper watches ``<think>`` /
``</think>``, the filter ``TOOL_CALL_OPENERS``): a trailing ``"<"``,
``"<thi"``, ``"<tool_c"`` ... is held until the next delta or the end of the
run says whether it is one. A *buffered* shaper holds all text until the run
ends and resolves it whole (``_resolve``).

The output policy
-----------------
``OutputPolicy`` is ``iop.config.OutputPolicy`` (per model in the edge's
config). What each field does:

* ``strict``: reasoning is never sent and ``<think>...</think>`` blocks are
  stripped from the content. Without buffering the stripping is
  streaming-safe (the hold-back above).
* ``stream_buffer``: only with ``strict`` (ignored otherwise, as the seed's
  ``if outputPolicy.Strict && outputPolicy.StreamBuffer``): the whole run is
  buffered, normalised and sent at once. The client sees nothing until the
  run ends: the HTTP layer sends keep-alives meanwhile. Non-streaming
  responses are buffered too (``OutputShaper(..., buffered=True)``).
* ``xml_completion_tool``: for agents that speak XML tools in the prompt,
  such as Cline or Roo Code, for which a plain-text answer is a protocol error
  that costs a retry. Only with ``strict``, and only where the whole text is
  known (buffered shapers): a final text that is not blank, comes with no
  tool call (native or synthesised) and holds no XML tool call is sent as
  ``<{tool}>\\n<result>\\n{text}\\n</result>\\n</{tool}>`` (e.g.
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
  The tool-text filter only runs when the request has tools (seed:
  ``if len(req.Tools) > 0``).
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

Streaming, the text events follow seed 001's ``streamChatCompletion``: at
``Complete`` what the stripper still holds goes through the filter and out,
then native calls flush the filter's held text first; synthesised calls
release only the part of the cleaned text the client has not seen
(``unstreamed_cleaned_text``); otherwise the held text is released. Each
release is its own ``ShapedText``.

Failures (``ShapedFailed``): an ``Error`` keeps its status when it is 400-599
(else 500), its code, and its message (``"run failed"`` when empty); a
``Cancelled`` gets ``cancel_status`` (503 node lost, 504 timeouts, 500
otherwise), its reason as the code, and ``cancel_message``
(``iop.api._openai_errors``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Final, assert_never

import msgspec

from iop.api._openai_errors import cancel_message, cancel_status, error_status
from iop.api._shaped import Shaped, ShapedDone, ShapedFailed, ShapedReasoning, ShapedText
from iop.config import OutputPolicy
from iop.errors import InvariantError
from iop.events import (
    Cancelled,
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
)
from iop.spec import ChatRequest, Tool
from iop.wire import HoldBack, Tags, ToolTextFilter, parse_tool_calls, unstreamed_cleaned_text

__all__ = [
    "PREVIEW_CHARS",
    "OutputShaper",
    "OutputStats",
    "has_xml_tool_call",
    "normalize_tool_calls",
    "shape_failure",
    "strip_think",
    "wrap_xml_completion",
]

PREVIEW_CHARS: Final = 1000
"""Bound of the content/reasoning previews in ``OutputStats`` (seed 001 logs
``previewString(s, 1000)``)."""


def _synthesises(policy: OutputPolicy, request: ChatRequest, complete: Complete) -> bool:
    """Seed 001's ``shouldSynthesizeTextToolCalls``: tool calls from this run's text?"""
    if not request.tools or policy.text_tool_calls == "never":
        return False
    return policy.text_tool_calls == "always" or complete.text_tool_fallback


def shape_failure(event: Error | Cancelled) -> ShapedFailed:
    """The ``ShapedFailed`` of a failed or cancelled run (module docstring)."""
    if isinstance(event, Error):
        return ShapedFailed(
            status=error_status(event.status),
            code=event.code,
            message=event.message or "run failed",
            param=event.param,
        )
    return ShapedFailed(
        status=cancel_status(event.reason),
        code=event.reason.value,
        message=cancel_message(event),
        reason=event.reason,
        usage=event.usage,
    )


# --- <think> stripping ---------------------------------------------------------------

_THINK_OPEN: Final = "<think>"
_THINK_CLOSE: Final = "</think>"
_THINK_TAGS: Final = Tags(folded=(_THINK_OPEN, _THINK_CLOSE))


class _ThinkStripper:
    """Streaming-safe removal of ``<think>...</think>`` blocks.

    The hold-back (``iop.wire.HoldBack``, shared with the tool-text filter)
    splits the text at the tags and keeps a trailing part that could still
    become one (``"<"``, ``"</thi"``); this class drops what lies inside a
    block. ``feed(all) + flush()`` equals ``strip_think(all)`` for every way
    of splitting ``all``.
    """

    __slots__ = ("_hold", "_inside", "_skip_space")

    def __init__(self) -> None:
        self._hold = HoldBack(_THINK_TAGS)
        self._inside = False
        self._skip_space = False  # drop whitespace right after a removed block

    def feed(self, text: str) -> str:
        if not self._inside and not self._skip_space and self._hold.quiet(text):
            return text  # fast path: plain text outside any block
        out: list[str] = []
        canonical = self._hold.tags.canonical
        for i, part in enumerate(self._hold.split(text)):
            if not i % 2:  # text
                if not self._inside:
                    self._emit(out, part)
            elif canonical(part) == _THINK_CLOSE:
                # Ends the block, or is a stray closer: the tag goes, whitespace after it too.
                self._inside = False
                self._skip_space = True
            elif not self._inside:
                self._inside = True
            # A <think> inside a block is part of the block: dropped with it.
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
        tail = self._hold.flush()
        if not self._inside:
            self._emit(out, tail)
        self._inside, self._skip_space = False, False
        return "".join(out)


def strip_think(text: str) -> str:
    """Remove ``<think>...</think>`` blocks from ``text`` (see the module docstring)."""
    stripper = _ThinkStripper()
    return stripper.feed(text) + stripper.flush()


# --- XML completion ---------------------------------------------------------------------

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
    """Native tool calls, made safe for a client (seed's
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


# --- resolving a finished run ----------------------------------------------------------


class _Resolved(msgspec.Struct, frozen=True, gc=False):
    content: str
    reasoning: str
    calls: tuple[ToolCall, ...]
    finish_reason: FinishReason
    normalized: bool


def _finish_reason(complete: Complete, calls: tuple[ToolCall, ...]) -> FinishReason:
    if calls:
        return FinishReason.TOOL_CALLS
    if complete.finish_reason is FinishReason.TOOL_CALLS:
        return FinishReason.STOP
    return complete.finish_reason


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


# --- the shaper ------------------------------------------------------------------------


class OutputStats(msgspec.Struct, frozen=True, kw_only=True):
    """What a run's close log line reports of its text (seed 001's deferred log).

    Lengths are in characters. Once a buffered shaper resolved the run they
    describe the normalised output (as the seed logs it), otherwise the raw
    text received.

    Attributes:
        normalized: The buffered output was changed by the strict policy.
        content_len: Characters of content.
        reasoning_len: Characters of reasoning.
        content_preview: The content's head, at most ``PREVIEW_CHARS``.
        reasoning_preview: The reasoning's head, at most ``PREVIEW_CHARS``.
    """

    normalized: bool
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


def _preview(text: str) -> str:
    return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 3] + "..."


class OutputShaper:
    """One run's output policy: RuntimeEvents in, shaped events out.

    Args:
        request: The run's request (its tools decide the tool-text filter and
            synthesis).
        policy: The model's output policy.
        run_id: Names synthesised tool-call ids (``call_<run id>_<i>``).
        buffered: Hold all text until the run ends and resolve it whole, as
            a non-streaming response needs (a strict ``stream_buffer``
            policy buffers anyway). Only a buffered shaper wraps XML
            completions.
        keep_text: Keep the text sent, for ``ShapedDone.content`` and
            ``.reasoning``. A stream that never sends the whole text again
            (chat completions) passes False, so that a run's memory here
            stays constant when nothing else needs the text; then those
            fields are empty unless the shaper kept the text anyway
            (buffered).

    ``feed`` returns the shaped events of one RuntimeEvent (see
    ``iop.api._shaped`` for the sequence a run shapes to); ``feed_delta`` is
    the hot path for content deltas. Anything fed after the terminal event is
    a bug and raises ``InvariantError``.
    """

    __slots__ = (
        "_buffered",
        "_content",
        "_emitted",
        "_filter",
        "_finished",
        "_keep",
        "_policy",
        "_reasoning",
        "_reasoning_sent",
        "_request",
        "_resolved",
        "_run_id",
        "_source",
        "_stripper",
        "_tool_text_limit",
        "tool_text_abandoned",
    )

    def __init__(
        self,
        request: ChatRequest,
        policy: OutputPolicy,
        run_id: str,
        *,
        buffered: bool = False,
        keep_text: bool = True,
    ) -> None:
        self._request = request
        self._policy = policy
        self._run_id = run_id
        self._buffered = buffered or (policy.strict and policy.stream_buffer)
        tools = bool(request.tools)
        self._filter = ToolTextFilter() if tools and not self._buffered else None
        self._stripper = _ThinkStripper() if policy.strict and not self._buffered else None
        # The raw text received. Kept whole only when it may be parsed for tool
        # calls, or buffered; otherwise its length and head.
        self._content = _TextLog(keep=tools or self._buffered)
        self._reasoning = _TextLog(keep=self._buffered)
        # What tool parsing sees (only with the filter): the raw text, or the
        # think-stripped text under strict.
        self._source = self._content.parts if self._stripper is None else []
        # Content sent: for unstreamed_cleaned_text (filter) and ShapedDone.content.
        keep = keep_text and not self._buffered
        self._keep = keep
        self._emitted: list[str] | None = [] if keep or self._filter is not None else None
        self._reasoning_sent: list[str] | None = [] if keep else None
        self._resolved: _Resolved | None = None
        self._finished = False
        # Past this much content, tool calls are no longer parsed from text
        # (policy.max_tool_text_chars): the kept text is what costs memory.
        self._tool_text_limit = policy.max_tool_text_chars
        self.tool_text_abandoned = False

    @property
    def buffered(self) -> bool:
        """True when all text is held until the run ends (keep-alives matter)."""
        return self._buffered

    @property
    def finished(self) -> bool:
        """True once the terminal event was fed."""
        return self._finished

    def feed_delta(self, text: str) -> str:
        """The hot path: ``feed(Delta(text))``, as the text of its ``ShapedText``
        (``""`` for none), without building the event.

        Raises:
            InvariantError: If the run finished.
        """
        if self._finished:
            raise InvariantError("feed(Delta) after the run finished")
        if not text:  # seed: ``if event.GetDelta() == "" { continue }``
            return ""
        log = self._content  # _TextLog.add, inlined: this runs once per delta
        log.length += len(text)
        if log.keep:
            log.parts.append(text)
        elif log.room > 0:
            log.parts.append(text[: log.room])
            log.room -= len(text)
        if self._buffered:
            return ""
        if self._stripper is not None:
            text = self._stripper.feed(text)
            if not text:
                return ""
        if self._filter is not None:
            if self._stripper is not None:
                self._source.append(text)
            text = self._filter.append(text)
            if log.length > self._tool_text_limit:
                text += self._abandon_tool_text()
            if not text:
                return ""
        if self._emitted is not None:
            self._emitted.append(text)
        return text

    def _abandon_tool_text(self) -> str:
        """The answer outgrew ``max_tool_text_chars``: release what the filter
        holds, stop keeping the text, and shape the rest as plain text (native
        tool calls in ``Complete`` still go out)."""
        assert self._filter is not None
        held = self._filter.flush()
        self._filter = None
        self._source = []
        if not self._keep:
            self._emitted = None
        self._content.forget()
        self.tool_text_abandoned = True
        return held

    def feed(self, event: RuntimeEvent) -> list[Shaped]:
        """The shaped events for one RuntimeEvent, in order (possibly none).

        Raises:
            InvariantError: If the run finished.
        """
        if isinstance(event, Delta):
            text = self.feed_delta(event.text)
            return [ShapedText(text)] if text else []
        if self._finished:
            raise InvariantError(f"feed({type(event).__name__}) after the run finished")
        if isinstance(event, ReasoningDelta):
            text = event.text
            if not text:
                return []
            self._reasoning.add(text)
            if self._buffered or self._policy.strict:
                return []
            if self._reasoning_sent is not None:
                self._reasoning_sent.append(text)
            return [ShapedReasoning(text)]
        if isinstance(event, Complete):
            self._finished = True
            if self._buffered:
                return self._complete_buffered(event)
            return self._complete(event)
        if isinstance(event, Error | Cancelled):
            self._finished = True
            return [shape_failure(event)]
        if isinstance(event, Start | EmbeddingData | TokenCount):
            return []  # a chat-like run has no other operation's output
        assert_never(event)

    def feed_many(self, events: Iterable[RuntimeEvent]) -> list[Shaped]:
        """The shaped events of several RuntimeEvents, in order."""
        out: list[Shaped] = []
        for event in events:
            out += self.feed(event)
        return out

    def _send(self, out: list[Shaped], text: str) -> None:
        """A ``ShapedText`` for text the client has not seen (none when empty)."""
        if text:
            if self._emitted is not None:
                self._emitted.append(text)
            out.append(ShapedText(text))

    def _done(self, complete: Complete, calls: tuple[ToolCall, ...]) -> ShapedDone:
        return ShapedDone(
            finish_reason=_finish_reason(complete, calls),
            calls=calls,
            usage=complete.usage,
            content="".join(self._emitted or ()),
            reasoning="".join(self._reasoning_sent or ()),
        )

    def _complete(self, complete: Complete) -> list[Shaped]:
        """Seed 001's ``case "complete"`` of ``streamChatCompletion``."""
        out: list[Shaped] = []
        flt = self._filter
        if self._stripper is not None and (rest := self._stripper.flush()):
            if flt is not None:
                self._source.append(rest)
                rest = flt.append(rest)
            self._send(out, rest)
        calls: tuple[ToolCall, ...] = ()
        if complete.tool_calls:
            # ``if len(nativeToolCalls) > 0``: pending text first, then the calls.
            if flt is not None:
                self._send(out, flt.flush())
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
                emitted = "".join(self._emitted or ())
                self._send(out, unstreamed_cleaned_text(parsed.content, emitted))
            else:
                self._send(out, flt.flush())
        elif flt is not None:
            # ``else if toolTextFilter != nil``: release what was held back.
            self._send(out, flt.flush())
        out.append(self._done(complete, calls))
        return out

    def _complete_buffered(self, complete: Complete) -> list[Shaped]:
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
        out: list[Shaped] = []
        if resolved.reasoning:
            out.append(ShapedReasoning(resolved.reasoning))
        if resolved.content:
            out.append(ShapedText(resolved.content))
        out.append(
            ShapedDone(
                finish_reason=resolved.finish_reason,
                calls=resolved.calls,
                usage=complete.usage,
                content=resolved.content,
                reasoning=resolved.reasoning,
            )
        )
        return out

    def stats(self) -> OutputStats:
        """What the close log line reports of the run's text (``OutputStats``)."""
        resolved = self._resolved
        if resolved is not None:
            return OutputStats(
                normalized=resolved.normalized,
                content_len=len(resolved.content),
                reasoning_len=len(resolved.reasoning),
                content_preview=_preview(resolved.content),
                reasoning_preview=_preview(resolved.reasoning),
            )
        return OutputStats(
            normalized=False,
            content_len=self._content.length,
            reasoning_len=self._reasoning.length,
            content_preview=_preview(self._content.text()),
            reasoning_preview=_preview(self._reasoning.text()),
        )
