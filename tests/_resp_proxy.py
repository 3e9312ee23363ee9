"""A TCP proxy in front of a real ``valkey-server`` that can lie.

It forwards every command faithfully, one at a time per connection (a
command, then the server's one reply, framed by ``reply_length``), until a
test calls ``answer`` with a rule: then each command the rule picks is
answered by the proxy itself with the bytes the rule returns, and never
reaches the server. What Valkey (or whatever listens on its port) could
send: a reply of another shape, an error, a nil, garbage that is not RESP,
a reply that never ends. ``answer(None)`` forwards faithfully again.

Runs on threads (one per connection), so both a trio test and a sync
module fixture can use it; ``stop`` closes every socket and joins.
The framing follows the RESP3 specification
(https://github.com/redis/redis-specifications/blob/master/protocol/RESP3.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

# What a script may be answered instead of its own reply: each a fault the
# edge must take as it takes a socket error.
FAULTS: Final = {
    "array-for-integer": b"*2\r\n:1\r\n:2\r\n",
    "bulk-string": b"$1\r\n3\r\n",
    "error": b"-ERR boom\r\n",
    "noscript": b"-NOSCRIPT No matching script. Please use EVAL.\r\n",
    "nil": b"_\r\n",
    "resp2-nil": b"$-1\r\n",
    "huge-integer": b":" + b"9" * 40 + b"\r\n",
    "zero": b":0\r\n",
    "boolean": b"#t\r\n",
    "double": b",2.5\r\n",
    "map": b"%1\r\n+a\r\n:1\r\n",
    "nine-junk-strings": b"*9\r\n" + b"$3\r\nabc\r\n" * 9,
    "nine-zeros": b"*9\r\n" + b":0\r\n" * 9,
    "nine-with-nan": b"*9\r\n:1\r\n"
    + b"$3\r\nnan\r\n" * 4
    + b":0\r\n"
    + b"$1\r\n0\r\n" * 2
    + b":0\r\n",
    "garbage": b"HTTP/1.1 400 Bad Request\r\n\r\n",
    "never-ends": b"$1048576\r\nabc",
}

# A rule: the command's arguments (``[b"EVALSHA", sha, numkeys, ...]``) ->
# the bytes to answer instead of the server, or None to forward it.
Rule = Callable[[list[bytes]], bytes | None]

# Line types: one line to CRLF. Bulk types: a length line, then the bytes.
_LINE = b"+-:_,#("
_BULK = b"$=!"
_AGGREGATE = b"*~>"
_PAIRS = b"%|"


def reply_length(buf: bytes, start: int = 0) -> int | None:
    """The end offset of the one RESP2/RESP3 value at ``start``; None if incomplete.

    Raises:
        ValueError: ``buf`` is not RESP at ``start``.
    """
    nl = buf.find(b"\r\n", start)
    if nl < 0:
        return None
    kind, head = buf[start : start + 1], buf[start + 1 : nl]
    end = nl + 2
    if kind and kind in _LINE:
        return end
    if kind and kind in _BULK:
        n = int(head)
        if n < 0:
            return end
        return end + n + 2 if len(buf) >= end + n + 2 else None
    if kind and kind in _AGGREGATE + _PAIRS:
        n = int(head)
        count = max(0, n) * (2 if kind in _PAIRS else 1)
        for _ in range(count):
            nxt = reply_length(buf, end)
            if nxt is None:
                return None
            end = nxt
        if kind == b"|":  # attributes precede the value they describe
            return reply_length(buf, end)
        return end
    raise ValueError(f"not RESP: {buf[start : start + 16]!r}")


def command_args(frame: bytes) -> list[bytes]:
    """The arguments of one command sent as a RESP array of bulk strings."""
    args: list[bytes] = []
    nl = frame.find(b"\r\n")
    pos = nl + 2
    for _ in range(int(frame[1:nl])):
        nl = frame.find(b"\r\n", pos)
        n = int(frame[pos + 1 : nl])
        args.append(frame[nl + 2 : nl + 2 + n])
        pos = nl + 2 + n + 2
    return args


def runs_script(args: list[bytes], script: str) -> bool:
    """Whether the command runs ``script`` (``EVALSHA`` of its SHA1, or ``EVAL``)."""
    name = args[0].upper() if args else b""
    if name == b"EVALSHA":
        return args[1].decode() == hashlib.sha1(script.encode()).hexdigest()
    return name == b"EVAL" and args[1] == script.encode()


def scripts_rule(scripts: list[str], reply: bytes) -> Rule:
    """Answer ``reply`` to every run of one of ``scripts``; forward the rest."""

    def rule(args: list[bytes]) -> bytes | None:
        return reply if any(runs_script(args, s) for s in scripts) else None

    return rule


@dataclass
class RespProxy:
    """``127.0.0.1:port`` -> ``127.0.0.1:upstream_port``, lying on command."""

    upstream_port: int
    port: int = 0
    answered: int = 0  # commands the proxy answered itself
    _rule: Rule | None = None
    _listener: socket.socket | None = None
    _threads: list[threading.Thread] = field(default_factory=list)
    _sockets: list[socket.socket] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: bool = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port))
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._spawn(self._accept, listener)

    def answer(self, rule: Rule | None) -> None:
        """From the next command on, answer what ``rule`` picks (None: forward all)."""
        with self._lock:
            self._rule = rule

    def drop_connections(self) -> None:
        """Close every client connection (the listener stays)."""
        with self._lock:
            socks = [s for s in self._sockets if s is not self._listener]
            self._sockets = [s for s in self._sockets if s is self._listener]
        for s in socks:
            _close(s)

    def stop(self) -> None:
        with self._lock:
            self._closed = True
            socks, self._sockets = self._sockets, []
        if self._listener is not None:
            _close(self._listener)
        for s in socks:
            _close(s)
        for t in self._threads:
            t.join(10)

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _track(self, s: socket.socket) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._sockets.append(s)
            return True

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            if not (self._track(client) and self._track(upstream)):
                _close(client)
                _close(upstream)
                return
            self._spawn(self._serve, client, upstream)

    def _serve(self, client: socket.socket, upstream: socket.socket) -> None:
        pending = b""
        replies = b""
        try:
            while True:
                end = reply_length(pending) if pending else None
                if end is None:
                    data = client.recv(65536)
                    if not data:
                        return
                    pending += data
                    continue
                frame, pending = pending[:end], pending[end:]
                with self._lock:
                    rule = self._rule
                fake = rule(command_args(frame)) if rule is not None else None
                if fake is not None:
                    with self._lock:
                        self.answered += 1
                    client.sendall(fake)
                    continue
                upstream.sendall(frame)
                while (n := reply_length(replies) if replies else None) is None:
                    data = upstream.recv(65536)
                    if not data:
                        return
                    replies += data
                client.sendall(replies[:n])
                replies = replies[n:]
        except (OSError, ValueError):
            return
        finally:
            _close(client)
            _close(upstream)


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    s.close()
