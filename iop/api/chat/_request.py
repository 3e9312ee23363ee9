"""Chat-completions request bodies to ``ChatRequest``, with OpenAI's 400s (sans-IO).

``parse_chat_request`` decodes a ``POST /v1/chat/completions`` body into the
typed ``iop.spec.ChatRequest`` and turns every problem into a
``RequestError`` (status 400) whose message, ``param`` and ``code`` read like
OpenAI's own (``"Invalid type for 'messages[0].content': ..."``,
``param="messages[0].content"``, ``code="invalid_type"``), so clients and
SDKs show something actionable.

Cost: two passes of msgspec over the body, both in C. The first decodes only
the top level into ``dict[str, msgspec.Raw]`` (values are not parsed, just
delimited), which rejects bad JSON and non-objects and finds the keys IOP does
not model; the second is the typed decode, which skips unknown keys without
building them. Only unknown keys' values are decoded again, into
``ChatRequest.extra_body``, so vLLM extras like ``top_k`` or
``chat_template_kwargs`` reach the backend.

Checks after decoding (OpenAI's and vLLM's validators):

* ``model`` non-blank; ``messages`` non-empty;
* ``stream_options`` only with ``stream: true``;
* ``n``: at least 1, and IOP returns one choice, so more than 1 is a 400;
* ``tool_choice``: ``"none"``, ``"auto"``, ``"required"`` or a named function;
  ``"required"`` or a named function need ``tools``, and the named function
  must be one of them. (``"auto"``/``"none"`` without tools are accepted:
  they ask for nothing that cannot be done.)
"""

from __future__ import annotations

import re
import typing
from typing import Any, Final

import msgspec

from iop.errors import RequestError
from iop.spec import ChatRequest, Message, NamedToolChoice

__all__ = ["parse_chat_request"]

_TOP: Final = msgspec.json.Decoder(dict[str, msgspec.Raw])
_TYPED: Final = msgspec.json.Decoder(ChatRequest)
_KNOWN: Final = frozenset(ChatRequest.__struct_fields__)

_INVALID_JSON: Final = (
    "We could not parse the JSON body of your request. (HINT: This likely means you aren't "
    "using your HTTP library correctly. The API expects a JSON payload, but what was sent "
    "was not valid JSON.)"
)

_TOOL_CHOICES: Final = frozenset({"none", "auto", "required"})
_ROLES: Final[tuple[str, ...]] = typing.get_args(typing.get_type_hints(Message)["role"])
_PART_TYPES: Final = ("text", "image_url", "input_audio", "file", "refusal")

# msgspec's ValidationError messages (msgspec/_core.c), each optionally
# followed by " - at `$.path`".
_AT: Final = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_MISSING: Final = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")
_TYPE: Final = re.compile(r"^Expected `(?P<expected>[^`]+)`(?P<rest>.*?), got `(?P<got>[^`]+)`$")
_VALUE: Final = re.compile(r"^Invalid (?:enum )?value (?P<value>.+)$")

_TYPE_NAMES: Final[dict[str, str]] = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "null": "null",
    "array": "an array",
    "object": "an object",
}


def _quote(items: tuple[str, ...]) -> str:
    quoted = [f"'{i}'" for i in items]
    return ", ".join(quoted[:-1]) + f", and {quoted[-1]}" if len(quoted) > 1 else quoted[0]


def _type_phrase(spec: str) -> str:
    names = [_TYPE_NAMES.get(n.strip(), n.strip()) for n in spec.split("|")]
    if len(names) == 1:
        return names[0]
    return "one of " + ", ".join(names[:-1]) + " or " + names[-1]


def _param(path: str) -> str | None:
    """msgspec's ``$.messages[0].role`` path as OpenAI's ``messages[0].role``."""
    path = path.removeprefix(".")
    return path or None


def _join(parent: str | None, field: str) -> str:
    return f"{parent}.{field}" if parent else field


