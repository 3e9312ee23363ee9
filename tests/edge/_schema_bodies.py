"""Hypothesis strategies for request bodies of every surface: what the API's
request schema describes, and hostile mutations of them (test helper).

``schema_value`` draws a value for a JSON Schema of the subset OpenAI's
document uses (``$ref``, ``type`` and type lists, ``enum``, ``properties`` /
``required`` / ``additionalProperties``, ``items`` / ``minItems`` /
``maxItems``, ``anyOf`` / ``oneOf`` / ``allOf``, ``minimum`` / ``maximum``,
``maxLength``). It is a small generator rather than ``hypothesis-jsonschema``,
whose 0.23.1 fails on current hypothesis (``'many' object has no attribute
'more'``). Values are close to valid, not certified valid (``oneOf`` is
drawn as ``anyOf``, ``allOf`` objects are merged): the property under test
is "never a 5xx", not "always a 200".

``chat_bodies``, ``responses_bodies`` (OpenAI's ``CreateResponse``) and
``messages_bodies`` (Anthropic's Messages request, hand-described: Anthropic
publishes no schema) draw whole request bodies as bytes: a schema-described
request (``model`` pinned to the served one most of the time, so runs start),
or one mutated by deep nesting, an integer beyond 64 bits, a value of the
wrong type, invalid UTF-8 in a string, or truncation.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import strategies as st

from tests.edge._openai_schema import SCHEMA_PATH, rewrite_nullable

__all__ = [
    "Body",
    "Schemas",
    "chat_bodies",
    "messages_bodies",
    "messages_objects",
    "mutated",
    "request_objects",
    "responses_bodies",
    "responses_objects",
    "schema_value",
]

_DOC = rewrite_nullable(json.loads(SCHEMA_PATH.read_text(encoding="utf-8")))
_SCHEMAS: dict[str, Any] = _DOC["components"]["schemas"]
_MAX_REF_DEPTH = 6  # recursive refs (a schema's own sub-schemas) stop here

_text = st.text(max_size=12)
_json_scalar = st.none() | st.booleans() | st.integers(-1000, 1000) | st.floats(-1e6, 1e6) | _text
_json_value = st.recursive(
    _json_scalar,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=6,
)


Schemas = dict[str, Any]
"""A document's ``components.schemas``, where ``$ref`` s resolve."""


def _resolve(schema: dict[str, Any], schemas: Schemas) -> dict[str, Any]:
    name = schema["$ref"].rsplit("/", 1)[-1]
    resolved: dict[str, Any] = schemas[name]
    return resolved


def _merge_all_of(schema: dict[str, Any], schemas: Schemas) -> dict[str, Any]:
    merged: dict[str, Any] = {"type": "object", "properties": {}, "required": []}
    for part in schema["allOf"]:
        part = _resolve(part, schemas) if "$ref" in part else part
        if "allOf" in part:
            part = _merge_all_of(part, schemas)
        merged["properties"].update(part.get("properties", {}))
        merged["required"] += part.get("required", [])
    return merged


def _number(schema: dict[str, Any], integer: bool) -> st.SearchStrategy[Any]:
    low, high = schema.get("minimum"), schema.get("maximum")
    if integer:
        lo = int(low) if low is not None else -(2**31)
        hi = int(high) if high is not None else 2**31
        return st.integers(max(lo, -(2**63)), min(hi, 2**63 - 1))
    return st.floats(low, high, allow_nan=False, allow_infinity=False)


def schema_value(
    schema: dict[str, Any], depth: int = 0, schemas: Schemas | None = None
) -> st.SearchStrategy[Any]:
    """A strategy for values of ``schema`` (module docstring), its ``$ref`` s
    resolved in ``schemas`` (the chat document's when None)."""
    schemas = _SCHEMAS if schemas is None else schemas
    if "$ref" in schema:
        if depth >= _MAX_REF_DEPTH:
            return _json_scalar
        found = _resolve(schema, schemas)
        return st.deferred(lambda: schema_value(found, depth + 1, schemas))
    if "allOf" in schema:
        return schema_value(_merge_all_of(schema, schemas), depth, schemas)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([schema_value(s, depth, schemas) for s in schema[key]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    types = schema.get("type")
    if types is None:
        return _json_value
    if isinstance(types, list):
        return st.one_of([schema_value({**schema, "type": t}, depth, schemas) for t in types])
    if types == "null":
        return st.none()
    if types == "boolean":
        return st.booleans()
    if types in ("integer", "number"):
        return _number(schema, types == "integer")
    if types == "string":
        return st.text(max_size=min(schema.get("maxLength", 24), 24))
    if types == "array":
        low = schema.get("minItems", 0)
        high = max(low, min(schema.get("maxItems", 3), 3))
        return st.lists(
            schema_value(schema.get("items", {}), depth + 1, schemas), min_size=low, max_size=high
        )
    return _object(schema, depth, schemas)


def _object(
    schema: dict[str, Any], depth: int, schemas: Schemas
) -> st.SearchStrategy[dict[str, Any]]:
    props: dict[str, Any] = schema.get("properties", {})
    required = [k for k in schema.get("required", []) if k in props]
    optional = [k for k in props if k not in required]
    extra = schema.get("additionalProperties")
    extras = (
        st.dictionaries(_text, schema_value(extra, depth + 1, schemas), max_size=2)
        if isinstance(extra, dict)
        else st.just({})
    )

    @st.composite
    def draw(d: st.DrawFn) -> dict[str, Any]:
        out: dict[str, Any] = dict(d(extras))
        chosen = d(st.lists(st.sampled_from(optional), unique=True, max_size=4)) if optional else []
        for key in [*required, *chosen]:
            out[key] = d(schema_value(props[key], depth + 1, schemas))
        return out

    return draw()


@st.composite
def request_objects(draw: st.DrawFn, model: str = "m") -> dict[str, Any]:
    """A request the schema describes; ``model`` is ``model`` 80 % of the time."""
    obj: dict[str, Any] = draw(
        schema_value({"$ref": "#/components/schemas/CreateChatCompletionRequest"})
    )
    if draw(st.integers(0, 4)):
        obj["model"] = model
    return obj


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*path, i))
    return out


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    value[path[0]] = _replace(value[path[0]], path[1:], new)
    return value


