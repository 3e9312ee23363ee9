"""``iop node``: run a node agent that dials its edges and serves its instances.

The node connects *out* to every edge of its config (NAT-friendly), says
hello with its instances' capabilities, executes the runs the edges assign,
and reconnects with backoff when a link drops. SIGINT or SIGTERM drains it:
no new runs, in-flight runs get ``node.drain_timeout_s`` to finish, then the
rest are cancelled (reason ``shutdown``) and the process exits 0. A second
signal stops at once. SIGUSR1 restarts the backends the node runs itself
(``llamacpp`` instances) that are down, a crash loop included. SIGHUP
re-reads the config file and applies what changed (``iop.cli._reloader``;
docs/operations.md, "Reloading").
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from iop._extras import Extra, require
from iop._log import scrub
from iop._reload import NODE_RULES, managed_instances
from iop._secrets import node_secrets, register_secrets
from iop.cli._reloader import Reloader, watch_reloads
from iop.cli._signals import open_stop_signals
from iop.config import (
    HTTPInstance,
    InstanceConfig,
    LlamaCppInstance,
    NodeConfig,
    VllmInstance,
    load_config,
)
from iop.errors import ConfigError
from iop.runtime import settle_heap

if TYPE_CHECKING:
    from iop.node import NodeAgent

__all__ = ["add_parser"]

log = logging.getLogger("iop.node")

_EPILOG = """\
config (TOML):
  [node]
  id = "gpu-1"                       # unique among the edge's nodes
  reconnect_min_s = 0.2              # backoff after a lost link ...
  reconnect_max_s = 5.0              # ... doubling up to this (with jitter)
  probe_interval_s = 10.0            # instances re-probed; changes pushed to edges
  drain_timeout_s = 10.0             # on SIGINT/SIGTERM, time for runs to finish

  [[node.edges]]
  url = "ws://edge.example:8080/v1/link"
  token = "${IOP_NODE_TOKEN}"        # secrets come from the environment

  [[instances]]
  adapter = "vllm"                   # or "openai_compat", "sim"
  name = "qwen"
  endpoint = "http://127.0.0.1:8000"
  max_concurrency = 8

See docs/configuration.md for every key.
"""


def add_parser(sub: Any) -> None:
    """Register ``iop node`` on the ``iop`` subparsers."""
    p = sub.add_parser(
        "node",
        help="run a node agent: dial the edges, serve runs on local backends",
        description=(
            "Run a node agent. It dials every edge in the config's [[node.edges]] over "
            "a WebSocket, advertises its [[instances]] (adapter, targets, capacity), "
            "executes the runs the edges assign, and reconnects with exponential backoff "
            "when a link drops. SIGINT/SIGTERM drain it: new runs are refused, in-flight "
            "runs get node.drain_timeout_s to finish, then it exits 0; a second signal "
            "stops at once (exit 130 for SIGINT, 143 for SIGTERM). SIGUSR1 restarts the "
            "backends the node runs itself (llamacpp instances) that are down. SIGHUP (or "
            "iop reload --pid PID) re-reads the config and applies its instances "
            "(added, removed, changed) without touching the runs in flight."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        required=True,
        metavar="FILE",
        help="node config (TOML): [node], [[instances]], [[models]]",
    )
    p.set_defaults(func=_cmd_node)


def _load(path: str) -> NodeConfig:
    cfg = load_config(path, NodeConfig)
    if not cfg.node.edges:
        raise ConfigError(
            f"{path}: no edges to dial; add a [[node.edges]] table with url and token"
        )
    if not cfg.instances and not cfg.models:
        # A node of on-demand models alone serves them (docs/operations.md,
        # "Models on demand").
        raise ConfigError(
            f"{path}: no instances to serve; add an [[instances]] or a [[models]] table"
        )
    if cfg.tracing.otlp_endpoint:
        require(Extra.OTEL, "tracing.otlp_endpoint")
    require_instance_extras(cfg.instances)
    return cfg


def require_instance_extras(instances: Sequence[InstanceConfig]) -> None:
    """Refuse, before anything starts, an instance whose keys need a missing extra.

    Raises:
        ConfigError: One does (the line names what to install).
    """
    for inst in instances:
        if isinstance(inst, VllmInstance) and inst.kv_events_endpoint:
            require(Extra.KVEVENTS, f"instance {inst.name!r}: kv_events_endpoint")


def _cmd_node(args: argparse.Namespace) -> int:
    cfg = _load(args.config)
    register_secrets(node_secrets(cfg))
    return trio.run(_run_node, cfg, args.config)


def _kind(inst: InstanceConfig) -> str:
    tag = type(inst).__struct_config__.tag
    return str(tag) if tag is not None else type(inst).__name__


def startup_line(agent: NodeAgent) -> str:
    """One line saying who the node is, what it dials and what it serves."""
    cfg = agent.config
    caps = {c.instance: c for c in agent.capabilities}
    parts = []
    for inst in cfg.instances:
        if isinstance(inst, HTTPInstance):
            where = inst.endpoint
        elif isinstance(inst, LlamaCppInstance):
            where = "started by the node"
        else:
            where = "in-process"
        c = caps.get(inst.name)
        targets = ", ".join(c.targets) if c and c.targets else "none yet"
        status = str(c.provider_status) if c else "unknown"
        if c and c.provider_detail:
            status += f": {c.provider_detail}"
        parts.append(f"{inst.name} ({_kind(inst)} {where}, {status}, targets: {targets})")
    edges = ", ".join(e.url for e in cfg.node.edges)
    # Endpoints and edge URLs may carry credentials (user:pass@, ?api_key=).
    return scrub(
        f"iop node: node {agent.node_id!r} dialling {edges}; instances: {'; '.join(parts)}"
    )


async def _run_node(cfg: NodeConfig, path: str) -> int:
    # Imported when the command runs: building the parser (``iop --help``, the
    # clients) loads no server (tests/cli/test_main.py).
    from iop.node import open_node_agent

    # The signals are watched before anything slow (the first probe), so an
    # early signal is not lost.
    async with (
        open_stop_signals(log, restart=True, reload=True) as stop,
        open_node_agent(cfg) as agent,
    ):
        stop.on_restart = agent.restart_backends
        print(startup_line(agent), flush=True)
        reloader = Reloader(
            source=path,
            running=cfg,
            load=partial(_load, path),
            rules=NODE_RULES,
            apply=agent.apply_config,
            secrets=node_secrets,
            log=log,
            restart=managed_instances,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.serve)
            await nursery.start(watch_reloads, stop, reloader)
            settle_heap(log)
            await stop.drain.wait()
            await agent.drain(agent.config.node.drain_timeout_s)  # a reload may change it
            nursery.cancel_scope.cancel()
    log.info("stopped")
    return stop.exit_code
