"""Moved to ``iop/bench/_stress.py``; run by ``iop bench`` (docs/benchmarks.md, "How to rerun").

This shim keeps ``python scripts/bench_stress.py ...`` working with the same
options. Each measurement is its own module: ``iop/bench/_cancel.py``,
``_memory.py``, ``_overload.py``, ``_idle_nodes.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

_REPO = str(Path(__file__).resolve().parent.parent)
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)  # this checkout's iop, also when run without PYTHONPATH

from iop.bench import _stress  # noqa: E402

if __name__ == "__main__":
    sys.exit(_stress.main())
