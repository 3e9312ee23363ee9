"""``iop bench run --against``: the other version's children import the other tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from iop.bench._against import AgainstError, checkout, compare, side_env

REPO = Path(__file__).resolve().parent.parent


def _which_iop(cwd: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-c", "import iop; print(iop.__file__)"],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return out.stdout.strip()


def test_a_child_started_inside_side_env_imports_that_tree_even_from_this_checkout(
    tmp_path: Path,
) -> None:
    other = tmp_path / "other"
    (other / "iop").mkdir(parents=True)
    (other / "iop" / "__init__.py").write_text("")
    before = os.environ.get("PYTHONPATH")
    with side_env(other):
        # The working directory is this checkout: without PYTHONSAFEPATH its
        # iop would come first.
        assert _which_iop(REPO) == str(other / "iop" / "__init__.py")
    assert os.environ.get("PYTHONPATH") == before
    assert _which_iop(REPO).startswith(str(REPO))


def _repo(tmp_path: Path) -> tuple[Path, str]:
    repo = tmp_path / "repo"
    (repo / "iop").mkdir(parents=True)
    (repo / "iop" / "__init__.py").write_text("VERSION = 1\n")

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    first = git("rev-parse", "HEAD")
    (repo / "iop" / "__init__.py").write_text("VERSION = 2\n")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two")
    return repo, first


def test_a_revision_is_checked_out_for_the_run_and_removed_after(tmp_path: Path) -> None:
    repo, first = _repo(tmp_path)
    scratch = tmp_path / "out"
    scratch.mkdir()
    with checkout(first, repo, scratch) as (tree, label):
        assert label == first[:12]
        assert (tree / "iop" / "__init__.py").read_text() == "VERSION = 1\n"
    assert not tree.exists()
    assert (repo / "iop" / "__init__.py").read_text() == "VERSION = 2\n"


def test_what_cannot_be_run_is_one_clear_error(tmp_path: Path) -> None:
    repo, _ = _repo(tmp_path)
    with (
        pytest.raises(AgainstError, match="neither a directory nor a revision"),
        checkout("no-such-rev", repo, tmp_path),
    ):
        pass
    (tmp_path / "empty").mkdir()
    with (
        pytest.raises(AgainstError, match=r"without iop/__init__\.py"),
        checkout(str(tmp_path / "empty"), repo, tmp_path),
    ):
        pass


def test_compare_lists_what_changed_and_counts_the_rest() -> None:
    base = {"cpu_ms": 10.0, "levels": [{"p99": 4.0}], "trials": 20, "old": 1}
    head = {"cpu_ms": 8.0, "levels": [{"p99": 4.0}], "trials": 20, "new": 2}
    table = compare("platform", base, head, "aaa", "bbb")
    assert "| `cpu_ms` | 10 | 8 | -20.0 % |" in table
    assert "`levels[0].p99`" not in table
    assert "2 figure(s) equal on both sides" in table
    assert "2 only one side reported" in table


def test_compare_matches_cells_by_what_names_them_not_by_their_order() -> None:
    """An interleaved run can order a scenario's cells differently on each
    side: a list of cells is matched by their names (their text fields),
    so prefix is compared with prefix, not with least-loaded."""
    base = {
        "cells": [{"placement": "least_loaded", "p90": 400.0}, {"placement": "prefix", "p90": 80.0}]
    }
    head = {
        "cells": [{"placement": "prefix", "p90": 60.0}, {"placement": "least_loaded", "p90": 390.0}]
    }
    table = compare("routing", base, head, "aaa", "bbb")
    assert "| `cells[placement=prefix].p90` | 80 | 60 | -25.0 % |" in table
    assert "| `cells[placement=least_loaded].p90` | 400 | 390 | -2.5 % |" in table


def test_compare_falls_back_to_positions_when_cells_have_no_unique_names() -> None:
    base = {"cells": [{"kind": "x", "n": 1.0}, {"kind": "x", "n": 2.0}]}
    head = {"cells": [{"kind": "x", "n": 1.5}, {"kind": "x", "n": 2.0}]}
    assert "| `cells[0].n` | 1 | 1.5 | +50.0 % |" in compare("s", base, head, "a", "b")


def test_run_against_a_revision_runs_both_sides_interleaved(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "iop",
            "bench",
            "run",
            "configs/bench/cancel.toml",
            "--smoke",
            "--repeat",
            "2",
            "--against",
            "HEAD",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    order = [
        line.split("] ")[1].split(" (")[0]
        for line in proc.stdout.splitlines()
        if line.startswith("iop bench: [")
    ]
    assert order == ["cancel@base", "cancel", "cancel", "cancel@base"]
    doc = json.loads(next(out.glob("bench-*.json")).read_text())
    assert len(doc["scenarios"]["cancel@base"]["repeats"]) == 2
    assert doc["against"]["commit"]
    assert "#### cancel: base" in proc.stdout
    assert not list(out.glob("against-*")), "the checkout outlives the run"
