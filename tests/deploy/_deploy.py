"""What the deployment files of deploy/ are checked against.

``installed_wheel`` is iop as the image and the systemd units install it: a
wheel built from this tree, installed into a fresh virtualenv (the image's
``/opt/iop``), so a path or a command the recipes use must exist there. Its
dependencies come from the running interpreter's site-packages (a ``.pth``
file), not from an index: the wheel's own files are what is checked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

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
