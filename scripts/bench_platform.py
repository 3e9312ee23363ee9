"""Benchmark the whole platform: client -> edge -> node -> backend, as real processes.

Starts, each as its own process (all stopped by PID at the end, on error and on
Ctrl-C or SIGTERM):

* two simulated backends (``iop sim``, vLLM's wire format, 64 content chunks per
  answer, no time to first token): ``iop-sim`` streams as fast as it can,
  ``iop-sim-paced`` at ``--paced-rate`` tokens/s (a real LLM's trickle);
* an edge (``iop edge --port 0 --node-token ...``);
* a node (``iop node --config <tmp toml>``) with one ``vllm`` instance per sim.

Once the edge is ready (``/readyz`` and both models in ``/v1/models``), this
process drives streamed chat completions (``stream: true``) through the edge
with a closed-loop httpx/trio load generator, one level per concurrency, and
checks that every answer has its 64 content chunks and ``[DONE]``. Then a
chunk-count sweep (the answer length set per request with the sim's
``iop_sim.output_tokens`` override) splits the cost into a fixed part per
request and a part per chunk.

What it reports is **CPU time per request**, not requests per second: the
utime+stime of the edge, node and sim processes (from /proc/PID/stat) before
and after each level, divided by the requests of that level. On a shared
2-core box req/s moves with whatever else runs; CPU per request does not
(much). Capacity of one core ~= 1000 / (CPU ms per request). The load average
and the machine's busy CPU not explained by the benchmark's own processes
("foreign") are recorded per level so that a noisy run can be recognised.

Outputs:
  bench-results/platform-<timestamp>.json   every number (the directory is gitignored)
  docs/img/bench_cpu_per_request.png         edge/node CPU ms per request, with references
  docs/img/bench_latency.png                 client-observed TTFT and total latency

Examples:
  python scripts/bench_platform.py                       # defaults, about 40 s on 2 cores
  python scripts/bench_platform.py --repeat 3            # median of 3 interleaved runs
  python scripts/bench_platform.py --requests 1000 --concurrency 1,8,32,64
  python scripts/bench_platform.py --profile             # + py-spy on edge and node (c=32)
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
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

REPO = Path(__file__).resolve().parent.parent
CHUNKS = 64  # content chunks per answer (sim --output-tokens)
NODE_TOKEN = "bench-token"
MODEL_FAST = "iop-sim"
MODEL_PACED = "iop-sim-paced"
MAX_REQUESTS = 20_000  # per level, whatever is asked
CLK_TCK = os.sysconf("SC_CLK_TCK")

# Reference figures drawn on the plot; how they were measured: docs/benchmarks.md,
# "Earlier measurements" (the trio-stack spike, LiteLLM 1.108.5).
LITELLM_MS = (49.0, 61.0)  # LiteLLM CPU per 64-chunk stream
LITELLM_PACED_MS = (57.0, 72.0)  # same, paced 64 x 20 ms, c=32
LITELLM_FIXED_MS = (17.0, 20.0)  # LiteLLM: fixed part per streamed request
LITELLM_PER_CHUNK_MS = 0.6  # ... plus this per SSE chunk
SPIKE_EDGE_E2E_MS = 5.3  # spike: prototype edge (one process, httpx upstream), c=32
SPIKE_SSE_COALESCE_MS = 2.2  # spike: quart-trio SSE + coalescing, no upstream, c=32
SPIKE_EDGE_PACED_MS = 14.5  # spike: prototype edge at 50 tok/s, c=32


# --------------------------------------------------------------------------- /proc


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of proc(5)


def proc_wakeups(pid: int) -> int:
    """Voluntary context switches of the process's main thread: times it slept."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    return 0


def machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)  # idle + iowait
    total = sum(parts[:8])  # guest time is already counted in user
    return (total - idle) / CLK_TCK, total / CLK_TCK


# --------------------------------------------------------------------------- processes


