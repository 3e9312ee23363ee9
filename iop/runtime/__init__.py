"""The Trio core: runs as supervised tasks, bounded channels, per-phase deadlines,
the one driver of the edge <-> node link and its in-process channel, and a server's garbage collector
settings (``iop.runtime._heap``).

See ``iop.runtime._run`` for the theory of operation of runs and
``iop.runtime._link`` for the link driver.
"""

from iop.runtime._heap import YOUNG_THRESHOLD, settle_heap
from iop.runtime._link import (
    LIVENESS_RESOLUTION_S,
    MAX_FRAMES_PER_WAKE,
    Backpressure,
    LinkClock,
    LinkDriver,
    LinkSession,
    NowaitFrameChannel,
    PeerSilent,
    SweptSession,
    Wakeup,
)
from iop.runtime._local_link import (
    CLOSE_DROPPED,
    LOCAL_LINK_FRAMES,
    LocalFrameChannel,
    local_link_pair,
)
from iop.runtime._run import (
    RUN_EVENT_BUFFER,
    EventSender,
    Executor,
    Outlet,
    Run,
    RunEvents,
    RunSink,
    RunState,
    RunSupervisor,
    collect_run,
    new_run_id,
    open_run_supervisor,
)

__all__ = [
    "CLOSE_DROPPED",
    "LIVENESS_RESOLUTION_S",
    "LOCAL_LINK_FRAMES",
    "MAX_FRAMES_PER_WAKE",
    "RUN_EVENT_BUFFER",
    "YOUNG_THRESHOLD",
    "Backpressure",
    "EventSender",
    "Executor",
    "LinkClock",
    "LinkDriver",
    "LinkSession",
    "LocalFrameChannel",
    "NowaitFrameChannel",
    "Outlet",
    "PeerSilent",
    "Run",
    "RunEvents",
    "RunSink",
    "RunState",
    "RunSupervisor",
    "SweptSession",
    "Wakeup",
    "collect_run",
    "local_link_pair",
    "new_run_id",
    "open_run_supervisor",
    "settle_heap",
]
