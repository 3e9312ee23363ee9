"""OpenAI's legacy Completions API, ``POST /v1/completions`` (sans-IO surface).

Prompt in, text out, streamed or not, over the same runs as chat (the
``completion`` operation: ``iop.spec.CompletionRequest``), so it inherits
their cancellation, failover before the first output, keep-alives and
deadlines. Parsing in ``_request``, the stream and the body in ``_encode``,
OpenAI's errors in ``_errors``; ``COMPLETIONS`` (``_surface``) is the
``Surface``.
"""

from iop.api.completions._encode import CompletionCollector, CompletionStream
from iop.api.completions._request import ParsedCompletion, parse_completion
from iop.api.completions._surface import COMPLETIONS, CompletionsSurface

__all__ = [
    "COMPLETIONS",
    "CompletionCollector",
    "CompletionStream",
    "CompletionsSurface",
    "ParsedCompletion",
    "parse_completion",
]
