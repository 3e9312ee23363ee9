"""``soak``: mixed traffic on every surface for a long while, with faults on
a schedule; memory and file descriptors of every process over time, every
run's single terminal, and the usage ledger against what clients saw.

Theory of operation
-------------------
One run starts a ``valkey-server`` (``iop.bench._procs.start_valkey``),
``iop sim`` (a paced vLLM-compatible backend that answers tool calls), one
``iop edge`` (two tenants, a usage ledger, ``[cluster]`` on that Valkey, an
admin key) and two nodes: ``node-sim`` (the sim as a ``vllm`` instance) and
``node-llama`` (a managed ``adapter = "llamacpp"`` instance: the node runs
llama.cpp's server with the packaged SmolLM2-135M itself and supervises it).

Then, for ``duration_s``, three kinds of task run side by side:

* **traffic**: ``concurrency`` seeded workers, each a loop of one request at
  a time: chat, completions, Responses or Messages, streamed or not, on the
  sim or on llama.cpp, some with tools (sim), some cancelled by the client
  before their first token or right after it (sim, streams). Every request
  runs under a deadline (``request_deadline_s``): one that reaches it is a
  *hang*. Each ends in one outcome: ``complete`` (its surface's success
  terminal: ``finish_reason`` then ``[DONE]``, ``response.completed`` or
  ``response.incomplete``, ``message_stop``; a 200 body), ``error`` (the
  surface's error terminal in the stream), ``http NNN`` (an error status),
  ``cancelled`` (the client hung up on purpose), or an anomaly: no
  terminal, more than one, a transport error, a hang.
* **faults**, at fixed fractions of the duration: ``node-sim`` killed
  (SIGKILL) and started again, the managed ``llama-server`` killed
  (``kill -9``; the node restarts it), Valkey stopped and started again on
  its port, and ``reloads`` reloads of the edge spread over the run
  (SIGHUP and ``POST /admin/reload`` in turn, each changing one tenant's
  limit so that it is applied, docs/operations.md "Reloading").
* **samples** every ``sample_s``: RSS (``rss_kb``), open fds (the entries
  of ``/proc/PID/fd``) and CPU seconds of every process, a restarted one
  under its role's name with its new pid; a process that exits when no
  fault killed it is recorded as a death.

At the end the traffic stops, the edge is waited idle, its ``iop_runs``
counter is read from ``/metrics``, and the edge is stopped gracefully (a
graceful stop writes every queued ledger row). The ledger is then read back
(``iop usage --format json`` for its totals, ``LedgerStore`` for its rows
by outcome): the tokens of its ``complete`` rows must equal the usage the
clients received for their completed requests, its ``complete`` rows their
count, and its row count the runs the edge counted. Per process, the least
squares slope of RSS (KiB/min) and of fds (per minute) over the samples of
its last incarnation, after ``warmup_s``.

The run measures and records; the suite's two-minute run
(tests/test_bench_soak.py) asserts the invariants. The traffic is
``iop/bench/_soak_traffic.py``'s, the processes, faults and samples
``_soak_stack.py``'s, the slopes, tables and plot ``_soak_report.py``'s.
"""

from __future__ import annotations

import os
import time
from typing import Any, Final

import msgspec
import trio

from iop.bench._runner import RunContext, register
from iop.bench._soak_report import report, slopes
from iop.bench._soak_stack import (
    SoakStack,
    count_runs,
    deaths,
    fault_dict,
    ledger,
    run_faults,
    sampler,
    schedule,
    take_sample,
)
from iop.bench._soak_traffic import Options, Request, outcomes, traffic
from iop.testing import poll

__all__ = ["Options", "run"]

# The edge's last runs, after the traffic stops, end within this.
IDLE_S: Final = 60.0


async def _soak(stack: SoakStack, opts: Options, duration: float) -> dict[str, Any]:
    requests: list[Request] = []
    samples: list[dict[str, Any]] = []
    faults = schedule(opts, duration)
    t0 = trio.current_time()
    until = t0 + duration
    async with trio.open_nursery() as n:
        n.start_soon(traffic, stack.url, opts, until, requests)
        n.start_soon(run_faults, stack, faults, t0)
        n.start_soon(sampler, stack, t0, until, opts.sample_s, samples)
    return {"requests": requests, "samples": samples, "faults": faults}


@register(
    "soak",
    Options,
    "Mixed traffic on every surface with faults on a schedule: RSS and fd slopes of every "
    "process, one terminal per request, the usage ledger against the clients.",
    report=report,
)
def run(opts: Options, ctx: RunContext) -> dict[str, Any]:
    if ctx.smoke:
        opts = msgspec.structs.replace(
            opts,
            duration_s=min(opts.duration_s, 120.0),
            concurrency=min(opts.concurrency, 3),
            sample_s=min(opts.sample_s, 2.0),
            warmup_s=min(opts.warmup_s, 10.0),
        )
    stack = SoakStack(opts, ctx)
    try:
        stack.start()
        got = trio.run(_soak, stack, opts, opts.duration_s)
        died = deaths(stack)
        idle = True
        try:
            poll(
                lambda: not (s := stack.node_state())["runs"] and not s["queued"],
                timeout=IDLE_S,
                what="the edge to be idle",
                interval=0.2,
            )
        except AssertionError:
            idle = False
        final = take_sample(stack, time.monotonic())
        edge_runs = count_runs(stack)
        edge_rc = stack.procs["edge"].stop()
        book = ledger(stack, got["requests"])
    finally:
        codes = stack.stop()
    samples = got["samples"]
    return {
        "options": msgspec.to_builtins(opts),
        "cores": os.cpu_count(),
        "outcomes": outcomes(got["requests"]),
        "faults": [msgspec.to_builtins(fault_dict(f)) for f in got["faults"]],
        "deaths": died,
        "idle_at_end": idle,
        "final_fds": {k: v["fds"] for k, v in final["procs"].items()},
        "edge_runs": edge_runs,
        "edge_runs_total": sum(edge_runs.values()),
        "edge_exit": edge_rc,
        "exit_codes": codes,
        "ledger": book,
        "ledger_equals_edge": book["records"] == sum(edge_runs.values()),
        "slopes": slopes(samples, opts.warmup_s),
        "series": {
            "t": [s["t"] for s in samples],
            "procs": {
                role: {
                    "rss_kb": [s["procs"].get(role, {}).get("rss_kb") for s in samples],
                    "fds": [s["procs"].get(role, {}).get("fds") for s in samples],
                }
                for role in sorted({r for s in samples for r in s["procs"]})
            },
        },
    }
