"""Keep a backend that IOP starts itself serving: restarts with backoff, crash loops.

Theory of operation
-------------------
``Supervisor.serve`` is a Trio service (``nursery.start``) that runs one
*life* of the backend after another. A life is one call of the backend's
serve function (``serve_llamacpp``): it reports the endpoint through its
``task_status`` once the backend serves, calls ``on_exit`` the moment the
process is gone, and then ends by raising (it never returns on its own).
Whatever a life raises is its end, never the supervisor's: ``except*``
takes every ``Exception`` out of the life's nursery, and only
``trio.Cancelled`` (the node stopping) goes on.

The states, each change made in ``Supervisor._enter`` (which tells
``on_change``: the node re-probes and pushes the instance's status to its
edges at once)::

    STARTING ──serves──► UP ──gone──► DOWN ──delay──► STARTING
       │                               ▲  │
       └──failed start─────────────────┘  └──crash loop──► CRASH_LOOP
                                                              │
    DOWN or CRASH_LOOP ──operator (restart())──► STARTING ◄────┘

``RestartPolicy`` (sans-IO) decides after each end: the delay before the
next start doubles with each end still inside ``crash_loop_window_s``
(``restart_min_s``, twice that, ... at most ``restart_max_s``), and the
``crash_loop_exits``-th end inside the window is a crash loop: no more
starts until an operator calls ``restart()`` (SIGUSR1 to ``iop up`` or
``iop node``, ``iop.cli._signals``). That one wait has no deadline, by
design; cancelling the service ends it. ``restart()`` also cuts a backoff
short. Ends age out of the window, so a backend that dies once a day is
restarted after ``restart_min_s`` every time.

``detail`` says why the backend is not ``UP`` (the instance's
``provider_detail``: the node's log, ``/admin``, ``/readyz``, the 503 of a
new request); ``life`` is the current life, whose ``gone`` event tells
a run whose connection broke that the backend died under it
(``iop.managed._adapter``).
"""

from __future__ import annotations

import collections
import enum
import logging
import math
from collections.abc import Callable
from functools import partial
from typing import Any, Final, Generic, Protocol, TypeVar, runtime_checkable

import trio

from iop.config import SuperviseSettings
from iop.errors import IopError, first_leaf

__all__ = [
    "OPERATOR_ACTION",
    "BackendState",
    "Life",
    "RestartPolicy",
    "ServeFn",
    "SupervisedAdapter",
    "Supervisor",
    "headline",
]

log = logging.getLogger("iop.managed.supervise")

E = TypeVar("E")
E_co = TypeVar("E_co", covariant=True)

# How the log tail starts in a serve function's error message
# (iop.managed._llamacpp._with_tail); a status line stops before it.
_TAIL_INTRO: Final = "; last lines of its log:"
# The operator's action, named in every message that waits for it.
OPERATOR_ACTION: Final = "SIGUSR1"


class ServeFn(Protocol[E_co]):
    """Runs one life of the backend (``serve_llamacpp`` with its settings bound).

    Reports the endpoint through ``task_status`` once the backend serves,
    calls ``on_exit(reason)`` the moment a backend that served is gone, and
    raises when the life ends (it never returns on its own).
    """

    async def __call__(
        self, *, on_exit: Callable[[str], None], task_status: trio.TaskStatus[E_co]
    ) -> None: ...


class BackendState(enum.Enum):
    """Where a supervised backend is; changes only in ``Supervisor._enter``."""

    STARTING = "starting"  # a life began, the backend does not serve yet
    UP = "up"  # it serves
    DOWN = "down"  # gone; restarted after the backoff
    CRASH_LOOP = "crash_loop"  # gone too often; restarted only by an operator
    STOPPED = "stopped"  # the service ended (the node stops; a one-off check)


