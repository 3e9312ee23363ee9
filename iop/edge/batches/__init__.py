"""The edge's batches: OpenAI's Batch API run on the edge's own nodes, on the
capacity interactive runs leave (``_runner``; the routes are
``iop.edge.routes._batches``, the file format, states and store ``iop.batches``)."""

from iop.edge.batches._runner import (
    COMPLETION_WINDOW_S,
    Batches,
    LineAnswer,
    LineCall,
    LineCheck,
    new_id,
)

__all__ = ["COMPLETION_WINDOW_S", "Batches", "LineAnswer", "LineCall", "LineCheck", "new_id"]
