"""Benchmark IOP from outside, side by side: direct, `iop up`, edge + node, LiteLLM.

One run measures every *shape* of gateway in front of the same mock backend,
each as real processes (all stopped by PID at the end, on error and on Ctrl-C
or SIGTERM):

* two simulated backends (``iop sim``, vLLM's wire format, no time to first
  token): ``iop-sim`` streams as fast as it can, ``iop-sim-paced`` at
  ``--paced-rate`` tokens/s (50 tok/s = 20 ms per chunk, a real model's pace);
* ``direct``: the client talks to the sims itself, the reference;
* ``up``: ``iop up --config <tmp toml>``, edge and node in one process, with
  one ``vllm`` instance per sim;
* ``split``: ``iop edge`` and ``iop node --config <tmp toml>``, two processes;
* ``litellm``: LiteLLM's proxy (``--litellm PATH``, its own venv), one
  uvicorn worker, both sims as ``openai/<model>`` with ``api_base``, no
  database. Skipped, with a message, when the executable is missing.

Levels, each run for every shape in turn, the whole sequence ``--repeat``
times (the order of the shapes rotates between repeats):

* ``paced-c32``: 32 concurrent streams of 64 chunks at 50 tok/s, the clients'
  starts spread over one stream's duration (a steady state, not 32 requests
  in the same millisecond);
* ``paced-c1``: one stream at a time, 50 tok/s, short answers (TTFT is what
  it measures: the first chunk arrives alone, 20 ms before the next);
* ``fast-<k>ch``: c=32, as fast as the sim sends, k chunks per answer (the
  sweep; the sim's ``iop_sim.output_tokens`` override, which every gateway
  passes through): a least-squares fit splits the gateway's CPU into a fixed
  part per request and a part per chunk;
* ``nonstream``: c=32, ``stream: false``, a 64-token answer.

Each level is measured in a steady-state *window*: the clients run
``warmup`` requests first, then /proc is read, then ``requests`` more
complete (or ``--level-seconds`` pass, with one completion per client), then
/proc is read again and the requests still open are cancelled. Per window
and shape:

* CPU per request: utime+stime of the gateway's processes (edge and node;
  the one ``iop up``; LiteLLM's process, its threads, its live descendants and
  its reaped children) over the window, divided by the requests that
  completed in it. The sims' and the client's CPU is reported, not counted;
* throughput: requests completed per second, in % of ``direct``'s in the same
  repeat;
* added TTFT: the shape's TTFT percentile (request sent -> first content chunk
  parsed) minus ``direct``'s in the same repeat.

Every cell of the tables is the median over the repeats. On a shared 2-core
box latencies move with the load; CPU per request much less (the load
average and the busy CPU no process of the benchmark used, "foreign", are
recorded per window).

Outputs:
  bench-results/platform-<timestamp>.json   every number (the directory is gitignored)
  docs/img/bench_cpu_per_request.png         gateway CPU per request, per shape, + the sweep
  docs/img/bench_latency.png                 added TTFT and throughput, per shape

Examples:
  python scripts/bench_platform.py                          # every shape, 3.5-5 min (loaded box)
  python scripts/bench_platform.py --repeat 3               # medians of 3 interleaved repeats
  python scripts/bench_platform.py --shapes direct,split    # only these columns
  python scripts/bench_platform.py --profile                # + py-spy on edge and node (paced c=32)
  python scripts/bench_platform.py --no-plots --out-dir /tmp/bench

docs/benchmarks.md explains the method and quotes the results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

from iop.testing import EDGE_READY, SIM_READY, UP_READY, Proc, free_port, poll

# The checkout: children run `python -m iop` from here (so they import this
# checkout's iop), and bench-results/ and docs/img/ are under it.
REPO = Path(__file__).resolve().parent.parent.parent

CHUNKS = 64  # content chunks per answer (the sims' --output-tokens)
NODE_TOKEN = "bench-token"
MODEL_FAST = "iop-sim"
MODEL_PACED = "iop-sim-paced"
SHAPES = ("direct", "up", "split", "litellm")
GATEWAYS = ("up", "split", "litellm")  # the shapes with a gateway to charge CPU to
LITELLM_WANTED = "1.108.5"
LITELLM_DEFAULT = Path.home() / ".cache" / "iop" / "bench-litellm" / "bin" / "litellm"
MAX_REQUESTS = 20_000  # per level, whatever is asked
CLK_TCK = os.sysconf("SC_CLK_TCK")
SATURATED = 4  # see measure()
READY_TIMEOUT_S = 60.0  # LiteLLM takes 5-10 s to import on this box

# What the lead checks the IOP shapes (up, split) against: issue 9.
# (key, level, metric, "<=" or ">=", bound, unit)
TARGETS: tuple[tuple[str, str, str, str, float, str], ...] = (
    ("paced_c32_cpu", "paced-c32", "gateway_cpu_ms_per_req", "<=", 8.0, "ms/request"),
    ("paced_c32_added_ttft_p50", "paced-c32", "added_ttft_p50_ms", "<=", 5.0, "ms"),
    ("paced_c32_added_ttft_p99", "paced-c32", "added_ttft_p99_ms", "<=", 20.0, "ms"),
    ("paced_c32_throughput", "paced-c32", "throughput_pct_of_direct", ">=", 99.0, "%"),
    ("paced_c1_added_ttft_p50", "paced-c1", "added_ttft_p50_ms", "<=", 2.0, "ms"),
    ("paced_c1_added_ttft_p99", "paced-c1", "added_ttft_p99_ms", "<=", 5.0, "ms"),
    ("fast_fixed", "sweep", "fixed_ms", "<=", 2.0, "ms/request"),
    ("fast_per_chunk", "sweep", "per_chunk_us", "<=", 40.0, "µs/chunk"),
    ("nonstream_cpu", "nonstream", "gateway_cpu_ms_per_req", "<=", 3.0, "ms/request"),
)


# --------------------------------------------------------------------------- /proc


def _stat_fields(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rindex(b")") + 2 :].split()  # field 3 of proc(5) onwards


def proc_cpu_s(pid: int, *, reaped_children: bool = False) -> float:
    """utime + stime of a process (all its threads), in seconds; with
    ``reaped_children``, plus cutime + cstime (children it has waited for)."""
    f = _stat_fields(pid)
    ticks = int(f[11]) + int(f[12])  # fields 14 and 15
    if reaped_children:
        ticks += int(f[13]) + int(f[14])  # fields 16 and 17
    return ticks / CLK_TCK


def descendants(pid: int) -> list[int]:
    """The live descendants of ``pid`` (a scan of /proc: call it outside a window)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent[int(entry)] = int(_stat_fields(int(entry))[1])  # field 4: ppid
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return sorted(out)


def machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)  # idle + iowait
    total = sum(parts[:8])  # guest time is already counted in user
    return (total - idle) / CLK_TCK, total / CLK_TCK


# --------------------------------------------------------------------------- processes


@dataclass
class Gateway:
    """One shape: where its clients send each model, and whose CPU it is charged."""

    shape: str
    urls: dict[str, str]  # model -> http://host:port
    procs: dict[str, Proc]  # what CPU per request counts ("edge", "node"; "up"; "litellm")
    tree: bool = False  # count live descendants and reaped children too (LiteLLM)
    children: dict[str, list[int]] = field(default_factory=dict)

    def cpu_s(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, p in self.procs.items():
            cpu = proc_cpu_s(p.pid, reaped_children=self.tree)
            for kid in self.children.get(name, []):
                with contextlib.suppress(OSError):
                    cpu += proc_cpu_s(kid, reaped_children=True)
            out[name] = cpu
        return out


@dataclass
class Platform:
    sims: dict[str, Proc]  # "sim", "sim_paced"
    gateways: dict[str, Gateway]  # shape -> gateway, "direct" included
    started: list[Proc]
    skipped: dict[str, str]  # shape -> why

    def all_cpu_s(self) -> dict[str, float]:
        """Every process of the benchmark, keyed "shape/name" (sims: "sim/NAME")."""
        out = {f"sim/{k}": proc_cpu_s(p.pid) for k, p in self.sims.items()}
        for gw in self.gateways.values():
            out |= {f"{gw.shape}/{k}": v for k, v in gw.cpu_s().items()}
        return out


_INSTANCES_TOML = """\
# max_concurrency above the highest level: the sims have no limit, and the
# edge's scheduler would otherwise queue runs (the default is 8 per instance).
[[instances]]
adapter = "vllm"
name = "sim"
endpoint = "{fast}"
max_concurrency = 256
max_queue = 256

[[instances]]
adapter = "vllm"
name = "sim-paced"
endpoint = "{paced}"
max_concurrency = 256
max_queue = 256
"""

_NODE_TOML = """\
[node]
id = "bench"
probe_interval_s = 30.0

[[node.edges]]
url = "{link}"
token = "{token}"

"""

_UP_TOML = """\
[node]
id = "bench-up"
probe_interval_s = 30.0

"""

# LiteLLM's proxy config. The sims are OpenAI-compatible backends
# ("openai/<model>" + api_base); no database (no DATABASE_URL), so no spend
# logs or key table; message logging off. No master key, like the IOP shapes
# (which run without API keys here): LiteLLM refuses to start without one
# unless told it is a local test.
_LITELLM_YAML = """\
model_list:
  - model_name: {fast_model}
    litellm_params:
      model: openai/{fast_model}
      api_base: {fast}/v1
      api_key: bench-unused
  - model_name: {paced_model}
    litellm_params:
      model: openai/{paced_model}
      api_base: {paced}/v1
      api_key: bench-unused
litellm_settings:
  turn_off_message_logging: true
  telemetry: false
  request_timeout: 600
general_settings:
  disable_spend_logs: true
  dangerously_permit_weak_or_unset_master_key: true
"""
# Offline: the model cost map from the package, not fetched from GitHub at
# start; only errors logged (LiteLLM logs every request at INFO otherwise).
_LITELLM_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}


def litellm_version(exe: Path) -> str | None:
    """The version of the litellm package next to ``exe`` (its venv's python)."""
    py = exe.parent / "python"
    if not py.exists():
        return None
    code = "import importlib.metadata as m; print(m.version('litellm'))"
    try:
        out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def wait_models(proc_list: list[Proc], url: str, paths: tuple[str, ...], timeout: float) -> None:
    """Wait until every path answers 200 and /v1/models lists both sims' models."""
    last = [""]

    def check() -> bool:
        for p in proc_list:
            if not p.alive:
                raise RuntimeError(f"{p.name} exited during start-up:\n{p.logs(20)}")
        try:
            with httpx.Client(base_url=url, timeout=2, trust_env=False) as c:
                for path in paths:
                    r = c.get(path)
                    if r.status_code != 200:
                        last[0] = f"{path}: {r.status_code} {r.text[:200]}"
                        return False
                models = {m["id"] for m in c.get("/v1/models").json()["data"]}
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            last[0] = repr(exc)
            return False
        last[0] = f"models: {sorted(models)}"
        return {MODEL_FAST, MODEL_PACED} <= models

    try:
        poll(check, timeout=timeout, what=f"{url} to be ready", interval=0.1)
    except AssertionError as exc:
        raise RuntimeError(f"{exc} ({last[0]})") from None


