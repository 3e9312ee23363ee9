"""The edge's queue end to end: one slot on the node, one place in the edge's queue.

The node's instance has ``max_concurrency = 1`` and the edge queues at most
one run for ``queue_timeout_s = 4``. A long stream holds the slot while the
tests queue, abandon, time out and overflow other requests.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from openai import Stream

from tests.e2e._platform import (
    MODEL,
    Edge,
    Node,
    Sim,
    StreamResult,
    poll,
    read_more,
    read_stream,
    start_node,
    validated_completion,
)
from tests.edge._openai_schema import validate_error

EDGE_CONFIG: dict[str, Any] = {
    "server": {"keepalive_interval_s": 0.5},
    "scheduler": {"max_queue": 1, "queue_timeout_s": 4.0},
}
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
# Holds the node's only slot for up to 50 s, until the test closes it.
LONG = {"iop_sim": {"output_tokens": 1000, "tokens_per_s": 20.0}}


@pytest.fixture(scope="module")
def node(edge: Edge, sim: Sim, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """The module's node: one slot only."""
    n = start_node(
        tmp_path_factory.mktemp("node"),
        [edge.link_url],
        sim.url,
        instance={"max_concurrency": 1},
    )
    try:
        edge.wait_ready(node_id=n.node_id)
        yield n
    finally:
        n.proc.stop()


@dataclass
class Busy:
    """A client whose long stream holds the node's only slot."""

    client: openai.OpenAI
    stream: Stream[Any]


@pytest.fixture
def busy(edge: Edge, node: Node, sim: Sim) -> Iterator[Busy]:
    sim.wait_idle()
    edge.wait_no_runs()
    with edge.openai() as client:
        stream = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, extra_body=LONG
        )
        with stream:
            r = read_stream(stream, limit=2)
            assert r.content_deltas
            yield Busy(client, stream)
    assert sim.wait_idle()


def test_a_queued_client_that_leaves_never_reaches_the_backend(
    edge: Edge, sim: Sim, busy: Busy
) -> None:
    requests = sim.stats()["requests"]
    before = edge.outcome("cancelled:client_disconnect")
    # The edge commits the headers while the run waits in its queue.
    with busy.client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True) as queued:
        r = read_stream(queued, limit=1)
        assert r.chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert edge.admin()["queued"] == 1
    poll(lambda: edge.admin()["queued"] == 0, timeout=5, what="the queue to empty")
    poll(
        lambda: edge.outcome("cancelled:client_disconnect") == before + 1,
        timeout=5,
        what="the queued run to end as cancelled:client_disconnect",
    )
    assert sim.stats()["requests"] == requests


def test_queue_timeout(edge: Edge, busy: Busy) -> None:
    before = edge.outcome("cancelled:queue_timeout")
    r = StreamResult([], "", [], "", {}, None, None)
    with (
        busy.client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True) as stream,
        pytest.raises(openai.APIError) as info,
    ):
        read_more(iter(stream), r)
    assert info.value.code == "queue_timeout"
    assert r.content_deltas == []
    with pytest.raises(openai.InternalServerError) as status_info:
        busy.client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert status_info.value.status_code == 504
    assert status_info.value.code == "queue_timeout"
    validate_error(status_info.value.response.json())
    assert edge.outcome("cancelled:queue_timeout") == before + 2


def test_queue_full_is_429_and_the_queued_run_gets_the_slot(
    edge: Edge, sim: Sim, busy: Busy
) -> None:
    results: dict[str, Any] = {}

    def queued() -> None:
        with edge.openai() as c:
            try:
                results["completion"] = c.chat.completions.create(
                    model=MODEL, messages=MESSAGES, extra_body={"iop_sim": {"output_tokens": 3}}
                )
            except Exception as exc:
                results["error"] = exc

    waiter = threading.Thread(target=queued)
    waiter.start()
    try:
        poll(lambda: edge.admin()["queued"] == 1, timeout=5, what="a run in the queue")
        with pytest.raises(openai.RateLimitError) as info:
            busy.client.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert info.value.code == "queue_full"
        assert info.value.response.headers["retry-after"] == "1"
        validate_error(info.value.response.json())
        # Free the slot: the long stream's client leaves.
        busy.stream.close()
    finally:
        waiter.join(30)
    assert "error" not in results, results
    validated_completion(results["completion"])
    assert results["completion"].choices[0].finish_reason == "stop"
