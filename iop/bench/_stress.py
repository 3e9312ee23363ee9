"""Stress the platform from outside: cancellation, memory, overload, idle links.

Four measurements of the targets in docs/benchmarks.md ("Cancellation,
memory, overload, idle links"), each on real processes (``python -m
iop edge``, ``python -m iop node --config ...``, ``python -m iop sim``) on
loopback, each starting its own processes and stopping them all by PID at
the end, on error and on Ctrl-C or SIGTERM. Select them with ``--only``
(default: all four, in this order, about 6 minutes on 2 cores).

Outputs: bench-results/stress-<timestamp>.json (every number, machine,
package versions, load averages; the directory is gitignored) and a summary
table per measurement on stdout. Absolute latencies on a shared 2-core box
are noisy: the load average and the machine's busy CPU not explained by the
benchmark's processes ("foreign") are recorded with each measurement.

Examples:
  python scripts/bench_stress.py                        # all four, defaults
  python scripts/bench_stress.py --only cancel --trials 50
  python scripts/bench_stress.py --only cancel --trials 50 --perf-trace
  python scripts/bench_stress.py --only memory --streams 2000 --rounds 3
  python scripts/bench_stress.py --only overload --levels 80,90,100,120,150
  python scripts/bench_stress.py --only overload --edge-set scheduler.max_queue=32
  python scripts/bench_stress.py --only idle-nodes --nodes 200 --real-nodes 4

docs/benchmarks.md ("Cancellation, memory, overload, idle links") explains the
method and quotes the results.

Each measurement is its own module (``iop/bench/_cancel.py``, ``_memory.py``,
``_overload.py``, ``_idle_nodes.py``: its options, its run, its tables, and
in its docstring what it does, which ``--help`` shows before "Outputs");
this one puts their command lines together (``iop.bench._steps``).
"""

from __future__ import annotations

import sys
from typing import Any, Final

from iop.bench import _cancel, _idle_nodes, _memory, _overload
from iop.bench._procs import script_main
from iop.bench._steps import Step, describe, parse, run_steps

__all__ = ["STEPS", "main", "parse_args"]

# In the order they run (--only's default).
STEPS: Final[tuple[Step, ...]] = (_cancel.STEP, _memory.STEP, _overload.STEP, _idle_nodes.STEP)


def parse_args(argv: list[str] | None) -> Any:
    """The command line of every step (``--help`` tells them all)."""
    return parse(STEPS, describe(STEPS, __doc__ or ""), argv)


def main(argv: list[str] | None = None) -> int:
    """``scripts/bench_stress.py``: the steps of ``--only``, one JSON; 130 on Ctrl-C."""
    args = parse_args(argv)
    return script_main(lambda: run_steps(args, STEPS))


if __name__ == "__main__":
    sys.exit(main())
