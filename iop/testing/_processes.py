"""Real ``iop`` processes for end-to-end tests and benchmarks: start, watch, stop by PID.

One runner for both users: ``tests/e2e/_platform.py`` (the end-to-end tests'
helpers) and ``scripts/bench_platform.py`` (the platform benchmark). It lives
in the public testing kit, not under ``tests/``, so that the script imports
it as ``iop.testing`` with no ``sys.path`` games and does not drag in the test
tree's own dependencies (the ``openai`` SDK, the schema validators), and so
that ``mypy --strict`` checks it with the rest of ``iop``.

Theory of operation
-------------------
A ``Proc`` is started by its constructor: ``python -m iop ARGS`` (or any
``argv``), stdin from ``/dev/null``, stdout and stderr to two files in a log
directory, in its own session, so a Ctrl-C at the terminal reaches only the
parent, which then stops its children itself, in its order. Every wait has a
deadline: ``wait_stdout`` polls the stdout file for a start-up line (the CLIs
print their URLs there, see the ``*_READY`` patterns) and fails early when the
process exits first; ``poll`` is the same loop for any check.

A process is stopped by its PID, never by name: SIGCONT (a frozen process
cannot drain), SIGTERM (every ``iop`` command drains and exits 0), then
SIGKILL after a grace period. ``Proc.ALL`` lists every process this
interpreter started, so that a test's failure report can show their logs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Final, TypeVar

__all__ = [
    "EDGE_READY",
    "NODE_READY",
    "POLL_S",
    "SIM_READY",
    "START_TIMEOUT_S",
    "STOP_GRACE_S",
    "UP_READY",
    "Proc",
    "free_port",
    "poll",
    "toml_dumps",
]

# Generous: a process start on a loaded 2-core machine.
START_TIMEOUT_S: Final = 30.0
# Stop: SIGTERM, then SIGKILL after this. The CLIs drain open streams first
# (iop/cli/_signals.py); a drain that takes longer than this is a hang.
STOP_GRACE_S: Final = 15.0
# Between two looks at a file or an endpoint: short next to a start-up (hundreds
# of ms), long enough not to burn a core of a 2-core machine.
POLL_S: Final = 0.02

# The start-up lines of the CLIs (stdout), group 1 the OpenAI API's base URL:
# iop/cli/_sim.py ("... on http://HOST:PORT/v1"), iop/cli/_edge.py describe_edge
# (group 2: the URL nodes dial), iop/cli/_up.py (after describe_edge) and
# iop/cli/_node.py.
SIM_READY: Final = r"on (https?://\S+)/v1"
EDGE_READY: Final = r"OpenAI API on (https?://\S+)/v1 .*nodes dial (wss?://\S+)"
UP_READY: Final = r"OpenAI API on (https?://\S+)/v1 (?s:.*)iop up: ready; models: (.*)\n"
NODE_READY: Final = r"iop node: node "

T = TypeVar("T")


def free_port() -> int:
    """A TCP port that was free a moment ago (for processes that must keep a port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def poll(
    check: Callable[[], T | None], *, timeout: float, what: str, interval: float = POLL_S
) -> T:
    """Call ``check`` until it returns something other than None/False.

    Raises:
        AssertionError: ``timeout`` seconds passed first (``what`` says what for).
    """
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result is not None and result is not False:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


class Proc:
    """One child process, its output in files, stopped by PID."""

    # Every process started by this interpreter, for failure reports.
    ALL: ClassVar[list[Proc]] = []

    def __init__(
        self,
        name: str,
        args: list[str],
        log_dir: Path,
        *,
        argv: list[str] | None = None,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        python: str | None = None,
    ) -> None:
        """Start ``python -m iop ARGS`` (or ``argv`` as given).

        Args:
            name: Names the log files ``NAME.stdout`` and ``NAME.stderr`` in ``log_dir``.
            args: The ``iop`` command line, ignored when ``argv`` is given.
            log_dir: Where the log files go (created if missing).
            argv: Run this instead of ``python -m iop ARGS``.
            cwd: The working directory (default: ``log_dir``). ``python -m``
                puts it first on ``sys.path``: a checkout's root runs that
                checkout's ``iop``.
            env: Extra environment variables, on top of this process's.
            python: The interpreter for ``-m iop`` (default: this one).
        """
        self.name = name
        self.args = args
        self.argv = argv or [python or sys.executable, "-m", "iop", *args]
        log_dir.mkdir(parents=True, exist_ok=True)
        self.stdout_path = log_dir / f"{name}.stdout"
        self.stderr_path = log_dir / f"{name}.stderr"
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=cwd or log_dir,
                env=child_env,
                # Its own session: a Ctrl-C at the terminal reaches the parent only.
                start_new_session=True,
            )
        self.pid = self.popen.pid
        self.started_at = time.time()
        self.stopped_at: float | None = None
        Proc.ALL.append(self)

    def __repr__(self) -> str:
        return f"<Proc {self.name} pid={self.pid} rc={self.popen.returncode}>"

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def logs(self, tail: int = 120) -> str:
        """The command line and the last ``tail`` lines of stdout and of stderr."""

        def last(text: str) -> str:
            lines = text.splitlines()
            cut = len(lines) - tail
            head = [f"... ({cut} earlier lines in the file)"] if cut > 0 else []
            return "\n".join(head + lines[-tail:])

        return (
            f"--- {self.name} (pid {self.pid}, rc {self.popen.poll()}): "
            f"{' '.join(self.argv)}\n"
            f"--- stdout ({self.stdout_path})\n{last(self.stdout())}\n"
            f"--- stderr ({self.stderr_path})\n{last(self.stderr())}"
        )

    def wait_stdout(self, pattern: str, timeout: float = START_TIMEOUT_S) -> re.Match[str]:
        """Wait for stdout to match ``pattern`` (a regex searched in the whole output).

        Raises:
            AssertionError: The process exited first, or ``timeout`` passed.
        """
        rx = re.compile(pattern)

        def check() -> re.Match[str] | None:
            m = rx.search(self.stdout())
            if m is None and not self.alive:
                raise AssertionError(
                    f"{self.name} exited ({self.returncode}) before printing {pattern!r}\n"
                    + self.logs()
                )
            return m

        return poll(check, timeout=timeout, what=f"{self.name} to print {pattern!r}")

    def wait_stderr(self, pattern: str, timeout: float) -> re.Match[str]:
        """Wait for stderr (the log) to match ``pattern``."""
        rx = re.compile(pattern)
        return poll(
            lambda: rx.search(self.stderr()),
            timeout=timeout,
            what=f"{self.name} to log {pattern!r}",
        )

    def send(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the process, if it still runs."""
        if self.alive:
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int:
        """Wait for the exit; returns the exit code.

        Raises:
            AssertionError: Still running after ``timeout``.
        """
        try:
            rc = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} still running after {timeout:g}s\n{self.logs()}"
            ) from None
        self.stopped_at = self.stopped_at or time.time()
        return rc

    def kill(self) -> int:
        """SIGKILL (of a stopped process too) and reap; returns the exit code."""
        if self.alive:
            os.kill(self.pid, signal.SIGCONT)
            os.kill(self.pid, signal.SIGKILL)
        return self.wait(STOP_GRACE_S)

    def stop(self, grace: float = STOP_GRACE_S) -> int:
        """SIGTERM, then SIGKILL after ``grace``; reaps the process, returns its exit code."""
        if self.alive:
            os.kill(self.pid, signal.SIGCONT)  # a frozen process cannot drain
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
        rc = self.popen.wait(STOP_GRACE_S)
        self.stopped_at = self.stopped_at or time.time()
        return rc


# --- config files for the processes ------------------------------------------------


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML for {v!r}")


_BARE_KEY: Final = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key)


def toml_dumps(data: dict[str, Any], _prefix: str = "") -> str:
    """A minimal TOML writer (the configs the tests and benchmarks start
    processes with): scalars, lists of scalars, tables, arrays of tables."""
    lines: list[str] = []
    tables: list[str] = []
    for raw_key, value in data.items():
        key = _toml_key(raw_key)
        name = f"{_prefix}.{key}" if _prefix else key
        if isinstance(value, dict):
            tables.append(f"\n[{name}]\n" + toml_dumps(value, name))
        elif isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
            for item in value:
                tables.append(f"\n[[{name}]]\n" + toml_dumps(item, name))
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n" + "".join(tables)
