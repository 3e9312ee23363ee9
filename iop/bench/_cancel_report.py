"""The cancel measurement's results as text: its stdout table, the docs' table and plot.

``print_cancel`` is what ``scripts/bench_stress.py`` prints; ``report`` what
``iop bench report`` writes between the ``cancel`` (and
``research-cancel``) scenarios' markers, with ``bench_SCENARIO.png`` when
LiteLLM was measured beside IOP (``iop/bench/_cancel.py`` measures).
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

from iop.bench._report import DASH, fmt, import_matplotlib, table
from iop.bench._runner import ReportInput

__all__ = ["print_cancel", "report"]


def print_cancel(res: dict[str, Any]) -> None:
    print(f"\ncancel: client closes -> backend sees EOF, ms ({res['settings']['trials']} trials)")
    print(f"{'window':<20}{'n':>4}{'p50':>8}{'p99':>8}{'max':>8}  errors")
    for window, w in res["windows"].items():
        m = w["ms"]
        extra = dict(w["errors"])
        if window == "queued":
            extra["leaked"] = len(w["leaked_to_backend"])
        print(
            f"{window:<20}{m['n']:>4}{m.get('p50', math.nan):>8.1f}{m.get('p99', math.nan):>8.1f}"
            f"{m.get('max', math.nan):>8.1f}  {extra or ''}"
        )
    print(f"edge outcomes: {res['edge_outcomes']}")
    q = res["windows"].get("queued")
    if q is not None and q.get("poll_ms", {}).get("n"):
        print(
            "queued: the edge's own dequeue time (/admin/nodes queue.last_exit); "
            f"the first poll that saw it: p50 {q['poll_ms']['p50']:.1f}, "
            f"p99 {q['poll_ms']['p99']:.1f} ms"
        )


# --------------------------------------------------------------------------- docs


def _ms_cell(w: dict[str, Any] | None) -> list[str]:
    if not w:
        return [DASH, DASH, DASH]
    m = w["ms"]
    return [fmt(m.get("p50")), fmt(m.get("p99")), fmt(m.get("max"))]


def report(r: ReportInput) -> dict[str, str]:
    res = r.median
    lite = res.get("litellm")
    first = r.repeats[0] if r.repeats else res
    n = res["settings"]["trials"]
    head = ["window", "IOP p50 ms", "p99 ms", "max ms"]
    if lite:
        head += ["LiteLLM p50 ms", "p99 ms", "LiteLLM never closed"]
    rows = []
    for window, w in res["windows"].items():
        row = [window, *_ms_cell(w)]
        if lite:
            lw = lite["windows"].get(window)
            if lw is None:
                row += ["n/a (no queue)", "", ""]
            else:
                never = sum(
                    v
                    for rep in r.repeats
                    for k, v in rep["litellm"]["windows"][window]["errors"].items()
                    if k.startswith("no EOF")
                )
                total = sum(
                    len(rep["litellm"]["windows"][window]["samples_ms"]) for rep in r.repeats
                )
                p50, p99 = (lw["ms"].get("p50"), lw["ms"].get("p99"))
                row += [fmt(p50), fmt(p99), f"{never} of {total}"]
        rows.append(row)
    leaked = len(first["windows"].get("queued", {}).get("leaked_to_backend", []))
    text = table(head, rows)
    text += (
        f"\n\nIOP: {n} trials per window (median of the repeats' percentiles); the client's "
        f"close → the backend's EOF (queued: → the edge's dequeue); queued runs that reached "
        f"the backend: {leaked}."
    )
    if lite:
        text += (
            f" LiteLLM {res.get('litellm_version') or '?'}: {lite['trials']} trials per window "
            f"and repeat, a trial waits {lite['eof_wait_s']:g} s for the backend's EOF "
            f'("never closed": it did not come); cancel_on_disconnect '
            f"{'on' if lite['cancel_on_disconnect'] else 'off (its default)'}."
        )
        imgs = _cancel_plot(r)
        text += "\n\n" + "\n\n".join(f"![{p.stem}](img/{p.name})" for p in imgs)
    return {r.scenario: f"{text}\n\n{r.footer}"}


def _cancel_plot(r: ReportInput) -> list[Path]:
    import_matplotlib()
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    res = r.median
    lite = res["litellm"]
    windows = list(res["windows"])
    wait_ms = 1000 * lite["eof_wait_s"]
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(windows))
    iop = [res["windows"][w]["ms"].get("p50") or 0 for w in windows]
    ax.bar([x - 0.2 for x in xs], iop, 0.4, color="#4C72B0")
    for x, w in zip(xs, windows, strict=True):
        lw = lite["windows"].get(w)
        if lw is None:
            ax.text(x + 0.2, 1, "no queue", rotation=90, ha="center", va="bottom", fontsize=8)
        elif lw["ms"].get("p50") is None:
            ax.bar(x + 0.2, wait_ms, 0.4, color="none", edgecolor="#C44E52", hatch="//")
            label = f"none in {lite['eof_wait_s']:g} s"
            ax.text(x + 0.2, wait_ms, label, ha="center", va="bottom", fontsize=8)
        else:
            ax.bar(x + 0.2, lw["ms"]["p50"], 0.4, color="#C44E52")
    ax.set_yscale("log")
    ax.set_xticks(list(xs), windows, fontsize=8)
    ax.set_ylabel("client close → backend EOF, p50 ms (log)")
    ax.set_title("Cancellation latency by window", fontsize=10)
    handles = [
        Patch(color="#4C72B0", label="IOP (edge + node)"),
        Patch(color="#C44E52", label=f"LiteLLM {res.get('litellm_version') or ''}".strip()),
        Patch(facecolor="none", edgecolor="#C44E52", hatch="//", label="LiteLLM: no EOF came"),
    ]
    ax.legend(handles=handles, fontsize=8, loc="upper left")
    fig.text(0.01, 0.01, textwrap.fill(r.footer.strip("_").replace("`", ""), 160), fontsize=6)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    r.img_dir.mkdir(parents=True, exist_ok=True)
    out = r.img_dir / f"bench_{r.scenario}.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [out]
