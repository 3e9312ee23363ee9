"""``POST /v1/responses`` bodies to a ``ChatRequest``, with OpenAI's 400s (sans-IO).

A Responses request (OpenAI's ``CreateResponse``) is decoded into typed
structs and translated into the ``iop.spec.ChatRequest`` a run executes, so
the Responses surface rides the same run machinery as chat. docs/api.md
("OpenAI Responses") is the user-facing table of this module; in short:

* ``input``: a string is one user message. A list holds items, each
  translated in order:

  - ``message`` (``type`` may be omitted): roles ``user``, ``system``,
    ``developer``, ``assistant``. ``input_text`` / ``output_text`` parts
    become text, ``input_image`` an ``image_url`` part, ``input_file`` a
    ``file`` part. ``system`` and ``developer`` messages become ``system``
    messages (the chat templates of open models know no ``developer``
    role); their text parts are joined. An assistant message's text parts
    (and refusals) are joined into its content.
  - ``function_call`` and ``custom_tool_call`` items become ``tool_calls``
    of an assistant message, as the model made them (``_tools``): a
    namespaced call (``namespace`` set) under its flattened function name,
    a custom tool's ``input`` as the JSON arguments ``{"input": ...}``;
    consecutive calls, and calls right after an assistant message, share
    that one message (chat templates expect the calls of one turn together).
  - ``function_call_output`` and ``custom_tool_call_output`` items become
    ``tool`` messages.
  - ``reasoning`` items passed back become the ``reasoning_content`` of the
    assistant turn that follows them (their ``reasoning_text`` content, else
    their summary); encrypted-only reasoning, or reasoning no assistant turn
    follows, is dropped: IOP never produces encrypted content.
  - items of the tools IOP cannot run (``web_search_call``,
    ``local_shell_call``, ``mcp_call``, ... every other item type OpenAI
    defines) are dropped: their tools are never offered to the model
    (below), so only a conversation begun elsewhere carries them.
  - ``item_reference`` is a 400 (IOP keeps no item index).

* ``instructions`` is a ``system`` message put first. With
  ``previous_response_id`` the stored conversation (that response's input
  and output, with its own history, but never its instructions, as OpenAI
  specifies) goes before the new input. Leading ``system`` messages are then
  merged into one, since many chat templates accept a single system message
  only at the start.
* ``tools``: ``function`` tools become chat tools (the flat Responses shape
  ``{type, name, parameters, strict, description}`` nested under
  ``function``); ``custom`` tools become functions of one string argument
  and each tool of a ``namespace`` a function named ``<namespace>__<name>``
  (``_tools``: how, and how the calls come back). Every other tool type
  (``web_search``, ``local_shell``, ``file_search``, ``mcp``, ...) is
  dropped, never a 400: clients such as Codex send them beside their
  functions.
* ``tool_choice``: ``auto``, ``none``, ``required``, ``{"type": "function",
  "name"}``, ``{"type": "custom", "name"}`` map onto chat's;
  ``allowed_tools`` keeps only the listed function and custom tools and
  uses its ``mode``. A choice that forces a dropped tool
  (``{"type": "web_search_preview"}``, ``{"type": "mcp", ...}``, ...) is a
  400: IOP cannot honour it, and answering without it would be wrong. With
  no tool left, ``auto``/``none`` are dropped.
* ``max_output_tokens`` -> ``max_completion_tokens`` (at least 16, as
  OpenAI's schema says); ``temperature`` (0-2), ``top_p`` (0-1),
  ``parallel_tool_calls`` as they are; ``reasoning.effort`` ->
  ``reasoning_effort``; ``text.format`` -> ``response_format``;
  ``prompt_cache_key`` (else ``user``, else ``safety_identifier``) ->
  ``user``, the affinity key.
* Accepted and not acted on (echoed where the Response has the field):
  ``metadata``, ``store`` (used by the surface's store), ``include``,
  ``client_metadata``, ``truncation``, ``service_tier``, ``stream_options``,
  ``top_logprobs``, ``max_tool_calls``, ``prompt_cache_retention``,
  ``prompt_cache_options``, ``context_management``, ``moderation``,
  ``reasoning.summary``, ``text.verbosity``, ``background: false``.
* A 400: ``background: true``, ``conversation``, ``prompt`` (IOP has no
  background runs, Conversations or stored prompts).
* Keys that are not Responses parameters at all go to the backend in
  ``extra_body``, as on the chat surface (vLLM's ``top_k``, ...).

Errors read like OpenAI's (``Invalid type for 'input[0].content': ...``,
``param="input[0].content"``).
"""

