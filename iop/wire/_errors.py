"""Backend error bodies, normalised (sans-IO).

Backends disagree on how an error looks (protocols.md §0.7, §3.6):

* vLLM >= 0.10.1: ``{"error": {"message", "type", "param", "code": <int>}}``
* vLLM <= 0.10.0, SGLang: flat ``{"object": "error", "message", "type", "code": <int>}``
* llama.cpp: ``{"error": {"code": <int>, "message", "type"}}`` (no ``param``)
* Ollama: ``{"error": {"message", "type", "param": null, "code": null}}``
* Lemonade, LM Studio: sometimes ``{"error": "<string>"}``
* anything else: plain text or HTML from a proxy.

``parse_error_body`` reduces all of them to one ``BackendErrorInfo``.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

__all__ = [
    "ERROR_EXCERPT_BYTES",
    "BackendErrorInfo",
    "excerpt",
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
