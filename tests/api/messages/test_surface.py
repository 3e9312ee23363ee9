"""The Messages surface: the Surface contract, auth and headers, errors, count_tokens."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest

from iop.api import Surface
from iop.api.messages import (
    AUTH_FAILED,
    COUNT_HEADER,
    MESSAGES,
    ApiHeaders,
    anthropic_error,
    api_headers,
    api_key,
    estimate_input_tokens,
    parse_count_tokens,
)
from iop.api.messages._tokens import CHARS_PER_TOKEN, IMAGE_TOKENS, MESSAGE_TOKENS
from iop.errors import RequestError
from tests.api.messages._sdk import validate_count, validate_error

_SURFACE: Surface = MESSAGES  # the protocol, checked by mypy-style assignment and below


def test_it_is_a_surface() -> None:
    assert _SURFACE.name == "messages"
    for method in ("parse", "error_body", "stream", "collector"):
        assert callable(getattr(MESSAGES, method))


def test_parse_gives_the_call() -> None:
    body = {
        "model": "claude-x",
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": "q"}],
    }
    call = MESSAGES.parse(msgspec.json.encode(body), {"anthropic-version": "2023-06-01"})
    assert (call.stream, call.model, call.request.model, call.request.max_tokens) == (
        True,
        "claude-x",
        "claude-x",
        8,
    )


def test_parse_errors_are_request_errors_the_surface_words() -> None:
    with pytest.raises(RequestError) as info:
        MESSAGES.parse(b'{"model":"m","messages":[{"role":"user","content":"q"}]}', {})
    status, body = MESSAGES.error_body(info.value.status, info.value.message, code=info.value.code)
    assert status == 400
    assert msgspec.json.decode(body) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }


# --- auth and headers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "key"),
    [
        ({"x-api-key": "sk-1"}, "sk-1"),
        ({"X-Api-Key": "sk-1"}, "sk-1"),
        ({"Authorization": "Bearer sk-2"}, "sk-2"),
        ({"authorization": "Bearer sk-2"}, "sk-2"),
        ({"x-api-key": "sk-1", "Authorization": "Bearer sk-2"}, "sk-1"),
        ({"x-api-key": "", "Authorization": "Bearer sk-2"}, "sk-2"),
        ({"Authorization": "Basic abc"}, None),
        ({"Authorization": "Bearer "}, None),
        ({}, None),
    ],
)
def test_api_key(headers: dict[str, str], key: str | None) -> None:
    assert api_key(headers) == key


def test_auth_failure_body() -> None:
    status, body = MESSAGES.error_body(401, AUTH_FAILED, code="invalid_api_key")
    assert status == 401
    data = msgspec.json.decode(body)
    validate_error(data)
    assert data == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid x-api-key"},
    }


def test_any_version_and_beta_is_accepted() -> None:
    assert api_headers({}) == ApiHeaders()
    assert api_headers(
        {
            "anthropic-version": "2023-06-01",
            "anthropic-beta": "claude-code-20250219, interleaved-thinking-2025-05-14,,",
        }
    ) == ApiHeaders(
        version="2023-06-01",
        betas=("claude-code-20250219", "interleaved-thinking-2025-05-14"),
    )
    assert api_headers({"Anthropic-Version": "1999-01-01"}).version == "1999-01-01"


# --- the status mapping -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (400, "invalid_request_error", (400, "invalid_request_error")),
        (401, "invalid_api_key", (401, "authentication_error")),
        (403, "cross_origin", (403, "permission_error")),
        (404, "model_not_found", (404, "not_found_error")),
        (413, "request_entity_too_large", (413, "request_too_large")),
        (422, "backend_http_error", (422, "invalid_request_error")),
        (429, "queue_full", (429, "rate_limit_error")),
        (500, "internal_error", (500, "api_error")),
        (502, "backend_error", (502, "api_error")),
        (503, "no_nodes", (529, "overloaded_error")),
        (503, "draining", (529, "overloaded_error")),
        (503, "model_unavailable", (529, "overloaded_error")),
        (503, "node_lost", (529, "overloaded_error")),
        (504, "queue_timeout", (529, "overloaded_error")),
        (500, "shutdown", (529, "overloaded_error")),
        (504, "first_token_timeout", (504, "timeout_error")),
        (504, "idle_timeout", (504, "timeout_error")),
        (504, "total_timeout", (504, "timeout_error")),
        (504, "backend_timeout", (504, "timeout_error")),
        (500, "client_disconnect", (500, "api_error")),
        (500, "explicit", (500, "api_error")),
        (599, None, (500, "api_error")),
    ],
)
def test_status_mapping(status: int, code: str | None, expected: tuple[int, str]) -> None:
    assert anthropic_error(status, code) == expected
    got, body = MESSAGES.error_body(status, "m", code=code)
    assert got == expected[0]
    validate_error(msgspec.json.decode(body))


# --- count_tokens ----------------------------------------------------------------------------------


def _count(**fields: Any) -> tuple[int, bytes, dict[str, str]]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return MESSAGES.count_tokens(MESSAGES.parse_count_tokens(msgspec.json.encode(body)))


def test_count_tokens_says_it_estimated() -> None:
    status, body, headers = _count()
    assert status == 200
    validate_count(msgspec.json.decode(body))
    assert headers == {COUNT_HEADER: "estimated"}
    assert msgspec.json.decode(body) == {
        "input_tokens": math.ceil(2 / CHARS_PER_TOKEN) + MESSAGE_TOKENS
    }


def test_count_tokens_with_a_tokenizer_count_says_exact() -> None:
    request = MESSAGES.parse_count_tokens(
        b'{"model":"m","messages":[{"role":"user","content":"x"}]}'
    )
    status, body, headers = MESSAGES.count_tokens(request, exact=17)
    assert (status, body, headers) == (200, b'{"input_tokens":17}', {COUNT_HEADER: "exact"})


def test_estimate_counts_system_tools_calls_and_images_not_their_base64() -> None:
    big = "A" * 100_000
    body = {
        "model": "m",
        "system": "s" * 8,
        "tools": [{"name": "f", "description": "d" * 7, "input_schema": {"type": "object"}}],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "t" * 12},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": big},
                    },
                ],
            },
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "c", "name": "f", "input": {"a": 1}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "c", "content": "r" * 5}],
            },
        ],
    }
    _, req = parse_count_tokens(msgspec.json.encode(body))
    chars = 8 + (1 + 7 + len('{"type":"object"}')) + 12 + (1 + len('{"a":1}')) + 5
    messages = 4  # system, user, assistant, tool
    assert estimate_input_tokens(req) == (
        math.ceil(chars / CHARS_PER_TOKEN) + MESSAGE_TOKENS * messages + IMAGE_TOKENS
    )


def test_public_surface_is_explicit() -> None:
    import iop.api.messages as pkg

    for name in pkg.__all__:
        assert hasattr(pkg, name), name
        assert not name.startswith("_")
