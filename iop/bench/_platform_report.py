"""The platform runner's results as tables and plots: stdout, the docs' Markdown, PNGs.

``print_tables`` is what ``scripts/bench_platform.py`` prints; ``report`` is
what ``iop bench report`` writes between the ``platform`` scenario's
markers in docs/benchmarks.md; ``plot`` draws ``bench_cpu_per_request.png``
and ``bench_latency.png`` for both. ``TARGETS`` are the bounds the IOP
shapes are checked against, as docs/benchmarks.md states them ("After the
hot-path changes", the target column).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from iop.bench._report import DASH, fmt, import_matplotlib, table
from iop.bench._runner import ReportInput

__all__ = ["LABELS", "TARGETS", "plot", "print_tables", "report"]

# (key, level, metric, "<=" or ">=", bound, unit)
TARGETS: Final[tuple[tuple[str, str, str, str, float, str], ...]] = (
    ("paced_c32_cpu", "paced-c32", "gateway_cpu_ms_per_req", "<=", 8.0, "ms/request"),
    ("paced_c32_added_ttft_p50", "paced-c32", "added_ttft_p50_ms", "<=", 5.0, "ms"),
    ("paced_c32_added_ttft_p99", "paced-c32", "added_ttft_p99_ms", "<=", 20.0, "ms"),
    ("paced_c32_throughput", "paced-c32", "throughput_pct_of_direct", ">=", 99.0, "%"),
    ("paced_c1_added_ttft_p50", "paced-c1", "added_ttft_p50_ms", "<=", 2.0, "ms"),
    ("paced_c1_added_ttft_p99", "paced-c1", "added_ttft_p99_ms", "<=", 5.0, "ms"),
    ("fast_fixed", "sweep", "fixed_ms", "<=", 2.0, "ms/request"),
    ("fast_per_chunk", "sweep", "per_chunk_us", "<=", 40.0, "µs/chunk"),
    ("nonstream_cpu", "nonstream", "gateway_cpu_ms_per_req", "<=", 3.0, "ms/request"),
)

_COLORS = {"direct": "#999999", "up": "#55A868", "split": "#4C72B0", "litellm": "#C44E52"}
_NODE_COLOR = "#DD8452"
LABELS = {"direct": "direct", "up": "iop up", "split": "edge + node", "litellm": "LiteLLM"}


def plot(result: dict[str, Any], img_dir: Path) -> list[Path]:
    import_matplotlib()

    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    cells = result["cells"]
    shapes = [s for s in result["shapes"] if s != "direct"]
    machine = result["machine"]
    where = (
        f"{machine['ncpu']} vCPU {machine['cpu_model']}, shared; commit {result['commit']}; "
        f"load average {result['loadavg_start'][0]:.2f} at start, "
        f"{result['loadavg_end'][0]:.2f} at end; {result['timestamp']}; "
        f"median of {result['settings']['repeat']}"
    )
    target = {t[0]: t[4] for t in TARGETS}
    paths = []

    # ---- CPU per request, per shape, and the sweep
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(15, 6.2), dpi=100)
    levels = [
        (lv, label, tkey)
        for lv, label, tkey in (
            ("paced-c32", "paced 50 tok/s\nc=32, 64 chunks", "paced_c32_cpu"),
            ("fast-64ch", "as fast as possible\nc=32, 64 chunks", None),
            ("nonstream", "non-streaming\nc=32, 64 tokens", "nonstream_cpu"),
        )
        if lv in cells
    ]
    w = 0.8 / max(1, len(shapes))
    ymax = 0.0
    for j, shape in enumerate(shapes):
        for i, (lv, _, _) in enumerate(levels):
            cell = cells[lv].get(shape)
            if cell is None:
                continue
            x = i - 0.4 + w * (j + 0.5)
            parts = cell["cpu_ms_per_req"]
            bottom = 0.0
            for name, v in parts.items():
                color = _NODE_COLOR if name == "node" else _COLORS[shape]
                label = None
                if i == 0:
                    label = f"{LABELS[shape]} ({name})" if len(parts) > 1 else LABELS[shape]
                ax.bar(x, v, w * 0.9, bottom=bottom, color=color, label=label)
                bottom += v
            ymax = max(ymax, bottom)
            ax.text(x, bottom, f"{bottom:.1f}", ha="center", va="bottom", fontsize=8)
    for i, (_, _, tkey) in enumerate(levels):
        if tkey:
            ax.hlines(target[tkey], i - 0.45, i + 0.45, colors="black", linestyles="--", lw=1.2)
            ax.text(
                i + 0.45,
                target[tkey],
                f"target {target[tkey]:g}",
                ha="right",
                va="bottom",
                fontsize=8,
            )
    ax.set_xticks(range(len(levels)), [lb for _, lb, _ in levels])
    ax.set_yscale("log")
    ax.set_ylim(0.5, max(ymax, 10) * 2.5)
    ax.set_ylabel("gateway CPU ms per request (log scale)")
    ax.set_title("CPU per request of the gateway processes (lower is better)")
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    ax.grid(axis="y", alpha=0.3, which="both")

    fits = result.get("sweep_fit") or {}
    fast = sorted((c for c in result["specs"] if c["kind"] == "fast"), key=lambda c: c["chunks"])
    if fits and fast:
        xs = [c["chunks"] for c in fast]
        dense = [max(xs) * i / 100 for i in range(101)]  # a straight line on linear x
        for shape in shapes:
            if shape not in fits:
                continue
            ys = [cells[c["name"]][shape]["gateway_cpu_ms_per_req"] for c in fast]
            f = fits[shape]["gateway"]
            ax2.plot(xs, ys, "o", color=_COLORS[shape])
            ax2.plot(
                dense,
                [f["fixed_ms"] + f["per_chunk_us"] / 1000 * v for v in dense],
                "-",
                color=_COLORS[shape],
                lw=1.2,
                label=f"{LABELS[shape]}: {f['fixed_ms']:.1f} ms + {f['per_chunk_us']:.0f} µs/chunk",
            )
        ax2.plot(
            dense,
            [target["fast_fixed"] + target["fast_per_chunk"] / 1000 * v for v in dense],
            "--",
            color="black",
            lw=1,
            label=f"target: {target['fast_fixed']:g} ms + {target['fast_per_chunk']:g} µs/chunk",
        )
        ax2.set_yscale("log")
        ax2.set_xlim(0, max(xs) * 1.03)
        ax2.set_xlabel("content chunks per streamed answer (c=32, as fast as possible)")
        ax2.set_ylabel("gateway CPU ms per request (log scale)")
        ax2.set_title("Fixed vs per-chunk cost: the chunk-count sweep (dots) and its fit")
        ax2.legend(loc="lower right", fontsize=8)
        ax2.grid(alpha=0.3, which="both")
    else:
        ax2.axis("off")
    fig.suptitle(where, fontsize=8, y=0.995)
    fig.tight_layout()
    p = img_dir / "bench_cpu_per_request.png"
    fig.savefig(p)
    plt.close(fig)
    paths.append(p)

    # ---- Added TTFT and throughput
    fig, axes = plt.subplots(1, 3, figsize=(15, 5), dpi=100)
    for ax, lv, title, tkey in (
        (axes[0], "paced-c32", "paced 50 tok/s, c=32", "paced_c32"),
        (axes[1], "paced-c1", "paced 50 tok/s, c=1", "paced_c1"),
    ):
        if lv not in cells:
            ax.axis("off")
            continue
        present = [s for s in shapes if s in cells[lv]]
        top = 1.0
        for j, shape in enumerate(present):
            c = cells[lv][shape]
            for k, p_ in enumerate(("p50", "p99")):
                v = c[f"added_ttft_{p_}_ms"]
                if v is None:
                    continue
                x = j + (k - 0.5) * 0.38
                top = max(top, v)
                ax.bar(x, v, 0.36, color=_COLORS[shape], alpha=1.0 if p_ == "p50" else 0.55)
                ax.text(x, max(v, 0), f"{p_}\n{v:.1f}", ha="center", va="bottom", fontsize=7)
        for p_ in ("p50", "p99"):
            b = target[f"{tkey}_added_ttft_{p_}"]
            ax.axhline(
                b,
                color="black",
                ls="--" if p_ == "p50" else ":",
                lw=1,
                label=f"target {p_} {b:g} ms",
            )
        ax.axhline(0, color="black", lw=0.6)
        # Symlog: the targets (a few ms) and a saturated gateway (seconds) on one axis.
        ax.set_yscale("symlog", linthresh=1)
        ax.set_ylim(top=max(top, 20) * 6)  # room for the labels and the legend
        ax.set_xticks(range(len(present)), [LABELS[s] for s in present])
        ax.set_ylabel("added TTFT vs direct, ms (symlog)")
        ax.set_title(f"Added time to first chunk: {title}")
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    ax = axes[2]
    tl = [lv for lv in ("paced-c32", "fast-64ch") if lv in cells]
    w = 0.8 / max(1, len(shapes))
    for j, shape in enumerate(shapes):
        for i, lv in enumerate(tl):
            c = cells[lv].get(shape)
            if c is None or c["throughput_pct_of_direct"] is None:
                continue
            x = i - 0.4 + w * (j + 0.5)
            v = c["throughput_pct_of_direct"]
            ax.bar(x, v, w * 0.9, color=_COLORS[shape], label=LABELS[shape] if i == 0 else None)
            ax.text(
                x, v, f"{v:.0f}" if v < 99 else f"{v:.1f}", ha="center", va="bottom", fontsize=8
            )
    ax.axhline(
        target["paced_c32_throughput"],
        color="black",
        ls="--",
        lw=1,
        label=f"target (paced) {target['paced_c32_throughput']:g} %",
    )
    ax.set_xticks(range(len(tl)), ["paced 50 tok/s\nc=32", "as fast as possible\nc=32"][: len(tl)])
    ax.set_ylim(0, 135)
    ax.set_ylabel("requests/s, % of direct")
    ax.set_title("Throughput")
    ax.legend(loc="upper right", fontsize=8, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(where, fontsize=8, y=0.995)
    fig.tight_layout()
    p = img_dir / "bench_latency.png"
    fig.savefig(p)
    plt.close(fig)
    paths.append(p)
    return paths


# --------------------------------------------------------------------------- main


# --------------------------------------------------------------------------- stdout


def _num(v: float | None, nd: int = 1, sign: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:+.{nd}f}" if sign else f"{v:.{nd}f}"


def _cpu_cell(c: dict[str, Any] | None) -> str:
    if c is None:
        return "-"
    parts = c["cpu_ms_per_req"]
    if not parts:
        return "-"
    if len(parts) == 1:
        return _num(c["gateway_cpu_ms_per_req"], 2)
    inner = " + ".join(f"{_num(v, 2)}" for v in parts.values())
    return f"{inner} = {_num(c['gateway_cpu_ms_per_req'], 2)}"


def print_tables(result: dict[str, Any]) -> None:
    cells = result["cells"]
    shapes = result["shapes"]
    head = f"{'':<30}" + "".join(f"{LABELS[s]:>22}" for s in shapes)
    for spec in result["specs"]:
        lv = spec["name"]
        print(f"\n{lv}: c={spec['concurrency']}, {spec['chunks']} chunks, {spec['kind']}")
        print(head)
        rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
            ("requests/s", lambda c: _num(c["req_per_s"])),
            ("throughput, % of direct", lambda c: _num(c["throughput_pct_of_direct"])),
            (
                "TTFT p50 / p99, ms",
                lambda c: f"{_num(c['ttft_ms']['p50'])} / {_num(c['ttft_ms']['p99'])}",
            ),
            (
                "added TTFT p50 / p99, ms",
                lambda c: (
                    f"{_num(c['added_ttft_p50_ms'], sign=True)} / "
                    f"{_num(c['added_ttft_p99_ms'], sign=True)}"
                ),
            ),
            ("gateway CPU ms/request", _cpu_cell),
            ("sim CPU ms/request", lambda c: _num(c["sim_cpu_ms_per_req"], 2)),
            ("client reads/response", lambda c: _num(c["client_reads_per_response"])),
            ("foreign CPU % of a core", lambda c: _num(c["foreign_cpu_pct_of_core"], 0)),
        ]
        for label, fn in rows:
            line = f"{label:<30}"
            for s in shapes:
                c = cells[lv].get(s)
                line += f"{fn(c) if c else '-':>22}"
            print(line)
    for shape, fit in (result.get("sweep_fit") or {}).items():
        txt = ", ".join(
            f"{k} {f['fixed_ms']:.2f} ms + {f['per_chunk_us']:.1f} µs/chunk" for k, f in fit.items()
        )
        print(f"bench: sweep fit {LABELS[shape]}: {txt}")
    print("\ntargets (docs/benchmarks.md), iop up / edge + node:")
    for key, row in result["targets"].items():
        vals = []
        for s in ("up", "split"):
            v = row[s]
            mark = {True: "ok", False: "MISSED", None: "n/a"}[v["met"]]
            vals.append(f"{_num(v['value'], 2)} ({mark})")
        print(f"  {key:<28}{row['bound']:<18}" + "  /  ".join(vals))


# --------------------------------------------------------------------------- docs


def report(r: ReportInput) -> dict[str, str]:
    res = r.median
    cells = res["cells"]
    shapes = [s for s in res["shapes"] if s != "direct"]
    by_name = {s["name"]: s for s in res["specs"]}

    def cell(level: str, shape: str) -> dict[str, Any] | None:
        c: dict[str, Any] | None = cells.get(level, {}).get(shape)
        return c

    def cpu(level: str, shape: str) -> str:
        c = cell(level, shape)
        if not c:
            return DASH
        parts = c["cpu_ms_per_req"]
        total = fmt(c["gateway_cpu_ms_per_req"])
        if len(parts) > 1:
            return " + ".join(fmt(v) for v in parts.values()) + f" = {total}"
        return total

    def added(level: str, shape: str) -> str:
        c = cell(level, shape)
        if not c:
            return DASH
        p50, p99 = c["added_ttft_p50_ms"], c["added_ttft_p99_ms"]
        return f"{fmt(p50, sign=True)} / {fmt(p99, sign=True)}"

    def thr(level: str, shape: str) -> str:
        c = cell(level, shape)
        return fmt(c["throughput_pct_of_direct"]) if c else DASH

    rows: list[list[str]] = []
    for name, spec in by_name.items():
        c = spec["concurrency"]
        if spec["kind"] == "paced":
            what = f"paced c={c}, {spec['chunks']} chunks"
            rows.append([f"{what}: CPU ms per request", *(cpu(name, s) for s in shapes)])
            rows.append([f"{what}: added TTFT p50 / p99, ms", *(added(name, s) for s in shapes)])
            rows.append([f"{what}: throughput, % of direct", *(thr(name, s) for s in shapes)])
        elif spec["kind"] == "fast":
            what = f"fast c={c}, {spec['chunks']} chunk{'s' if spec['chunks'] != 1 else ''}"
            rows.append([f"{what}: CPU ms per request", *(cpu(name, s) for s in shapes)])
        else:
            rows.append(
                [f"non-streaming c={c}: CPU ms per request", *(cpu(name, s) for s in shapes)]
            )
    fits = res.get("sweep_fit") or {}
    if fits:
        fixed, per = [], []
        for s in shapes:
            f = fits.get(s)
            if not f:
                fixed.append(DASH)
                per.append(DASH)
                continue
            procs = [k for k in f if k != "gateway"]
            g = f["gateway"]
            if procs:
                fixed.append(
                    " + ".join(fmt(f[k]["fixed_ms"], 2) for k in procs)
                    + f" = {fmt(g['fixed_ms'], 2)}"
                )
                per.append(
                    " + ".join(fmt(f[k]["per_chunk_us"]) for k in procs)
                    + f" = {fmt(g['per_chunk_us'])}"
                )
            else:
                fixed.append(fmt(g["fixed_ms"], 2))
                per.append(fmt(g["per_chunk_us"]))
        rows.append(["fast: fixed ms per request (fit over the sweep)", *fixed])
        rows.append(["fast: µs per chunk (fit over the sweep)", *per])
    foreign = [
        c.get("foreign_cpu_pct_of_core")
        for by in cells.values()
        for c in by.values()
        if c.get("foreign_cpu_pct_of_core") is not None
    ]
    head = ["figure", *(LABELS[s] for s in shapes)]
    text = table(head, rows)
    if foreign:
        text += (
            f"\n\nForeign CPU per window: {min(foreign):.0f}{DASH}{max(foreign):.0f} % of a core."
        )
    skipped = res.get("skipped") or {}
    if skipped:
        text += (
            " Skipped: "
            + "; ".join(f"{k} ({v.split('(')[0].strip()})" for k, v in skipped.items())
            + "."
        )
    imgs = plot(res, r.img_dir)
    links = "\n\n".join(f"![{p.stem}](img/{p.name})" for p in imgs)
    return {r.scenario: f"{text}\n\n{links}\n\n{r.footer}"}
