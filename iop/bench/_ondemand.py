"""``ondemand``: models on demand against every model loaded everywhere.

The measurement of docs/benchmarks.md, "Models on demand". ``nodes`` ``iop
node`` processes behind one ``iop edge``, each offering the same
``models`` on-demand ``sim`` models (``[[models]]``, ``engine = "sim"``:
a load takes ``load_time_s``, each model ``memory_mib``). Two modes, each a
fresh edge and nodes and the same request plan:

``on_demand``
    Each node's ``memory_mib`` holds ``per_node`` models: a request for a
    model its node does not hold loads it there (evicting the least recently
    used), and the edge queues it meanwhile and prefers a node that has the
    model loaded (docs/operations.md, "Models on demand").
``all_loaded``
    Each node's budget holds every model and every model is ``pinned``: all
    are loaded before the first request (the reference: no load ever).

The plan (``plan``) is open-loop Poisson arrivals at ``rate_per_s`` for
``duration_s``, each for a model drawn from a Zipf distribution of exponent
``zipf_s`` over the models' popularity ranks; every ``phase_s`` the ranking
rotates by ``rotate`` places (what is hot changes over time, as tenants'
traffic does), so the on-demand nodes must load and evict as it moves.

Figures per mode: TTFT p50 and p99 (from the scheduled arrival to the first
content chunk, streamed chat completions), failures; cold starts (the
edge's ``iop_model_cold_starts_total``: runs that found their model not
loaded on their node) and their rate over the requests, loads and
evictions; and the memory the nodes held (``/admin/nodes`` polled every
``sample_s``, each node's ``memory_mib.used``), integrated over the traffic
window into MiB-seconds, against ``nodes * models * memory_mib`` held for
that window: what keeping every model loaded everywhere costs.
"""

from __future__ import annotations

import bisect
import json
import math
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final, Literal

import httpx
import msgspec
import trio

from iop.bench._client import TimedSample, load_client, open_loop, stream_body, timed_stream
from iop.bench._procs import Stack, process_stack, start_edge, start_node
from iop.bench._results import pct_ms
from iop.bench._runner import RunContext, register, tables_report

__all__ = [
    "MODES",
    "Arrival",
    "Options",
    "memory_seconds",
    "metric_sums",
    "plan",
    "run",
    "zipf_weights",
]

