"""Memory census hooks for ``scripts/bench_idle_streams.py`` (on the children's PYTHONPATH).

Installs nothing unless asked, by environment:

* ``IOP_BENCH_CENSUS=DIR``: on SIGUSR2, collect garbage and write a count and
  ``sys.getsizeof`` total of the live gc-tracked objects by type to
  ``DIR/<pid>-types-<n>.json``;
* ``IOP_BENCH_TRACEMALLOC=N`` (with ``IOP_BENCH_CENSUS``): trace allocations
  with N frames from the start, and on SIGUSR1 write a snapshot to
  ``DIR/<pid>-<n>.snap``.

A signal handler runs between two bytecodes of the main thread, so the trio
loop is simply paused while it writes.
"""

from __future__ import annotations

import os

_DIR = os.environ.get("IOP_BENCH_CENSUS")
if _DIR:
    import gc
    import itertools
    import json
    import signal
    import sys
    import tracemalloc

    _types_n = itertools.count()
    _snap_n = itertools.count()

    def _types(signum: int, frame: object) -> None:
        gc.collect()
        out: dict[str, list[int]] = {}
        for obj in gc.get_objects():
            kind = type(obj)
            entry = out.setdefault(f"{kind.__module__}.{kind.__qualname__}", [0, 0])
            entry[0] += 1
            entry[1] += sys.getsizeof(obj)
        path = f"{_DIR}/{os.getpid()}-types-{next(_types_n)}.json"
        with open(path, "w") as f:
            json.dump(out, f)

    signal.signal(signal.SIGUSR2, _types)
    frames = int(os.environ.get("IOP_BENCH_TRACEMALLOC", "0"))
    if frames:
        tracemalloc.start(frames)

        def _snapshot(signum: int, frame: object) -> None:
            gc.collect()
            tracemalloc.take_snapshot().dump(f"{_DIR}/{os.getpid()}-{next(_snap_n)}.snap")

        signal.signal(signal.SIGUSR1, _snapshot)
