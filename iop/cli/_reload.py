"""``iop reload``: make a running edge, node or ``iop up`` re-read its config file.

Two ways to reach the process (docs/operations.md, "Reloading"):

* an edge (or ``iop up``) is asked over HTTP, ``POST /admin/reload`` with
  an admin key: the reply is the plan (what was applied, what needs a
  restart) or why the file was refused, printed as JSON on stdout;
* any of them, a node too (it serves no HTTP), gets SIGHUP with ``--pid``;
  it says what it did in its log.

Where the edge listens and its admin key come from ``--url`` and ``--key``,
or from its config file (``--config``): ``server.host``/``server.port`` and
the first of ``server.admin_keys`` (a client key never opens ``/admin``).
The file is read leniently for that, so a file that fails validation is still sent for,
and the edge's reply names what is wrong with it.

Exit status: 0 applied or unchanged (also when keys need a restart: they are
listed), 1 refused or the edge unreachable, 2 a usage error.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any, Final

import httpx

from iop._log import scrub
from iop.config import expand_env, read_config_file
from iop.errors import ConfigError

__all__ = ["add_parser", "add_where_arguments", "admin_where"]

# The edge answers once its reload is done: reading a file and swapping a
# few objects, well under a second; the rest is a loaded machine.
DEFAULT_TIMEOUT_S: Final = 30.0
# Where an edge listens with no config (iop.config.EdgeServer's defaults).
_DEFAULT_HOST: Final = "127.0.0.1"
_DEFAULT_PORT: Final = 8080
# An edge listening on every interface is asked on loopback.
_ANY: Final = frozenset({"0.0.0.0", "::", ""})

_EPILOG = """\
examples:
  iop reload --config configs/edge.toml        # POST /admin/reload to that edge
  iop reload --url http://edge:8080 --key "$IOP_ADMIN_KEY"
  iop reload --pid "$(pgrep -f 'iop node')"    # SIGHUP; the node logs what it did
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "reload",
        help="make a running edge, node or `iop up` re-read its config",
        description=(
            "Ask a running edge (or iop up) to re-read its config file and apply what "
            "changed (POST /admin/reload; prints the reply), or send SIGHUP to a process "
            "(--pid). Exit status: 0 applied or unchanged, 1 refused or unreachable."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_where_arguments(p)
    p.add_argument(
        "--pid", type=int, help="send SIGHUP to this process instead (a node: it has no HTTP)"
    )
    p.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait for the reply"
    )
    p.set_defaults(func=_cmd_reload)


def add_where_arguments(p: argparse.ArgumentParser) -> None:
    """``--config``, ``--url``, ``--key``: which edge to ask, with what admin key
    (``admin_where``)."""
    p.add_argument(
        "--config",
        metavar="FILE",
        help="the edge's (or iop up's) config: where to ask, with what key",
    )
    p.add_argument("--url", help="the edge's base URL (default: from --config)")
    p.add_argument(
        "--key",
        help="an admin key (default: $IOP_ADMIN_KEY, else the config's first admin key)",
    )


def _cmd_reload(args: argparse.Namespace) -> int:
    if args.pid is not None:
        try:
            os.kill(args.pid, signal.SIGHUP)
        except ProcessLookupError:
            print(f"iop reload: no process {args.pid}", file=sys.stderr)
            return 1
        except PermissionError:
            print(f"iop reload: not allowed to signal process {args.pid}", file=sys.stderr)
            return 1
        print(f"sent SIGHUP to {args.pid}: it logs what it applied", flush=True)
        return 0
    url, key = admin_where(args)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with httpx.Client(timeout=args.timeout, trust_env=False) as client:
            reply = client.post(f"{url.rstrip('/')}/admin/reload", headers=headers)
    except httpx.HTTPError as exc:
        print(f"iop reload: cannot reach {url}: {exc}", file=sys.stderr)
        return 1
    if reply.status_code in (200, 422):
        print(reply.text, flush=True)
        return 0 if reply.status_code == 200 else 1
    print(f"iop reload: {url} answered {reply.status_code}: {scrub(reply.text)}", file=sys.stderr)
    return 1


def admin_where(
    args: argparse.Namespace, ways: str = "--url, --config or --pid"
) -> tuple[str, str | None]:
    """The edge's URL and the admin key to present (``add_where_arguments``).

    Raises:
        ConfigError: Neither ``--url`` nor a readable ``--config`` says where.
    """
    server: dict[str, Any] = {}
    if args.config:
        try:
            raw = read_config_file(args.config)
        except ConfigError as exc:
            raise ConfigError(
                f"{exc.message}; pass --url and --key to ask the edge anyway"
            ) from exc
        table = raw.get("edge", raw) if isinstance(raw.get("edge"), dict) else raw
        found = table.get("server", {})
        server = found if isinstance(found, dict) else {}
    elif not args.url:
        raise ConfigError(f"say which edge to ask: {ways}")
    url = args.url
    if not url:
        host = str(server.get("host", _DEFAULT_HOST))
        host = "127.0.0.1" if host in _ANY else host
        url = f"http://{host}:{server.get('port', _DEFAULT_PORT)}"
    key = args.key or os.environ.get("IOP_ADMIN_KEY")
    if not key:
        keys = server.get("admin_keys") or []
        if keys and isinstance(keys, list):
            key = str(expand_env(keys[0], where="server.admin_keys[0]"))
    return url, key
