"""Validate IOP's output against OpenAI's own OpenAPI schemas (test helper).

``tests/data/openai-chat-schemas.json`` is the chat-completion subset of
``openai/openai-openapi``'s ``openapi.json`` (OpenAPI 3.1.0, info.version
2.3.0). OpenAPI 3.1 *is* JSON Schema 2020-12, except that the upstream
document still uses the OpenAPI-3.0 keyword ``nullable: true`` in 111 places,
which JSON Schema ignores: validated raw, every chunk with
``"finish_reason": null`` fails (docs/testing.md, "OpenAI's schemas").
``rewrite_nullable`` turns that keyword into real null types:

* next to ``type``: ``"null"`` is added to the type (and ``None`` to an
  ``enum``, if there is one, since an enum constrains the value too);
* anywhere else (``$ref``, ``allOf``, ...): the schema becomes
  ``{"anyOf": [<schema without nullable>, {"type": "null"}]}``.

The stored subset is already rewritten (its ``$comment`` says so), so the
rewrite is a no-op on it today; it runs anyway, so a fresh copy of the
upstream document can be dropped in unchanged.

Usage (also from the end-to-end tests)::

    from _openai_schema import validate_chunk   # however the test imports it
    validate_chunk(json.loads(event.data))      # raises jsonschema.ValidationError
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

__all__ = [
    "SCHEMA_PATH",
    "rewrite_nullable",
    "validate_chunk",
    "validate_completion",
    "validate_error",
    "validator",
]

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "data" / "openai-chat-schemas.json"
_BASE_URI = "urn:iop:openai-chat-schemas"


def rewrite_nullable(node: Any) -> Any:
    """A copy of ``node`` with every ``nullable: true`` made a JSON-Schema null type."""
    if isinstance(node, list):
        return [rewrite_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: rewrite_nullable(value) for key, value in node.items()}
    nullable = out.pop("nullable", False)
    if nullable is not True:
        return out
    if "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        if "null" not in types:
            out["type"] = [*types, "null"]
        if "enum" in out and None not in out["enum"]:
            out["enum"] = [*out["enum"], None]
        return out
    return {"anyOf": [out, {"type": "null"}]}


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


def validate_chunk(obj: Any) -> None:
    """Validate one ``chat.completion.chunk`` (``CreateChatCompletionStreamResponse``)."""
    validator("CreateChatCompletionStreamResponse").validate(obj)


def validate_completion(obj: Any) -> None:
    """Validate one ``chat.completion`` body (``CreateChatCompletionResponse``)."""
    validator("CreateChatCompletionResponse").validate(obj)


def validate_error(obj: Any) -> None:
    """Validate one error body (``ErrorResponse``)."""
    validator("ErrorResponse").validate(obj)
