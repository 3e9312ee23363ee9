"""Tool calls that models print as text, and a stream filter that hides them.

When a backend has no tool-call parser (or the run uses the text-tool
fallback), the model's tool calls arrive as plain ``content``. This module
turns such text into ``ToolCall``s (``parse_tool_calls``) and, while the text
streams, holds back anything that may be tool-call syntax so the client never
sees it (``ToolTextFilter``, on the shared hold-back of ``_holdback``). It is a port of seed 001's
``streamToolTextFilter``/``unstreamedCleanedText`` plus a parser for the
formats vLLM's tool parsers recognise (docs/architecture.md, "Facts about the
backends: Streamed tool calls"). Sans-IO: stdlib,
msgspec and IOP's own types only.

Formats recognised by ``parse_tool_calls``, anywhere in the text, in order:

* Hermes/Qwen: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
  (``"parameters"`` accepted for ``"arguments"``; a JSON list of such objects
  in one block is several calls). Like vLLM's hermes regex
  ``<tool_call>(.*?)</tool_call>|<tool_call>(.*)``, the closer may be missing
  at the end of the text; it may also be missing before the next
  ``<tool_call>``. A missing *opener* is tolerated too: a bare call object
  directly followed by ``</tool_call>``.
* Mustache: ``{{tool_call}}{...}{{/tool_call}}``. Seed 001 references
  ``textMustacheToolCallOpenHint`` without defining it; we *assume* the opener
  is ``{{tool_call`` (case-sensitive, as the seed compares it without
  lowering) and the closer ``{{/tool_call}}``.
* Qwen3-Coder XML: ``<tool_call><function=fn><parameter=p>v</parameter>
  </function></tool_call>``, or ``<function=...>`` without the wrapper.
  ``</parameter>`` and ``</function>`` may be missing (vLLM's qwen3_coder
  regexes tolerate that too). One newline right after ``<parameter=..>`` and
  one right before its end are not part of the value (vLLM does the same).
* Bare JSON: an object with ``"name"`` and ``"arguments"``/``"parameters"``,
  or a non-empty list of such objects, as the whole text or inside prose.

Decisions (the tests pin each one):

* Tag matching is ASCII case-insensitive for the XML-like forms
  (``<TOOL_CALL>`` works, a non-ASCII look-alike does not), case-sensitive for
  the mustache form; the hold-back filter uses the same rules.
* With ``tools`` given (non-empty), a call whose name is not one of them is not
  a call: its whole block stays in ``content``. A block holding several calls
  (a JSON list, or several ``<function=>``) is taken all-or-nothing. With
  ``tools`` None or empty, any name is accepted.
* Anything malformed (bad JSON, no ``"name"``, junk between the JSON and its
  closer, junk inside a ``<function=>`` body) leaves the whole block as
  content. A bare JSON value that parses but is not a call is skipped whole,
  so calls nested inside ordinary JSON answers are never extracted.
* ``arguments``: an object (or any non-string JSON value) becomes compact JSON
  (``separators=(",", ":")``, ``ensure_ascii=False``); a string that is valid
  JSON is kept exactly as it is; any other string becomes the JSON string
  literal ``json.dumps(s)`` (so arguments are always valid JSON and nothing
  the model wrote is lost); missing, ``null`` or blank becomes ``"{}"``.
  ``NaN``/``Infinity`` are not JSON and are rejected as malformed.
* Qwen3-Coder parameter values are strings unless the tool's schema types the
  parameter (``type``, a list of types, or ``anyOf``/``oneOf`` branches) as
  non-string: then the value is decoded as JSON (``true``/``false`` case
  -insensitively for booleans), falling back to the string. A parameter that
  may be a string stays a string.
* ``content`` is the text with every recognised call span removed, pieces
  concatenated as they are, then stripped.
* Call ids are ``f"{id_prefix}{i}"`` with ``i`` the call's index: deterministic,
  so the same text always gives the same ids.
* The parser never raises: malformed input only means fewer calls. A JSON
  value nested deeper than Python's ``json`` can decode (~1000 levels) is
  skipped whole, bracket-balanced, without looking for calls inside it.
* The degenerate output of a model stuck in a loop (thousands of openers
  without closers, unbalanced deep nesting) does not cost quadratic time:
  closer searches are memoised and too-deep values are skipped whole.

Known limit of the filter: the bare-JSON and missing-opener forms have no
opener to watch, so they stream to the client as text (holding back every
``{`` would delay every JSON answer); ``parse_tool_calls`` still finds them at
the end, and ``unstreamed_cleaned_text`` then releases nothing it cannot place.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Sequence
from typing import Any, Final, NamedTuple

import msgspec

from iop.events import ToolCall
from iop.spec import Tool
from iop.wire._holdback import HoldBack, Tags

__all__ = [
    "TOOL_CALL_OPENERS",
    "ParsedToolText",
    "ToolTextFilter",
    "parse_tool_calls",
    "unstreamed_cleaned_text",
]

TOOL_CALL_OPENERS: Final[tuple[str, ...]] = ("<tool_call", "{{tool_call", "<function=")
"""What the hold-back filter watches for. ``<tool_call`` and ``<function=`` are
matched ASCII case-insensitively, ``{{tool_call`` exactly."""

_CASE_INSENSITIVE_OPENERS: Final = frozenset({"<tool_call", "<function="})
# The filter's hold-back: the one of ``iop.wire._holdback``, which ``<think>``
# stripping uses too.
_OPENER_TAGS: Final = Tags(
    folded=_CASE_INSENSITIVE_OPENERS,
    exact=[o for o in TOOL_CALL_OPENERS if o not in _CASE_INSENSITIVE_OPENERS],
)


# --- the streaming hold-back filter --------------------------------------------


class _FilterState(enum.Enum):
    SCANNING = enum.auto()
    """No opener seen yet: release all but a possible opener prefix."""
    HOLDING = enum.auto()
    """An opener was seen: hold everything until flush()."""


class ToolTextFilter:
    """Streaming hold-back filter (port of seed 001's streamToolTextFilter, improved).

    Feed it content deltas with ``append``; it returns the text that is safe
    to show now. Before any opener (``TOOL_CALL_OPENERS``) is seen it releases
    everything except a trailing part that could still become an opener
    (``"<"``, ``"<tool"``, ``"{{"``, ...). As in the seed, whitespace right
    before that held part, or at the end of the text so far, is held as well,
    so released text never ends with the whitespace that precedes a tool call.
    Once an opener is seen, it and everything after it is held until
    ``flush()``, which returns all held text and resets the filter.

    Improvement over the seed: the seed dropped the whitespace it trimmed in
    front of an opener; here nothing is ever dropped, so the concatenation of
    every ``append()`` result and the final ``flush()`` is always exactly the
    concatenation of the deltas. At any moment, the released text plus
    ``held`` is the input so far, and ``held`` with its leading whitespace
    removed is empty, a proper prefix of an opener, or starts with an opener.

    The filter keeps no limit of its own on held text: the caller keeps the
    whole content anyway, to parse the calls out of it at the end, and bounds
    that (the edge's ``OutputPolicy.max_tool_text_chars``: past it, it
    ``flush()``es and stops using the filter). Finding openers and holding a
    possible opener prefix is ``iop.wire.HoldBack``'s job (the mechanism
    ``<think>`` stripping shares); this class adds the whitespace rule and
    holding everything after an opener.
    """

    def __init__(self) -> None:
        self._state = _FilterState.SCANNING
        # SCANNING: held text is _space (whitespace only) then what the
        # hold-back keeps (a proper opener prefix, or ""). Kept apart so that a
        # long run of whitespace deltas costs linear, not quadratic, time.
        self._space: list[str] = []
        self._hold = HoldBack(_OPENER_TAGS)
        # HOLDING: everything from the whitespace before the opener on.
        self._held: list[str] = []

    @property
    def held(self) -> str:
        """The text held back so far."""
        if self._state is _FilterState.HOLDING:
            return "".join(self._held)
        return "".join(self._space) + self._hold.held

    @property
    def holding_call(self) -> bool:
        """True once an opener was seen (until the next flush)."""
        return self._state is _FilterState.HOLDING

    def append(self, delta: str) -> str:
        """Add a content delta; return the text safe to release now."""
        if self._state is _FilterState.HOLDING:
            if delta:
                self._held.append(delta)
            return ""
        # [text, opener, rest...]: only the text before the first opener is
        # released; openers hold no whitespace, so _space is never part of one.
        parts = self._hold.split(delta)
        text = parts[0]
        out = text.rstrip()
        released = ""
        if out:
            released = "".join(self._space) + out
            self._space = []
        if space := text[len(out) :]:
            self._space.append(space)
        if len(parts) > 1:
            self._state = _FilterState.HOLDING
            self._held = [*self._space, *parts[1:], self._hold.flush()]
            self._space = []
        return released

    def flush(self) -> str:
        """Return everything held back and reset the filter."""
        out = self.held
        self._state = _FilterState.SCANNING
        self._space, self._held = [], []
        self._hold.flush()
        return out


def unstreamed_cleaned_text(cleaned: str, emitted: str) -> str:
    """The part of ``cleaned`` the client has not been sent yet.

    Port of seed 001's ``unstreamedCleanedText``. ``cleaned`` is the content
    left once tool calls are parsed out of the whole text; ``emitted`` is what
    the stream already released. Branches, in the seed's order:

    1. ``cleaned`` empty: nothing.
    2. nothing emitted: all of ``cleaned``.
    3. ``emitted`` is a prefix of ``cleaned``: the rest of ``cleaned``.
    4. after trimming both: ``cleaned`` blank or equal to ``emitted``: nothing.
    5. trimmed ``emitted`` non-empty and a prefix of trimmed ``cleaned``: the
       rest, trimmed.
    6. otherwise (the stream diverged from ``cleaned``): nothing, rather than
       repeat or garble what the client already has.

    Deliberate deviation from the seed: where the seed reached branch 6 with
    a blank ``emitted`` (only whitespace was sent), it dropped all of
    ``cleaned``; here that returns trimmed ``cleaned``, since the client has
    seen none of it.
    """
    if cleaned == "":
        return ""
    if emitted == "":
        return cleaned
    if cleaned.startswith(emitted):
        return cleaned[len(emitted) :]
    cleaned = cleaned.strip()
    emitted = emitted.strip()
    if cleaned == "" or cleaned == emitted:
        return ""
    if emitted != "" and cleaned.startswith(emitted):
        return cleaned[len(emitted) :].strip()
    if emitted == "":
        return cleaned
    return ""


# --- the parser ----------------------------------------------------------------


class ParsedToolText(msgspec.Struct, frozen=True):
    """What ``parse_tool_calls`` found.

    Attributes:
        content: The text with the tool-call syntax removed, stripped of
            surrounding whitespace.
        calls: The calls, in text order, ``index`` 0..n-1.
    """

    content: str
    calls: tuple[ToolCall, ...]


# Every pattern is compiled with re.ASCII: case-insensitive matching and \s
# then mean ASCII only, exactly like the filter's hold-back. No pattern has anchors
# or look-behinds, so whether one matches at a position does not depend on where
# the search started: that is what makes _Searcher's memo sound.
_FLAGS: Final = re.ASCII
_CANDIDATE: Final = re.compile(
    r"(?P<hermes>(?i:<tool_call\s*>))"
    r"|(?P<function>(?i:<function=))"
    r"|(?P<mustache>\{\{tool_call\s*\}\})"
    r"|(?P<json>\{(?=\s*\")|\[(?=\s*\{))",
    _FLAGS,
)
_HERMES_OPEN: Final = re.compile(r"<tool_call\s*>", _FLAGS | re.IGNORECASE)
_HERMES_CLOSE: Final = re.compile(r"</tool_call\s*>", _FLAGS | re.IGNORECASE)
_MUSTACHE_OPEN: Final = re.compile(r"\{\{tool_call\s*\}\}", _FLAGS)
_MUSTACHE_CLOSE: Final = re.compile(r"\{\{/tool_call\s*\}\}", _FLAGS)
_ANY_CLOSE: Final = re.compile(r"(?i:</tool_call\s*>)|\{\{/tool_call\s*\}\}", _FLAGS)
_FUNCTION_OPEN: Final = re.compile(r"<function=", _FLAGS | re.IGNORECASE)
_FUNCTION_CLOSE: Final = re.compile(r"</function\s*>", _FLAGS | re.IGNORECASE)
_PARAMETER_OPEN: Final = re.compile(r"<parameter=([^>]*)>", _FLAGS | re.IGNORECASE)
_PARAMETER_CLOSE: Final = re.compile(r"</parameter\s*>", _FLAGS | re.IGNORECASE)
_GT: Final = re.compile(r">")
_BRACKET: Final = re.compile(r"[\[\]{}]")
_FUNCTION_NAME: Final = re.compile(r"[^\s<>]+")
_WHITESPACE: Final = re.compile(r"\s*", _FLAGS)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Python's json accepts NaN/Infinity; they are not JSON (RFC 8259), so reject.
_DECODER: Final = json.JSONDecoder(parse_constant=_reject_constant)


class _Call(NamedTuple):
    name: str
    arguments: str


class _TooDeep(Exception):
    """A JSON value nests deeper than Python's json can decode."""


def _decode_at(text: str, pos: int) -> tuple[Any, int] | None:
    """Decode one JSON value starting at ``pos``: (value, end), or None."""
    try:
        value, end = _DECODER.raw_decode(text, pos)
    except ValueError:
        return None
    except RecursionError as exc:
        raise _TooDeep from exc
    return value, end


def _is_json(s: str) -> bool:
    try:
        _DECODER.decode(s)
    except (ValueError, RecursionError):
        return False
    return True


def _dumps(value: Any) -> str | None:
    """Compact JSON text for ``value``, or None if it cannot be encoded."""
    try:
        out = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        # A "\ud800" escape decodes to a lone surrogate, which is not UTF-8
        # encodable; keep such text escaped.
        out.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (ValueError, RecursionError):
        return None
    return out


def _arguments_json(value: Any) -> str | None:
    """The JSON text for a call's arguments (see the module docstring)."""
    if value is None:
        return "{}"
    if isinstance(value, str):
        if not value.strip():
            return "{}"
        if _is_json(value):
            return value
        return _dumps(value)
    return _dumps(value)


def _schema_types(schema: Any) -> set[str]:
    """The JSON-schema types a (property) schema allows."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    out: set[str] = set()
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            for branch in branches:
                out |= _schema_types(branch)
    return out


def _convert_parameter(raw: str, schema: Any, parameter: str) -> Any:
    """A Qwen3-Coder parameter value, typed by the tool's schema when known."""
    value = raw
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    props = schema.get("properties") if isinstance(schema, dict) else None
    types = _schema_types(props.get(parameter)) if isinstance(props, dict) else set()
    if not types or "string" in types:
        return value
    stripped = value.strip()
    if "boolean" in types and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    try:
        return _DECODER.decode(stripped)
    except (ValueError, RecursionError):
        return value


class _Searcher:
    """``pattern.search`` over one text, memoised for forward scanning.

    The parser looks for the same closers again and again from positions that
    only move forward; without the memo, text full of openers and no closer
    (a model stuck in a loop) would cost quadratic time.
    """

    __slots__ = ("_from", "_hit", "_pattern", "_text")

    def __init__(self, pattern: re.Pattern[str], text: str) -> None:
        self._pattern = pattern
        self._text = text
        self._from = -1
        self._hit: re.Match[str] | None = None

    def search(self, pos: int, limit: int | None = None) -> re.Match[str] | None:
        """The first match starting at or after ``pos`` and ending by ``limit``."""
        hit = self._hit
        if not (0 <= self._from <= pos and (hit is None or hit.start() >= pos)):
            hit = self._hit = self._pattern.search(self._text, pos)
            self._from = pos
        if hit is not None and limit is not None and hit.end() > limit:
            # None of our patterns can match inside another match and end
            # earlier, so nothing else fits before ``limit`` either.
            return None
        return hit


class _Parser:
    """One parse of one text (see ``parse_tool_calls``)."""

    def __init__(self, text: str, tools: Sequence[Tool] | None) -> None:
        self.text = text
        if tools:
            self.names: frozenset[str] | None = frozenset(t.function.name for t in tools)
            self.schemas: dict[str, Any] = {t.function.name: t.function.parameters for t in tools}
        else:
            self.names, self.schemas = None, {}
        self._searchers: dict[re.Pattern[str], _Searcher] = {}

    def search(
        self, pattern: re.Pattern[str], pos: int, limit: int | None = None
    ) -> re.Match[str] | None:
        searcher = self._searchers.get(pattern)
        if searcher is None:
            searcher = self._searchers[pattern] = _Searcher(pattern, self.text)
        return searcher.search(pos, limit)

    def skip_ws(self, pos: int, limit: int | None = None) -> int:
        m = _WHITESPACE.match(self.text, pos, len(self.text) if limit is None else limit)
        return m.end() if m else pos

    def known(self, name: str) -> bool:
        return self.names is None or name in self.names

    def calls_from_json(self, value: Any, *, require_arguments: bool) -> list[_Call] | None:
        """The calls a decoded JSON value describes, or None if it is not calls."""
        items = value if isinstance(value, list) else [value]
        if not items:
            return None
        calls: list[_Call] = []
        for item in items:
            if not isinstance(item, dict):
                return None
            name = item.get("name")
            if not isinstance(name, str) or not name.strip() or not self.known(name):
                return None
            if "arguments" in item:
                raw = item["arguments"]
            elif "parameters" in item:
                raw = item["parameters"]
            elif require_arguments:
                return None
            else:
                raw = None
            arguments = _arguments_json(raw)
            if arguments is None:
                return None
            calls.append(_Call(name, arguments))
        return calls

    def function(self, pos: int, limit: int) -> tuple[_Call, int] | None:
        """Parse ``<function=name>...</function>`` at ``pos``: (call, end) or None."""
        text = self.text
        name_start = pos + len("<function=")
        gt = self.search(_GT, name_start, limit)
        if gt is None:
            return None
        name = text[name_start : gt.start()].strip()
        if not _FUNCTION_NAME.fullmatch(name) or not self.known(name):
            return None
        body_start = gt.end()
        close = self.search(_FUNCTION_CLOSE, body_start, limit)
        following = self.search(_FUNCTION_OPEN, body_start, limit)
        if close is not None and (following is None or close.start() < following.start()):
            body_end, end = close.start(), close.end()
        else:
            body_end = following.start() if following is not None else limit
            end = body_end
        schema = self.schemas.get(name)
        arguments: dict[str, Any] = {}
        p = body_start
        while (k := self.skip_ws(p, body_end)) < body_end:
            m = _PARAMETER_OPEN.match(text, k, body_end)
            if m is None:
                return None  # junk inside the function body
            parameter = m.group(1).strip()
            if not parameter:
                return None
            value_start = m.end()
            value_end = p = body_end
            pclose = self.search(_PARAMETER_CLOSE, value_start, body_end)
            if pclose is not None:
                value_end, p = pclose.start(), pclose.end()
            pnext = self.search(_PARAMETER_OPEN, value_start, body_end)
            if pnext is not None and pnext.start() < value_end:
                value_end = p = pnext.start()
            arguments[parameter] = _convert_parameter(
                text[value_start:value_end], schema, parameter
            )
        encoded = _dumps(arguments)
        if encoded is None:
            return None
        return _Call(name, encoded), end

    def functions(self, pos: int, limit: int) -> tuple[list[_Call], int] | None:
        """Parse consecutive ``<function=...>`` blocks from ``pos``."""
        calls: list[_Call] = []
        end = pos
        while True:
            k = self.skip_ws(end, limit)
            if k >= limit or _FUNCTION_OPEN.match(self.text, k, limit) is None:
                break
            parsed = self.function(k, limit)
            if parsed is None:
                return None
            call, end = parsed
            calls.append(call)
        return (calls, end) if calls else None

    def block(
        self, body_start: int, opener: re.Pattern[str], closer: re.Pattern[str]
    ) -> tuple[list[_Call] | None, int]:
        """Parse a wrapped block whose opener ends at ``body_start``.

        Returns (calls or None, where scanning resumes). On failure scanning
        resumes after the block's closer (or at the next opener, or the end),
        so the whole malformed block stays content.
        """
        text, n = self.text, len(self.text)
        close = self.search(closer, body_start)
        following = self.search(opener, body_start)
        if close is not None and (following is None or close.start() < following.start()):
            body_end, block_end = close.start(), close.end()
        else:
            body_end = following.start() if following is not None else n
            block_end = body_end
        start = self.skip_ws(body_start, body_end)
        if start >= body_end:
            return None, block_end
        calls: list[_Call] | None
        if _FUNCTION_OPEN.match(text, start, body_end):
            parsed = self.functions(start, body_end)
            if parsed is None:
                return None, block_end
            calls, end = parsed
        else:
            try:
                decoded = _decode_at(text, start)
            except _TooDeep:
                return None, block_end
            if decoded is None:
                return None, block_end
            value, end = decoded
            calls = self.calls_from_json(value, require_arguments=False)
            if calls is None:
                return None, max(block_end, end)
        # What follows the call decides where the block ends.
        k = self.skip_ws(end)
        if k >= n:
            return calls, n
        if (m := closer.match(text, k)) is not None:
            return calls, m.end()
        if opener.match(text, k) is not None:
            return calls, end
        close = self.search(closer, k)
        following = self.search(opener, k)
        if close is not None and (following is None or close.start() < following.start()):
            return None, close.end()  # junk between the call and its closer
        return calls, end  # unclosed block: what follows is prose

    def bare_json(self, start: int) -> tuple[list[_Call] | None, int]:
        """A bare JSON value at ``start``: (calls or None, where scanning resumes)."""
        try:
            decoded = _decode_at(self.text, start)
        except _TooDeep:
            # Skip the whole (bracket-balanced) structure: retrying at every
            # bracket inside it would cost quadratic time, and nothing that
            # deep is a call.
            depth = 0
            for m in _BRACKET.finditer(self.text, start):
                depth += 1 if m.group() in "[{" else -1
                if depth == 0:
                    return None, m.end()
            return None, len(self.text)
        if decoded is None:
            return None, start + 1
        # A JSON value that is not a call is skipped whole.
        return self.calls_from_json(decoded[0], require_arguments=True), decoded[1]

    def parse(self, id_prefix: str) -> ParsedToolText:
        text = self.text
        pieces: list[str] = []
        calls: list[_Call] = []
        kept_from = 0  # start of the text not yet copied into pieces
        pos = 0
        while (m := _CANDIDATE.search(text, pos)) is not None:
            start, kind = m.start(), m.lastgroup
            found: list[_Call] | None
            if kind == "hermes":
                found, end = self.block(m.end(), _HERMES_OPEN, _HERMES_CLOSE)
            elif kind == "mustache":
                found, end = self.block(m.end(), _MUSTACHE_OPEN, _MUSTACHE_CLOSE)
            elif kind == "function":
                # Unwrapped: the body may run to a stray </tool_call> (missing opener).
                stray = self.search(_HERMES_CLOSE, start)
                parsed = self.functions(start, stray.start() if stray is not None else len(text))
                found, end = (None, start + 1) if parsed is None else parsed
            else:
                found, end = self.bare_json(start)
            if found is not None:
                if kind in ("function", "json"):
                    # A missing opener: the bare call is followed by a closer.
                    close = _ANY_CLOSE.match(text, self.skip_ws(end))
                    if close is not None:
                        end = close.end()
                pieces.append(text[kept_from:start])
                calls.extend(found)
                kept_from = end
            pos = max(end, start + 1)
        pieces.append(text[kept_from:])
        return ParsedToolText(
            content="".join(pieces).strip(),
            calls=tuple(
                ToolCall(id=f"{id_prefix}{i}", name=c.name, arguments=c.arguments, index=i)
                for i, c in enumerate(calls)
            ),
        )


def parse_tool_calls(
    text: str, tools: Sequence[Tool] | None = None, *, id_prefix: str = "call_"
) -> ParsedToolText:
    """Find the tool calls a model printed as text.

    Args:
        text: The whole content of a message.
        tools: The request's tools. When given (non-empty), only calls to
            these names are recognised, and Qwen3-Coder parameter values are
            typed by their JSON schemas.
        id_prefix: Synthesised call ids are ``f"{id_prefix}{index}"``.

    Returns:
        The calls found, in text order, and the content with their syntax
        removed. Never raises: text that is not a well-formed call stays in
        ``content``. See the module docstring for the formats and decisions.
    """
    return _Parser(text, tools).parse(id_prefix)
