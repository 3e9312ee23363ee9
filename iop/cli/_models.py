"""``iop models``: see and steer the nodes' on-demand models through an edge.

``iop models list`` reads ``GET /admin/nodes`` and prints each node's
models (state, memory, pinned, runs) and its memory used of its budget;
``load``, ``unload``, ``pin`` and ``unpin`` post ``/admin/nodes/{node}/
models/{model}/{action}`` (docs/operations.md, "Operator controls") and
print the edge's reply as JSON. The node starts a load and answers at once;
``load --wait`` then polls the admin view until the model is ready (exit 0)
or failed (exit 1), for at most ``--timeout`` seconds.

Which edge and which admin key: as ``iop reload`` (``--url``/``--key`` or
``--config``, ``$IOP_ADMIN_KEY``).

Exit status: 0 done, 1 refused, failed or unreachable, 2 a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Final
from urllib.parse import quote

import httpx

from iop._log import scrub
from iop.cli._reload import add_where_arguments, admin_where

__all__ = ["add_parser"]

# The edge answers an action once the node did it (a load is only started):
# a round trip on the link, well under a second; the rest is a loaded machine.
DEFAULT_TIMEOUT_S: Final = 30.0
# How often ``load --wait`` reads the admin view: the node pushes a model's
# change at once, so a few reads a second see it soon after.
WAIT_POLL_S: Final = 0.25
# ``load --wait``'s default bound: a large model from network storage.
DEFAULT_WAIT_S: Final = 600.0

_ACTIONS: Final = {
    "load": "start loading a model on a node (not waited for unless --wait)",
    "unload": "unload a model once its runs end (refused while pinned)",
    "pin": "keep a model loaded: never evicted or idle-unloaded; loads it if cold",
    "unpin": "let a pinned model be evicted again (the config's pinned returns at restart)",
}

_EPILOG = """\
examples:
  iop models list --config configs/up-models.toml
  iop models load n1 smollm2-4k --wait --url http://127.0.0.1:8080 --key "$IOP_ADMIN_KEY"
  iop models pin n1 smollm2-4k --config configs/up-models.toml
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "models",
        help="list, load, unload, pin or unpin the nodes' on-demand models (via an edge)",
        description=(
            "The nodes' on-demand models as an edge sees them ([[models]] in a node's "
            "config), and the operator's actions on them, through the edge's admin API "
            "(an admin key). Exit status: 0 done, 1 refused, failed or unreachable."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    lister = actions.add_parser("list", help="each node's models: state, memory, pinned, runs")
    add_where_arguments(lister)
    lister.add_argument("--node", help="only this node")
    lister.add_argument(
        "--format", choices=["table", "json"], default="table", help="output (default: table)"
    )
    lister.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait for the reply"
    )
    lister.set_defaults(func=_cmd_list)
    for action, what in _ACTIONS.items():
        a = actions.add_parser(action, help=what, description=what)
        a.add_argument("node", help="the node's id (node.id)")
        a.add_argument("model", help="the model's name ([[models]] name)")
        add_where_arguments(a)
        a.add_argument(
            "--timeout",
            type=float,
            default=DEFAULT_TIMEOUT_S,
            help="seconds to wait for the reply (with --wait: for the load too)",
        )
        if action == "load":
            a.add_argument(
                "--wait",
                action="store_true",
                help="wait until the model is ready (exit 0) or failed (exit 1)",
            )
        a.set_defaults(func=_cmd_action, action=action)


def _client(args: argparse.Namespace) -> tuple[httpx.Client, str]:
    url, key = admin_where(args, "--url or --config")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    client = httpx.Client(
        base_url=url.rstrip("/"), headers=headers, timeout=args.timeout, trust_env=False
    )
    return client, url


def _refused(url: str, reply: httpx.Response) -> int:
    print(f"iop models: {url} answered {reply.status_code}: {scrub(reply.text)}", file=sys.stderr)
    return 1


def _nodes(client: httpx.Client, url: str) -> list[dict[str, Any]] | int:
    """The admin view's nodes, or the exit status of a failure (said on stderr)."""
    try:
        reply = client.get("/admin/nodes")
    except httpx.HTTPError as exc:
        print(f"iop models: cannot reach {url}: {exc}", file=sys.stderr)
        return 1
    if reply.status_code != 200:
        return _refused(url, reply)
    nodes: list[dict[str, Any]] = reply.json()["nodes"]
    return nodes


def _cmd_list(args: argparse.Namespace) -> int:
    client, url = _client(args)
    with client:
        nodes = _nodes(client, url)
    if isinstance(nodes, int):
        return nodes
    nodes = [n for n in nodes if args.node in (None, n["id"]) and n.get("models")]
    if args.format == "json":
        keys = ("id", "memory_mib", "controls", "models")
        print(json.dumps([{k: n.get(k) for k in keys} for n in nodes], indent=2))
        return 0
    if not nodes:
        print("no connected node offers on-demand models")
        return 0
    rows = [("NODE", "MODEL", "STATE", "MEMORY", "PINNED", "RUNS", "DETAIL")]
    for n in nodes:
        for m in n["models"]:
            state = m["state"]
            if state == "loading":
                state = f"loading ({m.get('loading_for_s', 0)} s)"
            elif state == "failed":
                state = f"failed (retry in {m.get('retry_in_s', 0)} s)"
            rows.append(
                (
                    n["id"],
                    m["model"],
                    state,
                    f"{m['memory_mib']} MiB",
                    "yes" if m.get("pinned") else "no",
                    str(m.get("runs", 0)),
                    m.get("detail") or "",
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])
    for n in nodes:
        mem = n.get("memory_mib") or {}
        print(f"{n['id']}: memory {mem.get('used', 0)} / {mem.get('budget', 0)} MiB")
    return 0


def _cmd_action(args: argparse.Namespace) -> int:
    client, url = _client(args)
    path = f"/admin/nodes/{quote(args.node, safe='')}/models/{quote(args.model, safe='')}"
    with client:
        try:
            reply = client.post(f"{path}/{args.action}")
        except httpx.HTTPError as exc:
            print(f"iop models: cannot reach {url}: {exc}", file=sys.stderr)
            return 1
        if reply.status_code != 200:
            return _refused(url, reply)
        print(reply.text, flush=True)
        if args.action == "load" and args.wait:
            return _wait_loaded(client, url, args.node, args.model, args.timeout)
    return 0


def _wait_loaded(client: httpx.Client, url: str, node: str, model: str, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = _nodes(client, url)
        if isinstance(nodes, int):
            return nodes
        found = next(
            (
                m
                for n in nodes
                if n["id"] == node
                for m in n.get("models", [])
                if m["model"] == model
            ),
            None,
        )
        if found is None:
            print(f"iop models: node {node} no longer offers {model}", file=sys.stderr)
            return 1
        state = found["state"]
        if state == "ready":
            print(f"{model} on {node}: ready (loaded in {found.get('load_s', 0)} s)", flush=True)
            return 0
        if state in ("failed", "cold"):
            print(
                f"iop models: {model} on {node}: {state}: {scrub(found.get('detail') or '')}",
                file=sys.stderr,
            )
            return 1
        if time.monotonic() > deadline:
            print(
                f"iop models: {model} on {node} still {state} after {timeout_s:g}s",
                file=sys.stderr,
            )
            return 1
        time.sleep(WAIT_POLL_S)
