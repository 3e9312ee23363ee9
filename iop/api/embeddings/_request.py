"""``POST /v1/embeddings`` request parsing (sans-IO).

OpenAI's ``CreateEmbeddingRequest`` in, the run's
``iop.spec.EmbeddingRequest`` out, or a 400 worded like OpenAI's with
``param`` set.

What maps where (``docs/api.md``, "Embeddings"):

* ``input``: a string, an array of strings, an array of token ids or an array
  of arrays of ids, at most ``MAX_INPUTS`` (OpenAI's 2048) items; empty
  strings and empty arrays are OpenAI's 400.
* ``encoding_format``: ``float`` (default) or ``base64`` (the vector's
  little-endian float32 bytes, as OpenAI sends them); the node always gets
  floats from its backend and carries float32, so both encodings hold
  exactly the same numbers.
* ``dimensions`` (>= 1) and ``user`` are passed on; other keys go to
  ``extra_body``, passed through. ``stream`` is a 400: there is no stream.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec

from iop.api._json_guard import DEFAULT_MAX_JSON_DEPTH
from iop.api._openai_validation import missing_parameter
from iop.api.completions._errors import decode_object, from_validation, invalid
from iop.spec import EmbeddingInput, EmbeddingRequest

__all__ = ["MAX_INPUTS", "parse_embeddings"]

# OpenAI's limit on inputs per request ("any array must be 2048 dimensions or
# less"). Each input is one event on the link and one vector held by the
# collector until the run completes.
MAX_INPUTS: Final = 2048


class _Body(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


_KNOWN: Final = frozenset(_Body.__struct_fields__)

_FORMS: Final = (
    "'input' must be a string, an array of strings, an array of integers "
    "or an array of arrays of integers."
)


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )


def _inputs(value: str | list[Any]) -> list[EmbeddingInput]:
    if isinstance(value, str):
        items: list[Any] = [value]
    elif not value:
        raise invalid("'input' must not be an empty array.", "input")
    elif _is_ids(value):
        items = [value]
    elif all(isinstance(v, str) for v in value) or all(_is_ids(v) for v in value):
        items = value
    else:
        raise invalid(_FORMS, "input")
    if len(items) > MAX_INPUTS:
        raise invalid(f"'input' has {len(items)} items; at most {MAX_INPUTS} are allowed.", "input")
    for i, item in enumerate(items):
        if not item:
            where = "'input'" if len(items) == 1 else f"'input[{i}]'"
            raise invalid(f"{where} must not be empty.", "input")
    return items


def parse_embeddings(body: bytes, *, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> EmbeddingRequest:
    """Decode and check a ``/v1/embeddings`` body.

    Raises:
        RequestError: A 400 with OpenAI's wording and ``param``.
    """
    top = decode_object(body, max_depth=max_depth)
    if "stream" in top:
        raise invalid("Embeddings are not streamed: 'stream' is not supported.", "stream")
    for name in ("model", "input"):
        if name not in top:
            raise missing_parameter(name)
    try:
        req = msgspec.convert({k: v for k, v in top.items() if k in _KNOWN}, _Body)
    except msgspec.ValidationError as exc:
        raise from_validation(exc) from exc
    if not req.model.strip():
        raise missing_parameter("model")
    if req.dimensions is not None and req.dimensions < 1:
        raise invalid(
            f"{req.dimensions} is less than the minimum of 1 - 'dimensions'", "dimensions"
        )
    extra = {k: v for k, v in top.items() if k not in _KNOWN}
    return EmbeddingRequest(
        model=req.model,
        inputs=_inputs(req.input),
        encoding_format=req.encoding_format,
        dimensions=req.dimensions,
        user=req.user,
        extra_body=extra or None,
    )
