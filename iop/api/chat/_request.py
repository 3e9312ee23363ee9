"""Chat-completions request bodies to ``ChatRequest``, with OpenAI's 400s (sans-IO).

``parse_chat_request`` decodes a ``POST /v1/chat/completions`` body into the
typed ``iop.spec.ChatRequest`` and turns every problem into a
``RequestError`` (status 400) whose message, ``param`` and ``code`` read like
OpenAI's own (``"Invalid type for 'messages[0].content': ..."``,
``param="messages[0].content"``, ``code="invalid_type"``), so clients and
SDKs show something actionable.

Hostile input is refused before any typed decoding, in this order (each a
400, ``docs/operations.md`` "HTTP input"):

* **nesting** deeper than ``max_depth`` levels (the body object is level 1),
  measured on the raw bytes with C-speed bytes operations
  (``json_nesting_depth``). msgspec recurses on the C stack and raises
  ``RecursionError`` at Python's recursion limit, which depends on how deep
  the caller's stack already is: a body just under it on the edge could fail
  to decode on the node and take its link down. An explicit limit far below
  it makes the answer the same everywhere; the ``RecursionError`` is still
  mapped, for bodies the byte scan cannot judge (unbalanced, truncated).
* **invalid JSON**, including invalid UTF-8 inside a string, and numbers
  beyond a 64-bit float: one generic decode of the whole body, which also
  yields the values of the keys IOP does not model.
* **integers the link cannot carry**: msgpack holds integers in
  ``[-2**63, 2**64 - 1]``; one larger anywhere in the body (a known field, an
  unknown key, a tool's JSON Schema) would fail the run's ``Assign`` frame.
  The check is one msgpack encode (C); only when it fails is the value
  searched for, by bisection, so ``param`` can name it (``zz.a[1].b``).

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

import re
import typing
from itertools import accumulate
from typing import Any, Final

import msgspec

from iop.errors import RequestError
from iop.spec import ChatRequest, Message, NamedToolChoice

__all__ = ["DEFAULT_MAX_JSON_DEPTH", "json_nesting_depth", "parse_chat_request"]

# 64 levels: a chat request needs about 5 (body, messages, a message, its
# content parts, a part) plus its tools' JSON Schemas, which OpenAI's
# structured outputs cap at 10 levels of nesting (about 20 JSON levels). Far
# below Python's recursion limit (1000 frames, shared with the server's own
# stack, on the edge and on the node), half of serde_json's default of 128.
DEFAULT_MAX_JSON_DEPTH: Final = 64

# What the link's msgpack can carry (msgspec raises OverflowError beyond).
LINK_INT_MIN: Final = -(2**63)
LINK_INT_MAX: Final = 2**64 - 1

_GENERIC: Final = msgspec.json.Decoder()
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


# Bytes ops for json_nesting_depth: openers become "(", closers ")", all
# else is deleted; runs of either, once leaves are peeled.
_BRACKETS: Final = bytes.maketrans(b"[{]}", b"(())")
_NOT_BRACKETS: Final = bytes(b for b in range(256) if b not in b"[]{}")
_RUNS: Final = re.compile(rb"\(+|\)+")


def json_nesting_depth(body: bytes) -> int:
    """How deeply ``body``'s JSON nests (``{}`` is 1, a bare scalar 0).

    Exact for valid JSON; for invalid JSON, not deeper than what a decoder
    reaches before it fails, so a check on it still bounds the decoder's
    recursion. Only bytes operations run over the whole body (C speed; well
    under a second for 8 MiB of adversarial brackets, about 10 ms for a
    typical 1 MiB chat): escaped backslashes and quotes are removed, the
    text between quotes is dropped, the brackets kept. Leaf pairs ``()`` are
    then peeled while that shrinks the text much (each pass is one level),
    and the rest is walked run by run.
    """
    s = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    s = b"".join(s.split(b'"')[0::2]).translate(_BRACKETS, _NOT_BRACKETS)
    peeled = 0
    while s:
        shorter = s.replace(b"()", b"")
        if len(shorter) == len(s):
            break
        peeled += 1
        shrunk_little = len(shorter) * 8 > len(s) * 7
        s = shorter
        if shrunk_little:
            break
    if not s:
        return peeled
    rest = max(accumulate(len(r) if r[0] == ord("(") else -len(r) for r in _RUNS.findall(s)))
    return peeled + max(rest, 0)


def _too_deep(limit: int) -> RequestError:
    return RequestError(
        f"Invalid request body: JSON nested too deeply (more than {limit} levels).",
        code="json_too_deep",
    )


def _fits_link(value: object) -> bool:
    try:
        msgspec.msgpack.encode(value)
    except OverflowError:
        return False
    return True


def _first_unfit(items: list[Any]) -> int:
    """Index of the first item the link cannot carry (one is known to exist),
    by bisection: log2(n) msgpack encodes, no Python loop over the items."""
    lo, hi = 0, len(items)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits_link(items[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo


def _unfit_int(value: Any, path: str) -> tuple[str, int]:
    """The path and value of the first integer in ``value`` the link cannot carry."""
    while True:
        if isinstance(value, dict):
            keys = list(value)
            i = _first_unfit(list(value.values()))
            path, value = _join(path, str(keys[i])), value[keys[i]]
        elif isinstance(value, list):
            i = _first_unfit(value)
            path, value = f"{path}[{i}]", value[i]
        else:
            assert isinstance(value, int), value
            return path, value


def _int_out_of_range(param: str, value: int, low: float, high: float | None) -> RequestError:
    """OpenAI's error for an integer below ``low`` or above ``high``."""
    if value < low:
        kind, bound = "below minimum", f">= {_number(low)}"
        code = "integer_below_min_value"
    else:
        kind, bound = "above maximum", f"<= {_number(high or 0)}"
        code = "integer_above_max_value"
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
        kind, bound, code = "below minimum", f">= {_number(low)}", "decimal_below_min_value"
    elif high is not None and value > high:
        kind, bound, code = "above maximum", f"<= {_number(high)}", "decimal_above_max_value"
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
        _check_range("n", req.n, 1, 128)
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
    if json_nesting_depth(body) > max_depth:
        raise _too_deep(max_depth)
    try:
        top = _GENERIC.decode(body)
    except RecursionError as exc:
        raise _too_deep(max_depth) from exc
    except msgspec.ValidationError as exc:  # msgspec: "Number out of range"
        raise RequestError(
            f"Invalid request body: {exc}: numbers must fit a 64-bit float.",
            code="invalid_value",
        ) from exc
    except msgspec.DecodeError as exc:
        raise RequestError(_INVALID_JSON, code="invalid_json") from exc
    if not isinstance(top, dict):
        raise RequestError("Invalid request body: expected a JSON object.", code="invalid_type")
    if not _fits_link(top):
        param, value = _unfit_int(top, "")
        raise _int_out_of_range(param, value, LINK_INT_MIN, LINK_INT_MAX)
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
