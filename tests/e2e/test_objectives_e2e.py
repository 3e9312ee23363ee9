"""Objectives on real processes (docs/operations.md, "Sessions and objectives"): a
sheddable flood queues behind a one-slot instance, an interactive request is served
next, a batch run that has sent nothing yet gives its slot to an interactive one and
still answers whole, and a deadline the queue cannot meet is refused at once, through
the openai SDK.

The order of service is read from the runs' timelines on the edge
(``/admin/runs/{id}``, the edge's monotonic clock). No timing is asserted.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Final

import openai
import pytest

from tests.e2e._platform import MODEL, Cluster, Edge, Node, Sim, poll, start_node

ADMIN_KEY: Final = "iop-e2e-objectives-admin"
EDGE_CONFIG: dict[str, Any] = {
    "server": {
        "keepalive_interval_s": 0.5,
        "api_keys": ["iop-e2e-objectives-key"],
        "admin_keys": [ADMIN_KEY],
    },
    "scheduler": {"max_queue": 64, "max_queue_delay_s": 0, "queue_timeout_s": 120},
    "objectives": [
        {"name": "interactive", "priority": 10, "ttft_deadline_s": 30.0},
        {"name": "batch", "priority": 0, "sheddable": True},
    ],
}
FLOOD: Final = 8
# 20 tokens at 200/s: each run holds the one slot ~0.1 s.
SLOW: dict[str, Any] = {"iop_sim": {"output_tokens": 20, "tokens_per_s": 200.0}}
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def node(edge: Edge, sim: Sim, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """One slot: every run but one waits in the edge's queue."""
    n = start_node(
        tmp_path_factory.mktemp("node"), [edge.link_url], sim.url, instance={"max_concurrency": 1}
    )
    try:
        edge.wait_ready(node_id=n.node_id)
        yield n
    finally:
        n.proc.stop()


def _ask(client: openai.OpenAI, objective: str, ids: list[str], **headers: str) -> None:
    made = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        extra_body=SLOW,
        extra_headers={"x-iop-objective": objective, **headers},
    )
    ids.append(made.id.removeprefix("chatcmpl-"))


def _timeline(edge: Edge, run_id: str) -> dict[str, Any]:
    r = edge.admin_get(f"/admin/runs/{run_id}")
    r.raise_for_status()
    t: dict[str, Any] = r.json()
    # On one clock: each time is in ms since its own run's arrival.
    for key in ("queued", "dequeued"):
        ms = t[f"{key}_ms"]
        t[key] = None if ms is None else t["received_unix"] + ms / 1000.0
    return t


def test_an_interactive_request_is_served_before_a_queued_sheddable_flood(
    cluster: Cluster,
) -> None:
    edge = cluster.edge
    edge.admin_key = ADMIN_KEY
    batch: list[str] = []
    interactive: list[str] = []
    with edge.openai(timeout=60) as client:
        flood = [threading.Thread(target=_ask, args=(client, "batch", batch)) for _ in range(FLOOD)]
        for t in flood:
            t.start()
        poll(lambda: edge.admin()["queued"] >= FLOOD - 2, timeout=30, what="the flood to queue")

        # A deadline its line cannot meet: refused at once, 429 in OpenAI's shape.
        with pytest.raises(openai.RateLimitError) as info:
            _ask(client, "batch", [], **{"x-llm-d-slo-ttft-ms": "50"})
        assert info.value.response.headers["retry-after"] == "1"
        assert "deadline" in info.value.message
        # An objective the edge does not have: 400 naming it.
        with pytest.raises(openai.BadRequestError) as bad:
            _ask(client, "realtime", [])
        assert "'realtime'" in bad.value.message

        _ask(client, "interactive", interactive)
        for t in flood:
            t.join(timeout=60)
    assert len(batch) == FLOOD
    (calm,) = (_timeline(edge, rid) for rid in interactive)
    assert calm["objective"] == "interactive"
    assert calm["queued"] is not None  # it did wait
    floods = [_timeline(edge, rid) for rid in batch]
    # Strict priority: no batch run left the queue while it waited.
    overtook = [
        t for t in floods if t["dequeued"] and calm["queued"] < t["dequeued"] < calm["dequeued"]
    ]
    assert overtook == []
    assert sum(1 for t in floods if (t["dequeued"] or 0) > calm["dequeued"]) >= 4
    metrics = edge.admin_get("/metrics").text
    assert 'iop_queue_refused_total{why="deadline"} 1.0' in metrics


