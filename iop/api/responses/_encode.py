"""The Responses surface's output, sans-IO: shaped events in, SSE or one body out.

Theory of operation
-------------------
A run's output arrives as shaped events (``iop.api._shaped``)::

    (ShapedText | ShapedReasoning)*  (ShapedDone | ShapedFailed)

:class:`ResponsesStream` formats them as OpenAI's Responses stream and
:class:`ResponsesCollector` as one ``Response`` object. Both also take the
run's ``RuntimeEvent`` s (the ``StreamEncoder`` / ``Collector`` interface of
``iop.api._surface``), shaping them first with ``iop.api.OutputShaper``.

The stream (every event is ``event: <type>`` + ``data: <json>``, each JSON
carrying ``sequence_number``, 0, 1, 2, ... in order)::

    response.created, response.in_progress                     (start())
    per run of reasoning text, one reasoning item:
        response.output_item.added {type: reasoning, id: rs_...}
        response.content_part.added {part: reasoning_text}
        response.reasoning_text.delta *
        response.reasoning_text.done, response.content_part.done,
        response.output_item.done {the whole item}
    per run of answer text, one message item:
        response.output_item.added {type: message, id: msg_...}
        response.content_part.added {part: output_text}
        response.output_text.delta *   (logprobs: [])
        response.output_text.done, response.content_part.done,
        response.output_item.done {the whole item}
    per tool call, once the run is done, one function_call item:
        response.output_item.added {type: function_call, id: fc_..., arguments: ""}
        response.function_call_arguments.delta (the whole arguments)
        response.function_call_arguments.done
        response.output_item.done {the whole item}
    or, for a call of a custom tool, one custom_tool_call item:
        response.output_item.added {type: custom_tool_call, id: ctc_..., input: ""}
        response.custom_tool_call_input.delta (the whole input)
        response.custom_tool_call_input.done
        response.output_item.done {the whole item}
    exactly one of
        response.completed    the run completed
        response.incomplete   finish reason length (incomplete_details.reason
                              max_output_tokens) or content_filter
        response.failed       the run failed or was cancelled after start():
                              response.error {code, message}

Reasoning is raw reasoning text, so it uses OpenAI's ``reasoning_text``
events and content, not the ``reasoning_summary_*`` ones (IOP writes no
summaries). Text and reasoning that alternate open a new item at each
switch, so every item's content is one part. An item still open when the
run ends is closed first (``status: incomplete`` unless the run completed),
so every ``output_item.added`` has its ``output_item.done``: Codex reads the
finished item from ``output_item.done`` alone. No ``error`` event is sent:
a failure after the headers is ``response.failed`` (its ``error.code`` is
``rate_limit_exceeded`` for a 429 and ``server_error`` otherwise, from the
codes OpenAI's schema allows; IOP's own code is in the message), and a
failure before them is an HTTP error from ``Surface.error_body``. The
stream ends after its terminal event; the Responses API has no ``[DONE]``.
``keepalive()`` is OpenAI's ``keepalive`` event (``{"type": "keepalive",
"sequence_number": N}``, which OpenAI sends on long streams but leaves out
of its schema; the SDKs pass it through) once the stream has started, an SSE
comment before: Codex ends a turn after ``stream_idle_timeout_ms`` without an
*event* (comments do not count), so a long queue wait or prefill needs real
events.

A call is turned back into the client's tool by ``ResponsesCall.tools``
(``_tools``): a namespaced function's call carries the client's name and
its ``namespace``, a custom tool's call its ``input`` unwrapped from the
model's JSON arguments. The stored conversation keeps the calls as the
model made them.

Ids: the response is the ``response_id`` given (the edge's surface gives a
random one: a stored response is looked up by it, ``_store``), else
``resp_<run id>``; items ``msg_<run id>_<n>``, ``rs_<run id>_<n>``,
``fc_<run id>_<n>`` and ``ctc_<run id>_<n>`` with ``n`` the output index.

A response that completed or is incomplete, with ``store`` not false, is
handed to ``keep`` (the surface's store) as its conversation: the history
it was asked with, then its output as one assistant message.

Per text delta the stream builds no dict: the event is pre-encoded bytes,
the sequence number and the JSON-encoded text.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Iterable
from typing import Any, Final, Literal

import msgspec

from iop.api._collect import ShapedCollector, openai_failure
from iop.api._openai_errors import scrub
from iop.api._output import OutputShaper
from iop.api._shaped import Shaped, ShapedDone, ShapedFailed, ShapedReasoning, ShapedText
from iop.api._surface import Call, RunContext
from iop.api.responses._tools import ToolEcho, ToolMap, custom_input, empty_map
from iop.errors import ErrorCode, InvariantError
from iop.events import FinishReason, RuntimeEvent, ToolCall, Usage
from iop.spec import FunctionCall, Message, MessageToolCall

__all__ = [
    "KEEPALIVE",
    "Keep",
    "ResponseEcho",
    "ResponsesCall",
    "ResponsesCollector",
    "ResponsesStream",
]

KEEPALIVE: Final[bytes] = b": keep-alive\n\n"
"""An SSE comment, the keep-alive before ``response.created``: clients ignore
it, proxies see traffic."""
_KEEPALIVE_EVENT: Final = b'event: keepalive\ndata: {"type":"keepalive","sequence_number":%d}\n\n'
"""OpenAI's ``keepalive`` event, the keep-alive once the stream started: an
event, so clients' idle timers (Codex's) see it too."""

Keep = Callable[[str, tuple[Message, ...]], None]
"""Stores a finished response's conversation under its id (``_store``)."""

