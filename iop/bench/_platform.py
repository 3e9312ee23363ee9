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

docs/benchmarks.md explains the method and quotes the results. The tables
and plots are ``iop/bench/_platform_report.py``'s; ``iop bench`` runs this
as the ``platform`` runner (``run``, at the end).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from iop.bench._platform_load import (
    LevelSpec,
    check_targets,
    merge,
    relative,
    run_window,
    sweep_fits,
)
from iop.bench._platform_report import plot, print_tables, report
from iop.bench._platform_stack import (
    CHUNKS,
    MODEL_FAST,
    MODEL_PACED,
    SHAPES,
    Platform,
    running_platform,
)
from iop.bench._procs import (
    LITELLM_DEFAULT,
    LITELLM_WANTED,
    REPO,
    descendants,
    find_py_spy,
    git_commit,
    litellm_version,
    machine_info,
    script_main,
    spy_report,
    start_py_spy,
)
from iop.bench._runner import RunContext, options_argv, register
from iop.bench._steps import add_out_dir, add_python, int_list

__all__ = [
    "MODEL_FAST",
    "MODEL_PACED",
    "LevelSpec",
    "PlatformOptions",
    "check_targets",
    "level_specs",
    "main",
    "merge",
    "parse_args",
    "print_tables",
    "relative",
    "run_all",
    "sweep_fits",
]

MAX_REQUESTS = 20_000  # per level, whatever is asked


# --------------------------------------------------------------------------- profile


def run_profile(  # pragma: no cover - py-spy attaches by ptrace: not in the suite
    plat: Platform, py_spy: str, spec: LevelSpec, outdir: Path, stamp: str, timeout_s: float
) -> dict[str, Any]:
    """One more ``spec`` window through the split shape, with py-spy (non-blocking,
    250 Hz) attached to the edge and to the node for the whole of it."""
    gw = plat.gateways["split"]
    spies: dict[str, tuple[Path, Any]] = {}
    try:
        for name in ("edge", "node"):
            raw = outdir / f"pyspy-{stamp}-split-{spec.name}-{name}.txt"
            spies[name] = (raw, start_py_spy(py_spy, gw.procs[name].pid, raw, rate=250))
        time.sleep(1.0)  # let py-spy attach
        level = run_window(plat, "split", spec, timeout_s)
    finally:
        summaries = spy_report(spies, interrupt=True)  # py-spy writes its file on SIGINT
    out: dict[str, Any] = {
        "shape": "split",
        "level": level,
        "raw_files": {k: str(raw) for k, (raw, _) in spies.items()},
    }
    return out | summaries


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = PlatformOptions()  # the defaults are the runner's: one copy
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--shapes",
        default=",".join(d.shapes),
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
        "--paced-rate",
        type=float,
        default=d.paced_rate,
        help="tokens/s per stream (default: %(default)s)",
    )
    g.add_argument(
        "--paced-concurrency",
        type=int,
        default=d.paced_concurrency,
        help="concurrency (default: %(default)s)",
    )
    g.add_argument(
        "--paced-requests",
        type=int,
        default=d.paced_requests,
        help="requests of 64 chunks in the window, 0 to skip the level (default: %(default)s)",
    )
    g.add_argument(
        "--paced-seconds",
        type=float,
        default=d.paced_seconds,
        help="the paced c=32 window closes after this many seconds, with at least one "
        "request per client (default: %(default)s)",
    )
    g.add_argument(
        "--c1-requests",
        type=int,
        default=d.c1_requests,
        help="requests of the c=1 level, 0 to skip it (default: %(default)s)",
    )
    g.add_argument(
        "--c1-chunks",
        type=int,
        default=d.c1_chunks,
        help="chunks per answer at c=1: TTFT needs only the first (default: %(default)s)",
    )
    g = ap.add_argument_group("as fast as the backend sends: chunk-count sweep, non-streaming")
    g.add_argument(
        "--fast-concurrency",
        type=int,
        default=d.fast_concurrency,
        help="concurrency (default: %(default)s)",
    )
    g.add_argument(
        "--sweep-chunks",
        default=",".join(str(v) for v in d.sweep_chunks),
        help="content chunks per answer, one level each; empty to skip (default: %(default)s)",
    )
    g.add_argument(
        "--fast-requests",
        type=int,
        default=d.fast_requests,
        help="most requests in a window (default: %(default)s)",
    )
    g.add_argument(
        "--nonstream-requests",
        type=int,
        default=d.nonstream_requests,
        help="most non-streaming requests in the window, 0 to skip (default: %(default)s)",
    )
    g.add_argument(
        "--level-seconds",
        type=float,
        default=d.level_seconds,
        help="a fast or non-streaming window closes after this many seconds, with at least "
        "one request per client (default: %(default)s)",
    )
    g.add_argument(
        "--warmup",
        type=int,
        default=d.warmup,
        help="completions before a fast or non-streaming window opens; paced c=32: "
        "one per two clients (default: %(default)s)",
    )
    ap.add_argument(
        "--level-timeout",
        type=float,
        default=d.level_timeout,
        help="give up on a level after this many seconds (default: %(default)s)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="at the end, run one more paced c=32 window through edge + node with py-spy "
        "attached to each (needs py-spy; raw stacks go to --out-dir)",
    )
    add_out_dir(ap)
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
    add_python(ap)
    args = ap.parse_args(argv)
    args.shape_list = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = sorted(set(args.shape_list) - set(SHAPES))
    if unknown or not args.shape_list:
        ap.error(f"--shapes: unknown {unknown}; choose from {','.join(SHAPES)}")
    args.sweep = int_list(args.sweep_chunks, "--sweep-chunks", ap) if args.sweep_chunks else []
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


