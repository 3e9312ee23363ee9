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

import contextlib
import dataclasses
import json
import math
import os
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx
import msgspec
import trio

from iop.bench._client import sse_data
from iop.bench._procs import Stack, machine_cpu_s, start_edge, start_node
from iop.bench._procs import proc_cpu_s as _cpu_s
from iop.bench._results import pct
from iop.bench._routing_report import (
    DEFAULT_PLACEMENTS,
    DEFAULT_WORKLOADS,
    Placement,
    Workload,
    report,
)
from iop.bench._runner import RunContext, register
from iop.sim import tokenize
from iop.testing import NODE_READY, SIM_READY, Proc, poll

__all__ = ["Options", "run"]

MODEL: Final = "iop-sim"
# Words of the prompts: 2 to 5 lower-case letters, one toy token each with
# its leading space (iop/sim/_tokenizer.py cuts a word with its leading space
# into pieces of at most 6 bytes).
_LETTERS: Final = "abcdefghijklmnopqrstuvwxyz"
# An agent's turn in the ``agents`` workload: the session's header (placement
# ``session`` only, ``iop.api._routing``).
SESSION_HEADER: Final = "x-iop-session-id"


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``routing`` runner's options (a scenario's ``[args]``).

    Attributes:
        workloads: Which workloads to run (``shared``, ``unique``).
        placements: Which placements to compare, each a cell per workload.
        instances: Engines (``iop sim`` processes), one ``vllm`` instance each.
        tenants: Distinct system prompts of the ``shared`` workload.
        prefix_tokens: Tokens of a system prompt.
        user_tokens: Tokens of a user turn.
        output_tokens: Tokens of an answer.
        rate: Requests per second offered (Poisson arrivals).
        requests: Requests in a cell's measured window.
        ttft_s: The sims' fixed time to first token (scheduling, one decode step).
        tokens_per_s: The sims' decode rate per request.
        prefill_tokens_per_s: The sims' prefill rate for uncached prompt tokens.
        kv_cache_blocks: Each sim's prefix cache, in blocks of ``kv_block_tokens``.
        kv_block_tokens: Tokens per cache block.
        max_num_seqs: Each sim's running batch; the rest wait in the engine.
        decode_slowdown: Each other running request stretches a token's delay so much.
        max_concurrency: The node's slots per instance (the edge's view).
        seed: Seeds the prompts and the arrivals (the same in every cell).
        client_timeout_s: A request not answered within this fails.
        scheduler: More of the edge's ``[scheduler]`` keys, for every cell
            (``placement`` and ``affinity`` are the cell's).
        prefix_tokens_min: When above 0, each tenant's system prompt has a
            length drawn between this and ``prefix_tokens``.
        zipf_s: Tenants' popularity: tenant i (from 1) is drawn in
            proportion to ``i ** -zipf_s`` (0: uniformly). 0.61 over 24
            tenants: the most popular 14 % of requests, the least 2 %.
        clients: When above 0, a closed loop: this many clients, each
            sending its next request when its last is answered (``rate``
            is then unused); the window is the ``requests`` after the
            warm-up, or what ``duration_s`` lets them send.
        duration_s: Closed loop only: the window ends after this long
            (0: after ``requests``).
        window_s: Misses (requests that found less than half their prompt
            cached) are also counted per window of this long, to show a
            trend.
        kv_events: The node reads each sim's KV cache events
            (``kv_events_path = "/kv_events"``), so prefix placement learns
            what the caches hold, not only their size.
        turn_tokens: In the ``agents`` workload, tokens of each assistant
            turn and of each tool result a session's transcript grows by.
    """

    workloads: list[Workload] = msgspec.field(default_factory=lambda: list(DEFAULT_WORKLOADS))
    placements: list[Placement] = msgspec.field(default_factory=lambda: list(DEFAULT_PLACEMENTS))
    instances: int = 4
    tenants: int = 32
    prefix_tokens: int = 2048
    user_tokens: int = 24
    output_tokens: int = 32
    rate: float = 12.0
    requests: int = 150
    ttft_s: float = 0.02
    tokens_per_s: float = 40.0
    prefill_tokens_per_s: float = 6000.0
    kv_cache_blocks: int = 1536
    kv_block_tokens: int = 16
    max_num_seqs: int = 8
    decode_slowdown: float = 0.05
    max_concurrency: int = 16
    seed: int = 0
    client_timeout_s: float = 60.0
    scheduler: dict[str, Any] = msgspec.field(default_factory=dict)
    prefix_tokens_min: int = 0
    zipf_s: float = 0.0
    clients: int = 0
    duration_s: float = 0.0
    window_s: float = 10.0
    kv_events: bool = False
    turn_tokens: int = 96

    def __post_init__(self) -> None:
        if self.instances < 1 or self.tenants < 1 or self.requests < 1:
            raise ValueError("instances, tenants and requests must be >= 1")
        if self.rate <= 0:
            raise ValueError("rate must be > 0")
        if not self.workloads or not self.placements:
            raise ValueError("workloads and placements must not be empty")
        if self.clients < 0 or self.duration_s < 0 or not self.window_s > 0:
            raise ValueError("clients and duration_s must be >= 0, window_s > 0")


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


# --------------------------------------------------------------------------- prompts


def _words(rng: random.Random, n: int) -> str:
    return "".join(" " + "".join(rng.choices(_LETTERS, k=rng.randint(2, 5))) for _ in range(n))


def _text(head: str, rng: random.Random, tokens: int) -> str:
    """``head`` and then random words: ``tokens`` toy tokens in all."""
    return head + _words(rng, max(0, tokens - len(tokenize(head))))


@dataclass(frozen=True)
class _Request:
    index: int
    at: float  # scheduled arrival, seconds after the cell's start
    tenant: int  # -1: the unique workload
    messages: list[dict[str, str]]
    measured: bool


def _requests(opts: Options, workload: Workload, salt: str) -> list[_Request]:
    """A cell's arrivals: the warm-up (one per tenant), then the window.

    The same seed gives every cell of a workload the same tenants' order,
    the same draws and the same gaps; ``salt`` (the cell's own first word)
    keeps the caches of earlier cells out of it.
    """
    # One generator per kind of draw: the arrivals and the tenants' order
    # are the same in both workloads whatever the prompts' words take.
    arrivals = random.Random(f"{opts.seed}/arrivals")
    draws = random.Random(f"{opts.seed}/tenants")
    rng = random.Random(f"{opts.seed}/words")
    lengths = random.Random(f"{opts.seed}/lengths")
    systems = [
        _text(
            f"cell {salt} tenant {t}",
            random.Random(f"{opts.seed}/{t}"),
            lengths.randint(opts.prefix_tokens_min, opts.prefix_tokens)
            if 0 < opts.prefix_tokens_min < opts.prefix_tokens
            else opts.prefix_tokens,
        )
        for t in range(opts.tenants)
    ]
    warm = list(range(opts.tenants))
    draws.shuffle(warm)
    if opts.zipf_s > 0:
        weights = [(t + 1) ** -opts.zipf_s for t in range(opts.tenants)]
        drawn = draws.choices(range(opts.tenants), weights=weights, k=opts.requests)
    else:
        drawn = [draws.randrange(opts.tenants) for _ in range(opts.requests)]
    tenants = warm + drawn
    out: list[_Request] = []
    at = 0.0
    # The agents' shared head: one system prompt and one brief for all (the
    # sub-agents of one fan-out), then each session's own growing turns.
    agents_system = _text(
        f"cell {salt} agents", random.Random(f"{opts.seed}/a"), opts.prefix_tokens
    )
    brief = _text(f"cell {salt} brief", random.Random(f"{opts.seed}/b"), opts.user_tokens)
    turns: dict[int, list[dict[str, str]]] = {}
    for i, tenant in enumerate(tenants):
        user = _text(f"request {i}", rng, opts.user_tokens)
        if workload == "agents":
            mine = turns.setdefault(tenant, [])
            out.append(
                _Request(
                    index=i,
                    at=at,
                    tenant=tenant,
                    messages=[
                        {"role": "system", "content": agents_system},
                        {"role": "user", "content": brief},
                        *mine,
                    ],
                    measured=i >= len(warm),
                )
            )
            k = len(mine) // 2
            turn = random.Random(f"{opts.seed}/{tenant}/{k}")
            mine.append(
                {
                    "role": "assistant",
                    "content": _text(f"agent {tenant} step {k}", turn, opts.turn_tokens),
                }
            )
            mine.append(
                {"role": "user", "content": _text(f"result {tenant} {k}", turn, opts.turn_tokens)}
            )
            at += arrivals.expovariate(opts.rate)
            continue
        if workload == "shared":
            system = systems[tenant]
        else:
            system = _text(f"cell {salt} request {i}", rng, opts.prefix_tokens)
            tenant = -1
        out.append(
            _Request(
                index=i,
                at=at,
                tenant=tenant,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
                measured=i >= len(warm),
            )
        )
        at += arrivals.expovariate(opts.rate)
    return out


# --------------------------------------------------------------------------- the client


@dataclass
class _Sample:
    index: int
    tenant: int
    measured: bool
    scheduled: float  # trio clock
    run_id: str = ""
    ttft_s: float = math.nan
    end: float = math.nan
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


async def _one(
    client: httpx.AsyncClient, url: str, req: _Request, s: _Sample, sessions: bool
) -> None:
    body = {
        "model": MODEL,
        "messages": req.messages,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {SESSION_HEADER: f"agent-{req.tenant}"} if sessions and req.tenant >= 0 else {}
    try:
        async with client.stream(
            "POST", url + "/v1/chat/completions", json=body, headers=headers
        ) as r:
            if r.status_code != 200:
                s.error = f"http {r.status_code}"
                await r.aread()
                return
            buf = b""
            async for piece in r.aiter_raw():
                payloads, buf = sse_data(buf + piece)
                for payload in payloads:
                    if payload != b"[DONE]":
                        _take(s, json.loads(payload))
        s.end = trio.current_time()
        if math.isnan(s.ttft_s):
            s.error = "no content"
    except httpx.HTTPError as exc:
        s.error = type(exc).__name__


def _take(s: _Sample, chunk: dict[str, Any]) -> None:
    """What one chunk of the stream tells: its run, its first content, the usage."""
    if not s.run_id:
        s.run_id = str(chunk.get("id", "")).removeprefix("chatcmpl-")
    if math.isnan(s.ttft_s):
        for choice in chunk.get("choices") or ():
            if (choice.get("delta") or {}).get("content"):
                s.ttft_s = trio.current_time() - s.scheduled
                break
    usage = chunk.get("usage")
    if usage:
        s.completion_tokens = int(usage.get("completion_tokens") or 0)
        s.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        s.cached_tokens = int(details.get("cached_tokens") or 0)


async def _drive(
    url: str, reqs: list[_Request], timeout_s: float, sessions: bool = False
) -> tuple[list[_Sample], float]:
    """Send ``reqs`` at their scheduled times, whatever is still outstanding."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    samples: list[_Sample] = []
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        t0 = trio.current_time() + 0.05
        async with trio.open_nursery() as nursery:
            for req in reqs:
                await trio.sleep_until(t0 + req.at)
                s = _Sample(req.index, req.tenant, req.measured, t0 + req.at)
                samples.append(s)
                nursery.start_soon(_one, client, url, req, s, sessions)
    return samples, t0


async def _drive_closed(
    url: str,
    reqs: list[_Request],
    timeout_s: float,
    clients: int,
    duration_s: float,
    sessions: bool = False,
) -> tuple[list[_Sample], float]:
    """``clients`` closed loops over ``reqs`` in order: the warm-up first
    (one request per tenant, as many at once as there are clients, as
    clients that arrive together would send them; the window starts when
    the last is answered), then each client sends its next request as its
    last ends, until ``reqs`` or ``duration_s`` of the window run out."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    samples: list[_Sample] = []
    warm = iter([r for r in reqs if not r.measured])
    window = iter([r for r in reqs if r.measured])
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        t0 = trio.current_time()
        end = math.inf

        async def loop(todo: Iterator[_Request]) -> None:
            for req in todo:
                now = trio.current_time()
                if now >= end:
                    return
                s = _Sample(req.index, req.tenant, req.measured, now)
                samples.append(s)
                await _one(client, url, req, s, sessions)

        for todo in (warm, window):
            if todo is window and duration_s > 0:
                end = trio.current_time() + duration_s
            async with trio.open_nursery() as nursery:
                for _ in range(clients):
                    nursery.start_soon(loop, todo)
    return samples, t0


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
    sims = [stack.launch(f"sim{i}", "sim", "--port", "0", *flags) for i in range(opts.instances)]
    return [(p, p.wait_stdout(SIM_READY)[1]) for p in sims]


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
    with httpx.Client(timeout=5.0, trust_env=False) as c:

        def ready() -> bool:
            nodes = c.get(url + "/admin/nodes").json().get("nodes", [])
            return any(len(n.get("instances", [])) == len(sims) for n in nodes)

        poll(ready, timeout=30.0, what="the node's instances at the edge", interval=0.1)
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


# --------------------------------------------------------------------------- figures


def _pct(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile; None with no values."""
    v = pct(values, p)
    return None if math.isnan(v) else v


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


def _placements(export: Path) -> dict[str, tuple[str, str, dict[str, float]]]:
    """run id -> (instance, why, scores) of its last placement, from the exported timelines."""
    out: dict[str, tuple[str, str, dict[str, float]]] = {}
    if not export.exists():
        return out
    for line in export.read_text().splitlines():
        with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
            tl = json.loads(line)
            p = tl["placements"][-1]
            out[str(tl["run_id"])] = (str(p["instance"]), str(p["why"]), dict(p["scores"]))
    return out


def _rule(why: str) -> str:
    """A placement's rule, without its numbers: ``prefix``, ``least-loaded: ...``."""
    head, _, rest = why.partition(":")
    if head == "least-loaded" and rest:
        return "least-loaded (balance)"
    return head or "?"


def _cell_figures(
    samples: list[_Sample], placements: dict[str, tuple[str, str, dict[str, float]]]
) -> dict[str, Any]:
    win = [s for s in samples if s.measured]
    ok = [s for s in win if not s.error]
    ttft = [s.ttft_s for s in ok]
    first = min(s.scheduled for s in win)
    last = max((s.end for s in ok), default=first)
    span = max(last - first, 1e-9)
    prompt = sum(s.prompt_tokens for s in ok)
    cached = sum(s.cached_tokens for s in ok)
    where = [placements.get(s.run_id) for s in ok]
    per_instance = Counter(w[0] for w in where if w is not None)
    rules = Counter(_rule(w[1]) for w in where if w is not None)
    spread: dict[int, set[str]] = {}
    for s, w in zip(ok, where, strict=True):
        if s.tenant >= 0 and w is not None:
            spread.setdefault(s.tenant, set()).add(w[0])
    hits = [s for s in ok if s.prompt_tokens and s.cached_tokens * 2 >= s.prompt_tokens]
    return {
        "requests": len(win),
        "errors": dict(Counter(s.error for s in win if s.error)),
        "ttft_ms": {
            "p50": _ms(_pct(ttft, 50)),
            "p90": _ms(_pct(ttft, 90)),
            "p99": _ms(_pct(ttft, 99)),
            "mean": _ms(statistics.fmean(ttft)) if ttft else None,
            "hit_p50": _ms(_pct([s.ttft_s for s in hits], 50)),
            "miss_p50": _ms(_pct([s.ttft_s for s in ok if s not in hits], 50)),
        },
        "e2e_ms_p50": _ms(_pct([s.end - s.scheduled for s in ok], 50)),
        "throughput_tok_s": round(sum(s.completion_tokens for s in ok) / span, 2),
        "answers_per_s": round(len(ok) / span, 3),
        "span_s": round(span, 3),
        "hit_rate": round(cached / prompt, 4) if prompt else None,
        "hit_requests": round(len(hits) / len(ok), 4) if ok else None,
        "prompt_tokens_mean": round(prompt / len(ok), 1) if ok else None,
        "per_instance": dict(sorted(per_instance.items())),
        "rules": dict(rules),
        "instances_per_tenant": (
            round(statistics.fmean(len(v) for v in spread.values()), 2) if spread else None
        ),
        "timelines_found": sum(1 for w in where if w is not None),
    }


def _misses_per_window(samples: list[_Sample], window_s: float) -> list[float | None]:
    """The window's misses (answers that found less than half their prompt
    cached) per ``window_s`` of sending time, as shares of its answers."""
    ok = [s for s in samples if s.measured and not s.error and s.prompt_tokens]
    if not ok:
        return []
    first = min(s.scheduled for s in ok)
    bins: dict[int, list[bool]] = {}
    for s in ok:
        bins.setdefault(int((s.scheduled - first) // window_s), []).append(
            s.cached_tokens * 2 < s.prompt_tokens
        )
    return [
        round(sum(bins[i]) / len(bins[i]), 4) if bins.get(i) else None for i in range(max(bins) + 1)
    ]


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
    reqs = _requests(opts, workload, tag)
    before = _sim_counters(urls)
    cpu0 = {k: _cpu_s(p.pid) for k, p in procs.items()}
    me0, busy0, t0 = time.process_time(), machine_cpu_s()[0], time.monotonic()
    load0 = os.getloadavg()[0]
    sessions = placement == "session"
    if opts.clients > 0:
        samples, _ = trio.run(
            _drive_closed,
            url,
            reqs,
            opts.client_timeout_s,
            opts.clients,
            opts.duration_s,
            sessions,
        )
    else:
        samples, _ = trio.run(_drive, url, reqs, opts.client_timeout_s, sessions)
    wall = time.monotonic() - t0
    cpu = {k: round(_cpu_s(p.pid) - cpu0[k], 3) for k, p in procs.items()}
    client_cpu = time.process_time() - me0
    busy = machine_cpu_s()[0] - busy0
    after = _sim_counters(urls)
    stack.stop(node)
    stack.stop(edge)  # flushes the timelines' export
    placements = _placements(export)
    with (stack.logdir / f"samples-{tag}.jsonl").open("w") as f:
        for s in samples:
            where = placements.get(s.run_id, ("", "", {}))
            row = dataclasses.asdict(s) | dict(
                zip(("instance", "why", "scores"), where, strict=True)
            )
            f.write(json.dumps(row) + "\n")
    ours = sum(cpu.values()) + client_cpu
    queries = sum(a.get("prefix_cache_queries_total", 0) - b.get("prefix_cache_queries_total", 0)
                  for a, b in zip(after, before, strict=True))  # fmt: skip
    hits = sum(a.get("prefix_cache_hits_total", 0) - b.get("prefix_cache_hits_total", 0)
               for a, b in zip(after, before, strict=True))  # fmt: skip
    return {
        "workload": workload,
        "placement": placement,
        **_cell_figures(samples, placements),
        "misses_per_window": _misses_per_window(samples, opts.window_s),
        "sim_metrics_hit_rate": round(hits / queries, 4) if queries else None,
        "wall_s": round(wall, 2),
        "cpu_s": cpu | {"client": round(client_cpu, 3)},
        "foreign_cpu_pct": round(max(0.0, busy - ours) / wall * 100, 1),
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
    stack = Stack(ctx.python, ctx.workdir)
    # The placements' order turns with the repeat, so none always runs first.
    k = ctx.repeat % len(opts.placements)
    order = opts.placements[k:] + opts.placements[:k]
    cells: list[dict[str, Any]] = []
    try:
        sims = _start_sims(stack, opts)
        for workload in opts.workloads:
            for placement in order:
                tag = f"r{ctx.repeat}-{workload}-{placement}"
                cells.append(_cell(stack, opts, workload, placement, sims, tag))
    finally:
        stack.stop_all()
    return {
        "options": msgspec.to_builtins(opts),
        "repeat": ctx.repeat,
        "smoke": ctx.smoke,
        "cells": cells,
        "elapsed_s": round(time.monotonic() - started, 1),
        "cpus": os.cpu_count(),
    }
