"""Logging set-up: one line per record, key=value friendly, secrets redacted."""

from __future__ import annotations

import logging
import re
import sys
from typing import Final

__all__ = ["configure_logging", "redact"]

# Values of these header/field names never reach a log line.
_SECRET: Final = re.compile(
    r"(?i)(authorization|api[-_]?key|x-api-key|token|secret|password)(['\"]?\s*[:=]\s*['\"]?)"
    r"(bearer\s+)?([^\s'\",}]+)"
)


def redact(text: str) -> str:
    """Mask the values of secret-looking keys in ``text``."""
    return _SECRET.sub(lambda m: f"{m.group(1)}{m.group(2)}{m.group(3) or ''}***", text)


class _RedactingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def configure_logging(level: str = "info") -> None:
    """Log to stderr as ``time level logger: message``, redacting secrets."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        _RedactingFormatter("%(asctime)s %(levelname)-5s %(name)s: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # hypercorn's access log is noisy at info; errors still show.
    logging.getLogger("hypercorn.access").setLevel(logging.WARNING)
    # httpx logs every request at info: the node's periodic probes would flood.
    logging.getLogger("httpx").setLevel(logging.WARNING)
