"""Moved to ``iop/bench/_platform.py``; run by ``iop bench`` (docs/benchmarks.md, "How to rerun").

This shim keeps ``python scripts/bench_platform.py ...`` working with the same
options. ``import bench_platform`` (scripts/bench_fixed_cost.py,
scripts/bench_first_chunk.py) gets ``iop/bench/_platform_stack.py``, the
module that starts the platform, so that setting its ``REPO`` still reaches
``running_platform``; the client and /proc readers those scripts take from
it under their old names (now in ``iop/bench/_client.py`` and
``iop/bench/_procs.py``) are put back on it here.
"""

from __future__ import annotations

import sys
from pathlib import Path

_REPO = str(Path(__file__).resolve().parent.parent)
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)  # this checkout's iop, also when run without PYTHONPATH

from iop.bench import _client, _platform, _platform_stack, _procs  # noqa: E402

if __name__ == "__main__":
    sys.exit(_platform.main())
for _name, _value in {
    "one_request": _client.one_request,
    "_decode_chunk": _client.decode_chunk,
    "machine_cpu_s": _procs.machine_cpu_s,
    "proc_cpu_s": _procs.proc_cpu_s,
    "find_py_spy": _procs.find_py_spy,
}.items():
    setattr(_platform_stack, _name, _value)
sys.modules[__name__] = _platform_stack
