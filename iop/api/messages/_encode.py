"""Anthropic Messages output, sans-IO: shaped events in, SSE events or one Message out.

Theory of operation
-------------------
A run's ``RuntimeEvent`` s go through the shaper (``iop.api.OutputShaper``,
the output policy) and come out as shaped events (``iop.api._shaped``);
:class:`MessagesStream` formats those as Anthropic's SSE stream and
:class:`MessagesCollector` as one ``Message`` body. ``feed_many`` takes
runtime events (the ``StreamEncoder`` contract); ``feed_shaped`` takes shaped
ones (what tests and the shaper drive).

Every SSE event carries an ``event:`` line naming its type: the SDKs
dispatch on it and skip events without one (Claude Code needs it). A
completed stream is::

    message_start
    ( content_block_start  content_block_delta*  content_block_stop )*
    message_delta  message_stop

with ``ping`` anywhere after ``message_start`` as the keep-alive. Blocks
have increasing ``index`` from 0, one open at a time: text goes to a ``text``
block (``text_delta``), reasoning to a ``thinking`` block
(``thinking_delta``); a change of kind closes the open block and starts the
next. At the end the tool calls follow as ``tool_use`` blocks, their
arguments in one ``input_json_delta``; then ``message_delta`` with the stop
reason and usage, and ``message_stop``. An answer with neither text nor a
tool call gets one empty text block, as its non-streaming ``Message`` does
(whose ``content`` is never empty).

A run that fails after the stream began ends with its open block stopped and
one ``error`` event in Anthropic's shape (``_errors``: 529
``overloaded_error`` for a lost node...), no ``message_stop``; the SDK raises
it as an ``APIStatusError``. So a stream ends with exactly one of
``message_stop`` or ``error``. States::

    FRESH --start()/feed--> STREAMING --ShapedDone/ShapedFailed--> FINISHED

Wire decisions (``docs/api.md``, "Anthropic Messages"):

* ``id`` is ``msg_<run id>``; errors carry ``request_id`` ``req_<run id>``.
* ``usage.input_tokens`` is 0 in ``message_start`` (a backend reports usage
  only at the end) and the real count in ``message_delta``, which the SDKs
  take as the total. Anthropic counts cache reads apart from
  ``input_tokens``: IOP's cached prompt tokens are
  ``cache_read_input_tokens`` and ``input_tokens`` is the rest.
* ``stop_reason``: ``stop`` -> ``end_turn``, ``length`` -> ``max_tokens``,
  ``tool_calls`` -> ``tool_use``, ``content_filter`` -> ``refusal``.
  ``stop_sequence`` is never reported: backends do not say which stop
  sequence matched (a stop is an ``end_turn``).
* Thinking blocks carry ``"signature": ""``: the SDK's ``ThinkingBlock``
  requires the field, and no backend signs its reasoning. A request with
  ``thinking: {"type": "disabled"}`` gets no thinking blocks.
* A tool call's ``arguments`` that are not a JSON object (a model's broken
  JSON) become ``{}``: Anthropic's ``input`` is an object, and the SDK's
  accumulator raises on JSON it cannot parse.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, Final, assert_never

import msgspec

from iop.api._collect import ShapedCollector
from iop.api._output import OutputShaper
from iop.api._shaped import Shaped, ShapedDone, ShapedFailed, ShapedReasoning, ShapedText
from iop.api.messages._errors import anthropic_error, error_body, error_event
from iop.api.messages._request import MessagesRequest, ThinkingDisabled
from iop.config import OutputPolicy
from iop.errors import InvariantError
from iop.events import FinishReason, RuntimeEvent, ToolCall, Usage
from iop.spec import ChatRequest

__all__ = ["PING", "MessagesCollector", "MessagesStream", "stop_reason"]

PING: Final[bytes] = b'event: ping\ndata: {"type":"ping"}\n\n'
"""Anthropic's own keep-alive event (the SDKs skip it)."""

_STOP_REASONS: Final[dict[FinishReason, str]] = {
    FinishReason.STOP: "end_turn",
    FinishReason.LENGTH: "max_tokens",
    FinishReason.TOOL_CALLS: "tool_use",
    FinishReason.FUNCTION_CALL: "tool_use",
    FinishReason.CONTENT_FILTER: "refusal",
}

_encode: Final = msgspec.json.encode
_decode_input: Final = msgspec.json.Decoder(dict[str, Any])


def stop_reason(finish: FinishReason) -> str:
    """Anthropic's ``stop_reason`` for a run's finish reason (module docstring)."""
    return _STOP_REASONS[finish]


def _text(text: str) -> bytes:
    """``text`` as JSON; lone surrogates (a backend's broken UTF-16) become ``?``."""
    try:
        return _encode(text)
    except UnicodeEncodeError:
        return _encode(_scrub(text))


def _scrub(text: str) -> str:
    """``text`` with lone surrogates (which UTF-8 cannot encode) replaced by ``?``."""
    return text.encode("utf-8", "replace").decode("utf-8")


