"""A long-lived server's garbage collector, set once its start-up is done.

CPython's cycle collector runs its youngest generation every 700 container
allocations and, now and then, a full collection that walks every tracked
object. A server allocates a few short-lived containers per token (events,
coroutines, trio's scheduling records), and holds tens of thousands of
objects built at start-up (modules, config, the app) that never become
garbage. At 256 paced streams the edge spent about 16 % of its CPU in the
collector, a full collection taking 50 to 100 ms (docs/benchmarks.md, "Tokens
per core at fleet scale").

``settle_heap``, called once a server is up, collects what start-up left,
moves the survivors out of the collector's sight (``gc.freeze``: they are
never walked again; reference counting still frees them), and runs the
youngest generation every ``YOUNG_THRESHOLD`` allocations instead of 700:
most per-token objects are freed by their reference count before a
collection would have to walk them. The older generations keep CPython's
ratios. Not for a test process that starts many servers: what it freezes
stays frozen (``iop edge``, ``iop node`` and ``iop up`` call it once they
are up, not ``serve_edge``).
"""

from __future__ import annotations

import gc
import logging
from typing import Final

__all__ = ["YOUNG_THRESHOLD", "settle_heap"]

# Container allocations (net of frees) between two collections of the
# youngest generation: CPython's 700 is one every few paced tokens of a busy
# server; 10,000 such objects are about 1 MB held a little longer.
YOUNG_THRESHOLD: Final = 10_000


def settle_heap(log: logging.Logger | None = None) -> int:
    """Collect, freeze what survives and collect the young less often; the
    number of objects frozen (said in ``log``'s INFO)."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
    frozen = gc.get_freeze_count()
    if log is not None:
        log.info(
            "garbage collector: %d start-up objects frozen, young generation every %d allocations",
            frozen,
            YOUNG_THRESHOLD,
        )
    return frozen
