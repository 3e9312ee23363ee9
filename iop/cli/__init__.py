"""The ``iop`` command: one entry point, a subcommand per process kind."""

from __future__ import annotations

from iop.cli._main import build_parser, main

__all__ = ["build_parser", "main"]