_DEEP = "\u0000deep\u0000"
# Each draw its own copy: sampled_from hands out the same list or dict every
# time, and a mutation inside one (a later draw's "wrong" value spliced into
# the {"a": None} an earlier draw's "key" put in) made it contain itself.
_WRONG = st.sampled_from([None, True, -1, 2**31, 1.5, "x", [], {}, [[]], {"a": None}]).map(
    copy.deepcopy
)
_HUGE = st.sampled_from([2**64, 2**90, -(2**63) - 1, -(2**100)])


class Body(bytes):
    """A body whose repr is short: hypothesis prints failing examples, and a
    100,000-level body would be 200 kB (a HypothesisWarning, an error here)."""

    def __repr__(self) -> str:
        text = bytes.__repr__(self)
        return text if len(text) <= 300 else f"{text[:150]}...{text[-100:]} ({len(self)} bytes)"


@st.composite
def chat_bodies(draw: st.DrawFn, model: str = "m") -> Body:
    """A request body: schema-described, or one hostile mutation of it."""
    return draw(mutated(request_objects(model)))


@st.composite
def mutated(draw: st.DrawFn, objects: st.SearchStrategy[dict[str, Any]]) -> Body:
    """A body of one of ``objects`` (any surface's), as is or with one hostile
    mutation: deep nesting, an integer beyond 64 bits, a value of the wrong
    type, invalid UTF-8 in a string, truncation, or an unknown key."""
    # A copy: strategies such as st.just hand out one object to every draw,
    # and the mutations below change it in place.
    obj = copy.deepcopy(draw(objects))
    mutation = draw(st.sampled_from(["none", "deep", "huge", "wrong", "utf8", "truncate", "key"]))
    if mutation in ("deep", "huge", "wrong"):
        path = draw(st.sampled_from(_paths(obj)))
        if mutation == "deep":
            new: Any = _DEEP  # spliced in as bytes: json.dumps would recurse
        else:
            new = draw(_HUGE if mutation == "huge" else _WRONG)
        obj = _replace(obj, path, new)
    elif mutation == "key":
        obj[draw(_text)] = draw(_HUGE | _WRONG | _json_value)
    raw = json.dumps(obj).encode()
    if mutation == "deep":
        levels = draw(st.sampled_from([65, 70, 300, 5000, 100_000]))
        nest = draw(st.sampled_from([b"[]", b'{"a":}']))
        opener, closer = nest[:-1], nest[-1:]
        raw = raw.replace(json.dumps(_DEEP).encode(), opener * levels + b"1" + closer * levels)
    if mutation == "utf8":
        # Inside a string, or (a body with none, such as ``{}``) before the body.
        quotes = [i + 1 for i, b in enumerate(raw) if b == ord('"')] or [0]
        at = draw(st.sampled_from(quotes))
        raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3(", b"\xed\xa0\x80"])) + raw[at:]
    elif mutation == "truncate":
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    return Body(raw)


# --- the other surfaces' bodies -------------------------------------------------------

_RESPONSES_DOC = rewrite_nullable(
    json.loads((SCHEMA_PATH.parent / "openai-schemas.json").read_text(encoding="utf-8"))
)
_RESPONSES_SCHEMAS: Schemas = _RESPONSES_DOC["components"]["schemas"]


@st.composite
def responses_objects(draw: st.DrawFn, model: str = "m") -> dict[str, Any]:
    """A ``CreateResponse`` as OpenAI's schema describes it; ``model`` and
    ``input`` present most of the time (the schema requires neither)."""
    obj: dict[str, Any] = draw(
        schema_value({"$ref": "#/components/schemas/CreateResponse"}, schemas=_RESPONSES_SCHEMAS)
    )
    if draw(st.integers(0, 4)):
        obj["model"] = model
    if "input" not in obj and draw(st.integers(0, 3)):
        obj["input"] = draw(
            st.text(max_size=12)
            | schema_value({"$ref": "#/components/schemas/InputParam"}, schemas=_RESPONSES_SCHEMAS)
        )
    return obj


def responses_bodies(model: str = "m") -> st.SearchStrategy[Body]:
    """A ``POST /v1/responses`` body: schema-described, or one hostile mutation of it."""
    return mutated(responses_objects(model))


# Anthropic publishes no JSON Schema of its request; these follow its
# Messages API reference, with each field sometimes of a wrong shape.
_image_source = st.fixed_dictionaries(
    {"type": st.just("base64"), "media_type": st.just("image/png"), "data": st.just("iVBORw0KGgo=")}
) | st.fixed_dictionaries({"type": st.just("url"), "url": st.just("https://example.com/a.png")})
_text_block = st.fixed_dictionaries({"type": st.just("text"), "text": _text})
_tool_input = st.dictionaries(_text, _json_value, max_size=2)
_blocks = st.one_of(
    _text_block,
    st.fixed_dictionaries({"type": st.just("image"), "source": _image_source}),
    st.fixed_dictionaries(
        {"type": st.just("tool_use"), "id": st.just("toolu_1"), "name": _text, "input": _tool_input}
    ),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": st.just("toolu_1")},
        optional={
            "content": _text | st.lists(_text_block, max_size=2),
            "is_error": st.booleans(),
        },
    ),
    st.fixed_dictionaries(
        {"type": st.just("thinking"), "thinking": _text, "signature": st.just("sig")}
    ),
    st.fixed_dictionaries({"type": st.just("redacted_thinking"), "data": _text}),
    st.fixed_dictionaries({"type": _text}),
)
_anthropic_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system", "tool"]),
        "content": _text | st.lists(_blocks, max_size=3),
    }
)
_anthropic_tool = st.fixed_dictionaries(
    {"name": _text, "input_schema": st.just({"type": "object", "properties": {}})},
    optional={"description": _text, "type": st.sampled_from(["custom", "web_search_20250305"])},
)
_anthropic_fields: dict[str, st.SearchStrategy[Any]] = {
    "system": _text | st.lists(_text_block, max_size=2),
    "max_tokens": st.integers(-2, 5000),
    "stream": st.booleans(),
    "temperature": st.floats(-1, 3, allow_nan=False),
    "top_p": st.floats(-1, 2, allow_nan=False),
    "top_k": st.integers(-1, 500),
    "stop_sequences": st.lists(_text, max_size=3),
    "tools": st.lists(_anthropic_tool, max_size=2),
    "tool_choice": st.fixed_dictionaries(
        {"type": st.sampled_from(["auto", "any", "tool", "none", "other"])},
        optional={"name": _text, "disable_parallel_tool_use": st.booleans()},
    ),
    "thinking": st.fixed_dictionaries(
        {"type": st.sampled_from(["enabled", "adaptive", "disabled"])},
        optional={"budget_tokens": st.integers(0, 40_000)},
    ),
    "metadata": st.fixed_dictionaries({}, optional={"user_id": _text | st.none()}),
    "context_management": _json_value,
    "output_config": _json_value,
}


