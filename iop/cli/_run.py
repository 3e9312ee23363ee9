"""``iop run`` and ``iop probe``: drive one adapter instance from a node config.

For operators wiring up a backend: ``iop probe`` shows what each instance
serves and whether its provider is up; ``iop run`` sends one chat request
through an instance's adapter and prints its RuntimeEvents as they come, with
the same runtime (deadlines, cancellation) the node uses. A ``llamacpp``
instance's server is started for the command, once (``open_adapter``): a
server that cannot start is reported unavailable with the reason.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import httpx
import msgspec
import trio

from iop._log import scrub
from iop._secrets import node_secrets, register_secrets
from iop.adapters import join_openai_path
from iop.config import HTTPInstance, InstanceConfig, NodeConfig, decode_config, read_config_file
from iop.errors import ConfigError
from iop.events import Complete, Delta, ReasoningDelta, is_terminal
from iop.managed import open_adapter
from iop.runtime import new_run_id, open_run_supervisor
from iop.spec import ChatRequest, ExecutionSpec, Message

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="send one chat request through an adapter instance and print its events",
        description=(
            "Send one chat request through an adapter instance of a node config and "
            "print its RuntimeEvents (one JSON object per line with --events, else the "
            "text as it streams). Exit status: 0 complete, 1 error or cancelled."
        ),
    )
    p.add_argument(
        "--config", required=True, metavar="FILE", help="node config (TOML) with [[instances]]"
    )
    p.add_argument("--instance", help="instance name (default: the first)")
    p.add_argument("--model", default="", help="model to ask for (default: first target)")
    p.add_argument("--max-tokens", type=int, default=None, help="max_tokens of the request")
    p.add_argument("--events", action="store_true", help="print every event as JSON")
    p.add_argument("prompt", help="the user message")
    p.set_defaults(func=_cmd_run)

    q = sub.add_parser(
        "probe",
        help="probe every adapter instance of a node config",
        description=(
            "Probe each instance's backend (GET /v1/models) and print its capabilities as "
            "one JSON object per line; provider_detail says why an instance is not available. "
            "Exit status: 0 all available, 1 otherwise. Never dials an edge, so "
            "[[node.edges]] (and its token) may be absent."
        ),
    )
    q.add_argument(
        "--config", required=True, metavar="FILE", help="node config (TOML) with [[instances]]"
    )
    q.set_defaults(func=_cmd_probe)


def _pick(cfg: NodeConfig, name: str | None) -> InstanceConfig:
    if not cfg.instances:
        raise ConfigError("the config has no [[instances]]")
    if name is None:
        return cfg.instances[0]
    for inst in cfg.instances:
        if inst.name == name:
            return inst
    names = ", ".join(i.name for i in cfg.instances)
    raise ConfigError(f"no instance named {name!r} (have: {names})")


def _load_instances(path: str) -> NodeConfig:
    """The node config without its ``[[node.edges]]``.

    ``run`` and ``probe`` never dial an edge, so an edge token's ``${VAR}``
    need not be set; the instances' own variables (backend API keys) must.
    """
    data = read_config_file(path)
    node = data.get("node")
    if isinstance(node, dict):
        data = {**data, "node": {k: v for k, v in node.items() if k != "edges"}}
    return decode_config(data, NodeConfig, source=path)


def _cmd_run(args: argparse.Namespace) -> int:
    cfg = _load_instances(args.config)
    register_secrets(node_secrets(cfg))
    inst = _pick(cfg, args.instance)
    return trio.run(_run, inst, args)


async def _run(inst: InstanceConfig, args: argparse.Namespace) -> int:
    async with open_adapter(inst) as adapter:
        model = args.model
        if not model:
            caps = await adapter.capabilities()
            model = caps.targets[0] if caps.targets else ""
        request = ChatRequest(
            model=model,
            messages=[Message(role="user", content=args.prompt)],
            stream=True,
            max_tokens=args.max_tokens,
        )
        spec = ExecutionSpec(run_id=new_run_id(), request=request, target=model)
        ok = False
        async with open_run_supervisor() as sup:
            run = sup.start_run(adapter, spec, inst.deadlines)
            async with run.events:
                async for ev in run.events:
                    if args.events:
                        line = msgspec.json.encode(ev).decode()
                        sys.stdout.write((scrub(line) if is_terminal(ev) else line) + "\n")
                    elif isinstance(ev, Delta):
                        sys.stdout.write(ev.text)
                    elif isinstance(ev, ReasoningDelta):
                        sys.stderr.write(ev.text)
                    elif is_terminal(ev):
                        sys.stdout.write("\n")
                        if not isinstance(ev, Complete):
                            line = scrub(msgspec.json.encode(ev).decode())
                            sys.stderr.write(f"iop run: {line}\n")
                    sys.stdout.flush()
                    ok = isinstance(ev, Complete)
        return 0 if ok else 1


def _cmd_probe(args: argparse.Namespace) -> int:
    cfg = _load_instances(args.config)
    register_secrets(node_secrets(cfg))
    return trio.run(_probe, cfg)


async def _probe(cfg: NodeConfig) -> int:
    worst = 0
    for inst in cfg.instances:
        async with open_adapter(inst) as adapter:
            caps = await adapter.capabilities()
        sys.stdout.write(scrub(msgspec.json.encode(caps).decode()) + "\n")
        if caps.provider_status != "available":
            worst = 1
            # The URL in full for the operator (the detail, which the edge
            # shows too, names host and port only).
            if isinstance(inst, HTTPInstance):
                tried = httpx.URL(join_openai_path(inst.endpoint, "/v1/models"))
                url = tried.copy_with(username=None, password=None, query=None)
                print(
                    scrub(f"iop probe: {inst.name}: GET {url}: {caps.provider_detail}"),
                    file=sys.stderr,
                )
    return worst
