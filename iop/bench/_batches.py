"""Batches on spare capacity: what a big batch costs interactive traffic, how
fast it goes, and a ``kill -9`` halfway.

The measurement of ``[batches]`` in docs/benchmarks.md ("Batches on spare
capacity"). ``instances`` ``iop sim`` engines behind one ``iop node`` (one
``vllm`` instance each, ``max_concurrency`` slots), behind an ``iop edge``
with a batch store; the *capacity* is what the slots finish a second
(``instances * max_concurrency`` over one run's time). Interactive
requests are streamed chat completions at ``interactive_pct`` % of capacity
(Poisson, TTFT from the scheduled arrival to the first content chunk, the
``objectives`` runner's client); batches go through ``POST /v1/files`` and
``POST /v1/batches`` (``batch_lines`` lines, the batch objective).

Phases, each a fresh edge and node:

``alone``
    Interactive requests alone for ``duration_s``: the reference TTFT.
``with_batch``
    A batch submitted, then the same interactive requests for
    ``duration_s``: their TTFT, and the batch's lines done a second in the
    window against the capacity the interactive load leaves. The batch is
    cancelled at the window's end.
``idle_batch``
    The whole batch on the idle cluster: lines a second against capacity.
``kill9``
    The whole batch; at half of it the edge is killed (SIGKILL) and
    restarted on the same port and store; the output must answer every
    ``custom_id`` exactly once. Also: how many lines the backends saw
    beyond the batch's (those in flight at the kill, run again).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
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
    NODE_TOKEN,
    Stack,
    process_stack,
    start_node,
    start_sims,
    wait_instances,
)
from iop.bench._results import pct_ms
from iop.bench._runner import RunContext, register, tables_report
from iop.testing import EDGE_READY, NODE_READY, Proc, free_port, poll, toml_dumps

__all__ = ["Options", "run"]

Phase = Literal["alone", "with_batch", "idle_batch", "kill9"]
PHASES: Final[tuple[Phase, ...]] = ("alone", "with_batch", "idle_batch", "kill9")
MODEL: Final = "iop-sim"


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``batches`` runner's options (a scenario's ``[args]``).

    Attributes:
        instances: Engines (``iop sim`` processes), one ``vllm`` instance each.
        max_concurrency: The node's slots per instance (and each sim's batch).
        output_tokens: Tokens of an answer (interactive and batch alike).
        ttft_s: The sims' time to first token.
        tokens_per_s: The sims' decode rate per request.
        interactive_pct: Interactive arrivals, in % of capacity.
        batch_lines: Lines of each batch.
        max_concurrent_per_batch: ``batches.max_concurrent_per_batch``.
        duration_s: The interactive window (``alone``, ``with_batch``).
        phases: Which phases to run.
        seed: Seeds the arrivals (the same in every phase).
        client_timeout_s: An interactive request not answered within this fails.
        batch_timeout_s: A batch not ended within this fails the run.
    """

    instances: int = 2
    max_concurrency: int = 8
    output_tokens: int = 16
    ttft_s: float = 0.05
    tokens_per_s: float = 100.0
    interactive_pct: float = 30.0
    batch_lines: int = 5000
    max_concurrent_per_batch: int = 24
    duration_s: float = 30.0
    phases: list[Phase] = msgspec.field(default_factory=lambda: list(PHASES))
    seed: int = 0
    client_timeout_s: float = 60.0
    batch_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.instances < 1 or self.max_concurrency < 1 or self.batch_lines < 2:
            raise ValueError("instances and max_concurrency must be >= 1, batch_lines >= 2")
        if self.duration_s <= 0 or not 0 < self.interactive_pct < 100:
            raise ValueError("duration_s must be > 0, interactive_pct within 0 and 100")

    @property
    def run_s(self) -> float:
        return self.ttft_s + self.output_tokens / self.tokens_per_s

    @property
    def capacity(self) -> float:
        """Runs the slots finish a second."""
        return self.instances * self.max_concurrency / self.run_s


def _smoke(opts: Options) -> Options:
    return msgspec.structs.replace(
        opts,
        instances=1,
        max_concurrency=2,
        output_tokens=4,
        tokens_per_s=200.0,
        duration_s=2.0,
        batch_lines=40,
        max_concurrent_per_batch=4,
    )


def _batch_file(opts: Options, tag: str) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"{tag}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"batch line {i}"}],
                    "iop_sim": {"output_tokens": opts.output_tokens},
                },
            }
        ).encode()
        + b"\n"
        for i in range(opts.batch_lines)
    )


