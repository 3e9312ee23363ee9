"""``iop bench``: every figure in docs/benchmarks.md and docs/research.md from one command.

A *scenario* is a TOML file (``configs/bench/*.toml``) that names a *runner*
and sets its options; a runner is a function registered here with
``register``, taking its typed options and a ``RunContext`` and returning a
JSON-able result. The command (``iop.bench._cli``) loads scenarios, checks
their options against the runner's ``Options`` struct (an unknown key is an
error naming it), runs them (interleaving repeats), and writes JSON; ``iop
bench report`` turns results into the tables and plots of the docs.

Where things are: ``_cli`` (the command), ``_scenario`` and ``_runner``
(scenario files, the runner contract), ``_results`` (result files, medians,
statistics), ``_report`` (Markdown cells and tables). What every runner
shares: ``_procs`` (start, read from /proc, profile and stop processes; the
scripts' main), ``_mock_backend`` (an OpenAI-compatible backend in this
process), ``_client`` (raw HTTP/1.1, httpx and bare-socket clients, SSE
decoding). The runners: ``_platform`` (with ``_platform_stack``,
``_platform_load``, ``_platform_report``); ``_cancel``, ``_memory``,
``_overload``, ``_idle_nodes`` (the stress steps, with ``_steps`` and
``_stress``, the script that runs them together); ``_slow_reader``,
``_credit_window``, ``_channel_capacity``, ``_hol`` (on ``_backpressure``);
``_edges``; ``_routing`` (with ``_routing_load``); ``_soak``; ``_ondemand``
(models on demand, with ``_ondemand_report``). A runner's ``*_report`` module turns
its results into text.
"""

from __future__ import annotations

from iop.bench._runner import RUNNERS, ReportFn, ReportInput, RunContext, Runner, register

__all__ = ["RUNNERS", "ReportFn", "ReportInput", "RunContext", "Runner", "register"]
