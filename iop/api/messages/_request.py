"""Anthropic Messages request bodies to a ``ChatRequest``, with Anthropic's 400s (sans-IO).

``parse_messages_request`` decodes a ``POST /v1/messages`` body into typed
Structs after Anthropic's Messages API (``MessagesRequest``) and translates
it into the ``iop.spec.ChatRequest`` a run executes; ``parse_count_tokens``
does the same for ``POST /v1/messages/count_tokens``, where ``max_tokens`` is
not required. Every problem is a ``RequestError`` (400) worded like
Anthropic's own validation errors: a dotted path, then what is wrong
(``"messages.0.content.1.type: Input tag 'foo' found using 'type' does not
match any of the expected tags: ..."``, ``"max_tokens: Field required"``).

The mapping onto a run (each row is in ``docs/api.md``, "Anthropic Messages"):

* ``system`` (a string or text blocks) -> a first ``system`` message; a
  ``system``-role message inside ``messages`` (Claude Code sends them) -> a
  ``system`` message in place. ``cache_control`` is ignored everywhere.
* ``user`` turns: ``tool_result`` blocks become ``tool`` messages (in order,
  before the rest of the turn, as OpenAI wants a tool result right after the
  call); the remaining text, image and document blocks become one ``user``
  message (a string for a lone text block, else content parts). Images
  inside a tool result go to that user message too, first: OpenAI's tool
  messages carry text only. ``is_error`` prefixes the result with
  ``"Error: "`` so the model sees it failed.
* ``assistant`` turns: text -> ``content``, ``tool_use`` -> ``tool_calls``
  (the id kept, ``input`` as JSON ``arguments``), ``thinking`` ->
  ``reasoning_content``; ``redacted_thinking`` is opaque and dropped.
* Blocks of Anthropic's server tools (``server_tool_use``,
  ``web_search_tool_result``...) and tools of a server ``type``
  (``web_search_*``, ``bash_*``, ``text_editor_*``, ``computer_*``...) are
  dropped: only Anthropic runs them, and a backend cannot.
* ``tool_choice``: ``auto``/``any``/``tool``/``none`` -> ``auto``/
  ``required``/the named function/``none``; ``disable_parallel_tool_use``
  -> ``parallel_tool_calls: false``.
* ``thinking`` -> ``reasoning_effort`` (:func:`reasoning_effort`);
  ``metadata.user_id`` -> ``user`` (the affinity key); ``top_k`` ->
  ``extra_body["top_k"]``; ``stop_sequences`` -> ``stop``.
* ``output_config.format`` (structured output, a JSON schema) ->
  ``response_format`` ``json_schema``; ``output_config.effort`` is accepted
  and not sent (``OutputConfig``).
* Ignored, documented: ``context_management``, ``service_tier``, ``container``, ``mcp_servers`` and any other top-level
  key (Anthropic's beta features, enabled by ``anthropic-beta``, add keys
  all the time; refusing them would break clients that IOP can otherwise
  serve). Their names are in ``MessagesRequest.ignored`` for the log.
"""

from __future__ import annotations

import re
from typing import Any, Final, Literal

import msgspec

from iop.api._json_guard import DEFAULT_MAX_JSON_DEPTH, Style, guarded_decode
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
    "IGNORED_FIELDS",
    "MessagesRequest",
    "parse_count_tokens",
    "parse_messages_request",
    "reasoning_effort",
]

# --- Anthropic's request, typed (unknown keys inside objects are ignored) ------------


class _Struct(msgspec.Struct, frozen=True, kw_only=True):
    pass


class TextBlock(_Struct, frozen=True, tag="text", tag_field="type"):
    text: str


class Base64Source(_Struct, frozen=True, tag="base64", tag_field="type"):
    media_type: str
    data: str


class URLSource(_Struct, frozen=True, tag="url", tag_field="type"):
    url: str


class TextSource(_Struct, frozen=True, tag="text", tag_field="type"):
    data: str
    media_type: str = "text/plain"


class ImageBlock(_Struct, frozen=True, tag="image", tag_field="type"):
    source: Base64Source | URLSource


class DocumentBlock(_Struct, frozen=True, tag="document", tag_field="type"):
    source: Base64Source | URLSource | TextSource
    title: str | None = None


class ToolResultBlock(_Struct, frozen=True, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] = ""
    is_error: bool = False


