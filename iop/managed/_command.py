"""Run a model server the operator names by its command line (an on-demand ``vllm`` model).

``serve_command`` is one *life* of such a server, in the shape of a
``Supervisor``'s serve function (``iop.managed._supervise``, ``ServeFn``):

1. It picks the port (the configured one, or a free one of ``host``),
   replaces ``{port}``, ``{model}`` and ``{name}`` in the argv, and spawns it in a
   session of its own (a Ctrl-C on the terminal reaches only the node, which
   stops it in order). Its stdout and stderr go through one pipe, read
   continuously line by line (split as the llama.cpp server's log,
   ``iop.managed._llamacpp``) into the ``iop.managed.command`` logger at DEBUG;
   the last ``LOG_TAIL_LINES`` lines are kept for error messages.
2. It polls ``health_path`` every ``HEALTH_POLL_INTERVAL_S`` until it
   answers 2xx, within ``ready_timeout_s`` (vLLM answers ``/health`` once
   the model is loaded); the process exiting first, or the deadline, fails
   the life with ``BackendUnavailable`` quoting the log's tail.
3. It reports the base URL through ``task_status`` and waits on the
   process; an exit is ``on_exit`` at once, then ``BackendUnavailable``.
4. Whatever ends the life, a shielded cleanup sends SIGTERM to the process
   group, SIGKILL after ``stop_grace_s``, and reaps the process.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import Callable, Sequence
from typing import Final

import httpx
import trio

from iop.errors import BackendUnavailable
from iop.managed._llamacpp import (
    ERROR_TAIL_LINES,
    LOG_TAIL_LINES,
    PIPE_READ_BYTES,
    _LineSplitter,
    _raise_sole,
    signal_name,
)
from iop.managed._llamacpp_server import _free_port

__all__ = ["serve_command"]

log = logging.getLogger("iop.managed.command")

# The log's limits (line length, tail) are the llama.cpp server's
# (iop.managed._llamacpp, which says why).
HEALTH_POLL_INTERVAL_S: Final = 0.2
HEALTH_REQUEST_TIMEOUT_S: Final = 2.0


def _tail_text(message: str, tail: Sequence[str]) -> str:
    lines = [line for line in tail if line.strip()][-ERROR_TAIL_LINES:]
    if not lines:
        return message
    return message + "; last lines of its log:\n" + "\n".join(lines)


async def _read_log(
    stream: trio.abc.ReceiveStream, name: str, tail: collections.deque[str]
) -> None:
    # The stream stays open after its reader is cancelled: the server's last
    # lines while it stops wait in the pipe rather than meet a closed one.
    splitter = _LineSplitter()
    while True:
        data = await stream.receive_some(PIPE_READ_BYTES)
        for line in splitter.feed(data) if data else splitter.flush():
            tail.append(line)
            log.debug("%s: %s", name, line)
        if not data:
            return


async def _stop(proc: trio.Process, grace_s: float) -> None:
    """SIGTERM to the process group, SIGKILL after ``grace_s``; always reaped."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with trio.move_on_after(grace_s):
            await proc.wait()
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    await proc.wait()


async def serve_command(
    argv: Sequence[str],
    *,
    name: str,
    model: str,
    host: str,
    port: int,
    health_path: str,
    ready_timeout_s: float,
    stop_grace_s: float,
    on_exit: Callable[[str], None],
    task_status: trio.TaskStatus[str],
) -> None:
    """One life of the server: see the module docstring. Reports its base URL.

    Raises:
        BackendUnavailable: It could not start, was not healthy within
            ``ready_timeout_s``, or exited; the message quotes its log.
    """
    port = port or _free_port(host)
    args = [
        a.replace("{port}", str(port)).replace("{model}", model).replace("{name}", name)
        for a in argv
    ]
    url = f"http://{host}:{port}"
    tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
    try:
        proc = await trio.lowlevel.open_process(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        raise BackendUnavailable(f"model {name}: cannot start {args[0]!r}: {exc}") from exc
    log.info(
        "model %s: started %s (pid %d), waiting for %s%s", name, args[0], proc.pid, url, health_path
    )
    try:
        async with trio.open_nursery() as nursery:
            assert proc.stdout is not None
            nursery.start_soon(_read_log, proc.stdout, name, tail)
            exited = trio.Event()

            async def watch() -> None:
                await proc.wait()
                exited.set()

            nursery.start_soon(watch)
            async with httpx.AsyncClient(timeout=HEALTH_REQUEST_TIMEOUT_S) as client:
                with trio.move_on_after(ready_timeout_s) as ready:
                    while not exited.is_set():
                        try:
                            resp = await client.get(url + health_path)
                            if resp.is_success:
                                break
                        except httpx.HTTPError:
                            pass  # not listening yet
                        with trio.move_on_after(HEALTH_POLL_INTERVAL_S):
                            await exited.wait()
            if exited.is_set():
                raise BackendUnavailable(
                    _tail_text(f"model {name}: {_exit_words(proc.returncode)} while loading", tail)
                )
            if ready.cancelled_caught:
                raise BackendUnavailable(
                    _tail_text(f"model {name}: not healthy within {ready_timeout_s:g}s", tail)
                )
            task_status.started(url)
            await exited.wait()
            reason = f"model {name}: {_exit_words(proc.returncode)}"
            on_exit(reason)
            raise BackendUnavailable(_tail_text(reason, tail))
    except BaseExceptionGroup as group:
        _raise_sole(group)
    finally:
        with trio.CancelScope(shield=True):
            await _stop(proc, stop_grace_s)


def _exit_words(returncode: int | None) -> str:
    """How a model's process ended: ``exited with 3``, ``killed by SIGKILL``."""
    name = None if returncode is None else signal_name(returncode)
    return f"killed by {name}" if name is not None else f"exited with {returncode}"
