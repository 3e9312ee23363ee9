"""The real coding agents, installed into a cache and run headless (helpers, no fixtures).

* **Codex CLI** comes from PyPI (``openai-codex-cli-bin``: the wheel carries the
  native ``codex`` binary), installed with ``pip install --target`` into
  ``<cache>/codex-<version>``; ``run_codex`` runs ``codex exec`` with a custom
  model provider (``wire_api = "responses"``) whose ``base_url`` is the server
  under test.
* **Claude Code** comes from npm (``@anthropic-ai/claude-code``: its postinstall
  puts the native binary at ``bin/claude.exe``), installed with ``npm install
  --prefix`` into ``<cache>/claude-<version>``; ``run_claude`` runs ``claude -p``
  with ``ANTHROPIC_BASE_URL`` at the server under test.

The versions are pinned (``CODEX_VERSION``, ``CLAUDE_VERSION``): the captures in
``tests/data/agents`` and the tests' assertions are about exactly these. The
cache is ``$IOP_AGENTS_DIR`` or ``~/.cache/iop/agents``; an install goes to a
scratch directory first and is renamed into place, under a file lock, so a
half-finished install is never used. A fresh install takes about 40 s (codex)
and 10 s (claude) with warm registry caches.

Each run gets a throwaway ``HOME`` (and ``CODEX_HOME`` / ``CLAUDE_CONFIG_DIR``)
and an environment built from nothing but ``PATH`` and ``LANG``, so nothing of
the developer's own configuration or keys leaks in. Both agents are pointed
only at loopback: the model API is ``base_url``; every proxy variable points
at ``proxy`` (by default a closed loopback port, so any other connection fails
at once; the stub tests point it at the stub, which records the attempt as a
``CONNECT``) with ``NO_PROXY`` for loopback; and the agents' own update
checks, telemetry, plugin sync and other background traffic are switched off
(``CODEX_CONFIG``, ``CLAUDE_QUIET_ENV``; tests/data/agents/README.md says what
each one stops).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest

__all__ = [
    "API_KEY",
    "CLAUDE_ALLOWED_TOOLS",
    "CLAUDE_QUIET_ENV",
    "CLAUDE_VERSION",
    "CODEX_VERSION",
    "PATCH_PROMPT",
    "PLAIN_PROMPT",
    "TOOL_PROMPT",
    "AgentResult",
    "AgentUnavailable",
    "agent_or_skip",
    "claude_binary",
    "claude_command",
    "codex_binary",
    "codex_command",
    "codex_config",
    "codex_model_catalog",
    "run_claude",
    "run_codex",
]

CODEX_VERSION: Final = "0.163.0"
CLAUDE_VERSION: Final = "2.1.197"
CODEX_PACKAGE: Final = f"openai-codex-cli-bin=={CODEX_VERSION}"
CLAUDE_PACKAGE: Final = f"@anthropic-ai/claude-code@{CLAUDE_VERSION}"
NPM_FLAGS: Final = ("--no-audit", "--no-fund", "--no-save", "--loglevel=error")
# A registry install on a loaded 2-core machine (measured: ~40 s codex, ~10 s claude).
INSTALL_TIMEOUT_S: Final = 600.0
# One agent run against a local server answering at once: a turn takes 0.3-3 s.
RUN_TIMEOUT_S: Final = 60.0
# The key the agents send; servers under test accept it (or ignore auth).
API_KEY: Final = "sk-iop-agent-test"
# Nothing listens on the discard port here: a connection an agent tries to
# make beyond loopback through the proxy is refused at once.
DEAD_PROXY: Final = "http://127.0.0.1:9"
NO_PROXY: Final = "127.0.0.1,localhost,::1"
# The prompts of the captures and tests: a plain turn, and one that makes the
# (stub) model ask for a shell command.
PLAIN_PROMPT: Final = "Say hello."
TOOL_PROMPT: Final = "Run the shell command `echo iop-tool-ok` and tell me what it printed."
PATCH_PROMPT: Final = "Create the file iop-patch.txt with apply_patch."

# Claude Code: no telemetry, error reports, auto-update, feedback survey or
# other "non-essential" calls (which include the extra title-generation
# request it makes to the model API on the first turn).
CLAUDE_QUIET_ENV: Final[Mapping[str, str]] = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
}


class AgentUnavailable(Exception):
    """The agent cannot be installed or run here; the message says why."""


@dataclass(frozen=True)
class AgentResult:
    returncode: int
    stdout: str
    stderr: str
    command: tuple[str, ...]
    # The environment the agent ran with, keys masked.
    env: Mapping[str, str]
    # Codex: the config.toml it ran with.
    config: str = ""


# ---------------------------------------------------------------- install


def cache_dir() -> Path:
    root = os.environ.get("IOP_AGENTS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "iop" / "agents"


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _install(final: Path, run_install: Sequence[str], what: str) -> None:
    """Run ``run_install`` (with ``{dest}`` for a scratch dir) and rename it to ``final``."""
    scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        command = [arg.replace("{dest}", str(scratch)) for arg in run_install]
        try:
            done = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=INSTALL_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise AgentUnavailable(f"installing {what} failed: {exc}") from exc
        if done.returncode != 0:
            # npm puts the cause first (code, then the message), pip last.
            lines = (done.stderr or done.stdout).strip().splitlines()
            said = lines if len(lines) <= 6 else [*lines[:4], "...", *lines[-2:]]
            raise AgentUnavailable(
                f"installing {what} failed (exit {done.returncode}): " + " | ".join(said)
            )
        scratch.rename(final)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _check_version(binary: Path, want: str, what: str) -> None:
    try:
        done = subprocess.run(
            [str(binary), "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tempfile.gettempdir()},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AgentUnavailable(f"{what} at {binary} does not run: {exc}") from exc
    if want not in done.stdout:
        raise AgentUnavailable(
            f"{what} at {binary} says {done.stdout.strip()!r}, not version {want}"
        )


def codex_binary() -> Path:
    """The pinned ``codex`` binary, installed from PyPI into the cache if missing."""
    root = cache_dir()
    final = root / f"codex-{CODEX_VERSION}"
    binary = final / "codex_cli_bin" / "bin" / "codex"
    with _locked(root):
        if not binary.exists():
            pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
            _install(
                final,
                [*pip, "install", "-q", "--no-deps", "--target", "{dest}", CODEX_PACKAGE],
                f"Codex CLI ({CODEX_PACKAGE}, pip)",
            )
    _check_version(binary, CODEX_VERSION, "codex")
    return binary


def claude_binary() -> Path:
    """The pinned ``claude`` binary, installed from npm into the cache if missing."""
    root = cache_dir()
    final = root / f"claude-{CLAUDE_VERSION}"
    modules = final / "node_modules" / "@anthropic-ai"
    with _locked(root):
        if not (modules / "claude-code").exists():
            npm = shutil.which("npm")
            if npm is None:
                raise AgentUnavailable("npm is not installed (apt-get install npm)")
            _install(
                final,
                [npm, "install", "--prefix", "{dest}", *NPM_FLAGS, CLAUDE_PACKAGE],
                f"Claude Code ({CLAUDE_PACKAGE}, npm)",
            )
    # The postinstall copies the platform's native binary over the wrapper's
    # placeholder; should it not have run, the platform package has it too.
    candidates = [modules / "claude-code" / "bin" / "claude.exe"]
    candidates += sorted(modules.glob("claude-code-linux-*/claude"))
    errors = []
    for binary in candidates:
        try:
            _check_version(binary, CLAUDE_VERSION, "claude")
        except AgentUnavailable as exc:
            errors.append(str(exc))
            continue
        return binary
    raise AgentUnavailable("; ".join(errors) or f"no claude binary under {modules}")


def agent_or_skip(locate: Callable[[], Path], what: str) -> Path:
    """``locate()`` (``codex_binary``/``claude_binary``), or skip the test with
    the reason; under ``IOP_REQUIRE_AGENTS=1`` (CI) fail it instead."""
    try:
        return locate()
    except AgentUnavailable as exc:
        if os.environ.get("IOP_REQUIRE_AGENTS") == "1":
            pytest.fail(f"IOP_REQUIRE_AGENTS=1 but {what} cannot run: {exc}", pytrace=False)
        pytest.skip(f"{what} is not available: {exc}")


# ---------------------------------------------------------------- run


def _base_env(home: Path, proxy: str) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "HOME": str(home),
        "TMPDIR": str(home),
        "HTTPS_PROXY": proxy,
        "HTTP_PROXY": proxy,
        "ALL_PROXY": proxy,
        "https_proxy": proxy,
        "http_proxy": proxy,
        "all_proxy": proxy,
        "NO_PROXY": NO_PROXY,
        "no_proxy": NO_PROXY,
    }


def _toml_value(value: object) -> str:
    # JSON strings, numbers and booleans are valid TOML values.
    return json.dumps(value)


def codex_model_catalog(model: str) -> dict[str, object]:
    """A ``model_catalog_json`` document naming ``model`` with freeform ``apply_patch``.

    Codex 0.163.0 offers its file-editing tool ``apply_patch`` only for the
    models its catalog knows (all of its built-in ones as a ``custom``
    freeform tool, ``apply_patch_tool_type = "freeform"``); a model it does
    not know gets its fallback metadata and no ``apply_patch`` at all. This is
    the smallest entry it accepts (each key is one its parser requires;
    tests/data/agents/README.md, ``codex-apply-patch``).
    """
    entry = {
        "slug": model,
        "display_name": model,
        "base_instructions": "You are Codex, a coding agent.",
        "apply_patch_tool_type": "freeform",
        "supported_reasoning_levels": [],
        "shell_type": "shell_command",
        "visibility": "list",
        "supported_in_api": True,
        "priority": 1,
        "support_verbosity": False,
        "truncation_policy": {"mode": "tokens", "limit": 10000},
        "experimental_supported_tools": [],
    }
    return {"models": [entry]}


def codex_config(
    base_url: str,
    model: str,
    *,
    quiet: bool = True,
    stream_idle_timeout_ms: int = 30_000,
    model_catalog_json: str | None = None,
) -> str:
    """``config.toml`` for one run: the provider at ``base_url``, nothing else reached.

    ``quiet=False`` leaves out the settings that stop background traffic (to
    see what a default install tries to reach). ``stream_idle_timeout_ms``:
    how long Codex waits for the next SSE event before it gives the turn up
    (SSE comments do not count). ``model_catalog_json``: the path of a model
    catalog (``codex_model_catalog``) replacing Codex's built-in one.
    """
    provider = {
        "name": "IOP",
        "base_url": f"{base_url.rstrip('/')}/v1",
        "env_key": "IOP_API_KEY",
        "wire_api": "responses",
        # A failed request or stream fails the run at once instead of being
        # retried with back-off: tests see the failure, not a slow pass.
        "request_max_retries": 0,
        "stream_max_retries": 0,
        "stream_idle_timeout_ms": stream_idle_timeout_ms,
    }
    head = [f"model = {_toml_value(model)}", 'model_provider = "iop"']
    if model_catalog_json is not None:
        head.append(f"model_catalog_json = {_toml_value(model_catalog_json)}")
    head.append("")
    quiet_lines = [
        # The release check (api.github.com).
        "check_for_update_on_startup = false",
        "",
        "[analytics]",
        "enabled = false",
        "",
        "[feedback]",
        "enabled = false",
        "",
        "[otel]",
        'exporter = "none"',
        'metrics_exporter = "none"',
        'trace_exporter = "none"',
        "",
        "[features]",
        # Plugin and app sync (github.com, chatgpt.com).
        "plugins = false",
        "",
    ]
    tail = [
        "[model_providers.iop]",
        *(f"{key} = {_toml_value(value)}" for key, value in provider.items()),
    ]
    return "\n".join(head + (quiet_lines if quiet else []) + tail) + "\n"


def codex_command(binary: Path, prompt: str, workdir: Path) -> list[str]:
    return [
        str(binary),
        "exec",
        # Unknown keys in config.toml are errors: CODEX_CONFIG cannot rot silently.
        "--strict-config",
        "--skip-git-repo-check",
        "--ephemeral",
        # Run the model's shell commands without the Landlock/bubblewrap
        # sandbox (unavailable as root in a container) and without approval.
        "--sandbox",
        "danger-full-access",
        "--color",
        "never",
        "--cd",
        str(workdir),
        prompt,
    ]


def _run(
    command: Sequence[str], workdir: Path, env: Mapping[str, str], timeout: float, config: str = ""
) -> AgentResult:
    shown = {
        k: ("<masked>" if k.endswith(("_API_KEY", "_AUTH_TOKEN")) else v) for k, v in env.items()
    }
    try:
        done = subprocess.run(
            list(command),
            cwd=workdir,
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:

        def text(data: bytes | str | None) -> str:
            return data.decode(errors="replace") if isinstance(data, bytes) else data or ""

        stderr = text(exc.stderr) + "\n[timed out]"
        return AgentResult(-1, text(exc.stdout), stderr, tuple(command), shown, config)
    return AgentResult(done.returncode, done.stdout, done.stderr, tuple(command), shown, config)


def run_codex(
    base_url: str,
    prompt: str,
    workdir: Path,
    timeout: float = RUN_TIMEOUT_S,
    *,
    binary: Path | None = None,
    model: str = "iop-model",
    api_key: str = API_KEY,
    proxy: str = DEAD_PROXY,
    quiet: bool = True,
    stream_idle_timeout_ms: int = 30_000,
    freeform_apply_patch: bool = False,
) -> AgentResult:
    """``codex exec PROMPT`` in ``workdir`` against ``base_url`` (``/v1/responses``).

    ``freeform_apply_patch``: give ``model`` a catalog entry
    (``codex_model_catalog``) so that Codex offers ``apply_patch`` as a
    ``custom`` tool, as it does for OpenAI's models.
    """
    binary = binary or codex_binary()
    with tempfile.TemporaryDirectory(prefix="iop-codex-home-") as scratch:
        home = Path(scratch)
        codex_home = home / ".codex"
        codex_home.mkdir()
        catalog: str | None = None
        if freeform_apply_patch:
            catalog_path = codex_home / "models.json"
            catalog_path.write_text(json.dumps(codex_model_catalog(model), indent=2) + "\n")
            catalog = str(catalog_path)
        config = codex_config(
            base_url,
            model,
            quiet=quiet,
            stream_idle_timeout_ms=stream_idle_timeout_ms,
            model_catalog_json=catalog,
        )
        (codex_home / "config.toml").write_text(config)
        env = _base_env(home, proxy) | {"CODEX_HOME": str(codex_home), "IOP_API_KEY": api_key}
        return _run(codex_command(binary, prompt, workdir), workdir, env, timeout, config)


# The tool round trip runs exactly this shell command, allowed up front
# (``-p`` cannot ask, and root may not skip permissions).
CLAUDE_ALLOWED_TOOLS: Final = ("Bash(echo:*)",)


def claude_command(
    binary: Path,
    prompt: str,
    model: str,
    *,
    allowed_tools: Sequence[str] = CLAUDE_ALLOWED_TOOLS,
    options: Sequence[str] = (),
) -> list[str]:
    """``claude -p PROMPT --model MODEL [options] --allowedTools ...``.

    ``options``: more of its options (``--continue``, ``--session-id ID``,
    ``--output-format json``). ``--allowedTools`` is last: it takes every
    argument after it.
    """
    return [str(binary), "-p", prompt, "--model", model, *options, "--allowedTools", *allowed_tools]


def run_claude(
    base_url: str,
    prompt: str,
    workdir: Path,
    timeout: float = RUN_TIMEOUT_S,
    *,
    binary: Path | None = None,
    model: str = "iop-model",
    api_key: str = API_KEY,
    proxy: str = DEAD_PROXY,
    quiet: bool = True,
    key_variable: str = "ANTHROPIC_API_KEY",
    allowed_tools: Sequence[str] = CLAUDE_ALLOWED_TOOLS,
    options: Sequence[str] = (),
    home: Path | None = None,
) -> AgentResult:
    """``claude -p PROMPT`` in ``workdir`` against ``base_url`` (``/v1/messages``).

    The key goes in ``key_variable``: ``ANTHROPIC_API_KEY`` (sent as
    ``x-api-key``) or ``ANTHROPIC_AUTH_TOKEN`` (sent as ``Authorization: Bearer``).
    ``allowed_tools`` and ``options``: as ``claude_command``. ``home``: the
    ``HOME`` to run in, kept after the run (Claude Code keeps its sessions
    there, so a later run with the same ``home`` can ``--continue`` one);
    by default a throwaway one.
    """
    binary = binary or claude_binary()
    with contextlib.ExitStack() as stack:
        if home is None:
            home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="iop-claude-home-")))
        env = _base_env(home, proxy) | {
            "CLAUDE_CONFIG_DIR": str(home / ".claude"),
            "ANTHROPIC_BASE_URL": base_url.rstrip("/"),
            key_variable: api_key,
            # An HTTP error fails the run at once instead of being retried
            # with back-off (as Codex's request_max_retries = 0). It does not
            # stop the stream retries and non-streaming fallback that follow
            # a broken stream (tests/data/agents/README.md).
            "CLAUDE_CODE_MAX_RETRIES": "0",
        }
        if quiet:
            env |= CLAUDE_QUIET_ENV
        command = claude_command(
            binary, prompt, model, allowed_tools=allowed_tools, options=options
        )
        return _run(command, workdir, env, timeout)