@contextlib.contextmanager
def running_platform(args: argparse.Namespace, logdir: Path) -> Iterator[Platform]:
    """Start the sims and every asked-for gateway; stop them all (by PID) however
    the block ends: nodes first (they drain their runs), then edges, then the sims."""
    started: list[Proc] = []
    skipped: dict[str, str] = {}

    def launch(name: str, *iop_args: str, argv: list[str] | None = None, **kw: Any) -> Proc:
        p = Proc(name, list(iop_args), logdir, argv=argv, cwd=REPO, python=args.python, **kw)
        started.append(p)
        return p

    try:
        sim = ["sim", "--port", "0", "--ttft", "0", "--output-tokens", str(CHUNKS)]
        sim_fast = launch("sim", *sim, "--tokens-per-s", "0", "--model", MODEL_FAST)
        sim_paced = launch(
            "sim_paced", *sim, "--tokens-per-s", f"{args.paced_rate:g}", "--model", MODEL_PACED
        )
        fast_url = sim_fast.wait_stdout(SIM_READY)[1]
        paced_url = sim_paced.wait_stdout(SIM_READY)[1]
        instances = _INSTANCES_TOML.format(fast=fast_url, paced=paced_url)
        gateways: dict[str, Gateway] = {}
        if "direct" in args.shape_list:
            gateways["direct"] = Gateway(
                "direct", {MODEL_FAST: fast_url, MODEL_PACED: paced_url}, {}
            )
        # Start every gateway first, then wait for each: the start-ups overlap.
        edge = up = lite = None
        lite_url = ""
        if "split" in args.shape_list:
            edge = launch("edge", "edge", "--port", "0", "--node-token", NODE_TOKEN)
        if "up" in args.shape_list:
            up_toml = logdir / "up.toml"
            up_toml.write_text(_UP_TOML + instances)
            up = launch("up", "up", "--port", "0", "--config", str(up_toml))
        if "litellm" in args.shape_list:
            if not args.litellm.exists():
                skipped["litellm"] = (
                    f"no LiteLLM at {args.litellm} (install: python3 -m venv "
                    "~/.cache/iop/bench-litellm && ~/.cache/iop/bench-litellm/bin/pip install "
                    f"'litellm[proxy]=={LITELLM_WANTED}', or pass --litellm PATH)"
                )
            else:
                cfg = logdir / "litellm.yaml"
                cfg.write_text(
                    _LITELLM_YAML.format(
                        fast_model=MODEL_FAST,
                        paced_model=MODEL_PACED,
                        fast=fast_url,
                        paced=paced_url,
                    )
                )
                port = free_port()
                argv = [str(args.litellm), "--config", str(cfg), "--host", "127.0.0.1"]
                argv += ["--port", str(port), "--num_workers", "1"]
                lite = launch("litellm", argv=argv, env=_LITELLM_ENV)
                lite_url = f"http://127.0.0.1:{port}"
        if edge is not None:
            m = edge.wait_stdout(EDGE_READY)
            node_toml = logdir / "node.toml"
            node_toml.write_text(_NODE_TOML.format(link=m[2], token=NODE_TOKEN) + instances)
            node = launch("node", "node", "--config", str(node_toml))
            wait_models([edge, node], m[1], ("/readyz",), READY_TIMEOUT_S)
            gateways["split"] = Gateway(
                "split", {MODEL_FAST: m[1], MODEL_PACED: m[1]}, {"edge": edge, "node": node}
            )
        if up is not None:
            m = up.wait_stdout(UP_READY, timeout=READY_TIMEOUT_S)
            wait_models([up], m[1], ("/readyz",), READY_TIMEOUT_S)
            gateways["up"] = Gateway("up", {MODEL_FAST: m[1], MODEL_PACED: m[1]}, {"up": up})
        if lite is not None:
            wait_models([lite], lite_url, ("/health/liveliness",), READY_TIMEOUT_S)
            gw = Gateway(
                "litellm", {MODEL_FAST: lite_url, MODEL_PACED: lite_url}, {"litellm": lite}, True
            )
            gw.children = {"litellm": descendants(lite.pid)}
            gateways["litellm"] = gw
        # The table's column order.
        gateways = {s: gateways[s] for s in SHAPES if s in gateways}
        yield Platform({"sim": sim_fast, "sim_paced": sim_paced}, gateways, started, skipped)
    finally:
        order = {"node": 0, "edge": 1, "up": 1, "litellm": 1}
        for p in sorted(started, key=lambda p: order.get(p.name, 2)):
            try:
                rc = p.stop()
                if rc not in (0, -signal.SIGTERM):
                    print(f"bench: {p.name} (pid {p.pid}) exited {rc}", file=sys.stderr)
            except Exception as exc:
                print(f"bench: stopping {p.name}: {exc!r}", file=sys.stderr)


# --------------------------------------------------------------------------- load


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta = msgspec.field(default_factory=_Delta)


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []


class _Message(msgspec.Struct):
    content: str | None = None


class _FullChoice(msgspec.Struct):
    message: _Message


class _Usage(msgspec.Struct):
    completion_tokens: int | None = None


class _Completion(msgspec.Struct):
    choices: list[_FullChoice]
    usage: _Usage | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode
_decode_completion = msgspec.json.Decoder(_Completion).decode


@dataclass
class Sample:
    ok: bool
    ttft_s: float  # request sent -> first content chunk (non-streaming: the whole body)
    total_s: float  # request sent -> end of the response
    chunks: int  # content chunks (non-streaming: completion tokens)
    reads: int  # body pieces received: about the number of the gateway's writes
    error: str = ""


async def one_request(client: httpx.AsyncClient, url: str, body: bytes, expect: int) -> Sample:
    t0 = time.perf_counter()
    ttft = math.nan
    chunks = reads = 0
    done = False
    try:
        async with client.stream(
            "POST", url, content=body, headers={"Content-Type": "application/json"}
        ) as r:
            if r.status_code != 200:
                text = (await r.aread())[:200].decode(errors="replace")
                err = f"HTTP {r.status_code} {text}"
                return Sample(False, ttft, time.perf_counter() - t0, 0, 0, err)
            buf = b""
            async for data in r.aiter_raw():
                reads += 1
                buf += data
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    if not ev.startswith(b"data: "):
                        continue  # an SSE comment (keep-alive)
                    payload = ev[6:]
                    if payload == b"[DONE]":
                        done = True
                        continue
                    chunk = _decode_chunk(payload)
                    if chunk.choices and chunk.choices[0].delta.content:
                        if chunks == 0:
                            ttft = time.perf_counter() - t0
                        chunks += 1
    except (httpx.HTTPError, msgspec.DecodeError) as exc:
        return Sample(False, ttft, time.perf_counter() - t0, chunks, reads, repr(exc))
    total = time.perf_counter() - t0
    if chunks != expect or not done:
        err = f"{chunks} content chunks (expected {expect}), [DONE] {'seen' if done else 'missing'}"
        return Sample(False, ttft, total, chunks, reads, err)
    return Sample(True, ttft, total, chunks, reads)