Mode = Literal["on_demand", "all_loaded"]
MODES: Final[tuple[Mode, ...]] = ("on_demand", "all_loaded")
# Deadlines far above what they bound on a loaded 2-core machine: nodes
# joining with their models, every model of the all-loaded nodes ready.
_JOIN_S: Final = 60.0
# Points of the memory series kept for the plot (the samples are thinned to it).
_SERIES_POINTS: Final = 400
# Points of each mode's TTFT distribution kept for the plot.
_CDF_POINTS: Final = 200


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``[args]`` of an ``ondemand`` scenario.

    Attributes:
        models: Models every node offers (``m0``, ``m1``, ...).
        nodes: ``iop node`` processes.
        per_node: Models a node's memory holds at once (on demand).
        memory_mib: Each model's memory.
        load_time_s: How long a model's load takes (``sim.load_time_s``).
        duration_s: The traffic window.
        rate_per_s: Poisson arrivals a second, over all models.
        zipf_s: The exponent of the popularity (rank r drawn with weight 1/r^s).
        phase_s: Every this many seconds the ranking rotates ...
        rotate: ... by this many places.
        output_tokens: Tokens of each answer.
        tokens_per_s: The sim's token rate.
        ttft_s: The sim's time to first token.
        max_concurrency: Runs at once per model and node.
        sample_s: How often the nodes' memory is read.
        client_timeout_s: One request's bound.
        seed: The plan's random seed.
        modes: Which modes to run.
    """

    models: int = 6
    nodes: int = 3
    per_node: int = 2
    memory_mib: int = 1000
    load_time_s: float = 3.0
    duration_s: float = 60.0
    rate_per_s: float = 5.0
    zipf_s: float = 1.1
    phase_s: float = 20.0
    rotate: int = 2
    output_tokens: int = 16
    tokens_per_s: float = 200.0
    ttft_s: float = 0.02
    max_concurrency: int = 8
    sample_s: float = 0.25
    client_timeout_s: float = 120.0
    seed: int = 1
    modes: list[Mode] = msgspec.field(default_factory=lambda: list(MODES))

    def __post_init__(self) -> None:
        if self.models < 1 or self.nodes < 1 or not 1 <= self.per_node <= self.models:
            raise ValueError("models and nodes must be >= 1, per_node within 1..models")
        if self.duration_s <= 0 or self.rate_per_s <= 0 or self.phase_s <= 0:
            raise ValueError("duration_s, rate_per_s and phase_s must be > 0")
        if self.zipf_s < 0 or self.sample_s <= 0:
            raise ValueError("zipf_s must be >= 0, sample_s > 0")

    @property
    def names(self) -> list[str]:
        return [f"m{i}" for i in range(self.models)]


def _smoke(opts: Options) -> Options:
    return msgspec.structs.replace(
        opts,
        models=3,
        nodes=1,
        per_node=2,
        load_time_s=0.3,
        duration_s=3.0,
        rate_per_s=5.0,
        phase_s=1.0,
        output_tokens=4,
        sample_s=0.1,
    )


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Arrival:
    """One request of the plan: when (seconds from the start) and for which model."""

    at_s: float
    model: str


def zipf_weights(n: int, s: float) -> list[float]:
    """The probabilities of ranks 1..n under Zipf's law with exponent ``s``."""
    raw = [1.0 / (r**s) for r in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def plan(opts: Options) -> list[Arrival]:
    """The requests of one run: Poisson arrivals, Zipf-ranked models, the
    ranking rotated by ``rotate`` every ``phase_s`` (module docstring).
    The same ``opts`` give the same plan."""
    rng = random.Random(opts.seed)
    names = opts.names
    cumulative: list[float] = []
    acc = 0.0
    for w in zipf_weights(len(names), opts.zipf_s):
        acc += w
        cumulative.append(acc)
    out: list[Arrival] = []
    at = rng.expovariate(opts.rate_per_s)
    while at < opts.duration_s:
        rank = min(bisect.bisect_left(cumulative, rng.random() * acc), len(names) - 1)
        shift = int(at // opts.phase_s) * opts.rotate
        out.append(Arrival(round(at, 6), names[(rank + shift) % len(names)]))
        at += rng.expovariate(opts.rate_per_s)
    return out


# --------------------------------------------------------------------------- figures


def memory_seconds(samples: list[tuple[float, float]], start: float, end: float) -> float:
    """The integral of a step function over ``[start, end]``: each sample
    ``(t, value)`` holds until the next (the first from ``start``)."""
    if not samples or end <= start:
        return 0.0
    total = 0.0
    for i, (t, value) in enumerate(samples):
        t0 = max(start, t if i else start)
        t1 = min(end, samples[i + 1][0]) if i + 1 < len(samples) else end
        if t1 > t0:
            total += value * (t1 - t0)
    return total


_SAMPLE = re.compile(r'^(iop_model_\w+_total)\{model="([^"]*)"\} (\S+)$', re.M)


def metric_sums(text: str) -> dict[str, float]:
    """``iop_model_*_total`` of a ``/metrics`` text, summed over models, by name
    without the prefix and suffix (``loads``, ``evictions``, ``cold_starts``, ...)."""
    out: dict[str, float] = {}
    for name, _, value in _SAMPLE.findall(text):
        key = name.removeprefix("iop_model_").removesuffix("_total")
        out[key] = out.get(key, 0.0) + float(value)
    return out


def _thin(points: list[tuple[float, float]], n: int) -> list[list[float]]:
    step = max(1, math.ceil(len(points) / n))
    return [[round(t, 3), v] for t, v in points[::step]]


def _quantiles(values: list[float], n: int) -> list[float]:
    vals = sorted(v for v in values if not math.isnan(v))
    if not vals:
        return []
    return [round(vals[min(len(vals) - 1, int(i * len(vals) / n))] * 1000, 1) for i in range(n)]


# --------------------------------------------------------------------------- a mode's run


@dataclass
class _Memory:
    points: list[tuple[float, float]] = field(default_factory=list)


def _model_config(opts: Options, name: str, pinned: bool) -> dict[str, Any]:
    return {
        "name": name,
        "engine": "sim",
        "memory_mib": opts.memory_mib,
        "pinned": pinned,
        "max_concurrency": opts.max_concurrency,
        "sim": {
            "model": name,
            "load_time_s": opts.load_time_s,
            "ttft_s": opts.ttft_s,
            "tokens_per_s": opts.tokens_per_s,
            "output_tokens": opts.output_tokens,
            "reasoning_tokens": 0,
        },
    }


def _start(stack: Stack, opts: Options, mode: Mode, tag: str) -> str:
    """A fresh edge and its nodes for ``mode``; the edge's URL once every
    node offers its models (all-loaded: once every model is ready)."""
    config = {
        # A run for a model that loads waits for it: room for a load or two.
        "scheduler": {"max_queue_delay_s": 0, "queue_timeout_s": opts.client_timeout_s},
        "deadlines": {"first_token_timeout_s": opts.client_timeout_s},
    }
    _, url, link = start_edge(stack, config, name=f"edge-{tag}")
    all_loaded = mode == "all_loaded"
    budget = opts.memory_mib * (opts.models if all_loaded else opts.per_node)
    for i in range(opts.nodes):
        start_node(
            stack,
            f"node{i}-{tag}",
            link,
            {"memory_mib": budget, "model_load_timeout_s": opts.client_timeout_s},
            [],
            models=[_model_config(opts, name, all_loaded) for name in opts.names],
        )
    want = "ready" if all_loaded else None

    def joined() -> bool:
        for p in stack.procs:
            if not p.alive:
                raise RuntimeError(f"{p.name} exited during start-up:\n{p.logs(tail=20)}")
        nodes = httpx.get(url + "/admin/nodes", timeout=5.0, trust_env=False).json()["nodes"]
        offered = [n for n in nodes if len(n.get("models", [])) == opts.models]
        if len(offered) < opts.nodes:
            return False
        return want is None or all(m["state"] == want for n in offered for m in n["models"])

    deadline = time.monotonic() + _JOIN_S + (opts.load_time_s * opts.models if all_loaded else 0)
    while not joined():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the nodes of {mode} were not ready within the deadline")
        time.sleep(0.2)
    return url


async def _one(client: httpx.AsyncClient, url: str, s: TimedSample, opts: Options) -> None:
    """One request for ``s``'s model; a refusal counts as its error, with its body."""
    body = stream_body(s.label, s, max_tokens=opts.output_tokens)
    await timed_stream(client, url + "/v1/chat/completions", s, body, opts.client_timeout_s)
    if s.status not in (0, 200) and not s.error:
        s.error = f"HTTP {s.status}: {s.refusal}"


async def _sample_memory(
    client: httpx.AsyncClient, url: str, every_s: float, memory: _Memory
) -> None:
    while True:
        r = await client.get(url + "/admin/nodes")
        used = sum(n.get("memory_mib", {}).get("used", 0) for n in r.json()["nodes"])
        memory.points.append((trio.current_time(), float(used)))
        await trio.sleep(every_s)


async def _drive(
    url: str, opts: Options, arrivals: list[Arrival]
) -> tuple[list[TimedSample], _Memory, float, float, str, str]:
    memory = _Memory()
    async with load_client(opts.client_timeout_s, keepalive=256) as client:
        before = (await client.get(url + "/metrics")).text
        async with trio.open_nursery() as sampler:
            sampler.start_soon(_sample_memory, client, url, opts.sample_s, memory)
            t0 = trio.current_time() + 0.05
            samples = await open_loop(
                t0, [(a.at_s, a.model) for a in arrivals], partial(_one, client, url, opts=opts)
            )
            end = trio.current_time()
            sampler.cancel_scope.cancel()
        after = (await client.get(url + "/metrics")).text
    return samples, memory, t0, end, before, after


def _figures(
    opts: Options,
    samples: list[TimedSample],
    memory: _Memory,
    start: float,
    end: float,
    before: str,
    after: str,
) -> dict[str, Any]:
    ok = [s for s in samples if s.status == 200 and not s.error]
    ttft = [s.ttft_s for s in ok]
    was, now = metric_sums(before), metric_sums(after)
    counts = {k: int(now.get(k, 0) - was.get(k, 0)) for k in now}
    window = end - start
    held = memory_seconds(memory.points, start, end)
    everywhere = opts.nodes * opts.models * opts.memory_mib * window
    return {
        "sent": len(samples),
        "answered": len(ok),
        "errors": dict(Counter(s.error for s in samples if s.error)),
        "ttft_ms": {"p50": pct_ms(ttft, 50), "p90": pct_ms(ttft, 90), "p99": pct_ms(ttft, 99)},
        "cold_starts": counts.get("cold_starts", 0),
        "cold_start_rate": round(counts.get("cold_starts", 0) / len(samples), 4)
        if samples
        else None,
        "loads": counts.get("loads", 0),
        "evictions": counts.get("evictions", 0),
        "load_failures": counts.get("load_failures", 0),
        "window_s": round(window, 2),
        "memory_mib_s": round(held),
        "all_loaded_mib_s": round(everywhere),
        "memory_share": round(held / everywhere, 4) if everywhere else None,
        "memory_series": _thin([(t - start, v) for t, v in memory.points], _SERIES_POINTS),
        "ttft_quantiles_ms": _quantiles(ttft, _CDF_POINTS),
    }


@register(
    "ondemand",
    Options,
    "Models on demand (6 models, memory for 2 per node, 3 nodes, a rotating Zipf mix) "
    "against every model loaded everywhere: cold starts, TTFT, memory held.",
    report=tables_report("iop.bench._ondemand_report"),
)
def run(opts: Options, ctx: RunContext) -> dict[str, Any]:
    """Every mode of ``opts`` on the same plan, each with a fresh edge and nodes."""
    if ctx.smoke:
        opts = _smoke(opts)
    arrivals = plan(opts)
    started = time.monotonic()
    modes: dict[str, Any] = {}
    for mode in opts.modes:
        tag = f"r{ctx.repeat}-{mode}"
        with process_stack(ctx.python, ctx.workdir) as stack:
            url = _start(stack, opts, mode, tag)
            samples, memory, start, end, before, after = trio.run(_drive, url, opts, arrivals)
        modes[mode] = _figures(opts, samples, memory, start, end, before, after)
        with (ctx.workdir / f"samples-{tag}.jsonl").open("w") as f:
            for s in samples:
                f.write(json.dumps(s.row("model", end=False)) + "\n")
    popularity = Counter(a.model for a in arrivals)
    return {
        "options": msgspec.to_builtins(opts),
        "requests": len(arrivals),
        "popularity": dict(sorted(popularity.items())),
        "modes": modes,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