from __future__ import annotations

from typing import Any, Final, Literal, TypeVar

import msgspec

from iop.api._json_guard import DEFAULT_MAX_JSON_DEPTH, guarded_decode
from iop.api._openai_validation import from_validation, missing_parameter
from iop.api.responses._tools import (
    CustomToolEcho,
    FunctionToolEcho,
    NamespaceToolEcho,
    ToolEcho,
    ToolMap,
    ToolOrigin,
    custom_arguments,
    custom_function,
    empty_map,
    flat_name,
    tool_key,
)
from iop.errors import ErrorCode, RequestError
from iop.spec import (
    ChatRequest,
    ContentPart,
    FilePart,
    FileRef,
    FunctionCall,
    FunctionDef,
    ImagePart,
    ImageURL,
    Message,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
    TextPart,
    Tool,
    ToolChoice,
)

__all__ = [
    "MAX_OUTPUT_TOKENS_MIN",
    "OfferedTools",
    "ResponsesRequest",
    "decode_request",
    "translate",
]

MAX_OUTPUT_TOKENS_MIN: Final = 16
"""OpenAI's schema: ``max_output_tokens`` has ``minimum: 16``."""

_METADATA_MAX_KEYS: Final = 16
_METADATA_KEY_MAX: Final = 64
_METADATA_VALUE_MAX: Final = 512
"""OpenAI's ``metadata`` limits: 16 pairs, keys up to 64 and values up to 512 characters."""

_EFFORTS: Final = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_ROLES: Final = ("user", "assistant", "system", "developer")
_TOOL_CHOICES: Final = ("none", "auto", "required")

# Item types OpenAI defines whose tools IOP cannot run: dropped from input.
_DROPPED_ITEMS: Final = frozenset(
    {
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "web_search_call",
        "tool_search_call",
        "tool_search_output",
        "additional_tools",
        "compaction",
        "compaction_summary",
        "compaction_trigger",
        "image_generation_call",
        "code_interpreter_call",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "mcp_call",
        "program",
        "program_output",
    }
)
_ITEM_TYPES: Final = (
    "message",
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "reasoning",
)


# --- the request, typed ----------------------------------------------------------------


class _Struct(msgspec.Struct, frozen=True, kw_only=True):
    pass


_S = TypeVar("_S", bound=_Struct)


class InputText(_Struct, frozen=True, tag="input_text", tag_field="type"):
    text: str


class OutputText(_Struct, frozen=True, tag="output_text", tag_field="type"):
    text: str


class InputImage(_Struct, frozen=True, tag="input_image", tag_field="type"):
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class InputFile(_Struct, frozen=True, tag="input_file", tag_field="type"):
    file_data: str | None = None
    file_id: str | None = None
    filename: str | None = None
    file_url: str | None = None


class Refusal(_Struct, frozen=True, tag="refusal", tag_field="type"):
    refusal: str


Part = InputText | OutputText | InputImage | InputFile | Refusal


class MessageItem(_Struct, frozen=True, tag="message", tag_field="type"):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(_Struct, frozen=True, tag="function_call", tag_field="type"):
    call_id: str
    name: str
    arguments: str = ""
    namespace: str | None = None


class FunctionCallOutputItem(_Struct, frozen=True, tag="function_call_output", tag_field="type"):
    call_id: str
    output: str | list[Part]


class CustomToolCallItem(_Struct, frozen=True, tag="custom_tool_call", tag_field="type"):
    call_id: str
    name: str
    input: str
    namespace: str | None = None


class CustomToolCallOutputItem(
    _Struct, frozen=True, tag="custom_tool_call_output", tag_field="type"
):
    call_id: str
    output: str | list[Part]


class _ReasoningPart(_Struct, frozen=True):
    text: str = ""


class ReasoningItem(_Struct, frozen=True, tag="reasoning", tag_field="type"):
    summary: list[_ReasoningPart] = []
    content: list[_ReasoningPart] | None = None


Item = (
    MessageItem
    | FunctionCallItem
    | FunctionCallOutputItem
    | CustomToolCallItem
    | CustomToolCallOutputItem
    | ReasoningItem
)


class _Reasoning(_Struct, frozen=True):
    effort: str | None = None
    summary: str | None = None


