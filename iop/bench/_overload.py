"""``overload``: goodput, refusals and TTFT past the saturated rate.

``iop sim`` as the backend (vLLM's wire format, 64 chunks, no TTFT, as fast
as it can: --paced-rate for a paced one), one node with one ``vllm``
instance (--max-concurrency slots), the edge with its default config
(--edge-set to change it). A closed loop (--sat-concurrency workers for
--sat-s, then --resat-s before every further level, as the box's other
load moves) measures the saturated rate; an open loop then offers
--levels percent of it (Poisson arrivals, or fixed with --arrivals fixed)
for --duration-s each, a fresh request per arrival whatever is still
outstanding. A last closed loop ends the run. The load generator speaks HTTP/1.1 with h11 over trio
sockets with its own keep-alive free list: O(1) per event at any
concurrency (httpcore's pool costs grow with the connections it holds,
and would make the load generator the bottleneck). Each level reports the
offered rate, goodput (answers with all 64 chunks and [DONE], completed
inside the level's window, per second; ok/s counts the answers to the
window's arrivals that succeeded at all), errors by kind (HTTP status and
code, client timeouts after --client-timeout-s, broken streams), TTFT
p50/p99 from the scheduled arrival, how fast refusals came, the edge's
run outcomes (from /admin/nodes) and CPU per answer of each process.
--levels repeats a level by listing it again (default: 90 % three times).
"""

from __future__ import annotations

import argparse
import random
import sys
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx
import msgspec
import trio

from iop.bench._client import (
    Answer,
    RawClient,
    admin_nodes,
    chat_body,
    stream_answer,
    wait_edge_idle,
)
from iop.bench._overload_report import print_overload, report
from iop.bench._procs import (
    CpuWindow,
    Stack,
    find_py_spy,
    log_counts,
    spy_report,
    start_edge,
    start_node,
    start_py_spy,
    start_sim,
    wait_models,
)
from iop.bench._results import counter_delta, summary
from iop.bench._runner import RunContext, options_argv, register
from iop.bench._steps import Step, int_list, run_step

__all__ = ["STEP", "OverloadOptions", "closed_loop", "open_loop"]

CHUNKS: Final = 64  # content chunks per answer (sim --output-tokens)
MODEL: Final = "iop-sim"


def apply_sets(config: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """``KEY.PATH=VALUE`` overrides (VALUE in TOML syntax) into a config tree."""
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"bench: --*-set wants KEY=VALUE, got {item!r}")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw  # a bare string
        *path, last = key.split(".")
        node = config
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return config


# --------------------------------------------------------------------------- load


@dataclass
class LoadStats:
    peak_outstanding: int = 0
    late_max_s: float = 0.0
    overflow: int = 0


async def _timed(
    client: RawClient, body: bytes, a: Answer, timeout_s: float, st: LoadStats, n: list[int]
) -> None:
    n[0] += 1
    st.peak_outstanding = max(st.peak_outstanding, n[0])
    try:
        with trio.move_on_at(a.arrival + timeout_s) as scope:
            await stream_answer(client, body, a)
        if scope.cancelled_caught:
            a.error = "client_timeout"
            a.end_at = trio.current_time()
    finally:
        n[0] -= 1


async def open_loop(
    client: RawClient,
    body: bytes,
    rate: float,
    duration_s: float,
    timeout_s: float,
    rng: random.Random,
    poisson: bool,
    max_outstanding: int,
) -> tuple[list[Answer], LoadStats, float]:
    """Arrivals at ``rate``/s for ``duration_s``, each a new request whatever is outstanding."""
    answers: list[Answer] = []
    st = LoadStats()
    n = [0]
    async with trio.open_nursery() as nursery:
        start = trio.current_time() + 0.05
        t = start
        while True:
            t += rng.expovariate(rate) if poisson else 1.0 / rate
            if t >= start + duration_s:
                break
            await trio.sleep_until(t)
            st.late_max_s = max(st.late_max_s, trio.current_time() - t)
            a = Answer(arrival=t, expect=CHUNKS)
            answers.append(a)
            if n[0] >= max_outstanding:
                a.error = "client_overflow"
                st.overflow += 1
                continue
            nursery.start_soon(_timed, client, body, a, timeout_s, st, n)
    return answers, st, start


async def closed_loop(
    client: RawClient, body: bytes, concurrency: int, duration_s: float, timeout_s: float
) -> tuple[list[Answer], float, float]:
    """``concurrency`` workers, each issuing its next request when the last one ended."""
    answers: list[Answer] = []
    st = LoadStats()
    n = [0]
    start = trio.current_time()
    end = start + duration_s

    async def worker() -> None:
        while trio.current_time() < end:
            a = Answer(arrival=trio.current_time(), expect=CHUNKS)
            answers.append(a)
            await _timed(client, body, a, timeout_s, st, n)

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return answers, start, trio.current_time()