def _from_validation(exc: msgspec.ValidationError) -> RequestError:
    """A RequestError worded like OpenAI's for one of msgspec's messages."""
    m = _AT.match(str(exc))
    assert m is not None  # the pattern matches any string
    msg, param = m["msg"], _param(m["path"] or "")
    if missing := _MISSING.match(msg):
        param = _join(param, missing["field"])
        return RequestError(
            f"Missing required parameter: '{param}'.",
            param=param,
            code="missing_required_parameter",
        )
    if wrong := _TYPE.match(msg):
        expected = _type_phrase(wrong["expected"]) + wrong["rest"]
        got = _TYPE_NAMES.get(wrong["got"], wrong["got"])
        where = f" for '{param}'" if param else ""
        return RequestError(
            f"Invalid type{where}: expected {expected}, but got {got} instead.",
            param=param,
            code="invalid_type",
        )
    if bad := _VALUE.match(msg):
        text = f"Invalid value: {bad['value']}."
        last = (param or "").rsplit(".", 1)[-1]
        if last == "role":
            text += f" Supported values are: {_quote(_ROLES)}."
        elif last == "type" and param and ".content[" in param:
            text += f" Supported values are: {_quote(_PART_TYPES)}."
        elif last == "type":
            text += " Supported values are: 'function'."
        return RequestError(text, param=param, code="invalid_value")
    where = f" for '{param}'" if param else ""
    return RequestError(f"Invalid value{where}: {msg}.", param=param, code="invalid_value")


def _check(req: ChatRequest) -> None:
    """The checks msgspec's types cannot express (module docstring)."""
    if not req.model.strip():
        raise RequestError(
            "Missing required parameter: 'model'.",
            param="model",
            code="missing_required_parameter",
        )
    if not req.messages:
        raise RequestError(
            "Invalid 'messages': empty array. Expected an array with minimum length 1, "
            "but got an empty array instead.",
            param="messages",
            code="empty_array",
        )
    if req.stream_options is not None and not req.stream:
        raise RequestError(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
            code="invalid_value",
        )
    if req.n is not None:
        if req.n < 1:
            raise RequestError(
                "Invalid 'n': integer below minimum value. Expected a value >= 1, "
                f"but got {req.n} instead.",
                param="n",
                code="integer_below_min_value",
            )
        if req.n > 1:
            raise RequestError(
                f"Invalid 'n': only one choice per request is supported, but got {req.n}.",
                param="n",
                code="unsupported_value",
            )
    choice = req.tool_choice
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in _TOOL_CHOICES:
            raise RequestError(
                f"Invalid value for 'tool_choice': '{choice}'. Supported values are: "
                "'none', 'auto', 'required', or an object naming a function.",
                param="tool_choice",
                code="invalid_value",
            )
        if choice != "required":
            return
    if not req.tools:
        raise RequestError(
            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' "
            "are specified.",
            param="tool_choice",
            code="invalid_value",
        )
    if isinstance(choice, NamedToolChoice) and choice.function.name not in req.tool_names():
        raise RequestError(
            f"Invalid value for 'tool_choice': function '{choice.function.name}' is not "
            "one of the functions in 'tools'.",
            param="tool_choice",
            code="invalid_value",
        )


def parse_chat_request(body: bytes) -> ChatRequest:
    """Decode and check a chat-completions request body.

    Args:
        body: The raw HTTP request body.

    Returns:
        The typed request; keys IOP does not model are in ``extra_body``
        (merged over a literal ``extra_body`` object, if the client sent one).

    Raises:
        RequestError: Status 400, with OpenAI-style ``message``, ``param`` and
            ``code``, for anything that is not a valid request.
    """
    try:
        top = _TOP.decode(body)
    except msgspec.ValidationError as exc:
        raise RequestError(
            "Invalid request body: expected a JSON object.", code="invalid_type"
        ) from exc
    except msgspec.DecodeError as exc:
        raise RequestError(_INVALID_JSON, code="invalid_json") from exc
    try:
        req = _TYPED.decode(body)
    except msgspec.ValidationError as exc:
        raise _from_validation(exc) from exc
    _check(req)
    if not _KNOWN.issuperset(top):
        extra: dict[str, Any] = dict(req.extra_body or {})
        for key, raw in top.items():
            if key not in _KNOWN:
                extra[key] = msgspec.json.decode(raw)
        req = msgspec.structs.replace(req, extra_body=extra)
    return req
