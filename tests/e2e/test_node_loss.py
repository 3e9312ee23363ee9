"""Losing a node mid-run, end to end: killed, frozen, and failover before output.

Each test starts its own edge and node processes (``procs``), because it
kills or freezes them. The backend is the session's sim.

What the docs promise (docs/protocol.md, "Liveness" and "What happens to runs
when a link dies"): a killed node is detected at once (the kernel closes its
socket), a frozen one within ``heartbeat_timeout_s`` (2 s) of its last frame;
a frozen edge is given up by its nodes within twice that (4 s);
a run that had produced output ends with ``Cancelled(node_lost)``, which a
streaming client sees as an SSE error object; a run without output yet is
retried on another node.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import openai
import pytest

from tests.e2e._platform import MODEL, Edge, Procs, Sim, StreamResult, poll, read_more, read_stream

pytestmark = pytest.mark.slow

EDGE_CONFIG: dict[str, Any] = {"server": {"keepalive_interval_s": 0.5}}
MESSAGES: list[Any] = [{"role": "user", "content": "Tell me a long story."}]
LONG = {"iop_sim": {"output_tokens": 1000, "tokens_per_s": 20.0}}
# Generous bounds (the measured values are printed).
KILLED_BOUND_S = 5.0
FROZEN_BOUND_S = 5.0


def empty() -> StreamResult:
    return StreamResult([], "", [], "", {}, None, None)


def _node_lost_during_stream(edge: Edge, sig: signal.Signals, victim: Any) -> float:
    """Stream, send ``sig`` to the node mid-stream; the client's stream ends with node_lost."""
    with edge.openai() as client:
        r = empty()
        with client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, extra_body=LONG
        ) as stream:
            it = iter(stream)
            read_more(it, r, 3)
            assert len(r.content_deltas) == 2
            t0 = time.monotonic()
            victim.proc.send(sig)
            with pytest.raises(openai.APIError) as info:
                read_more(it, r)
            took = time.monotonic() - t0
    exc = info.value
    assert not isinstance(exc, openai.APIStatusError)
    assert exc.code == "node_lost"
    assert f"node {victim.node_id}" in exc.message
    assert "lost" in exc.message
    assert r.finish_reason is None
    return took


def test_killed_node_mid_stream(procs: Procs, sim: Sim) -> None:
    edge = procs.edge(EDGE_CONFIG)
    node = procs.node([edge], sim, node_id="n1")
    edge.wait_ready(node_id="n1")
    disconnects = sim.stats()["client_disconnects"]

    took = _node_lost_during_stream(edge, signal.SIGKILL, node)
    print(f"\nnode SIGKILLed: the client's stream ended with node_lost after {took * 1000:.0f} ms")
    assert took < KILLED_BOUND_S
    assert node.proc.wait(5) == -signal.SIGKILL
    # The edge's log line names the close code once, and what it means.
    line = edge.proc.wait_stderr(r"iop\.edge: node n1 disconnected: [^\n]*", timeout=15).group(0)
    assert line.count("1006") == 1, line
    assert "without a close frame" in line, line
    # The backend saw its client (the dead node's HTTP connection) go away.
    sim.wait_disconnects(disconnects)
    admin = edge.wait_no_runs()
    assert admin["nodes"] == []
    assert admin["outcomes"]["cancelled:node_lost"] == 1
    assert edge.get("/readyz").status_code == 503
    with edge.openai() as client, pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert info.value.status_code == 503
    assert info.value.code == "no_nodes"

    # A new node process (same id) joins and takes work.
    procs.node([edge], sim, node_id="n1", name="node-2")
    edge.wait_ready(node_id="n1")
    with (
        edge.openai() as client,
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            stream=True,
            extra_body={"iop_sim": {"output_tokens": 5}},
        ) as stream,
    ):
        r = read_stream(stream)
    assert r.finish_reason == "stop"
    assert len(r.content_deltas) == 5