class _Text(_Struct, frozen=True):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(_Struct, frozen=True):
    """The fields of ``CreateResponse`` IOP reads (module docstring)."""

    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    reasoning: _Reasoning | None = None
    text: _Text | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    # Accepted, not acted on (module docstring).
    include: list[str] | None = None
    client_metadata: Any = None
    service_tier: str | None = None
    stream_options: Any = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    context_management: Any = None
    moderation: Any = None
    # Refused with a 400.
    conversation: Any = None
    prompt: Any = None


_TYPED: Final = msgspec.json.Decoder(ResponsesRequest)
_KNOWN: Final = frozenset(ResponsesRequest.__struct_fields__)


# --- OpenAI's wording for msgspec's validation errors --------------------------------


def _json_type(value: object) -> str:
    """OpenAI's name for the JSON type of a decoded value ("an array", "null", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _quote(items: tuple[str, ...]) -> str:
    return ", ".join(f"'{i}'" for i in items)


def _hint(param: str | None) -> str:
    """What the Responses enums accept, after OpenAI's ``Invalid value: X.``."""
    last = (param or "").rsplit(".", 1)[-1]
    if last == "role":
        return f" Supported values are: {_quote(_ROLES)}."
    if last == "truncation":
        return " Supported values are: 'auto', 'disabled'."
    return ""


def _from_validation(exc: msgspec.ValidationError, prefix: str = "") -> RequestError:
    """A RequestError worded like OpenAI's for one of msgspec's messages.

    ``prefix`` is the path of the converted value (``input[2]``), put before
    msgspec's own path.
    """
    return from_validation(exc, prefix=prefix, hint=_hint)


# --- checks --------------------------------------------------------------------------

_BELOW_MIN: Final = {
    "integer": ErrorCode.INTEGER_BELOW_MIN_VALUE,
    "decimal": ErrorCode.DECIMAL_BELOW_MIN_VALUE,
}
_ABOVE_MAX: Final = {
    "integer": ErrorCode.INTEGER_ABOVE_MAX_VALUE,
    "decimal": ErrorCode.DECIMAL_ABOVE_MAX_VALUE,
}


def _range(param: str, value: float | None, low: float, high: float | None) -> None:
    """OpenAI's range errors (``decimal_above_max_value``, ``integer_below_min_value``)."""
    if value is None:
        return
    kind = "integer" if isinstance(value, int) else "decimal"
    if value < low:
        raise RequestError(
            f"Invalid '{param}': {kind} below minimum value. Expected a value >= {low:g}, "
            f"but got {value} instead.",
            param=param,
            code=_BELOW_MIN[kind],
        )
    if high is not None and value > high:
        raise RequestError(
            f"Invalid '{param}': {kind} above maximum value. Expected a value <= {high:g}, "
            f"but got {value} instead.",
            param=param,
            code=_ABOVE_MAX[kind],
        )


def _unsupported(param: str, what: str) -> RequestError:
    return RequestError(
        f"'{param}' is not supported by this server: {what}.",
        param=param,
        code=ErrorCode.UNSUPPORTED_PARAMETER,
    )


def _check(req: ResponsesRequest) -> None:
    """The checks msgspec's types cannot express (module docstring)."""
    if not req.model.strip():
        raise missing_parameter("model")
    if req.input is None:
        raise missing_parameter("input")
    _range("temperature", req.temperature, 0, 2)
    _range("top_p", req.top_p, 0, 1)
    _range("max_output_tokens", req.max_output_tokens, MAX_OUTPUT_TOKENS_MIN, None)
    _range("top_logprobs", req.top_logprobs, 0, 20)
    if req.background:
        raise _unsupported("background", "responses run in the foreground only")
    if req.conversation is not None:
        raise _unsupported(
            "conversation", "there is no Conversations API; use previous_response_id"
        )
    if req.prompt is not None:
        raise _unsupported("prompt", "there are no stored prompts; send instructions and input")
    effort = req.reasoning.effort if req.reasoning else None
    if effort is not None and effort not in _EFFORTS:
        raise RequestError(
            f"Invalid value: '{effort}'. Supported values are: {_quote(_EFFORTS)}.",
            param="reasoning.effort",
            code=ErrorCode.INVALID_VALUE,
        )
    if req.metadata is not None:
        if len(req.metadata) > _METADATA_MAX_KEYS:
            raise RequestError(
                f"Invalid 'metadata': too many properties. Expected an object with at most "
                f"{_METADATA_MAX_KEYS} properties, but got an object with {len(req.metadata)} "
                "properties instead.",
                param="metadata",
                code=ErrorCode.OBJECT_ABOVE_MAX_PROPERTIES,
            )
        for key, value in req.metadata.items():
            for what, text, limit in (
                ("key", key, _METADATA_KEY_MAX),
                ("value", value, _METADATA_VALUE_MAX),
            ):
                if len(text) > limit:
                    raise RequestError(
                        f"Invalid 'metadata': {what} of '{key[:_METADATA_KEY_MAX]}' too long. "
                        f"Expected a string with maximum length {limit}, but got a string with "
                        f"length {len(text)} instead.",
                        param=f"metadata.{key[:_METADATA_KEY_MAX]}",
                        code=ErrorCode.STRING_ABOVE_MAX_LENGTH,
                    )


