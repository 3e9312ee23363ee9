"""A client that stops reading: real edge, node and sim, a raw socket that never reads.

The edge's write-stall deadline (``server.write_stall_timeout_s``, here 1 s)
must end the run as ``slow_client``, free the node's only slot, close the
backend's connection, and close the client's connection, which hypercorn
would otherwise keep blocked in a socket write forever.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any
from urllib.parse import urlsplit

from tests.e2e._platform import MODEL, Edge, Procs, poll

STALL_S = 1.0
EDGE_CONFIG: dict[str, Any] = {
    "server": {"keepalive_interval_s": 0.5, "write_stall_timeout_s": STALL_S},
}
MESSAGES: list[Any] = [{"role": "user", "content": "Tell me a very long story."}]
# Far more than the socket buffers between the edge and the client hold, as
# fast as the sim writes (it builds the whole answer first, so not millions).
ENDLESS = {"iop_sim": {"output_tokens": 20_000}}
# The smallest receive buffer the kernel grants (it clamps the value up).
RCVBUF = 1024


def _stalled_client(edge: Edge) -> socket.socket:
    """A streaming request on a socket with a tiny receive buffer; never read."""
    url = urlsplit(edge.url)
    assert url.hostname is not None
    assert url.port is not None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Before connect, so the advertised window is small from the start.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
    sock.settimeout(10)
    sock.connect((url.hostname, url.port))
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "stream": True, **ENDLESS}).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\n"
        b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def _closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Read what the kernel holds; True once the server closed (EOF or RST)."""
    # Open the window first, as iop.testing's SlowReader does (its
    # wait_closed_by_server says why): else the rest comes at the pace of
    # the edge's zero-window probes.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024 * 1024)
    deadline = time.monotonic() + timeout
    sock.settimeout(0.5)
    while time.monotonic() < deadline:
        try:
            if sock.recv(65536) == b"":
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            continue
    return False


def test_a_client_that_stops_reading_is_cut_off_and_frees_its_slot(procs: Procs) -> None:
    sim = procs.sim()
    edge = procs.edge(EDGE_CONFIG)
    # One slot: the next request can only run once the stalled one let go.
    procs.node([edge], sim, instance={"max_concurrency": 1, "max_queue": 4})
    edge.wait_ready()
    before = sim.stats()["client_disconnects"]

    sock = _stalled_client(edge)
    try:
        sim.wait_open()
        poll(
            lambda: edge.outcome("cancelled:slow_client") == 1,
            timeout=20.0,
            what="the stalled run to end as slow_client",
        )
        # The backend saw its connection close (the node cancelled its run).
        sim.wait_disconnects(before)
        sim.wait_idle()
        # The slot is free: a request on the 1-slot instance completes.
        answer = edge.openai().chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_body={"iop_sim": {"output_tokens": 5}}
        )
        assert answer.choices[0].finish_reason == "stop"
        # And the client's own connection was closed by the edge.
        assert _closed_by_server(sock, timeout=20.0)
    finally:
        sock.close()
    assert "accepted no data for write_stall_timeout_s=1" in edge.proc.stderr()
    admin = edge.wait_no_runs()
    assert admin["outcomes"].get("cancelled:client_disconnect", 0) == 0