def test_a_batch_run_still_in_its_prefill_yields_its_slot_and_still_answers_whole(
    cluster: Cluster,
) -> None:
    """A streamed batch run holds the one slot and has sent nothing yet (a
    long prefill); an interactive request comes: the batch run's attempt is
    cancelled on the node and the interactive one runs at once; then the
    batch run is placed again and its client gets one whole answer, no error
    (docs/operations.md, "Sessions and objectives")."""
    edge = cluster.edge
    edge.admin_key = ADMIN_KEY
    texts: list[str] = []
    finishes: list[str | None] = []
    ids: list[str] = []

    def stream_batch(client: openai.OpenAI) -> None:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            stream=True,
            extra_body={"iop_sim": {"ttft_s": 3.0, "output_tokens": 8}},
            extra_headers={"x-iop-objective": "batch"},
        )
        for chunk in stream:
            ids.append(chunk.id.removeprefix("chatcmpl-"))
            for choice in chunk.choices:
                texts.append(choice.delta.content or "")
                if choice.finish_reason is not None:
                    finishes.append(choice.finish_reason)

    def placed_batch() -> bool:
        live = edge.admin_get("/admin/runs").json()["live"]
        return any(r["objective"] == "batch" and r["phase"] == "placed" for r in live)

    interactive: list[str] = []
    before = _preemptions(edge)
    with edge.openai(timeout=60) as client:
        batch = threading.Thread(target=stream_batch, args=(client,))
        batch.start()
        poll(placed_batch, timeout=30, what="the batch run to be on the node")
        _ask(client, "interactive", interactive)
        batch.join(timeout=60)
    assert not batch.is_alive()
    assert finishes == ["stop"]
    assert "".join(texts)
    (run_id,) = set(ids)
    slow = _timeline(edge, run_id)
    calm = _timeline(edge, interactive[0])
    assert [p["result"] for p in slow["placements"]] == ["preempted", "ran"]
    assert slow["outcome"] == "complete:stop"
    assert slow["cancel_requested_ms"] is None
    # The interactive run had its answer before the batch run's first token.
    calm_done = calm["received_unix"] + calm["terminal_ms"] / 1000.0
    slow_first = slow["received_unix"] + slow["first_output_ms"] / 1000.0
    assert calm_done < slow_first
    assert _preemptions(edge) == before + 1


def _preemptions(edge: Edge) -> float:
    for line in edge.admin_get("/metrics").text.splitlines():
        if line.startswith("iop_preemptions_total "):
            return float(line.split()[1])
    raise AssertionError("no iop_preemptions_total in /metrics")


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("x-iop-session-id", "agent-1"),
        ("x-claude-code-session-id", "3f1c-cc"),
        ("session_id", "codex-conv-1"),  # an underscore: through hypercorn as sent
        ("x-llm-d-inference-fairness-id", "fair-1"),
    ],
)
def test_a_session_header_reaches_the_runs_timeline(
    cluster: Cluster, header: str, value: str
) -> None:
    edge = cluster.edge
    edge.admin_key = ADMIN_KEY
    ids: list[str] = []
    with edge.openai() as client:
        made = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_headers={header: value}, user="ignored"
        )
        ids.append(made.id.removeprefix("chatcmpl-"))
    t = _timeline(edge, ids[0])
    assert (t["session"], t["session_from"]) == (value, header)


@pytest.mark.parametrize("header", ["x-iop-objective", "x-llm-d-inference-objective"])
def test_an_unknown_objective_names_the_header_it_came_in(cluster: Cluster, header: str) -> None:
    with cluster.edge.openai() as client, pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_headers={header: "realtime"}
        )
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["param"] == header
    assert f"(header '{header}')" in error["message"]
    assert "'realtime'" in error["message"]
