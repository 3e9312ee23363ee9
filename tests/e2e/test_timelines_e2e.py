"""Run timelines from outside: real edge, node and sim processes; a run's
timeline at ``/admin/runs/{id}`` holds both sides, the node's set against the
edge's clock, for a run that completed and for one its client left."""

from __future__ import annotations

import itertools
from typing import Any

import httpx

from tests.e2e._platform import MODEL, Cluster, Edge, poll

MESSAGES: list[Any] = [{"role": "user", "content": "Tell me a story."}]


def _timeline(edge: Edge, run_id: str, *, with_node: bool = True) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        resp = edge.get(f"/admin/runs/{run_id}")
        if resp.status_code != 200:
            return None
        body: dict[str, Any] = resp.json()
        if body["terminal_ms"] is None or (with_node and body["node"] is None):
            return None
        return body

    got: dict[str, Any] = {}

    def check() -> bool:
        found = ready()
        if found is not None:
            got.update(found)
        return found is not None

    poll(check, timeout=10.0, what=f"the timeline of {run_id} with its node's side")
    return got


def _in_order(*times: float | None, slack: float = 0.0) -> None:
    present = [t for t in times if t is not None]
    assert len(present) == len(times), times
    for a, b in itertools.pairwise(present):
        assert a <= b + slack, (a, b, times)


def test_a_completed_runs_timeline_holds_both_sides(cluster: Cluster) -> None:
    edge = cluster.edge
    stream = edge.openai().chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        stream=True,
        extra_body={"iop_sim": {"output_tokens": 20, "tokens_per_s": 200, "ttft_s": 0.05}},
    )
    chunks = list(stream)
    run_id = chunks[0].id.removeprefix("chatcmpl-")
    t = _timeline(edge, run_id)
    node = t["node"]
    (placement,) = t["placements"]
    assert placement["result"] == "ran"
    assert t["outcome"] == "complete:stop"
    assert t["cancel_requested_ms"] is None
    half = node["clock_rtt_ms"] / 2 + 0.01  # each node time is good to half the round trip
    # The node's moments fall inside the edge's, in the order they happen.
    _in_order(
        placement["at_ms"],
        node["started_ms"],
        node["backend_sent_ms"],
        node["backend_first_byte_ms"],
        node["first_output_ms"],
        node["terminal_ms"],
        t["terminal_ms"],
        slack=half,
    )
    _in_order(node["first_output_ms"], t["first_output_ms"], slack=half)
    # The sim waited ttft_s before its first token.
    assert node["first_output_ms"] - node["backend_sent_ms"] >= 50.0 - half
    assert edge.get("/admin/runs").json()["recent"][0]["run_id"] == run_id


def test_a_run_its_client_left_still_gets_the_nodes_side(cluster: Cluster) -> None:
    edge, sim = cluster.edge, cluster.sim
    before = sim.stats()["client_disconnects"]
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "stream": True,
        "iop_sim": {"output_tokens": 2000, "tokens_per_s": 50},
    }
    with (
        httpx.Client(base_url=edge.url, timeout=10) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as resp,
    ):
        run_id = ""
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                run_id = line.split('"id":"chatcmpl-', 1)[1].split('"', 1)[0]
                break
    # Leaving the block closed the connection mid-stream.
    sim.wait_disconnects(before)
    t = _timeline(edge, run_id)
    node = t["node"]
    assert t["outcome"] == "cancelled:client_disconnect"
    assert t["cancel_cause"] == "client_disconnect"
    half = node["clock_rtt_ms"] / 2 + 0.01
    _in_order(t["cancel_requested_ms"], t["cancel_sent_ms"], node["cancel_received_ms"], slack=half)
    # The node closed the backend's connection after the cancel reached it.
    _in_order(node["cancel_received_ms"], node["backend_closed_ms"], node["terminal_ms"])
    assert t["placements"][0]["result"] == "cancelled"
