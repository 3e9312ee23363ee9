"""The node link under abuse and at its limits, end to end (real processes).

docs/operations.md "Limits and abuse" / "The node link": a request body at
``server.max_body_bytes`` crosses the link without disturbing other runs; a
peer that has not said hello cannot make the edge buffer more than
``link.max_hello_bytes``; a text frame is a protocol error (4400); a live
node id cannot be taken over by a second connection.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from iop.events import Delta
from iop.node._ws import open_ws_link
from iop.protocol import (
    CLOSE_ID_IN_USE,
    CLOSE_PROTOCOL,
    CLOSE_RATE,
    CLOSE_TOO_BIG,
    LinkClosed,
    NodeSession,
    Ping,
    RunEvents,
    encode,
    encode_batch,
)
from tests.e2e._platform import MODEL, TOKEN, Procs, Sim, StreamResult, read_stream

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
    # The sim takes bodies up to 4 MiB (iop/sim/_server.py): its own 413,
    # relayed, proves the request crossed the link whole.
    assert resp.status_code == 413, resp.text
    assert resp.json()["error"]["code"] == "backend_http_error"
    assert "vllm returned 413" in resp.json()["error"]["message"]
    for r in results:
        assert isinstance(r, StreamResult), r
        assert r.finish_reason == "stop"
        assert len(r.content_deltas) == 40
    assert edge.outcome("cancelled:node_lost") == 0


async def _first_close(url: str, *frames: bytes | str) -> tuple[int | None, str]:
    """Send ``frames`` on a fresh link connection; the close code and reason it gets.

    Over the node's own channel (``open_ws_link`` closes the socket even when
    the server closed first); a text frame too (``_send_text``).
    """
    async with open_ws_link(url) as chan:
        # Closed while we were still sending: the edge's close frame says why.
        with contextlib.suppress(LinkClosed):
            for frame in frames:
                if isinstance(frame, str):
                    await chan._send_text(frame)
                else:
                    await chan.send(frame)
        try:
            with trio.fail_after(10):
                while True:
                    await chan.receive()
        except LinkClosed as exc:
            return exc.close_code, exc.reason
    raise AssertionError("unreachable")


def test_a_big_frame_before_the_hello_is_closed_at_once_and_logged(procs: Procs) -> None:
    edge = procs.edge({})
    code, _ = trio.run(_first_close, edge.link_url, b"\x00" * (4 << 20))
    assert code == CLOSE_TOO_BIG
    m = edge.proc.wait_stderr(
        r"node link from 127\.0\.0\.1:\d+: frame of more than \d+ bytes before its hello "
        r"\(limit 262144\): closing \(1009\)",
        timeout=10,
    )
    assert m is not None


def test_a_text_frame_first_is_a_protocol_error(procs: Procs) -> None:
    edge = procs.edge({})
    code, reason = trio.run(_first_close, edge.link_url, "hello?")
    assert code == CLOSE_PROTOCOL
    assert "text frame" in reason
    edge.proc.wait_stderr(r"refusing node link from 127\.0\.0\.1:\d+: text frame", timeout=10)


def test_a_live_node_id_cannot_be_taken_over(procs: Procs, sim: Sim) -> None:
    """A second connection with a valid token and the id of a live node is
    refused with 4410 (both sides log it); the live node's stream completes."""
    edge = procs.edge({"server": {"keepalive_interval_s": 0.5}})
    procs.node([edge], sim, node_id="n1")
    edge.wait_ready(node_id="n1")
    with (
        edge.openai() as client,
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            stream=True,
            extra_body={"iop_sim": {"output_tokens": 30, "tokens_per_s": 20.0}},
        ) as stream,
    ):
        session = NodeSession(node_id="n1", token=TOKEN, now=0.0)
        for _ in range(3):  # every attempt is refused, not only the first
            code, reason = trio.run(_first_close, edge.link_url, session.hello([]))
            assert code == CLOSE_ID_IN_USE
            assert "in use by a live link" in reason
        r = read_stream(stream)
    assert r.finish_reason == "stop"
    assert len(r.content_deltas) == 30
    assert edge.outcome("cancelled:node_lost") == 0
    edge.proc.wait_stderr(r"refusing node from 127\.0\.0\.1:\d+: node id 'n1' is in use", 10)
    assert [n["id"] for n in edge.admin()["nodes"]] == ["n1"]


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _flood(url: str, count: int) -> tuple[int, int | None, str]:
    """Say hello as a valid node, then send ``count`` pings; (sent, close code, reason)."""
    session = NodeSession(node_id="flooder", token=TOKEN, now=0.0)
    pong = encode_batch([encode(Ping(nonce=1))])
    sent = 0
    async with open_ws_link(url) as chan:
        try:
            await chan.send(session.hello([]))
            await chan.receive()  # the welcome
            for _ in range(count):
                await chan.send(pong)
                sent += 1
            with trio.fail_after(10):
                while True:
                    await chan.receive()
        except LinkClosed as exc:
            return sent, exc.close_code, exc.reason
    raise AssertionError("unreachable")


def test_a_flooding_node_is_cut_off(procs: Procs) -> None:
    """100,000 messages that cost no credit: the edge closes the link with
    4429 once the burst (link.control_burst = 1000) is spent."""
    edge = procs.edge({})
    cpu0 = _cpu_s(edge.proc.pid)
    sent, code, reason = trio.run(_flood, edge.link_url, 100_000)
    cpu = _cpu_s(edge.proc.pid) - cpu0
    print(f"\nflood: {sent} pings sent before the close ({code} {reason}); edge CPU {cpu:.2f} s")
    assert code == CLOSE_RATE
    assert sent < 100_000
    edge.proc.wait_stderr(r"node flooder broke the protocol: .*message rate.*\(close 4429\)", 10)


async def _hello_then(url: str, frame: bytes) -> tuple[int | None, str]:
    session = NodeSession(node_id="big-framer", token=TOKEN, now=0.0)
    async with open_ws_link(url) as chan:
        try:
            await chan.send(session.hello([]))
            await chan.receive()  # the welcome
            await chan.send(frame)
            with trio.fail_after(10):
                while True:
                    await chan.receive()
        except LinkClosed as exc:
            return exc.close_code, exc.reason
    raise AssertionError("unreachable")


def test_after_the_hello_the_frame_limit_is_raised(procs: Procs) -> None:
    """A 1 MiB frame is over the pre-hello limit but fine after it: the edge
    reads it (and closes 4400 because no such run is assigned, not 1009)."""
    edge = procs.edge({})
    frame = encode_batch([encode(RunEvents(run_id="nope", seq=0, events=[Delta("x" * (1 << 20))]))])
    code, reason = trio.run(_hello_then, edge.link_url, frame)
    assert code == CLOSE_PROTOCOL, reason
    assert "not assigned on this link" in reason


def test_a_node_that_leaves_cleanly_is_logged_at_info(procs: Procs, sim: Sim) -> None:
    edge = procs.edge({})
    node = procs.node([edge], sim, node_id="n1")
    edge.wait_ready(node_id="n1")
    node.proc.stop()  # SIGTERM: drain, goodbye, close 1001
    m = edge.proc.wait_stderr(r"(\w+) +iop\.edge: node n1 disconnected: ([^\n]*)", timeout=15)
    assert m.group(1) == "INFO", m.group(0)
    assert "None" not in m.group(2)
    assert "goodbye" in m.group(2) or "closed cleanly" in m.group(2)
