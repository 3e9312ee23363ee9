"""Recorded backend transcripts, loaded byte for byte.

Two kinds of files live in ``iop/testing/transcripts/`` (its ``README.md``
says where each came from, and which were written from documentation):

* **Raw bodies** (``vllm_*.txt``, ``llamacpp_stream.txt``, ``hermes_*.txt``,
  ...): the exact bytes of one response body. ``transcript_body(name)``
  returns the file itself.
* **Captures** (``real-*.txt``): terminal sessions against a real server,
  made of records like::

      # captured <when> on <where>
      $ curl -sS -i [-w '<trailer>'] http://...
      HTTP/1.1 200 OK\\r\\n            <- only with curl -i
      Header: value\\r\\n
      \\r\\n
      <body, de-chunked by curl>
      <curl -w trailer, if any>
      \\n                               <- added by the capture script

  Sections may be introduced by ``## `` lines. ``parse_capture`` splits such a
  file into ``CapturedExchange`` records and recovers each body exactly:
  ``Content-Length`` when the response has one, otherwise everything up to
  the next record minus the capture script's newline and curl's ``-w``
  trailer (both formats used there start with ``\\n``).

Parsing is sans-IO (bytes in, structs out); only ``load_transcript`` reads
package data, through ``importlib.resources`` so it works from a wheel too.
"""

from __future__ import annotations

import re
from importlib.resources import files
from typing import Final

import msgspec

__all__ = [
    "CapturedExchange",
    "captured_exchanges",
    "is_capture",
    "list_transcripts",
    "load_transcript",
    "parse_capture",
    "transcript_body",
]

_PACKAGE: Final = "iop.testing"
_DIRECTORY: Final = "transcripts"
# Provenance of the files, in particular of those not captured from a server.
_README: Final = "README.md"

_RECORD_START: Final = b"# captured "
_SECTION_START: Final = b"## "
_COMMAND_PREFIX: Final = b"$ "
_STATUS_LINE: Final = re.compile(rb"HTTP/1\.[01] (\d{3})(?: ([^\r\n]*))?\r?\n")
# curl -w formats used by the capture script, e.g. '\nHTTP %{http_code}\n'
# and '\n--- curl: http=%{http_code} ...\n'; each starts with its own newline.
_CURL_TRAILER: Final = re.compile(rb"\n(?:--- curl: [^\n]*|HTTP \d{3})\n\Z")


class CapturedExchange(msgspec.Struct, frozen=True, kw_only=True):
    """One command of a capture and what the server answered.

    Attributes:
        command: The shell command line, without its ``$ `` prompt.
        status: The HTTP status, when the capture shows headers (``curl -i``).
        reason: The status line's reason phrase.
        headers: Response headers in order, names as sent.
        body: The response body exactly as the server sent it (de-chunked).
    """

    command: str
    status: int | None = None
    reason: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (case-insensitive), if present."""
        low = name.lower()
        return next((v for k, v in self.headers if k.lower() == low), None)


def list_transcripts() -> list[str]:
    """Names of every transcript shipped with ``iop.testing``, sorted (not the README)."""
    root = files(_PACKAGE).joinpath(_DIRECTORY)
    return sorted(
        p.name
        for p in root.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.name != _README
    )


def load_transcript(name: str) -> bytes:
    """The raw bytes of transcript ``name``.

    Raises:
        FileNotFoundError: No transcript has that name.
    """
    if "/" in name or "\\" in name or name.startswith("."):
        raise FileNotFoundError(f"not a transcript name: {name!r}")
    return files(_PACKAGE).joinpath(_DIRECTORY, name).read_bytes()


def is_capture(data: bytes) -> bool:
    """True for a terminal capture (``real-*`` files), False for a raw body."""
    return data.startswith((_RECORD_START, _SECTION_START, _COMMAND_PREFIX))


def _lines(data: bytes) -> list[bytes]:
    # Split on LF only, keeping terminators: bodies may hold CR or other
    # bytes that bytes.splitlines() would treat as line ends.
    out = data.split(b"\n")
    lines = [line + b"\n" for line in out[:-1]]
    if out[-1]:
        lines.append(out[-1])
    return lines


def _parse_record(command: str, output: bytes) -> CapturedExchange:
    # The capture script ends every command's output with one newline.
    if output.endswith(b"\n"):
        output = output[:-1]
    if " -w " in command or " --write-out " in command:
        output = _CURL_TRAILER.sub(b"", output, count=1)
    status_match = _STATUS_LINE.match(output)
    if status_match is None:
        return CapturedExchange(command=command, body=output)
    status = int(status_match.group(1))
    reason = (status_match.group(2) or b"").decode("latin-1").strip()
    headers: list[tuple[str, str]] = []
    pos = status_match.end()
    while True:
        end = output.find(b"\n", pos)
        if end < 0:  # headers never ended: no body
            pos = len(output)
            break
        line = output[pos:end].rstrip(b"\r")
        pos = end + 1
        if not line:
            break
        name, _, value = line.partition(b":")
        headers.append((name.decode("latin-1").strip(), value.decode("latin-1").strip()))
    body = output[pos:]
    exchange = CapturedExchange(
        command=command, status=status, reason=reason, headers=tuple(headers), body=body
    )
    length = exchange.header("content-length")
    if length is not None and length.isdigit():
        exchange = msgspec.structs.replace(exchange, body=body[: int(length)])
    return exchange


def parse_capture(data: bytes) -> list[CapturedExchange]:
    """Split a terminal capture into its ``curl`` exchanges, in order.

    Records whose command is not ``curl`` (``cat`` of a request file, ...)
    are skipped, so ``index`` in ``transcript_body`` counts HTTP exchanges.
    """
    exchanges: list[CapturedExchange] = []
    command: str | None = None
    output: list[bytes] = []
    expecting_command = False

    def flush() -> None:
        if command is not None and command.startswith("curl "):
            exchanges.append(_parse_record(command, b"".join(output)))

    for line in _lines(data):
        if line.startswith((_RECORD_START, _SECTION_START)):
            flush()
            command, output = None, []
            expecting_command = line.startswith(_RECORD_START)
        elif expecting_command and line.startswith(_COMMAND_PREFIX):
            command = line[len(_COMMAND_PREFIX) :].rstrip(b"\r\n").decode("utf-8", "replace")
            expecting_command = False
        elif command is not None:
            output.append(line)
    flush()
    return exchanges


def captured_exchanges(name: str) -> list[CapturedExchange]:
    """The ``curl`` exchanges of capture ``name`` (see ``parse_capture``)."""
    return parse_capture(load_transcript(name))


def transcript_body(name: str, index: int = 0) -> bytes:
    """The ``index``-th response body of a transcript, byte for byte.

    For a raw-body transcript, the file itself is the one body (index 0).

    Raises:
        IndexError: The transcript has no such exchange.
    """
    data = load_transcript(name)
    if not is_capture(data):
        if index != 0:
            raise IndexError(f"{name} is a single raw body; index {index} does not exist")
        return data
    exchanges = parse_capture(data)
    if not -len(exchanges) <= index < len(exchanges):
        raise IndexError(f"{name} has {len(exchanges)} exchanges; no index {index}")
    return exchanges[index].body
