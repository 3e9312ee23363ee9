"""deploy/proxy/Caddyfile: Caddy terminating TLS in front of the edge.

Caddy's own parser checks the file where Caddy is installed (Debian: apt-get
install caddy); everywhere, the upstream is the edge's port and the health
check its ``/readyz`` (docs/deploying.md, "A terminating proxy in front").
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from iop.config import EdgeConfig
from tests.deploy._deploy import DEPLOY, load

CADDYFILE = DEPLOY / "proxy" / "Caddyfile"


@pytest.mark.skipif(shutil.which("caddy") is None, reason="caddy is not installed")
def test_caddy_accepts_the_file() -> None:
    done = subprocess.run(
        ["caddy", "adapt", "--adapter", "caddyfile", "--config", str(CADDYFILE), "--validate"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_the_proxy_sends_to_the_edge_and_asks_its_readyz() -> None:
    text = CADDYFILE.read_text()
    port = load(DEPLOY / "config" / "edge.toml", EdgeConfig).server.port
    upstream = re.search(r"^\s*reverse_proxy (\S+):(\d+) \{", text, re.M)
    assert upstream is not None
    assert int(upstream.group(2)) == port
    assert re.search(r"^\s*health_uri /readyz$", text, re.M)
    # SSE: every chunk is flushed as the edge writes it.
    assert re.search(r"^\s*flush_interval -1$", text, re.M)
