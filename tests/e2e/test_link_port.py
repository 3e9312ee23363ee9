"""The node link on a port of its own (``link.port``), end to end (real processes).

docs/operations.md, "The link's own port": with ``link.port`` set the edge
prints the link's own URL, a node dialling it serves requests as usual, the
API port refuses the link (404) and the link port serves no API.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.e2e._platform import MODEL, Procs, Sim, read_stream

pytestmark = pytest.mark.slow

MESSAGES: list[Any] = [{"role": "user", "content": "Tell me a story."}]


# A node's upgrade request (RFC 6455 §4.1), sent with httpx: trio-websocket
# 0.12.2 leaves the socket of a refused upgrade open.
UPGRADE = {
    "Connection": "Upgrade",
    "Upgrade": "websocket",
    "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
    "Sec-WebSocket-Version": "13",
}


def test_a_node_on_the_link_port_serves_a_request(procs: Procs, sim: Sim) -> None:
    edge = procs.edge({"link": {"port": 0}, "server": {"keepalive_interval_s": 0.5}})
    link_port = int(edge.link_url.removesuffix("/v1/link").rsplit(":", 1)[1])
    assert link_port != edge.port
    procs.node([edge], sim, node_id="n1")
    edge.wait_ready(node_id="n1")
    with (
        edge.openai() as client,
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            stream=True,
            extra_body={"iop_sim": {"output_tokens": 12}},
        ) as stream,
    ):
        r = read_stream(stream)
    assert r.finish_reason == "stop"
    assert len(r.content_deltas) == 12
    (node,) = edge.admin()["nodes"]
    assert node["id"] == "n1"

    # The API port serves no link; the link port no API.
    refused = httpx.get(f"{edge.url}/v1/link", headers=UPGRADE, trust_env=False)
    assert refused.status_code == 404
    assert "its own port (link.port)" in refused.json()["error"]["message"]
    resp = httpx.get(f"http://127.0.0.1:{link_port}/v1/models", trust_env=False)
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "not_found"
