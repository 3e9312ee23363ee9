"""The platform runner's processes: two sims and every shape of gateway in front of them.

``running_platform`` starts the sims (``iop sim``: ``iop-sim`` as fast as it
can, ``iop-sim-paced`` at ``--paced-rate``) and each asked-for shape: ``up``
(``iop up``), ``split`` (``iop edge`` and ``iop node``), ``litellm``
(LiteLLM's proxy, skipped with a reason when it is missing), ``direct``
(the sims themselves). Each is a ``Gateway``: its URL per model and the
processes its CPU per request is charged to. Every process is stopped by PID
when the block ends: nodes first (they drain their runs), then edges, then
the sims.

``REPO`` is a module global: the children run ``python -m iop`` in it (so
they import its ``iop``), and a script may point it at another source tree
(``scripts/bench_fixed_cost.py`` and ``scripts/bench_first_chunk.py`` did, until December 2026:
``git show 37c0eb9^:scripts/bench_fixed_cost.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from iop.bench._procs import (
    LITELLM_ENV,
    LITELLM_WANTED,
    NODE_TOKEN,
    READY_TIMEOUT_S,
    descendants,
    litellm_command,
    litellm_config,
    proc_cpu_s,
    wait_models,
)
from iop.bench._procs import REPO as _REPO
from iop.testing import EDGE_READY, SIM_READY, UP_READY, Proc, free_port

__all__ = [
    "CHUNKS",
    "MODEL_FAST",
    "MODEL_PACED",
    "REPO",
    "SHAPES",
    "Gateway",
    "Platform",
    "running_platform",
]

REPO = _REPO
CHUNKS = 64  # content chunks per answer (the sims' --output-tokens)
MODEL_FAST = "iop-sim"
MODEL_PACED = "iop-sim-paced"
SHAPES = ("direct", "up", "split", "litellm")


@dataclass
class Gateway:
    """One shape: where its clients send each model, and whose CPU it is charged."""

    shape: str
    urls: dict[str, str]  # model -> http://host:port
    procs: dict[str, Proc]  # what CPU per request counts ("edge", "node"; "up"; "litellm")
    tree: bool = False  # count live descendants and reaped children too (LiteLLM)
    children: dict[str, list[int]] = field(default_factory=dict)

    def cpu_s(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, p in self.procs.items():
            cpu = proc_cpu_s(p.pid, reaped_children=self.tree)
            for kid in self.children.get(name, []):
                with contextlib.suppress(OSError):
                    cpu += proc_cpu_s(kid, reaped_children=True)
            out[name] = cpu
        return out


@dataclass
class Platform:
    sims: dict[str, Proc]  # "sim", "sim_paced"
    gateways: dict[str, Gateway]  # shape -> gateway, "direct" included
    started: list[Proc]
    skipped: dict[str, str]  # shape -> why

    def all_cpu_s(self) -> dict[str, float]:
        """Every process of the benchmark, keyed "shape/name" (sims: "sim/NAME")."""
        out = {f"sim/{k}": proc_cpu_s(p.pid) for k, p in self.sims.items()}
        for gw in self.gateways.values():
            out |= {f"{gw.shape}/{k}": v for k, v in gw.cpu_s().items()}
        return out


_INSTANCES_TOML = """\
# max_concurrency above the highest level: the sims have no limit, and the
# edge's scheduler would otherwise queue runs (the default is 8 per instance).
[[instances]]
adapter = "vllm"
name = "sim"
endpoint = "{fast}"
max_concurrency = 256
max_queue = 256

[[instances]]
adapter = "vllm"
name = "sim-paced"
endpoint = "{paced}"
max_concurrency = 256
max_queue = 256
"""

_NODE_TOML = """\
[node]
id = "bench"
probe_interval_s = 30.0

[[node.edges]]
url = "{link}"
token = "{token}"

"""

_UP_TOML = """\
[node]
id = "bench-up"
probe_interval_s = 30.0