class ToolUseBlock(_Struct, frozen=True, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(_Struct, frozen=True, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Struct, frozen=True, tag="redacted_thinking", tag_field="type"):
    data: str = ""


# Blocks of Anthropic's server tools, resent by clients on later turns:
# accepted and dropped with the server tools themselves (module docstring).
class ServerToolUse(_Struct, frozen=True, tag="server_tool_use", tag_field="type"):
    pass


class WebSearchResult(_Struct, frozen=True, tag="web_search_tool_result", tag_field="type"):
    pass


class WebFetchResult(_Struct, frozen=True, tag="web_fetch_tool_result", tag_field="type"):
    pass


class CodeExecutionResult(_Struct, frozen=True, tag="code_execution_tool_result", tag_field="type"):
    pass


class BashExecutionResult(
    _Struct, frozen=True, tag="bash_code_execution_tool_result", tag_field="type"
):
    pass


class EditorExecutionResult(
    _Struct, frozen=True, tag="text_editor_code_execution_tool_result", tag_field="type"
):
    pass


class ToolSearchResult(_Struct, frozen=True, tag="tool_search_tool_result", tag_field="type"):
    pass


class MCPToolUse(_Struct, frozen=True, tag="mcp_tool_use", tag_field="type"):
    pass


class MCPToolResult(_Struct, frozen=True, tag="mcp_tool_result", tag_field="type"):
    pass


class ContainerUpload(_Struct, frozen=True, tag="container_upload", tag_field="type"):
    pass


_ServerBlock = (
    ServerToolUse
    | WebSearchResult
    | WebFetchResult
    | CodeExecutionResult
    | BashExecutionResult
    | EditorExecutionResult
    | ToolSearchResult
    | MCPToolUse
    | MCPToolResult
    | ContainerUpload
)
_SERVER_BLOCKS: Final = (
    ServerToolUse,
    WebSearchResult,
    WebFetchResult,
    CodeExecutionResult,
    BashExecutionResult,
    EditorExecutionResult,
    ToolSearchResult,
    MCPToolUse,
    MCPToolResult,
    ContainerUpload,
)

Block = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolResultBlock
    | ToolUseBlock
    | ThinkingBlock
    | RedactedThinkingBlock
    | _ServerBlock
)
_BLOCK_TAGS: Final = (
    "text",
    "image",
    "document",
    "tool_result",
    "tool_use",
    "thinking",
    "redacted_thinking",
    *(str(b.__struct_config__.tag) for b in _SERVER_BLOCKS),
)


class InputMessage(_Struct, frozen=True):
    # "system" is not Anthropic's, but Claude Code sends it (module docstring).
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolHead(_Struct, frozen=True):
    """What tells a custom tool (no ``type``, or ``custom``) from a server tool."""

    type: str | None = None


class CustomTool(_Struct, frozen=True):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


class ToolChoiceAuto(_Struct, frozen=True, tag="auto", tag_field="type"):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(_Struct, frozen=True, tag="any", tag_field="type"):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(_Struct, frozen=True, tag="tool", tag_field="type"):
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(_Struct, frozen=True, tag="none", tag_field="type"):
    pass


class ThinkingEnabled(_Struct, frozen=True, tag="enabled", tag_field="type"):
    budget_tokens: int


class ThinkingAdaptive(_Struct, frozen=True, tag="adaptive", tag_field="type"):
    pass


class ThinkingDisabled(_Struct, frozen=True, tag="disabled", tag_field="type"):
    pass


Thinking = ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled


class Metadata(_Struct, frozen=True):
    user_id: str | None = None


class JSONOutputFormat(_Struct, frozen=True, tag="json_schema", tag_field="type"):
    schema: dict[str, Any]


class OutputConfig(_Struct, frozen=True):
    """``output_config``: Anthropic's structured output (``format``) and effort.

    ``effort`` is accepted and not sent: Claude Code sends it with every request,
    and a backend's own default is what ``thinking: adaptive`` asks for too.
    """

    format: JSONOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class MessagesRequest(_Struct, frozen=True):
    """A ``POST /v1/messages`` body, as Anthropic documents it.

    ``max_tokens`` is required by :func:`parse_messages_request` (not by
    count_tokens, whose body is otherwise the same). ``ignored`` names the
    top-level keys that were accepted and ignored (module docstring).
    """

    model: str
    messages: list[InputMessage]
    max_tokens: int | None = None
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[msgspec.Raw] | None = None
    tool_choice: ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone | None = None
    thinking: Thinking | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    ignored: tuple[str, ...] = ()


IGNORED_FIELDS: Final = frozenset(
    {"context_management", "service_tier", "container", "mcp_servers"}
)
"""Top-level keys Anthropic documents that IOP accepts and ignores by name
(any other unknown key is ignored too, see the module docstring)."""

