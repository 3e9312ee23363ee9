"""Scenario files: ``configs/bench/NAME.toml``, one measurement each.

::

    runner = "cancel"                 # a registered runner (`iop bench list`)
    description = "..."               # one line, shown by `iop bench list`
    requires_litellm = false          # true: skipped (with a message) without --litellm

    [args]                            # the runner's Options fields; omitted = default
    trials = 20

Loading checks the file against the runner: an unknown runner is an error
listing the known ones, an unknown key in ``[args]`` names the key and the
runner's valid keys, a value of the wrong type names its key.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from iop.bench._runner import RUNNERS, Runner

__all__ = ["Scenario", "ScenarioError", "load_scenario"]


class ScenarioError(Exception):
    """A scenario file that cannot be run as written (the message says why and where)."""


class _File(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    runner: str
    description: str = ""
    requires_litellm: bool = False
    args: dict[str, Any] = msgspec.field(default_factory=dict)


@dataclass(frozen=True)
class Scenario:
    """A loaded scenario: its name (the file's stem), runner and typed options."""

    name: str
    path: Path
    runner: Runner[Any]
    description: str
    requires_litellm: bool
    args: dict[str, Any]  # as written in the file
    options: msgspec.Struct


_AT = re.compile(r" - at `\$\.?([^`]*)`$")


def _where(exc: msgspec.ValidationError) -> tuple[str, str]:
    """(the key path msgspec names, its message without it)."""
    msg = str(exc)
    m = _AT.search(msg)
    return (m[1], msg[: m.start()]) if m else ("", msg)


def load_scenario(path: Path) -> Scenario:
    """Read and check one scenario file.

    Raises:
        ScenarioError: the file is not TOML, has an unknown top-level key,
            names an unknown runner, or an ``[args]`` key the runner does not
            have or of the wrong type.
    """
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ScenarioError(f"{path}: {exc}") from exc
    try:
        f = msgspec.convert(raw, _File)
    except msgspec.ValidationError as exc:
        key, msg = _where(exc)
        raise ScenarioError(f"{path}: {key or 'top level'}: {msg}") from exc
    runner = RUNNERS.get(f.runner)
    if runner is None:
        known = ", ".join(sorted(RUNNERS)) or "(none registered)"
        raise ScenarioError(f"{path}: unknown runner {f.runner!r}; known runners: {known}")
    fields = runner.options.__struct_fields__
    for key in f.args:
        if key not in fields:
            raise ScenarioError(
                f"{path}: [args] {key!r} is not an option of runner {f.runner!r}; "
                f"its options: {', '.join(fields)}"
            )
    try:
        options = msgspec.convert(f.args, runner.options)
    except msgspec.ValidationError as exc:
        key, msg = _where(exc)
        raise ScenarioError(f"{path}: [args] {key}: {msg}") from exc
    return Scenario(
        name=path.stem,
        path=path,
        runner=runner,
        description=f.description,
        requires_litellm=f.requires_litellm,
        args=f.args,
        options=options,
    )
