"""The routing runner's load: its options, each workload's requests, the
client that sends them, and the figures of what the client saw.

The workloads, the placements and what a cell measures are described in
``iop/bench/_routing.py``, which starts the processes and runs the cells;
this module runs in the benchmark's own process only. Requests are drawn
from seeded generators (``requests``), so every cell of a workload sends the
same tenants in the same order at the same times; ``drive`` sends them open
loop (Poisson arrivals), ``drive_closed`` as closed-loop clients, each
request into a ``Sample``; ``cell_figures`` and ``misses_per_window`` turn a
cell's samples into its figures.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import statistics
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx
import msgspec
import trio

from iop.bench._client import load_client, read_sse
from iop.bench._results import pct_ms
from iop.bench._routing_report import (
    DEFAULT_PLACEMENTS,
    DEFAULT_WORKLOADS,
    Placement,
    Workload,
)
from iop.sim import tokenize

__all__ = [
    "MODEL",
    "SESSION_HEADER",
    "Options",
    "Request",
    "Sample",
    "cell_figures",
    "drive",
    "drive_closed",
    "misses_per_window",
    "placements_of",
    "requests",
]

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


# --------------------------------------------------------------------------- prompts


def _words(rng: random.Random, n: int) -> str:
    return "".join(" " + "".join(rng.choices(_LETTERS, k=rng.randint(2, 5))) for _ in range(n))


def _text(head: str, rng: random.Random, tokens: int) -> str:
    """``head`` and then random words: ``tokens`` toy tokens in all."""
    return head + _words(rng, max(0, tokens - len(tokenize(head))))


@dataclass(frozen=True)
class Request:
    index: int
    at: float  # scheduled arrival, seconds after the cell's start
    tenant: int  # -1: the unique workload
    messages: list[dict[str, str]]
    measured: bool


def requests(opts: Options, workload: Workload, salt: str) -> list[Request]:
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
    out: list[Request] = []
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
                Request(
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
            Request(
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
class Sample:
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
    client: httpx.AsyncClient, url: str, req: Request, s: Sample, sessions: bool, timeout_s: float
) -> None:
    body = {
        "model": MODEL,
        "messages": req.messages,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {SESSION_HEADER: f"agent-{req.tenant}"} if sessions and req.tenant >= 0 else {}
    # httpx's timeout bounds each read; this, the whole answer.
    with trio.move_on_after(timeout_s) as deadline:
        try:
            async with client.stream(
                "POST", url + "/v1/chat/completions", json=body, headers=headers
            ) as r:
                if r.status_code != 200:
                    s.error = f"http {r.status_code}"
                    await r.aread()
                    return
                await read_sse(r, lambda payload: _take(s, json.loads(payload)))
            s.end = trio.current_time()
            if math.isnan(s.ttft_s):
                s.error = "no content"
        except httpx.HTTPError as exc:
            s.error = type(exc).__name__
    if deadline.cancelled_caught:
        s.error = "timeout"


def _take(s: Sample, chunk: dict[str, Any]) -> None:
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


async def drive(
    url: str, reqs: list[Request], timeout_s: float, sessions: bool = False
) -> list[Sample]:
    """Send ``reqs`` at their scheduled times, whatever is still outstanding."""
    samples: list[Sample] = []
    async with load_client(timeout_s, keepalive=256) as client:
        t0 = trio.current_time() + 0.05
        async with trio.open_nursery() as nursery:
            for req in reqs:
                await trio.sleep_until(t0 + req.at)
                s = Sample(req.index, req.tenant, req.measured, t0 + req.at)
                samples.append(s)
                nursery.start_soon(_one, client, url, req, s, sessions, timeout_s)
    return samples


async def drive_closed(
    url: str,
    reqs: list[Request],
    timeout_s: float,
    clients: int,
    duration_s: float,
    sessions: bool = False,
) -> list[Sample]:
    """``clients`` closed loops over ``reqs`` in order: the warm-up first
    (one request per tenant, as many at once as there are clients, as
    clients that arrive together would send them; the window starts when
    the last is answered), then each client sends its next request as its
    last ends, until ``reqs`` or ``duration_s`` of the window run out."""
    samples: list[Sample] = []
    warm = iter([r for r in reqs if not r.measured])
    window = iter([r for r in reqs if r.measured])
    async with load_client(timeout_s, keepalive=256) as client:
        end = math.inf

        async def loop(todo: Iterator[Request]) -> None:
            for req in todo:
                now = trio.current_time()
                if now >= end:
                    return
                s = Sample(req.index, req.tenant, req.measured, now)
                samples.append(s)
                await _one(client, url, req, s, sessions, timeout_s)

        for todo in (warm, window):
            if todo is window and duration_s > 0:
                end = trio.current_time() + duration_s
            async with trio.open_nursery() as nursery:
                for _ in range(clients):
                    nursery.start_soon(loop, todo)
    return samples


# --------------------------------------------------------------------------- figures


def placements_of(export: Path) -> dict[str, tuple[str, str, dict[str, float]]]:
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


def cell_figures(
    samples: list[Sample], placements: dict[str, tuple[str, str, dict[str, float]]]
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
            "p50": pct_ms(ttft, 50),
            "p90": pct_ms(ttft, 90),
            "p99": pct_ms(ttft, 99),
            "mean": round(statistics.fmean(ttft) * 1000, 1) if ttft else None,
            "hit_p50": pct_ms([s.ttft_s for s in hits], 50),
            "miss_p50": pct_ms([s.ttft_s for s in ok if s not in hits], 50),
        },
        "e2e_ms_p50": pct_ms([s.end - s.scheduled for s in ok], 50),
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


def misses_per_window(samples: list[Sample], window_s: float) -> list[float | None]:
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
