"""``iop edge``: serve the OpenAI-compatible API and accept node links."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Container
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import msgspec
import trio

from iop._extras import Extra, require
from iop._reload import EDGE_RULES
from iop._secrets import edge_secrets, register_secrets
from iop.cli._reloader import Reloader, watch_reloads
from iop.cli._signals import open_stop_signals
from iop.config import EdgeConfig, load_config
from iop.errors import ConfigError
from iop.runtime import settle_heap

if TYPE_CHECKING:
    from iop.edge import EdgeCore, EdgeHandle

__all__ = ["add_parser", "describe_edge"]

log = logging.getLogger("iop.edge")

_EPILOG = """\
examples:
  iop edge --config configs/edge.toml
  IOP_NODE_TOKEN=s3cret iop edge --node-token '${IOP_NODE_TOKEN}' --port 8080

Nodes dial ws://HOST:PORT/v1/link with one of the configured node tokens.
With --link-port (link.port) the link has a port of its own, and the API
port serves no link.
SIGINT/SIGTERM drain: new requests get 503, in-flight runs get
server.drain_timeout_s to finish, then the process exits 0. A second signal
stops at once (exit 130 for SIGINT, 143 for SIGTERM).
SIGHUP, `iop reload` and POST /admin/reload re-read --config and apply what
changed (tenants and keys, node tokens, scheduler settings...); the flags
still override the file. Runs in flight are not touched.
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "edge",
        help="serve the OpenAI-compatible API and accept node links",
        description=(
            "Serve the OpenAI and Anthropic APIs (POST /v1/chat/completions, "
            "/v1/completions, /v1/embeddings, /v1/responses, /v1/messages; GET /v1/models), "
            "health (GET /healthz, GET /readyz), Prometheus metrics (GET /metrics; behind "
            "server.metrics_keys or server.admin_keys once clients have keys) and the admin "
            "view (GET /admin as a page, GET /admin/nodes as JSON; behind server.admin_keys; "
            "a client key never opens it, and with client keys but no admin key it answers "
            "403 admin_disabled), and accept nodes on the /v1/link WebSocket."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE", help="edge config (TOML); see docs/configuration.md")
    p.add_argument("--host", help="interface to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on, 0 for a free one (default: 8080)")
    p.add_argument(
        "--link-port",
        type=int,
        metavar="PORT",
        help="serve the node link on a port of its own (link.port; 0 for a free one), "
        "not on --port (default: on --port)",
    )
    p.add_argument(
        "--node-token",
        action="append",
        metavar="TOKEN",
        help="a token nodes may present (repeatable; ${VAR} reads the environment)",
    )
    p.set_defaults(func=_cmd_edge)


def edge_config_from_args(args: argparse.Namespace) -> EdgeConfig:
    cfg = load_config(args.config, EdgeConfig) if args.config else EdgeConfig()
    server = msgspec.structs.replace(
        cfg.server,
        **{k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None},
    )
    link = cfg.link
    if args.link_port is not None:
        try:
            link = msgspec.structs.replace(link, port=args.link_port)
        except ValueError as exc:
            raise ConfigError(f"--link-port: {exc}") from exc
    if args.node_token:
        from iop.config import expand_env

        tokens = [expand_env(t, where="--node-token") for t in args.node_token]
        link = msgspec.structs.replace(link, node_tokens=[*link.node_tokens, *tokens])
    if not link.node_tokens and not link.nodes:
        raise ConfigError(
            "no node token configured: set link.node_tokens or [[link.nodes]], or pass --node-token"
        )
    require_extras(cfg)
    if cfg.usage.ledger_path:
        from iop.ledger import check_ledger_path

        check_ledger_path(cfg.usage.ledger_path)
    return msgspec.structs.replace(cfg, server=server, link=link)


def require_extras(cfg: EdgeConfig, *, section: str = "") -> None:
    """Refuse a config whose keys need an extra that is not installed.

    Args:
        cfg: The edge's config.
        section: The keys' prefix in the file (``"edge."`` in ``iop up``'s).
    """
    if cfg.tracing.otlp_endpoint:
        require(Extra.OTEL, f"{section}tracing.otlp_endpoint")
    if cfg.cluster.valkey_url:
        require(Extra.CLUSTER, f"{section}cluster.valkey_url")


def _cmd_edge(args: argparse.Namespace) -> int:
    cfg = edge_config_from_args(args)
    register_secrets(edge_secrets(cfg))
    return trio.run(_main, cfg, args)


# The API surfaces, each with the operation a model must serve for it
# (``Capabilities.operations``).
SURFACE_OPERATIONS: Final = (
    ("chat/completions", "chat"),
    ("completions", "completion"),
    ("embeddings", "embedding"),
    ("responses", "chat"),
    ("messages", "chat"),
)


def describe_edge(handle: EdgeHandle, served: Container[str] | None = None) -> str:
    """The edge's start-up line.

    Args:
        handle: The running edge.
        served: The operations its models serve (``iop up``, whose node has
            joined); None: every surface (the edge serves what nodes bring).
    """
    names = [name for name, op in SURFACE_OPERATIONS if served is None or op in served]
    return (
        f"iop edge: OpenAI API on {handle.url}/v1 "
        f"({', '.join([*names, 'models'])}), "
        f"nodes dial {handle.link_url}"
    )


def edge_reloader(args: argparse.Namespace, core: EdgeCore) -> Reloader[EdgeConfig]:
    """What reloads ``core`` from ``--config`` (with the flags on top)."""
    return Reloader(
        source=args.config,
        running=core.config,
        load=partial(edge_config_from_args, args),
        rules=EDGE_RULES,
        apply=core.apply_config,
        secrets=edge_secrets,
        log=log,
    )


async def _main(cfg: EdgeConfig, args: argparse.Namespace) -> int:
    # Imported when the command runs: building the parser (``iop --help``, the
    # clients) loads no server (tests/cli/test_main.py).
    from iop.edge import serve_edge

    # Without a file there is nothing to re-read: SIGHUP (a closed terminal) stops it.
    reload = bool(args.config)
    async with open_stop_signals(log, reload=reload) as stop, trio.open_nursery() as nursery:
        handle = await nursery.start(partial(serve_edge, cfg, shutdown=stop.drain))
        if reload:  # else POST /admin/reload answers 409
            reloader = handle.core.reloader = edge_reloader(args, handle.core)
            await nursery.start(watch_reloads, stop, reloader)
        settle_heap(log)
        print(describe_edge(handle), flush=True)
        # serve_edge returns once the first signal's drain is done.
    log.info("stopped")
    return stop.exit_code
