"""Validate the sim's completions and embeddings bodies against OpenAI's schemas.

``tests/data/openai-completions-embeddings-schemas.json`` is the legacy
completions and embeddings subset of ``openai/openai-openapi``'s
``openapi.json`` (the same upstream document as the chat subset of
``tests/edge/_openai_schema.py``), stored unmodified: its ``nullable: true``
keywords are rewritten to JSON-Schema null types at load time, by the same
``rewrite_nullable``.

OpenAI's ``CreateCompletionResponse`` says streamed and non-streamed bodies
share one shape, yet declares ``finish_reason`` not nullable, while every
streamed chunk but the last carries ``"finish_reason": null`` (OpenAI's own
streams do too). ``validate_completion_chunk`` therefore validates against
that schema with only this one field made nullable.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tests.edge._openai_schema import rewrite_nullable

__all__ = ["validate_completion", "validate_completion_chunk", "validate_embeddings"]

SCHEMA_PATH = (
    Path(__file__).resolve().parent.parent / "data" / "openai-completions-embeddings-schemas.json"
)
_BASE_URI = "urn:iop:openai-completions-embeddings-schemas"


@cache
def _document() -> Any:
    return rewrite_nullable(json.loads(SCHEMA_PATH.read_text(encoding="utf-8")))


@cache
def _validator(name: str, *, stream_chunk: bool = False) -> Draft202012Validator:
    document = copy.deepcopy(_document())
    if stream_chunk:
        choice = document["components"]["schemas"][name]["properties"]["choices"]["items"]
        reason = choice["properties"]["finish_reason"]
        reason["type"] = [reason["type"], "null"]
        reason["enum"] = [*reason["enum"], None]
    resource: Resource[Any] = Resource.from_contents(document, default_specification=DRAFT202012)
    registry: Registry[Any] = Registry().with_resource(_BASE_URI, resource)
    return Draft202012Validator(
        {"$ref": f"{_BASE_URI}#/components/schemas/{name}"}, registry=registry
    )


def validate_completion(obj: Any) -> None:
    """A non-streamed ``text_completion`` body (``CreateCompletionResponse``).

    vLLM sends ``"system_fingerprint": null`` and ``"usage":
    {"prompt_tokens_details": null}`` where OpenAI's schema wants an object
    or string, or no key (a backend's deviation a gateway must normalise):
    they are dropped when null, and the rest validated (an object
    ``prompt_tokens_details``, as IOP sends with cached tokens, is OpenAI's).
    """
    obj = copy.deepcopy(obj)
    for parent, key in (
        (obj, "system_fingerprint"),
        (obj.get("usage") or {}, "prompt_tokens_details"),
    ):
        if key in parent and parent[key] is None:
            del parent[key]
    _validator("CreateCompletionResponse").validate(obj)


def validate_completion_chunk(obj: Any) -> None:
    """A streamed ``text_completion`` chunk (``finish_reason`` may be null)."""
    _validator("CreateCompletionResponse", stream_chunk=True).validate(obj)


def validate_embeddings(obj: Any) -> None:
    """An embeddings body (``CreateEmbeddingResponse``)."""
    _validator("CreateEmbeddingResponse").validate(obj)
