"""``iop edge``: serve the OpenAI-compatible API and accept node links."""

from __future__ import annotations

import argparse
import logging
from functools import partial
from typing import Any

import msgspec
import trio

from iop._secrets import edge_secrets, register_secrets
from iop.cli._signals import open_stop_signals
from iop.config import EdgeConfig, load_config
from iop.edge import EdgeHandle, serve_edge
from iop.errors import ConfigError

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
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "edge",
        help="serve the OpenAI-compatible API and accept node links",
        description=(
            "Serve the OpenAI API (POST /v1/chat/completions, GET /v1/models), health "
            "(GET /healthz, GET /readyz), Prometheus metrics (GET /metrics; behind "
            "server.metrics_keys or server.admin_keys once clients have keys) and the admin "
            "view (GET /admin as a page, GET /admin/nodes as JSON; behind server.admin_keys, "
            "off when clients have keys and no admin key is set), and accept nodes on the "
            "/v1/link WebSocket."
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
    if cfg.cluster.valkey_url:
        import importlib.util

        if importlib.util.find_spec("coredis") is None:
            raise ConfigError(
                "cluster.valkey_url needs the Valkey client: pip install 'iop[cluster]'"
            )
    return msgspec.structs.replace(cfg, server=server, link=link)


def _cmd_edge(args: argparse.Namespace) -> int:
    cfg = edge_config_from_args(args)
    register_secrets(edge_secrets(cfg))
    return trio.run(_main, cfg)


def describe_edge(handle: EdgeHandle) -> str:
    return (
        f"iop edge: OpenAI API on {handle.url}/v1 "
        f"(chat/completions, completions, embeddings, responses, messages, models), "
        f"nodes dial {handle.link_url}"
    )


async def _main(cfg: EdgeConfig) -> int:
    async with open_stop_signals(log) as stop, trio.open_nursery() as nursery:
        handle = await nursery.start(partial(serve_edge, cfg, shutdown=stop.drain))
        print(describe_edge(handle), flush=True)
        # serve_edge returns once the first signal's drain is done.
    log.info("stopped")
    return stop.exit_code
