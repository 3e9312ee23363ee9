"""The pytest plugin as a user meets it: a test file run by pytest in a fresh process.

The file is docs/examples/test_with_iop.py, the one docs/testing-kit.md shows
(``test_the_docs_show_the_file_that_runs`` keeps them equal), next to a file
of tests that must fail, to read their messages. pytest loads the plugin the
way it does for a user: through the ``pytest11`` entry point, never ``-p``.
A checkout installed before the entry point was declared (an editable
install's metadata is written at install time) gets that same entry point
from a distribution shim built from pyproject.toml, so what is tested is the
declared entry point either way.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "test_with_iop.py"
DOC = ROOT / "docs" / "testing-kit.md"
PLUGIN = ROOT / "iop" / "testing" / "_plugin.py"

# Tests that must fail, with the message each must show.
MUST_FAIL = """
from iop.testing import Fault


def test_a_stream_the_client_cut_has_no_terminal(iop_platform):
    iop_platform.replay(fault=Fault.stall(after_chunks=6))
    stream = iop_platform.stream_chat(hang_up_after=2)
    iop_platform.assert_one_terminal(stream)


def test_a_truncated_stream_did_not_finish(iop_platform):
    iop_platform.replay(fault=Fault.truncate(after_chunks=3))
    stream = iop_platform.stream_chat()
    iop_platform.assert_one_terminal(stream, kind="finish")
"""
MESSAGES = {
    "test_a_stream_the_client_cut_has_no_terminal": (
        "expected exactly one terminal event (a finish_reason or an error), found 0: none"
    ),
    "test_a_truncated_stream_did_not_finish": "expected a terminal 'finish', the run ended with error=",
}


def _declared_entry_point() -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    value: str = project["entry-points"]["pytest11"]["iop"]
    return value


@pytest.fixture
def as_installed(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """``pytester`` whose child processes see the ``iop`` plugin's entry point."""
    # This checkout's iop first, whatever else is installed.
    path = [str(ROOT)]
    if not importlib.metadata.entry_points(group="pytest11", name="iop"):
        site = pytester.mkdir("site")
        info = site / "iop_entry_point_shim-0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: iop-entry-point-shim\nVersion: 0\n"
        )
        (info / "entry_points.txt").write_text(f"[pytest11]\niop = {_declared_entry_point()}\n")
        path.append(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")]))
    return pytester


def test_the_entry_point_names_the_plugin_module() -> None:
    assert _declared_entry_point() == "iop.testing._plugin"


def test_the_documented_file_passes_and_failures_read_clearly(
    as_installed: pytest.Pytester,
) -> None:
    as_installed.makepyfile(test_with_iop=EXAMPLE.read_text(), test_must_fail=MUST_FAIL)
    result = as_installed.runpytest_subprocess(
        "-v", "-W", "error", "--strict-markers", "-p", "no:cacheprovider", "--iop-log-lines", "5"
    )
    out = result.stdout.str()
    documented = re.findall(r"^def (test_\w+)", EXAMPLE.read_text(), re.M)
    for name in documented:
        assert re.search(rf"test_with_iop\.py::{name} PASSED", out), f"{name} did not pass:\n{out}"
    for name, message in MESSAGES.items():
        assert re.search(rf"test_must_fail\.py::{name} FAILED", out), out
        assert message in out, f"{name}: no {message!r} in the report"
    # The processes' logs are in a failed test's report.
    assert re.search(r"iop edge \(pid \d+\)", out)
    result.assert_outcomes(passed=len(documented), failed=len(MESSAGES))


def test_no_iop_turns_the_plugin_off(as_installed: pytest.Pytester) -> None:
    as_installed.makepyfile("def test_x(iop_platform):\n    pass\n")
    result = as_installed.runpytest_subprocess("-p", "no:iop", "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'iop_platform' not found*"])


def test_the_plugin_registers_its_marker_and_option(pytester: pytest.Pytester) -> None:
    # In process, loaded by name: the entry point is the other tests' business.
    config = pytester.parseconfigure("-p", "iop.testing._plugin", "--iop-log-lines", "7")
    assert config.getoption("--iop-log-lines") == 7
    markers = config.getini("markers")
    assert any(m.startswith("iop_platform(**options):") for m in markers), markers


def test_the_docs_show_the_file_that_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert EXAMPLE.read_text() in blocks, (
        "docs/testing-kit.md must show docs/examples/test_with_iop.py whole"
    )


def _fixture_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if ast.unparse(target) == "pytest.fixture":
                    names.add(node.name)
    return names


def test_the_plugin_fixtures_do_not_shadow_the_suites() -> None:
    ours = _fixture_names(PLUGIN)
    assert ours == {"iop_platform", "iop_platform_factory", "iop_virtual"}
    theirs: set[str] = set()
    for conftest in (ROOT / "tests").rglob("conftest.py"):
        theirs |= _fixture_names(conftest)
    assert not ours & theirs


def test_iop_runs_without_pytest() -> None:
    """The plugin is the only module that imports pytest, and iop does not depend on it."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if d.startswith("pytest")]
    code = (
        "import sys, iop.testing, iop.edge, iop.node, iop.cli; "
        "from iop.testing import Fault, start_platform, open_virtual_platform; "
        "print('pytest' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "False"


VIRTUAL_ONLY = """
from iop.testing import Fault


def test_a_virtual_run(iop_virtual):
    async def scenario(platform):
        platform.replay(fault=Fault.truncate(after_chunks=3))
        stream = await platform.stream_chat()
        return await platform.assert_one_terminal(stream)

    assert iop_virtual.run(scenario).startswith("error=")


def test_a_failing_virtual_run(iop_virtual):
    async def scenario(platform):
        stream = await platform.stream_chat(hang_up_after=1)
        await platform.assert_one_terminal(stream)

    iop_virtual.run(scenario)
"""


def test_the_virtual_fixture_in_this_process(pytester: pytest.Pytester) -> None:
    """In process too (where coverage sees the plugin), with no process started."""
    pytester.makepyfile(test_virtual=VIRTUAL_ONLY)
    loaded = importlib.metadata.entry_points(group="pytest11", name="iop")
    args = [] if loaded else ["-p", "iop.testing._plugin"]
    result = pytester.runpytest_inprocess(*args, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*expected exactly one terminal event*found 0: none*"])
