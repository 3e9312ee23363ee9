"""The edge's wait timeouts end to end: each tells the client why, and the backend's socket closes.

Two edges with the same small deadlines (``[deadlines]`` of the edge config)
share one node, which dials both (``[[node.edges]]`` twice):

* ``quick`` commits the response headers after 0.2 s without output
  (``keepalive_interval_s``), so a streaming client already holds a 200 when
  the first-token deadline strikes and gets an SSE error object;
* ``patient`` would wait 30 s (and allows 60 s in total), so a run that times out before any output gets
  a real HTTP status (504) instead, as the edge documents ("headers are
  committed on the run's first output, or after keepalive_interval_s").

After output the headers are committed on both, and every timeout is an SSE
error object (``APIError`` in the SDK) with the reason as its ``code``.
Non-streaming requests get a 504 with the same code.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from tests.e2e._platform import (
    MODEL,
    Edge,
    Node,
    Sim,
    StreamResult,
    read_more,
    start_edge,
    start_node,
)
from tests.edge._openai_schema import validate_error

DEADLINES = {"first_token_timeout_s": 1.0, "idle_timeout_s": 1.0, "request_timeout_s": 2.5}
# The same first-token and idle deadlines, with room for a slow client to finish.
PATIENT_DEADLINES = {**DEADLINES, "request_timeout_s": 60.0}
MESSAGES: list[Any] = [{"role": "user", "content": "Tell me a long story."}]

# The client learns of a timeout well within this after the deadline.
SLACK_S = 5.0


@dataclass
class TimeoutCluster:
    sim: Sim
    quick: Edge
    patient: Edge
    node: Node


@pytest.fixture(scope="module")
def timeouts(sim: Sim, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TimeoutCluster]:
    log_dir = tmp_path_factory.mktemp("timeouts")
    quick = start_edge(
        log_dir,
        {"server": {"keepalive_interval_s": 0.2}, "deadlines": DEADLINES},
        name="edge-quick",
    )
    patient: Edge | None = None
    node: Node | None = None
    try:
        patient = start_edge(
            log_dir,
            {"server": {"keepalive_interval_s": 30.0}, "deadlines": PATIENT_DEADLINES},
            name="edge-patient",
        )
        node = start_node(log_dir, [quick.link_url, patient.link_url], sim.url)
        quick.wait_ready(node_id=node.node_id)
        patient.wait_ready(node_id=node.node_id)
        yield TimeoutCluster(sim, quick, patient, node)
    finally:
        if node is not None:
            node.proc.stop()
        for e in (patient, quick):
            if e is not None:
                e.close()
                e.proc.stop()


@pytest.fixture
def cluster(timeouts: TimeoutCluster) -> TimeoutCluster:
    timeouts.sim.wait_idle()
    return timeouts


def _check_backend_released(c: TimeoutCluster, edge: Edge, disconnects: int, reason: str) -> None:
    latency = c.sim.wait_disconnects(disconnects)
    edge.wait_no_runs()
    assert c.sim.wait_idle()["client_disconnects"] == disconnects + 1
    print(f"\n{reason}: backend socket closed {latency * 1000:.0f} ms after the client's error")


CASES = {
    # reason: (sim overrides, content tokens the client sees first)
    "first_token_timeout": ({"failure": "stall_before_first_byte"}, 0),
    "idle_timeout": ({"failure": "stall_mid_stream", "fail_after_tokens": 3}, 3),
    # 10 tokens/s never leaves the backend idle for 1 s, but lasts 100 s.
    "total_timeout": ({"tokens_per_s": 10.0, "output_tokens": 1000}, None),
}


@pytest.mark.parametrize("reason", list(CASES))
def test_streaming_timeout_is_an_sse_error(cluster: TimeoutCluster, reason: str) -> None:
    opts, tokens = CASES[reason]
    edge = cluster.quick
    disconnects = cluster.sim.stats()["client_disconnects"]
    before = edge.outcome(f"cancelled:{reason}")
    r = StreamResult([], "", [], "", {}, None, None)
    with edge.openai() as client:
        t0 = time.monotonic()
        with (
            client.chat.completions.create(
                model=MODEL, messages=MESSAGES, stream=True, extra_body={"iop_sim": opts}
            ) as stream,
            pytest.raises(openai.APIError) as info,
        ):
            read_more(iter(stream), r)
        took = time.monotonic() - t0
    exc = info.value
    assert not isinstance(exc, openai.APIStatusError), "headers were committed: an SSE error"
    assert exc.code == reason
    assert isinstance(exc.body, dict)
    validate_error({"error": exc.body})
    assert exc.body["type"] == "server_error"
    assert r.chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    if tokens is not None:
        assert len(r.content_deltas) == tokens
    else:
        assert r.content_deltas  # it was streaming when the total deadline struck
    assert r.finish_reason is None
    assert took < DEADLINES["request_timeout_s"] + SLACK_S
    assert edge.outcome(f"cancelled:{reason}") == before + 1
    print(f"\nstreaming {reason}: client told after {took:.2f}s: {exc.message!r}")
    _check_backend_released(cluster, edge, disconnects, f"streaming {reason}")


@pytest.mark.parametrize("reason", list(CASES))
def test_non_streaming_timeout_is_504(cluster: TimeoutCluster, reason: str) -> None:
    opts, _ = CASES[reason]
    edge = cluster.quick
    disconnects = cluster.sim.stats()["client_disconnects"]
    with edge.openai() as client, pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"iop_sim": opts})
    exc = info.value
    assert exc.status_code == 504
    assert exc.code == reason
    body = exc.response.json()
    validate_error(body)
    assert body["error"]["code"] == reason
    _check_backend_released(cluster, edge, disconnects, f"non-streaming {reason}")


def test_first_token_timeout_before_headers_is_a_real_504(cluster: TimeoutCluster) -> None:
    """No output and no keep-alive yet: the headers are not committed, so the
    streaming client gets the HTTP status rather than an SSE error behind a 200."""
    edge = cluster.patient
    disconnects = cluster.sim.stats()["client_disconnects"]
    with edge.openai() as client, pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            stream=True,
            extra_body={"iop_sim": {"failure": "stall_before_first_byte"}},
        )
    exc = info.value
    assert exc.status_code == 504
    assert exc.code == "first_token_timeout"
    validate_error(exc.response.json())
    _check_backend_released(cluster, edge, disconnects, "streaming first_token_timeout (patient)")


def test_timeouts_do_not_touch_healthy_runs(cluster: TimeoutCluster) -> None:
    """A run that produces output steadily within the deadlines completes on the same edges."""
    for edge in (cluster.quick, cluster.patient):
        with edge.openai() as client:
            completion = client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                extra_body={"iop_sim": {"tokens_per_s": 20.0, "output_tokens": 10}},
            )
        assert completion.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_a_slow_reader_is_not_an_idle_backend(cluster: TimeoutCluster) -> None:
    """docs/architecture.md: "While the sink is blocked on a slow consumer only the
    total deadline applies: a slow reader is backpressure, not an idle backend."
    The client stops reading for twice the idle deadline, long enough for the
    answer to back up all the way (see test_platform's slow-client test)."""
    edge = cluster.patient
    before = edge.outcome("cancelled:idle_timeout")
    n = 20000  # more than the sockets between sim and client can hold (test_platform)
    r = StreamResult([], "", [], "", {}, None, None)
    with (
        edge.openai() as client,
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            stream=True,
            extra_body={"iop_sim": {"output_tokens": n}},
        ) as stream,
    ):
        it = iter(stream)
        read_more(it, r, 2)
        time.sleep(2 * DEADLINES["idle_timeout_s"])  # the client is slow: that is the test
        read_more(it, r, validate_every=50)
    assert r.finish_reason == "stop"
    assert len(r.content_deltas) == n
    assert edge.outcome("cancelled:idle_timeout") == before
