"""``iop`` argument parsing and dispatch.

Each subcommand lives in its own module exposing ``add_parser(subparsers)``,
which registers the subcommand and sets ``func`` (a callable taking the parsed
namespace and returning an exit code).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from iop import __version__
from iop._log import configure_logging, scrub
from iop.errors import ConfigError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iop",
        description="IOP: an open inference orchestration platform.",
    )
    parser.add_argument("--version", action="version", version=f"iop {__version__}")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (default: info)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from iop.cli import _edge, _node, _run, _sim, _up

    _up.add_parser(sub)
    _edge.add_parser(sub)
    _node.add_parser(sub)
    _sim.add_parser(sub)
    _run.add_parser(sub)
    return parser


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
    except KeyboardInterrupt:
        return 130
    except Exception:
        # Through the log, not Python's default hook: the traceback may
        # carry a secret (an exception message echoing a backend's error).
        logging.getLogger("iop").critical("iop %s crashed", args.command, exc_info=True)
        return 1
    return code
