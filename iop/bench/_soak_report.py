"""The soak's results as figures: slopes of memory and fds, tables, the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from iop.bench._report import import_matplotlib
from iop.bench._results import least_squares
from iop.bench._runner import ReportInput

__all__ = ["plot", "report", "slope", "slopes", "tables"]


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least squares slope of ``(x, y)`` points (None for fewer than 3)."""
    return least_squares(points)[1] if len(points) >= 3 else None


def slopes(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    """Per role: RSS (KiB/min) and fds (per minute) slopes over its last
    incarnation's samples after its first ``warmup_s``, and their ranges."""
    out: dict[str, Any] = {}
    roles = sorted({r for s in samples for r in s["procs"]})
    for role in roles:
        series = [(s["t"], s["procs"][role]) for s in samples if role in s["procs"]]
        last_pid = series[-1][1]["pid"]
        mine = [(t, p) for t, p in series if p["pid"] == last_pid]
        born = mine[0][0]
        steady = [(t, p) for t, p in mine if t >= born + warmup_s] or mine
        rss = slope([(t / 60, p["rss_kb"]) for t, p in steady])
        fds = slope([(t / 60, p["fds"]) for t, p in steady])
        out[role] = {
            "incarnations": len({p["pid"] for _, p in series}),
            "samples": len(steady),
            "from_s": steady[0][0],
            "rss_kib_per_min": None if rss is None else round(rss, 1),
            "fds_per_min": None if fds is None else round(fds, 3),
            "rss_first_kb": steady[0][1]["rss_kb"],
            "rss_last_kb": steady[-1][1]["rss_kb"],
            "rss_max_kb": max(p["rss_kb"] for _, p in series),
            "fds_first": steady[0][1]["fds"],
            "fds_last": steady[-1][1]["fds"],
            "fds_max": max(p["fds"] for _, p in series),
            "cpu_s": round(sum(_cpu_of(series, pid) for pid in {p["pid"] for _, p in series}), 1),
        }
    return out


def _cpu_of(series: list[tuple[float, dict[str, Any]]], pid: int) -> float:
    mine = [p["cpu_s"] for _, p in series if p["pid"] == pid]
    return mine[-1] - mine[0] if mine else 0.0


# --------------------------------------------------------------------------- report


def tables(result: dict[str, Any]) -> str:
    """The Markdown tables of one result."""
    o = result["outcomes"]
    lines = [
        "| process | incarnations | RSS first → last (MiB) | RSS slope (KiB/min) "
        "| fds first → last (max) | fd slope (/min) | CPU s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for role, s in result["slopes"].items():
        lines.append(
            f"| {role} | {s['incarnations']} | {s['rss_first_kb'] / 1024:.1f} → "
            f"{s['rss_last_kb'] / 1024:.1f} | {_num(s['rss_kib_per_min'])} "
            f"| {s['fds_first']} → {s['fds_last']} ({s['fds_max']}) "
            f"| {_num(s['fds_per_min'], 3)} | {s['cpu_s']} |"
        )
    counts = ", ".join(f"{k} {v}" for k, v in o["counts"].items())
    lines += [
        "",
        "| requests | outcomes | exactly one terminal | anomalies | tool calls |",
        "| ---: | --- | ---: | ---: | ---: |",
        f"| {o['requests']} | {counts} | {o['single_terminal']} | {o['anomaly_count']} "
        f"| {o['tool_calls']} |",
    ]
    b = result["ledger"]
    ct, lt = b["client_tokens"], b["complete_tokens"]
    lines += [
        "",
        "| | runs | complete | input tokens | output tokens | cached |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        f"| clients | \u2013 | {b['client_complete']} | {ct['input']} | {ct['output']} "
        f"| {ct['cached']} |",
        f"| ledger | {b['records']} | {b['by_outcome'].get('complete', 0)} | {lt['input']} "
        f"| {lt['output']} | {lt['cached']} |",
        f"| edge (`iop_runs_total`) | {result['edge_runs_total']} "
        f"| {result['edge_runs'].get('complete', 0)} | | | |",
    ]
    faults = ", ".join(
        f"{f['kind']} at {f['at_s']:.0f} s (back in {f['recovered_s']} s)"
        for f in result["faults"]
        if not f["kind"].startswith("reload")
    )
    reloads = [f for f in result["faults"] if f["kind"].startswith("reload")]
    died = ", ".join(f"{d['name']} (rc {d['rc']})" for d in result["deaths"]) or "none"
    lines += [
        "",
        f"Faults: {faults}; {len(reloads)} reloads "
        f"({', '.join(sorted({f['detail'] for f in reloads}))}). "
        f"Unplanned exits: {died}.",
    ]
    return "\n".join(lines) + "\n"


def _num(v: float | None, nd: int = 1) -> str:
    return "\u2013" if v is None else f"{v:+.{nd}f}"


def plot(result: dict[str, Any], path: Path) -> Path:
    """RSS of IOP's processes and Valkey, RSS of llama.cpp's server (ten times
    theirs: its own axis), and every process's open fds, the faults marked."""
    import_matplotlib()
    import matplotlib.pyplot as plt

    series = result["series"]
    minutes = [t / 60 for t in series["t"]]
    fig, (ax_rss, ax_llama, ax_fd) = plt.subplots(
        3, 1, figsize=(9, 9), sharex=True, gridspec_kw={"height_ratios": [3, 2, 3]}
    )
    for role, s in series["procs"].items():
        rss = [None if v is None else v / 1024 for v in s["rss_kb"]]
        (ax_llama if role == "llama-server" else ax_rss).plot(
            minutes, rss, label=role, linewidth=1.2
        )
        ax_fd.plot(minutes, s["fds"], label=role, linewidth=1.0)
    for f in result["faults"]:
        reload = f["kind"].startswith("reload")
        for ax in (ax_rss, ax_llama, ax_fd):
            ax.axvline(
                f["at_s"] / 60,
                color="#bbbbbb" if reload else "#C44E52",
                linestyle=":" if reload else "--",
                linewidth=0.8,
            )
    ax_rss.set_ylabel("RSS (MiB)")
    ax_rss.set_ylim(bottom=0)
    ax_llama.set_ylabel("llama-server\nRSS (MiB)")
    ax_llama.set_ylim(bottom=0)
    ax_fd.set_ylabel("open fds")
    ax_fd.set_ylim(bottom=0)
    ax_fd.set_xlabel("minutes (red dashes: kills and restarts; grey dots: reloads)")
    ax_rss.legend(fontsize=8, ncol=3, loc="lower right")
    ax_fd.legend(fontsize=8, ncol=3, loc="lower right")
    ax_rss.set_title("Soak: every process's memory and file descriptors over the run")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(r: ReportInput) -> dict[str, str]:
    """The scenario's table, and its plot ``bench_SCENARIO.png`` in ``r.img_dir``."""
    plot(r.median, r.img_dir / f"bench_{r.scenario}.png")
    return {r.scenario: f"{tables(r.median)}\n{r.footer}"}