"""

# Offline: the model cost map from the package, not fetched from GitHub at
# start; only errors logged (LiteLLM logs every request at INFO otherwise).


@contextlib.contextmanager
def running_platform(args: argparse.Namespace, logdir: Path) -> Iterator[Platform]:
    """Start the sims and every asked-for gateway; stop them all (by PID) however
    the block ends: nodes first (they drain their runs), then edges, then the sims."""
    started: list[Proc] = []
    skipped: dict[str, str] = {}

    def launch(name: str, *iop_args: str, argv: list[str] | None = None, **kw: Any) -> Proc:
        p = Proc(name, list(iop_args), logdir, argv=argv, cwd=REPO, python=args.python, **kw)
        started.append(p)
        return p

    try:
        sim = ["sim", "--port", "0", "--ttft", "0", "--output-tokens", str(CHUNKS)]
        sim_fast = launch("sim", *sim, "--tokens-per-s", "0", "--model", MODEL_FAST)
        sim_paced = launch(
            "sim_paced", *sim, "--tokens-per-s", f"{args.paced_rate:g}", "--model", MODEL_PACED
        )
        fast_url = sim_fast.wait_stdout(SIM_READY)[1]
        paced_url = sim_paced.wait_stdout(SIM_READY)[1]
        instances = _INSTANCES_TOML.format(fast=fast_url, paced=paced_url)
        gateways: dict[str, Gateway] = {}
        if "direct" in args.shape_list:
            gateways["direct"] = Gateway(
                "direct", {MODEL_FAST: fast_url, MODEL_PACED: paced_url}, {}
            )
        # Start every gateway first, then wait for each: the start-ups overlap.
        edge = up = lite = None
        lite_url = ""
        if "split" in args.shape_list:
            edge = launch("edge", "edge", "--port", "0", "--node-token", NODE_TOKEN)
        if "up" in args.shape_list:
            up_toml = logdir / "up.toml"
            up_toml.write_text(_UP_TOML + instances)
            up = launch("up", "up", "--port", "0", "--config", str(up_toml))
        if "litellm" in args.shape_list:
            if not args.litellm.exists():
                skipped["litellm"] = (
                    f"no LiteLLM at {args.litellm} (install: python3 -m venv "
                    "~/.cache/iop/bench-litellm && ~/.cache/iop/bench-litellm/bin/pip install "
                    f"'litellm[proxy]=={LITELLM_WANTED}', or pass --litellm PATH)"
                )
            else:
                cfg = logdir / "litellm.yaml"
                cfg.write_text(litellm_config({MODEL_FAST: fast_url, MODEL_PACED: paced_url}))
                port = free_port()
                argv = litellm_command(args.litellm, cfg, port)
                lite = launch("litellm", argv=argv, env=LITELLM_ENV)
                lite_url = f"http://127.0.0.1:{port}"
        if edge is not None:
            m = edge.wait_stdout(EDGE_READY)
            node_toml = logdir / "node.toml"
            node_toml.write_text(_NODE_TOML.format(link=m[2], token=NODE_TOKEN) + instances)
            node = launch("node", "node", "--config", str(node_toml))
            wait_models(m[1], {MODEL_FAST, MODEL_PACED}, [edge, node], READY_TIMEOUT_S)
            gateways["split"] = Gateway(
                "split", {MODEL_FAST: m[1], MODEL_PACED: m[1]}, {"edge": edge, "node": node}
            )
        if up is not None:
            m = up.wait_stdout(UP_READY, timeout=READY_TIMEOUT_S)
            wait_models(m[1], {MODEL_FAST, MODEL_PACED}, [up], READY_TIMEOUT_S)
            gateways["up"] = Gateway("up", {MODEL_FAST: m[1], MODEL_PACED: m[1]}, {"up": up})
        if lite is not None:
            wait_models(
                lite_url,
                {MODEL_FAST, MODEL_PACED},
                [lite],
                READY_TIMEOUT_S,
                paths=("/health/liveliness",),
            )
            gw = Gateway(
                "litellm", {MODEL_FAST: lite_url, MODEL_PACED: lite_url}, {"litellm": lite}, True
            )
            gw.children = {"litellm": descendants(lite.pid)}
            gateways["litellm"] = gw
        # The table's column order.
        gateways = {s: gateways[s] for s in SHAPES if s in gateways}
        yield Platform({"sim": sim_fast, "sim_paced": sim_paced}, gateways, started, skipped)
    finally:
        order = {"node": 0, "edge": 1, "up": 1, "litellm": 1}
        for p in sorted(started, key=lambda p: order.get(p.name, 2)):
            try:
                rc = p.stop()
                if rc not in (0, -signal.SIGTERM):
                    print(f"bench: {p.name} (pid {p.pid}) exited {rc}", file=sys.stderr)
            except Exception as exc:
                print(f"bench: stopping {p.name}: {exc!r}", file=sys.stderr)
