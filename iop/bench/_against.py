"""``iop bench run --against REV``: the same scenarios on two versions of IOP, interleaved.

A before/after figure taken on two different days on a shared machine
measures the days as much as the change. ``--against`` runs each scenario
on the other version (*base*) and on this checkout (*head*) in turn, within
one run: repeat 0 runs base then head, repeat 1 head then base, and so on,
so a noisy minute of the box hits both alike.

What differs between the two sides is only the code of the processes under
test. The runners themselves (their clients, the mock backend in the
benchmark's own process, the measurement) are this checkout's; every child
they start (``python -m iop ...``: edge, node, ``iop up``, the sims) gets
``PYTHONPATH`` set to its side's tree and ``PYTHONSAFEPATH=1`` (Python 3.11,
https://docs.python.org/3/using/cmdline.html#envvar-PYTHONSAFEPATH), so
neither the child's working directory nor the editable install can put the
other tree's ``iop`` first. The runners start children with this process's
environment (``iop.testing.Proc``), which is what this module sets around
each run.

``REV`` is a directory holding another checkout of the repo, or a git
revision of this one (a commit, tag or branch): that is checked out with
``git worktree add --detach`` under the run's output directory for the run,
and removed after it.

The comparison (``compare``) lists, for every number both sides' medians
have and differ on, base, head and the change in percent. Both sides'
repeats are in the run's JSON (base under ``NAME@base``); ``iop bench
report`` never writes a base side into the docs.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

__all__ = ["BASE_SUFFIX", "AgainstError", "checkout", "compare", "side_env"]

BASE_SUFFIX: Final = "@base"
"""Appended to a scenario's name for its runs on the base version."""

_GIT_TIMEOUT_S: Final = 120.0


class AgainstError(Exception):
    """``--against`` names nothing that can be run: the message says why."""


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(repo), *args],
        capture_output=True,
        text=True,
        timeout=_GIT_TIMEOUT_S,
        check=False,
    )


@contextmanager
def checkout(spec: str, repo: Path, scratch: Path) -> Iterator[tuple[Path, str]]:
    """The tree of ``spec`` and a label for it (its short commit), for the run.

    Raises:
        AgainstError: ``spec`` is neither a checkout of IOP nor a revision of
            ``repo``, or git cannot check it out.
    """
    given = Path(spec).expanduser()
    if given.is_dir():
        if not (given / "iop" / "__init__.py").is_file():
            raise AgainstError(f"--against {spec}: a directory without iop/__init__.py")
        described = _git(given, "describe", "--always", "--dirty")
        label = described.stdout.strip() if described.returncode == 0 else given.name
        yield given.resolve(), label
        return
    parsed = _git(repo, "rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}")
    if parsed.returncode != 0:
        raise AgainstError(
            f"--against {spec}: neither a directory nor a revision of {repo} "
            "(give a commit, tag or branch, or the path of another checkout)"
        )
    commit = parsed.stdout.strip()
    tree = scratch / f"against-{commit[:12]}"
    added = _git(repo, "worktree", "add", "--detach", str(tree), commit)
    if added.returncode != 0:
        raise AgainstError(f"--against {spec}: git worktree add failed: {added.stderr.strip()}")
    try:
        yield tree, commit[:12]
    finally:
        _git(repo, "worktree", "remove", "--force", str(tree))


@contextmanager
def side_env(tree: Path) -> Iterator[None]:
    """Children started inside import ``iop`` from ``tree``; the environment
    is restored after, also on error."""
    keys = ("PYTHONPATH", "PYTHONSAFEPATH")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ["PYTHONPATH"] = str(tree)
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """Every number in ``tree`` with its path (``a.b[2].c``), in order."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, list):
        names = _cell_names(tree)
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{prefix}[{names[i] if names else i}]")
    elif isinstance(tree, int | float) and not isinstance(tree, bool):
        yield prefix, float(tree)


def _cell_names(cells: list[Any]) -> list[str] | None:
    """Each cell's name from its text fields (``placement=prefix``), when
    every cell is a mapping with one and no two share it: an interleaved run
    may order a scenario's cells differently on each side, so cells are
    matched by name. None: match them by position."""
    names: list[str] = []
    for cell in cells:
        if not isinstance(cell, dict):
            return None
        name = ",".join(f"{k}={v}" for k, v in cell.items() if isinstance(v, str))
        if not name:
            return None
        names.append(name)
    return names if len(set(names)) == len(names) else None


def _change(base: float, head: float) -> str:
    if base == head:
        return "0"
    if base == 0:
        return "n/a"
    return f"{(head - base) / abs(base) * 100:+.1f} %"


def compare(name: str, base: Any, head: Any, base_label: str, head_label: str) -> str:
    """A Markdown table of every number the two medians of scenario ``name``
    share: base, head, change. Numbers only one side has are left out (and
    counted)."""
    b = dict(_leaves(base))
    h = dict(_leaves(head))
    shared = [k for k in h if k in b and b[k] != h[k]]
    same = sum(1 for k in h if k in b and b[k] == h[k])
    lines = [
        f"#### {name}: base `{base_label}` against head `{head_label}` (medians)",
        "",
        "| figure | base | head | change |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [f"| `{k}` | {b[k]:g} | {h[k]:g} | {_change(b[k], h[k])} |" for k in shared]
    only = len(b) + len(h) - 2 * (len(shared) + same)
    if same or only:
        lines += [
            "",
            f"Left out: {same} figure(s) equal on both sides (settings, counts), "
            f"{only} only one side reported.",
        ]
    return "\n".join(lines)
