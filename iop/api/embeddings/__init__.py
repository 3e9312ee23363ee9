"""OpenAI's Embeddings API, ``POST /v1/embeddings`` (sans-IO surface).

Inputs in, one vector per input out, over the same runs as chat (the
``embedding`` operation: ``iop.spec.EmbeddingRequest``, answered
``Start EmbeddingData* Complete``). Embeddings are not streamed, but the run
is one like any other: cancelled when the client goes away, bounded by the
run's deadlines, failed over before its first vector. Parsing in
``_request``, the body in ``_encode`` (a collector, no stream), OpenAI's
errors in ``iop.api.completions._errors`` (the two legacy surfaces share
them); ``EMBEDDINGS`` (``_surface``) is the ``Surface``.
"""

from iop.api.embeddings._encode import EmbeddingsCollector
from iop.api.embeddings._request import MAX_INPUTS, parse_embeddings
from iop.api.embeddings._surface import EMBEDDINGS, EmbeddingsSurface

__all__ = [
    "EMBEDDINGS",
    "MAX_INPUTS",
    "EmbeddingsCollector",
    "EmbeddingsSurface",
    "parse_embeddings",
]
