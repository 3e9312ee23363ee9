"""``iop bench``: run scenarios, write their results, regenerate the docs' figures.

Theory of operation. Every module of ``iop.bench`` is imported
(``discover``); each registers its runners (``iop.bench._runner``). A
scenario file names a runner and sets its options (``iop.bench._scenario``).
``run`` runs the scenarios' repeats interleaved (A, B, A, B, ...: a noisy
minute of the shared box hits every scenario alike), measures the machine's
foreign CPU around each run (``iop.bench._results.CpuMeter``), and writes one
JSON, after every run, with every repeat's result and the medians.
``report`` hands each scenario's medians to its runner's report function and
rewrites the blocks between ``<!-- bench:KEY -->`` markers in the docs.

A run starts its processes itself and stops them by PID before it returns,
also on error; Ctrl-C and SIGTERM (turned into SIGINT, which trio turns into
KeyboardInterrupt) unwind through those same ``finally`` blocks.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import iop.bench
from iop.bench._against import BASE_SUFFIX, AgainstError, checkout, compare, side_env
from iop.bench._procs import LITELLM_DEFAULT, git_commit, interrupted, machine_info, term_as_int
from iop.bench._results import (
    CpuMeter,
    ResultError,
    ResultFile,
    ScenarioResult,
    marker_keys,
    median_tree,
    read_result,
    rewrite_markers,
)
from iop.bench._runner import RUNNERS, ReportInput, RunContext
from iop.bench._scenario import Scenario, ScenarioError, load_scenario

__all__ = ["add_parser", "discover"]

# The checkout this package is in: configs/bench/, docs/, bench-results/.
REPO = Path(__file__).resolve().parent.parent.parent
SCENARIOS = REPO / "configs" / "bench"
DOCS = REPO / "docs"
RESULTS = REPO / "bench-results"
RESULT_FORMAT = 1  # the JSON's "format": bumped when its shape changes

_EPILOG = f"""\
examples:
  iop bench list                                     # scenarios and runners, with options
  iop bench run configs/bench/cancel.toml            # one scenario, once
  iop bench run configs/bench/platform.toml configs/bench/cancel.toml --repeat 3
                                                     # interleaved: A, B, A, B, A, B
  iop bench run configs/bench/research-cancel.toml --litellm {LITELLM_DEFAULT}
  iop bench report                                   # the docs' tables and plots, newest results
  iop bench report bench-results/bench-20261201-230000.json
  iop bench --all --litellm {LITELLM_DEFAULT}        # every scenario, then report

Results go to bench-results/bench-<timestamp>.json (gitignored), each run's
logs to bench-results/bench-<timestamp>/<scenario>-<repeat>/. The scenario
format and how to add a runner: docs/bench.md.
"""


def discover() -> list[str]:
    """Import every module of ``iop.bench`` (their runners register); return
    the names of those that failed to import, each reported on stderr."""
    failed = []
    for mod in pkgutil.iter_modules(iop.bench.__path__):
        name = f"iop.bench.{mod.name}"
        try:
            importlib.import_module(name)
        except Exception as exc:
            print(
                f"iop bench: cannot import {name}, its runners are missing: {exc!r}",
                file=sys.stderr,
            )
            failed.append(name)
    return failed


def _common_options(*, suppress: bool) -> argparse.ArgumentParser:
    """The options of ``run`` and ``--all``. Under the subcommand their
    defaults are SUPPRESS, so that one given before it (``iop bench --repeat
    3 run ...``) is kept."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--repeat",
        type=int,
        default=default(1),
        metavar="N",
        help="run every scenario N times, interleaved; the figures are medians (default: 1)",
    )
    common.add_argument(
        "--litellm",
        type=Path,
        default=default(None),
        metavar="PATH",
        help="LiteLLM's `litellm` executable (its own venv): runners that compare with it "
        "start it in front of the same backend; without it they measure IOP alone. "
        f"Installed for the docs at {LITELLM_DEFAULT}",
    )
    common.add_argument(
        "--out",
        type=Path,
        default=default(RESULTS),
        metavar="DIR",
        help="where the JSON and the runs' logs go (default: bench-results/)",
    )
    common.add_argument(
        "--smoke",
        action="store_true",
        default=default(False),
        help="tiny sizes (seconds per scenario), for the test suite; the numbers mean nothing",
    )
    return common


