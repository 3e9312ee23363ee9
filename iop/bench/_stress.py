"""Stress the platform from outside: cancellation, memory, overload, idle links.

Four measurements of the targets in docs/benchmarks.md ("Cancellation,
memory, overload, idle links"), each on real processes (``python -m
iop edge``, ``python -m iop node --config ...``, ``python -m iop sim``) on
loopback, each starting its own processes and stopping them all by PID at
the end, on error and on Ctrl-C or SIGTERM. Select them with ``--only``
(default: all four, in this order, about 6 minutes on 2 cores).

cancel (about 15 s)
  The backend is a mock OpenAI-compatible server inside this process
  (``iop/bench/_mock_backend.py``: a small trio + h11 TCP server streaming
  ``chat.completion.chunk`` SSE, or holding its answer), so the client
  closing its connection and the backend seeing its socket end are timed on
  one clock (``time.perf_counter``, CLOCK_MONOTONIC, the clock of the edge's
  ``time.monotonic()`` too). The
  node has two ``openai_compat`` instances on it: ``bench`` with free slots,
  and ``bench-q`` with ``max_concurrency = 1``, whose slot a held request
  keeps busy. For each window, ``--trials`` times: a client (h11 on a trio
  socket of its own) sends a request, waits until the window is reached,
  waits ``--settle-ms``, and closes its socket; the time from that
  ``close()`` until the backend's read of that request's socket returns EOF
  (or a reset) is the sample. Windows:

    queued              the request waits in the edge's queue for bench-q's
                        one slot. No backend socket exists: the sample ends
                        at the edge's own time of the run's leaving the queue
                        (/admin/nodes ``queue.last_exit``, read --poll-ms
                        after the close), and the backend must never see the
                        request (counted as "leaked" otherwise);
    before-headers      the backend has read the request and sent nothing;
    before-first-token  the backend sent its 200 and SSE headers, no chunk;
    mid-stream          the backend sent --mid-chunks chunks and the client
                        read them all;
    non-streaming       a "stream": false request; the backend holds its
                        JSON answer.

  --perf-trace records the trials with ``perf record`` (the scheduler, and
  the cancel path's syscalls) on the same clock: ``scripts/trace_cancel.py``
  then shows where one trial's time went, and how much of each sample was
  a wait for a CPU.

memory (about 50 s)
  The same mock backend sends its headers and one chunk, then stays silent.
  The script opens --streams streams (1,000; the file limit is raised to the
  hard limit), waits until every client has its first chunk, and samples
  VmRSS of edge and node (/proc/PID/status) before, with all open, and
  --settle-s after closing them all (clients close their sockets). Deadlines
  and the node's slots are configured out of the way (every timeout 3600 s,
  max_concurrency above --streams). --rounds times in one set of processes:
  the first round is the cost of a fresh process, the next ones show
  whether the memory is reused.

overload (about 4 min)
  ``iop sim`` as the backend (vLLM's wire format, 64 chunks, no TTFT, as fast
  as it can: --paced-rate for a paced one), one node with one ``vllm``
  instance (--max-concurrency slots), the edge with its default config
  (--edge-set to change it). A closed loop (--sat-concurrency workers for
  --sat-s, then --resat-s before every further level, as the box's other
  load moves) measures the saturated rate; an open loop then offers
  --levels percent of it (Poisson arrivals, or fixed with --arrivals fixed)
  for --duration-s each, a fresh request per arrival whatever is still
  outstanding. A last closed loop ends the run. The load generator speaks HTTP/1.1 with h11 over trio
  sockets with its own keep-alive free list: O(1) per event at any
  concurrency (httpcore's pool costs grow with the connections it holds,
  and would make the load generator the bottleneck). Each level reports the
  offered rate, goodput (answers with all 64 chunks and [DONE], completed
  inside the level's window, per second; ok/s counts the answers to the
  window's arrivals that succeeded at all), errors by kind (HTTP status and
  code, client timeouts after --client-timeout-s, broken streams), TTFT
  p50/p99 from the scheduled arrival, how fast refusals came, the edge's
  run outcomes (from /admin/nodes) and CPU per answer of each process.
  --levels repeats a level by listing it again (default: 90 % three times).

idle-nodes (about 45 s)
  One edge and --nodes idle nodes. --real-nodes of them are ``iop node``
  processes (each with an in-process sim instance); the rest are
  ``NodeAgent``s (``iop.node.open_node_agent``, the code ``iop node`` runs)
  in one helper process, each with its own node id, a sim instance and its
  own WebSocket link: the edge sees 100 real links either way, and one
  process keeps 100 Python interpreters (about 5 GiB and minutes of CPU to
  start on 2 cores) out of the measurement. Once /admin/nodes lists them
  all, edge CPU (utime+stime from /proc/PID/stat) is measured over
  --idle-s, with the nodes' CPU per node from both kinds of process.
  Then node-loss detection: SIGSTOP one real node (a frozen host) and time
  until /admin/nodes no longer lists it, --loss-trials times, and once
  with SIGKILL (the TCP connection closes at once).

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
``_overload.py``, ``_idle_nodes.py``: its options, its run, its tables);
this one puts their command lines together (``iop.bench._steps``).
"""

from __future__ import annotations

import sys
from typing import Any, Final

from iop.bench import _cancel, _idle_nodes, _memory, _overload
from iop.bench._procs import script_main
from iop.bench._steps import Step, parse, run_steps

__all__ = ["STEPS", "main", "parse_args"]

# In the order they run (--only's default).
STEPS: Final[tuple[Step, ...]] = (_cancel.STEP, _memory.STEP, _overload.STEP, _idle_nodes.STEP)


def parse_args(argv: list[str] | None) -> Any:
    """The command line of every step (``--help`` tells them all)."""
    return parse(STEPS, __doc__, argv)


def main(argv: list[str] | None = None) -> int:
    """``scripts/bench_stress.py``: the steps of ``--only``, one JSON; 130 on Ctrl-C."""
    args = parse_args(argv)
    return script_main(lambda: run_steps(args, STEPS))


if __name__ == "__main__":
    sys.exit(main())
