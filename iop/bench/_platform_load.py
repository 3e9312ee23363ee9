"""The platform runner's windows: what one measures, and how windows combine.

A *window* (``measure``) is a closed loop of ``spec.concurrency`` clients
(``iop.bench._client.one_request`` / ``one_completion``) through one shape's
gateway, opened after ``spec.warmup`` completions and closed at
``spec.requests`` (or ``spec.max_s``); /proc is read at both ends, so the
gateway's CPU per request is its utime+stime over the window divided by the
completions in it. ``run_window`` turns one into a flat dict; ``relative``
sets each shape against ``direct`` of the same repeat, ``merge`` takes the
median of every figure over the repeats, ``sweep_fits`` splits CPU per
request into a fixed part and a part per chunk, ``check_targets`` gives the
verdicts against ``TARGETS``.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import trio

from iop.bench._client import Sample, one_completion, one_request
from iop.bench._platform_report import TARGETS
from iop.bench._platform_stack import CHUNKS, MODEL_PACED, Platform
from iop.bench._procs import machine_cpu_s
from iop.bench._results import least_squares, pct

__all__ = [
    "GATEWAYS",
    "LevelSpec",
    "Window",
    "check_targets",
    "linear_fit",
    "measure",
    "merge",
    "relative",
    "run_window",
    "sweep_fits",
]

GATEWAYS = ("up", "split", "litellm")  # the shapes with a gateway to charge CPU to
SATURATED = 4  # see measure()


@dataclass(frozen=True)
class LevelSpec:
    name: str  # "paced-c32", "paced-c1", "fast-64ch", "nonstream"
    kind: str  # "paced", "fast" or "nonstream"
    model: str
    concurrency: int
    requests: int  # completions measured in the window
    warmup: int  # completions before the window opens
    chunks: int = CHUNKS
    stream: bool = True
    stagger_s: float = 0.0  # client i starts i * stagger_s after client 0
    max_s: float = math.inf  # the window closes after this (at >= concurrency completions)

    def body(self) -> bytes:
        req: dict[str, Any] = {
            "model": self.model,
            "stream": self.stream,
            "messages": [{"role": "user", "content": "Tell me about the benchmark."}],
            # The sim's per-request override; every gateway passes unknown
            # keys through to the backend (IOP: ExecutionSpec.extra_body;
            # LiteLLM: the OpenAI provider's extra_body).
            "iop_sim": {"output_tokens": self.chunks},
        }
        return msgspec.json.encode(req)


@dataclass
class Window:
    samples: list[Sample]  # the completions inside the window
    wall_s: float
    cpu_s: dict[str, float]  # "shape/name" -> CPU seconds in the window
    client_cpu_s: float
    machine_busy_s: float
    machine_total_s: float
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]


async def measure(
    url: str, spec: LevelSpec, snapshot: Callable[[], dict[str, float]], timeout_s: float
) -> Window:
    """Closed loop: ``spec.concurrency`` clients issue requests until the window
    (``spec.warmup`` completions in) has ``spec.requests`` completions or is
    ``spec.max_s`` old; then the open ones are cancelled (after the window's
    last reading of /proc: the next window's warm-up absorbs what the gateways
    do about the hang-ups), so a slow gateway's tail costs no time."""
    body = spec.body()
    path = url + "/v1/chat/completions"
    call = one_request if spec.stream else one_completion
    c = spec.concurrency
    samples: list[Sample] = []
    done = 0
    cancel = trio.CancelScope()
    start: dict[str, Any] = {}
    end: dict[str, Any] = {}

    def mark() -> dict[str, Any]:
        busy, total = machine_cpu_s()
        return {
            "t": time.perf_counter(),
            "cpu": snapshot(),
            "own": time.process_time(),
            "busy": busy,
            "total": total,
            "load": os.getloadavg(),
        }

    if spec.warmup == 0:
        start = mark()
    t_begin = time.perf_counter()
    # A gateway that cannot keep up (LiteLLM at c=32 on a loaded box does a
    # request a second) would make the window wait for one completion per
    # client: past SATURATED x max_s, a quarter of that will do.
    few = max(1, c // 4)

    def completed(s: Sample) -> None:
        nonlocal done, start, end
        done += 1
        now = time.perf_counter()
        if not start:
            if done >= spec.warmup or (now - t_begin >= spec.max_s and done >= few):
                start = mark()
            return
        if end:
            return  # finished after the window closed
        samples.append(s)
        n, age = len(samples), now - start["t"]
        if (
            n >= spec.requests
            or (age >= spec.max_s and n >= c)
            or (age >= SATURATED * spec.max_s and n >= few)
        ):
            end = mark()
            cancel.cancel()

    limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
    timeout = httpx.Timeout(connect=5, read=60, write=5, pool=60)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:

        async def worker(i: int) -> None:
            await trio.sleep(i * spec.stagger_s)
            while True:
                completed(await call(client, path, body, spec.chunks))

        with trio.fail_after(timeout_s), cancel:
            async with trio.open_nursery() as nursery:
                for i in range(c):
                    nursery.start_soon(worker, i)
    return Window(
        samples,
        end["t"] - start["t"],
        {k: end["cpu"][k] - v for k, v in start["cpu"].items()},
        end["own"] - start["own"],
        end["busy"] - start["busy"],
        end["total"] - start["total"],
        start["load"],
        end["load"],
    )


def _r(v: float, nd: int = 3) -> float | None:
    return None if v is None or math.isnan(v) else round(v, nd)


def run_window(plat: Platform, shape: str, spec: LevelSpec, timeout_s: float) -> dict[str, Any]:
    """One measured window of ``spec`` through ``shape``, as a flat dict."""
    gw = plat.gateways[shape]
    t0 = time.monotonic()
    w = trio.run(measure, gw.urls[spec.model], spec, plat.all_cpu_s, timeout_s)
    elapsed = time.monotonic() - t0
    n = len(w.samples)
    ok = [s for s in w.samples if s.ok]
    gw_cpu = {k.split("/", 1)[1]: v for k, v in w.cpu_s.items() if k.startswith(shape + "/")}
    gw_ms = {k: v * 1000 / n for k, v in gw_cpu.items()}
    total_ms = sum(gw_ms.values()) if gw_ms else math.nan
    sim_key = "sim/sim_paced" if spec.model == MODEL_PACED else "sim/sim"
    ours = sum(w.cpu_s.values()) + w.client_cpu_s

    def lat(attr: str) -> dict[str, float | None]:
        vals = [getattr(s, attr) * 1000 for s in ok]
        return {"p50": _r(pct(vals, 50), 2), "p99": _r(pct(vals, 99), 2)}

    return {
        "shape": shape,
        "level": spec.name,
        "requests": n,
        "ok": len(ok),
        "errors": dict(Counter(s.error for s in w.samples if not s.ok)),
        "wall_s": round(w.wall_s, 3),  # the window
        "elapsed_s": round(elapsed, 2),  # warm-up + window + cancelling the rest
        "req_per_s": round(n / w.wall_s, 2),
        "cpu_ms_per_req": {k: round(v, 3) for k, v in gw_ms.items()},
        "gateway_cpu_ms_per_req": _r(total_ms),
        "gateway_us_per_chunk": _r(total_ms * 1000 / spec.chunks, 1),
        "sim_cpu_ms_per_req": round(w.cpu_s[sim_key] * 1000 / n, 3),
        "client_cpu_ms_per_req": round(w.client_cpu_s * 1000 / n, 3),
        "client_reads_per_response": round(sum(s.reads for s in ok) / max(1, len(ok)), 1),
        "ttft_ms": lat("ttft_s"),
        "total_ms": lat("total_s"),
        "loadavg_before": [round(x, 2) for x in w.load_before],
        "loadavg_after": [round(x, 2) for x in w.load_after],
        "machine_busy_pct": round(100 * w.machine_busy_s / w.machine_total_s, 1)
        if w.machine_total_s > 0
        else None,
        # Busy CPU, in % of one core, that none of the benchmark's processes used.
        "foreign_cpu_pct_of_core": round(100 * max(0.0, w.machine_busy_s - ours) / w.wall_s, 1),
    }


def _median(vals: list[float | None]) -> float | None:
    xs = [v for v in vals if v is not None and not math.isnan(v)]
    return round(statistics.median(xs), 3) if xs else None


def relative(runs: list[dict[str, Any]], direct: dict[str, Any] | None) -> None:
    """Add throughput % of direct and added TTFT (vs direct, the same repeat)."""
    for lv in runs:
        if direct is None or lv["shape"] == "direct":
            lv["throughput_pct_of_direct"] = 100.0 if lv["shape"] == "direct" else None
            lv["added_ttft_p50_ms"] = lv["added_ttft_p99_ms"] = None
            continue
        lv["throughput_pct_of_direct"] = round(100 * lv["req_per_s"] / direct["req_per_s"], 2)
        for p in ("p50", "p99"):
            a, b = lv["ttft_ms"][p], direct["ttft_ms"][p]
            lv[f"added_ttft_{p}_ms"] = None if a is None or b is None else round(a - b, 2)


def merge(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of every figure over the repeats (each cell on its own)."""
    first = repeats[0]
    out: dict[str, Any] = {"shape": first["shape"], "level": first["level"]}
    out["requests"] = sum(r["requests"] for r in repeats)
    out["ok"] = sum(r["ok"] for r in repeats)
    errors: Counter[str] = Counter()
    for r in repeats:
        errors.update(r["errors"])
    out["errors"] = dict(errors)
    for key in (
        "req_per_s",
        "gateway_cpu_ms_per_req",
        "gateway_us_per_chunk",
        "sim_cpu_ms_per_req",
        "client_cpu_ms_per_req",
        "client_reads_per_response",
        "throughput_pct_of_direct",
        "added_ttft_p50_ms",
        "added_ttft_p99_ms",
        "foreign_cpu_pct_of_core",
    ):
        out[key] = _median([r.get(key) for r in repeats])
    out["cpu_ms_per_req"] = {
        k: _median([r["cpu_ms_per_req"][k] for r in repeats]) for k in first["cpu_ms_per_req"]
    }
    for key in ("ttft_ms", "total_ms"):
        out[key] = {p: _median([r[key][p] for r in repeats]) for p in ("p50", "p99")}
    out["loadavg_after"] = [_median([r["loadavg_after"][i] for r in repeats]) for i in range(3)]
    if len(repeats) > 1:
        g = [r["gateway_cpu_ms_per_req"] for r in repeats if r["gateway_cpu_ms_per_req"]]
        out["gateway_cpu_ms_range"] = [min(g), max(g)] if g else None
    out["repeats"] = repeats
    return out


def linear_fit(points: list[tuple[float, float]]) -> dict[str, float]:
    """Least squares y = fixed + per_chunk * x."""
    fixed, slope = least_squares(points)
    return {"fixed_ms": round(fixed, 3), "per_chunk_us": round(slope * 1000, 1)}


def sweep_fits(cells: dict[str, dict[str, dict[str, Any]]], specs: list[LevelSpec]) -> Any:
    """Per gateway shape (and per process): the fit of CPU per request on chunks."""
    fast = [s for s in specs if s.kind == "fast"]
    if len({s.chunks for s in fast}) < 2:
        return {}
    out: dict[str, Any] = {}
    for shape in GATEWAYS:
        pts = [(s, cells[s.name][shape]) for s in fast if shape in cells.get(s.name, {})]
        if not pts:
            continue
        fit: dict[str, Any] = {
            "gateway": linear_fit([(s.chunks, c["gateway_cpu_ms_per_req"]) for s, c in pts])
        }
        procs = pts[0][1]["cpu_ms_per_req"]
        if len(procs) > 1:
            for name in procs:
                fit[name] = linear_fit([(s.chunks, c["cpu_ms_per_req"][name]) for s, c in pts])
        out[shape] = fit
    return out


def check_targets(
    cells: dict[str, dict[str, dict[str, Any]]], fits: dict[str, Any]
) -> dict[str, Any]:
    """Each target (``TARGETS``), for the IOP shapes: the figure, the bound, met or not."""
    out: dict[str, Any] = {}
    for key, level, metric, op, bound, unit in TARGETS:
        row: dict[str, Any] = {"bound": f"{op} {bound:g} {unit}"}
        for shape in ("up", "split"):
            if level == "sweep":
                v = fits.get(shape, {}).get("gateway", {}).get(metric)
            else:
                v = cells.get(level, {}).get(shape, {}).get(metric)
            met = None if v is None else (v <= bound if op == "<=" else v >= bound)
            row[shape] = {"value": v, "met": met}
        out[key] = row
    return out