_TYPED: Final = msgspec.json.Decoder(MessagesRequest)
_TOOL_HEAD: Final = msgspec.json.Decoder(ToolHead)
_CUSTOM_TOOL: Final = msgspec.json.Decoder(CustomTool)
_KNOWN: Final = frozenset(MessagesRequest.__struct_fields__) - {"ignored"}

# --- errors worded like Anthropic's (pydantic-style: "<dotted.path>: <what>") -------

# msgspec's ValidationError messages (msgspec/_core.c), each optionally
# followed by " - at `$.path`".
_AT: Final = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_MISSING: Final = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")
_TYPE: Final = re.compile(r"^Expected `(?P<expected>[^`]+)`(?P<rest>.*?), got `(?P<got>[^`]+)`$")
_VALUE: Final = re.compile(r"^Invalid (?:enum )?value (?P<value>.+)$")
_INDEX: Final = re.compile(r"\[(\d+)\]")

_TYPE_NAMES: Final[dict[str, str]] = {
    "str": "a valid string",
    "int": "a valid integer",
    "float": "a valid number",
    "bool": "a valid boolean",
    "array": "a valid list",
    "object": "a valid dictionary",
    "null": "null",
}
_TAGS: Final[dict[str, tuple[str, ...]]] = {
    "content": _BLOCK_TAGS,
    "tool_choice": ("auto", "any", "tool", "none"),
    "thinking": ("enabled", "adaptive", "disabled"),
    "source": ("base64", "url", "text"),
}


def _dotted(path: str) -> str:
    """msgspec's ``.messages[0].content[1]`` as Anthropic's ``messages.0.content.1``."""
    return _INDEX.sub(r".\1", path).strip(".")


def _join(parent: str, field: str) -> str:
    return f"{parent}.{field}" if parent and field else parent or field


def _invalid(
    path: str, what: str, *, code: ErrorCode = ErrorCode.INVALID_REQUEST_ERROR
) -> RequestError:
    return RequestError(f"{path}: {what}" if path else what, param=path or None, code=code)


def _tags_for(path: str) -> tuple[str, ...] | None:
    parts = [p for p in path.split(".") if not p.isdigit()]
    # ``...content.N.type`` / ``tool_choice.type`` / ``...source.type``
    return _TAGS.get(parts[-2]) if len(parts) >= 2 and parts[-1] == "type" else None


def _from_validation(exc: msgspec.ValidationError, prefix: str = "") -> RequestError:
    m = _AT.match(str(exc))
    assert m is not None  # the pattern matches any string
    msg, path = m["msg"], _join(prefix, _dotted(m["path"] or ""))
    if missing := _MISSING.match(msg):
        return _invalid(_join(path, missing["field"]), "Field required")
    if wrong := _TYPE.match(msg):
        names = [_TYPE_NAMES.get(n.strip(), n.strip()) for n in wrong["expected"].split("|")]
        names = [n for n in names if n != "null"] or names
        return _invalid(path, "Input should be " + " or ".join(names))
    if bad := _VALUE.match(msg):
        tags = _tags_for(path)
        if tags is not None:
            expected = ", ".join(f"'{t}'" for t in tags)
            return _invalid(
                path,
                f"Input tag {bad['value']} found using 'type' does not match any of the "
                f"expected tags: {expected}",
            )
        if path.endswith(".role"):
            return _invalid(path, "Input should be 'user' or 'assistant'")
        return _invalid(path, f"Input should be a valid value, got {bad['value']}")
    return _invalid(path, msg)


# --- translation ------------------------------------------------------------------------


def reasoning_effort(thinking: Thinking | None) -> str | None:
    """``thinking`` as OpenAI's ``reasoning_effort`` (``docs/api.md``).

    ``enabled`` buckets ``budget_tokens``: below 4,096 ``low``, below 16,384
    ``medium``, else ``high`` (Anthropic's minimum budget is 1,024; 16k is
    where its docs start calling a budget large). ``adaptive`` (the model
    decides, what Claude Code sends) and ``disabled`` leave the backend's own
    default: there is no portable "off" (``"none"`` is refused by backends
    that know only low/medium/high), so a disabled run's reasoning is dropped
    from the answer instead (``MessagesRequest.thinking`` reaches the encoder).
    """
    if not isinstance(thinking, ThinkingEnabled):
        return None
    if thinking.budget_tokens < 4096:
        return "low"
    if thinking.budget_tokens < 16384:
        return "medium"
    return "high"


