"""The optional dependencies (the extras of ``pyproject.toml``) and the one
error a config that needs a missing one gets.

A config is checked before anything starts (``iop up``, ``iop edge``,
``iop node``): a key that needs an extra which is not installed is a
``ConfigError`` (one line, exit 2) naming the install line, never a crash
from deep inside a running service. Sans-IO: only ``importlib.util``.
"""

from __future__ import annotations

import enum
import importlib.util
from typing import Final

from iop.errors import ConfigError

__all__ = ["DISTRIBUTION", "Extra", "install_line", "missing", "require"]

# The name on the Python package index ("iop" there is an unrelated project).
DISTRIBUTION: Final = "iop-platform"


class Extra(enum.Enum):
    """An extra of ``pyproject.toml``: its name and the modules it brings."""

    OTEL = ("otel", ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"))
    CLUSTER = ("cluster", ("coredis",))
    KVEVENTS = ("kvevents", ("zmq",))

    def __init__(self, extra: str, modules: tuple[str, ...]) -> None:
        self.extra = extra
        self.modules = modules


def install_line(extra: Extra) -> str:
    """What to run to install ``extra``."""
    return f"pip install '{DISTRIBUTION}[{extra.extra}]'"


def missing(extra: Extra) -> bool:
    """Whether a module of ``extra`` cannot be imported."""
    for name in extra.modules:
        try:
            if importlib.util.find_spec(name) is None:
                return True
        except ModuleNotFoundError:  # a parent package is missing
            return True
    return False


def require(extra: Extra, key: str) -> None:
    """Raise the ``ConfigError`` for config ``key`` when ``extra`` is missing."""
    if missing(extra):
        raise ConfigError(
            f"{key} needs the {extra.extra} extra, which is not installed: {install_line(extra)}"
        )
