"""The ``ondemand`` runner's results as the docs' table and plot
(docs/benchmarks.md, "Models on demand")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from iop.bench._report import fmt, import_matplotlib, table

__all__ = ["plots", "tables"]

_LABELS = {
    "on_demand": "on demand (memory for {per_node} of {models} per node)",
    "all_loaded": "every model loaded everywhere",
}


def _label(mode: str, o: dict[str, Any]) -> str:
    return _LABELS.get(mode, mode).format(**o)


def tables(result: dict[str, Any]) -> str:
    """One row per mode: TTFT, cold starts, loads, evictions, memory held."""
    o = result["options"]
    rows = []
    for mode, m in result["modes"].items():
        ttft = m["ttft_ms"]
        share = m.get("memory_share")
        rows.append(
            [
                _label(mode, o),
                f"{m['answered']} / {m['sent']}",
                f"{fmt(ttft['p50'])} ms",
                f"{fmt(ttft['p99'])} ms",
                f"{m['cold_starts']} ({fmt(100 * (m['cold_start_rate'] or 0), 1)} %)",
                str(m["loads"]),
                str(m["evictions"]),
                f"{fmt(m['memory_mib_s'] / 1024, 0)} GiB·s",
                f"{fmt(100 * share, 0)} %" if share is not None else "",
            ]
        )
    head = [
        "mode",
        "answered",
        "TTFT p50",
        "TTFT p99",
        "cold starts (rate)",
        "loads",
        "evictions",
        "memory held",
        "of all loaded",
    ]
    lines = table(head, rows)
    return (
        f"{lines}\n\n{o['nodes']} nodes, {o['models']} sim models of {o['memory_mib']} MiB "
        f"loading in {o['load_time_s']:g} s; {result['requests']} requests in "
        f"{o['duration_s']:g} s (Poisson, {o['rate_per_s']:g}/s), Zipf s = {o['zipf_s']:g}, "
        f"the ranking rotated by {o['rotate']} every {o['phase_s']:g} s; requests per model: "
        + ", ".join(f"{k} {v}" for k, v in result["popularity"].items())
        + ". Memory held: the nodes' `memory_mib.used` integrated over the traffic window; "
        "of all loaded: against every model held on every node for that window."
    )


def plots(result: dict[str, Any], img_dir: Path) -> list[Path]:
    """``bench_ondemand.png`` (``bench_ondemand_N_per_node.png`` for one mode):
    memory held over time, and each mode's TTFT distribution."""
    import_matplotlib()
    import matplotlib.pyplot as plt

    o = result["options"]
    img_dir.mkdir(parents=True, exist_ok=True)
    fig, (mem_ax, ttft_ax) = plt.subplots(1, 2, figsize=(12, 4))
    for mode, m in result["modes"].items():
        series = m.get("memory_series") or []
        if series:
            mem_ax.step(
                [t for t, _ in series],
                [v / 1024 for _, v in series],
                where="post",
                label=_label(mode, o),
            )
        q = m.get("ttft_quantiles_ms") or []
        if q:
            ttft_ax.plot(q, [i / len(q) for i in range(len(q))], label=_label(mode, o))
    for at in range(1, int(o["duration_s"] // o["phase_s"]) + 1):
        mem_ax.axvline(at * o["phase_s"], color="grey", linewidth=0.5, linestyle=":")
    mem_ax.set_title("memory the nodes hold, GiB (dotted: the popularity rotates)")
    mem_ax.set_xlabel("s into the traffic window")
    mem_ax.set_ylim(bottom=0)
    ttft_ax.set_title("TTFT distribution")
    ttft_ax.set_xscale("log")
    ttft_ax.set_xlabel("ms (log)")
    ttft_ax.set_ylabel("share of answered requests")
    for ax in (mem_ax, ttft_ax):
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    # The comparison is bench_ondemand.png; a run of one mode (the tight
    # scenario) names its memory, so the two never overwrite each other.
    name = (
        "bench_ondemand.png"
        if len(result["modes"]) > 1
        else f"bench_ondemand_{o['per_node']}_per_node.png"
    )
    path = img_dir / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
