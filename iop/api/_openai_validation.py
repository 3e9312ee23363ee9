"""msgspec's validation errors, worded like OpenAI's 400s (sans-IO).

Every OpenAI-shaped surface (chat, Responses, completions, embeddings)
decodes its body into typed structs with msgspec; a body of the wrong shape
raises ``msgspec.ValidationError`` with one of a few messages
(``msgspec/_core.c``), each optionally followed by `` - at `$.path` ``.
``from_validation`` turns one into the ``RequestError`` OpenAI would send
(``"Invalid type for 'messages[0].content': expected a string, but got an
integer instead."``, ``param="messages[0].content"``, ``code="invalid_type"``),
so clients and SDKs show something actionable. A surface adds what it knows
about its own enums through ``hint`` ("Supported values are: ...").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Final

import msgspec

from iop.errors import ErrorCode, RequestError

__all__ = ["Hint", "from_validation", "missing_parameter", "type_phrase"]

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

Hint = Callable[[str | None], str]
"""What a surface adds after ``Invalid value: X.`` for the parameter at fault
(e.g. ``" Supported values are: 'auto', 'disabled'."``), or ``""``."""


def type_phrase(spec: str) -> str:
    """msgspec's ``str | null`` as OpenAI's ``one of a string or null``."""
    names = [_TYPE_NAMES.get(n.strip(), n.strip()) for n in spec.split("|")]
    if len(names) == 1:
        return names[0]
    return "one of " + ", ".join(names[:-1]) + " or " + names[-1]


def _param(prefix: str, path: str) -> str | None:
    """msgspec's ``$.messages[0].role`` path as OpenAI's ``messages[0].role``,
    under ``prefix`` (the path of a value converted on its own, ``input[2]``)."""
    path = path.removeprefix(".")
    if path.startswith("["):
        return prefix + path
    if prefix and path:
        return f"{prefix}.{path}"
    return prefix or path or None


def missing_parameter(param: str) -> RequestError:
    """OpenAI's 400 for a required parameter that is absent (or empty)."""
    return RequestError(
        f"Missing required parameter: '{param}'.",
        param=param,
        code=ErrorCode.MISSING_REQUIRED_PARAMETER,
    )


def from_validation(
    exc: msgspec.ValidationError, *, prefix: str = "", hint: Hint | None = None
) -> RequestError:
    """A 400 worded like OpenAI's for one of msgspec's messages, ``param`` set.

    Args:
        exc: msgspec's error.
        prefix: The path of the value that was converted, when it is not the body.
        hint: The surface's words on an enum value it refused.
    """
    m = _AT.match(str(exc))
    assert m is not None  # the pattern matches any string
    msg, param = m["msg"], _param(prefix, m["path"] or "")
    if missing := _MISSING.match(msg):
        param = f"{param}.{missing['field']}" if param else missing["field"]
        return missing_parameter(param)
    where = f" for '{param}'" if param else ""
    if wrong := _TYPE.match(msg):
        expected = type_phrase(wrong["expected"]) + wrong["rest"]
        got = _TYPE_NAMES.get(wrong["got"], wrong["got"])
        return RequestError(
            f"Invalid type{where}: expected {expected}, but got {got} instead.",
            param=param,
            code=ErrorCode.INVALID_TYPE,
        )
    if bad := _VALUE.match(msg):
        text = f"Invalid value: {bad['value']}." + (hint(param) if hint else "")
        return RequestError(text, param=param, code=ErrorCode.INVALID_VALUE)
    return RequestError(f"Invalid value{where}: {msg}.", param=param, code=ErrorCode.INVALID_VALUE)
