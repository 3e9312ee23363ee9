"""Fixtures of the agent tests: the real Codex CLI and Claude Code binaries.

``codex_bin`` and ``claude_bin`` (session) install the pinned agent into the
cache on first use (``tests/agents/_agents.py``: pip for Codex, npm for
Claude Code) and return its binary. When an agent cannot be installed or run
here the tests that need it skip with the reason, except under
``IOP_REQUIRE_AGENTS=1`` (CI, ``.ci/run``), where they fail. ``workdir`` is
an empty directory for the agent to work in. Tests elsewhere (tests/e2e)
get the same fixtures from ``tests.agents._agents.agent_or_skip``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.agents._agents import agent_or_skip, claude_binary, codex_binary


@pytest.fixture(scope="session")
def codex_bin() -> Path:
    """The pinned Codex CLI binary (installed from PyPI into the cache if missing)."""
    return agent_or_skip(codex_binary, "Codex CLI")


@pytest.fixture(scope="session")
def claude_bin() -> Path:
    """The pinned Claude Code binary (installed from npm into the cache if missing)."""
    return agent_or_skip(claude_binary, "Claude Code")


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path