@st.composite
def messages_objects(draw: st.DrawFn, model: str = "m") -> dict[str, Any]:
    """An Anthropic Messages request, near valid (``max_tokens`` most of the time)."""
    obj: dict[str, Any] = {
        "model": model if draw(st.integers(0, 4)) else draw(_text),
        "messages": draw(st.lists(_anthropic_message, max_size=3)),
    }
    if draw(st.integers(0, 4)):
        obj["max_tokens"] = draw(st.integers(1, 64))
    for key in draw(st.lists(st.sampled_from(sorted(_anthropic_fields)), unique=True, max_size=5)):
        obj[key] = draw(_anthropic_fields[key])
    return obj


def messages_bodies(model: str = "m") -> st.SearchStrategy[Body]:
    """A ``POST /v1/messages`` body: near valid, or one hostile mutation of it."""
    return mutated(messages_objects(model))


@st.composite
def _operation_objects(draw: st.DrawFn, schema: str, key: str, model: str) -> dict[str, Any]:
    """A ``schema`` request as OpenAI's schema describes it, ``model`` and
    ``key`` (the prompt or the input) present most of the time."""
    obj: dict[str, Any] = draw(
        schema_value({"$ref": f"#/components/schemas/{schema}"}, schemas=_RESPONSES_SCHEMAS)
    )
    if draw(st.integers(0, 4)):
        obj["model"] = model
    if key not in obj and draw(st.integers(0, 3)):
        obj[key] = draw(st.text(max_size=12))
    return obj


def completions_bodies(model: str = "m") -> st.SearchStrategy[Body]:
    """A ``POST /v1/completions`` body: schema-described, or one hostile mutation of it."""
    return mutated(_operation_objects("CreateCompletionRequest", "prompt", model))


def embeddings_bodies(model: str = "m") -> st.SearchStrategy[Body]:
    """A ``POST /v1/embeddings`` body: schema-described, or one hostile mutation of it."""
    return mutated(_operation_objects("CreateEmbeddingRequest", "input", model))
