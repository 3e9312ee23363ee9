"""The Embeddings surface (``POST /v1/embeddings``): ``EMBEDDINGS``, never streamed.

Parsing is ``_request.parse_embeddings``; the body is ``_encode``'s
collector; errors are OpenAI's body (``iop.api.completions._errors``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NoReturn

from iop.api._json_guard import DEFAULT_MAX_JSON_DEPTH
from iop.api._routing import with_routing
from iop.api._surface import Call, RunContext
from iop.api.completions._errors import error_response
from iop.api.embeddings._encode import EmbeddingsCollector
from iop.api.embeddings._request import parse_embeddings
from iop.errors import InvariantError
from iop.spec import EmbeddingRequest

__all__ = ["EMBEDDINGS", "EmbeddingsSurface"]


class EmbeddingsSurface:
    """``POST /v1/embeddings`` as a ``Surface`` (never streamed)."""

    def __init__(self, *, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> None:
        self._max_depth = max_depth

    @property
    def name(self) -> str:
        return "embeddings"

    def parse(self, body: bytes, headers: Mapping[str, str], *, tenant: str = "") -> Call:
        request = with_routing(parse_embeddings(body, max_depth=self._max_depth), headers)
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