def main(argv: list[str] | None = None) -> int:
    """``scripts/bench_platform.py``: one run, its JSON, tables and plots; 130 on Ctrl-C."""
    args = parse_args(argv)
    return script_main(lambda: _main(args))


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


# --------------------------------------------------------------------------- iop bench


class PlatformOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """This module's command-line options (its ``--help`` says what each does)."""

    shapes: list[str] = msgspec.field(default_factory=lambda: list(SHAPES))
    paced_rate: float = 50.0
    paced_concurrency: int = 32
    paced_requests: int = 128
    paced_seconds: float = 6.0
    c1_requests: int = 50
    c1_chunks: int = 8
    fast_concurrency: int = 32
    sweep_chunks: list[int] = msgspec.field(default_factory=lambda: [1, 16, 64, 256])
    fast_requests: int = 256
    nonstream_requests: int = 256
    level_seconds: float = 4.0
    warmup: int = 32
    level_timeout: float = 180.0
    profile: bool = False


_PLATFORM_SMOKE: dict[str, Any] = {
    "paced_rate": 500.0,
    "paced_concurrency": 2,
    "paced_requests": 2,
    "paced_seconds": 1.0,
    "c1_requests": 2,
    "c1_chunks": 2,
    "fast_concurrency": 2,
    "sweep_chunks": [1, 4],
    "fast_requests": 4,
    "nonstream_requests": 4,
    "level_seconds": 1.0,
    "warmup": 2,
    "level_timeout": 60.0,
    "profile": False,
}


@register(
    "platform",
    PlatformOptions,
    "CPU per request, added TTFT, throughput: direct, iop up, edge + node, LiteLLM "
    "(paced c=32 and c=1, a chunk-count sweep, non-streaming)",
    report=report,
)
def run(opts: PlatformOptions, ctx: RunContext) -> dict[str, Any]:
    if ctx.smoke:
        opts = msgspec.structs.replace(opts, **_PLATFORM_SMOKE)
    shapes = [s for s in opts.shapes if s != "litellm" or ctx.litellm is not None]
    opts = msgspec.structs.replace(opts, shapes=shapes)
    argv = [*options_argv(opts), "--repeat", "1", "--no-plots", "--out-dir", str(ctx.workdir)]
    argv += ["--python", ctx.python]
    if ctx.litellm is not None:
        argv += ["--litellm", str(ctx.litellm)]
    args = parse_args(argv)
    result, failed = run_all(args)
    result["failed_requests"] = failed
    return result


if __name__ == "__main__":
    sys.exit(main())
