"""Backend errors mapped onto OpenAI's error codes (iop.wire._errors.openai_error_code)."""

from __future__ import annotations

import pytest

from iop.testing import captured_exchanges
from iop.wire._errors import (
    CONTEXT_LENGTH_EXCEEDED,
    MODEL_NOT_FOUND,
    RATE_LIMIT_EXCEEDED,
    OpenAIErrorCode,
    openai_error_code,
    parse_error_body,
)


def _llamacpp_context_overflow() -> bytes:
    """The real llama.cpp (xllamacpp) 400 for a prompt over the context."""
    exchange = next(
        e
        for e in captured_exchanges("real-xllamacpp-errors.txt")
        if "req-too-long.json" in e.command
    )
    assert exchange.status == 400
    return exchange.body


def test_llamacpp_context_overflow_from_the_real_capture() -> None:
    info = parse_error_body(_llamacpp_context_overflow())
    assert info.type == "exceed_context_size_error"
    assert openai_error_code(info, 400) == OpenAIErrorCode("context_length_exceeded", "messages")


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        pytest.param(
            400,
            b'{"error":{"message":"\'max_tokens\' or \'max_completion_tokens\' is too large: 8000.'
            b" This model's maximum context length is 4096 tokens and your request has 2778 "
            b'input tokens (8000 > 4096 - 2778). None","type":"BadRequestError","param":null,'
            b'"code":400}}',
            CONTEXT_LENGTH_EXCEEDED,
            id="vllm-nested",
        ),
        pytest.param(
            400,
            b'{"object":"error","message":"This model\'s maximum context length is 2048 tokens. '
            b"However, you requested 3000 tokens (2900 in the messages, 100 in the completion)."
            b' Please reduce the length of the messages or completion.","type":"BadRequestError",'
            b'"param":null,"code":400}',
            CONTEXT_LENGTH_EXCEEDED,
            id="vllm-flat-sglang",
        ),
        pytest.param(
            400,
            b'{"error":{"message":"Requested tokens (5000) exceed context window of 4096",'
            b'"type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}',
            CONTEXT_LENGTH_EXCEEDED,
            id="llama-cpp-python-openai-wording",
        ),
        pytest.param(
            404,
            b'{"error":{"message":"The model `gpt-x` does not exist.","type":"NotFoundError",'
            b'"param":"model","code":404}}',
            MODEL_NOT_FOUND,
            id="vllm-unknown-model",
        ),
        pytest.param(
            404,
            b'{"error":{"message":"model \\"llama9\\" not found, try pulling it first",'
            b'"type":"api_error","param":null,"code":null}}',
            MODEL_NOT_FOUND,
            id="ollama-unknown-model",
        ),
        pytest.param(
            404,
            b'{"error":{"message":"File Not Found","type":"not_found_error","code":404}}',
            None,
            id="llamacpp-unknown-path",
        ),
        pytest.param(429, b"Too Many Requests", RATE_LIMIT_EXCEEDED, id="rate-limited"),
        pytest.param(
            401,
            b'{"error":{"message":"Invalid API Key","type":"authentication_error","code":401}}',
            None,
            id="node-credential-not-the-clients",
        ),
        pytest.param(
            400,
            b'{"error":{"code":400,"message":"\'messages\' is required",'
            b'"type":"invalid_request_error"}}',
            None,
            id="other-400",
        ),
        pytest.param(500, b"<html>bad gateway</html>", None, id="html-500"),
    ],
)
def test_mapping(status: int, body: bytes, expected: OpenAIErrorCode | None) -> None:
    assert openai_error_code(parse_error_body(body), status) == expected
