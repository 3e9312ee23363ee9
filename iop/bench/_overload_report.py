"""The overload measurement's results as text: its stdout table and the docs' table.

``print_overload`` is what ``scripts/bench_stress.py`` prints; ``report``
what ``iop bench report`` writes between the ``overload`` scenario's
markers (``iop/bench/_overload.py`` measures).
"""

from __future__ import annotations

import math
from typing import Any

from iop.bench._report import fmt, table
from iop.bench._runner import ReportInput

__all__ = ["print_overload", "report"]


def print_overload(res: dict[str, Any]) -> None:
    cfg = res["config"]["instance"]
    for key in ("saturation", "saturation_end"):
        sat = res[key]
        print(
            f"\noverload: closed loop c={sat['concurrency']} ({'start' if key == 'saturation' else 'end'}): "
            f"{sat['goodput_rps']} req/s, edge+node {sat['edge_node_cpu_ms_per_ok']} ms CPU "
            f"per answer, ttft p50 {sat['ttft_ms'].get('p50')} ms, foreign "
            f"{sat['foreign_cpu_pct_of_core']} %"
        )
    print(
        f"open loop, node slots {cfg['max_concurrency']}, edge "
        f"{res['config']['edge'] or 'defaults'}; goodput = answers done inside the level, "
        "ok/s = answers to its arrivals done at all"
    )
    print(
        f"{'level':>6}{'sat':>7}{'offered':>9}{'goodput':>9}{'ok/s':>7}{'429':>6}"
        f"{'other err':>10}"
        f"{'ttft p50/p99 ms':>18}{'429 p50 ms':>11}{'e+n ms/ok':>10}{'peak runs':>10}"
        f"{'load1':>7}{'foreign%':>9}"
    )
    for lv in res["levels"]:
        other = sum(v for k, v in lv["errors"].items() if not k.startswith("HTTP 429"))
        t = lv["ttft_ms"]
        print(
            f"{lv['level_pct']:>5}%{lv['saturated_rps']:>7.1f}"
            f"{lv['offered_rps']:>9.1f}{lv['goodput_rps']:>9.1f}"
            f"{lv['ok_rps']:>7.1f}{lv['refused_429']:>6}{other:>10}"
            f"{t.get('p50', math.nan):>9.0f}/{t.get('p99', math.nan):<8.0f}"
            f"{lv['refusal_ms'].get('p50', math.nan):>11.1f}"
            f"{lv['edge_node_cpu_ms_per_ok'] or math.nan:>10.2f}{lv['edge_peak_runs']:>10}"
            f"{lv['loadavg'][0]:>7.2f}{lv['foreign_cpu_pct_of_core']:>9.0f}"
        )
        if lv["errors"]:
            print(f"        errors: {lv['errors']}; edge outcomes: {lv['edge_outcomes']}")


# --------------------------------------------------------------------------- docs


def report(r: ReportInput) -> dict[str, str]:
    res = r.median
    rows = []
    for lv in res["levels"]:
        other = sum(v for k, v in lv["errors"].items() if not k.startswith("HTTP 429"))
        t = lv["ttft_ms"]
        rows.append(
            [
                f"{lv['level_pct']} %",
                fmt(lv["saturated_rps"]),
                fmt(lv["offered_rps"]),
                f"{fmt(lv['goodput_rps'])} / {fmt(lv['ok_rps'])}",
                str(lv["refused_429"]),
                str(other),
                f"{fmt(t.get('p50'), 0)} / {fmt(t.get('p99'), 0)}",
                fmt(lv["edge_node_cpu_ms_per_ok"], 2),
                fmt(lv["foreign_cpu_pct_of_core"], 0),
            ]
        )
    head = [
        "level",
        "saturated req/s",
        "offered req/s",
        "goodput / ok/s",
        "429s",
        "other errors",
        "TTFT p50 / p99 ms",
        "edge+node CPU ms per answer",
        "foreign %",
    ]
    sat = res["saturation"]
    text = table(head, rows)
    kinds: dict[str, int] = {}
    for lv in res["levels"]:
        for k, v in lv["errors"].items():
            if not k.startswith("HTTP 429"):
                kinds[k] = kinds.get(k, 0) + v
    if kinds:
        text += (
            "\n\nOther errors, all levels: "
            + ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items()))
            + "."
        )
    text += (
        f"\n\nClosed loop c={sat['concurrency']} at the start: {fmt(sat['goodput_rps'])} req/s, "
        f"edge + node {fmt(sat['edge_node_cpu_ms_per_ok'], 2)} ms CPU per answer."
    )
    return {r.scenario: f"{text}\n\n{r.footer}"}