def headline(exc: BaseException) -> str:
    """The status line of a life's error: its first line, without the log tail."""
    text = exc.message if isinstance(exc, IopError) else f"{type(exc).__name__}: {exc}"
    first = text.split("\n", 1)[0]
    return first.removesuffix(_TAIL_INTRO).strip() or type(exc).__name__


class RestartPolicy:
    """When to start the backend again after it ended (sans-IO).

    Holds the end times inside the crash-loop window: at most
    ``crash_loop_exits`` of them (the last one is a crash loop, and only
    ``reset`` follows it).
    """

    def __init__(self, settings: SuperviseSettings) -> None:
        self._s = settings
        self._ends: collections.deque[float] = collections.deque()

    @property
    def recent(self) -> int:
        """Ends inside the window, as of the last ``ended``."""
        return len(self._ends)

    def ended(self, now: float) -> float | None:
        """Record an end at ``now``; the delay before the next start, or None: a crash loop."""
        s = self._s
        self._ends.append(now)
        while self._ends[0] <= now - s.crash_loop_window_s:
            self._ends.popleft()
        n = len(self._ends)
        if n >= s.crash_loop_exits:
            return None
        return float(min(s.restart_max_s, s.restart_min_s * 2 ** (n - 1)))

    def reset(self) -> None:
        """An operator acted: the count starts again."""
        self._ends.clear()


class Life(Generic[E]):
    """One start of the backend: its endpoint once it serves, and its end.

    Attributes:
        number: 1 for the first start, then counting.
        endpoint: Where it serves, once it does.
        gone: Set the moment a backend that served is gone.
        reason: Why it is gone (one line), once it is.
    """

    def __init__(self, number: int) -> None:
        self.number = number
        self.endpoint: E | None = None
        self.gone = trio.Event()
        self.reason = ""


def _nothing() -> None:
    pass


