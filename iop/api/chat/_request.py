"""Chat-completions request bodies to ``ChatRequest``, with OpenAI's 400s (sans-IO).

``parse_chat_request`` decodes a ``POST /v1/chat/completions`` body into the
typed ``iop.spec.ChatRequest`` and turns every problem into a
``RequestError`` (status 400) whose message, ``param`` and ``code`` read like
OpenAI's own (``"Invalid type for 'messages[0].content': ..."``,
``param="messages[0].content"``, ``code="invalid_type"``), so clients and
SDKs show something actionable.

Hostile input (nesting deeper than ``max_depth``, invalid JSON or UTF-8,
numbers beyond a 64-bit float, integers the link's msgpack cannot carry) is
refused before any typed decoding by ``iop.api._json_guard.guarded_decode``,
which every surface shares (``docs/operations.md`` "HTTP input"); its one
generic decode of the whole body also yields the values of the keys IOP does
not model.

Then the typed decode (a second msgspec pass, in C), whose validation errors
read like OpenAI's. Unknown keys' values, already decoded, go into
``ChatRequest.extra_body`` so vLLM extras like ``top_k`` or
``chat_template_kwargs`` reach the backend unchecked: the backend judges its
own extensions.

Checks after decoding (OpenAI's and vLLM's validators):

* ``model`` non-blank; ``messages`` non-empty;
* the ranges OpenAI documents for its request schema (``_RANGES``):
  ``temperature`` [0, 2], ``top_p`` [0, 1], ``presence_penalty`` and
  ``frequency_penalty`` [-2, 2], ``top_logprobs`` [0, 20], ``n`` [1, 128],
  ``logit_bias`` values [-100, 100], ``max_tokens`` and
  ``max_completion_tokens`` at least 1, ``seed`` a signed 64-bit integer;
  worded as OpenAI words them (``"Invalid 'temperature': decimal above
  maximum value. Expected a value <= 2, but got 99 instead."``);
* ``stream_options`` only with ``stream: true``;
* ``n``: at least 1, and IOP returns one choice, so more than 1 is a 400;
* ``tool_choice``: ``"none"``, ``"auto"``, ``"required"`` or a named function;
  ``"required"`` or a named function need ``tools``, and the named function
  must be one of them. (``"auto"``/``"none"`` without tools are accepted:
  they ask for nothing that cannot be done.)
"""

from __future__ import annotations

import typing
from typing import Any, Final

import msgspec

from iop.api._json_guard import DEFAULT_MAX_JSON_DEPTH, guarded_decode, json_nesting_depth
from iop.api._openai_validation import from_validation, missing_parameter
from iop.errors import ErrorCode, RequestError
from iop.spec import ChatRequest, Message, NamedToolChoice

__all__ = ["DEFAULT_MAX_JSON_DEPTH", "json_nesting_depth", "parse_chat_request"]

_TYPED: Final = msgspec.json.Decoder(ChatRequest)
_KNOWN: Final = frozenset(ChatRequest.__struct_fields__)

_TOOL_CHOICES: Final = frozenset({"none", "auto", "required"})
_ROLES: Final[tuple[str, ...]] = typing.get_args(typing.get_type_hints(Message)["role"])
_PART_TYPES: Final = ("text", "image_url", "input_audio", "file", "refusal")


def _quote(items: tuple[str, ...]) -> str:
    quoted = [f"'{i}'" for i in items]
    return ", ".join(quoted[:-1]) + f", and {quoted[-1]}" if len(quoted) > 1 else quoted[0]


def _hint(param: str | None) -> str:
    """What chat's enums accept, after OpenAI's ``Invalid value: X.``."""
    last = (param or "").rsplit(".", 1)[-1]
    if last == "role":
        return f" Supported values are: {_quote(_ROLES)}."
    if last == "type" and param and ".content[" in param:
        return f" Supported values are: {_quote(_PART_TYPES)}."
    if last == "type":
        return " Supported values are: 'function'."
    return ""


def _from_validation(exc: msgspec.ValidationError) -> RequestError:
    """A RequestError worded like OpenAI's for one of msgspec's messages."""
    return from_validation(exc, hint=_hint)


def _int_out_of_range(param: str, value: int, low: float, high: float | None) -> RequestError:
    """OpenAI's error for an integer below ``low`` or above ``high``."""
    if value < low:
        kind, bound = "below minimum", f">= {_number(low)}"
        code = ErrorCode.INTEGER_BELOW_MIN_VALUE
    else:
        kind, bound = "above maximum", f"<= {_number(high or 0)}"
        code = ErrorCode.INTEGER_ABOVE_MAX_VALUE
    return RequestError(
        f"Invalid '{param}': integer {kind} value. Expected a value {bound}, "
        f"but got {value} instead.",
        param=param,
        code=code,
    )


