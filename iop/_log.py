"""Logging set-up: one line per record, key=value friendly, secrets redacted.

Every record goes through two filters before it is written (message, args,
exception text and traceback alike, since they are applied to the formatted
record):

* ``iop._secrets.mask``: the configured secret values (API keys, node tokens,
  instance header values), wherever they appear;
* ``redact``: the values of secret-looking keys (``Authorization: Basic ...``,
  ``api_key=...``, ``"token": "..."``), credentials in URLs
  (``user:pass@host``), and credentials with no key in front of them
  (``Bearer <token>``, ``Basic <base64 of user:pass>``, ``sk-...`` keys).
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
import sys
from typing import Final

from iop._secrets import MASK, mask

__all__ = ["configure_logging", "redact", "scrub"]

# Keys whose value never reaches a log line, then the separator, then an
# optional opening quote (the value's end is found by ``_value_end``).
# Separators: ``key: v``, ``key=v``, ``"key": "v"``, ``'key': 'v'``, JSON in a
# JSON string (``\"key\": \"v\"``) and header tuples (``(b'key', b'v')``).
_SECRET_KEY: Final = re.compile(
    r"(?i)(?<![\w.-])[\w.-]*?"
    r"(?:authorization|api[-_]?key|access[-_]?key|token|secret|password|passwd)"
    r"(?:\\?['\"]?[ \t]*[:=][ \t]*|\\?['\"][ \t]*,[ \t]*b?(?=\\?['\"]))"
    r"(?P<q>\\?['\"])?"
)
# An unquoted value: one run up to a delimiter of the text around it.
_UNQUOTED: Final = re.compile(r"[^\s'\"\\,;&<>(){}\[\]]+")
# An authentication scheme kept readable in front of its credential.
_SCHEME: Final = re.compile(
    r"(?i)(?:bearer|basic|token|digest|apikey|api-key|key|negotiate|ntlm)[ \t]+(?=\S)"
)
# ``scheme://user:password@host``: the password goes.
_URL_PASSWORD: Final = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/\s:@'\"]+):([^/\s@'\"]+)@")
# Credentials with no key in front (a backend echoing the header it refused).
_BEARER: Final = re.compile(r"(?i)\b(bearer[ \t]+)([A-Za-z0-9._~+/-]{8,}=*)")
_BASIC: Final = re.compile(r"(?i)\b(basic[ \t]+)([A-Za-z0-9+/]{8,}={0,2})")
_OPENAI_KEY: Final = re.compile(r"\bsk-[A-Za-z0-9_-]{16,}")

# What every match of the patterns above starts with or contains, for an
# ASCII line lower-cased: a key word followed by a character that can begin
# ``_SECRET_KEY``'s separator (``api_key`` and ``access-key`` end in
# ``key``), a scheme word, ``sk-``, or a URL's ``://`` with an ``@`` before
# the next space (its user part). A line with none of them cannot match any
# pattern, and skips them all: nearly every line the hot path logs ("run ...
# complete finish=stop out_tokens=64 ...") costs 2-3 us here instead of
# 17-26 us (docs/benchmarks.md, "Fixed cost and the first chunk at c=1
# (second pass)"). Non-ASCII
# text always takes the full path: ``(?i)`` matches U+212A (Kelvin sign) for
# ``k`` and U+017F (long s) for ``s``, which ``str.lower`` does not map so.
_MAY_MATCH: Final = re.compile(
    r"(?:authorization|key|token|secret|password|passwd)[\\'\": \t=]|bearer|basic|sk-"
    r"|://[^\s@]*@"
)


def _value_end(text: str, start: int, quote: str | None) -> int:
    """Where the value starting at ``start`` ends (exclusive)."""
    if quote is None:
        scheme = _SCHEME.match(text, start)
        m = _UNQUOTED.match(text, scheme.end() if scheme else start)
        return m.end() if m else start
    if len(quote) == 2:  # an escaped quote: JSON inside a JSON string
        end = text.find(quote, start)
    else:
        end, i = -1, start
        while i < len(text) and text[i] != "\n":
            if text[i] == "\\":
                i += 2
                continue
            if text[i] == quote:
                end = i
                break
            i += 1
    if end < 0:  # unterminated: the rest of the line
        newline = text.find("\n", start)
        end = len(text) if newline < 0 else newline
    return end


def _redact_keyed(text: str) -> str:
    out: list[str] = []
    pos = 0
    while (m := _SECRET_KEY.search(text, pos)) is not None:
        start = m.end()
        end = _value_end(text, start, m.group("q"))
        scheme = _SCHEME.match(text, start, end)
        keep = scheme.end() if scheme else start
        if end <= keep:  # nothing to hide (an empty value)
            out.append(text[pos:start])
            pos = start
            continue
        out.append(text[pos:keep])
        out.append(MASK)
        pos = end
    out.append(text[pos:])
    return "".join(out)


def _bearer(m: re.Match[str]) -> str:
    # "Bearer tokens are..." is prose; a token has a digit or a symbol.
    return m.group(0) if m.group(2).isalpha() else m.group(1) + MASK


def _basic(m: re.Match[str]) -> str:
    # Only base64 of "user:pass" is a credential; "Basic configuration" is prose.
    cred = m.group(2)
    try:
        plain = base64.b64decode(cred + "=" * (-len(cred) % 4), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return m.group(0)
    return m.group(1) + MASK if ":" in plain else m.group(0)


def may_hold_secret(text: str) -> bool:
    """False only when no pattern of ``redact`` can match ``text`` (its fast path)."""
    return not text.isascii() or _MAY_MATCH.search(text.lower()) is not None


def redact(text: str) -> str:
    """Mask the values of secret-looking keys and credential-looking text in ``text``."""
    if not may_hold_secret(text):
        return text
    return _redact_all(text)


def _redact_all(text: str) -> str:
    """``redact`` without its fast path: every pattern, in order."""
    text = _redact_keyed(text)
    text = _URL_PASSWORD.sub(lambda m: f"{m.group(1)}:{MASK}@", text)
    text = _BEARER.sub(_bearer, text)
    text = _BASIC.sub(_basic, text)
    return _OPENAI_KEY.sub(f"sk-{MASK}", text)


def scrub(text: str) -> str:
    """``text`` as a log line would show it: registered secrets masked, then ``redact``.

    For what a command prints outside the log (start-up lines, errors).
    """
    return redact(mask(text))


class _RedactingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        # Configured secrets first: redact may cut a value at a delimiter the
        # secret itself contains, and the rest would then not match.
        return scrub(super().format(record))


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