def _response_format(config: OutputConfig | None) -> dict[str, Any] | None:
    """``output_config.format`` as OpenAI's ``response_format``: what vLLM and
    llama.cpp's server turn into guided decoding (docs/api.md, "Structured output")."""
    if config is None or config.format is None:
        return None
    return {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": config.format.schema, "strict": True},
    }


def _image_url(source: Base64Source | URLSource) -> str:
    if isinstance(source, URLSource):
        return source.url
    return f"data:{source.media_type};base64,{source.data}"


def _part(block: TextBlock | ImageBlock | DocumentBlock) -> ContentPart:
    if isinstance(block, TextBlock):
        return TextPart(text=block.text)
    if isinstance(block, ImageBlock):
        return ImagePart(image_url=ImageURL(url=_image_url(block.source)))
    source = block.source
    if isinstance(source, TextSource):
        return TextPart(text=source.data)
    if isinstance(source, URLSource):
        return FilePart(file=FileRef(file_data=source.url, filename=block.title))
    return FilePart(file=FileRef(file_data=_image_url(source), filename=block.title))


def _content(parts: list[ContentPart]) -> str | list[ContentPart]:
    """A lone text part as a plain string (what every backend takes), else the parts."""
    if len(parts) == 1 and isinstance(parts[0], TextPart):
        return parts[0].text
    return parts


def _tool_message(block: ToolResultBlock, images: list[ContentPart]) -> Message:
    if isinstance(block.content, str):
        text = block.content
    else:
        texts: list[str] = []
        for item in block.content:
            part = _part(item)
            if isinstance(part, TextPart):
                texts.append(part.text)
            else:
                images.append(part)
        text = "\n".join(texts)
    if block.is_error:
        text = f"Error: {text}" if text else "Error"
    return Message(role="tool", content=text, tool_call_id=block.tool_use_id)


def _system_text(content: str | list[TextBlock] | list[Block], path: str) -> str:
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for i, block in enumerate(content):
        if not isinstance(block, TextBlock):
            raise _invalid(
                f"{path}.{i}.type",
                "system content must be text blocks",
                code=ErrorCode.INVALID_VALUE,
            )
        texts.append(block.text)
    return "\n".join(texts)


def _user_turn(content: str | list[Block], path: str) -> list[Message]:
    if isinstance(content, str):
        return [Message(role="user", content=content)]
    tools: list[Message] = []
    images: list[ContentPart] = []
    parts: list[ContentPart] = []
    for i, block in enumerate(content):
        if isinstance(block, ToolResultBlock):
            tools.append(_tool_message(block, images))
        elif isinstance(block, TextBlock | ImageBlock | DocumentBlock):
            parts.append(_part(block))
        elif isinstance(block, _SERVER_BLOCKS):
            continue
        else:
            raise _invalid(
                f"{path}.{i}.type",
                f"'{block.__struct_config__.tag}' blocks are only allowed in assistant messages",
                code=ErrorCode.INVALID_VALUE,
            )
    rest = images + parts
    return tools + ([Message(role="user", content=_content(rest))] if rest else [])


def _arguments(value: dict[str, Any]) -> str:
    return msgspec.json.encode(value).decode()


def _assistant_turn(content: str | list[Block], path: str) -> list[Message]:
    if isinstance(content, str):
        return [Message(role="assistant", content=content)]
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[MessageToolCall] = []
    for i, block in enumerate(content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append(
                MessageToolCall(
                    id=block.id,
                    function=FunctionCall(name=block.name, arguments=_arguments(block.input)),
                )
            )
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, (RedactedThinkingBlock, *_SERVER_BLOCKS)):
            continue
        else:
            raise _invalid(
                f"{path}.{i}.type",
                f"'{block.__struct_config__.tag}' blocks are only allowed in user messages",
                code=ErrorCode.INVALID_VALUE,
            )
    if not texts and not calls and not reasoning:
        return []
    return [
        Message(
            role="assistant",
            content="".join(texts) if texts or not calls else None,
            tool_calls=calls or None,
            reasoning_content="".join(reasoning) or None,
        )
    ]


