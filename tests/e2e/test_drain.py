"""SIGTERM drains, end to end: ``iop edge`` and ``iop node`` stop cleanly and exit 0.

From their ``--help``: new requests get 503 (edge) or are not assigned
(node), in-flight runs get ``drain_timeout_s`` to finish, the rest are
cancelled with reason ``shutdown`` (a clean SSE error, then ``[DONE]``), and
the process exits 0.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import openai
import pytest

from tests.e2e._platform import MODEL, Edge, Node, Procs, Sim, StreamResult, poll, read_more
from tests.edge._openai_schema import validate_error

pytestmark = pytest.mark.slow

MESSAGES: list[Any] = [{"role": "user", "content": "Tell me a long story."}]
# 50 s of tokens: only a drain ends it.
LONG = {"iop_sim": {"output_tokens": 1000, "tokens_per_s": 20.0}}
# 1.5 s of tokens: finishes within a 10 s drain.
SHORT = {"iop_sim": {"output_tokens": 15, "tokens_per_s": 10.0}}
# Exit after the drain timeout, generously.
EXIT_BOUND_S = 15.0


def edge_config(drain_timeout_s: float) -> dict[str, Any]:
    return {"server": {"keepalive_interval_s": 0.5, "drain_timeout_s": drain_timeout_s}}


def start(
    procs: Procs, sim: Sim, *, edge_drain: float = 10.0, node_drain: float = 10.0
) -> tuple[Edge, Node]:
    edge = procs.edge(edge_config(edge_drain))
    node = procs.node([edge], sim, node_id="n1", node={"drain_timeout_s": node_drain})
    edge.wait_ready(node_id="n1")
    return edge, node


def stream_through_signal(
    edge: Edge, target: Any, opts: dict[str, Any], during: Any = None
) -> tuple[StreamResult, openai.APIError | None, float]:
    """Stream; after two tokens SIGTERM ``target``; read to the end.

    Returns what was read, the error that ended the stream (if any) and the
    seconds from the signal to the end of the stream.
    """
    r = StreamResult([], "", [], "", {}, None, None)
    error: openai.APIError | None = None
    with (
        edge.openai() as client,
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, extra_body=opts
        ) as stream,
    ):
        it = iter(stream)
        read_more(it, r, 3)
        assert len(r.content_deltas) == 2
        t0 = time.monotonic()
        target.proc.send(signal.SIGTERM)
        if during is not None:
            during()
        try:
            read_more(it, r)
        except openai.APIError as exc:
            error = exc
    return r, error, time.monotonic() - t0


def test_edge_sigterm_cuts_a_long_stream_at_the_drain_timeout(procs: Procs, sim: Sim) -> None:
    edge, _ = start(procs, sim, edge_drain=1.0)
    disconnects = sim.stats()["client_disconnects"]

    def while_draining() -> None:
        poll(
            lambda: edge.get("/readyz").status_code == 503,
            timeout=5,
            what="/readyz to say draining",
        )
        assert edge.get("/readyz").json()["status"] == "draining"
        with edge.openai() as client, pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert info.value.status_code == 503
        validate_error(info.value.response.json())

    r, error, took = stream_through_signal(edge, edge, LONG, while_draining)
    assert error is not None
    assert not isinstance(error, openai.APIStatusError)
    assert error.code == "shutdown"
    assert r.finish_reason is None
    print(f"\nedge SIGTERM: long stream cut after {took:.2f}s (drain_timeout_s=1)")
    assert edge.proc.wait(EXIT_BOUND_S) == 0
    assert "iop.edge: stopped" in edge.proc.stderr()
    sim.wait_disconnects(disconnects)  # the backend was told too


def test_edge_sigterm_lets_a_short_stream_finish(procs: Procs, sim: Sim) -> None:
    edge, _ = start(procs, sim, edge_drain=10.0)
    r, error, took = stream_through_signal(edge, edge, SHORT)
    assert error is None
    assert r.finish_reason == "stop"
    assert len(r.content_deltas) == 15
    t0 = time.monotonic()
    assert edge.proc.wait(EXIT_BOUND_S) == 0
    print(
        f"\nedge SIGTERM: short stream completed {took:.2f}s after the signal; "
        f"exit 0 {time.monotonic() - t0:.2f}s later"
    )


def test_node_sigterm_cuts_a_long_stream_at_the_drain_timeout(procs: Procs, sim: Sim) -> None:
    edge, node = start(procs, sim, node_drain=1.0)
    disconnects = sim.stats()["client_disconnects"]
    r, error, took = stream_through_signal(edge, node, LONG)
    assert error is not None
    assert not isinstance(error, openai.APIStatusError)
    assert error.code == "shutdown"
    assert r.finish_reason is None
    print(f"\nnode SIGTERM: long stream cut after {took:.2f}s (drain_timeout_s=1)")
    assert node.proc.wait(EXIT_BOUND_S) == 0
    assert "iop.node: stopped" in node.proc.stderr()
    sim.wait_disconnects(disconnects)
    admin = edge.wait_no_runs()
    assert admin["nodes"] == []
    assert admin["outcomes"] == {"cancelled:shutdown": 1}


def test_node_sigterm_lets_a_short_stream_finish(procs: Procs, sim: Sim) -> None:
    edge, node = start(procs, sim, node_drain=10.0)
    r, error, took = stream_through_signal(edge, node, SHORT)
    assert error is None
    assert r.finish_reason == "stop"
    assert len(r.content_deltas) == 15
    t0 = time.monotonic()
    assert node.proc.wait(EXIT_BOUND_S) == 0
    print(
        f"\nnode SIGTERM: short stream completed {took:.2f}s after the signal; "
        f"exit 0 {time.monotonic() - t0:.2f}s later"
    )
    assert edge.admin()["outcomes"] == {"complete": 1}


def test_node_second_sigterm_stops_at_once(procs: Procs, sim: Sim) -> None:
    """``iop node --help``: "a second signal stops at once" (the drain would take 30 s)."""
    edge, node = start(procs, sim, node_drain=30.0)
    disconnects = sim.stats()["client_disconnects"]

    def second_signal() -> None:
        poll(
            lambda: edge.admin()["nodes"][0]["draining"],
            timeout=5,
            what="the edge to see the node draining",
        )
        node.proc.send(signal.SIGTERM)

    r, error, took = stream_through_signal(edge, node, LONG, second_signal)
    assert error is not None
    assert r.finish_reason is None
    # 128 + SIGTERM: the drain was cut short (docs/operations.md).
    assert node.proc.wait(EXIT_BOUND_S) == 128 + signal.SIGTERM
    assert "SIGTERM again: stopping now" in node.proc.stderr()
    print(f"\nnode SIGTERM twice: stream ended after {took:.2f}s ({error.code}: {error.message})")
    assert took < EXIT_BOUND_S
    sim.wait_disconnects(disconnects)


def test_edge_second_sigterm_stops_at_once(procs: Procs, sim: Sim) -> None:
    """``docs/operations.md``: a second signal stops at once, exit 143 (the drain would take 30 s)."""
    edge, _ = start(procs, sim, edge_drain=30.0)

    def second_signal() -> None:
        poll(
            lambda: edge.get("/readyz").status_code == 503,
            timeout=5,
            what="/readyz to say draining",
        )
        edge.proc.wait_stderr(r"SIGTERM received: draining", timeout=5)
        edge.proc.send(signal.SIGTERM)

    r, error, took = stream_through_signal(edge, edge, LONG, second_signal)
    assert r.finish_reason is None
    assert edge.proc.wait(EXIT_BOUND_S) == 128 + signal.SIGTERM
    print(f"\nedge SIGTERM twice: stream ended after {took:.2f}s ({error!r})")
    assert "SIGTERM again: stopping now" in edge.proc.stderr()


def test_a_draining_nodes_model_is_unavailable_not_unknown(procs: Procs, sim: Sim) -> None:
    edge, node = start(procs, sim, node_drain=2.0)

    def while_draining() -> None:
        poll(
            lambda: edge.admin()["nodes"][0]["draining"],
            timeout=5,
            what="the edge to see the node draining",
        )
        with edge.openai() as client, pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert info.value.status_code == 503

    stream_through_signal(edge, node, LONG, while_draining)
