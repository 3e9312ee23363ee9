"""Reloading a running command's config: one path for SIGHUP and ``POST /admin/reload``.

``Reloader.reload`` reads the file again (in a worker thread: a slow disk
does not stall the streams), plans the change (``iop._reload.plan_reload``,
sans-IO), applies the plan in one synchronous call, and logs one line saying
what it did; the same ``ReloadOutcome`` is the HTTP reply. Reloads are
serialised: a second one waits for the first and is planned against what the
first left. ``watch_reloads`` turns each SIGHUP (``StopSignals``) into a
reload; signals that arrive while one runs are coalesced into the next, which
reads the file as it is then.

docs/operations.md, "Reloading", is the operator's side of it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from typing import Generic, TypeVar

import trio

from iop._log import scrub
from iop._reload import ReloadOutcome, Rules, plan_reload
from iop._secrets import Secret, register_secrets
from iop.cli._signals import StopSignals
from iop.errors import ConfigError

__all__ = ["Reloader", "watch_reloads"]

C = TypeVar("C")


class Reloader(Generic[C]):
    """Re-reads one config file and applies what changed (module docstring).

    Args:
        source: The file (None: the command was started without one, and a
            reload is refused saying so).
        running: The config the process runs with now.
        load: Reads and validates the file as the command's start does (its
            flags applied on top); raises ``ConfigError``. Called in a thread.
        rules: How each key takes effect (``iop._reload``).
        apply: Runs with a plan's config (synchronous: nothing awaits between
            the pieces it swaps).
        secrets: The config's secrets, registered for masking before
            anything logs them.
        log: Where the outcome is logged.
        restart: Keys that need a restart here whatever ``rules`` say, or
            what says them from the running and the new config
            (``iop._reload.managed_instances``).
    """

    def __init__(
        self,
        *,
        source: str | None,
        running: C,
        load: Callable[[], C],
        rules: Rules,
        apply: Callable[[C], None],
        secrets: Callable[[C], Iterable[Secret]],
        log: logging.Logger,
        restart: Collection[str] | Callable[[C, C], Collection[str]] = (),
    ) -> None:
        self.source = source
        self.running = running
        self._load = load
        self._rules = rules
        self._apply = apply
        self._secrets = secrets
        self._log = log
        self._restart = restart
        self._lock = trio.Lock()

    async def reload(self, via: str) -> ReloadOutcome:
        """Re-read the file and apply what changed; says what it did.

        Args:
            via: What asked for it (``SIGHUP``, ``POST /admin/reload by ...``),
                for the log line.
        """
        async with self._lock:
            outcome = await self._reload()
        level = logging.ERROR if outcome.status == "refused" else logging.INFO
        if outcome.restart_required:
            level = logging.WARNING
        self._log.log(level, "reload (%s): %s", via, outcome.describe())
        return outcome

    async def _reload(self) -> ReloadOutcome:
        if self.source is None:
            return ReloadOutcome.refused(
                "", "the process was started without a config file: nothing to re-read"
            )
        try:
            new = await trio.to_thread.run_sync(self._load)
            register_secrets(self._secrets(new))
            restart = self._restart(self.running, new) if callable(self._restart) else self._restart
            plan = plan_reload(self.running, new, self._rules, restart=restart)
            # Even when no key changed: a certificate renewed in place is read
            # again (EdgeCore.apply_config). Checks what it must before it
            # changes anything (ConfigError).
            self._apply(plan.config)
        except ConfigError as exc:
            # The reply is not a log line: values that look secret go too.
            return ReloadOutcome.refused(self.source, scrub(exc.message))
        except Exception as exc:
            # A bug must not take the running process down: the config stays.
            self._log.exception("reload crashed; the running config is unchanged")
            return ReloadOutcome.refused(self.source, f"internal error: {type(exc).__name__}")
        self.running = plan.config
        return ReloadOutcome.of(plan, self.source)


async def watch_reloads(
    stop: StopSignals,
    reloader: Reloader[C],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Reload on every SIGHUP until the drain begins (or until cancelled)."""
    async with trio.open_nursery() as nursery:

        async def until_drain() -> None:
            await stop.drain.wait()
            nursery.cancel_scope.cancel()

        nursery.start_soon(until_drain)
        task_status.started()
        while True:
            await stop.reload_requested()
            await reloader.reload("SIGHUP")
