"""``iop`` argument parsing and dispatch.

Each subcommand lives in its own module exposing ``add_parser(subparsers)``,
which registers the subcommand and sets ``func`` (a callable taking the parsed
namespace and returning an exit code).

Exit statuses: 0 success (and a clean drain after SIGINT/SIGTERM), 1 a
command's own failure (``iop run``, ``iop probe``), 2 a usage or config
error or an address that cannot be bound, 130/143 a second SIGINT/SIGTERM
that stopped a drain at once (see ``iop.cli._signals``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from iop import __version__
from iop._log import configure_logging, scrub
from iop.errors import ConfigError, ListenError, first_leaf

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iop",
        description="IOP: an open inference orchestration platform.",
    )
    parser.add_argument("--version", action="version", version=f"iop {__version__}")
    _add_log_level(parser, default="info")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from iop.bench import _cli as _bench
    from iop.cli import _edge, _keys, _models, _node, _reload, _run, _sim, _up, _usage

    _up.add_parser(sub)
    _edge.add_parser(sub)
    _node.add_parser(sub)
    _sim.add_parser(sub)
    _run.add_parser(sub)
    _keys.add_parser(sub)
    _reload.add_parser(sub)
    _models.add_parser(sub)
    _usage.add_parser(sub)
    _bench.add_parser(sub)
    for command in sub.choices.values():
        # Also after the subcommand (`iop edge --log-level debug`); SUPPRESS
        # keeps a value given before it when this one is absent.
        _add_log_level(command, default=argparse.SUPPRESS)
    return parser


def _add_log_level(parser: argparse.ArgumentParser, *, default: str) -> None:
    parser.add_argument(
        "--log-level",
        default=default,
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (default: info)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``iop`` command; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    configure_logging(args.log_level)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"iop: config error: {scrub(str(exc))}", file=sys.stderr)
        return 2
    except ListenError as exc:
        print(f"iop: {_listen_advice(exc)}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as group:
        # A service that could not bind fails inside its nurseries.
        listen, rest = group.split(ListenError)
        if listen is not None and rest is None:
            print(f"iop: {_listen_advice(first_leaf(listen, ListenError))}", file=sys.stderr)
            return 2
        # A config fault found only once a service started (the CLI checks
        # what it can before): the same one line as one found before.
        config, rest = group.split(ConfigError)
        if config is not None and rest is None:
            print(
                f"iop: config error: {scrub(str(first_leaf(config, ConfigError)))}", file=sys.stderr
            )
            return 2
        if not isinstance(group, Exception):
            raise  # KeyboardInterrupt or SystemExit inside: not a crash
        logging.getLogger("iop").critical("iop %s crashed", args.command, exc_info=True)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception:
        # Through the log, not Python's default hook: the traceback may
        # carry a secret (an exception message echoing a backend's error).
        logging.getLogger("iop").critical("iop %s crashed", args.command, exc_info=True)
        return 1
    return code


def _listen_advice(exc: ListenError) -> str:
    if exc.in_use:
        port = exc.address.rsplit(":", 1)[-1]
        return (
            f"{exc}; stop the process that holds it (`ss -ltnp 'sport = :{port}'` shows it) "
            "or choose another port with --port (0 picks a free one)"
        )
    return f"{exc}; choose another address with --host/--port"
