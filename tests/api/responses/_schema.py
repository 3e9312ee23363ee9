"""Validate Responses output against OpenAI's own schemas (test helper).

``tests/data/openai-schemas.json`` is the subset of ``openai/openai-openapi``
(chat, responses, completions, embeddings, models, errors; its ``info``
names the commit). It is loaded as JSON Schema 2020-12 with
``rewrite_nullable`` applied (``tests/edge/_openai_schema.py`` explains why),
so a fresh upstream copy can be dropped in unchanged.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any, Final

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tests.edge._openai_schema import rewrite_nullable

__all__ = ["SCHEMA_PATH", "validate_error", "validate_event", "validate_response", "validator"]

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "data" / "openai-schemas.json"
_BASE_URI = "urn:iop:openai-schemas"

# Each stream event type and its schema (the members of ResponseStreamEvent).
_EVENT_SCHEMAS = {
    "response.created": "ResponseCreatedEvent",
    "response.in_progress": "ResponseInProgressEvent",
    "response.completed": "ResponseCompletedEvent",
    "response.incomplete": "ResponseIncompleteEvent",
    "response.failed": "ResponseFailedEvent",
    "response.output_item.added": "ResponseOutputItemAddedEvent",
    "response.output_item.done": "ResponseOutputItemDoneEvent",
    "response.content_part.added": "ResponseContentPartAddedEvent",
    "response.content_part.done": "ResponseContentPartDoneEvent",
    "response.output_text.delta": "ResponseTextDeltaEvent",
    "response.output_text.done": "ResponseTextDoneEvent",
    "response.reasoning_text.delta": "ResponseReasoningTextDeltaEvent",
    "response.reasoning_text.done": "ResponseReasoningTextDoneEvent",
    "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaEvent",
    "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneEvent",
    "response.custom_tool_call_input.delta": "ResponseCustomToolCallInputDeltaEvent",
    "response.custom_tool_call_input.done": "ResponseCustomToolCallInputDoneEvent",
    "error": "ResponseErrorEvent",
}


@cache
def _registry() -> Registry[Any]:
    document = rewrite_nullable(json.loads(SCHEMA_PATH.read_text(encoding="utf-8")))
    resource: Resource[Any] = Resource.from_contents(document, default_specification=DRAFT202012)
    registry: Registry[Any] = Registry().with_resource(_BASE_URI, resource)
    return registry


@cache
def validator(name: str) -> Draft202012Validator:
    """A validator for ``#/components/schemas/<name>``."""
    schema = {"$ref": f"{_BASE_URI}#/components/schemas/{name}"}
    return Draft202012Validator(schema, registry=_registry())


# OpenAI's keep-alive on long streams, absent from its schema (docs/api.md):
# exactly these two keys.
_KEEPALIVE_EVENT: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "type": {"const": "keepalive"},
        "sequence_number": {"type": "integer", "minimum": 0},
    },
    "required": ["type", "sequence_number"],
    "additionalProperties": False,
}


def validate_event(obj: Any) -> None:
    """Validate one stream event: by its own schema, and as a ``ResponseStreamEvent``
    (a ``keepalive`` event, which OpenAI's schema leaves out, by its known shape)."""
    if obj.get("type") == "keepalive":
        Draft202012Validator(_KEEPALIVE_EVENT).validate(obj)
        return
    validator(_EVENT_SCHEMAS[obj["type"]]).validate(obj)
    validator("ResponseStreamEvent").validate(obj)


def validate_response(obj: Any) -> None:
    """Validate one ``Response`` object."""
    validator("Response").validate(obj)


def validate_error(obj: Any) -> None:
    """Validate one error body (``ErrorResponse``)."""
    validator("ErrorResponse").validate(obj)
