"""The body-level input guards (``iop.api._json_guard``) hold on every surface:
the same hostile body gets the same 400 (code, and ``param`` for an integer)
from chat, Responses, Messages and count_tokens, each in its own error shape,
and nothing a parser accepts fails the node link's msgpack."""

from __future__ import annotations

import json
from collections.abc import Callable

import msgspec
import pytest

from iop.api import ChatSurface, MessagesSurface, ResponsesSurface
from iop.api._json_guard import (
    DEFAULT_MAX_JSON_DEPTH,
    LINK_INT_MAX,
    LINK_INT_MIN,
    Style,
    guarded_decode,
    json_nesting_depth,
)
from iop.config import ResponsesSettings
from iop.errors import RequestError
from iop.spec import ExecutionSpec
from tests.api.messages._sdk import validate_error as validate_anthropic_error
from tests.api.responses._schema import validate_error as validate_openai_error

# name -> (a valid body to splice into, the parser, how an error validates)
Parse = Callable[[bytes], object]

_CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}]'
_RESPONSES = b'{"model":"m","input":"hi"'
_MESSAGES = b'{"model":"m","max_tokens":16,"messages":[{"role":"user","content":"hi"}]'


def _responses(max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> ResponsesSurface:
    return ResponsesSurface.from_settings(ResponsesSettings(), max_depth=max_depth)


def _openai_body(surface: ChatSurface | ResponsesSurface, exc: RequestError) -> None:
    status, body = surface.error_body(exc.status, exc.message, code=exc.code, param=exc.param)
    assert status == 400
    validate_openai_error(json.loads(body))
    assert json.loads(body)["error"]["code"] == exc.code


def _anthropic_body(exc: RequestError) -> None:
    status, body = MessagesSurface().error_body(exc.status, exc.message, code=exc.code)
    assert status == 400
    validate_anthropic_error(json.loads(body))
    assert json.loads(body)["error"]["type"] == "invalid_request_error"


def _parse(surface: str, body: bytes, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> object:
    if surface == "chat":
        return ChatSurface(max_depth=max_depth).parse(body, {})
    if surface == "responses":
        return _responses(max_depth).parse(body, {})
    if surface == "messages":
        return MessagesSurface(max_depth=max_depth).parse(body, {})
    return MessagesSurface(max_depth=max_depth).parse_count_tokens(body)


def _head(surface: str) -> bytes:
    return {"chat": _CHAT, "responses": _RESPONSES}.get(surface, _MESSAGES)


def _refused(surface: str, body: bytes, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> RequestError:
    with pytest.raises(RequestError) as info:
        _parse(surface, body, max_depth)
    exc = info.value
    assert exc.status == 400
    if surface in ("chat", "responses"):
        _openai_body(ChatSurface() if surface == "chat" else _responses(), exc)
    else:
        _anthropic_body(exc)
    return exc


SURFACES = ["chat", "responses", "messages", "count_tokens"]


def _deep(levels: int) -> bytes:
    return b"[" * levels + b"1" + b"]" * levels


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize(
    ("tail", "code"),
    [
        (b',"zz":' + _deep(64) + b"}", "json_too_deep"),  # 65 levels with the body
        (b',"zz":' + _deep(100_000) + b"}", "json_too_deep"),
        (b',"zz":' + b"[" * 100_000, "json_too_deep"),  # unbalanced: the decoder's limit
        (b',"zz":"\xff"}', "invalid_json"),  # invalid UTF-8 in a key nobody reads
        (b',"zz":"\xed\xa0\x80"}', "invalid_json"),  # an encoded surrogate
        (b',"zz":1e999}', "invalid_value"),
        (b',"zz":', "invalid_json"),  # truncated
        (b"}}", "invalid_json"),
    ],
)
def test_every_surface_refuses_a_hostile_body_with_the_same_code(
    surface: str, tail: bytes, code: str
) -> None:
    assert _refused(surface, _head(surface) + tail).code == code


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize("body", [b"[]", b'"x"', b"null", b"1"])
def test_every_surface_wants_an_object(surface: str, body: bytes) -> None:
    assert _refused(surface, body).code == "invalid_type"


# Integers one past what msgpack carries: in a key the surface ignores, and
# in a field it reads as an integer.
@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize(
    ("value", "code"),
    [(LINK_INT_MAX + 1, "integer_above_max_value"), (LINK_INT_MIN - 1, "integer_below_min_value")],
)
def test_every_surface_refuses_an_integer_the_link_cannot_carry(
    surface: str, value: int, code: str
) -> None:
    body = _head(surface) + b',"zz":{"a":[0,%d]}}' % value
    exc = _refused(surface, body)
    assert exc.code == code
    style_param = "zz.a[1]" if surface in ("chat", "responses") else "zz.a.1"
    assert exc.param == style_param
    assert str(value) in exc.message or surface in ("messages", "count_tokens")


@pytest.mark.parametrize(
    ("surface", "field"),
    [
        ("responses", "max_output_tokens"),
        ("responses", "temperature"),
        ("messages", "max_tokens"),
        ("messages", "top_k"),
        ("count_tokens", "top_k"),
    ],
)
def test_a_huge_integer_in_a_known_field_is_a_400_not_an_overflow(surface: str, field: str) -> None:
    """Before the guard, these parsed and then failed the run's Assign (OverflowError)."""
    obj = json.loads(_head(surface) + b"}")
    obj[field] = 2**64
    exc = _refused(surface, json.dumps(obj).encode())
    assert exc.code == "integer_above_max_value"
    assert exc.param == field


@pytest.mark.parametrize("surface", SURFACES)
def test_max_depth_is_each_surfaces_own_limit(surface: str) -> None:
    body = _head(surface) + b',"zz":[[[1]]]}'  # 4 levels
    assert json_nesting_depth(body) == 4
    _parse(surface, body, max_depth=4)
    exc = _refused(surface, body, max_depth=3)
    assert exc.code == "json_too_deep"
    assert "more than 3 levels" in exc.message


@pytest.mark.parametrize("surface", SURFACES)
def test_what_a_surface_accepts_fits_the_link(surface: str) -> None:
    body = _head(surface) + b',"zz":{"a":[%d,%d,1.5e308,"\\u00e9"]}}' % (LINK_INT_MAX, LINK_INT_MIN)
    parsed = _parse(surface, body)
    request = getattr(parsed, "request", parsed)
    msgspec.msgpack.encode(ExecutionSpec(run_id="r", request=request))  # type: ignore[arg-type]


def test_anthropic_wording_is_a_dotted_path_then_what() -> None:
    with pytest.raises(RequestError) as info:
        guarded_decode(b'{"a":[{"b":%d}]}' % 2**70, style=Style.ANTHROPIC)
    assert info.value.message == f"a.0.b: Input should be less than or equal to {LINK_INT_MAX}"
    with pytest.raises(RequestError) as info:
        guarded_decode(b"{", style=Style.ANTHROPIC)
    assert info.value.message == "There was an error parsing the body of your request as JSON."


def test_openai_wording_names_the_value_and_the_bound() -> None:
    with pytest.raises(RequestError) as info:
        guarded_decode(b'{"a":[{"b":%d}]}' % -(2**70))
    assert info.value.message == (
        f"Invalid 'a[0].b': integer below minimum value. Expected a value >= {LINK_INT_MIN}, "
        f"but got {-(2**70)} instead."
    )
