"""The node link under abuse and at its limits, end to end (real processes).

docs/operations.md "Limits and abuse" / "The node link": a request body at
``server.max_body_bytes`` crosses the link without disturbing other runs; a
peer that has not said hello cannot make the edge buffer more than
``link.max_hello_bytes``; a text frame is a protocol error (4400); a live
node id cannot be taken over by a second connection.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tests.e2e._platform import MODEL, Procs, Sim, StreamResult, read_stream

pytestmark = pytest.mark.slow

MESSAGES: list[Any] = [{"role": "user", "content": "Tell me a story."}]


def test_a_max_size_body_does_not_break_other_streams(procs: Procs, sim: Sim) -> None:
    """docs/protocol.md "Limits": frames are sized from ``server.max_body_bytes``;
    a run whose Assign would not fit is refused alone, never by dropping the link."""
    edge = procs.edge({"server": {"keepalive_interval_s": 0.5}})  # max_body_bytes: 8 MiB
    procs.node([edge], sim, node_id="n1")
    edge.wait_ready(node_id="n1")
    limit = 8 * 1024 * 1024
    results: list[StreamResult | BaseException] = []

    def stream() -> None:
        try:
            with (
                edge.openai() as client,
                client.chat.completions.create(
                    model=MODEL,
                    messages=MESSAGES,
                    stream=True,
                    extra_body={"iop_sim": {"output_tokens": 40, "tokens_per_s": 20.0}},
                ) as s,
            ):
                results.append(read_stream(s))
        except BaseException as exc:  # reported below
            results.append(exc)

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    sim.wait_open(2)
    # Floats: 4 bytes of JSON each ("0.5,"), 9 bytes of msgpack: the Assign
    # frame is over twice the body.
    head = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "xs": [' % (
        MODEL.encode()
    )
    n = (limit - len(head) - 2) // 4
    body = head + b"0.5," * (n - 1) + b"0.5]}"
    assert len(body) <= limit
    resp = edge.post(
        "/v1/chat/completions",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=60.0,
    )
    for t in threads:
        t.join(60)
    assert resp.status_code in (200, 413), resp.text
    for r in results:
        assert isinstance(r, StreamResult), r
        assert r.finish_reason == "stop"
        assert len(r.content_deltas) == 40
    assert edge.outcome("cancelled:node_lost") == 0