def _number(value: float) -> str:
    """A number as a client wrote it: ``99`` rather than ``99.0``."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def _check_range(param: str, value: float | None, low: float, high: float | None) -> None:
    """OpenAI's range error for ``value`` outside ``[low, high]`` (None: unbounded)."""
    if value is None:
        return
    if isinstance(value, int) and not isinstance(value, bool):
        if value < low or (high is not None and value > high):
            raise _int_out_of_range(param, value, low, high)
        return
    if value < low:
        kind, bound, code = "below minimum", f">= {_number(low)}", ErrorCode.DECIMAL_BELOW_MIN_VALUE
    elif high is not None and value > high:
        kind, bound, code = (
            "above maximum",
            f"<= {_number(high)}",
            ErrorCode.DECIMAL_ABOVE_MAX_VALUE,
        )
    else:
        return
    raise RequestError(
        f"Invalid '{param}': decimal {kind} value. Expected a value {bound}, "
        f"but got {_number(value)} instead.",
        param=param,
        code=code,
    )


_INT64: Final = (-(2**63), 2**63 - 1)

# (field, minimum, maximum or None): OpenAI's documented ranges
# (docs/operations.md, "HTTP input").
_RANGES: Final[tuple[tuple[str, float, float | None], ...]] = (
    ("temperature", 0, 2),
    ("top_p", 0, 1),
    ("presence_penalty", -2, 2),
    ("frequency_penalty", -2, 2),
    ("top_logprobs", 0, 20),
    ("max_tokens", 1, None),
    ("max_completion_tokens", 1, None),
    ("seed", *_INT64),
)


def _check_ranges(req: ChatRequest) -> None:
    for name, low, high in _RANGES:
        _check_range(name, getattr(req, name), low, high)
    for token, bias in (req.logit_bias or {}).items():
        _check_range(f"logit_bias.{token}", bias, -100, 100)


def _check(req: ChatRequest) -> None:
    """The checks msgspec's types cannot express (module docstring)."""
    _check_ranges(req)
    if not req.model.strip():
        raise missing_parameter("model")
    if not req.messages:
        raise RequestError(
            "Invalid 'messages': empty array. Expected an array with minimum length 1, "
            "but got an empty array instead.",
            param="messages",
            code=ErrorCode.EMPTY_ARRAY,
        )
    if req.stream_options is not None and not req.stream:
        raise RequestError(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
            code=ErrorCode.INVALID_VALUE,
        )
    if req.n is not None:
        _check_range("n", req.n, 1, 128)
        if req.n > 1:
            raise RequestError(
                f"Invalid 'n': only one choice per request is supported, but got {req.n}.",
                param="n",
                code=ErrorCode.UNSUPPORTED_VALUE,
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
                code=ErrorCode.INVALID_VALUE,
            )
        if choice != "required":
            return
    if not req.tools:
        raise RequestError(
            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' "
            "are specified.",
            param="tool_choice",
            code=ErrorCode.INVALID_VALUE,
        )
    if isinstance(choice, NamedToolChoice) and choice.function.name not in req.tool_names():
        raise RequestError(
            f"Invalid value for 'tool_choice': function '{choice.function.name}' is not "
            "one of the functions in 'tools'.",
            param="tool_choice",
            code=ErrorCode.INVALID_VALUE,
        )


def parse_chat_request(body: bytes, *, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> ChatRequest:
    """Decode and check a chat-completions request body.

    Args:
        body: The raw HTTP request body.
        max_depth: Deepest JSON nesting accepted (``server.max_json_depth``).

    Returns:
        The typed request; keys IOP does not model are in ``extra_body``
        (merged over a literal ``extra_body`` object, if the client sent one).

    Raises:
        RequestError: Status 400, with OpenAI-style ``message``, ``param`` and
            ``code``, for anything that is not a valid request.
    """
    top = guarded_decode(body, max_depth=max_depth)
    try:
        req = _TYPED.decode(body)
    except msgspec.ValidationError as exc:
        raise _from_validation(exc) from exc
    _check(req)
    if not _KNOWN.issuperset(top):
        extra: dict[str, Any] = dict(req.extra_body or {})
        extra.update((key, value) for key, value in top.items() if key not in _KNOWN)
        req = msgspec.structs.replace(req, extra_body=extra)
    return req
