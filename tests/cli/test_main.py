"""``iop`` itself: what a crashing command leaves on stderr."""

from __future__ import annotations

import logging
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