_encode: Final = msgspec.json.encode


def _scrubbed(node: Any) -> Any:
    if isinstance(node, str):
        return scrub(node)
    if isinstance(node, list):
        return [_scrubbed(v) for v in node]
    if isinstance(node, dict):
        return {_scrubbed(k): _scrubbed(v) for k, v in node.items()}
    return node


def _json(obj: Any) -> bytes:
    """``obj`` as JSON; a lone surrogate anywhere (a backend's broken text) becomes ``?``."""
    try:
        return _encode(obj)
    except UnicodeEncodeError:
        return _encode(_scrubbed(msgspec.to_builtins(obj)))


def _clean_call(call: ToolCall) -> ToolCall:
    """``call`` with lone surrogates replaced: its fields are stored and resent."""
    return ToolCall(
        id=scrub(call.id), name=scrub(call.name), arguments=scrub(call.arguments), index=call.index
    )


# --- what the Response echoes of its request ------------------------------------------


class ReasoningEcho(msgspec.Struct, frozen=True):
    effort: str | None = None
    summary: str | None = None


class TextEcho(msgspec.Struct, frozen=True):
    format: dict[str, Any]


class ResponseEcho(msgspec.Struct, frozen=True, kw_only=True):
    """The request's settings as the Response object shows them."""

    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = {}
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningEcho = ReasoningEcho()
    store: bool = True
    temperature: float | None = None
    text: TextEcho = TextEcho({"type": "text"})
    tool_choice: Any = "auto"
    tools: list[ToolEcho] = []
    top_p: float | None = None
    truncation: str = "disabled"


class ResponsesCall(msgspec.Struct, frozen=True, kw_only=True):
    """``Call.native`` of a Responses call.

    Attributes:
        echo: What the Response shows of the request.
        history: The conversation without instructions (stored with the output).
        tenant: The tenant that asked: the response is stored as its own.
        tools: The client's custom and namespaced tools behind the functions
            the model may call (``_tools``).
    """

    echo: ResponseEcho
    history: tuple[Message, ...]
    tenant: str = ""
    tools: ToolMap = ToolMap()


# --- the Response object ----------------------------------------------------------------


