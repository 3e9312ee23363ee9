"""Body-level guards every API surface runs before it reads a field (sans-IO).

``guarded_decode`` is the first thing each surface's parser does with a
request body (chat, Responses, Messages and count_tokens; the completions
and embeddings surfaces call it the same way). It refuses, each as a 400
``RequestError`` in the calling surface's wording (``Style``), in this order
(``docs/api.md``, "Input guards (every surface)"):

* **nesting** deeper than ``max_depth`` levels (the body object is level 1;
  ``server.max_json_depth``), measured on the raw bytes with C-speed bytes
  operations (:func:`json_nesting_depth`). msgspec recurses on the C stack
  and raises ``RecursionError`` at Python's recursion limit, which depends
  on how deep the caller's stack already is: a body just under it on the
  edge could fail to decode on the node and take its link down. An explicit
  limit far below it makes the answer the same everywhere; the
  ``RecursionError`` is still mapped, for bodies the byte scan cannot judge
  (unbalanced, truncated). Code ``json_too_deep``.
* **invalid JSON**, including invalid UTF-8 anywhere (a string of a key the
  surface ignores included) and truncated bodies: one generic decode of the
  whole body, which also yields the values of the keys the surface does not
  model. Code ``invalid_json``.
* **numbers beyond a 64-bit float** (``1e999``): code ``invalid_value``.
* **not an object** (``[]``, ``"x"``, ``null``): code ``invalid_type``.
* **integers the link cannot carry**: msgpack holds integers in
  ``[-2**63, 2**64 - 1]`` (:data:`LINK_INT_MIN`, :data:`LINK_INT_MAX`); one
  beyond anywhere in the body (a known field, an unknown key, a tool's JSON
  Schema) would fail the run's ``Assign`` frame with an ``OverflowError``.
  The check is one msgpack encode (C); only when it fails is the value
  searched for, by bisection, so ``param`` names it (``zz.a[1].b`` for
  OpenAI, ``zz.a.1.b`` for Anthropic). Codes ``integer_above_max_value`` /
  ``integer_below_min_value``.

What passes is a JSON object whose every value the link can carry, nested at
most ``max_depth`` deep: the surface's typed decode of the same bytes can
then fail only with a ``msgspec.ValidationError`` (a wrong type or value).
"""

from __future__ import annotations

import enum
import re
from itertools import accumulate
from typing import Any, Final

import msgspec

from iop.errors import ErrorCode, RequestError

__all__ = [
    "DEFAULT_MAX_JSON_DEPTH",
    "LINK_INT_MAX",
    "LINK_INT_MIN",
    "Style",
    "guarded_decode",
    "json_nesting_depth",
]

# 64 levels: a chat request needs about 5 (body, messages, a message, its
# content parts, a part) plus its tools' JSON Schemas, which OpenAI's
# structured outputs cap at 10 levels of nesting (about 20 JSON levels);
# Responses and Messages bodies nest the same way. Far below Python's
# recursion limit (1000 frames, shared with the server's own stack, on the
# edge and on the node), half of serde_json's default of 128.
DEFAULT_MAX_JSON_DEPTH: Final = 64

# What the link's msgpack can carry (msgspec raises OverflowError beyond).
LINK_INT_MIN: Final = -(2**63)
LINK_INT_MAX: Final = 2**64 - 1

_GENERIC: Final = msgspec.json.Decoder()

_OPENAI_INVALID_JSON: Final = (
    "We could not parse the JSON body of your request. (HINT: This likely means you aren't "
    "using your HTTP library correctly. The API expects a JSON payload, but what was sent "
    "was not valid JSON.)"
)
_ANTHROPIC_INVALID_JSON: Final = "There was an error parsing the body of your request as JSON."


class Style(enum.Enum):
    """Whose wording the guard's errors take.

    ``OPENAI``: OpenAI's messages, ``param`` as ``a.b[1].c``. ``ANTHROPIC``:
    pydantic-style ``"a.b.1.c: <what>"`` messages, as Anthropic's validation
    errors read, ``param`` as ``a.b.1.c``.
    """

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


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