def decode_request(
    body: bytes, *, max_depth: int = DEFAULT_MAX_JSON_DEPTH
) -> tuple[ResponsesRequest, dict[str, Any]]:
    """Decode and check a Responses body, after the body-level guards every
    surface shares (``iop.api._json_guard``: depth, JSON and UTF-8, numbers).

    Args:
        body: The raw HTTP request body.
        max_depth: Deepest JSON nesting accepted (``server.max_json_depth``).

    Returns:
        The typed request, and the keys that are no Responses parameter
        (passed to the backend in ``extra_body``).

    Raises:
        RequestError: 400 in OpenAI's wording, with ``param``.
    """
    top = guarded_decode(body, max_depth=max_depth)
    try:
        req = _TYPED.decode(body)
    except msgspec.ValidationError as exc:
        raise _from_validation(exc) from exc
    _check(req)
    extra = {k: value for k, value in top.items() if k not in _KNOWN}
    return req, extra


# --- translation ------------------------------------------------------------------------


def _convert_item(raw: dict[str, Any], param: str) -> Item | None:
    """One input item as its struct, or None for a dropped type."""
    kind = raw.get("type", "message")
    if not isinstance(kind, str):
        raise RequestError(
            f"Invalid type for '{param}.type': expected a string, but got {_json_type(kind)} instead.",
            param=f"{param}.type",
            code=ErrorCode.INVALID_TYPE,
        )
    if kind == "item_reference":
        raise RequestError(
            "Item references are not supported by this server: send the item itself, or use "
            "previous_response_id.",
            param=f"{param}.type",
            code=ErrorCode.UNSUPPORTED_VALUE,
        )
    if kind in _DROPPED_ITEMS:
        return None
    if kind not in _ITEM_TYPES:
        raise RequestError(
            f"Invalid value: '{kind}'. Supported values are: {_quote(_ITEM_TYPES)}.",
            param=f"{param}.type",
            code=ErrorCode.INVALID_VALUE,
        )
    if "type" not in raw:
        raw = {**raw, "type": "message"}
    try:
        item: Item = msgspec.convert(raw, Item)
        return item
    except msgspec.ValidationError as exc:
        raise _from_validation(exc, param) from exc


def _content_part(part: Part, param: str) -> ContentPart:
    if isinstance(part, InputText | OutputText):
        return TextPart(text=part.text)
    if isinstance(part, Refusal):
        return TextPart(text=part.refusal)
    if isinstance(part, InputImage):
        if part.image_url is None:
            raise RequestError(
                "Images by 'file_id' are not supported by this server: send 'image_url' "
                "(an https URL or a data URL).",
                param=f"{param}.image_url",
                code=ErrorCode.UNSUPPORTED_VALUE,
            )
        detail = part.detail if part.detail in ("low", "high", "auto") else None
        return ImagePart(image_url=ImageURL(url=part.image_url, detail=detail))
    if part.file_url is not None:
        raise RequestError(
            "Files by 'file_url' are not supported by this server: send 'file_data'.",
            param=f"{param}.file_url",
            code=ErrorCode.UNSUPPORTED_VALUE,
        )
    return FilePart(
        file=FileRef(file_data=part.file_data, file_id=part.file_id, filename=part.filename)
    )


def _text_of(parts: list[ContentPart]) -> str:
    return "".join(p.text for p in parts if isinstance(p, TextPart))


def _parts(content: str | list[Part], param: str) -> str | list[ContentPart]:
    if isinstance(content, str):
        return content
    return [_content_part(p, f"{param}.content[{i}]") for i, p in enumerate(content)]


