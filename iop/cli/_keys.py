"""``iop keys``: make a client key for a tenant, and print its config.

``iop keys create NAME`` draws a new random key, prints the key once (to
stderr, or into ``--key-file`` with mode 0600) and the ``[[tenants]]``
table that admits it (to stdout, so it can be appended to an edge config;
with ``--up``, the ``[[edge.tenants]]`` table of ``iop up``'s config):
the config holds only the key's SHA-256, never the key (docs/operations.md,
"Tenants and limits"). ``iop keys hash`` prints the digest of a key read
from stdin, for keys made elsewhere. ``iop keys node NAME`` does the same for
a node: a fresh node token, and the ``[[link.nodes]]`` table that admits it
(docs/operations.md, "TLS and node credentials").

A key travels in an HTTP header (``Authorization: Bearer``, ``x-api-key``),
which the edge reads as Latin-1 and which carries no leading or trailing
white space (RFC 9110, section 5.5): ``hash`` refuses a key that is not
printable ASCII, or has white space at either end, since no client could
ever present it. Bad input (a key file that exists or cannot be made, no
key on stdin) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import sys
from typing import Any, Final

from iop.config import NodeCredential, TenantKey, TenantSettings
from iop.errors import ConfigError

__all__ = ["add_parser", "new_key", "node_toml", "tenant_toml"]

KEY_PREFIX = "iop-"
# 32 random bytes (256 bits), URL-safe base64: 43 characters after the prefix.
KEY_BYTES = 32


def new_key() -> str:
    """A fresh client key: ``iop-`` and 256 random bits."""
    return KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)


# Above the edge's table: where it goes, since iop up's config nests it.
_WHERE: Final = (
    "# for `iop edge --config`; `iop up --config` reads [[edge.tenants]] (iop keys create --up)"
)


def tenant_toml(t: TenantSettings, *, up: bool = False) -> str:
    """The ``[[tenants]]`` table of ``t``, as the edge config reads it.

    Args:
        t: The tenant.
        up: The ``[[edge.tenants]]`` table of ``iop up``'s config instead.
    """
    lines = ["[[edge.tenants]]"] if up else [_WHERE, "[[tenants]]"]
    lines.append(f"name = {json.dumps(t.name)}")
    if t.key_sha256:
        lines.append("key_sha256 = [" + ", ".join(json.dumps(d) for d in t.key_sha256) + "]")
    if t.keys:
        named = (
            f"{{sha256 = {json.dumps(k.sha256)}, name = {json.dumps(k.name)}}}" for k in t.keys
        )
        lines.append("keys = [" + ", ".join(named) + "]")
    if t.models:
        lines.append("models = [" + ", ".join(json.dumps(m) for m in t.models) + "]")
    for key in ("requests_per_minute", "tokens_per_minute", "max_concurrent_runs"):
        value = getattr(t, key)
        if value:
            lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"


def node_toml(n: NodeCredential) -> str:
    """The ``[[link.nodes]]`` table of ``n``, as the edge config reads it."""
    lines = ["[[link.nodes]]", f"name = {json.dumps(n.name)}"]
    lines.append(f"token_sha256 = {json.dumps(n.token_sha256)}")
    if n.node_ids:
        lines.append("node_ids = [" + ", ".join(json.dumps(i) for i in n.node_ids) + "]")
    return "\n".join(lines) + "\n"


def _write_secret(path: str, value: str) -> bool:
    """Write ``value`` into a new file of mode 0600; False (said on stderr) if it cannot."""
    try:
        # O_EXCL: never over another key (nor through a symlink planted there).
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        print(
            f"iop keys: {path} exists: a key file is never overwritten; "
            "choose another path (nothing was made)",
            file=sys.stderr,
        )
        return False
    except OSError as exc:
        print(
            f"iop keys: cannot make {path}: {exc.strerror or exc} (nothing was made)",
            file=sys.stderr,
        )
        return False
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return True


def _node(args: argparse.Namespace) -> int:
    token = new_key()
    try:
        cred = NodeCredential(
            name=args.name,
            token_sha256=hashlib.sha256(token.encode()).hexdigest(),
            node_ids=args.node_id or [],
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if args.token_file:
        if not _write_secret(args.token_file, token):
            return 2
        print(
            f"iop keys: the token of node credential {cred.name} is in {args.token_file}",
            file=sys.stderr,
        )
    else:
        print(
            f"iop keys: the token of node credential {cred.name} (shown once; the edge keeps "
            f"only its SHA-256; put it in the node's [[node.edges]] token):\n{token}",
            file=sys.stderr,
        )
    sys.stdout.write(node_toml(cred))
    return 0


def _create(args: argparse.Namespace) -> int:
    key = new_key()
    digest = hashlib.sha256(key.encode()).hexdigest()
    try:
        tenant = TenantSettings(
            name=args.name,
            key_sha256=[] if args.key_name else [digest],
            keys=[TenantKey(sha256=digest, name=args.key_name)] if args.key_name else [],
            models=args.model or [],
            requests_per_minute=args.rpm,
            tokens_per_minute=args.tpm,
            max_concurrent_runs=args.concurrency,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if args.key_file:
        if not _write_secret(args.key_file, key):
            return 2
        print(f"iop keys: the key of tenant {tenant.name} is in {args.key_file}", file=sys.stderr)
    else:
        print(
            f"iop keys: the key of tenant {tenant.name} (shown once; the config keeps only "
            f"its SHA-256):\n{key}",
            file=sys.stderr,
        )
    sys.stdout.write(tenant_toml(tenant, up=args.up))
    return 0


def _printable_ascii(key: str) -> bool:
    return all(" " <= c <= "~" for c in key) and key == key.strip()


def _hash(args: argparse.Namespace) -> int:
    # Bytes, decoded here: a terminal's encoding must not change the digest.
    line = sys.stdin.buffer.readline() if sys.stdin is not None else b""
    key = line.rstrip(b"\r\n").decode("latin-1")
    if not key.strip():
        print("iop keys hash: no key on stdin", file=sys.stderr)
        return 2
    if not _printable_ascii(key):
        print(
            "iop keys hash: a key is printable ASCII with no white space at either end "
            "(it travels in an HTTP header); no client could send this one",
            file=sys.stderr,
        )
        return 2
    print(f'key_sha256 = ["{hashlib.sha256(key.encode()).hexdigest()}"]')
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "keys",
        help="make client keys for tenants and print their config",
        description=(
            "Client keys for the edge's tenants. The edge config holds each key's "
            "SHA-256 only (`[[tenants]] key_sha256`), never the key itself."
        ),
    )
    keys = p.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    c = keys.add_parser(
        "create",
        help="draw a new key; print it once and the [[tenants]] table that admits it",
        description=(
            "Draw a new random key (iop- and 256 random bits). The key goes to stderr "
            "(or --key-file, created with mode 0600); the [[tenants]] table goes to "
            "stdout, ready to append to the edge config: "
            "`iop keys create team-a --rpm 600 >> edge.toml` (iop up's config: "
            "`--up >> up.toml`, the [[edge.tenants]] table). Limits of 0 are no limit."
        ),
    )
    c.add_argument("name", help="the tenant's name (letters, digits, _.-; in logs and metrics)")
    c.add_argument("--rpm", type=int, default=0, help="requests per minute (default: no limit)")
    c.add_argument(
        "--tpm", type=int, default=0, help="input + output tokens per minute (default: no limit)"
    )
    c.add_argument("--concurrency", type=int, default=0, help="runs at once (default: no limit)")
    c.add_argument(
        "--model",
        action="append",
        metavar="MODEL",
        help="a model the tenant may use (repeat; default: every model)",
    )
    c.add_argument(
        "--key-name",
        metavar="NAME",
        help="name the key (`keys = [{sha256, name}]`): the usage ledger records runs by it",
    )
    c.add_argument("--key-file", metavar="PATH", help="write the key here (mode 0600) instead")
    c.add_argument(
        "--up",
        action="store_true",
        help="print the [[edge.tenants]] table of iop up's config (default: [[tenants]], "
        "the table of iop edge's config)",
    )
    c.set_defaults(func=_create)
    h = keys.add_parser(
        "hash",
        help="print the key_sha256 line of a key read from stdin",
        description="Read one key from stdin and print its `key_sha256` config line.",
    )
    h.set_defaults(func=_hash)
    n = keys.add_parser(
        "node",
        help="draw a node token; print it once and the [[link.nodes]] table that admits it",
        description=(
            "Draw a new random node token. The token goes to stderr (or --token-file, "
            "created with mode 0600), for the node's [[node.edges]] token; the "
            "[[link.nodes]] table goes to stdout, ready to append to the edge config: "
            "`iop keys node gpu-a --node-id gpu-a >> edge.toml`."
        ),
    )
    n.add_argument("name", help="the credential's name (letters, digits, _.-; in the edge's log)")
    n.add_argument(
        "--node-id",
        action="append",
        metavar="ID",
        help="a node id the credential may claim (repeat; default: any)",
    )
    n.add_argument("--token-file", metavar="PATH", help="write the token here (mode 0600) instead")
    n.set_defaults(func=_node)
