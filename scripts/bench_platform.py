"""Moved to ``iop/bench/_platform.py``; run by ``iop bench`` (docs/benchmarks.md, "How to rerun").

This shim keeps ``python scripts/bench_platform.py ...`` working with the same
options.
"""

from __future__ import annotations

import sys
from pathlib import Path

_REPO = str(Path(__file__).resolve().parent.parent)
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)  # this checkout's iop, also when run without PYTHONPATH

from iop.bench import _platform  # noqa: E402

if __name__ == "__main__":
    sys.exit(_platform.main())
