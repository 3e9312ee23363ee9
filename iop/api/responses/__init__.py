"""OpenAI Responses (``POST /v1/responses``), sans-IO.

``ResponsesSurface`` implements ``iop.api.Surface`` over a ``ResponseStore``
(``previous_response_id``); ``_request`` translates requests into a run's
``ChatRequest``, ``_tools`` offers its custom and namespace tools to the model
as functions and turns the calls back, ``_encode`` formats its shaped output
as OpenAI's stream or ``Response`` object. docs/api.md ("OpenAI Responses") documents the mapping.
"""

from iop.api.responses._encode import (
    KEEPALIVE,
    ResponsesCall,
    ResponsesCollector,
    ResponsesStream,
)
from iop.api.responses._request import ResponsesRequest, decode_request, translate
from iop.api.responses._store import ResponseStore
from iop.api.responses._surface import PREVIOUS_NOT_FOUND_STATUS, ResponsesSurface

__all__ = [
    "KEEPALIVE",
    "PREVIOUS_NOT_FOUND_STATUS",
    "ResponseStore",
    "ResponsesCall",
    "ResponsesCollector",
    "ResponsesRequest",
    "ResponsesStream",
    "ResponsesSurface",
    "decode_request",
    "translate",
]
