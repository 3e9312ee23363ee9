"""Objectives under overload: interactive requests through a sheddable flood.

The measurement of ``[[objectives]]`` in docs/benchmarks.md ("Objectives
under overload"). ``instances`` ``iop sim`` engines behind one ``iop node``
(one ``vllm`` instance each, ``max_concurrency`` slots), behind an ``iop
edge`` with two objectives: ``interactive`` (priority 10, not sheddable)
and ``batch`` (priority 0, sheddable). The *capacity* is what the slots
finish a second: ``instances * max_concurrency`` over one run's time
(``ttft_s`` plus ``output_tokens / tokens_per_s``).

Phases, each a fresh edge and node and ``duration_s`` of Poisson arrivals
from this process (streamed chat completions, TTFT from the *scheduled*
arrival to the first content chunk):

``unloaded``
    Interactive requests alone at ``interactive_pct`` % of capacity: the
    reference TTFT.
``queue_only``
    The same interactive requests (``x-iop-objective: interactive``) and a
    background load of ``background_pct`` % of capacity
    (``x-iop-objective: batch``), the queue's order alone
    (``max_preemptions = 0``): what objectives did before preemption.
``loaded``
    The same two loads with the edge's default ``[scheduler]``: a batch run
    that has sent nothing yet is preempted for an interactive one.
``reserved``
    The same, and ``reserved_slot_fraction`` of each instance's slots kept
    from the batch runs.
``engine_priority``
    The same two loads with the defaults (no reserve) and engine priority
    (docs/operations.md, "Engine priority"): the node's instances have
    ``engine_priority``, the edge ``priority_overflow_slots``, so an
    interactive run that finds every slot taken takes an overflow seat and
    the sim preempts a batch run for it (vLLM's priority policy: the paused
    run resumes after paying its first token again).
``no_objectives``
    The same two loads without the headers: what the queue does without
    objectives (the control).

Every phase runs on the same sims: ``max_num_seqs`` = the node's slots per
instance and vLLM's priority scheduling policy (``--scheduling-policy
priority``). A request without a ``priority`` is priority 0, so outside
``engine_priority`` (where the node sends none) the policy serves in
arrival order and preempts nothing, as ``fcfs`` would: one sim
configuration for every phase, the unloaded one included.

Figures per phase and class: TTFT p50, p90, p99; answers per second
(goodput: the answers completed in the window over the window); 429s; 5xx
and other failures (which must be none); the edge's preemptions and
overflow seats (``/admin/nodes``); and the sims' own preemptions
(``vllm:num_preemptions_total``, over the phase).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any, Final, Literal

import httpx
import msgspec
import trio

from iop.bench._client import (
    TimedSample,
    load_client,
    open_loop,
    poisson_arrivals,
    sim_stream_body,
    timed_stream,
)
from iop.bench._procs import (
    Stack,
    process_stack,
    start_edge,
    start_node,
    start_sims,
    wait_instances,
)
from iop.bench._results import pct_ms
from iop.bench._runner import RunContext, register, tables_report
from iop.testing import NODE_READY, Proc

__all__ = ["Options", "run"]

Phase = Literal["unloaded", "queue_only", "loaded", "reserved", "engine_priority", "no_objectives"]
PHASES: Final[tuple[Phase, ...]] = (
    "unloaded",
    "queue_only",
    "loaded",
    "reserved",
    "engine_priority",
    "no_objectives",
)
MODEL: Final = "iop-sim"
OBJECTIVES: Final = [
    {"name": "interactive", "priority": 10, "sheddable": False},
    {"name": "batch", "priority": 0, "sheddable": True},
]


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``objectives`` runner's options (a scenario's ``[args]``).

    Attributes:
        instances: Engines (``iop sim`` processes), one ``vllm`` instance each.
        max_concurrency: The node's slots per instance (and each sim's batch).
        output_tokens: Tokens of an answer.
        ttft_s: The sims' time to first token.
        tokens_per_s: The sims' decode rate per request.
        interactive_pct: Interactive arrivals, in % of capacity.
        background_pct: Background (sheddable) arrivals, in % of capacity.
        duration_s: Each phase's window of arrivals.
        reserved_slot_fraction: The ``reserved`` phase's reserve.
        priority_overflow_slots: The ``engine_priority`` phase's overflow
            seats per instance (``scheduler.priority_overflow_slots``).
        phases: Which phases to run.
        seed: Seeds the arrivals (the same in every phase).
        client_timeout_s: A request not answered within this fails.
        scheduler: More of the edge's ``[scheduler]`` keys.
    """

    instances: int = 2
    max_concurrency: int = 4
    output_tokens: int = 32
    ttft_s: float = 0.05
    tokens_per_s: float = 50.0
    interactive_pct: float = 20.0
    background_pct: float = 150.0
    duration_s: float = 20.0
    reserved_slot_fraction: float = 0.5
    priority_overflow_slots: int = 4
    phases: list[Phase] = msgspec.field(default_factory=lambda: list(PHASES))
    seed: int = 0
    client_timeout_s: float = 60.0
    scheduler: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.instances < 1 or self.max_concurrency < 1:
            raise ValueError("instances and max_concurrency must be >= 1")
        if self.duration_s <= 0 or self.interactive_pct <= 0 or self.background_pct < 0:
            raise ValueError("duration_s and interactive_pct must be > 0, background_pct >= 0")

    @property
    def capacity(self) -> float:
        """Runs the slots finish a second."""
        run_s = self.ttft_s + self.output_tokens / self.tokens_per_s
        return self.instances * self.max_concurrency / run_s


