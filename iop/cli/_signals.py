"""SIGINT/SIGTERM for the long-running commands: the first drains, the second stops.

``iop up``, ``iop edge``, ``iop node`` and ``iop sim`` all run their service
inside ``open_stop_signals()``:

* the **first** signal sets ``StopSignals.drain``; the command drains (new
  work refused, in-flight work given its drain timeout) and exits 0;
* a **second** signal cancels everything at once (in-flight runs end with
  ``shutdown``, embedded servers are still stopped and reaped) and the exit
  status is 128 + the signal's number: 130 for SIGINT, 143 for SIGTERM, what
  a shell reports for a process that signal killed. A supervisor can so tell
  a clean stop (0) from a cut-short one.

The receiver is open before the service starts, so a signal during a slow
start (a model loading, the first probe) is not lost: the service then
drains as soon as it is up.

``iop up`` and ``iop node`` also take **SIGUSR1** (``restart=True``): the
operator's restart of the backends the process runs itself that are down,
in a backoff or stopped by a crash loop (``StopSignals.on_restart``, set
once the node runs; docs/operations.md, "When a managed backend dies").
Not SIGHUP: a closing terminal sends that, and ``iop up`` must still stop
then.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

__all__ = ["StopSignals", "open_stop_signals"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
RESTART_SIGNAL = signal.SIGUSR1


class StopSignals:
    """What the stop signals asked for so far.

    Attributes:
        drain: Set by the first signal.
        exit_code: 0, or 128 + the number of the signal that stopped at once.
        on_restart: What SIGUSR1 does: restarts the managed backends that
            are down and returns their names (None: nothing runs yet).
    """

    def __init__(self, log: logging.Logger) -> None:
        self.drain = trio.Event()
        self.exit_code = 0
        self.on_restart: Callable[[], list[str]] | None = None
        self._log = log

    def _restart(self) -> None:
        name = RESTART_SIGNAL.name
        if self.on_restart is None:
            self._log.warning("%s received while starting: nothing to restart yet", name)
            return
        names = self.on_restart()
        if names:
            self._log.info("%s received: restarting %s", name, ", ".join(names))
        else:
            self._log.info("%s received: no managed backend is down", name)

    async def _watch(self, signals: AsyncIterator[int], hard: trio.CancelScope) -> None:
        async for signum in signals:
            if signum == RESTART_SIGNAL:
                self._restart()
                continue
            name = signal.Signals(signum).name
            if not self.drain.is_set():
                self._log.info("%s received: draining (a second signal stops at once)", name)
                self.drain.set()
                continue
            self._log.warning("%s again: stopping now", name)
            self.exit_code = 128 + signum
            hard.cancel()
            return


@asynccontextmanager
async def open_stop_signals(
    log: logging.Logger, *, restart: bool = False
) -> AsyncIterator[StopSignals]:
    """Watch SIGINT/SIGTERM while the body runs; a second signal cancels the body.

    The body ends normally after a hard stop (the cancellation is absorbed
    here); read ``exit_code`` afterwards.

    Args:
        log: Where the signals are logged.
        restart: Also take SIGUSR1, for ``StopSignals.on_restart``.
    """
    stop = StopSignals(log)
    watched = (*STOP_SIGNALS, RESTART_SIGNAL) if restart else STOP_SIGNALS
    with trio.open_signal_receiver(*watched) as signals, trio.CancelScope() as hard:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop._watch, signals, hard)
            yield stop
            nursery.cancel_scope.cancel()  # the watcher
