"""The fixture of tests/deploy: this tree's wheel, installed (tests/deploy/_deploy.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.deploy._deploy import ROOT, WHEEL_BUILD_TIMEOUT_S, InstalledWheel


@pytest.fixture(scope="session")
def installed_wheel(tmp_path_factory: pytest.TempPathFactory) -> InstalledWheel:
    """A wheel of this tree (or ``IOP_WHEEL``), installed into a new virtualenv."""
    base = tmp_path_factory.mktemp("wheel")
    given = os.environ.get("IOP_WHEEL")
    if given:
        wheel = Path(given)
    else:
        # Built from a copy: setuptools writes build/ and *.egg-info next to
        # the sources it builds.
        src = base / "src"
        src.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(ROOT / name, src / name)
        shutil.copytree(ROOT / "iop", src / "iop", ignore=shutil.ignore_patterns("__pycache__"))
        out = base / "dist"
        built = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
            capture_output=True,
            text=True,
            timeout=WHEEL_BUILD_TIMEOUT_S,
            check=False,
        )
        if built.returncode != 0:
            pytest.skip(
                "no wheel of iop could be built here (pip needs setuptools and wheel "
                f"from an index; or set IOP_WHEEL): {built.stderr.strip()[-400:]}"
            )
        (wheel,) = out.glob("*.whl")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            # pip runs in the new venv with its own site-packages (this
            # interpreter's) on the path, where an editable iop may be.
            "--ignore-installed",
            str(wheel),
        ],
        check=True,
        timeout=WHEEL_BUILD_TIMEOUT_S,
    )
    # The dependencies: this interpreter's (a .pth line adds a directory but
    # runs none of its .pth files, so an editable iop there stays out).
    (purelib,) = (venv / "lib").glob("python3*/site-packages")
    (purelib / "_iop_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return InstalledWheel(wheel=wheel, venv=venv)
