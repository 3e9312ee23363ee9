"""The legacy Completions surface (``POST /v1/completions``): ``COMPLETIONS``.

Parsing is ``_request.parse_completion``; output is ``_encode``'s stream and
collector; errors are OpenAI's body (``_errors``). Headers play no part.
"""

from __future__ import annotations

from collections.abc import Mapping

from iop.api._json_guard import DEFAULT_MAX_JSON_DEPTH
from iop.api._routing import with_routing
from iop.api._surface import Call, RunContext
from iop.api.completions._encode import CompletionCollector, CompletionStream
from iop.api.completions._errors import error_response
from iop.api.completions._request import ParsedCompletion, parse_completion

__all__ = ["COMPLETIONS", "CompletionsSurface"]


class CompletionsSurface:
    """``POST /v1/completions`` as a ``Surface``."""

    def __init__(self, *, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> None:
        self._max_depth = max_depth

    @property
    def name(self) -> str:
        return "completions"

    def parse(self, body: bytes, headers: Mapping[str, str], *, tenant: str = "") -> Call:
        parsed = parse_completion(body, max_depth=self._max_depth)
        return Call(
            request=with_routing(parsed.request, headers),
            stream=parsed.stream,
            model=parsed.request.model,
            native=parsed,
        )

    def error_body(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> tuple[int, bytes]:
        return error_response(status, message, code=code, param=param)

    def stream(self, call: Call, ctx: RunContext) -> CompletionStream:
        native = call.native
        include_usage = isinstance(native, ParsedCompletion) and native.include_usage
        return CompletionStream(
            run_id=ctx.run_id, created=ctx.created, model=call.model, include_usage=include_usage
        )

    def collector(self, call: Call, ctx: RunContext) -> CompletionCollector:
        return CompletionCollector(run_id=ctx.run_id, created=ctx.created, model=call.model)


COMPLETIONS = CompletionsSurface()
