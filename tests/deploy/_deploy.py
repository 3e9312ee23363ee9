"""What the deployment files of deploy/ are checked against.

``installed_wheel`` is iop as the image and the systemd units install it: a
wheel built from this tree, installed into a fresh virtualenv (the image's
``/opt/iop``), so a path or a command the recipes use must exist there. Its
dependencies come from the running interpreter's site-packages (a ``.pth``
file), not from an index: the wheel's own files are what is checked.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from iop.config import decode_config, read_config_file

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

T = TypeVar("T")

# The prefix the Containerfile and the systemd units install iop into.
PREFIX = "/opt/iop"

# A wheel build (pip, setuptools in an isolated build environment) takes about
# 15 s on an idle machine; a loaded one may take several times that.
WHEEL_BUILD_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class InstalledWheel:
    """iop installed from its wheel into ``venv`` (what ``/opt/iop`` holds)."""

    wheel: Path
    venv: Path

    def env(self) -> dict[str, str]:
        """An environment that imports iop from the wheel only: this tree's
        ``PYTHONPATH`` (tests run the worktree first) is dropped."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PATH"] = f"{self.venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
        return env

    def path(self, in_image: str) -> Path:
        """The file a path under ``/opt/iop`` names in this install."""
        assert in_image.startswith(PREFIX + "/"), in_image
        return self.venv / in_image.removeprefix(PREFIX + "/")


ENV_REF = re.compile(r"\$\{(\w+)\}")


def load(path: Path, type_: type[T], env: dict[str, str] | None = None) -> T:
    """A config of deploy/, its ``${VAR}`` from ``env`` (default: a value for each)."""
    if env is None:
        env = {name: f"deploy-test-{name.lower()}" for name in ENV_REF.findall(path.read_text())}
        env |= {
            "IOP_VALKEY_URL": "",
            "IOP_EDGE_URL": "ws://edge:8080/v1/link",
            "IOP_BACKEND_URL": "http://sim:8000",
        }
    return decode_config(read_config_file(path), type_, source=str(path), env=env)