def _smoke(opts: Options) -> Options:
    return msgspec.structs.replace(
        opts, instances=1, max_concurrency=2, output_tokens=4, tokens_per_s=200.0, duration_s=2.0
    )


async def _drive(url: str, opts: Options, background: bool, objective: bool) -> list[TimedSample]:
    cap = opts.capacity
    plan = [
        (at, "interactive")
        for at in poisson_arrivals(
            cap * opts.interactive_pct / 100, opts.duration_s, random.Random(f"{opts.seed}/i")
        )
    ]
    if background:
        plan += [
            (at, "batch")
            for at in poisson_arrivals(
                cap * opts.background_pct / 100, opts.duration_s, random.Random(f"{opts.seed}/b")
            )
        ]
    plan.sort()
    async with load_client(opts.client_timeout_s, keepalive=512) as client:

        async def send(s: TimedSample) -> None:
            body = sim_stream_body(MODEL, s, opts.output_tokens)
            headers = {"x-iop-objective": s.label} if objective else {}
            await timed_stream(
                client, url + "/v1/chat/completions", s, body, opts.client_timeout_s, headers
            )

        return await open_loop(trio.current_time() + 0.05, plan, send)


def _start_sims(stack: Stack, opts: Options) -> list[str]:
    flags = [
        "--model", MODEL,
        "--ttft", f"{opts.ttft_s:g}",
        "--tokens-per-s", f"{opts.tokens_per_s:g}",
        "--output-tokens", str(opts.output_tokens),
        "--reasoning-tokens", "0",
        "--max-num-seqs", str(opts.max_concurrency),
        "--scheduling-policy", "priority",
    ]  # fmt: skip
    return [url for _, url in start_sims(stack, opts.instances, *flags)]


def _phase_scheduler(opts: Options, phase: Phase) -> dict[str, Any]:
    """The edge's ``[scheduler]`` in ``phase``."""
    own: dict[str, Any] = {}
    if phase == "queue_only":
        own = {"max_preemptions": 0}
    elif phase == "reserved":
        own = {"reserved_slot_fraction": opts.reserved_slot_fraction}
    elif phase == "engine_priority":
        own = {"priority_overflow_slots": opts.priority_overflow_slots}
    return {"max_queue": 64, **opts.scheduler, **own}


def _start_cluster(
    stack: Stack, opts: Options, sims: list[str], tag: str, phase: Phase
) -> tuple[Proc, Proc, str]:
    config = {"scheduler": _phase_scheduler(opts, phase), "objectives": OBJECTIVES}
    edge, url, link = start_edge(stack, config, name=f"edge-{tag}")
    engine = {"engine_priority": True} if phase == "engine_priority" else {}
    instances = [
        {"adapter": "vllm", "name": f"gpu{i}", "endpoint": sim, "max_concurrency": opts.max_concurrency, **engine}
        for i, sim in enumerate(sims)
    ]  # fmt: skip
    node = start_node(stack, f"node-{tag}", link, {"probe_interval_s": 30.0}, instances)
    node.wait_stdout(NODE_READY)
    wait_instances(url, len(sims))
    return edge, node, url


def _engine_preemptions(sims: list[str]) -> int:
    """The sims' preemptions so far (``vllm:num_preemptions_total``)."""
    total = 0.0
    for sim in sims:
        page = httpx.get(sim + "/metrics", timeout=10.0, trust_env=False).text
        for line in page.splitlines():
            if line.startswith("vllm:num_preemptions_total"):
                total += float(line.split()[-1])
    return round(total)


