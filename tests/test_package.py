"""IOP as a user installs it: the built wheel, in a fresh venv, by its own name.

The name ``iop`` on the Python package index belongs to an unrelated project,
so the distribution is ``iop-platform`` (``pyproject.toml``); the import
package, the ``iop`` command and the ``iop`` pytest plugin keep their names.
The slow test builds the sdist and the wheel once (``python -m build``, the
wheel from the sdist, so the sdist is proved complete), installs the wheel with
its dependencies into a venv that sees nothing of this checkout (pip's cache
and ``constraints.txt`` keep that to seconds), and runs ``iop up --backend sim``
and the testing kit's example suite (``docs/examples/``) from there.
"""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Final

import openai
import pytest

from iop.testing import UP_READY, Proc

ROOT: Final = Path(__file__).resolve().parent.parent
DIST: Final = "iop-platform"
# Read by every doc and hint that tells someone what to install.
SCANNED: Final = ("README.md", "docs", "configs", "iop")
# `pip install iop`, `pip install 'iop[otel]'`, `-e '.[x]'` is fine (a checkout).
WRONG_NAME: Final = re.compile(r"""pip install (?:-\S+ )*['"]?iop(?:\[|['"\s]|$)""", re.MULTILINE)
# A hang guard for a build or an install, not a timing claim.
STEP_TIMEOUT_S: Final = 300


def test_no_doc_or_hint_installs_the_unrelated_iop() -> None:
    wrong: list[str] = []
    for top in SCANNED:
        path = ROOT / top
        files = [path] if path.is_file() else sorted(path.rglob("*"))
        for f in files:
            if f.suffix not in (".md", ".py", ".toml") or "__pycache__" in f.parts:
                continue
            wrong += [
                f"{f.relative_to(ROOT)}: {m.group(0)}" for m in WRONG_NAME.finditer(f.read_text())
            ]
    assert wrong == []
    # The pattern is not blind: it finds the lines this test was written against.
    assert WRONG_NAME.search("pip install iop pytest")
    assert WRONG_NAME.search("pip install 'iop[otel]'")
    assert not WRONG_NAME.search(f"pip install '{DIST}[otel]'")


def test_the_license_file_is_the_one_pyproject_names() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert 'license = "Apache-2.0"' in text
    assert 'license-files = ["LICENSE"]' in text
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License\n")


def run(argv: list[str], cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": ""}
    done = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S
    )
    assert done.returncode == 0, f"{argv}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.fixture(scope="session")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the built wheel (and pytest, for the example suite) installed."""
    base = tmp_path_factory.mktemp("package")
    # A copy of what the sdist is made of: building writes into the source tree.
    src = base / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "iop", src / "iop", ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    dist = base / "dist"
    run([sys.executable, "-m", "build", "--outdir", str(dist), str(src)], base)

    (sdist,) = dist.glob("iop_platform-*.tar.gz")
    (wheel,) = dist.glob("iop_platform-*-py3-none-any.whl")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"LICENSE", "pyproject.toml", "iop/cli/__init__.py"} <= names
    with zipfile.ZipFile(wheel) as whl:
        info = f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"
        meta = email.message_from_bytes(whl.read(f"{info}/METADATA"))
        assert (meta["Name"], meta["License-Expression"]) == (DIST, "Apache-2.0")
        assert whl.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        entry_points = whl.read(f"{info}/entry_points.txt").decode()
        assert "iop = iop.cli:main" in entry_points
        assert "iop = iop.testing._plugin" in entry_points
        assert any(n.startswith("iop/testing/transcripts/") for n in whl.namelist())

    env_dir = base / "venv"
    run([sys.executable, "-m", "venv", str(env_dir)], base)
    pip = [str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q"]
    run([*pip, "-c", str(ROOT / "constraints.txt"), str(wheel), "pytest"], base)
    return env_dir


@pytest.mark.slow
def test_the_wheel_runs_iop_up_and_serves(venv: Path, tmp_path: Path) -> None:
    python = str(venv / "bin" / "python")
    where = run([python, "-c", "import iop; print(iop.__file__)"], tmp_path)
    assert where.startswith(str(venv)), where
    shown = run([python, "-m", "pip", "show", DIST], tmp_path)
    assert f"Name: {DIST}\n" in shown, shown
    proc = Proc(
        "iop-up",
        [],
        tmp_path,
        argv=[str(venv / "bin" / "iop"), "up", "--backend", "sim", "--port", "0"],
        env={"PYTHONPATH": ""},
    )
    try:
        url = proc.wait_stdout(UP_READY).group(1)
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30) as c:
            model = c.models.list().data[0].id
            reply = c.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8
            )
        assert reply.choices[0].message.content, reply
    finally:
        rc = proc.stop()
    assert rc == 0, proc.logs()


@pytest.mark.slow
def test_the_wheel_runs_the_testing_kits_example_suite(venv: Path, tmp_path: Path) -> None:
    # A user's project: their test file, nothing of this checkout.
    shutil.copy(ROOT / "docs" / "examples" / "test_with_iop.py", tmp_path)
    python = str(venv / "bin" / "python")
    out = run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_with_iop.py"], tmp_path
    )
    assert re.search(r"\b7 passed\b", out), out


# A config that needs an extra the wheel was installed without: one line, exit 2.
NEEDS_EXTRA: Final = [
    ("up", "[edge.tracing]\notlp_endpoint = 'http://127.0.0.1:4318/v1/traces'\n", "otel"),
    ("up", "[edge.cluster]\nvalkey_url = 'redis://127.0.0.1:6379'\n", "cluster"),
    ("edge", "[tracing]\notlp_endpoint = 'http://127.0.0.1:4318/v1/traces'\n", "otel"),
    ("edge", "[cluster]\nvalkey_url = 'redis://127.0.0.1:6379'\n", "cluster"),
    (
        "up",
        "[[instances]]\nadapter = 'vllm'\nname = 'q'\nendpoint = 'http://127.0.0.1:8000'\n"
        "kv_events_endpoint = 'tcp://127.0.0.1:5557'\n",
        "kvevents",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("command", "config", "extra"),
    NEEDS_EXTRA,
    ids=["up-otel", "up-cluster", "edge-otel", "edge-cluster", "up-kvevents"],
)
def test_a_config_that_needs_a_missing_extra_is_one_line(
    venv: Path, tmp_path: Path, command: str, config: str, extra: str
) -> None:
    (tmp_path / "c.toml").write_text(config)
    argv = [str(venv / "bin" / "iop"), command, "--port", "0", "--config", "c.toml"]
    argv += ["--backend", "sim"] if command == "up" else ["--node-token", "t"]
    done = subprocess.run(
        argv,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ""},
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
    )
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("iop: config error: "), line
    assert line.endswith(f"pip install '{DIST}[{extra}]'"), line
