"""OpenAI's Embeddings API, ``POST /v1/embeddings`` (sans-IO surface).

Inputs in, one vector per input out, over the same runs as chat (the
``embedding`` operation: ``iop.spec.EmbeddingRequest``, answered
``Start EmbeddingData* Complete``). Embeddings are not streamed, but the run
is one like any other: cancelled when the client goes away, bounded by the
run's deadlines, failed over before its first vector. ``EMBEDDINGS`` is the
``Surface``.

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

import base64
from collections.abc import Mapping
from typing import Any, Final, Literal, NoReturn

import msgspec

from iop.api._json_guard import DEFAULT_MAX_JSON_DEPTH
from iop.api._surface import Call, RunContext
from iop.api.completions._errors import (
    decode_object,
    error_response,
    event_error,
    from_validation,
    invalid,
)
from iop.errors import ErrorCode, InvariantError, RequestError
from iop.events import Cancelled, Complete, EmbeddingData, Error, RuntimeEvent
from iop.spec import EmbeddingInput, EmbeddingRequest

__all__ = [
    "EMBEDDINGS",
    "MAX_INPUTS",
    "EmbeddingsCollector",
    "EmbeddingsSurface",
    "parse_embeddings",
]

# OpenAI's limit on inputs per request ("any array must be 2048 dimensions or
# less"). Each input is one event on the link and one vector held by the
# collector until the run completes.
MAX_INPUTS: Final = 2048

_encode: Final = msgspec.json.encode


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
            raise RequestError(
                f"Missing required parameter: '{name}'.",
                param=name,
                code=ErrorCode.MISSING_REQUIRED_PARAMETER,
            )
    try:
        req = msgspec.convert({k: v for k, v in top.items() if k in _KNOWN}, _Body)
    except msgspec.ValidationError as exc:
        raise from_validation(exc) from exc
    if not req.model.strip():
        raise RequestError(
            "Missing required parameter: 'model'.",
            param="model",
            code=ErrorCode.MISSING_REQUIRED_PARAMETER,
        )
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


class EmbeddingsCollector:
    """One ``/v1/embeddings`` response: ``CreateEmbeddingResponse`` or an error."""

    def __init__(self, *, model: str, inputs: int, encoding: Literal["float", "base64"]) -> None:
        self._model = model
        self._inputs = inputs
        self._encoding = encoding
        self._parts: list[bytes] = []
        # A malformed vector fails the response, decided at the terminal event.
        self._broken: tuple[int, bytes] | None = None
        self._result: tuple[int, bytes] | None = None

    @property
    def finished(self) -> bool:
        return self._result is not None

    def feed(self, event: RuntimeEvent) -> None:
        """Take one event.

        Raises:
            InvariantError: An event after the terminal one.
        """
        if self._result is not None:
            raise InvariantError(f"feed({type(event).__name__}) after the run finished")
        if isinstance(event, EmbeddingData):
            if self._broken is None:
                self._add(event)
        elif isinstance(event, Complete):
            self._complete(event)
        elif isinstance(event, Error | Cancelled):
            self._result = event_error(event)
        if self._result is not None:
            self._parts = []

    def _add(self, event: EmbeddingData) -> None:
        if event.index != len(self._parts) or len(event.vector) % 4:
            self._broken = error_response(
                502,
                f"the backend sent embedding {event.index} out of order or malformed",
                code=ErrorCode.BACKEND_PROTOCOL_ERROR,
            )
            return
        vector: bytes
        if self._encoding == "base64":
            vector = _encode(base64.b64encode(event.vector).decode())
        else:
            vector = _encode(event.floats())
        self._parts.append(
            b'{"object":"embedding","index":'
            + str(event.index).encode()
            + b',"embedding":'
            + vector
            + b"}"
        )

    def _complete(self, event: Complete) -> None:
        if self._broken is not None:
            self._result = self._broken
            return
        if len(self._parts) != self._inputs:
            self._result = error_response(
                502,
                f"the backend sent {len(self._parts)} embeddings for {self._inputs} inputs",
                code=ErrorCode.BACKEND_PROTOCOL_ERROR,
            )
            return
        tokens = event.usage.input_tokens
        self._result = (
            200,
            b'{"object":"list","data":['
            + b",".join(self._parts)
            + b'],"model":'
            + _encode(self._model)
            + b',"usage":'
            + _encode({"prompt_tokens": tokens, "total_tokens": tokens})
            + b"}",
        )

    def result(self) -> tuple[int, bytes]:
        """The status and body.

        Raises:
            InvariantError: No terminal event was fed yet.
        """
        if self._result is None:
            raise InvariantError("result() before the run finished")
        return self._result


class EmbeddingsSurface:
    """``POST /v1/embeddings`` as a ``Surface`` (never streamed)."""

    def __init__(self, *, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> None:
        self._max_depth = max_depth

    @property
    def name(self) -> str:
        return "embeddings"

    def parse(self, body: bytes, headers: Mapping[str, str], *, tenant: str = "") -> Call:
        request = parse_embeddings(body, max_depth=self._max_depth)
        return Call(request=request, stream=False, model=request.model, native=request)

    def error_body(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> tuple[int, bytes]:
        return error_response(status, message, code=code, param=param)

    def stream(self, call: Call, ctx: RunContext) -> NoReturn:
        raise InvariantError("embeddings are not streamed (Call.stream is always False)")

    def collector(self, call: Call, ctx: RunContext) -> EmbeddingsCollector:
        request = call.request
        if not isinstance(request, EmbeddingRequest):
            raise InvariantError("an embeddings collector for another operation")
        return EmbeddingsCollector(
            model=call.model, inputs=len(request.inputs), encoding=request.encoding_format
        )


EMBEDDINGS = EmbeddingsSurface()
