"""A recording relay between an agent and the server under test (test-only).

``Relay`` is a threaded ``http.server`` on 127.0.0.1 that forwards every
request unchanged (method, path, query, headers but ``Host`` and hop-by-hop
ones, body) to ``upstream`` over ``http.client`` and streams the answer
back as it arrives (chunked), so an agent behind it behaves as it does
against the server directly: SSE events reach it one by one. It records
each request (``Exchange``: headers as sent, the body, the status), so that
a test can read what an agent sent *through* IOP, e.g. the session id
header Claude Code repeats on every request of a session, and check that
every request of a session reached the server.
"""

from __future__ import annotations

import http.client
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final
from urllib.parse import urlsplit

__all__ = ["Exchange", "Relay"]

# Headers that belong to one connection (RFC 9110 §7.6.1), and the ones
# http.client sets itself.
HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
# An agent's turn against a local server answers within seconds; this bounds
# one upstream read so a stuck server fails the test instead of hanging it.
UPSTREAM_TIMEOUT_S: Final = 60.0
# Bytes read from the upstream per chunk forwarded.
CHUNK_BYTES: Final = 65536


@dataclass(frozen=True)
class Exchange:
    """One request the relay forwarded."""

    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    status: int

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    def json(self) -> Any:
        return json.loads(self.body)


class Relay:
    """Forward to ``upstream`` (``http://host:port``); ``url`` is where agents connect."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"the relay forwards to http://host:port, not {upstream!r}")
        self._upstream = (parts.hostname, parts.port)
        self._lock = threading.Lock()
        self._exchanges: list[Exchange] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def exchanges(self) -> list[Exchange]:
        with self._lock:
            return list(self._exchanges)

    def __enter__(self) -> Relay:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _record(self, exchange: Exchange) -> None:
        with self._lock:
            self._exchanges.append(exchange)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        relay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = [(k, v) for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP]
                upstream = http.client.HTTPConnection(*relay._upstream, timeout=UPSTREAM_TIMEOUT_S)
                try:
                    upstream.putrequest(self.command, self.path, skip_accept_encoding=True)
                    for key, value in headers:
                        upstream.putheader(key, value)
                    upstream.putheader("Content-Length", str(len(body)))
                    upstream.endheaders(body)
                    answer = upstream.getresponse()
                    relay._record(
                        Exchange(self.command, self.path, tuple(headers), body, answer.status)
                    )
                    self.send_response(answer.status, answer.reason)
                    for key, value in answer.getheaders():
                        if key.lower() not in HOP_BY_HOP:
                            self.send_header(key, value)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    while chunk := answer.read1(CHUNK_BYTES):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                finally:
                    upstream.close()

            do_GET = do_POST = do_PUT = do_DELETE = _forward

        return Handler