@dataclass
class Proc:
    """A child process with its output in log files; stopped by PID."""

    name: str
    argv: list[str]
    logdir: Path
    popen: subprocess.Popen[bytes] | None = None

    @property
    def out_path(self) -> Path:
        return self.logdir / f"{self.name}.out"

    @property
    def err_path(self) -> Path:
        return self.logdir / f"{self.name}.err"

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            # Own session: a Ctrl-C in the terminal reaches only this script,
            # which then stops every child itself, in order.
            self.popen = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
                env=env,
                start_new_session=True,
            )

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first match of ``pattern`` in the process's stdout."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while True:
            m = rx.search(self.out_path.read_text(errors="replace"))
            if m:
                return m
            if self.popen is not None and self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited early:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no {pattern!r} within {timeout}s:\n{self.tail()}")
            time.sleep(0.05)

    def tail(self, n: int = 15) -> str:
        lines = []
        for p in (self.out_path, self.err_path):
            with contextlib.suppress(OSError):
                lines += p.read_text(errors="replace").splitlines()[-n:]
        return "\n".join(lines)

    def cpu_s(self) -> float:
        return proc_cpu_s(self.pid)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGINT (the CLIs drain and exit 0), then SIGKILL after ``timeout``."""
        p = self.popen
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGINT)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            print(f"bench: {self.name} (pid {p.pid}) ignored SIGINT; killing", file=sys.stderr)
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            p.wait(5)


@dataclass
class Platform:
    sim_fast: Proc
    sim_paced: Proc
    edge: Proc
    node: Proc
    url: str  # http://host:port of the edge

    def procs(self) -> dict[str, Proc]:
        return {
            "edge": self.edge,
            "node": self.node,
            "sim": self.sim_fast,
            "sim_paced": self.sim_paced,
        }


_NODE_TOML = """\
[node]
id = "bench"
probe_interval_s = 30.0

[[node.edges]]
url = "{link}"
token = "{token}"

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


@contextlib.contextmanager
def running_platform(python: str, paced_rate: float, logdir: Path) -> Iterator[Platform]:
    """Start sims, edge and node; stop them all (by PID) however the block ends."""
    started: list[Proc] = []

    def launch(name: str, *args: str) -> Proc:
        p = Proc(name, [python, "-m", "iop", *args], logdir)
        started.append(p)
        p.start()
        return p

    url_rx = r"(http://[0-9a-z.:\[\]]+)/v1"
    try:
        sim = ["sim", "--port", "0", "--ttft", "0", "--output-tokens", str(CHUNKS)]
        sim_fast = launch("sim", *sim, "--tokens-per-s", "0", "--model", MODEL_FAST)
        sim_paced = launch(
            "sim_paced", *sim, "--tokens-per-s", f"{paced_rate:g}", "--model", MODEL_PACED
        )
        edge = launch("edge", "edge", "--port", "0", "--node-token", NODE_TOKEN)
        fast_url = sim_fast.wait_for(url_rx, 30)[1]
        paced_url = sim_paced.wait_for(url_rx, 30)[1]
        m = edge.wait_for(url_rx + r".*nodes dial (ws://\S+)", 30)
        node_toml = logdir / "node.toml"
        node_toml.write_text(
            _NODE_TOML.format(link=m[2], token=NODE_TOKEN, fast=fast_url, paced=paced_url)
        )
        node = launch("node", "node", "--config", str(node_toml))
        plat = Platform(sim_fast, sim_paced, edge, node, m[1])
        wait_ready(plat, timeout=30)
        yield plat
    finally:
        # The node first (it drains its runs), then the edge, then the backends.
        order = {"node": 0, "edge": 1}
        for p in sorted(started, key=lambda p: order.get(p.name, 2)):
            try:
                p.stop()
            except Exception as exc:
                print(f"bench: stopping {p.name}: {exc!r}", file=sys.stderr)


def wait_ready(plat: Platform, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    with httpx.Client(timeout=2, trust_env=False) as c:
        while time.monotonic() < deadline:
            for p in plat.procs().values():
                if p.popen is not None and p.popen.poll() is not None:
                    raise RuntimeError(f"{p.name} exited during start-up:\n{p.tail()}")
            try:
                r = c.get(plat.url + "/readyz")
                if r.status_code == 200:
                    models = {m["id"] for m in c.get(plat.url + "/v1/models").json()["data"]}
                    if {MODEL_FAST, MODEL_PACED} <= models:
                        return
                    last = f"models: {sorted(models)}"
                else:
                    last = f"/readyz {r.status_code} {r.text}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.1)
    raise RuntimeError(f"edge not ready within {timeout}s ({last})")


# --------------------------------------------------------------------------- load


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta = msgspec.field(default_factory=_Delta)


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


@dataclass
class Sample:
    ok: bool
    ttft_s: float  # request sent -> first content chunk
    total_s: float  # request sent -> end of the response
    chunks: int
    reads: int  # body pieces received: about the number of the edge's writes
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


@dataclass(frozen=True)
class LevelSpec:
    name: str
    kind: str  # "fast", "paced" or "sweep"
    model: str
    concurrency: int
    requests: int
    chunks: int = CHUNKS

    def body(self) -> bytes:
        req: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "messages": [{"role": "user", "content": "Tell me about the benchmark."}],
        }
        if self.kind == "sweep":
            # The sim's per-request override; edge and node pass unknown keys
            # through to the backend (ExecutionSpec.extra_body).
            req["iop_sim"] = {"output_tokens": self.chunks}
        return msgspec.json.encode(req)


