"""Anthropic's wire format, checked with the official ``anthropic`` SDK's own types.

The SDK's pydantic models allow extra fields; "strict" here means: validated
with ``strict=True`` (no coercion) AND no model anywhere in the result holds
a field the SDK does not declare. So a misspelt or invented field fails.
"""

from __future__ import annotations

import json
from typing import Any

import pydantic
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse

_EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)

# Anthropic documents 413 ``request_too_large``, which this SDK's ErrorObject
# union does not list (its client maps errors by status, so it still raises
# ContentTooLargeError).
_UNLISTED_ERROR_TYPES = {"request_too_large"}


def _no_extras(model: object, where: str = "$") -> None:
    if isinstance(model, pydantic.BaseModel):
        extra = model.model_extra or {}
        assert not extra, f"fields the SDK does not know at {where}: {sorted(extra)}"
        for name in type(model).model_fields:
            _no_extras(getattr(model, name), f"{where}.{name}")
    elif isinstance(model, list):
        for i, item in enumerate(model):
            _no_extras(item, f"{where}[{i}]")


def validate_event(name: str, data: dict[str, Any]) -> None:
    """One SSE event: its ``event:`` name matches its ``type``, and the SDK accepts it."""
    assert data.get("type") == name, f"event: {name} carries type {data.get('type')}"
    if name == "ping":
        assert data == {"type": "ping"}
        return
    if name == "error":
        validate_error(data)
        return
    _no_extras(_EVENT.validate_python(data, strict=True))


def validate_message(data: dict[str, Any]) -> Message:
    message = Message.model_validate(data, strict=True)
    _no_extras(message)
    return message


def validate_error(data: dict[str, Any]) -> None:
    if data.get("error", {}).get("type") in _UNLISTED_ERROR_TYPES:
        assert set(data) <= {"type", "error", "request_id"}
        assert set(data["error"]) == {"type", "message"}
        return
    _no_extras(ErrorResponse.model_validate(data, strict=True))


def validate_count(data: dict[str, Any]) -> None:
    _no_extras(MessageTokensCount.model_validate(data, strict=True))


def parse_sse(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """``(event name, data)`` of every event; every event must have both lines."""
    assert raw.endswith(b"\n\n"), raw[-40:]
    events = []
    for block in raw.decode().split("\n\n")[:-1]:
        lines = block.split("\n")
        assert len(lines) == 2, block
        assert lines[0].startswith("event: "), block
        assert lines[1].startswith("data: "), block
        events.append((lines[0][7:], json.loads(lines[1][6:])))
    return events