def _tools(raw: list[msgspec.Raw] | None) -> list[Tool] | None:
    if raw is None:
        return None
    tools: list[Tool] = []
    for i, item in enumerate(raw):
        try:
            head = _TOOL_HEAD.decode(item)
            if head.type not in (None, "custom"):
                continue  # a server tool (web_search_*, bash_*...): dropped, documented
            tool = _CUSTOM_TOOL.decode(item)
        except msgspec.ValidationError as exc:
            raise _from_validation(exc, prefix=f"tools.{i}") from exc
        tools.append(
            Tool(
                function=FunctionDef(
                    name=tool.name,
                    description=tool.description,
                    parameters=tool.input_schema,
                    strict=tool.strict,
                )
            )
        )
    return tools


def _tool_choice(req: MessagesRequest, tools: list[Tool] | None) -> tuple[ToolChoice | None, bool]:
    """OpenAI's ``tool_choice`` and whether parallel calls were disabled."""
    choice = req.tool_choice
    if choice is None:
        return None, False
    if isinstance(choice, ToolChoiceNone):
        return "none", False
    names = [t.function.name for t in tools or ()]
    serial = bool(choice.disable_parallel_tool_use)
    if isinstance(choice, ToolChoiceAuto):
        return "auto", serial
    if not names:
        raise _invalid("tool_choice", "tool_choice may only be specified while providing tools")
    if isinstance(choice, ToolChoiceAny):
        return "required", serial
    if choice.name not in names:
        raise _invalid("tool_choice.name", f"Tool '{choice.name}' not found in tools")
    return NamedToolChoice(function=NamedFunction(name=choice.name)), serial


def _messages(req: MessagesRequest) -> list[Message]:
    out: list[Message] = []
    if req.system is not None:
        text = _system_text(req.system, "system")
        if text:
            out.append(Message(role="system", content=text))
    for i, msg in enumerate(req.messages):
        path = f"messages.{i}.content"
        if msg.role == "system":
            out.append(Message(role="system", content=_system_text(msg.content, path)))
        elif msg.role == "user":
            out.extend(_user_turn(msg.content, path))
        else:
            out.extend(_assistant_turn(msg.content, path))
    return out


def _decode(body: bytes, max_depth: int) -> MessagesRequest:
    # The body-level guards every surface shares (depth, JSON and UTF-8, numbers).
    top = guarded_decode(body, max_depth=max_depth, style=Style.ANTHROPIC)
    ignored = tuple(k for k in top if k not in _KNOWN)
    if "ignored" in top:  # our own bookkeeping field, never the client's
        del top["ignored"]
        body = msgspec.json.encode(top)
    try:
        req = _TYPED.decode(body)
    except msgspec.ValidationError as exc:
        raise _from_validation(exc) from exc
    if not req.model.strip():
        raise _invalid("model", "Field required")
    if not req.messages:
        raise _invalid("messages", "at least one message is required")
    return msgspec.structs.replace(req, ignored=ignored) if ignored else req


def _translate(req: MessagesRequest) -> ChatRequest:
    tools = _tools(req.tools)
    choice, serial = _tool_choice(req, tools)
    return ChatRequest(
        model=req.model,
        messages=_messages(req),
        stream=req.stream,
        tools=tools or None,
        tool_choice=choice,
        parallel_tool_calls=False if serial else None,
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=req.max_tokens,
        stop=req.stop_sequences or None,
        reasoning_effort=reasoning_effort(req.thinking),
        response_format=_response_format(req.output_config),
        user=req.metadata.user_id if req.metadata else None,
        extra_body={"top_k": req.top_k} if req.top_k is not None else None,
    )


def parse_messages_request(
    body: bytes, *, max_depth: int = DEFAULT_MAX_JSON_DEPTH
) -> tuple[MessagesRequest, ChatRequest]:
    """Decode, check and translate a ``POST /v1/messages`` body.

    ``max_depth`` is the deepest JSON nesting accepted (``server.max_json_depth``;
    ``iop.api._json_guard`` runs first, as on every surface).

    Returns:
        Anthropic's typed request (for the encoder: ``thinking``, ``ignored``)
        and the ``ChatRequest`` the run executes.

    Raises:
        RequestError: 400, worded like Anthropic's (module docstring).
    """
    req = _decode(body, max_depth)
    if req.max_tokens is None:
        raise _invalid("max_tokens", "Field required")
    if req.max_tokens < 1:
        raise _invalid("max_tokens", "Input should be greater than or equal to 1")
    return req, _translate(req)


def parse_count_tokens(
    body: bytes, *, max_depth: int = DEFAULT_MAX_JSON_DEPTH
) -> tuple[MessagesRequest, ChatRequest]:
    """Like :func:`parse_messages_request` for ``count_tokens`` (no ``max_tokens`` needed)."""
    req = _decode(body, max_depth)
    return req, _translate(req)