async def drive(url: str, spec: LevelSpec, n: int, timeout_s: float) -> list[Sample]:
    """Closed loop: ``spec.concurrency`` workers issue ``n`` requests in total."""
    body = spec.body()
    samples: list[Sample] = []
    left = n
    c = spec.concurrency
    limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
    timeout = httpx.Timeout(connect=5, read=60, write=5, pool=60)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                samples.append(
                    await one_request(client, url + "/v1/chat/completions", body, spec.chunks)
                )

        with trio.fail_after(timeout_s):
            async with trio.open_nursery() as nursery:
                for _ in range(c):
                    nursery.start_soon(worker)
    return samples


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    vals = sorted(v for v in values if not math.isnan(v))
    if not vals:
        return math.nan
    return vals[max(0, min(len(vals) - 1, math.ceil(p / 100 * len(vals)) - 1))]


def run_level(plat: Platform, spec: LevelSpec, warmup: int, timeout_s: float) -> dict[str, Any]:
    """One measured level (after ``warmup`` unmeasured requests)."""
    procs = plat.procs()
    if warmup:
        trio.run(drive, plat.url, spec, warmup, timeout_s)
    load0 = os.getloadavg()
    cpu0 = {k: p.cpu_s() for k, p in procs.items()}
    wake0 = {k: proc_wakeups(procs[k].pid) for k in ("edge", "node")}
    own0 = time.process_time()
    busy0, total0 = machine_cpu_s()
    t0 = time.perf_counter()
    samples = trio.run(drive, plat.url, spec, spec.requests, timeout_s)
    wall = time.perf_counter() - t0
    busy1, total1 = machine_cpu_s()
    own = time.process_time() - own0
    cpu = {k: p.cpu_s() - cpu0[k] for k, p in procs.items()}
    wakes = {k: proc_wakeups(procs[k].pid) - wake0[k] for k in wake0}
    load1 = os.getloadavg()

    n = len(samples)
    ok = [s for s in samples if s.ok]
    ms = {k: v * 1000 / n for k, v in cpu.items()}
    edge_node = ms["edge"] + ms["node"]
    busy = busy1 - busy0
    ours = sum(cpu.values()) + own

    def lat(attr: str) -> dict[str, float]:
        vals = [getattr(s, attr) * 1000 for s in ok]
        return {"p50": round(pct(vals, 50), 2), "p99": round(pct(vals, 99), 2)}

    return {
        "level": spec.name,
        "kind": spec.kind,
        "model": spec.model,
        "concurrency": spec.concurrency,
        "chunks": spec.chunks,
        "requests": n,
        "ok": len(ok),
        "errors": dict(Counter(s.error for s in samples if not s.ok)),
        "wall_s": round(wall, 3),
        "req_per_s": round(n / wall, 2),
        "cpu_s": {k: round(v, 3) for k, v in cpu.items()} | {"client": round(own, 3)},
        "edge_cpu_ms_per_req": round(ms["edge"], 3),
        "node_cpu_ms_per_req": round(ms["node"], 3),
        "edge_node_cpu_ms_per_req": round(edge_node, 3),
        "edge_us_per_chunk": round(ms["edge"] * 1000 / spec.chunks, 1),
        "node_us_per_chunk": round(ms["node"] * 1000 / spec.chunks, 1),
        "edge_node_us_per_chunk": round(edge_node * 1000 / spec.chunks, 1),
        "sim_cpu_ms_per_req": round(ms["sim_paced" if spec.kind == "paced" else "sim"], 3),
        "client_cpu_ms_per_req": round(own * 1000 / n, 3),
        "capacity_req_per_core_s": round(1000 / edge_node, 1) if edge_node else None,
        "edge_wakeups_per_req": round(wakes["edge"] / n, 1),
        "node_wakeups_per_req": round(wakes["node"] / n, 1),
        "client_reads_per_response": round(sum(s.reads for s in ok) / max(1, len(ok)), 1),
        "edge_cpu_pct": round(100 * cpu["edge"] / wall, 1),
        "node_cpu_pct": round(100 * cpu["node"] / wall, 1),
        "ttft_ms": lat("ttft_s"),
        "total_ms": lat("total_s"),
        "loadavg_before": [round(x, 2) for x in load0],
        "loadavg_after": [round(x, 2) for x in load1],
        "machine_busy_pct": round(100 * busy / (total1 - total0), 1) if total1 > total0 else None,
        # Busy CPU, in % of one core, that none of the benchmark's processes used.
        "foreign_cpu_pct_of_core": round(100 * max(0.0, busy - ours) / wall, 1),
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median edge+node CPU, plus every run's key numbers."""
    ranked = sorted(runs, key=lambda r: r["edge_node_cpu_ms_per_req"])
    out = dict(ranked[(len(ranked) - 1) // 2])
    if len(runs) > 1:
        keys = ("edge_cpu_ms_per_req", "node_cpu_ms_per_req", "edge_node_cpu_ms_per_req")
        out["repeats"] = [
            {k: r[k] for k in (*keys, "req_per_s", "loadavg_after", "foreign_cpu_pct_of_core")}
            for r in runs
        ]
        vals = [r["edge_node_cpu_ms_per_req"] for r in runs]
        out["edge_node_cpu_ms_range"] = [min(vals), max(vals)]
    return out


def linear_fit(points: list[tuple[float, float]]) -> dict[str, float]:
    """Least squares y = fixed + per_chunk * x."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return {"fixed_ms": round(my - slope * mx, 3), "per_chunk_us": round(slope * 1000, 1)}


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
        "self_pct_by_package": share(self_pkg),
        "inclusive_pct_by_package": share(incl_pkg, entry),
        "self_pct_top_functions": share(self_fn),
        "inclusive_pct_top_functions": share(incl_fn, entry + entry_fns),
    }


def run_profile(
    plat: Platform, py_spy: str, spec: LevelSpec, outdir: Path, stamp: str, timeout_s: float
) -> dict[str, Any]:
    """One more level with py-spy (non-blocking, 250 Hz) attached to the edge and the node."""
    spies: dict[str, subprocess.Popen[bytes]] = {}
    raw: dict[str, Path] = {}
    trio.run(drive, plat.url, spec, spec.concurrency, timeout_s)  # warm-up
    try:
        for name in ("edge", "node"):
            raw[name] = outdir / f"pyspy-{stamp}-{spec.name}-{name}.txt"
            spies[name] = subprocess.Popen(
                [
                    py_spy,
                    "record",
                    "--pid",
                    str(plat.procs()[name].pid),
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
        level = run_level(plat, spec, warmup=0, timeout_s=timeout_s)
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
    out: dict[str, Any] = {"level": level, "raw_files": {k: str(v) for k, v in raw.items()}}
    for name, path in raw.items():
        out[name] = summarize_raw(path) if path.exists() else {"error": "py-spy wrote nothing"}
    return out


# --------------------------------------------------------------------------- plots


def _label(lv: dict[str, Any], paced_rate: float) -> str:
    if lv["kind"] == "paced":
        return f"c={lv['concurrency']}\npaced {paced_rate:g} tok/s"
    return f"c={lv['concurrency']}\nas fast as possible"


def _fmt_ms(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def plot(result: dict[str, Any], img_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    levels = result["levels"]
    rate = result["settings"]["paced_rate"]
    labels = [_label(lv, rate) for lv in levels]
    x = list(range(len(levels)))
    edge = [lv["edge_cpu_ms_per_req"] for lv in levels]
    node = [lv["node_cpu_ms_per_req"] for lv in levels]
    has_paced = any(lv["kind"] == "paced" for lv in levels)
    machine = result["machine"]
    where = (
        f"{machine['ncpu']} vCPU {machine['cpu_model']}, shared; "
        f"load average {result['loadavg_start'][0]:.2f} at start, "
        f"{result['loadavg_end'][0]:.2f} at end; {result['timestamp']}"
    )
    paths = []

    # ---- CPU per request
    fig = plt.figure(figsize=(14, 10.5), dpi=100)
    gs = fig.add_gridspec(2, 2, width_ratios=[3, 2], height_ratios=[1.15, 1])
    ax = fig.add_subplot(gs[0, 0])
    ax.bar(x, edge, 0.55, label="edge", color="#4C72B0")
    ax.bar(x, node, 0.55, bottom=edge, label="node", color="#DD8452")
    top = max(e + n for e, n in zip(edge, node, strict=True))
    for i, (e, n) in enumerate(zip(edge, node, strict=True)):
        ax.text(i, e + n + top * 0.015, f"{e + n:.1f} ms", ha="center", va="bottom", fontsize=11)
        ax.text(i, e / 2, f"{e:.2f}", ha="center", va="center", color="white", fontsize=9)
        ax.text(i, e + n / 2, f"{n:.2f}", ha="center", va="center", color="white", fontsize=9)
    # The spike's figures, over the levels they were measured at.
    for i, lv in enumerate(levels):
        refs: list[tuple[float, str]] = []
        if lv["kind"] == "paced":
            refs = [(SPIKE_EDGE_PACED_MS, f"spike edge {SPIKE_EDGE_PACED_MS:g}")]
        elif lv["concurrency"] == 32:
            refs = [
                (SPIKE_EDGE_E2E_MS, f"spike edge {SPIKE_EDGE_E2E_MS:g}"),
                (SPIKE_SSE_COALESCE_MS, f"spike SSE-only {SPIKE_SSE_COALESCE_MS:g}"),
            ]
        for y, txt in refs:
            ax.hlines(y, i - 0.36, i + 0.36, colors="black", linestyles="--", linewidth=1.4)
            ax.text(
                i + 0.3,
                y,
                txt,
                ha="right",
                va="bottom",
                fontsize=8,
                bbox={"facecolor": "white", "alpha": 0.8, "pad": 1, "edgecolor": "none"},
            )
    ax.set_xticks(x, labels)
    ax.set_ylim(0, max(top, SPIKE_EDGE_PACED_MS if has_paced else 0) * 1.15)
    ax.set_ylabel("CPU ms per 64-chunk streamed request")
    ax.set_title("IOP edge + node CPU per request (lower is better)")
    ax.legend(loc="upper left")
    ax.grid(axis="y", alpha=0.3)

    # Top right: on LiteLLM's scale.
    ax2 = fig.add_subplot(gs[0, 1])
    bars: list[tuple[str, float, str, tuple[float, float] | None]] = []
    fast = [lv for lv in levels if lv["kind"] == "fast"]
    paced = [lv for lv in levels if lv["kind"] == "paced"]
    if fast:
        best = max(fast, key=lambda lv: lv["concurrency"])
        c = best["concurrency"]
        bars.append((f"IOP\nedge+node\nc={c}", best["edge_node_cpu_ms_per_req"], "#4C72B0", None))
    bars.append(("trio spike\nedge alone\nc=32", SPIKE_EDGE_E2E_MS, "#999999", None))
    bars.append(("LiteLLM\n1.108.5\nc=1..32", sum(LITELLM_MS) / 2, "#C44E52", LITELLM_MS))
    if paced:
        pv = paced[0]["edge_node_cpu_ms_per_req"]
        bars.append((f"IOP\nedge+node\npaced c={paced[0]['concurrency']}", pv, "#4C72B0", None))
        bars.append(
            ("LiteLLM\npaced\nc=32", sum(LITELLM_PACED_MS) / 2, "#C44E52", LITELLM_PACED_MS)
        )
    for i, (_, v, color, rng) in enumerate(bars):
        ax2.bar(i, v, 0.6, color=color)
        if rng:
            lo, hi = rng
            ax2.errorbar(i, v, yerr=[[v - lo], [hi - v]], color="black", capsize=5)
            ax2.text(i, hi + 1, f"{lo:.0f}-{hi:.0f}", ha="center", va="bottom", fontsize=9)
        else:
            ax2.text(i, v + 1, f"{v:.1f}", ha="center", va="bottom", fontsize=9)
    ax2.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax2.set_ylim(0, LITELLM_PACED_MS[1] * 1.15)
    ax2.set_ylabel("CPU ms per 64-chunk streamed request")
    ax2.set_title("Next to the references (different setups: see docs)")
    ax2.grid(axis="y", alpha=0.3)

    # Bottom: chunk-count sweep, fixed + per-chunk cost.
    ax3 = fig.add_subplot(gs[1, :])
    sweep = result.get("sweep") or []
    if sweep:
        xs = [lv["chunks"] for lv in sweep]
        for key, color, name in (
            ("edge_cpu_ms_per_req", "#4C72B0", "edge"),
            ("node_cpu_ms_per_req", "#DD8452", "node"),
            ("edge_node_cpu_ms_per_req", "#222222", "edge + node"),
        ):
            ys = [lv[key] for lv in sweep]
            ax3.plot(xs, ys, "o-", color=color, label=f"IOP {name} (measured)")
        fit = result["sweep_fit"]["edge_node"]
        lx = [0, max(xs)]
        ax3.plot(
            lx,
            [fit["fixed_ms"] + fit["per_chunk_us"] / 1000 * v for v in lx],
            ":",
            color="#222222",
            linewidth=1,
            label=f"IOP edge + node fit: {fit['fixed_ms']:.1f} ms + {fit['per_chunk_us']:.0f} µs/chunk",
        )
        ymax = max(lv["edge_node_cpu_ms_per_req"] for lv in sweep) * 1.6
        for i, fixed in enumerate(LITELLM_FIXED_MS):
            ax3.plot(
                lx,
                [fixed + LITELLM_PER_CHUNK_MS * v for v in lx],
                "--",
                color="#C44E52",
                linewidth=1.2,
                label=(
                    f"LiteLLM 1.108.5: {LITELLM_FIXED_MS[0]:g}-{LITELLM_FIXED_MS[1]:g} ms"
                    f" + {LITELLM_PER_CHUNK_MS * 1000:.0f} µs/chunk"
                )
                if i == 0
                else None,
            )
        ax3.set_ylim(0, ymax)
        ax3.set_xlabel(
            f"content chunks per streamed answer (c={sweep[0]['concurrency']}, as fast as possible)"
        )
        ax3.set_ylabel("CPU ms per request")
        ax3.set_title("Fixed vs per-chunk cost: chunk-count sweep")
        ax3.set_xlim(-5, max(xs) * 1.05)
        ax3.legend(loc="upper right", fontsize=9)
        ax3.grid(alpha=0.3, which="both")
    else:
        ax3.axis("off")
    fig.suptitle(where, fontsize=9, y=0.995)
    fig.tight_layout()
    p = img_dir / "bench_cpu_per_request.png"
    fig.savefig(p)
    plt.close(fig)
    paths.append(p)

    # ---- Latency, client-observed
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2), dpi=100)
    w = 0.38
    for ax, key, title in (
        (axes[0], "ttft_ms", "time to first content chunk"),
        (axes[1], "total_ms", "whole stream (64 chunks + [DONE])"),
    ):
        p50 = [lv[key]["p50"] for lv in levels]
        p99 = [lv[key]["p99"] for lv in levels]
        ax.bar([i - w / 2 for i in x], p50, w, label="p50", color="#4C72B0")
        ax.bar([i + w / 2 for i in x], p99, w, label="p99", color="#8172B3")
        for i in x:
            for dx, v in ((-w / 2, p50[i]), (w / 2, p99[i])):
                ax.text(i + dx, v * 1.08, _fmt_ms(v), ha="center", va="bottom", fontsize=8)
        if key == "total_ms":
            for i, lv in enumerate(levels):
                if lv["kind"] == "paced":
                    ideal = 1000 * CHUNKS / rate
                    ax.hlines(ideal, i - 0.45, i + 0.45, colors="black", linestyles="--")
                    ax.text(i, ideal * 0.9, f"ideal {ideal:.0f}", ha="center", va="top", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylim(min(p50) / 2, max(p99) * 3)
        ax.set_xticks(x, labels, fontsize=9)
        ax.set_ylabel("ms (log scale)")
        ax.set_title(f"Client-observed {title}")
        ax.legend(loc="upper left")
        ax.grid(axis="y", alpha=0.3, which="both")
    fig.suptitle(
        "Latency through edge + node, sim backend with no prefill delay\n" + where, fontsize=9
    )
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


def print_table(levels: list[dict[str, Any]]) -> None:
    print(
        f"{'level':<14}{'reqs':>6}{'req/s':>8}{'edge ms':>9}{'node ms':>9}{'e+n ms':>8}"
        f"{'e+n µs/ch':>10}{'sim ms':>8}{'ttft p50/p99 ms':>17}{'total p50/p99 ms':>19}"
        f"{'load1':>7}{'foreign%':>9}"
    )
    for lv in levels:
        print(
            f"{lv['level']:<14}{lv['requests']:>6}{lv['req_per_s']:>8.1f}"
            f"{lv['edge_cpu_ms_per_req']:>9.2f}{lv['node_cpu_ms_per_req']:>9.2f}"
            f"{lv['edge_node_cpu_ms_per_req']:>8.2f}{lv['edge_node_us_per_chunk']:>10.1f}"
            f"{lv['sim_cpu_ms_per_req']:>8.2f}"
            f"{lv['ttft_ms']['p50']:>9.1f}/{lv['ttft_ms']['p99']:<7.1f}"
            f"{lv['total_ms']['p50']:>10.1f}/{lv['total_ms']['p99']:<8.1f}"
            f"{lv['loadavg_after'][0]:>7.2f}{lv['foreign_cpu_pct_of_core']:>9.0f}"
        )


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
        "--concurrency",
        default="1,8,32",
        help="concurrency levels, streams as fast as possible (default: %(default)s)",
    )
    ap.add_argument(
        "--requests", type=int, default=300, help="requests per level (default: %(default)s)"
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=32,
        help="unmeasured requests before each level (default: %(default)s)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every level this many times, interleaved, and report the run with the "
        "median edge+node CPU (default: %(default)s)",
    )
    g = ap.add_argument_group("paced level (a real LLM's trickle)")
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
        help="requests, 0 to skip the level (default: %(default)s)",
    )
    g = ap.add_argument_group("chunk-count sweep (fixed vs per-chunk cost)")
    g.add_argument(
        "--sweep-chunks",
        default="1,16,64,256",
        help="content chunks per answer; empty to skip the sweep (default: %(default)s)",
    )
    g.add_argument(
        "--sweep-concurrency", type=int, default=8, help="concurrency (default: %(default)s)"
    )
    g.add_argument(
        "--sweep-requests", type=int, default=150, help="requests per point (default: %(default)s)"
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
        help="at the end, run one more c=32 level with py-spy attached to the edge and the "
        "node (needs py-spy; raw stacks go to --out-dir)",
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
        "--python",
        default=sys.executable,
        help="interpreter that runs `-m iop` for the children (default: this one)",
    )
    args = ap.parse_args(argv)
    args.levels = _int_list(args.concurrency, "--concurrency", ap)
    args.sweep = _int_list(args.sweep_chunks, "--sweep-chunks", ap) if args.sweep_chunks else []
    for name in ("requests", "paced_requests", "sweep_requests"):
        v = getattr(args, name)
        if not (0 if name == "paced_requests" else 1) <= v <= MAX_REQUESTS:
            ap.error(f"--{name.replace('_', '-')} must be within 1..{MAX_REQUESTS}")
    if not 1 <= args.repeat <= 10:
        ap.error("--repeat must be within 1..10")
    if args.paced_rate <= 0:
        ap.error("--paced-rate must be > 0")
    return args


def _term_as_int(signum: int, frame: object) -> None:
    # SIGTERM becomes SIGINT, which trio turns into a clean KeyboardInterrupt
    # (raising from this handler could tear a running trio.run apart).
    os.kill(os.getpid(), signal.SIGINT)


def level_specs(args: argparse.Namespace) -> list[LevelSpec]:
    specs = [LevelSpec(f"c{c}", "fast", MODEL_FAST, c, args.requests) for c in args.levels]
    if args.paced_requests:
        c = args.paced_concurrency
        specs.append(LevelSpec(f"c{c}-paced", "paced", MODEL_PACED, c, args.paced_requests))
    c = args.sweep_concurrency
    specs += [
        LevelSpec(f"sweep-{k}ch", "sweep", MODEL_FAST, c, args.sweep_requests, chunks=k)
        for k in args.sweep
    ]
    return specs


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
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    specs = level_specs(args)
    result: dict[str, Any] = {
        "timestamp": stamp,
        "machine": machine_info(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "settings": {
            "chunks_per_request": CHUNKS,
            "requests": args.requests,
            "warmup": args.warmup,
            "repeat": args.repeat,
            "concurrency": args.levels,
            "paced_rate": args.paced_rate,
            "paced_concurrency": args.paced_concurrency,
            "paced_requests": args.paced_requests,
            "sweep_chunks": args.sweep,
            "sweep_concurrency": args.sweep_concurrency,
            "sweep_requests": args.sweep_requests,
        },
    }
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in specs}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="iop-bench-") as tmp:
        try:
            with running_platform(args.python, args.paced_rate, Path(tmp)) as plat:
                pids = {k: p.pid for k, p in plat.procs().items()} | {"client": os.getpid()}
                result["pids"] = pids
                print(f"bench: edge at {plat.url}; pids {pids}", flush=True)
                for rep in range(args.repeat):
                    for spec in specs:
                        # A paced request lasts seconds: one warm-up round is enough.
                        warm = spec.concurrency if spec.kind == "paced" else args.warmup
                        print(
                            f"bench: [{rep + 1}/{args.repeat}] {spec.name}: {spec.requests} "
                            f"requests (+{warm} warm-up) at concurrency {spec.concurrency}",
                            flush=True,
                        )
                        lv = run_level(plat, spec, warm, args.level_timeout)
                        runs[spec.name].append(lv)
                        if lv["errors"]:
                            print(f"bench: {spec.name}: errors {lv['errors']}", file=sys.stderr)
                if args.profile:
                    py_spy = find_py_spy(args.python)
                    if py_spy is None:
                        print("bench: --profile needs py-spy (pip install py-spy)", file=sys.stderr)
                    else:
                        result["profile"] = {}
                        pspecs = [LevelSpec("c32", "fast", MODEL_FAST, 32, 2 * args.requests)]
                        if args.paced_requests:
                            c = args.paced_concurrency
                            pspecs.append(
                                LevelSpec(
                                    f"c{c}-paced", "paced", MODEL_PACED, c, args.paced_requests
                                )
                            )
                        for pspec in pspecs:
                            print(f"bench: py-spy on edge and node during {pspec.name}", flush=True)
                            result["profile"][pspec.name] = run_profile(
                                plat, py_spy, pspec, args.out_dir, stamp, args.level_timeout
                            )
        except Exception:
            for name in ("sim", "sim_paced", "edge", "node"):
                p = Path(tmp) / f"{name}.err"
                if p.exists():
                    tail = p.read_text(errors="replace").splitlines()[-10:]
                    print(f"--- {name} stderr (tail)\n" + "\n".join(tail), file=sys.stderr)
            raise
    merged = [median_run(runs[s.name]) for s in specs]
    result["levels"] = [lv for lv in merged if lv["kind"] != "sweep"]
    result["sweep"] = [lv for lv in merged if lv["kind"] == "sweep"]
    if len(result["sweep"]) >= 2:
        result["sweep_fit"] = {
            name: linear_fit(
                [(lv["chunks"], lv[f"{name}_cpu_ms_per_req"]) for lv in result["sweep"]]
            )
            for name in ("edge", "node", "edge_node")
        }
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["duration_s"] = round(time.monotonic() - t_start, 1)
    out = args.out_dir / f"platform-{stamp}.json"
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")

    print()
    print_table(result["levels"] + result["sweep"])
    if "sweep_fit" in result:
        for name, fit in result["sweep_fit"].items():
            print(
                f"bench: sweep fit {name}: {fit['fixed_ms']:.2f} ms per request "
                f"+ {fit['per_chunk_us']:.1f} µs per chunk"
            )
    for level, prof in result.get("profile", {}).items():
        for name in ("edge", "node"):
            top = prof.get(name, {}).get("self_pct_by_package", [])[:6]
            print(f"bench: py-spy {level} {name}, self % by package: {top}")
    print(f"bench: results in {out} ({result['duration_s']} s)")
    if not args.no_plots:
        for p in plot(result, args.img_dir):
            print(f"bench: plot {p}")
    failed = sum(r["requests"] - r["ok"] for rs in runs.values() for r in rs)
    if failed:
        print(f"bench: {failed} request(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