def _docs_options(*, suppress: bool) -> argparse.ArgumentParser:
    docs = argparse.ArgumentParser(add_help=False)
    docs.add_argument(
        "--docs",
        type=Path,
        default=argparse.SUPPRESS if suppress else DOCS,
        metavar="DIR",
        help="the Markdown pages whose <!-- bench:KEY --> blocks are rewritten (default: docs/)",
    )
    docs.add_argument(
        "--img-dir",
        type=Path,
        default=argparse.SUPPRESS if suppress else None,
        metavar="DIR",
        help="where the plots go (default: DOCS/img/)",
    )
    return docs


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common = _common_options(suppress=False)
    docs = _docs_options(suppress=False)
    p = sub.add_parser(
        "bench",
        parents=[common, docs],
        help="run the benchmarks behind docs/benchmarks.md and docs/research.md",
        description="Run benchmark scenarios (configs/bench/*.toml) on real processes, write "
        "their results as JSON, and regenerate the tables and plots in docs/benchmarks.md and "
        "docs/research.md from them. Timings on a shared machine are noisy: every run records "
        "the machine's foreign CPU (busy CPU no process of the run used).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="run every scenario in configs/bench/ (--repeat times, interleaved), then report",
    )
    p.add_argument(
        "--scenarios",
        type=Path,
        default=SCENARIOS,
        metavar="DIR",
        help="the scenario directory of --all and `list` (default: configs/bench/)",
    )
    bsub = p.add_subparsers(dest="bench_command", metavar="SUBCOMMAND")
    r = bsub.add_parser(
        "run",
        parents=[_common_options(suppress=True)],
        help="run scenario files, write one JSON",
        description="Run each scenario file --repeat times, interleaved (A, B, A, B, ...), and "
        "write one JSON with every repeat's result, its foreign CPU, and the medians.",
    )
    r.add_argument("files", nargs="+", type=Path, metavar="FILE", help="scenario TOML files")
    r.add_argument(
        "--against",
        metavar="REV",
        default=None,
        help="also run every scenario on another version of IOP, interleaved with this one "
        "(base, head, head, base, ...), and print the two sides' medians side by side: a git "
        "revision of this repo (checked out for the run) or another checkout's directory",
    )
    bsub.add_parser(
        "list",
        help="scenarios in configs/bench/ and the registered runners with their options",
        description="The scenarios in --scenarios DIR and every registered runner: its "
        "summary and its options with their defaults (the keys of a scenario's [args]).",
    )
    rep = bsub.add_parser(
        "report",
        parents=[_docs_options(suppress=True)],
        help="rewrite the docs' marked tables and plots from results",
        description="Rewrite the blocks between <!-- bench:KEY --> and <!-- /bench:KEY --> in "
        "DOCS/*.md, and the plots, from result files (default: for each scenario, its newest "
        "result in bench-results/). A block without a result is left as it is.",
    )
    rep.add_argument("results", nargs="*", type=Path, metavar="RESULT.json")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Dispatch ``iop bench``; returns the exit code."""
    discover()
    cmd = args.bench_command
    try:
        if cmd == "list":
            return cmd_list(args.scenarios)
        if cmd == "report":
            return cmd_report(args.results, args.docs, args.img_dir)
        if cmd == "run":
            code, _ = cmd_run(
                args.files, args.repeat, args.litellm, args.out, args.smoke, against=args.against
            )
            return code
        if args.all:
            files = sorted(args.scenarios.glob("*.toml"))
            if not files:
                print(f"iop bench: no scenarios in {args.scenarios}", file=sys.stderr)
                return 2
            code, out = cmd_run(files, args.repeat, args.litellm, args.out, args.smoke)
            if out is None:
                return code
            return cmd_report([out], args.docs, args.img_dir) or code
    except (ScenarioError, ResultError, AgainstError) as exc:
        print(f"iop bench: {exc}", file=sys.stderr)
        return 2
    print("iop bench: give a subcommand (run, list, report) or --all; see iop bench --help")
    return 2


# --------------------------------------------------------------------------- list


def _describe_options(options: type[Any]) -> list[str]:
    defaults = options()
    return [f"{k} = {getattr(defaults, k)!r}" for k in options.__struct_fields__]


def cmd_list(scenarios: Path) -> int:
    print(f"scenarios in {scenarios}:")
    for path in sorted(scenarios.glob("*.toml")):
        try:
            sc = load_scenario(path)
        except ScenarioError as exc:
            print(f"  {path.stem:<22} INVALID: {exc}")
            continue
        need = " (needs --litellm)" if sc.requires_litellm else ""
        print(f"  {sc.name:<22} runner {sc.runner.name}{need}: {sc.description}")
    print("\nrunners (a scenario's [args] keys, with their defaults):")
    for name, runner in sorted(RUNNERS.items()):
        print(f"  {name}: {runner.summary}")
        for line in _describe_options(runner.options):
            print(f"      {line}")
    return 0


# --------------------------------------------------------------------------- run


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, ensure_ascii=False, default=str) + "\n")
    tmp.replace(path)


def _medians(doc: dict[str, Any]) -> None:
    for entry in doc["scenarios"].values():
        ok = [r for r in entry["repeats"] if r.get("result") is not None]
        entry["median"] = median_tree([r["result"] for r in ok]) if ok else None
        foreign = [r["foreign_cpu_pct"] for r in entry["repeats"]]
        entry["foreign_cpu_pct"] = {"min": min(foreign), "max": max(foreign)} if foreign else None


def cmd_run(
    files: list[Path],
    repeat: int,
    litellm: Path | None,
    out: Path,
    smoke: bool,
    *,
    against: str | None = None,
) -> tuple[int, Path | None]:
    """Run ``files`` ``repeat`` times interleaved; (exit code, the JSON written).

    With ``against`` (``iop.bench._against``), every scenario also runs on that
    version, alternating which side goes first.

    Raises:
        AgainstError: ``against`` names nothing that can be run.
    """
    if against is None:
        return _run(files, repeat, litellm, out, smoke, None)
    scratch = out.resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    with checkout(against, REPO, scratch) as (tree, label):
        print(f"iop bench: against {label} ({tree}), interleaved with this checkout", flush=True)
        return _run(files, repeat, litellm, out, smoke, (tree, label))


def _run(
    files: list[Path],
    repeat: int,
    litellm: Path | None,
    out: Path,
    smoke: bool,
    against: tuple[Path, str] | None,
) -> tuple[int, Path | None]:
    if not 1 <= repeat <= 20:
        print("iop bench: --repeat must be within 1..20", file=sys.stderr)
        return 2, None
    scenarios = [load_scenario(f) for f in files]  # every file checked before any runs
    # Absolute: the runners start their processes in the run's work dir, and
    # pass them paths inside it.
    out = out.resolve()
    if litellm is not None and not litellm.exists():
        print(
            f"iop bench: no LiteLLM at {litellm} (install: python3 -m venv "
            "~/.cache/iop/bench-litellm && ~/.cache/iop/bench-litellm/bin/pip install "
            "'litellm[proxy]==1.108.5')",
            file=sys.stderr,
        )
        return 2, None
    runnable: list[Scenario] = []
    for sc in scenarios:
        if sc.requires_litellm and litellm is None:
            print(f"iop bench: skipping {sc.name}: it needs --litellm PATH", file=sys.stderr)
        else:
            runnable.append(sc)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"iop bench: --out {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2, None
    path = out / f"bench-{stamp}.json"

    doc: dict[str, Any] = {
        "format": RESULT_FORMAT,
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(),
        "argv": sys.argv[1:],
        "machine": machine_info(),
        "repeat": repeat,
        "smoke": smoke,
        "litellm": str(litellm) if litellm else None,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "scenarios": {
            sc.name: {
                "file": str(sc.path.resolve()),
                "runner": sc.runner.name,
                "description": sc.description,
                "args": sc.args,
                "repeats": [],
            }
            for sc in runnable
        },
    }
    # (scenario, its name in the JSON, the tree its children import, or None: as started)
    sides: list[list[tuple[Scenario, str, Path | None]]] = [
        [(sc, sc.name, None)] for sc in runnable
    ]
    if against is not None:
        base_tree, base_label = against
        doc["against"] = {"tree": str(base_tree), "commit": base_label}
        for sc, pair in zip(runnable, sides, strict=True):
            doc["scenarios"][sc.name + BASE_SUFFIX] = {
                **doc["scenarios"][sc.name],
                "repeats": [],
                "against": base_label,
            }
            pair[:] = [(sc, sc.name + BASE_SUFFIX, base_tree), (sc, sc.name, REPO)]
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    old_term = signal.signal(signal.SIGTERM, term_as_int)
    failed = 0
    t0 = time.monotonic()
    try:
        for rep in range(repeat):
            for pair in sides:
                # Odd repeats run the pair the other way round.
                for sc, name, tree in pair if rep % 2 == 0 else pair[::-1]:
                    failed += _run_one(doc, sc, name, tree, rep, repeat, out, stamp, litellm, smoke)
                    _write(path, doc)
    except BaseException as exc:
        if not interrupted(exc):
            raise
        doc["interrupted"] = True
        _medians(doc)
        _write(path, doc)
        print(
            f"iop bench: interrupted; every process it started is stopped; partial results in {path}",
            file=sys.stderr,
        )
        return 130, None
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
    doc["duration_s"] = round(time.monotonic() - t0, 1)
    doc["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    _medians(doc)
    _write(path, doc)
    # The summary: the tables `iop bench report` would write into docs/ (its
    # plots beside the run's logs, not in docs/img/).
    for block in _blocks(path, out / f"bench-{stamp}").values():
        print(f"\n{block.strip()}")
    if against is not None:
        for sc in runnable:
            base = doc["scenarios"][sc.name + BASE_SUFFIX]["median"]
            head = doc["scenarios"][sc.name]["median"]
            if base is not None and head is not None:
                print("\n" + compare(sc.name, base, head, against[1], doc["commit"]))
    print(f"\niop bench: results in {path} ({doc['duration_s']} s)")
    return (1 if failed else 0), path


def _run_one(
    doc: dict[str, Any],
    sc: Scenario,
    name: str,
    tree: Path | None,
    rep: int,
    repeat: int,
    out: Path,
    stamp: str,
    litellm: Path | None,
    smoke: bool,
) -> int:
    """Run ``sc`` once as ``name`` (children importing ``tree`` when given),
    append the repeat to ``doc``; 1 if it failed, else 0."""
    workdir = out / f"bench-{stamp}" / f"{name}-{rep}"
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = RunContext(
        python=sys.executable, workdir=workdir, litellm=litellm, smoke=smoke, repeat=rep
    )
    print(f"iop bench: [{rep + 1}/{repeat}] {name} ({sc.runner.name})", flush=True)
    meter = CpuMeter.start()
    entry: dict[str, Any] = {"repeat": rep}
    failed = 0
    try:
        with side_env(tree) if tree is not None else nullcontext():
            entry["result"] = sc.runner.run(sc.options, ctx)
    except Exception as exc:
        print(f"iop bench: {name} failed: {exc!r} (logs in {workdir})", file=sys.stderr)
        entry["result"] = None
        entry["error"] = repr(exc)
        failed = 1
    entry |= meter.stop()
    print(
        f"iop bench: {name}: {entry['wall_s']} s, foreign CPU "
        f"{entry['foreign_cpu_pct']} % of a core",
        flush=True,
    )
    doc["scenarios"][name]["repeats"].append(entry)
    return failed


# --------------------------------------------------------------------------- report


def _footer(doc: ResultFile, entry: ScenarioResult) -> str:
    file = Path(entry.file)
    # Only where LiteLLM was measured (both runners record its version then).
    used = doc.litellm and (entry.median or {}).get("litellm_version")
    with_lite = " --litellm PATH" if used else ""
    try:
        shown = file.resolve().relative_to(REPO)
    except ValueError:
        # A shipped scenario run from another checkout (or a clean clone's
        # tmp dir) is still the repo's file.
        shipped = file.parent.name == "bench" and file.parent.parent.name == "configs"
        shown = Path("configs/bench") / file.name if shipped else file
    fc = entry.foreign_cpu_pct or {}
    lo, hi = fc.get("min", "?"), fc.get("max", "?")
    foreign = f"{lo}" if lo == hi else f"{lo}\u2013{hi}"
    n = sum(1 for r in entry.repeats if r.result is not None)
    load = doc.loadavg_start[0] if doc.loadavg_start else "?"
    return (
        f"_`iop bench run {shown}{with_lite}`: commit `{doc.commit}`, {doc.started}, "
        f"median of {n} repeat{'s' if n != 1 else ''}; foreign CPU "
        f"{foreign} % of a core, load average "
        f"{load} at the start{' (smoke sizes: not figures)' if doc.smoke else ''}._"
    )


def _latest_results() -> list[Path]:
    """Every result file in bench-results/, oldest first (a later one wins per scenario)."""
    return sorted(RESULTS.glob("bench-*.json"), key=lambda p: p.stat().st_mtime)


def _blocks(f: Path, img: Path) -> dict[str, str]:
    """The marked blocks (tables, by marker key) of result file ``f``; plots into ``img``.

    Raises:
        ResultError: ``f`` cannot be used.
    """
    blocks: dict[str, str] = {}
    doc = read_result(f, RESULT_FORMAT)
    for name, entry in doc.scenarios.items():
        if name.endswith(BASE_SUFFIX):
            continue  # another version's figures (--against): never the docs'
        runner = RUNNERS.get(entry.runner)
        if entry.median is None:
            print(f"iop bench: {f.name}: {name} has no successful run", file=sys.stderr)
            continue
        if runner is None or runner.report is None:
            print(f"iop bench: {name}: runner {entry.runner!r} writes no tables")
            continue
        inp = ReportInput(
            scenario=name,
            median=entry.median,
            repeats=[r.result for r in entry.repeats if r.result is not None],
            foreign_cpu_pct=[r.foreign_cpu_pct for r in entry.repeats],
            img_dir=img,
            footer=_footer(doc, entry),
        )
        try:
            blocks.update(runner.report(inp))
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            # A median without what the runner's tables read: edited by
            # hand, or written by another version of the runner.
            raise ResultError(
                f"{f}: {name}: not a result runner {entry.runner!r} can report ({exc!r})"
            ) from None
    return blocks


def cmd_report(results: list[Path], docs: Path, img_dir: Path | None) -> int:
    """Rewrite the marked blocks of ``docs`` from ``results``.

    Raises:
        ResultError: a result file that cannot be used, a ``docs`` that is not
            a directory, or a page with a marker left open.
    """
    if not docs.is_dir():
        raise ResultError(f"--docs {docs}: not a directory")
    files = results or _latest_results()
    if not files:
        print("iop bench: no results: run `iop bench run` (or --all) first", file=sys.stderr)
        return 2
    img = img_dir or docs / "img"
    blocks: dict[str, str] = {}
    for f in files:
        blocks.update(_blocks(f, img))
    pages = sorted(docs.glob("*.md"))
    seen: set[str] = set()
    for page in pages:
        text = page.read_text()
        seen.update(marker_keys(text))
        try:
            new, done = rewrite_markers(text, blocks)
        except ValueError as exc:
            raise ResultError(f"{page}: {exc}; nothing of it was rewritten") from None
        if new != text:
            page.write_text(new)
        if done:
            print(f"iop bench: {page}: rewrote {', '.join(done)}")
    for key in sorted(seen - set(blocks)):
        print(f"iop bench: <!-- bench:{key} --> has no result: left as it was")
    for key in sorted(set(blocks) - seen):
        print(f"iop bench: {key} has no <!-- bench:{key} --> marker in {docs}")
    return 0