def _fail(
    style: Style, param: str | None, openai: str, anthropic: str, code: ErrorCode
) -> RequestError:
    if style is Style.OPENAI:
        return RequestError(openai, param=param, code=code)
    return RequestError(f"{param}: {anthropic}" if param else anthropic, param=param, code=code)


def _too_deep(limit: int, style: Style) -> RequestError:
    return _fail(
        style,
        None,
        f"Invalid request body: JSON nested too deeply (more than {limit} levels).",
        f"Request body nested too deeply (more than {limit} levels of JSON)",
        ErrorCode.JSON_TOO_DEEP,
    )


def fits_link(value: object) -> bool:
    """Whether msgpack (the node link) can carry every integer in ``value``."""
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
        if fits_link(items[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo


def _unfit_int(value: Any, style: Style) -> tuple[str, int]:
    """The path and value of the first integer in ``value`` the link cannot carry."""
    path = ""
    while True:
        if isinstance(value, dict):
            keys = list(value)
            i = _first_unfit(list(value.values()))
            key = str(keys[i])
            path, value = (f"{path}.{key}" if path else key), value[keys[i]]
        elif isinstance(value, list):
            i = _first_unfit(value)
            path = f"{path}[{i}]" if style is Style.OPENAI else f"{path}.{i}"
            value = value[i]
        else:
            assert isinstance(value, int), value
            return path, value


def _unfit(top: dict[str, Any], style: Style) -> RequestError:
    param, value = _unfit_int(top, style)
    if value < LINK_INT_MIN:
        kind, bound, code = "below minimum", f">= {LINK_INT_MIN}", ErrorCode.INTEGER_BELOW_MIN_VALUE
        anthropic = f"Input should be greater than or equal to {LINK_INT_MIN}"
    else:
        kind, bound, code = "above maximum", f"<= {LINK_INT_MAX}", ErrorCode.INTEGER_ABOVE_MAX_VALUE
        anthropic = f"Input should be less than or equal to {LINK_INT_MAX}"
    return _fail(
        style,
        param,
        f"Invalid '{param}': integer {kind} value. Expected a value {bound}, "
        f"but got {value} instead.",
        anthropic,
        code,
    )


def guarded_decode(
    body: bytes, *, max_depth: int = DEFAULT_MAX_JSON_DEPTH, style: Style = Style.OPENAI
) -> dict[str, Any]:
    """The body as a JSON object, after every guard of the module docstring.

    Args:
        body: The raw HTTP request body.
        max_depth: Deepest JSON nesting accepted (``server.max_json_depth``).
        style: Whose wording the errors take.

    Returns:
        The whole body, decoded generically (the values of keys the surface
        does not model are taken from here).

    Raises:
        RequestError: 400, with ``code`` and, for an integer, ``param``.
    """
    if json_nesting_depth(body) > max_depth:
        raise _too_deep(max_depth, style)
    try:
        top = _GENERIC.decode(body)
    except RecursionError as exc:
        raise _too_deep(max_depth, style) from exc
    except msgspec.ValidationError as exc:  # msgspec: "Number out of range"
        raise _fail(
            style,
            None,
            f"Invalid request body: {exc}: numbers must fit a 64-bit float.",
            f"{exc}: numbers must fit a 64-bit float",
            ErrorCode.INVALID_VALUE,
        ) from exc
    except msgspec.DecodeError as exc:
        raise _fail(
            style, None, _OPENAI_INVALID_JSON, _ANTHROPIC_INVALID_JSON, ErrorCode.INVALID_JSON
        ) from exc
    if not isinstance(top, dict):
        raise _fail(
            style,
            None,
            "Invalid request body: expected a JSON object.",
            "Input should be a valid dictionary",
            ErrorCode.INVALID_TYPE,
        )
    if not fits_link(top):
        raise _unfit(top, style)
    return top