class Supervisor(Generic[E]):
    """Runs a backend's lives one after another; see the module docstring.

    Args:
        name: The instance's name (for the log).
        serve: Runs one life.
        settings: Backoff, crash-loop window.
        on_up: Called with the endpoint each time a life serves, before
            the state becomes ``UP``.

    Attributes:
        on_change: Called after every change of ``state`` or ``detail``
            (the node sets it: a re-probe is due).
    """

    def __init__(
        self,
        name: str,
        serve: ServeFn[E],
        settings: SuperviseSettings,
        *,
        on_up: Callable[[E], None] | None = None,
    ) -> None:
        self.name = name
        self._serve = serve
        self._on_up = on_up
        self._policy = RestartPolicy(settings)
        self._settings = settings
        self.state = BackendState.STARTING
        self.detail = "starting"
        self.life: Life[E] | None = None
        self.on_change: Callable[[], None] = _nothing
        # Set by restart() while a DOWN or CRASH_LOOP wait is on; a new one per wait.
        self._operator: trio.Event | None = None

    def _enter(self, state: BackendState, detail: str) -> None:
        """The one place the state changes."""
        if (state, detail) == (self.state, self.detail):
            return
        self.state, self.detail = state, detail
        self.on_change()

    def restart(self) -> bool:
        """The operator's restart: a backend that is down starts now, its crash count reset.

        Returns:
            True when the backend was down (in a backoff or a crash loop),
            False when it serves or is starting already.
        """
        if self._operator is None or self._operator.is_set():
            return False
        self._operator.set()
        return True

    async def _wait_operator(self) -> None:
        """Wait for ``restart()``; the caller bounds it (or not, in a crash loop)."""
        self._operator = operator = trio.Event()
        try:
            await operator.wait()
        finally:
            self._operator = None

    async def serve(
        self,
        *,
        once: bool = False,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Keep the backend serving until cancelled.

        ``task_status`` reports once the first life served or failed to
        start, so the first probe sees which.

        Args:
            once: One life, never restarted (``iop probe``, ``iop run``):
                a failed start leaves the state ``DOWN`` with the reason,
                and the service returns.
            task_status: Reports after the first life's start.
        """
        reported = False

        def report() -> None:
            nonlocal reported
            if not reported:
                reported = True
                task_status.started()

        number = 0
        try:
            while True:
                number += 1
                life: Life[E] = Life(number)
                self.life = life
                self._enter(BackendState.STARTING, "starting")
                error = await self._live(life, report)
                if not life.gone.is_set():  # it never served, or failed without an exit
                    life.reason = headline(error)
                    life.gone.set()
                if once:
                    log.error("instance %s: %s", self.name, _full(error))
                    self._enter(BackendState.DOWN, life.reason)
                    report()
                    return
                delay = self._after(life, error)
                report()
                with trio.move_on_after(delay) as backoff:
                    await self._wait_operator()
                if not backoff.cancelled_caught:
                    log.info(
                        "instance %s: %s received: starting the backend now",
                        self.name,
                        OPERATOR_ACTION,
                    )
                    self._policy.reset()
        finally:
            self._operator = None
            # The reason it was down stays (a one-off check reports it).
            self._enter(BackendState.STOPPED, self.detail or "stopped")

    async def _live(self, life: Life[E], report: Callable[[], None]) -> BaseException:
        """Run one life to its end; what ended it."""
        error: BaseException = IopError("it ended without an error")
        try:
            async with trio.open_nursery() as nursery:
                endpoint: E = await nursery.start(partial(self._serve, on_exit=self._gone(life)))
                life.endpoint = endpoint
                if self._on_up is not None:
                    self._on_up(endpoint)
                if life.number > 1:
                    log.info("instance %s: serving again (start %d)", self.name, life.number)
                self._enter(BackendState.UP, "")
                report()
        except* Exception as group:
            error = first_leaf(group, Exception)
            if not isinstance(error, IopError):
                log.error("instance %s: the backend's service crashed", self.name, exc_info=error)
        return error

    def _gone(self, life: Life[E]) -> Callable[[str], None]:
        def on_exit(reason: str) -> None:
            life.reason = reason
            life.gone.set()
            # Unavailable at once; the restart's delay is decided when the
            # life has ended (its log read).
            self._enter(BackendState.DOWN, reason)

        return on_exit

    def _after(self, life: Life[E], error: BaseException) -> float:
        """Log the end; the delay before the next start (inf: a crash loop)."""
        delay = self._policy.ended(trio.current_time())
        # A life that served had its log tail logged by the serve function.
        said = life.reason if life.endpoint is not None else _full(error)
        s = self._settings
        if delay is None:
            detail = (
                f"crash loop ({s.crash_loop_exits} exits in {s.crash_loop_window_s:g}s), "
                f"not restarted until {OPERATOR_ACTION}: {life.reason}"
            )
            log.error(
                "instance %s: crash loop: %d exits within crash_loop_window_s=%g; not "
                "restarting until an operator sends %s to this process "
                "(docs/operations.md, 'When a managed backend dies'). Last: %s",
                self.name,
                s.crash_loop_exits,
                s.crash_loop_window_s,
                OPERATOR_ACTION,
                said,
            )
            self._enter(BackendState.CRASH_LOOP, detail)
            return math.inf
        log.error(
            "instance %s: restarting in %gs (exit %d of %d within %gs makes a crash loop): %s",
            self.name,
            delay,
            self._policy.recent,
            s.crash_loop_exits,
            s.crash_loop_window_s,
            said,
        )
        self._enter(BackendState.DOWN, f"{life.reason}; restarting in {delay:g}s")
        return delay


def _full(error: BaseException) -> str:
    return error.message if isinstance(error, IopError) else f"{type(error).__name__}: {error}"


@runtime_checkable
class SupervisedAdapter(Protocol):
    """An adapter whose backend IOP runs itself: the node runs its supervisor."""

    @property
    def supervisor(self) -> Supervisor[Any]:
        """Keeps the backend serving (``Supervisor.serve`` in the node's nursery)."""
        ...
