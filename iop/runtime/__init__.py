"""The Trio core: runs as supervised tasks, bounded channels, per-phase deadlines.

See ``iop.runtime._run`` for the theory of operation.
"""

from iop.runtime._run import (
    RUN_EVENT_BUFFER,
    EventSender,
    Executor,
    Run,
    RunSink,
    RunState,
    RunSupervisor,
    collect_run,
    new_run_id,
    open_run_supervisor,
)

__all__ = [
    "RUN_EVENT_BUFFER",
    "EventSender",
    "Executor",
    "Run",
    "RunSink",
    "RunState",
    "RunSupervisor",
    "collect_run",
    "new_run_id",
    "open_run_supervisor",
]