async def one_completion(client: httpx.AsyncClient, url: str, body: bytes, expect: int) -> Sample:
    """A non-streaming request: the answer must have content and, when the
    gateway reports usage, ``expect`` completion tokens."""
    t0 = time.perf_counter()
    try:
        r = await client.post(url, content=body, headers={"Content-Type": "application/json"})
        total = time.perf_counter() - t0
        if r.status_code != 200:
            err = f"HTTP {r.status_code} {r.text[:200]}"
            return Sample(False, math.nan, total, 0, 1, err)
        c = _decode_completion(r.content)
    except (httpx.HTTPError, msgspec.DecodeError) as exc:
        return Sample(False, math.nan, time.perf_counter() - t0, 0, 0, repr(exc))
    tokens = c.usage.completion_tokens if c.usage and c.usage.completion_tokens else expect
    # The sim counts the end-of-sequence token in the usage, as vLLM does.
    if not c.choices or not c.choices[0].message.content or tokens not in (expect, expect + 1):
        return Sample(False, total, total, tokens, 1, f"{tokens} tokens (expected {expect})")
    return Sample(True, total, total, tokens, 1)


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


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    vals = sorted(v for v in values if not math.isnan(v))
    if not vals:
        return math.nan
    return vals[max(0, min(len(vals) - 1, math.ceil(p / 100 * len(vals)) - 1))]


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


# --------------------------------------------------------------------------- results


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
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return {"fixed_ms": round(my - slope * mx, 3), "per_chunk_us": round(slope * 1000, 1)}


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
    """Each target of issue 9, for the IOP shapes: the figure, the bound, met or not."""
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


# --------------------------------------------------------------------------- profile


def find_py_spy(python: str) -> str | None:
    cand = Path(python).parent / "py-spy"
    return str(cand) if cand.exists() else shutil.which("py-spy")


_FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


def _package(file: str) -> str:
    f = file.replace("\\", "/")
    for marker in ("site-packages/", "/lib/python3.11/", str(REPO) + "/"):
        if marker in f:
            f = f.split(marker, 1)[1]
            break
    parts = f.lstrip("/").split("/")
    if parts[0] == "iop" and len(parts) > 1:
        return "iop/" + parts[1].removesuffix(".py")  # iop/edge, iop/runtime...
    return parts[0].removesuffix(".py") or "?"


def summarize_raw(path: Path, top: int = 15) -> dict[str, Any]:
    """Summarise a py-spy ``--format raw`` file (collapsed stacks, one per line)."""
    self_pkg: Counter[str] = Counter()
    incl_pkg: Counter[str] = Counter()
    self_fn: Counter[str] = Counter()
    incl_fn: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [m for m in map(_FRAME.match, stack.split(";")) if m]
        if not frames:
            continue
        leaf = frames[-1]
        self_pkg[_package(leaf["file"])] += n
        self_fn[f"{leaf['fn']} ({_package(leaf['file'])})"] += n
        for p in {_package(m["file"]) for m in frames}:
            incl_pkg[p] += n
        for f in {f"{m['fn']} ({_package(m['file'])})" for m in frames}:
            incl_fn[f] += n

    def share(c: Counter[str], skip: tuple[str, ...] = ()) -> list[tuple[str, float]]:
        items = [(k, v) for k, v in c.most_common() if not k.startswith(skip)][:top]
        return [(k, round(100 * v / total, 1)) for k, v in items] if total else []

    entry = ("<frozen runpy>", "iop/__main__", "iop/cli", "run (trio)", "unrolled_run (trio)")
    entry_fns = ("_run_module_as_main", "_run_code", "<module> (iop", "main (iop", "_cmd_")
    return {
        "samples": total,
        "self_pct_top_functions": share(self_fn),
        "self_pct_by_package": share(self_pkg),
        "inclusive_pct_by_package": share(incl_pkg, entry),
        "inclusive_pct_top_functions": share(incl_fn, entry + entry_fns),
    }