def _figures(samples: list[TimedSample], duration_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("interactive", "batch"):
        mine = [s for s in samples if s.label == kind]
        if not mine:
            continue
        ok = [s for s in mine if s.status == 200 and not s.error]
        ttft = [s.ttft_s for s in ok]
        last = max((s.end for s in ok), default=0.0)
        first = min(s.scheduled for s in mine)
        span = max(duration_s, last - first)
        out[kind] = {
            "sent": len(mine),
            "answered": len(ok),
            "answers_per_s": round(len(ok) / span, 3),
            "refused_429": sum(1 for s in mine if s.status == 429),
            "failed_5xx": sum(1 for s in mine if s.status >= 500),
            "other_errors": dict(Counter(s.error for s in mine if s.error)),
            "ttft_ms": {
                "p50": pct_ms(ttft, 50),
                "p90": pct_ms(ttft, 90),
                "p99": pct_ms(ttft, 99),
            },
        }
    return out


@register(
    "objectives",
    Options,
    "Objectives under overload: interactive TTFT through a sheddable background flood, "
    "against the unloaded figure and against the same loads without objectives.",
    report=tables_report(__name__),
)
def run(opts: Options, ctx: RunContext) -> dict[str, Any]:
    """Every phase of ``opts`` on one set of sims, each with a fresh edge and node."""
    if ctx.smoke:
        opts = _smoke(opts)
    started = time.monotonic()
    phases: dict[str, Any] = {}
    with process_stack(ctx.python, ctx.workdir) as stack:
        sims = _start_sims(stack, opts)
        for phase in opts.phases:
            tag = f"r{ctx.repeat}-{phase}"
            edge, node, url = _start_cluster(stack, opts, sims, tag, phase)
            before = _engine_preemptions(sims)
            samples = trio.run(_drive, url, opts, phase != "unloaded", phase != "no_objectives")
            queue = httpx.get(url + "/admin/nodes", timeout=10.0, trust_env=False).json()["queue"]
            stack.stop(node)
            stack.stop(edge)
            phases[phase] = _figures(samples, opts.duration_s)
            phases[phase]["preempted"] = queue.get("preempted", 0)
            phases[phase]["overflowed"] = queue.get("priority_overflows", 0)
            phases[phase]["engine_preempted"] = _engine_preemptions(sims) - before
            with (ctx.workdir / f"samples-{tag}.jsonl").open("w") as f:
                for s in samples:
                    f.write(json.dumps(s.row("kind")) + "\n")
    return {
        "options": msgspec.to_builtins(opts),
        "capacity_per_s": round(opts.capacity, 2),
        "phases": phases,
        "elapsed_s": round(time.monotonic() - started, 1),
        "cpus": os.cpu_count(),
    }


def _f(v: Any, fmt: str) -> str:
    return "-" if not isinstance(v, int | float) else format(v, fmt)


def tables(result: dict[str, Any]) -> str:
    """One row per (phase, class): TTFT, goodput, refusals, failures."""
    rows = [
        "| phase | class | sent | answered/s | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms "
        "| 429 | 5xx | other errors | preempted | overflow seats | engine preempted |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for phase in PHASES:
        got = result.get("phases", {}).get(phase)
        if not got:
            continue
        for kind in ("interactive", "batch"):
            c = got.get(kind)
            if not c:
                continue
            t = c["ttft_ms"]
            other = sum(c["other_errors"].values()) if isinstance(c["other_errors"], dict) else 0
            preempted = _f(got.get("preempted"), ".0f") if kind == "batch" else ""
            overflowed = _f(got.get("overflowed"), ".0f") if kind == "interactive" else ""
            engine = _f(got.get("engine_preempted"), ".0f") if kind == "batch" else ""
            rows.append(
                f"| {phase} | {kind} | {_f(c['sent'], '.0f')} | {_f(c['answers_per_s'], '.2f')} "
                f"| {_f(t['p50'], '.0f')} | {_f(t['p90'], '.0f')} | {_f(t['p99'], '.0f')} "
                f"| {_f(c['refused_429'], '.0f')} | {_f(c['failed_5xx'], '.0f')} | {other} "
                f"| {preempted} | {overflowed} | {engine} |"
            )
    rows.append("")
    rows.append(f"Capacity {_f(result.get('capacity_per_s'), '.1f')} runs/s (the slots' rate).")
    return "\n".join(rows)


def plots(result: dict[str, Any], img_dir: Path) -> list[Path]:
    """No plot: the table says it."""
    del result, img_dir
    return []
