"""Placement against a prefix cache: random, least-loaded, affinity, prefix-aware.

The measurement of ``[scheduler] placement`` in docs/benchmarks.md
("Placement: prefix-aware against least-loaded"). Four ``iop sim``
processes stand for four engines (each its own KV prefix cache, prefill
time and running batch: ``iop/sim/_engine.py``), behind one ``iop node`` with
one ``vllm`` instance per sim, behind an ``iop edge`` started once per
placement. A Poisson load generator in this process sends streamed chat
completions; each *cell* is one (workload, placement) pair.

Workloads
---------
``shared``
    ``tenants`` tenants, each with its own system prompt of about
    ``prefix_tokens`` tokens (seeded random words, one toy token each), and
    a short unique user turn of ``user_tokens`` tokens. Each request's
    tenant is drawn uniformly. An instance's cache holds ``kv_cache_blocks``
    blocks, fewer than every tenant's prefix (the defaults: 12 of 32 per
    instance, 48 across four), so which tenants meet on which instance
    decides the hit rate.
``unique``
    The same lengths, every prompt different from its first word: nothing
    to reuse; what it measures is whether a placement's preference for
    cached prefixes costs load balance.

``agents``
    ``tenants`` agent sessions (the sub-agents of one fan-out: one system
    prompt and one brief for all of them, the conversation's head), each
    request a session's next turn: its transcript so far, grown by an
    assistant turn and a tool result of ``turn_tokens`` tokens each. The
    head is the same for every session, so the head's affinity key cannot
    tell them apart; a session key can (docs/benchmarks.md, "Sessions as
    queue keys", ``configs/bench/sessions.toml``).

Placements: ``random``; ``least_loaded`` with ``affinity = false``;
``affinity`` (``least_loaded`` with ``affinity = true``: a conversation,
here a tenant's system prompt plus its user turn, goes back to the instance
that served it); ``session`` (``affinity`` with each agent session's
``x-iop-session-id`` header, ``agents`` only); ``prefix``
(``iop/edge/scheduler/_prefix.py``).

A cell's measurement
--------------------
A fresh edge and node (the placement's state starts empty). The sims stay
up for the whole run, and every cell's prompts start with a word of their
own, so no block cached in an earlier cell can match: a full LRU cache of
dead blocks behaves as an empty one. The warm-up sends one request per
tenant (a random order) at the measured rate; the window is the next
``requests`` arrivals. Figures of the window's requests:

* TTFT from the *scheduled* arrival (a late client counts against the
  system, not for it) to the first content chunk; p50, p90, p99;
* throughput: completion tokens of the window's answers over the time from
  its first arrival to its last answer; and answers per second;
* hit rate: ``usage.prompt_tokens_details.cached_tokens`` over
  ``prompt_tokens`` of the window's answers (the sim's own count of the
  blocks it found cached; its ``/metrics`` counters over the whole cell are
  kept too);
* placement: how often each rule decided (the timelines' ``why``, exported
  by the edge to JSONL), runs per instance, and on how many instances each
  tenant's requests ran;
* CPU of every process of the run over the window, and the machine's busy
  CPU that none of them used ("foreign", % of one core).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

from iop.bench._procs import (
    CpuWindow,
    Stack,
    process_stack,
    start_edge,
    start_node,
    start_sims,
    wait_instances,
)
from iop.bench._routing_load import (
    MODEL,
    Options,
    cell_figures,
    drive,
    drive_closed,
    misses_per_window,
    placements_of,
    requests,
)
from iop.bench._routing_report import Placement, Workload, report
from iop.bench._runner import RunContext, register
from iop.testing import NODE_READY, Proc, poll

__all__ = ["Options", "run"]


def _smoke(opts: Options) -> Options:
    """Seconds, not minutes: two engines, a few tenants, short prompts."""
    return msgspec.structs.replace(
        opts,
        instances=2,
        tenants=3,
        prefix_tokens=96,
        user_tokens=8,
        output_tokens=4,
        rate=40.0,
        requests=8,
        ttft_s=0.0,
        tokens_per_s=0.0,
        kv_cache_blocks=16,
        client_timeout_s=20.0,
    )


# --------------------------------------------------------------------------- processes


def _start_sims(stack: Stack, opts: Options) -> list[tuple[Proc, str]]:
    flags = [
        "--model", MODEL,
        "--ttft", f"{opts.ttft_s:g}",
        "--tokens-per-s", f"{opts.tokens_per_s:g}",
        "--output-tokens", str(opts.output_tokens),
        "--reasoning-tokens", "0",
        "--prefill-tokens-per-s", f"{opts.prefill_tokens_per_s:g}",
        "--kv-cache-blocks", str(opts.kv_cache_blocks),
        "--kv-block-tokens", str(opts.kv_block_tokens),
        "--max-num-seqs", str(opts.max_num_seqs),
        "--decode-slowdown", f"{opts.decode_slowdown:g}",
    ]  # fmt: skip
    return start_sims(stack, opts.instances, *flags)


def _edge_config(
    placement: Placement, export: Path, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    scheduler: dict[str, Any] = {
        **(extra or {}),
        "placement": "least_loaded" if placement in ("affinity", "session") else placement,
        "affinity": placement in ("affinity", "session", "prefix"),
    }
    return {"scheduler": scheduler, "timelines": {"export_path": str(export)}}


def _start_cluster(
    stack: Stack, opts: Options, placement: Placement, sims: list[str], tag: str
) -> tuple[Proc, Proc, str, Path]:
    export = stack.logdir / f"timelines-{tag}.jsonl"
    config = _edge_config(placement, export, opts.scheduler)
    edge, url, link = start_edge(stack, config, name=f"edge-{tag}")
    instances = [
        {
            "adapter": "vllm",
            "name": f"gpu{i}",
            "endpoint": sim,
            "max_concurrency": opts.max_concurrency,
            **({"kv_events_path": "/kv_events"} if opts.kv_events else {}),
        }
        for i, sim in enumerate(sims)
    ]
    node_cfg = {"id": "node", "probe_interval_s": 30.0}
    node = start_node(stack, f"node-{tag}", link, node_cfg, instances)
    node.wait_stdout(NODE_READY)
    wait_instances(url, len(sims))
    return edge, node, url, export


def _sim_counters(sims: list[str]) -> list[dict[str, float]]:
    out = []
    with httpx.Client(timeout=5.0, trust_env=False) as c:
        for sim in sims:
            text = c.get(sim + "/metrics").text
            vals: dict[str, float] = {}
            for line in text.splitlines():
                if line.startswith("vllm:"):
                    name, _, value = line.partition(" ")
                    vals[name.split("{", 1)[0].removeprefix("vllm:")] = float(value)
            out.append(vals)
    return out


def _wait_idle(sims: list[str]) -> None:
    poll(
        lambda: all(
            v.get("num_requests_running", 0) == 0 and v.get("num_requests_waiting", 0) == 0
            for v in _sim_counters(sims)
        ),
        timeout=60.0,
        what="the sims to finish their requests",
        interval=0.2,
    )


# --------------------------------------------------------------------------- the run


def _cell(
    stack: Stack,
    opts: Options,
    workload: Workload,
    placement: Placement,
    sims: list[tuple[Proc, str]],
    tag: str,
) -> dict[str, Any]:
    urls = [u for _, u in sims]
    _wait_idle(urls)
    edge, node, url, export = _start_cluster(stack, opts, placement, urls, tag)
    procs = {"edge": edge, "node": node} | {p.name: p for p, _ in sims}
    reqs = requests(opts, workload, tag)
    before = _sim_counters(urls)
    window = CpuWindow({k: p.pid for k, p in procs.items()})
    load0 = os.getloadavg()[0]
    sessions = placement == "session"
    if opts.clients > 0:
        samples = trio.run(
            drive_closed,
            url,
            reqs,
            opts.client_timeout_s,
            opts.clients,
            opts.duration_s,
            sessions,
        )
    else:
        samples = trio.run(drive, url, reqs, opts.client_timeout_s, sessions)
    cpu = window.stop()
    after = _sim_counters(urls)
    # The prefix index at the cell's end: its homes, and the replicas made
    # and dropped over the cell (docs/operations.md, "What the caches hold").
    with httpx.Client(timeout=5.0, trust_env=False) as c:
        routing = c.get(url + "/admin/nodes").json().get("routing", {})
    stack.stop(node)
    stack.stop(edge)  # flushes the timelines' export
    placements = placements_of(export)
    with (stack.logdir / f"samples-{tag}.jsonl").open("w") as f:
        for s in samples:
            where = placements.get(s.run_id, ("", "", {}))
            row = dataclasses.asdict(s) | dict(
                zip(("instance", "why", "scores"), where, strict=True)
            )
            f.write(json.dumps(row) + "\n")
    queries = sum(a.get("prefix_cache_queries_total", 0) - b.get("prefix_cache_queries_total", 0)
                  for a, b in zip(after, before, strict=True))  # fmt: skip
    hits = sum(a.get("prefix_cache_hits_total", 0) - b.get("prefix_cache_hits_total", 0)
               for a, b in zip(after, before, strict=True))  # fmt: skip
    return {
        "workload": workload,
        "placement": placement,
        **cell_figures(samples, placements),
        "misses_per_window": misses_per_window(samples, opts.window_s),
        "sim_metrics_hit_rate": round(hits / queries, 4) if queries else None,
        "prefix_index": routing.get("prefix_index"),
        "wall_s": round(cpu["wall_s"], 2),
        "cpu_s": cpu["cpu_s"],
        "foreign_cpu_pct": cpu["foreign_cpu_pct_of_core"],
        "load_avg": [round(load0, 2), round(os.getloadavg()[0], 2)],
    }


@register(
    "routing",
    Options,
    "Placement against a prefix cache: TTFT, throughput and hit rate of random, "
    "least-loaded, affinity and prefix-aware placement on shared and unique prompts.",
    report=report,
)
def run(opts: Options, ctx: RunContext) -> dict[str, Any]:
    """Every (workload, placement) cell of ``opts`` on one set of sims."""
    if ctx.smoke:
        opts = _smoke(opts)
    started = time.monotonic()
    # The placements' order turns with the repeat, so none always runs first.
    k = ctx.repeat % len(opts.placements)
    order = opts.placements[k:] + opts.placements[:k]
    cells: list[dict[str, Any]] = []
    with process_stack(ctx.python, ctx.workdir) as stack:
        sims = _start_sims(stack, opts)
        for workload in opts.workloads:
            for placement in order:
                tag = f"r{ctx.repeat}-{workload}-{placement}"
                cells.append(_cell(stack, opts, workload, placement, sims, tag))
    return {
        "options": msgspec.to_builtins(opts),
        "repeat": ctx.repeat,
        "smoke": ctx.smoke,
        "cells": cells,
        "elapsed_s": round(time.monotonic() - started, 1),
        "cpus": os.cpu_count(),
    }
