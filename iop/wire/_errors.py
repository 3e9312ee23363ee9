"""Backend error bodies, normalised (sans-IO).

Backends disagree on how an error looks (docs/architecture.md, "Facts about
the backends: Error bodies"):

* vLLM >= 0.10.1: ``{"error": {"message", "type", "param", "code": <int>}}``
* vLLM <= 0.10.0, SGLang: flat ``{"object": "error", "message", "type", "code": <int>}``
* llama.cpp: ``{"error": {"code": <int>, "message", "type"}}`` (no ``param``)
* Ollama: ``{"error": {"message", "type", "param": null, "code": null}}``
* Lemonade, LM Studio: sometimes ``{"error": "<string>"}``
* anything else: plain text or HTML from a proxy.

``parse_error_body`` reduces all of them to one ``BackendErrorInfo``, and
``openai_error_code`` names the OpenAI error code it corresponds to, where
OpenAI has one (the client-facing table is in ``docs/operations.md``, "Errors
clients see"):

* ``context_length_exceeded`` with ``param: "messages"``: llama.cpp's error
  type ``exceed_context_size_error``; vLLM's and SGLang's "This model's
  maximum context length is N tokens..."; a backend that already sends
  OpenAI's code (llama-cpp-python).
* ``rate_limit_exceeded``: status 429 (OpenAI-compatible services, proxies).
* ``model_not_found``: status 404 with a message about a model (vLLM's
  "The model `x` does not exist.", Ollama's ``model "x" not found``); not
  llama.cpp's 404 "File Not Found" for an unknown path.

Anything else keeps the adapter's own code (``backend_http_error``...). A
backend 401/403 is deliberately *not* mapped to ``invalid_api_key``: it is the
node's configured credential that failed, not the client's.
"""

from __future__ import annotations

import re
from typing import Any, Final

import msgspec

from iop.errors import ErrorCode

__all__ = [
    "ERROR_EXCERPT_BYTES",
    "BackendErrorInfo",
    "OpenAIErrorCode",
    "excerpt",
    "openai_error_code",
    "parse_error_body",
    "parse_error_value",
]

# Seed 000/003 read at most 4 KiB of an error body: enough for any real
# error message, bounded against a backend that streams megabytes of HTML.
ERROR_EXCERPT_BYTES: Final = 4096


class BackendErrorInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend said went wrong.

    Attributes:
        message: The error message (or the body excerpt when unstructured).
        type: The backend's error type, if any.
        code: The backend's code as a string (OpenAI's schema wants a string).
        status: An HTTP status the backend put inside the body, if any.
    """

    message: str
    type: str | None = None
    code: str | None = None
    status: int | None = None


def excerpt(body: bytes, limit: int = ERROR_EXCERPT_BYTES) -> str:
    """Decode at most ``limit`` bytes of a body, stripped, never raising."""
    return body[:limit].decode("utf-8", errors="replace").strip()


def _as_status(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
        return value
    if isinstance(value, str) and value.isdigit() and 100 <= int(value) <= 599:
        return int(value)
    return None


def parse_error_value(value: Any) -> BackendErrorInfo | None:
    """Interpret the value of an ``error`` key (object or string)."""
    if isinstance(value, str):
        return BackendErrorInfo(message=value.strip() or "backend error")
    if not isinstance(value, dict):
        return None
    message = value.get("message")
    if not isinstance(message, str) or not message.strip():
        message = "backend error"
    code = value.get("code")
    type_ = value.get("type")
    return BackendErrorInfo(
        message=message.strip(),
        type=type_ if isinstance(type_, str) else None,
        code=None if code is None or isinstance(code, bool) else str(code),
        status=_as_status(value.get("status_code")) or _as_status(code),
    )


def parse_error_body(body: bytes) -> BackendErrorInfo:
    """Normalise a (possibly truncated) error body of any known backend shape."""
    text = excerpt(body)
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return BackendErrorInfo(message=text)
    if isinstance(obj, dict):
        if "error" in obj:
            info = parse_error_value(obj["error"])
            if info is not None:
                return info
        if obj.get("object") == "error" or "message" in obj:
            flat = parse_error_value(obj)
            if flat is not None:
                return flat
    return BackendErrorInfo(message=text)


class OpenAIErrorCode(msgspec.Struct, frozen=True):
    """An OpenAI error ``code`` (and the ``param`` OpenAI names with it)."""

    code: ErrorCode
    param: str | None = None


CONTEXT_LENGTH_EXCEEDED: Final = OpenAIErrorCode(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "messages")
RATE_LIMIT_EXCEEDED: Final = OpenAIErrorCode(ErrorCode.RATE_LIMIT_EXCEEDED)
MODEL_NOT_FOUND: Final = OpenAIErrorCode(ErrorCode.MODEL_NOT_FOUND)

# llama.cpp's error type for a prompt over the context (its
# ``format_error_response``, docs/architecture.md "Backend errors"); OpenAI's
# own code, which some servers (llama-cpp-python) already send.
_CONTEXT_TYPES: Final = frozenset({"exceed_context_size_error", ErrorCode.CONTEXT_LENGTH_EXCEEDED})
# vLLM: "This model's maximum context length is 2048 tokens. However, you
# requested ..."; SGLang words it the same way.
_CONTEXT_MESSAGE: Final = re.compile(r"maximum context length", re.IGNORECASE)
_MODEL_NOT_FOUND_MESSAGE: Final = re.compile(
    r"\bmodel\b.*\b(?:does not exist|not found)\b", re.IGNORECASE | re.DOTALL
)


def openai_error_code(info: BackendErrorInfo, status: int) -> OpenAIErrorCode | None:
    """OpenAI's code for what a backend answered with ``status``, if one fits.

    See the module docstring for the table; None means "keep our own code".
    """
    if (info.type or "").lower() in _CONTEXT_TYPES or (info.code or "") in _CONTEXT_TYPES:
        return CONTEXT_LENGTH_EXCEEDED
    if _CONTEXT_MESSAGE.search(info.message):
        return CONTEXT_LENGTH_EXCEEDED
    if status == 429:
        return RATE_LIMIT_EXCEEDED
    if status == 404 and _MODEL_NOT_FOUND_MESSAGE.search(info.message):
        return MODEL_NOT_FOUND
    return None
