"""The contract between ``iop bench`` and its runners.

A runner module defines an options struct and a run function and registers
them::

    class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
        streams: int = 100

    @register("slow-reader", Options, "Memory while a reader stalls; CPU after it leaves.")
    def run(opts: Options, ctx: RunContext) -> dict[str, Any]:
        ...

A run starts every process it needs itself (sim, edge, nodes, LiteLLM when
``ctx.litellm`` is set), with their logs under ``ctx.workdir``, stops them
all by PID before it returns (also on error), and returns a JSON-able dict.
It never asserts timings: it measures them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec

__all__ = [
    "RUNNERS",
    "ReportFn",
    "ReportInput",
    "RunContext",
    "Runner",
    "options_argv",
    "register",
    "tables_report",
]

OptionsT = TypeVar("OptionsT", bound=msgspec.Struct)


@dataclass(frozen=True, kw_only=True)
class RunContext:
    """What a runner gets besides its options.

    Attributes:
        python: The interpreter for ``python -m iop ...`` children.
        workdir: This run's own directory, for configs and logs.
        litellm: A LiteLLM install's ``litellm`` executable (``--litellm``),
            or None: compare with LiteLLM only when given.
        smoke: Tiny sizes for the test suite's smoke run; a runner may
            shrink counts and durations further than its options say.
        repeat: Which interleaved repeat this is (0-based).
    """

    python: str
    workdir: Path
    litellm: Path | None = None
    smoke: bool = False
    repeat: int = 0


@dataclass(frozen=True, kw_only=True)
class ReportInput:
    """What a runner's report function gets for one scenario's results.

    Attributes:
        scenario: The scenario's name (its file's stem): the marker key of
            its first table, ``<!-- bench:SCENARIO -->``.
        median: The median over the repeats of every number in the runs'
            results (``iop.bench._results.median_tree``), the rest as in the
            first repeat.
        repeats: Every repeat's own result, in order.
        foreign_cpu_pct: Per repeat, the machine's busy CPU that no process of
            the run used, in % of one core.
        img_dir: Where the report's plots go (docs/img/).
        footer: One line to end each table with: the command, commit, date,
            repeats and foreign CPU.
    """

    scenario: str
    median: dict[str, Any]
    repeats: list[dict[str, Any]]
    foreign_cpu_pct: list[float]
    img_dir: Path
    footer: str


# A report maps marker keys to the Markdown between the markers (tables,
# and links to the PNGs it wrote into ``img_dir``).
ReportFn = Callable[[ReportInput], dict[str, str]]


@dataclass(frozen=True)
class Runner(Generic[OptionsT]):
    """A registered runner: its name, options type, summary and function;
    ``report``, when set, turns its results into the docs' tables."""

    name: str
    options: type[OptionsT]
    summary: str
    run: Callable[[OptionsT, RunContext], dict[str, Any]]
    report: ReportFn | None = None


def options_argv(opts: msgspec.Struct, *, repeated: tuple[str, ...] = ()) -> list[str]:
    """``opts`` as the command line of the script a runner wraps: ``--name
    value`` per field, a bool as a flag, a list comma-separated (or the flag
    per item when the field is in ``repeated``)."""
    out: list[str] = []
    for name in opts.__struct_fields__:
        value = getattr(opts, name)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out += [flag] if value else []
        elif isinstance(value, list) and name in repeated:
            for item in value:
                out += [flag, str(item)]
        elif isinstance(value, list):
            out += [flag, ",".join(str(v) for v in value)]
        else:
            out += [flag, str(value)]
    return out


def tables_report(module: str) -> ReportFn:
    """A report made of ``module``'s ``tables(result) -> {key: markdown}`` (or
    one table as a string, for the scenario's own marker) and
    ``plots(result, img_dir) -> [png]``, on the median result, each table
    ended with the footer (its plots are linked from the prose around the
    markers, under fixed names)."""

    def report(r: ReportInput) -> dict[str, str]:
        mod = importlib.import_module(module)
        mod.plots(r.median, r.img_dir)
        made: dict[str, str] | str = mod.tables(r.median)
        # One table as a string is the scenario's own block.
        tables = {r.scenario: made} if isinstance(made, str) else made
        return {key: f"{text}\n\n{r.footer}" for key, text in tables.items()}

    return report


# Filled by ``register`` as runner modules are imported (``iop.bench._cli``
# imports them all).
RUNNERS: dict[str, Runner[Any]] = {}


def register(
    name: str, options: type[OptionsT], summary: str, *, report: ReportFn | None = None
) -> Callable[
    [Callable[[OptionsT, RunContext], dict[str, Any]]],
    Callable[[OptionsT, RunContext], dict[str, Any]],
]:
    """Register ``fn`` as the runner ``name`` with options type ``options``
    (and ``report``, its results' tables for the docs)."""

    def deco(
        fn: Callable[[OptionsT, RunContext], dict[str, Any]],
    ) -> Callable[[OptionsT, RunContext], dict[str, Any]]:
        if name in RUNNERS:
            raise ValueError(f"runner {name!r} is registered twice")
        RUNNERS[name] = Runner(name, options, summary, fn, report)
        return fn

    return deco