def _input(arguments: str) -> tuple[str, dict[str, Any]]:
    """A call's ``arguments`` as Anthropic's ``input``: the JSON text and the object."""
    try:
        value = _decode_input.decode(arguments)
    except (msgspec.DecodeError, UnicodeEncodeError):
        return "{}", {}
    return arguments, value


class _Usage(msgspec.Struct, frozen=True):
    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int


def _usage(usage: Usage) -> _Usage:
    cached = min(usage.cached_input_tokens, usage.input_tokens)
    return _Usage(usage.input_tokens - cached, 0, cached, usage.output_tokens)


class _TextOut(msgspec.Struct, frozen=True, tag="text", tag_field="type"):
    text: str


class _ThinkingOut(msgspec.Struct, frozen=True, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""


class _ToolUseOut(msgspec.Struct, frozen=True, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


_Block = _TextOut | _ThinkingOut | _ToolUseOut


class _Message(msgspec.Struct, frozen=True, kw_only=True):
    # Anthropic's field order.
    id: str
    type: str = "message"
    role: str = "assistant"
    model: str
    content: list[_Block]
    stop_reason: str | None
    stop_sequence: None = None
    usage: _Usage


def _event(name: bytes, data: bytes) -> bytes:
    return b"event: " + name + b"\ndata: " + data + b"\n\n"


class _State(enum.Enum):
    FRESH = "fresh"
    STREAMING = "streaming"
    FINISHED = "finished"


class _Kind(enum.Enum):
    TEXT = "text"
    THINKING = "thinking"


class MessagesStream:
    """One streaming Messages response: events in, SSE bytes out (module docstring).

    Args:
        run_id: The run's id (``msg_<run id>``).
        model: The model name shown to the client.
        request: The run's ``ChatRequest`` (for the shaper).
        native: Anthropic's typed request (``thinking``).
        policy: The model's output policy.
    """

    def __init__(
        self,
        run_id: str,
        model: str,
        request: ChatRequest,
        native: MessagesRequest,
        policy: OutputPolicy,
    ) -> None:
        self._run_id = run_id
        self._model = model
        self._shaper = OutputShaper(request, policy, run_id, keep_text=False)
        self._thinking = not isinstance(native.thinking, ThinkingDisabled)
        self._state = _State.FRESH
        self._index = -1  # of the last block started
        self._open: _Kind | None = None
        self._had_text = False
        self._delta_pre = b""  # the open block's delta framing (``_into``)
        self.outcome = "open"
        """``open``, ``complete`` or ``failed``: for the close log line."""

    @property
    def finished(self) -> bool:
        """True once ``message_stop`` or ``error`` was returned."""
        return self._state is _State.FINISHED

    def _check_open(self, what: str) -> None:
        if self._state is _State.FINISHED:
            raise InvariantError(f"{what} after the stream finished")

    # -- events ------------------------------------------------------------------------

    def start(self) -> bytes:
        """``message_start``; must come first, and only once.

        Raises:
            InvariantError: If the stream already started.
        """
        if self._state is not _State.FRESH:
            raise InvariantError("start() called twice")
        self._state = _State.STREAMING
        message = _Message(
            id=f"msg_{self._run_id}",
            model=self._model,
            content=[],
            stop_reason=None,
            usage=_usage(Usage()),
        )
        return _event(
            b"message_start", b'{"type":"message_start","message":' + _encode(message) + b"}"
        )

    def keepalive(self) -> bytes:
        """A ``ping`` event.

        Raises:
            InvariantError: If the stream finished.
        """
        self._check_open("keepalive()")
        return PING

    def _begin(self, block: bytes) -> bytes:
        self._index += 1
        return _event(
            b"content_block_start",
            b'{"type":"content_block_start","index":%d,"content_block":%s}' % (self._index, block),
        )

    def _delta(self, delta: bytes) -> bytes:
        return _event(
            b"content_block_delta",
            b'{"type":"content_block_delta","index":%d,"delta":%s}' % (self._index, delta),
        )

    def _stop(self) -> bytes:
        return _event(
            b"content_block_stop", b'{"type":"content_block_stop","index":%d}' % self._index
        )

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return self._stop()

    def _into(self, kind: _Kind) -> bytes:
        """Bytes that leave the open block, if another kind, and open one of ``kind``.

        The delta's framing up to the text is built here, once per block, so
        a text delta costs one JSON string encode and a join.
        """
        if self._open is kind:
            return b""
        out = self._close()
        self._open = kind
        if kind is _Kind.TEXT:
            self._had_text = True
            out += self._begin(b'{"type":"text","text":""}')
            field = b'{"type":"text_delta","text":'
        else:
            out += self._begin(_THINKING_START)
            field = b'{"type":"thinking_delta","thinking":'
        self._delta_pre = (
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,'
            b'"delta":%s' % (self._index, field)
        )
        return out

    def _tool_use(self, call: ToolCall) -> bytes:
        partial, _ = _input(call.arguments)
        head = b'{"type":"tool_use","id":%s,"name":%s,"input":{}}' % (
            _text(call.id),
            _text(call.name),
        )
        out = self._begin(head)
        out += self._delta(b'{"type":"input_json_delta","partial_json":' + _text(partial) + b"}")
        return out + self._stop()

    def _done(self, done: ShapedDone) -> bytes:
        out = self._close()
        if not self._had_text and not done.calls:  # as the collector: content is never empty
            out += self._begin(b'{"type":"text","text":""}') + self._stop()
        for call in done.calls:
            out += self._tool_use(call)
        delta = b'{"type":"message_delta","delta":{"stop_reason":%s,"stop_sequence":null},' % (
            _encode(stop_reason(done.finish_reason))
        )
        out += _event(b"message_delta", delta + b'"usage":' + _encode(_usage(done.usage)) + b"}")
        out += _event(b"message_stop", b'{"type":"message_stop"}')
        self._state = _State.FINISHED
        self.outcome = "complete"
        return out

    def _failed(self, failed: ShapedFailed) -> bytes:
        out = self._close()
        _, etype = anthropic_error(failed.status, failed.code)
        self._state = _State.FINISHED
        self.outcome = "failed"
        return out + error_event(etype, failed.message, request_id=f"req_{self._run_id}")

    def feed_shaped(self, events: Iterable[Shaped]) -> bytes:
        """The bytes of shaped events, joined.

        Raises:
            InvariantError: If an event comes after the stream finished.
        """
        out: list[bytes] = []
        for event in events:
            if self._state is not _State.STREAMING:
                self._check_open(f"feed({type(event).__name__})")
                out.append(self.start())
            if isinstance(event, ShapedText):
                if not event.text:
                    continue
                if self._open is not _Kind.TEXT:  # the hot path is one join
                    out.append(self._into(_Kind.TEXT))
                out.append(self._delta_pre + _text(event.text) + b"}}\n\n")
            elif isinstance(event, ShapedReasoning):
                if event.text and self._thinking:
                    out.append(self._into(_Kind.THINKING))
                    out.append(self._delta_pre + _text(event.text) + b"}}\n\n")
            elif isinstance(event, ShapedDone):
                out.append(self._done(event))
            elif isinstance(event, ShapedFailed):
                out.append(self._failed(event))
            else:
                assert_never(event)
        return b"".join(out)

    def feed_many(self, events: Iterable[RuntimeEvent]) -> bytes:
        """The bytes of runtime events, through the shaper."""
        return self.feed_shaped(s for event in events for s in self._shaper.feed(event))

    def fail(self, status: int, message: str, *, code: str | None = None) -> bytes:
        """End the stream with an error (e.g. a wait timeout at the HTTP layer)."""
        return self.feed_shaped([ShapedFailed(status=status, code=code or "", message=message)])


_THINKING_START: Final = b'{"type":"thinking","thinking":"","signature":""}'


class MessagesCollector(ShapedCollector):
    """One non-streaming Messages response: events in, ``(status, body)`` out.

    Same arguments as :class:`MessagesStream`. ``result()`` is ``(200,
    Message)`` for a completed run, or Anthropic's status and error body
    (``_errors.anthropic_error``) for a failed or cancelled one. The ending is
    ``iop.api._collect``'s.
    """

    def __init__(
        self,
        run_id: str,
        model: str,
        request: ChatRequest,
        native: MessagesRequest,
        policy: OutputPolicy,
    ) -> None:
        super().__init__(OutputShaper(request, policy, run_id, buffered=True))
        self._run_id = run_id
        self._model = model
        self._thinking = not isinstance(native.thinking, ThinkingDisabled)

    def feed_shaped(self, events: Iterable[Shaped]) -> None:
        """Take shaped events; only the terminal one matters (it holds the whole answer).

        Raises:
            InvariantError: If an event comes after the terminal one.
        """
        for event in events:
            self._take(event)

    def _body(self, done: ShapedDone) -> bytes:
        content: list[_Block] = []
        if done.reasoning and self._thinking:
            content.append(_ThinkingOut(_scrub(done.reasoning)))
        if done.content or not done.calls:
            content.append(_TextOut(_scrub(done.content)))
        content.extend(
            _ToolUseOut(_scrub(c.id), _scrub(c.name), _input(c.arguments)[1]) for c in done.calls
        )
        message = _Message(
            id=f"msg_{self._run_id}",
            model=self._model,
            content=content,
            stop_reason=stop_reason(done.finish_reason),
            usage=_usage(done.usage),
        )
        return _encode(message)

    def _failure(self, failed: ShapedFailed) -> tuple[int, bytes]:
        status, etype = anthropic_error(failed.status, failed.code)
        return status, error_body(etype, failed.message, request_id=f"req_{self._run_id}")