def _submit(url: str, opts: Options, tag: str) -> str:
    """Upload a batch file and create its batch; the batch's id."""
    with httpx.Client(base_url=url, timeout=120.0, trust_env=False) as c:
        up = c.post(
            "/v1/files",
            files={"file": ("batch.jsonl", _batch_file(opts, tag))},
            data={"purpose": "batch"},
        )
        up.raise_for_status()
        created = c.post(
            "/v1/batches",
            json={
                "input_file_id": up.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        created.raise_for_status()
        batch_id: str = created.json()["id"]
        return batch_id


def _batch(url: str, batch_id: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/v1/batches/{batch_id}", timeout=10.0, trust_env=False)
    r.raise_for_status()
    data: dict[str, Any] = r.json()
    return data


def _wait_ended(url: str, batch_id: str, timeout: float) -> dict[str, Any]:
    ended = ("completed", "cancelled", "expired", "failed")

    def check() -> dict[str, Any] | None:
        b = _batch(url, batch_id)
        return b if b["status"] in ended else None

    return poll(
        check,
        timeout=timeout,
        what=f"batch {batch_id} to end",
        interval=0.5,
    )


def _answers(url: str, batch: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for key in ("output_file_id", "error_file_id"):
        if batch.get(key):
            r = httpx.get(f"{url}/v1/files/{batch[key]}/content", timeout=60.0, trust_env=False)
            r.raise_for_status()
            out += [json.loads(x) for x in r.text.splitlines()]
    return out


def _sim_requests(sims: list[str]) -> int:
    total = 0
    for sim in sims:
        r = httpx.get(f"{sim}/sim/stats", timeout=10.0, trust_env=False)
        r.raise_for_status()
        total += int(r.json()["requests"])
    return total


def _start_sims(stack: Stack, opts: Options) -> list[str]:
    flags = [
        "--model", MODEL,
        "--ttft", f"{opts.ttft_s:g}",
        "--tokens-per-s", f"{opts.tokens_per_s:g}",
        "--output-tokens", str(opts.output_tokens),
        "--reasoning-tokens", "0",
        "--max-num-seqs", str(opts.max_concurrency),
    ]  # fmt: skip
    return [url for _, url in start_sims(stack, opts.instances, *flags)]


def _start_edge(
    stack: Stack, opts: Options, name: str, port: int, store: Path
) -> tuple[Proc, str, str]:
    """``iop edge`` on ``port`` with its batch store at ``store``: the process,
    its API URL and its link URL."""
    config = {
        "scheduler": {"max_queue": 256, "max_queue_delay_s": 0},
        "batches": {
            "path": str(store),
            "max_lines": max(opts.batch_lines, 1),
            "max_concurrent_per_batch": opts.max_concurrent_per_batch,
            "retry_initial_s": 0.05,
            "retry_max_s": 1.0,
        },
    }
    path = stack.logdir / f"{name}.toml"
    path.write_text(toml_dumps(config))
    edge = stack.launch(
        name, "edge", "--port", str(port), "--node-token", NODE_TOKEN, "--config", str(path)
    )
    m = edge.wait_stdout(EDGE_READY, 30)
    return edge, m[1], m[2]


def _start_node(stack: Stack, opts: Options, sims: list[str], link: str, tag: str) -> Proc:
    instances = [
        {"adapter": "vllm", "name": f"gpu{i}", "endpoint": sim, "max_concurrency": opts.max_concurrency}
        for i, sim in enumerate(sims)
    ]  # fmt: skip
    node = start_node(stack, f"node-{tag}", link, {"probe_interval_s": 30.0}, instances)
    node.wait_stdout(NODE_READY)
    return node


def _interactive(url: str, opts: Options) -> list[TimedSample]:
    """The interactive load beside the batch: the objectives runner's requests."""

    async def drive() -> list[TimedSample]:
        plan = poisson_arrivals(
            opts.capacity * opts.interactive_pct / 100,
            opts.duration_s,
            random.Random(f"{opts.seed}/i"),
        )
        async with load_client(opts.client_timeout_s, keepalive=512) as client:

            async def send(s: TimedSample) -> None:
                body = sim_stream_body(MODEL, s, opts.output_tokens)
                await timed_stream(
                    client, url + "/v1/chat/completions", s, body, opts.client_timeout_s
                )

            t0 = trio.current_time() + 0.05
            return await open_loop(t0, [(at, "interactive") for at in plan], send)

    return trio.run(drive)


def _ttft(samples: list[TimedSample]) -> dict[str, Any]:
    ok = [s for s in samples if s.status == 200 and not s.error]
    ttft = [s.ttft_s for s in ok]
    return {
        "sent": len(samples),
        "answered": len(ok),
        "failed": len(samples) - len(ok),
        "ttft_ms": {"p50": pct_ms(ttft, 50), "p90": pct_ms(ttft, 90), "p99": pct_ms(ttft, 99)},
    }


def _phase(
    stack: Stack, opts: Options, sims: list[str], phase: Phase, tag: str, workdir: Path
) -> dict[str, Any]:
    store = workdir / f"batches-{tag}.sqlite3"
    port = free_port()
    edge, url, link = _start_edge(stack, opts, f"edge-{tag}", port, store)
    node = _start_node(stack, opts, sims, link, tag)
    wait_instances(url, len(sims))
    out: dict[str, Any] = {}
    try:
        if phase == "alone":
            out["interactive"] = _ttft(_interactive(url, opts))
        elif phase == "with_batch":
            batch_id = _submit(url, opts, tag)
            before = _batch(url, batch_id)["request_counts"]["completed"]
            t0 = time.monotonic()
            out["interactive"] = _ttft(_interactive(url, opts))
            window = time.monotonic() - t0
            done = _batch(url, batch_id)["request_counts"]["completed"] - before
            spare = opts.capacity * (1 - opts.interactive_pct / 100)
            out["batch"] = {
                "lines_done": done,
                "lines_per_s": round(done / window, 2),
                "spare_capacity_per_s": round(spare, 2),
                "share_of_spare": round(done / window / spare, 3),
            }
            httpx.post(f"{url}/v1/batches/{batch_id}/cancel", timeout=30.0, trust_env=False)
            _wait_ended(url, batch_id, opts.batch_timeout_s)
        elif phase == "idle_batch":
            t0 = time.monotonic()
            batch_id = _submit(url, opts, tag)
            ended = _wait_ended(url, batch_id, opts.batch_timeout_s)
            took = time.monotonic() - t0
            counts = ended["request_counts"]
            out["batch"] = {
                "status": ended["status"],
                "completed": counts["completed"],
                "failed": counts["failed"],
                "seconds": round(took, 1),
                "lines_per_s": round(counts["completed"] / took, 2),
                "capacity_per_s": round(opts.capacity, 2),
                "share_of_capacity": round(counts["completed"] / took / opts.capacity, 3),
            }
        else:
            out["batch"] = _kill9(stack, opts, sims, url, port, store, tag, edge)
    finally:
        stack.stop(node)
        for p in list(stack.procs):
            if p.name.startswith("edge-") and tag in p.name:
                stack.stop(p)
    return out


def _kill9(
    stack: Stack,
    opts: Options,
    sims: list[str],
    url: str,
    port: int,
    store: Path,
    tag: str,
    edge: Proc,
) -> dict[str, Any]:
    seen = _sim_requests(sims)
    t0 = time.monotonic()
    batch_id = _submit(url, opts, tag)
    half = opts.batch_lines // 2
    poll(
        lambda: _batch(url, batch_id)["request_counts"]["completed"] >= half,
        timeout=opts.batch_timeout_s,
        what="half the batch",
        interval=0.2,
    )
    at_kill = _batch(url, batch_id)["request_counts"]["completed"]
    edge.send(signal.SIGKILL)
    edge.wait(10)
    restarted_at = time.monotonic()
    _, url, _ = _start_edge(stack, opts, f"edge-{tag}-again", port, store)
    ended = _wait_ended(url, batch_id, opts.batch_timeout_s)
    took = time.monotonic() - t0
    answers = _answers(url, ended)
    ids = [a["custom_id"] for a in answers]
    want = {f"{tag}-{i}" for i in range(opts.batch_lines)}
    return {
        "status": ended["status"],
        "completed_at_kill": at_kill,
        "answers": len(ids),
        "duplicates": len(ids) - len(set(ids)),
        "missing": len(want - set(ids)),
        "ok_200": sum(1 for a in answers if (a.get("response") or {}).get("status_code") == 200),
        "backend_requests_beyond_lines": _sim_requests(sims) - seen - opts.batch_lines,
        "seconds": round(took, 1),
        "restart_to_end_s": round(time.monotonic() - restarted_at, 1),
    }


@register(
    "batches",
    Options,
    "Batches on spare capacity: interactive TTFT with and without a big batch, the batch's "
    "pace against the capacity left, and a kill -9 halfway (every line answered once).",
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
            phases[phase] = _phase(stack, opts, sims, phase, f"r{ctx.repeat}-{phase}", ctx.workdir)
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
    """Interactive TTFT by phase; the batch's pace; the kill -9's count."""
    got = result.get("phases", {})
    rows = [
        "| phase | interactive sent | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | failed "
        "| batch lines/s | of capacity left |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for phase in ("alone", "with_batch", "idle_batch"):
        p = got.get(phase)
        if not p:
            continue
        i = p.get("interactive", {})
        t = i.get("ttft_ms", {})
        b = p.get("batch", {})
        share = b.get("share_of_spare", b.get("share_of_capacity"))
        rows.append(
            f"| {phase} | {_f(i.get('sent'), '.0f')} | {_f(t.get('p50'), '.0f')} "
            f"| {_f(t.get('p90'), '.0f')} | {_f(t.get('p99'), '.0f')} "
            f"| {_f(i.get('failed'), '.0f')} | {_f(b.get('lines_per_s'), '.1f')} "
            f"| {_f(share, '.0%') if isinstance(share, int | float) else '-'} |"
        )
    k = got.get("kill9", {}).get("batch")
    rows.append("")
    rows.append(f"Capacity {_f(result.get('capacity_per_s'), '.1f')} runs/s (the slots' rate).")
    if k:
        rows.append(
            f"kill -9 at {k['completed_at_kill']} lines done: {k['status']}, {k['answers']} "
            f"answers, {k['duplicates']} duplicate(s), {k['missing']} missing, "
            f"{k['ok_200']} answered 200; the backends saw "
            f"{k['backend_requests_beyond_lines']} request(s) beyond the batch's lines "
            f"(those in flight at the kill); {k['seconds']} s in all."
        )
    return "\n".join(rows)


def plots(result: dict[str, Any], img_dir: Path) -> list[Path]:
    """No plot: the table says it."""
    del result, img_dir
    return []