def run_profile(  # pragma: no cover - py-spy attaches by ptrace: not in the suite
    plat: Platform, py_spy: str, spec: LevelSpec, outdir: Path, stamp: str, timeout_s: float
) -> dict[str, Any]:
    """One more ``spec`` window through the split shape, with py-spy (non-blocking,
    250 Hz) attached to the edge and to the node for the whole of it."""
    gw = plat.gateways["split"]
    spies: dict[str, subprocess.Popen[bytes]] = {}
    raw: dict[str, Path] = {}
    try:
        for name in ("edge", "node"):
            raw[name] = outdir / f"pyspy-{stamp}-split-{spec.name}-{name}.txt"
            spies[name] = subprocess.Popen(
                [
                    py_spy,
                    "record",
                    "--pid",
                    str(gw.procs[name].pid),
                    "--rate",
                    "250",
                    "--nonblocking",
                    "--format",
                    "raw",
                    "--output",
                    str(raw[name]),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        time.sleep(1.0)  # let py-spy attach
        level = run_window(plat, "split", spec, timeout_s)
    finally:
        for sp in spies.values():
            if sp.poll() is None:
                os.kill(sp.pid, signal.SIGINT)  # py-spy writes its file on SIGINT
        for sp in spies.values():
            try:
                sp.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(sp.pid, signal.SIGKILL)
                sp.wait(5)
    out: dict[str, Any] = {
        "shape": "split",
        "level": level,
        "raw_files": {k: str(v) for k, v in raw.items()},
    }
    for name, path in raw.items():
        out[name] = summarize_raw(path) if path.exists() else {"error": "py-spy wrote nothing"}
    return out


# --------------------------------------------------------------------------- plots


def import_matplotlib() -> Any:
    """matplotlib (a dev dependency, imported only to plot), on the Agg backend."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "bench: plotting needs matplotlib, a dev dependency: "
            "pip install -c constraints.txt -e '.[dev]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    return matplotlib


_COLORS = {"direct": "#999999", "up": "#55A868", "split": "#4C72B0", "litellm": "#C44E52"}
_NODE_COLOR = "#DD8452"
_LABELS = {"direct": "direct", "up": "iop up", "split": "edge + node", "litellm": "LiteLLM"}


def plot(result: dict[str, Any], img_dir: Path) -> list[Path]:
    import_matplotlib()

    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    cells = result["cells"]
    shapes = [s for s in result["shapes"] if s != "direct"]
    machine = result["machine"]
    where = (
        f"{machine['ncpu']} vCPU {machine['cpu_model']}, shared; commit {result['commit']}; "
        f"load average {result['loadavg_start'][0]:.2f} at start, "
        f"{result['loadavg_end'][0]:.2f} at end; {result['timestamp']}; "
        f"median of {result['settings']['repeat']}"
    )
    target = {t[0]: t[4] for t in TARGETS}
    paths = []

    # ---- CPU per request, per shape, and the sweep
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(15, 6.2), dpi=100)
    levels = [
        (lv, label, tkey)
        for lv, label, tkey in (
            ("paced-c32", "paced 50 tok/s\nc=32, 64 chunks", "paced_c32_cpu"),
            ("fast-64ch", "as fast as possible\nc=32, 64 chunks", None),
            ("nonstream", "non-streaming\nc=32, 64 tokens", "nonstream_cpu"),
        )
        if lv in cells
    ]
    w = 0.8 / max(1, len(shapes))
    ymax = 0.0
    for j, shape in enumerate(shapes):
        for i, (lv, _, _) in enumerate(levels):
            cell = cells[lv].get(shape)
            if cell is None:
                continue
            x = i - 0.4 + w * (j + 0.5)
            parts = cell["cpu_ms_per_req"]
            bottom = 0.0
            for name, v in parts.items():
                color = _NODE_COLOR if name == "node" else _COLORS[shape]
                label = None
                if i == 0:
                    label = f"{_LABELS[shape]} ({name})" if len(parts) > 1 else _LABELS[shape]
                ax.bar(x, v, w * 0.9, bottom=bottom, color=color, label=label)
                bottom += v
            ymax = max(ymax, bottom)
            ax.text(x, bottom, f"{bottom:.1f}", ha="center", va="bottom", fontsize=8)
    for i, (_, _, tkey) in enumerate(levels):
        if tkey:
            ax.hlines(target[tkey], i - 0.45, i + 0.45, colors="black", linestyles="--", lw=1.2)
            ax.text(
                i + 0.45,
                target[tkey],
                f"target {target[tkey]:g}",
                ha="right",
                va="bottom",
                fontsize=8,
            )
    ax.set_xticks(range(len(levels)), [lb for _, lb, _ in levels])
    ax.set_yscale("log")
    ax.set_ylim(0.5, max(ymax, 10) * 2.5)
    ax.set_ylabel("gateway CPU ms per request (log scale)")
    ax.set_title("CPU per request of the gateway processes (lower is better)")
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    ax.grid(axis="y", alpha=0.3, which="both")

    fits = result.get("sweep_fit") or {}
    fast = sorted((c for c in result["specs"] if c["kind"] == "fast"), key=lambda c: c["chunks"])
    if fits and fast:
        xs = [c["chunks"] for c in fast]
        dense = [max(xs) * i / 100 for i in range(101)]  # a straight line on linear x
        for shape in shapes:
            if shape not in fits:
                continue
            ys = [cells[c["name"]][shape]["gateway_cpu_ms_per_req"] for c in fast]
            f = fits[shape]["gateway"]
            ax2.plot(xs, ys, "o", color=_COLORS[shape])
            ax2.plot(
                dense,
                [f["fixed_ms"] + f["per_chunk_us"] / 1000 * v for v in dense],
                "-",
                color=_COLORS[shape],
                lw=1.2,
                label=f"{_LABELS[shape]}: {f['fixed_ms']:.1f} ms + {f['per_chunk_us']:.0f} µs/chunk",
            )
        ax2.plot(
            dense,
            [target["fast_fixed"] + target["fast_per_chunk"] / 1000 * v for v in dense],
            "--",
            color="black",
            lw=1,
            label=f"target: {target['fast_fixed']:g} ms + {target['fast_per_chunk']:g} µs/chunk",
        )
        ax2.set_yscale("log")
        ax2.set_xlim(0, max(xs) * 1.03)
        ax2.set_xlabel("content chunks per streamed answer (c=32, as fast as possible)")
        ax2.set_ylabel("gateway CPU ms per request (log scale)")
        ax2.set_title("Fixed vs per-chunk cost: the chunk-count sweep (dots) and its fit")
        ax2.legend(loc="lower right", fontsize=8)
        ax2.grid(alpha=0.3, which="both")
    else:
        ax2.axis("off")
    fig.suptitle(where, fontsize=8, y=0.995)
    fig.tight_layout()
    p = img_dir / "bench_cpu_per_request.png"
    fig.savefig(p)
    plt.close(fig)
    paths.append(p)

    # ---- Added TTFT and throughput
    fig, axes = plt.subplots(1, 3, figsize=(15, 5), dpi=100)
    for ax, lv, title, tkey in (
        (axes[0], "paced-c32", "paced 50 tok/s, c=32", "paced_c32"),
        (axes[1], "paced-c1", "paced 50 tok/s, c=1", "paced_c1"),
    ):
        if lv not in cells:
            ax.axis("off")
            continue
        present = [s for s in shapes if s in cells[lv]]
        top = 1.0
        for j, shape in enumerate(present):
            c = cells[lv][shape]
            for k, p_ in enumerate(("p50", "p99")):
                v = c[f"added_ttft_{p_}_ms"]
                if v is None:
                    continue
                x = j + (k - 0.5) * 0.38
                top = max(top, v)
                ax.bar(x, v, 0.36, color=_COLORS[shape], alpha=1.0 if p_ == "p50" else 0.55)
                ax.text(x, max(v, 0), f"{p_}\n{v:.1f}", ha="center", va="bottom", fontsize=7)
        for p_ in ("p50", "p99"):
            b = target[f"{tkey}_added_ttft_{p_}"]
            ax.axhline(
                b,
                color="black",
                ls="--" if p_ == "p50" else ":",
                lw=1,
                label=f"target {p_} {b:g} ms",
            )
        ax.axhline(0, color="black", lw=0.6)
        # Symlog: the targets (a few ms) and a saturated gateway (seconds) on one axis.
        ax.set_yscale("symlog", linthresh=1)
        ax.set_ylim(top=max(top, 20) * 6)  # room for the labels and the legend
        ax.set_xticks(range(len(present)), [_LABELS[s] for s in present])
        ax.set_ylabel("added TTFT vs direct, ms (symlog)")
        ax.set_title(f"Added time to first chunk: {title}")
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    ax = axes[2]
    tl = [lv for lv in ("paced-c32", "fast-64ch") if lv in cells]
    w = 0.8 / max(1, len(shapes))
    for j, shape in enumerate(shapes):
        for i, lv in enumerate(tl):
            c = cells[lv].get(shape)
            if c is None or c["throughput_pct_of_direct"] is None:
                continue
            x = i - 0.4 + w * (j + 0.5)
            v = c["throughput_pct_of_direct"]
            ax.bar(x, v, w * 0.9, color=_COLORS[shape], label=_LABELS[shape] if i == 0 else None)
            ax.text(
                x, v, f"{v:.0f}" if v < 99 else f"{v:.1f}", ha="center", va="bottom", fontsize=8
            )
    ax.axhline(
        target["paced_c32_throughput"],
        color="black",
        ls="--",
        lw=1,
        label=f"target (paced) {target['paced_c32_throughput']:g} %",
    )
    ax.set_xticks(range(len(tl)), ["paced 50 tok/s\nc=32", "as fast as possible\nc=32"][: len(tl)])
    ax.set_ylim(0, 135)
    ax.set_ylabel("requests/s, % of direct")
    ax.set_title("Throughput")
    ax.legend(loc="upper right", fontsize=8, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(where, fontsize=8, y=0.995)
    fig.tight_layout()
    p = img_dir / "bench_latency.png"
    fig.savefig(p)
    plt.close(fig)
    paths.append(p)
    return paths


# --------------------------------------------------------------------------- main


def machine_info() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_gib = None
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        mem_gib = round(int(f.readline().split()[1]) / 2**20, 1)
    versions = {}
    for pkg in (
        "iop",
        "trio",
        "httpx",
        "httpcore",
        "hypercorn",
        "quart",
        "quart-trio",
        "msgspec",
        "trio-websocket",
        "wsproto",
        "h11",
    ):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[pkg] = metadata.version(pkg)
    return {
        "cpu_model": model,
        "ncpu": os.cpu_count(),
        "mem_gib": mem_gib,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": versions,
    }


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return out.stdout.strip() or "?"


def _fmt(v: float | None, nd: int = 1, sign: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:+.{nd}f}" if sign else f"{v:.{nd}f}"


def _cpu_cell(c: dict[str, Any] | None) -> str:
    if c is None:
        return "-"
    parts = c["cpu_ms_per_req"]
    if not parts:
        return "-"
    if len(parts) == 1:
        return _fmt(c["gateway_cpu_ms_per_req"], 2)
    inner = " + ".join(f"{_fmt(v, 2)}" for v in parts.values())
    return f"{inner} = {_fmt(c['gateway_cpu_ms_per_req'], 2)}"


def print_tables(result: dict[str, Any]) -> None:
    cells = result["cells"]
    shapes = result["shapes"]
    head = f"{'':<30}" + "".join(f"{_LABELS[s]:>22}" for s in shapes)
    for spec in result["specs"]:
        lv = spec["name"]
        print(f"\n{lv}: c={spec['concurrency']}, {spec['chunks']} chunks, {spec['kind']}")
        print(head)
        rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
            ("requests/s", lambda c: _fmt(c["req_per_s"])),
            ("throughput, % of direct", lambda c: _fmt(c["throughput_pct_of_direct"])),
            (
                "TTFT p50 / p99, ms",
                lambda c: f"{_fmt(c['ttft_ms']['p50'])} / {_fmt(c['ttft_ms']['p99'])}",
            ),
            (
                "added TTFT p50 / p99, ms",
                lambda c: (
                    f"{_fmt(c['added_ttft_p50_ms'], sign=True)} / "
                    f"{_fmt(c['added_ttft_p99_ms'], sign=True)}"
                ),
            ),
            ("gateway CPU ms/request", _cpu_cell),
            ("sim CPU ms/request", lambda c: _fmt(c["sim_cpu_ms_per_req"], 2)),
            ("client reads/response", lambda c: _fmt(c["client_reads_per_response"])),
            ("foreign CPU % of a core", lambda c: _fmt(c["foreign_cpu_pct_of_core"], 0)),
        ]
        for label, fn in rows:
            line = f"{label:<30}"
            for s in shapes:
                c = cells[lv].get(s)
                line += f"{fn(c) if c else '-':>22}"
            print(line)
    for shape, fit in (result.get("sweep_fit") or {}).items():
        txt = ", ".join(
            f"{k} {f['fixed_ms']:.2f} ms + {f['per_chunk_us']:.1f} µs/chunk" for k, f in fit.items()
        )
        print(f"bench: sweep fit {_LABELS[shape]}: {txt}")
    print("\ntargets (issue 9), iop up / edge + node:")
    for key, row in result["targets"].items():
        vals = []
        for s in ("up", "split"):
            v = row[s]
            mark = {True: "ok", False: "MISSED", None: "n/a"}[v["met"]]
            vals.append(f"{_fmt(v['value'], 2)} ({mark})")
        print(f"  {key:<28}{row['bound']:<18}" + "  /  ".join(vals))


def _int_list(text: str, what: str, ap: argparse.ArgumentParser) -> list[int]:
    try:
        vals = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        ap.error(f"{what}: not a comma-separated list of integers: {text!r}")
    if not vals or min(vals) < 1:
        ap.error(f"{what}: values must be >= 1")
    return vals


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--shapes",
        default=",".join(SHAPES),
        help="which columns, comma-separated, of: %(default)s (direct is the reference of "
        "the added TTFT and throughput figures)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every level this many times, interleaved, and report the median of every "
        "cell (default: %(default)s)",
    )
    ap.add_argument(
        "--litellm",
        type=Path,
        default=LITELLM_DEFAULT,
        help="LiteLLM's `litellm` executable, in its own venv; the column is skipped when "
        "it is missing (default: ~/.cache/iop/bench-litellm/bin/litellm)",
    )
    g = ap.add_argument_group("paced levels (a real model's trickle)")
    g.add_argument(
        "--paced-rate", type=float, default=50.0, help="tokens/s per stream (default: %(default)s)"
    )
    g.add_argument(
        "--paced-concurrency", type=int, default=32, help="concurrency (default: %(default)s)"
    )
    g.add_argument(
        "--paced-requests",
        type=int,
        default=128,
        help="requests of 64 chunks in the window, 0 to skip the level (default: %(default)s)",
    )
    g.add_argument(
        "--paced-seconds",
        type=float,
        default=6.0,
        help="the paced c=32 window closes after this many seconds, with at least one "
        "request per client (default: %(default)s)",
    )
    g.add_argument(
        "--c1-requests",
        type=int,
        default=50,
        help="requests of the c=1 level, 0 to skip it (default: %(default)s)",
    )
    g.add_argument(
        "--c1-chunks",
        type=int,
        default=8,
        help="chunks per answer at c=1: TTFT needs only the first (default: %(default)s)",
    )
    g = ap.add_argument_group("as fast as the backend sends: chunk-count sweep, non-streaming")
    g.add_argument(
        "--fast-concurrency", type=int, default=32, help="concurrency (default: %(default)s)"
    )
    g.add_argument(
        "--sweep-chunks",
        default="1,16,64,256",
        help="content chunks per answer, one level each; empty to skip (default: %(default)s)",
    )
    g.add_argument(
        "--fast-requests",
        type=int,
        default=256,
        help="most requests in a window (default: %(default)s)",
    )
    g.add_argument(
        "--nonstream-requests",
        type=int,
        default=256,
        help="most non-streaming requests in the window, 0 to skip (default: %(default)s)",
    )
    g.add_argument(
        "--level-seconds",
        type=float,
        default=4.0,
        help="a fast or non-streaming window closes after this many seconds, with at least "
        "one request per client (default: %(default)s)",
    )
    g.add_argument(
        "--warmup",
        type=int,
        default=32,
        help="completions before a fast or non-streaming window opens; paced c=32: "
        "one per two clients (default: %(default)s)",
    )
    ap.add_argument(
        "--level-timeout",
        type=float,
        default=180.0,
        help="give up on a level after this many seconds (default: %(default)s)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="at the end, run one more paced c=32 window through edge + node with py-spy "
        "attached to each (needs py-spy; raw stacks go to --out-dir)",
    )
    ap.add_argument(
        "--out-dir",
        type=Path,
        default=REPO / "bench-results",
        help="where the JSON (and py-spy files) go (default: bench-results/)",
    )
    ap.add_argument(
        "--img-dir",
        type=Path,
        default=REPO / "docs" / "img",
        help="where the plots go (default: docs/img/)",
    )
    ap.add_argument("--no-plots", action="store_true", help="write the JSON only")
    ap.add_argument(
        "--replot",
        type=Path,
        metavar="JSON",
        help="measure nothing: print the tables and draw the plots of an earlier run's JSON",
    )
    ap.add_argument(
        "--python",
        default=sys.executable,
        help="interpreter that runs `-m iop` for the children (default: this one)",
    )
    args = ap.parse_args(argv)
    args.shape_list = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = sorted(set(args.shape_list) - set(SHAPES))
    if unknown or not args.shape_list:
        ap.error(f"--shapes: unknown {unknown}; choose from {','.join(SHAPES)}")
    args.sweep = _int_list(args.sweep_chunks, "--sweep-chunks", ap) if args.sweep_chunks else []
    for name in ("paced_requests", "c1_requests", "fast_requests", "nonstream_requests"):
        v = getattr(args, name)
        if not (1 if name == "fast_requests" else 0) <= v <= MAX_REQUESTS:
            ap.error(f"--{name.replace('_', '-')} must be within 0..{MAX_REQUESTS}")
    if not 1 <= args.repeat <= 10:
        ap.error("--repeat must be within 1..10")
    if args.paced_rate <= 0:
        ap.error("--paced-rate must be > 0")
    if args.c1_chunks < 1 or args.level_seconds <= 0 or args.paced_seconds <= 0:
        ap.error("--c1-chunks must be >= 1, --level-seconds and --paced-seconds > 0")
    if args.paced_concurrency < 2 or args.fast_concurrency < 1:
        ap.error("--paced-concurrency must be >= 2 (c=1 is its own level), --fast-concurrency >= 1")
    return args


def level_specs(args: argparse.Namespace) -> list[LevelSpec]:
    specs = []
    if args.paced_requests:
        c = args.paced_concurrency
        # One stream lasts CHUNKS / rate: the clients' starts spread over it.
        stagger = CHUNKS / args.paced_rate / c
        specs.append(
            LevelSpec(
                f"paced-c{c}",
                "paced",
                MODEL_PACED,
                c,
                args.paced_requests,
                # By the (c/2)-th completion every client has started (the last
                # one at (c-1) * stagger, before the first stream ends).
                warmup=c // 2,
                stagger_s=stagger,
                max_s=args.paced_seconds,
            )
        )
    if args.c1_requests:
        specs.append(
            LevelSpec(
                "paced-c1",
                "paced",
                MODEL_PACED,
                1,
                args.c1_requests,
                warmup=2,
                chunks=args.c1_chunks,
            )
        )
    c = args.fast_concurrency
    for k in args.sweep:
        specs.append(
            LevelSpec(
                f"fast-{k}ch",
                "fast",
                MODEL_FAST,
                c,
                args.fast_requests,
                warmup=args.warmup,
                chunks=k,
                max_s=args.level_seconds,
            )
        )
    if args.nonstream_requests:
        specs.append(
            LevelSpec(
                "nonstream",
                "nonstream",
                MODEL_FAST,
                c,
                args.nonstream_requests,
                warmup=args.warmup,
                stream=False,
                max_s=args.level_seconds,
            )
        )
    return specs


def _term_as_int(signum: int, frame: object) -> None:
    # SIGTERM becomes SIGINT, which trio turns into a clean KeyboardInterrupt
    # (raising from this handler could tear a running trio.run apart).
    os.kill(os.getpid(), signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Even when started in the background with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _term_as_int)
    try:
        return _main(args)
    except BaseException as exc:
        # trio may deliver the interrupt inside an exception group.
        if isinstance(exc, KeyboardInterrupt) or (
            isinstance(exc, BaseExceptionGroup) and exc.subgroup(KeyboardInterrupt) is not None
        ):
            print("bench: interrupted; every process it started is stopped", file=sys.stderr)
            return 130
        raise


def _main(args: argparse.Namespace) -> int:
    if args.replot:
        earlier: dict[str, Any] = json.loads(args.replot.read_text())
        print_tables(earlier)
        for p in plot(earlier, args.img_dir):
            print(f"bench: plot {p}")
        return 0
    result, failed = run_all(args)
    out = args.out_dir / f"platform-{result['timestamp']}.json"
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")

    print_tables(result)
    prof = result.get("profile")
    if prof:
        for name in ("edge", "node"):
            top = prof.get(name, {}).get("self_pct_top_functions", [])[:5]
            print(f"bench: py-spy paced-c32 {name}, self % by function: {top}")
    print(f"bench: results in {out} ({result['duration_s']} s)")
    if not args.no_plots:
        for p in plot(result, args.img_dir):
            print(f"bench: plot {p}")
    if failed:
        print(f"bench: {failed} request(s) failed", file=sys.stderr)
        return 1
    return 0


def run_all(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    """One run of every level and shape ``args`` asks for: the result (what
    the JSON holds) and how many requests failed."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    specs = level_specs(args)
    lite_version = litellm_version(args.litellm) if "litellm" in args.shape_list else None
    result: dict[str, Any] = {
        "timestamp": stamp,
        "commit": git_commit(),
        "command": " ".join(["scripts/bench_platform.py", *sys.argv[1:]]),
        "machine": machine_info(),
        "litellm_version": lite_version,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "settings": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("out_dir", "img_dir")
        },
        "specs": [vars(s) | {"max_s": None if math.isinf(s.max_s) else s.max_s} for s in specs],
    }
    if lite_version and lite_version != LITELLM_WANTED:
        print(f"bench: LiteLLM {lite_version}, not {LITELLM_WANTED}", file=sys.stderr)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s.name: {} for s in specs}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="iop-bench-") as tmp:
        try:
            with running_platform(args, Path(tmp)) as plat:
                for shape, why in plat.skipped.items():
                    print(f"bench: skipping the {shape} column: {why}", file=sys.stderr)
                result["skipped"] = plat.skipped
                shapes = list(plat.gateways)
                result["shapes"] = shapes
                result["pids"] = {p.name: p.pid for p in plat.started} | {"client": os.getpid()}
                result["urls"] = {s: g.urls for s, g in plat.gateways.items()}
                print(f"bench: shapes {shapes}; pids {result['pids']}", flush=True)
                for rep in range(args.repeat):
                    # Rotate the shapes' order: none is always first after another.
                    order = shapes[rep % len(shapes) :] + shapes[: rep % len(shapes)]
                    for spec in specs:
                        for shape in order:
                            print(
                                f"bench: [{rep + 1}/{args.repeat}] {spec.name} via {shape}: "
                                f"{spec.requests} requests (+{spec.warmup} warm-up) at "
                                f"concurrency {spec.concurrency}",
                                flush=True,
                            )
                            lv = run_window(plat, shape, spec, args.level_timeout)
                            lv["repeat"] = rep
                            runs[spec.name].setdefault(shape, []).append(lv)
                            if lv["errors"]:
                                print(f"bench: errors {lv['errors']}", file=sys.stderr)
                        reps = {s: r[-1] for s, r in runs[spec.name].items()}
                        relative(list(reps.values()), reps.get("direct"))
                if "litellm" in plat.gateways:
                    kids = descendants(plat.gateways["litellm"].procs["litellm"].pid)
                    result["litellm_children"] = {
                        "at_start": plat.gateways["litellm"].children["litellm"],
                        "at_end": kids,
                    }
                if args.profile:
                    py_spy = find_py_spy(args.python)
                    pspec = next((s for s in specs if s.name == "paced-c32"), None)
                    if py_spy is None:
                        print("bench: --profile needs py-spy (pip install py-spy)", file=sys.stderr)
                    elif pspec is None or "split" not in plat.gateways:
                        print(
                            "bench: --profile needs the split shape and the paced c=32 level",
                            file=sys.stderr,
                        )
                    else:
                        print("bench: py-spy on edge and node during paced-c32", flush=True)
                        result["profile"] = run_profile(
                            plat, py_spy, pspec, args.out_dir, stamp, args.level_timeout
                        )
        except Exception:
            for name in ("sim", "sim_paced", "edge", "node", "up", "litellm"):
                p = Path(tmp) / f"{name}.stderr"
                if p.exists():
                    tail = p.read_text(errors="replace").splitlines()[-10:]
                    print(f"--- {name} stderr (tail)\n" + "\n".join(tail), file=sys.stderr)
            raise
    cells = {lv: {s: merge(r) for s, r in by.items()} for lv, by in runs.items()}
    cells = {lv: {s: by[s] for s in result["shapes"] if s in by} for lv, by in cells.items()}
    result["cells"] = cells
    result["sweep_fit"] = sweep_fits(cells, specs)
    result["targets"] = check_targets(cells, result["sweep_fit"])
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["duration_s"] = round(time.monotonic() - t_start, 1)
    failed = sum(r["requests"] - r["ok"] for by in runs.values() for rs in by.values() for r in rs)
    return result, failed


if __name__ == "__main__":
    sys.exit(main())