class _Builder:
    """Chat messages from Responses items, grouping an assistant turn's calls."""

    __slots__ = ("messages", "open_turn", "reasoning", "tools")

    def __init__(self, tools: ToolMap) -> None:
        self.tools = tools
        self.messages: list[Message] = []
        self.open_turn = False  # the last message is an assistant turn calls may join
        self.reasoning: str | None = None  # passed-back reasoning awaiting its turn

    def add(self, item: Item, param: str) -> None:
        if isinstance(item, ReasoningItem):
            parts = item.content if item.content else item.summary
            text = "".join(p.text for p in parts)
            self.reasoning = (self.reasoning or "") + text if text else self.reasoning
            return
        if isinstance(item, FunctionCallItem | CustomToolCallItem):
            # The call as the model made it: the flattened function name, a
            # custom tool's input wrapped as its one argument (_tools).
            name = self.tools.function(item.namespace, item.name)
            if isinstance(item, CustomToolCallItem):
                arguments = custom_arguments(item.input)
            else:
                arguments = item.arguments
            call = MessageToolCall(
                id=item.call_id, function=FunctionCall(name=name, arguments=arguments)
            )
            if self.open_turn and self.reasoning is None:
                last = self.messages[-1]
                calls = [*(last.tool_calls or ()), call]
                self.messages[-1] = msgspec.structs.replace(last, tool_calls=calls)
            else:
                self._assistant(None, [call])
            return
        self.open_turn = False
        if isinstance(item, FunctionCallOutputItem | CustomToolCallOutputItem):
            output = _parts(item.output, param)
            self.messages.append(Message(role="tool", tool_call_id=item.call_id, content=output))
            return
        content = _parts(item.content, param)
        if item.role == "assistant":
            text = content if isinstance(content, str) else _text_of(content)
            self._assistant(text, None)
        elif item.role == "user":
            self.messages.append(Message(role="user", content=content))
        else:  # system, developer (module docstring)
            text = content if isinstance(content, str) else _text_of(content)
            self.messages.append(Message(role="system", content=text))

    def _assistant(self, content: str | None, calls: list[MessageToolCall] | None) -> None:
        self.messages.append(
            Message(
                role="assistant",
                content=content,
                tool_calls=calls,
                reasoning_content=self.reasoning,
            )
        )
        self.reasoning = None
        self.open_turn = True


def input_messages(
    value: str | list[dict[str, Any]], tools: ToolMap | None = None
) -> list[Message]:
    """The chat messages of a request's ``input`` (module docstring).

    Args:
        value: The request's ``input``.
        tools: The function names of the request's custom and namespaced
            tools (``_tools``), which their calls are replayed under.

    Raises:
        RequestError: An item is invalid or unsupported.
    """
    if isinstance(value, str):
        return [Message(role="user", content=value)]
    builder = _Builder(tools or empty_map())
    for i, raw in enumerate(value):
        param = f"input[{i}]"
        item = _convert_item(raw, param)
        if item is not None:
            builder.add(item, param)
    return builder.messages