class _OutputText(msgspec.Struct, frozen=True, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class _ReasoningText(msgspec.Struct, frozen=True, tag="reasoning_text", tag_field="type"):
    text: str


_Status = Literal["in_progress", "completed", "incomplete"]


class _MessageItem(msgspec.Struct, frozen=True, tag="message", tag_field="type"):
    id: str
    status: _Status
    role: str
    content: list[_OutputText]


class _ReasoningItem(msgspec.Struct, frozen=True, tag="reasoning", tag_field="type"):
    id: str
    status: _Status
    summary: list[Any]
    content: list[_ReasoningText]


class _FunctionCallItem(msgspec.Struct, frozen=True, tag="function_call", tag_field="type"):
    id: str
    status: _Status
    call_id: str
    name: str
    arguments: str
    # The client's namespace of a namespaced function (absent otherwise).
    namespace: str | msgspec.UnsetType = msgspec.UNSET


class _CustomToolCallItem(msgspec.Struct, frozen=True, tag="custom_tool_call", tag_field="type"):
    # OpenAI's CustomToolCall: no status field.
    id: str
    call_id: str
    name: str
    input: str
    namespace: str | msgspec.UnsetType = msgspec.UNSET


_Item = _MessageItem | _ReasoningItem | _FunctionCallItem | _CustomToolCallItem


def _call_item(call: ToolCall, tools: ToolMap, run_id: str, index: int) -> _Item:
    """The finished output item of the model's call (``_tools``): a function
    call under the client's name and namespace, or a custom tool's call with
    its input unwrapped. ``call`` is already cleaned (``_clean_call``)."""
    origin = tools.origin(call.name)
    if origin is None:
        return _FunctionCallItem(
            id=f"fc_{run_id}_{index}",
            status="completed",
            call_id=call.id,
            name=call.name,
            arguments=call.arguments,
        )
    namespace = msgspec.UNSET if origin.namespace is None else origin.namespace
    if origin.custom:
        return _CustomToolCallItem(
            id=f"ctc_{run_id}_{index}",
            call_id=call.id,
            name=origin.name,
            input=custom_input(call.arguments),
            namespace=namespace,
        )
    return _FunctionCallItem(
        id=f"fc_{run_id}_{index}",
        status="completed",
        call_id=call.id,
        name=origin.name,
        arguments=call.arguments,
        namespace=namespace,
    )


def _tool_map(call: Call) -> ToolMap:
    native = call.native
    return native.tools if isinstance(native, ResponsesCall) else empty_map()


class _InputDetails(msgspec.Struct, frozen=True):
    cached_tokens: int
    cache_write_tokens: int = 0


class _OutputDetails(msgspec.Struct, frozen=True):
    reasoning_tokens: int


class _Usage(msgspec.Struct, frozen=True):
    input_tokens: int
    input_tokens_details: _InputDetails
    output_tokens: int
    output_tokens_details: _OutputDetails
    total_tokens: int


def _usage(usage: Usage) -> _Usage:
    return _Usage(
        input_tokens=usage.input_tokens,
        input_tokens_details=_InputDetails(usage.cached_input_tokens),
        output_tokens=usage.output_tokens,
        output_tokens_details=_OutputDetails(usage.reasoning_tokens),
        total_tokens=usage.total_tokens,
    )


class _Error(msgspec.Struct, frozen=True):
    code: str
    message: str


class _Incomplete(msgspec.Struct, frozen=True):
    reason: str


class _Response(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "response"
    created_at: int
    status: str
    completed_at: int | None = None
    error: _Error | None = None
    incomplete_details: _Incomplete | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[_Item]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: ReasoningEcho
    store: bool
    temperature: float | None
    text: TextEcho
    tool_choice: Any
    tools: list[ToolEcho]
    top_p: float | None
    truncation: str
    # Absent until the run ends: OpenAI's schema has no null usage.
    usage: _Usage | msgspec.UnsetType = msgspec.UNSET
    metadata: dict[str, str]


def _template(call: Call, ctx: RunContext, response_id: str | None) -> _Response:
    native = call.native
    echo = native.echo if isinstance(native, ResponsesCall) else ResponseEcho()
    return _Response(
        id=f"resp_{ctx.run_id}" if response_id is None else response_id,
        created_at=int(ctx.created),
        status="in_progress",
        instructions=echo.instructions,
        max_output_tokens=echo.max_output_tokens,
        model=call.model,
        output=[],
        parallel_tool_calls=echo.parallel_tool_calls,
        previous_response_id=echo.previous_response_id,
        reasoning=echo.reasoning,
        store=echo.store,
        temperature=echo.temperature,
        text=echo.text,
        tool_choice=echo.tool_choice,
        tools=echo.tools,
        top_p=echo.top_p,
        truncation=echo.truncation,
        metadata=echo.metadata,
    )


_INCOMPLETE: Final[dict[FinishReason, str]] = {
    FinishReason.LENGTH: "max_output_tokens",
    FinishReason.CONTENT_FILTER: "content_filter",
}


def _failure(failed: ShapedFailed) -> _Error:
    """``Response.error`` for a failure: codes limited to OpenAI's ``ResponseErrorCode``."""
    code = ErrorCode.RATE_LIMIT_EXCEEDED if failed.status == 429 else ErrorCode.SERVER_ERROR
    return _Error(code=code, message=f"{failed.message} ({failed.code})")


def _conversation(
    history: tuple[Message, ...], output: list[_Item], tool_calls: Iterable[ToolCall]
) -> tuple[Message, ...]:
    """The stored conversation: the history, then the output as one assistant
    turn, its calls as the model made them (function names and arguments)."""
    text = "".join(p.text for i in output if isinstance(i, _MessageItem) for p in i.content)
    reasoning = "".join(p.text for i in output if isinstance(i, _ReasoningItem) for p in i.content)
    calls = [
        MessageToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in tool_calls
    ]
    turn = Message(
        role="assistant",
        content=text if text or not calls else None,
        tool_calls=calls or None,
        reasoning_content=reasoning or None,
    )
    return (*history, turn)


def _history(call: Call) -> tuple[Message, ...] | None:
    native = call.native
    return native.history if isinstance(native, ResponsesCall) else None


# --- stream events ---------------------------------------------------------------------------


class _Event(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    sequence_number: int


class _ResponseEvent(_Event, frozen=True, kw_only=True):
    response: _Response


class _ItemEvent(_Event, frozen=True, kw_only=True):
    output_index: int
    item: _Item


class _PartEvent(_Event, frozen=True, kw_only=True):
    item_id: str
    output_index: int
    content_index: int
    part: _OutputText | _ReasoningText


class _TextDoneEvent(_Event, frozen=True, kw_only=True):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = []


class _ReasoningDoneEvent(_Event, frozen=True, kw_only=True):
    item_id: str
    output_index: int
    content_index: int
    text: str


class _DeltaEvent(_Event, frozen=True, kw_only=True):
    """``response.function_call_arguments.delta`` and ``response.custom_tool_call_input.delta``."""

    item_id: str
    output_index: int
    delta: str


class _ArgumentsDoneEvent(_Event, frozen=True, kw_only=True):
    item_id: str
    output_index: int
    name: str
    arguments: str


class _InputDoneEvent(_Event, frozen=True, kw_only=True):
    item_id: str
    output_index: int
    input: str


class _State(enum.Enum):
    FRESH = enum.auto()
    """Nothing sent yet (keep-alives aside)."""
    STREAMING = enum.auto()
    """``response.created`` is out; items flow."""
    FINISHED = enum.auto()
    """The terminal event is out; nothing more may be sent."""


class _OpenItem:
    """The text or reasoning item being streamed."""

    __slots__ = ("delta_end", "delta_post", "delta_pre", "id", "index", "parts", "reasoning")

    def __init__(self, *, reasoning: bool, index: int, item_id: str) -> None:
        self.reasoning = reasoning
        self.index = index
        self.id = item_id
        self.parts: list[str] = []
        kind = b"response.reasoning_text.delta" if reasoning else b"response.output_text.delta"
        self.delta_pre = b"event: " + kind + b'\ndata: {"type":"' + kind + b'","sequence_number":'
        tail = b',"item_id":' + _encode(item_id) + b',"output_index":%d' % index
        self.delta_post = tail + b',"content_index":0,"delta":'
        # output_text deltas carry logprobs (required by OpenAI's schema), reasoning deltas not.
        self.delta_end = b"}\n\n" if reasoning else b',"logprobs":[]}\n\n'


class _Record:
    """What a stream and a collector share: the response's template, the
    conversation it continues, where a finished one is stored, and the clock
    of ``completed_at``."""

    __slots__ = ("_clock", "_history", "_keep", "_t0", "response")

    def __init__(
        self,
        call: Call,
        ctx: RunContext,
        keep: Keep | None,
        clock: Callable[[], float] | None,
        response_id: str | None,
    ) -> None:
        self.response = _template(call, ctx, response_id)
        self._history = _history(call)
        self._keep = keep if self.response.store else None
        self._clock = clock
        self._t0 = clock() if clock is not None else 0.0

    def completed_at(self) -> int:
        elapsed = self._clock() - self._t0 if self._clock is not None else 0.0
        return self.response.created_at + int(elapsed)

    def finish(self, done: ShapedDone, output: list[_Item], calls: list[ToolCall]) -> _Response:
        """The Response of a run that completed or is incomplete (``done``),
        stored when ``store`` and a store allow."""
        incomplete = _INCOMPLETE.get(done.finish_reason)
        response = msgspec.structs.replace(
            self.response,
            status="incomplete" if incomplete else "completed",
            completed_at=None if incomplete else self.completed_at(),
            incomplete_details=_Incomplete(incomplete) if incomplete else None,
            output=output,
            usage=_usage(done.usage),
        )
        if self._keep is not None and self._history is not None:
            self._keep(response.id, _conversation(self._history, output, calls))
        return response


class ResponsesStream:
    """One streaming response: events in, SSE bytes out (module docstring).

    Args:
        call: The parsed call (``call.native`` a :class:`ResponsesCall`).
        ctx: The run's id, creation time and output policy.
        keep: Stores the finished conversation (None: not stored).
        clock: Monotonic seconds, for ``completed_at``.
        response_id: The response's id (None: ``resp_<run id>``).
    """

    def __init__(
        self,
        call: Call,
        ctx: RunContext,
        *,
        keep: Keep | None = None,
        clock: Callable[[], float] | None = None,
        response_id: str | None = None,
    ) -> None:
        self._run_id = ctx.run_id
        self._record = _Record(call, ctx, keep, clock, response_id)
        self._response = self._record.response
        self._tools = _tool_map(call)
        self._shaper = OutputShaper(call.chat, ctx.policy, ctx.run_id)
        self._state = _State.FRESH
        self._seq = 0
        self._output: list[_Item] = []
        self._open: _OpenItem | None = None

    # -- state ------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """True once the terminal event was produced."""
        return self._state is _State.FINISHED

    @property
    def response_id(self) -> str:
        return self._response.id

    def _check_open(self, what: str) -> None:
        if self._state is _State.FINISHED:
            raise InvariantError(f"{what} after the stream finished")

    def _next(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _sse(self, event: _Event) -> bytes:
        return b"".join((b"event: ", event.type.encode(), b"\ndata: ", _json(event), b"\n\n"))

    def _item_event(self, kind: str, index: int, item: _Item) -> bytes:
        """``response.output_item.added`` or ``.done`` of the item at ``index``."""
        return self._sse(
            _ItemEvent(type=kind, sequence_number=self._next(), output_index=index, item=item)
        )

    # -- the API ------------------------------------------------------------------------

    def start(self) -> bytes:
        """``response.created`` and ``response.in_progress``; must come first, once.

        Raises:
            InvariantError: If the stream already started.
        """
        if self._state is not _State.FRESH:
            raise InvariantError("start() called twice")
        self._state = _State.STREAMING
        created = _ResponseEvent(
            type="response.created", sequence_number=self._next(), response=self._response
        )
        progress = _ResponseEvent(
            type="response.in_progress", sequence_number=self._next(), response=self._response
        )
        return self._sse(created) + self._sse(progress)

    def keepalive(self) -> bytes:
        """A ``keepalive`` event (queue, prefill, a buffered run); an SSE comment
        before ``start()``.

        Raises:
            InvariantError: If the stream finished.
        """
        self._check_open("keepalive()")
        if self._state is _State.FRESH:
            return KEEPALIVE
        return _KEEPALIVE_EVENT % self._next()

    def feed_many(self, events: Iterable[RuntimeEvent]) -> bytes:
        """The bytes of a run's events, shaped, joined (for one coalesced send)."""
        return self.feed_shaped([s for event in events for s in self._shaper.feed(event)])

    def feed_shaped(self, events: Iterable[Shaped]) -> bytes:
        """The bytes of shaped events, joined."""
        return b"".join([self.feed(event) for event in events])

    def fail(self, message: str, *, status: int = 500, code: str = ErrorCode.SERVER_ERROR) -> bytes:
        """End the stream as failed (e.g. a wait timeout at the HTTP layer).

        Raises:
            InvariantError: If the stream finished.
        """
        return self.feed(ShapedFailed(status=status, code=code, message=message))

    def feed(self, event: Shaped) -> bytes:
        """The bytes for one shaped event.

        Raises:
            InvariantError: If the stream finished.
        """
        if self._state is not _State.STREAMING:
            self._check_open(f"feed({type(event).__name__})")
            return self.start() + self.feed(event)
        if isinstance(event, ShapedText | ShapedReasoning):
            if not event.text:
                return b""
            reasoning = isinstance(event, ShapedReasoning)
            out = b""
            item = self._open
            if item is None or item.reasoning is not reasoning:
                out = self._close("completed") + self._open_item(reasoning=reasoning)
                item = self._open
                assert item is not None
            text = event.text
            try:
                literal = _encode(text)
            except UnicodeEncodeError:  # a lone surrogate: not UTF-8, not storable
                text = scrub(text)
                literal = _encode(text)
            item.parts.append(text)
            seq = b"%d" % self._next()
            return out + item.delta_pre + seq + item.delta_post + literal + item.delta_end
        if isinstance(event, ShapedDone):
            return self._done(event)
        return self._failed(event)

    # -- items --------------------------------------------------------------------------

    def _open_item(self, *, reasoning: bool) -> bytes:
        index = len(self._output)
        prefix = "rs" if reasoning else "msg"
        item_id = f"{prefix}_{self._run_id}_{index}"
        self._open = _OpenItem(reasoning=reasoning, index=index, item_id=item_id)
        added: _Item
        part: _OutputText | _ReasoningText
        if reasoning:
            added = _ReasoningItem(id=item_id, status="in_progress", summary=[], content=[])
            part = _ReasoningText("")
        else:
            added = _MessageItem(id=item_id, status="in_progress", role="assistant", content=[])
            part = _OutputText("")
        self._output.append(added)  # replaced by the finished item in _close
        return self._item_event("response.output_item.added", index, added) + self._sse(
            _PartEvent(
                type="response.content_part.added",
                sequence_number=self._next(),
                item_id=item_id,
                output_index=index,
                content_index=0,
                part=part,
            )
        )

    def _close(self, status: _Status) -> bytes:
        """Finish the open item, if any, with ``status``."""
        item = self._open
        if item is None:
            return b""
        self._open = None
        text = "".join(item.parts)
        done: _Event
        part: _OutputText | _ReasoningText
        finished: _Item
        if item.reasoning:
            done = _ReasoningDoneEvent(
                type="response.reasoning_text.done",
                sequence_number=self._next(),
                item_id=item.id,
                output_index=item.index,
                content_index=0,
                text=text,
            )
            part = _ReasoningText(text)
            finished = _ReasoningItem(id=item.id, status=status, summary=[], content=[part])
        else:
            done = _TextDoneEvent(
                type="response.output_text.done",
                sequence_number=self._next(),
                item_id=item.id,
                output_index=item.index,
                content_index=0,
                text=text,
            )
            part = _OutputText(text)
            finished = _MessageItem(id=item.id, status=status, role="assistant", content=[part])
        self._output[item.index] = finished
        part_done = _PartEvent(
            type="response.content_part.done",
            sequence_number=self._next(),
            item_id=item.id,
            output_index=item.index,
            content_index=0,
            part=part,
        )
        return (
            self._sse(done)
            + self._sse(part_done)
            + self._item_event("response.output_item.done", item.index, finished)
        )

    def _call(self, call: ToolCall) -> bytes:
        """A finished call's item: added empty, its payload (a function's
        arguments or a custom tool's input) as one delta and a done event,
        then the item done."""
        index = len(self._output)
        finished = _call_item(call, self._tools, self._run_id, index)
        self._output.append(finished)
        added: _Item
        payload_done: Callable[..., _Event]
        if isinstance(finished, _CustomToolCallItem):
            added = msgspec.structs.replace(finished, input="")
            kind, payload = "response.custom_tool_call_input", finished.input
            payload_done = functools.partial(_InputDoneEvent, input=payload)
        else:
            assert isinstance(finished, _FunctionCallItem)
            added = msgspec.structs.replace(finished, status="in_progress", arguments="")
            kind, payload = "response.function_call_arguments", finished.arguments
            payload_done = functools.partial(
                _ArgumentsDoneEvent, name=finished.name, arguments=payload
            )
        out = [self._item_event("response.output_item.added", index, added)]
        if payload:
            delta = _DeltaEvent(
                type=f"{kind}.delta",
                sequence_number=self._next(),
                item_id=finished.id,
                output_index=index,
                delta=payload,
            )
            out.append(self._sse(delta))
        done = payload_done(
            type=f"{kind}.done",
            sequence_number=self._next(),
            item_id=finished.id,
            output_index=index,
        )
        out.append(self._sse(done))
        out.append(self._item_event("response.output_item.done", index, finished))
        return b"".join(out)

    # -- terminals ----------------------------------------------------------------------

    def _done(self, done: ShapedDone) -> bytes:
        incomplete = _INCOMPLETE.get(done.finish_reason)
        out = [self._close("incomplete" if incomplete else "completed")]
        calls = [_clean_call(call) for call in done.calls]
        out += [self._call(call) for call in calls]
        self._state = _State.FINISHED
        response = self._record.finish(done, self._output, calls)
        kind = "response.incomplete" if incomplete else "response.completed"
        out.append(
            self._sse(_ResponseEvent(type=kind, sequence_number=self._next(), response=response))
        )
        return b"".join(out)

    def _failed(self, failed: ShapedFailed) -> bytes:
        out = self._close("incomplete")
        self._state = _State.FINISHED
        response = msgspec.structs.replace(
            self._response,
            status="failed",
            error=_failure(failed),
            output=self._output,
            usage=_usage(failed.usage),
        )
        return out + self._sse(
            _ResponseEvent(type="response.failed", sequence_number=self._next(), response=response)
        )


# --- non-streaming -------------------------------------------------------------------------


class ResponsesCollector(ShapedCollector):
    """One non-streaming response: events in, ``(status, body)`` out.

    ``result()`` is ``(200, Response)`` for a run that completed (status
    ``completed``, or ``incomplete`` with ``incomplete_details``), and
    ``(status, OpenAI error body)`` for one that failed or was cancelled. The
    ending is ``iop.api._collect``'s.

    Args:
        call, ctx, keep, clock, response_id: As for :class:`ResponsesStream`.
    """

    def __init__(
        self,
        call: Call,
        ctx: RunContext,
        *,
        keep: Keep | None = None,
        clock: Callable[[], float] | None = None,
        response_id: str | None = None,
    ) -> None:
        # Buffered: a collector wants the whole policy applied at the end
        # (XML completion wrapping), as chat's does.
        super().__init__(OutputShaper(call.chat, ctx.policy, ctx.run_id, buffered=True))
        self._run_id = ctx.run_id
        self._record = _Record(call, ctx, keep, clock, response_id)
        self._tools = _tool_map(call)

    def feed_shaped(self, event: Shaped) -> None:
        """Take one shaped event (text is taken from ``ShapedDone``).

        Raises:
            InvariantError: If a terminal event was already fed.
        """
        self._take(event)

    def _failure(self, failed: ShapedFailed) -> tuple[int, bytes]:
        return openai_failure(failed)

    def _body(self, done: ShapedDone) -> bytes:
        incomplete = _INCOMPLETE.get(done.finish_reason)
        status: _Status = "incomplete" if incomplete else "completed"
        output: list[_Item] = []
        if done.reasoning:
            item_id = f"rs_{self._run_id}_{len(output)}"
            content = [_ReasoningText(scrub(done.reasoning))]
            output.append(_ReasoningItem(id=item_id, status=status, summary=[], content=content))
        if done.content:
            item_id = f"msg_{self._run_id}_{len(output)}"
            text = [_OutputText(scrub(done.content))]
            output.append(_MessageItem(id=item_id, status=status, role="assistant", content=text))
        calls = [_clean_call(call) for call in done.calls]
        for call in calls:
            output.append(_call_item(call, self._tools, self._run_id, len(output)))
        response = self._record.finish(done, output, calls)
        return _json(response)
