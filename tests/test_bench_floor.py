"""``scripts/bench_floor.py`` runs, and reports every operation it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_floor.py"


def test_the_floor_benchmark_measures_every_operation(tmp_path: Path) -> None:
    out = tmp_path / "floor.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--n", "50", "--repeat", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(out.read_text())
    names = set(result["us_per_op"])
    assert names == {
        "socket round trip",
        "socket send (writable)",
        "socket receive (ready)",
        "task hop",
        "cancel scope",
        "h11 chunk",
        "h11 chunk read",
        "chat chunk parse",
        "wsproto frame",
        "msgspec batch",
    }
    assert all(v > 0 for v in result["us_per_op"].values())
    assert all(name in done.stdout for name in names)
