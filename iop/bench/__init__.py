"""``iop bench``: every figure in docs/benchmarks.md and docs/research.md from one command.

A *scenario* is a TOML file (``configs/bench/*.toml``) that names a *runner*
and sets its options; a runner is a function registered here with
``register``, taking its typed options and a ``RunContext`` and returning a
JSON-able result. The command (``iop.bench._cli``) loads scenarios, checks
their options against the runner's ``Options`` struct (an unknown key is an
error naming it), runs them (interleaving repeats), and writes JSON; ``iop
bench report`` turns results into the tables and plots of the docs.
"""

from __future__ import annotations

from iop.bench._runner import RUNNERS, ReportFn, ReportInput, RunContext, Runner, register

__all__ = ["RUNNERS", "ReportFn", "ReportInput", "RunContext", "Runner", "register"]
