"""Fixtures of the agent tests: the real Codex CLI and Claude Code binaries.

``codex_bin`` and ``claude_bin`` (session) install the pinned agent into the
cache on first use (``tests/agents/_agents.py``: pip for Codex, npm for
Claude Code) and return its binary. When an agent cannot be installed or run
here the tests that need it skip with the reason, except under
``IOP_REQUIRE_AGENTS=1`` (CI, ``.ci/run``), where they fail. ``workdir`` is
an empty directory for the agent to work in.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.agents._agents import AgentUnavailable, claude_binary, codex_binary


def _agent(locate: Callable[[], Path], what: str) -> Path:
    try:
        return locate()
    except AgentUnavailable as exc:
        if os.environ.get("IOP_REQUIRE_AGENTS") == "1":
            pytest.fail(f"IOP_REQUIRE_AGENTS=1 but {what} cannot run: {exc}", pytrace=False)
        pytest.skip(f"{what} is not available: {exc}")


@pytest.fixture(scope="session")
def codex_bin() -> Path:
    """The pinned Codex CLI binary (installed from PyPI into the cache if missing)."""
    return _agent(codex_binary, "Codex CLI")


@pytest.fixture(scope="session")
def claude_bin() -> Path:
    """The pinned Claude Code binary (installed from npm into the cache if missing)."""
    return _agent(claude_binary, "Claude Code")


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path
