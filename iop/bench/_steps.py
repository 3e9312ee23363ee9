"""The stress measurements' harness: one command line, each step in its own processes.

``cancel``, ``memory``, ``overload`` and ``idle-nodes`` (docs/benchmarks.md,
"Cancellation, memory, overload, idle links") are *steps*: each module
defines a ``Step``, its argument group, a check of those arguments, its run
on a fresh ``Stack`` of processes and its summary table on stdout.
``iop.bench._stress`` (``scripts/bench_stress.py``) runs the steps asked for
one after the other and writes one JSON (``run_steps``); each step's
``iop bench`` runner runs it alone (``run_step``), from its scenario's
options turned into the same command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from iop.bench._procs import (
    REPO,
    Stack,
    git_commit,
    machine_info,
    process_stack,
    raise_fd_limit,
)
from iop.bench._runner import RunContext

__all__ = [
    "Step",
    "add_out_dir",
    "add_python",
    "build_parser",
    "describe",
    "int_list",
    "parse",
    "run_step",
    "run_steps",
]


def _no_check(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    return None


@dataclass(frozen=True)
class Step:
    """One measurement of the stress command line.

    Attributes:
        name: Its name in ``--only`` and the result's key.
        about: How long it takes with its defaults ("about 15 s").
        doc: Its module's docstring: the first line a title, the rest what
            ``--help`` says of it.
        add_arguments: Adds its options to its argument group.
        run: Measures on processes it starts into the stack; the result.
        print_result: Its summary table, from a result (or a median of them).
        check: Refuses option values out of range (``ap.error``).
    """

    name: str
    about: str
    doc: str | None
    add_arguments: Callable[[argparse._ArgumentGroup], None]
    run: Callable[[argparse.Namespace, Stack], dict[str, Any]]
    print_result: Callable[[dict[str, Any]], None]
    check: Callable[[argparse.Namespace, argparse.ArgumentParser], None] = _no_check


def int_list(text: str, what: str, ap: argparse.ArgumentParser) -> list[int]:
    """A comma-separated list of positive integers, or ``ap.error``."""
    try:
        vals = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        ap.error(f"{what}: not a comma-separated list of integers: {text!r}")
    if not vals or min(vals) < 1:
        ap.error(f"{what}: values must be >= 1")
    return vals


def describe(steps: Sequence[Step], doc: str) -> str:
    """``doc`` with, before its ``Outputs:`` paragraph, what each step does
    (its docstring but the title, under its name and duration)."""
    head, sep, tail = doc.partition("\n\nOutputs:")
    parts = [head.rstrip("\n")]
    for s in steps:
        body = textwrap.dedent((s.doc or "").partition("\n")[2]).strip("\n")
        parts.append(f"{s.name} ({s.about})\n" + textwrap.indent(body, "  "))
    return "\n\n".join(parts) + sep + tail


def add_out_dir(ap: argparse.ArgumentParser) -> None:
    """``--out-dir``: where a script's JSON and profiles go."""
    ap.add_argument(
        "--out-dir",
        type=Path,
        default=REPO / "bench-results",
        help="where the JSON (and py-spy files) go (default: bench-results/)",
    )


def add_python(ap: argparse.ArgumentParser) -> None:
    """``--python``: the interpreter of the ``python -m iop`` children."""
    ap.add_argument(
        "--python",
        default=sys.executable,
        help="interpreter that runs `-m iop` for the children (default: this one)",
    )


def build_parser(steps: Sequence[Step], description: str | None) -> argparse.ArgumentParser:
    """The command line of ``steps``: ``--only``, each step's group, the outputs."""
    ap = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--only",
        default=",".join(s.name for s in steps),
        help="comma-separated measurements to run, in this order (default: %(default)s)",
    )
    ap.add_argument("--seed", type=int, default=1, help="seed of the arrival times (default: 1)")
    for step in steps:
        step.add_arguments(ap.add_argument_group(step.name))
    add_out_dir(ap)
    add_python(ap)
    return ap


def parse(steps: Sequence[Step], description: str | None, argv: list[str] | None) -> Any:
    """Parse ``argv`` and check it: ``args.steps`` are the steps asked for."""
    ap = build_parser(steps, description)
    args = ap.parse_args(argv)
    names = [s.name for s in steps]
    args.steps = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in args.steps if s not in names]
    if bad:
        ap.error(f"--only: unknown {bad}; choose from {names}")
    for step in steps:
        step.check(args, ap)
    return args


def run_step(step: Step, argv: list[str], ctx: RunContext) -> dict[str, Any]:
    """``step`` alone with the options ``argv``, in its own processes (``iop bench``)."""
    args = parse([step], None, ["--out-dir", str(ctx.workdir), "--python", ctx.python, *argv])
    args.stamp = time.strftime("%Y%m%d-%H%M%S")
    fd_limit = raise_fd_limit()
    with process_stack(args.python, ctx.workdir) as stack:
        res = step.run(args, stack)
    res["fd_limit"] = fd_limit
    return res


def run_steps(args: argparse.Namespace, steps: Sequence[Step]) -> int:
    """``args.steps`` one after the other, each in its own processes; one JSON
    (rewritten after each step), then each step's table. 1 if one failed."""
    by_name = {s.name: s for s in steps}
    args.stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "timestamp": args.stamp,
        "commit": git_commit(),
        "argv": sys.argv[1:],
        "machine": machine_info(),
        "fd_limit": raise_fd_limit(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }
    t_start = time.monotonic()
    out = args.out_dir / f"stress-{args.stamp}.json"
    failed = False
    for name in args.steps:
        t0 = time.monotonic()
        print(f"bench: --- {name}", flush=True)
        with tempfile.TemporaryDirectory(prefix=f"iop-stress-{name}-") as tmp:
            try:
                with process_stack(args.python, Path(tmp)) as stack:
                    res = by_name[name].run(args, stack)
            except Exception as exc:  # recorded; the next steps still run
                print(f"bench: {name} failed: {exc!r}", file=sys.stderr)
                result[name] = {"error": repr(exc)}
                failed = True
                continue
        res["duration_s"] = round(time.monotonic() - t0, 1)
        result[name] = res
        out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["duration_s"] = round(time.monotonic() - t_start, 1)
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    for name in args.steps:
        if "error" not in result[name]:
            by_name[name].print_result(result[name])
    print(
        f"\nbench: commit {result['commit']}, load average {result['loadavg_start']} at start, "
        f"{result['loadavg_end']} at end"
    )
    print(f"bench: results in {out} ({result['duration_s']} s)")
    return 1 if failed else 0
