"""Where a run is placed: placement (``Scheduler``), the leases it hands out,
the queue in front of it, session affinity, the prefix index that
prefix-aware placement reads, and which node loads an on-demand model
(``_ondemand``).
"""

from iop.edge.scheduler._affinity import affinity_key
from iop.edge.scheduler._leases import Lease
from iop.edge.scheduler._queue import EVEN_SHARE, Excluded, QueueExit, QueueExitAt, QueueShare
from iop.edge.scheduler._scheduler import Scheduler

__all__ = [
    "EVEN_SHARE",
    "Excluded",
    "Lease",
    "QueueExit",
    "QueueExitAt",
    "QueueShare",
    "Scheduler",
    "affinity_key",
]