async def sample_admin(url: str, period_s: float, into: list[dict[str, Any]]) -> None:
    """Every ``period_s``: the edge's runs in flight and queue (until cancelled)."""
    async with httpx.AsyncClient(timeout=5, trust_env=False) as c:
        while True:
            t = trio.current_time()
            try:
                a = (await c.get(url + "/admin/nodes")).json()
                in_flight = sum(i["in_flight"] for n in a["nodes"] for i in n["instances"])
                into.append(
                    {"t": t, "runs": len(a["runs"]), "queued": a["queued"], "placed": in_flight}
                )
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                into.append({"t": t, "error": repr(exc)})
            await trio.sleep(period_s)


# --------------------------------------------------------------------------- overload


def level_report(
    answers: list[Answer], start: float, duration_s: float, cpu: dict[str, Any]
) -> dict[str, Any]:
    """The numbers of one load level (times in ms)."""
    ok = [a for a in answers if a.ok]
    in_window = [a for a in ok if a.end_at <= start + duration_s]
    refused = [a for a in answers if a.status == 429]
    errors = Counter(a.error for a in answers if not a.ok)
    ms = cpu["cpu_s"]
    per_ok = {k: round(1000 * v / len(ok), 3) for k, v in ms.items()} if ok else {}
    return {
        "issued": len(answers),
        "offered_rps": round(len(answers) / duration_s, 1),
        "goodput_rps": round(len(in_window) / duration_s, 1),
        # Answers to this window's arrivals that succeeded, finished in it or later.
        "ok_rps": round(len(ok) / duration_s, 1),
        "ok": len(ok),
        "ok_after_window": len(ok) - len(in_window),
        "errors": dict(errors.most_common()),
        "refused_429": len(refused),
        "refused_with_retry_after": sum(1 for a in refused if a.retry_after),
        "refusal_ms": summary([1000 * (a.head_at - a.arrival) for a in refused]),
        "ttft_ms": summary([1000 * (a.first_at - a.arrival) for a in ok]),
        "total_ms": summary([1000 * (a.end_at - a.arrival) for a in ok]),
        "failed_late_ms": summary(
            [1000 * (a.end_at - a.arrival) for a in answers if a.error and a.status != 429]
        ),
        "cpu_ms_per_ok": per_ok,
        "edge_node_cpu_ms_per_ok": round(per_ok.get("edge", 0) + per_ok.get("node", 0), 3)
        if ok
        else None,
        **cpu,
    }


def _spies(  # pragma: no cover - py-spy attaches by ptrace: not in the suite
    args: argparse.Namespace, pids: dict[str, int], label: str, seconds: float
) -> dict[str, tuple[Path, Any]]:
    """py-spy on edge and node for ``seconds`` (empty without py-spy)."""
    py_spy = find_py_spy(args.python)
    if py_spy is None:
        print("bench: --profile needs py-spy (pip install py-spy)", file=sys.stderr)
        return {}
    out: dict[str, tuple[Path, Any]] = {}
    for name in ("edge", "node"):
        raw = args.out_dir / f"stress-{args.stamp}-{label}-{name}.txt"
        out[name] = (raw, start_py_spy(py_spy, pids[name], raw, rate=100, seconds=seconds))
    return out


async def _closed_level(
    args: argparse.Namespace,
    ac: httpx.AsyncClient,
    client: RawClient,
    body: bytes,
    url: str,
    pids: dict[str, int],
    seconds: float,
    profile: bool,
) -> dict[str, Any]:
    await wait_edge_idle(ac, url, 60)
    client.close_idle()
    o0 = (await admin_nodes(ac, url))["outcomes"]
    spies = _spies(args, pids, "closed", seconds) if profile else {}
    win = CpuWindow(pids)
    answers, t0, t1 = await closed_loop(
        client, body, args.sat_concurrency, seconds, args.client_timeout_s
    )
    cpu = win.stop()
    sat = level_report(answers, t0, t1 - t0, cpu)
    sat["concurrency"] = args.sat_concurrency
    sat["edge_outcomes"] = counter_delta((await admin_nodes(ac, url))["outcomes"], o0)
    if spies:
        sat["profile"] = spy_report(spies)
    return sat


