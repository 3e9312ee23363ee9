"""The routing runner's results as a table per workload and one plot.

Every figure is the median over the repeats of the cell's own figure (a
cell is one workload and one placement: ``iop/bench/_routing.py``).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Final, Literal

from iop.bench._report import import_matplotlib
from iop.bench._runner import ReportInput

__all__ = [
    "DEFAULT_PLACEMENTS",
    "DEFAULT_WORKLOADS",
    "PLACEMENTS",
    "WORKLOADS",
    "Placement",
    "Workload",
    "misses_plot",
    "plots",
    "repeats_table",
    "report",
    "tables",
]

Placement = Literal["random", "least_loaded", "affinity", "session", "prefix"]
Workload = Literal["shared", "unique", "agents"]

PLACEMENTS: Final[tuple[Placement, ...]] = (
    "random",
    "least_loaded",
    "affinity",
    "session",
    "prefix",
)
WORKLOADS: Final[tuple[Workload, ...]] = ("shared", "unique", "agents")
# What a scenario without ``workloads`` and ``placements`` runs: the
# comparison of docs/benchmarks.md, "Placement: prefix-aware against least-loaded".
DEFAULT_PLACEMENTS: Final[tuple[Placement, ...]] = (
    "random",
    "least_loaded",
    "affinity",
    "prefix",
)
DEFAULT_WORKLOADS: Final[tuple[Workload, ...]] = ("shared", "unique")


def _results(result: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return result if isinstance(result, list) else [result]


def _median_cells(
    result: dict[str, Any] | list[dict[str, Any]],
) -> dict[tuple[str, str], dict[str, Any]]:
    """(workload, placement) -> the median over the repeats of each figure."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for res in _results(result):
        for c in res["cells"]:
            by.setdefault((c["workload"], c["placement"]), []).append(c)

    def med(cells: list[dict[str, Any]], *path: str) -> float | None:
        vals = []
        for c in cells:
            v: Any = c
            for p in path:
                v = v.get(p) if isinstance(v, dict) else None
            if isinstance(v, int | float):
                vals.append(float(v))
        return statistics.median(vals) if vals else None

    out: dict[tuple[str, str], dict[str, Any]] = {}
    for key, cells in by.items():
        out[key] = {
            "n": len(cells),
            "p50": med(cells, "ttft_ms", "p50"),
            "p90": med(cells, "ttft_ms", "p90"),
            "tok_s": med(cells, "throughput_tok_s"),
            "ans_s": med(cells, "answers_per_s"),
            "hit": med(cells, "hit_rate"),
            "hit_req": med(cells, "hit_requests"),
            "spread": med(cells, "instances_per_tenant"),
            "foreign": med(cells, "foreign_cpu_pct"),
            "errors": sum(sum(c["errors"].values()) for c in cells),
        }
    return out


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def tables(
    result: dict[str, Any] | list[dict[str, Any]], scenario: str = "routing"
) -> dict[str, str]:
    """Markdown tables by marker key: ``routing`` (every cell) and
    ``routing-target`` (the issue's two targets, met or not); another
    scenario of this runner (``sessions``) gets its cells' table alone,
    under its own name."""
    cells = _median_cells(result)
    rows = [
        "| workload | placement | TTFT p50 ms | TTFT p90 ms | tokens/s | answers/s "
        "| cache hit rate | full prefills | instances per tenant | errors | foreign CPU % |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for w in WORKLOADS:
        for p in PLACEMENTS:
            c = cells.get((w, p))
            if c is None:
                continue
            rows.append(
                f"| {w} | {p} | {_f(c['p50'], '.0f')} | {_f(c['p90'], '.0f')} "
                f"| {_f(c['tok_s'], '.1f')} | {_f(c['ans_s'], '.2f')} "
                f"| {_f(None if c['hit'] is None else c['hit'] * 100, '.1f')} % "
                f"| {_f(None if c['hit_req'] is None else (1 - c['hit_req']) * 100, '.1f')} % "
                f"| {_f(c['spread'], '.2f')} | {c['errors']} | {_f(c['foreign'], '.0f')} |"
            )
    n = max((c["n"] for c in cells.values()), default=0)
    rows.append("")
    rows.append(f"Median of {n} repeat(s) per cell.")
    if scenario != "routing":
        return {scenario: "\n".join(rows)}
    out = {"routing": "\n".join(rows)}
    target = [
        "| target | least-loaded | prefix | ratio | met |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    ll, px = cells.get(("shared", "least_loaded")), cells.get(("shared", "prefix"))
    if ll and px and ll["p90"] and px["p90"]:
        ratio = ll["p90"] / px["p90"]
        target.append(
            f"| shared: TTFT p90 at least halved | {ll['p90']:.0f} ms | {px['p90']:.0f} ms "
            f"| {ratio:.2f}x | {'yes' if ratio >= 2 else 'no'} |"
        )
    ll, px = cells.get(("unique", "least_loaded")), cells.get(("unique", "prefix"))
    if ll and px and ll["tok_s"] and px["tok_s"]:
        ratio = px["tok_s"] / ll["tok_s"]
        # "No throughput lost": within 2 %, the run-to-run spread of an open
        # loop's completions on this box.
        target.append(
            f"| unique: no throughput lost | {ll['tok_s']:.1f} tok/s | {px['tok_s']:.1f} tok/s "
            f"| {ratio:.3f} | {'yes' if ratio >= 0.98 else 'no'} |"
        )
    out["routing-target"] = "\n".join(target)
    return out


def plots(result: dict[str, Any] | list[dict[str, Any]], img_dir: Path) -> list[Path]:
    """``bench_routing.png``: TTFT p50/p90 and hit rate per placement, both workloads."""
    import_matplotlib()
    import matplotlib.pyplot as plt

    cells = _median_cells(result)
    img_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    x = list(range(len(DEFAULT_PLACEMENTS)))
    width = 0.38
    for wi, w in enumerate(DEFAULT_WORKLOADS):
        got = [cells.get((w, p)) for p in DEFAULT_PLACEMENTS]
        off = [i + (wi - 0.5) * width for i in x]
        p90 = [c["p90"] if c and c["p90"] else 0 for c in got]
        p50 = [c["p50"] if c and c["p50"] else 0 for c in got]
        axes[0].bar(off, p90, width, label=f"{w}: p90", alpha=0.55)
        axes[0].scatter(off, p50, marker="_", s=300, color="black", zorder=3)
        axes[1].bar(off, [c["tok_s"] if c and c["tok_s"] else 0 for c in got], width, label=w)
        axes[2].bar(off, [(c["hit"] or 0) * 100 if c else 0 for c in got], width, label=w)
    for ax, title in zip(
        axes,
        (
            "TTFT p90 (bars), p50 (ticks), ms",
            "throughput, completion tokens/s",
            "cache hit rate, %",
        ),
        strict=True,
    ):
        ax.set_xticks(x, list(DEFAULT_PLACEMENTS))
        ax.set_title(title)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.2)  # room for the legend above the bars
        ax.legend(fontsize=8, loc="upper right", ncols=2)
    fig.tight_layout()
    path = img_dir / "bench_routing.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def misses_plot(
    result: dict[str, Any] | list[dict[str, Any]], img_dir: Path, name: str
) -> list[Path]:
    """``bench_NAME_misses.png``, when the cells counted misses per window
    (the closed-loop scenarios): each repeat's misses over time, per placement."""
    runs = _results(result)
    if not any(c.get("misses_per_window") for res in runs for c in res["cells"]):
        return []
    import_matplotlib()
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4))
    colors = {"least_loaded": "tab:blue", "prefix": "tab:orange", "affinity": "tab:green"}
    for res in runs:
        window = float(res["options"].get("window_s", 10.0))
        for c in res["cells"]:
            ys = [v * 100 if v is not None else math.nan for v in c.get("misses_per_window", [])]
            if ys:
                ax.plot(
                    [(i + 1) * window for i in range(len(ys))],
                    ys,
                    color=colors.get(c["placement"], "tab:gray"),
                    alpha=0.6,
                    label=f"{c['placement']} (repeat {res['repeat']})",
                )
    ax.set_xlabel("seconds into the window")
    ax.set_ylabel("misses, % of answers")
    ax.set_title("misses per window (< half the prompt cached)")
    ax.legend(fontsize=7, ncols=2)
    fig.tight_layout()
    path = img_dir / f"bench_{name}_misses.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def repeats_table(result: dict[str, Any] | list[dict[str, Any]]) -> str:
    """One row per repeat: least-loaded against prefix on the ``shared``
    workload: TTFT p90, their ratio, throughput, misses overall and in the
    first and last window (the closed-loop scenarios' targets)."""
    rows = [
        "| repeat | window s | TTFT p90 least-loaded ms | TTFT p90 prefix ms | ratio "
        "| tokens/s least-loaded | tokens/s prefix | misses prefix | misses prefix, "
        "first / last window |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for res in _results(result):
        by = {c["placement"]: c for c in res["cells"] if c["workload"] == "shared"}
        ll, px = by.get("least_loaded"), by.get("prefix")
        if not ll or not px:
            continue
        a, b = ll["ttft_ms"]["p90"], px["ttft_ms"]["p90"]
        ratio = f"{a / b:.2f}x" if a and b else "-"
        miss = None if px["hit_requests"] is None else (1 - px["hit_requests"]) * 100
        series = [v for v in px.get("misses_per_window", []) if v is not None]
        trend = f"{series[0] * 100:.1f} % / {series[-1] * 100:.1f} %" if series else "-"
        rows.append(
            f"| {res['repeat']} | {px['span_s']:.0f} | {_f(a, '.0f')} | {_f(b, '.0f')} | {ratio} "
            f"| {ll['throughput_tok_s']:.1f} | {px['throughput_tok_s']:.1f} "
            f"| {_f(miss, '.1f')} % | {trend} |"
        )
    return "\n".join(rows)


def report(r: ReportInput) -> dict[str, str]:
    """``iop bench report``: the tables over every repeat (each figure their
    median), the plots, and the footer under each table; for a closed-loop
    scenario also its per-repeat table (``SCENARIO-repeats``)."""
    if r.scenario == "routing":  # bench_routing.png is that scenario's
        plots(r.repeats, r.img_dir)
    made = tables(r.repeats, r.scenario)
    if misses_plot(r.repeats, r.img_dir, r.scenario):
        made[f"{r.scenario}-repeats"] = repeats_table(r.repeats)
    return {key: f"{text}\n\n{r.footer}" for key, text in made.items()}