def test_frozen_node_is_detected_then_comes_back(procs: Procs, sim: Sim) -> None:
    edge = procs.edge(EDGE_CONFIG)
    node = procs.node([edge], sim, node_id="n1")
    edge.wait_ready(node_id="n1")
    disconnects = sim.stats()["client_disconnects"]
    try:
        took = _node_lost_during_stream(edge, signal.SIGSTOP, node)
        print(f"\nnode SIGSTOPped: the client's stream ended with node_lost after {took:.2f} s")
        assert took < FROZEN_BOUND_S
        admin = edge.wait_no_runs()
        assert admin["nodes"] == []
        assert admin["outcomes"]["cancelled:node_lost"] == 1
        # While it is frozen its backend request is still open: nobody closed it.
        assert sim.stats()["open_streams"] == 1
    finally:
        node.proc.send(signal.SIGCONT)
    # Thawed, the node finds its link closed, cancels the run (the backend
    # sees its client go), and reconnects by itself.
    sim.wait_disconnects(disconnects)
    t0 = time.monotonic()
    edge.wait_ready(node_id="n1")
    print(f"thawed node reconnected in {time.monotonic() - t0:.2f} s")
    with edge.openai() as client:
        completion = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_body={"iop_sim": {"output_tokens": 5}}
        )
    assert completion.choices[0].finish_reason == "stop"
    assert node.proc.alive


def test_run_without_output_fails_over_to_another_node(procs: Procs, sim: Sim) -> None:
    """docs/protocol.md: "a run that had not produced any output yet is failed over:
    retried on another node serving its model". Here the node holding the run is
    killed during a 3 s time-to-first-token; the other node should answer."""
    edge = procs.edge(EDGE_CONFIG)
    nodes = {
        "n1": procs.node([edge], sim, node_id="n1", name="node-1"),
        "n2": procs.node([edge], sim, node_id="n2", name="node-2"),
    }
    edge.wait_ready(node_id="n1")
    edge.wait_ready(node_id="n2")
    # A long "prefill": the run sits on its node with no output yet.
    opts = {"iop_sim": {"ttft_s": 3.0, "output_tokens": 5}}
    with (
        edge.openai() as client,
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, extra_body=opts
        ) as stream,
    ):
        it = iter(stream)
        r = read_more(it, empty(), 1)  # the role chunk, sent with the headers
        assert r.content_deltas == []

        def holder() -> str | None:
            for n in edge.admin()["nodes"]:
                if n["runs"]:
                    return str(n["id"])
            return None

        victim = poll(holder, timeout=5, what="the run to be placed on a node")
        nodes[victim].proc.kill()
        read_more(it, r)
    # The client never noticed: the whole answer arrived from the other node.
    assert r.finish_reason == "stop"
    assert len(r.content_deltas) == 5
    admin = edge.wait_no_runs()
    assert [n["id"] for n in admin["nodes"]] == [next(n for n in nodes if n != victim)]
    assert admin["outcomes"] == {"complete": 1}


def test_frozen_edge_makes_the_node_release_its_backend(procs: Procs, sim: Sim) -> None:
    """The node applies the same liveness rule to the edge: a silent edge's runs
    are cancelled (so the backend stops), and the node reconnects once it thaws."""
    edge = procs.edge(EDGE_CONFIG)
    procs.node([edge], sim, node_id="n1")
    edge.wait_ready(node_id="n1")
    disconnects = sim.stats()["client_disconnects"]
    with (
        edge.openai() as client,
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, extra_body=LONG
        ) as stream,
    ):
        it = iter(stream)
        r = read_more(it, empty(), 3)
        edge.proc.send(signal.SIGSTOP)
        try:
            took = sim.wait_disconnects(disconnects, timeout=FROZEN_BOUND_S)
            print(f"\nedge SIGSTOPped: the node closed its backend request after {took:.2f} s")
        finally:
            edge.proc.send(signal.SIGCONT)
        # The thawed edge has lost the node's link: the client is told.
        with pytest.raises(openai.APIError) as info:
            read_more(it, r)
    assert info.value.code == "node_lost"
    edge.wait_ready(node_id="n1")
    with edge.openai() as client:
        completion = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_body={"iop_sim": {"output_tokens": 5}}
        )
    assert completion.choices[0].finish_reason == "stop"
