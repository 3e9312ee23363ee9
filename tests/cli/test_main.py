"""``iop`` itself: what a crashing command leaves on stderr, and what its
parser loads before any command runs."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest

from iop import _secrets
from iop.cli import _run, main


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        yield
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)


@pytest.mark.usefixtures("restore_logging")
def test_a_crash_is_logged_with_its_traceback_and_secrets_masked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = "sk-crash-marker-5e4d3c"
    monkeypatch.setattr(_secrets, "_registered", _secrets.SecretMasker([secret]))

    def crash(_args: object) -> int:
        raise RuntimeError(f"Incorrect API key provided: {secret}")

    monkeypatch.setattr(_run, "_cmd_probe", crash)
    assert main(["probe", "--config", "unused.toml"]) == 1
    err = capsys.readouterr().err
    assert "CRITICAL iop: iop probe crashed" in err
    assert "Traceback" in err
    assert "RuntimeError: Incorrect API key provided: ***" in err
    assert secret not in err


# What only a running server needs: the edge, the node, the sim's server
# and the web stack under them.
SERVERS = ["iop.edge", "iop.node", "iop.sim._server", "quart", "hypercorn"]


def test_the_parser_loads_no_server() -> None:
    """``iop --help``, ``iop keys``, ``iop models`` and the other clients
    build the whole parser: each subcommand imports what it serves with
    only when it runs, so those start in a fraction of a server's import
    (the test suite runs them hundreds of times)."""
    # A fresh interpreter, so nothing else has imported them already.
    code = (
        "import sys; from iop.cli._main import build_parser; build_parser(); "
        f"print(','.join(m for m in {SERVERS!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == ""