class _FunctionTool(_Struct, frozen=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _CustomTool(_Struct, frozen=True):
    name: str
    description: str | None = None
    format: dict[str, Any] | None = None


class _NamespaceTool(_Struct, frozen=True):
    name: str
    description: str = ""
    tools: list[dict[str, Any]] = []


class OfferedTools(msgspec.Struct, frozen=True, kw_only=True):
    """A request's tools as the run offers them.

    Attributes:
        functions: The chat functions, in the order the client gave the tools.
        echo: The client's tools that were offered, as the Response shows them.
        map: Function names to the client's custom and namespaced tools.
    """

    functions: list[Tool]
    echo: list[ToolEcho]
    map: ToolMap


def _typed(raw: dict[str, Any], kind: type[_S], param: str) -> _S:
    fields = {k: v for k, v in raw.items() if k in kind.__struct_fields__}
    try:
        return msgspec.convert(fields, kind)
    except msgspec.ValidationError as exc:
        raise _from_validation(exc, param) from exc


def offered_tools(tools: list[dict[str, Any]] | None) -> OfferedTools:
    """The functions a request's ``tools`` are offered to the model as (``_tools``).

    Raises:
        RequestError: A function, custom or namespace tool is malformed.
    """
    raw_tools = list(tools or ())
    # Top-level functions keep their names; flattened names must not take one.
    taken = {
        t["name"]
        for t in raw_tools
        if t.get("type") == "function" and isinstance(t.get("name"), str)
    }
    functions: list[Tool] = []
    echo: list[ToolEcho] = []
    origins: dict[str, ToolOrigin] = {}
    names: dict[str, str] = {}

    def add(
        raw: dict[str, Any], param: str, namespace: _NamespaceTool | None
    ) -> FunctionToolEcho | CustomToolEcho | None:
        kind = raw.get("type")
        ns = namespace.name if namespace is not None else None
        note = None
        if namespace is not None:
            about = f": {namespace.description}" if namespace.description else ""
            note = f"(A tool of {namespace.name}{about})"
        if kind == "function":
            fn = _typed(raw, _FunctionTool, param)
            name = fn.name
            if ns is not None:
                name = flat_name(ns, fn.name, taken)
                taken.add(name)
                origins[name] = ToolOrigin(name=fn.name, namespace=ns)
                names[tool_key(ns, fn.name)] = name
            description = "\n\n".join(p for p in (fn.description, note) if p) or None
            functions.append(
                Tool(
                    function=FunctionDef(
                        name=name,
                        description=description,
                        parameters=fn.parameters,
                        strict=fn.strict,
                    )
                )
            )
            return FunctionToolEcho(fn.name, fn.description, fn.parameters, fn.strict)
        if kind == "custom":
            custom = _typed(raw, _CustomTool, param)
            name = flat_name(ns, custom.name, taken)
            taken.add(name)
            origins[name] = ToolOrigin(name=custom.name, namespace=ns, custom=True)
            names[tool_key(ns, custom.name)] = name
            functions.append(
                Tool(function=custom_function(name, custom.description, custom.format, note))
            )
            return CustomToolEcho(custom.name, custom.description, custom.format)
        return None  # a tool IOP cannot run: dropped (module docstring)

    for i, raw in enumerate(raw_tools):
        param = f"tools[{i}]"
        if raw.get("type") == "namespace":
            namespace = _typed(raw, _NamespaceTool, param)
            inner = [
                found
                for j, t in enumerate(namespace.tools)
                if (found := add(t, f"{param}.tools[{j}]", namespace)) is not None
            ]
            if inner:
                echo.append(NamespaceToolEcho(namespace.name, namespace.description, inner))
            continue
        found = add(raw, param, None)
        if found is not None:
            echo.append(found)
    return OfferedTools(functions=functions, echo=echo, map=ToolMap(origins=origins, names=names))


def _kept_echo(offered: OfferedTools, kept: set[str]) -> list[ToolEcho]:
    """The echo of the tools ``allowed_tools`` kept (function names ``kept``)."""

    def keeps(tool: FunctionToolEcho | CustomToolEcho, namespace: str | None) -> bool:
        return offered.map.function(namespace, tool.name) in kept

    out: list[ToolEcho] = []
    for tool in offered.echo:
        if isinstance(tool, NamespaceToolEcho):
            inner = [t for t in tool.tools if keeps(t, tool.name)]
            if inner:
                out.append(msgspec.structs.replace(tool, tools=inner))
        elif keeps(tool, None):
            out.append(tool)
    return out


def _choice_error(message: str) -> RequestError:
    return RequestError(message, param="tool_choice", code=ErrorCode.INVALID_VALUE)


def _tool_choice(
    choice: str | dict[str, Any] | None, tools: list[Tool], tool_map: ToolMap
) -> tuple[ToolChoice | None, list[Tool]]:
    """Chat's tool choice for a Responses one, and the tools left to offer."""
    names = [t.function.name for t in tools]
    if choice is None:
        return None, tools
    if isinstance(choice, str):
        if choice not in _TOOL_CHOICES:
            raise _choice_error(
                f"Invalid value: '{choice}'. Supported values are: {_quote(_TOOL_CHOICES)}, or an "
                "object naming a function or custom tool."
            )
        if choice == "required" and not tools:
            raise _choice_error(
                "Invalid value for 'tool_choice': 'required' needs at least one function or "
                "custom tool in 'tools' (tools of other types are not run by this server)."
            )
        return (choice if tools else None), tools
    kind = choice.get("type")
    if kind in ("function", "custom"):
        name = choice.get("name")
        function = tool_map.function(None, name) if isinstance(name, str) else None
        origin = tool_map.origin(function) if function is not None else None
        # A function is chosen by its own name, a custom tool by the client's.
        is_kind = (origin is not None and origin.custom) == (kind == "custom")
        if function not in names or not is_kind:
            raise _choice_error(
                f"Invalid value for 'tool_choice': {kind} tool '{name}' is not one of the "
                f"{kind} tools in 'tools'."
            )
        assert function is not None
        return NamedToolChoice(function=NamedFunction(name=function)), tools
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        listed = choice.get("tools")
        if not isinstance(listed, list):
            raise RequestError(
                "Invalid type for 'tool_choice.tools': expected an array, but got "
                f"{_json_type(listed)} instead.",
                param="tool_choice.tools",
                code=ErrorCode.INVALID_TYPE,
            )
        allowed = {
            tool_map.function(None, t["name"])
            for t in listed
            if isinstance(t, dict)
            and t.get("type") in ("function", "custom")
            and isinstance(t.get("name"), str)
        }
        kept = [t for t in tools if t.function.name in allowed]
        if mode not in ("auto", "required"):
            raise _choice_error(
                f"Invalid value: '{mode}'. Supported values for 'tool_choice.mode' are: 'auto', "
                "'required'."
            )
        if mode == "required" and not kept:
            raise _choice_error(
                "Invalid value for 'tool_choice': none of the allowed tools is a function or "
                "custom tool in 'tools' (tools of other types are not run by this server)."
            )
        return (mode if kept else None), kept
    raise _choice_error(
        f"Invalid value for 'tool_choice': tools of type '{kind}' are not run by this server; "
        "only function and custom tools can be chosen."
    )


def _response_format(text: _Text | None) -> dict[str, Any] | None:
    fmt = text.format if text else None
    if not fmt:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
            missing = "name" if not isinstance(fmt.get("name"), str) else "schema"
            raise missing_parameter(f"text.format.{missing}")
        spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise RequestError(
        f"Invalid value: '{kind}'. Supported values are: 'text', 'json_schema', 'json_object'.",
        param="text.format.type",
        code=ErrorCode.INVALID_VALUE,
    )


def _merge_leading_system(messages: list[Message]) -> list[Message]:
    """Leading system messages as one (module docstring)."""
    n = 0
    while n < len(messages) and messages[n].role == "system":
        n += 1
    if n < 2:
        return messages
    text = "\n\n".join(m.text() for m in messages[:n] if m.text())
    return [Message(role="system", content=text), *messages[n:]]


def translate(
    req: ResponsesRequest,
    extra: dict[str, Any],
    prior: tuple[Message, ...] = (),
) -> tuple[ChatRequest, tuple[Message, ...], OfferedTools, ToolChoice | None]:
    """The run's ``ChatRequest`` for a decoded Responses request.

    Args:
        req: The decoded, checked request.
        extra: Keys that are no Responses parameter (for ``extra_body``).
        prior: The stored conversation of ``previous_response_id``.

    Returns:
        The chat request; the conversation without instructions (``prior``
        and the new input, what a stored response keeps); the tools that
        were offered (echoed in the Response; their map turns the model's
        calls back into the client's) and the tool choice.

    Raises:
        RequestError: An item, tool or choice is invalid or unsupported.
    """
    assert req.input is not None  # _check
    offered = offered_tools(req.tools)
    history = (*prior, *input_messages(req.input, offered.map))
    if not history:
        raise RequestError(
            "Invalid 'input': empty array. Expected an array with minimum length 1, but got an "
            "empty array instead.",
            param="input",
            code=ErrorCode.EMPTY_ARRAY,
        )
    messages = list(history)
    if req.instructions:
        messages.insert(0, Message(role="system", content=req.instructions))
    choice, tools = _tool_choice(req.tool_choice, offered.functions, offered.map)
    if tools is not offered.functions:  # allowed_tools narrowed them
        kept = {t.function.name for t in tools}
        offered = msgspec.structs.replace(offered, functions=tools, echo=_kept_echo(offered, kept))
    chat = ChatRequest(
        model=req.model,
        messages=_merge_leading_system(messages),
        stream=bool(req.stream),
        tools=tools or None,
        tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls if tools else None,
        temperature=req.temperature,
        top_p=req.top_p,
        max_completion_tokens=req.max_output_tokens,
        response_format=_response_format(req.text),
        reasoning_effort=req.reasoning.effort if req.reasoning else None,
        user=req.prompt_cache_key or req.user or req.safety_identifier,
        extra_body=extra or None,
    )
    return chat, history, offered, choice
