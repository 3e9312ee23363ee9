"""What every runner's report uses: numbers as cells, Markdown tables, matplotlib.

A report (``iop.bench._runner.ReportFn``) turns a scenario's median result
into the Markdown between its markers in the docs and the PNGs it links;
these are its pieces, so that every table of docs/benchmarks.md and
docs/research.md writes a missing figure and aligns its columns alike.
"""

from __future__ import annotations

import math
from typing import Any, Final

__all__ = ["DASH", "fmt", "import_matplotlib", "table"]

DASH: Final = "\u2013"  # an en dash: no figure


def fmt(v: Any, nd: int = 1, sign: bool = False) -> str:
    """``v`` with ``nd`` decimals and thousands separators (a sign with
    ``sign``); the dash for None or NaN."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return DASH
    return f"{v:+,.{nd}f}" if sign else f"{v:,.{nd}f}"


def table(head: list[str], rows: list[list[str]], right: int = 1) -> str:
    """A Markdown table; columns from ``right`` on are right-aligned."""
    align = ["---" if i < right else "---:" for i in range(len(head))]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def import_matplotlib() -> Any:
    """matplotlib (a dev dependency, imported only to plot), on the Agg backend."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "bench: plotting needs matplotlib, a dev dependency: "
            "pip install -c constraints.txt -e '.[dev]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    return matplotlib