async def _overload(args: argparse.Namespace, url: str, pids: dict[str, int]) -> dict[str, Any]:
    body = chat_body(MODEL)
    rng = random.Random(args.seed)
    client = RawClient(url)
    out: dict[str, Any] = {"levels": []}
    async with httpx.AsyncClient(timeout=10, trust_env=False) as ac:
        print(f"bench: overload: warm-up, closed loop c={args.sat_concurrency}", flush=True)
        await closed_loop(client, body, args.sat_concurrency, 3.0, args.client_timeout_s)
        sat = await _closed_level(args, ac, client, body, url, pids, args.sat_s, args.profile == 0)
        rate = sat["goodput_rps"]
        out["saturation"] = sat
        print(
            f"bench: overload: saturated at {rate:.1f} req/s closed loop "
            f"({sat['edge_node_cpu_ms_per_ok']} ms edge+node CPU per answer)",
            flush=True,
        )
        if not rate:
            raise RuntimeError(f"no answer in the closed loop: {sat['errors']}")
        profiled = False
        for i, level in enumerate(args.levels):
            if args.resat_s and i:
                # What the box gives now: its other load moves by tens of percent.
                again = await _closed_level(args, ac, client, body, url, pids, args.resat_s, False)
                rate = again["goodput_rps"] or rate
            await wait_edge_idle(ac, url, 60)
            client.close_idle()
            await trio.sleep(args.pause_s)
            offered = rate * level / 100
            print(
                f"bench: overload: [{i + 1}/{len(args.levels)}] {level} % = {offered:.1f} req/s "
                f"for {args.duration_s:g} s",
                flush=True,
            )
            spies: dict[str, tuple[Path, Any]] = {}
            if args.profile == level and not profiled:
                profiled = True
                spies = _spies(args, pids, f"overload{level}", args.duration_s)
            o0 = (await admin_nodes(ac, url))["outcomes"]
            samples: list[dict[str, Any]] = []
            win = CpuWindow(pids)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sample_admin, url, 1.0, samples)
                answers, st, start = await open_loop(
                    client,
                    body,
                    offered,
                    args.duration_s,
                    args.client_timeout_s,
                    rng,
                    args.arrivals == "poisson",
                    args.max_outstanding,
                )
                nursery.cancel_scope.cancel()
            cpu = win.stop()
            rep = level_report(answers, start, args.duration_s, cpu)
            rep |= {
                "level_pct": level,
                "saturated_rps": rate,
                "goodput_pct_of_saturated": round(100 * rep["goodput_rps"] / rate, 1),
                "target_rps": round(offered, 1),
                "edge_outcomes": counter_delta((await admin_nodes(ac, url))["outcomes"], o0),
                "client_peak_outstanding": st.peak_outstanding,
                "client_late_max_ms": round(1000 * st.late_max_s, 1),
                "client_connects": client.connects,
                "edge_peak_runs": max((s.get("runs", 0) for s in samples), default=0),
                "edge_peak_queued": max((s.get("queued", 0) for s in samples), default=0),
                "edge_peak_placed": max((s.get("placed", 0) for s in samples), default=0),
                "edge_samples": [
                    {k: (round(v - start, 1) if k == "t" else v) for k, v in s.items()}
                    for s in samples
                ],
            }
            if spies:
                rep["profile"] = spy_report(spies)
            out["levels"].append(rep)
            print(
                f"bench: overload: {level} %: goodput {rep['goodput_rps']} req/s, "
                f"errors {rep['errors']}, ttft p50 {rep['ttft_ms'].get('p50')} ms",
                flush=True,
            )
        # The box's other load moves: the saturated rate again, at the end.
        end = await _closed_level(args, ac, client, body, url, pids, args.sat_s, False)
        out["saturation_end"] = end
        print(f"bench: overload: closed loop again: {end['goodput_rps']} req/s", flush=True)
    return out


def run_overload(args: argparse.Namespace, stack: Stack) -> dict[str, Any]:
    flags = ["--ttft", "0", "--output-tokens", str(CHUNKS), "--model", MODEL]
    flags += ["--tokens-per-s", f"{args.paced_rate:g}"]
    sim_url = start_sim(stack, "sim", *flags)
    sim = stack.procs[-1]
    edge_cfg = apply_sets({}, args.edge_set)
    edge, url, link = start_edge(stack, edge_cfg)
    inst = {
        "adapter": "vllm",
        "name": "sim",
        "endpoint": sim_url,
        "max_concurrency": args.max_concurrency,
        "max_queue": args.node_max_queue,
    }
    inst = apply_sets(inst, args.instance_set)
    node = start_node(stack, "node", link, {"probe_interval_s": 30.0}, [inst])
    wait_models(url, {MODEL}, stack.procs)
    pids = {"edge": edge.pid, "node": node.pid, "sim": sim.pid}
    result = trio.run(_overload, args, url, pids)
    result["config"] = {"edge": edge_cfg, "instance": inst}
    result["pids"] = pids
    result["log_warnings"] = {"edge": log_counts(edge), "node": log_counts(node)}
    return result


