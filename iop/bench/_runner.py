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

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec

__all__ = ["RUNNERS", "RunContext", "Runner", "register"]

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


@dataclass(frozen=True)
class Runner(Generic[OptionsT]):
    """A registered runner: its name, options type, summary and function."""

    name: str
    options: type[OptionsT]
    summary: str
    run: Callable[[OptionsT, RunContext], dict[str, Any]]


# Filled by ``register`` as runner modules are imported (``iop.bench._cli``
# imports them all).
RUNNERS: dict[str, Runner[Any]] = {}


def register(
    name: str, options: type[OptionsT], summary: str
) -> Callable[
    [Callable[[OptionsT, RunContext], dict[str, Any]]],
    Callable[[OptionsT, RunContext], dict[str, Any]],
]:
    """Register ``fn`` as the runner ``name`` with options type ``options``."""

    def deco(
        fn: Callable[[OptionsT, RunContext], dict[str, Any]],
    ) -> Callable[[OptionsT, RunContext], dict[str, Any]]:
        if name in RUNNERS:
            raise ValueError(f"runner {name!r} is registered twice")
        RUNNERS[name] = Runner(name, options, summary, fn)
        return fn

    return deco