# --------------------------------------------------------------------------- options


def add_arguments(g: argparse._ArgumentGroup) -> None:
    d = OverloadOptions()  # the defaults are the runner's: one copy
    g.add_argument(
        "--levels",
        default=",".join(str(v) for v in d.levels),
        help="open-loop levels, percent of the saturated rate; repeat one to rerun it "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--duration-s", type=float, default=d.duration_s, help="per level (default: %(default)s)"
    )
    g.add_argument(
        "--arrivals",
        choices=("poisson", "fixed"),
        default=d.arrivals,
        help="inter-arrival times (default: %(default)s)",
    )
    g.add_argument(
        "--sat-concurrency",
        type=int,
        default=d.sat_concurrency,
        help="closed-loop workers measuring the saturated rate (default: %(default)s)",
    )
    g.add_argument(
        "--sat-s", type=float, default=d.sat_s, help="closed-loop duration (default: %(default)s)"
    )
    g.add_argument(
        "--resat-s",
        type=float,
        default=d.resat_s,
        help="before every level after the first, a closed loop this long measures the "
        "saturated rate again and the level offers its share of that (the box's other "
        "load moves); 0 keeps the first one (default: %(default)s)",
    )
    g.add_argument(
        "--client-timeout-s",
        type=float,
        default=d.client_timeout_s,
        help="a request not done this long after its arrival is abandoned "
        "(client_timeout; the client closes its connection) (default: %(default)s)",
    )
    g.add_argument(
        "--max-outstanding",
        type=int,
        default=d.max_outstanding,
        help="the load generator's own cap on open requests (client_overflow above) "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--pause-s",
        type=float,
        default=d.pause_s,
        help="idle time between levels, once the edge has no run (default: %(default)s)",
    )
    g.add_argument(
        "--paced-rate",
        type=float,
        default=d.paced_rate,
        help="the sim's tokens/s per stream, 0 as fast as it can (default: %(default)s)",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=d.max_concurrency,
        help="the node instance's slots: the most runs it streams at once, the rest wait "
        "in the edge's queue. 32 is the closed loop's concurrency, where this box "
        "saturates; the platform runner's 256 lets the node stream 256 answers at once, "
        "which share its CPU (default: %(default)s)",
    )
    g.add_argument(
        "--node-max-queue",
        type=int,
        default=d.node_max_queue,
        help="the node instance's max_queue (default: %(default)s)",
    )
    g.add_argument(
        "--edge-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="edge config override, TOML value, e.g. scheduler.max_queue=32 (repeatable)",
    )
    g.add_argument(
        "--instance-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="node instance config override, e.g. queue_timeout_s=5 (repeatable)",
    )
    g.add_argument(
        "--profile",
        type=int,
        default=None,
        metavar="PCT",
        help="attach py-spy to edge and node during the first level PCT, 0 for the closed "
        "loop (needs py-spy; raw stacks go to --out-dir)",
    )


def check(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    args.levels = int_list(args.levels, "--levels", ap)


STEP: Final = Step(
    "overload", "about 4 min", __doc__, add_arguments, run_overload, print_overload, check
)


# --------------------------------------------------------------------------- iop bench


class OverloadOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The overload measurement's options (open-loop levels over the saturated rate)."""

    seed: int = 1
    levels: list[int] = msgspec.field(default_factory=lambda: [80, 90, 100, 90, 120, 90, 150])
    duration_s: float = 15.0
    arrivals: str = "poisson"
    sat_concurrency: int = 32
    sat_s: float = 10.0
    resat_s: float = 5.0
    client_timeout_s: float = 10.0
    max_outstanding: int = 4000
    pause_s: float = 1.0
    paced_rate: float = 0.0
    max_concurrency: int = 32
    node_max_queue: int = 256
    edge_set: list[str] = msgspec.field(default_factory=list)
    instance_set: list[str] = msgspec.field(default_factory=list)


@register(
    "overload",
    OverloadOptions,
    "Open-loop levels in % of the saturated rate: goodput, 429s, TTFT, CPU per answer",
    report=report,
)
def run(opts: OverloadOptions, ctx: RunContext) -> dict[str, Any]:
    if ctx.smoke:
        opts = msgspec.structs.replace(
            opts,
            levels=[100],
            duration_s=0.5,
            sat_concurrency=2,
            sat_s=0.5,
            resat_s=0.0,
            pause_s=0.1,
            client_timeout_s=5.0,
        )
    return run_step(STEP, options_argv(opts, repeated=("edge_set", "instance_set")), ctx)
