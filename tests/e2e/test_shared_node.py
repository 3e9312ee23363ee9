"""Two edges sharing one node, real processes on loopback.

The shared node's instance has one slot. Edge B's long stream takes it;
edge A learns it from the node's load report (its own count says the node
is idle) and places its run on the spare node without a refusal. With the
report not used (the node sends none), edge A tries the shared node, the
node refuses (``queue_full``) and A fails the run over. The reports carry
the sim's engine figures (its ``/metrics`` in vLLM's names).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e._platform import MODEL, Edge, Procs, poll, read_stream

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
LONG = {"iop_sim": {"output_tokens": 1000, "tokens_per_s": 20.0}}
SHARED = {"max_concurrency": 1, "max_queue": 0}


def shared_report(edge: Edge) -> dict[str, Any] | None:
    for node in edge.admin()["nodes"]:
        if node["id"] == "shared":
            report: dict[str, Any] | None = node["instances"][0]["reported"]
            return report
    return None


def last_run(edge: Edge) -> dict[str, Any]:
    resp = edge.get("/admin/runs?limit=1")
    resp.raise_for_status()
    run: dict[str, Any] = resp.json()["recent"][0]
    return run


@pytest.mark.parametrize("reports", [10.0, 0.0], ids=["reports", "no-reports"])
def test_a_node_filled_by_another_edge_is_avoided_or_refused(procs: Procs, reports: float) -> None:
    sim = procs.sim()
    a = procs.edge({})
    b = procs.edge({}, name="edge-b")
    # Registered first on A: with equal counts, A's first choice.
    procs.node(
        [a, b],
        sim,
        name="shared",
        node_id="shared",
        instance=SHARED,
        node={"load_reports_per_s": reports},
    )
    a.wait_ready(node_id="shared")
    procs.node([a], sim, name="spare", node_id="spare", node={"load_reports_per_s": reports})
    a.wait_ready(node_id="spare")
    b.wait_ready(node_id="shared")
    with b.openai() as client_b, a.openai() as client_a:
        stream = client_b.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, extra_body=LONG
        )
        with stream:
            assert read_stream(stream, limit=2).content_deltas
            if reports:
                poll(
                    lambda: (r := shared_report(a)) is not None and r["in_flight"] == 1,
                    timeout=10,
                    what="edge A to learn that the shared node is busy",
                )
                report = shared_report(a)
                assert report is not None
                assert report["stale"] is False
                assert report["engine"] is not None  # the sim's /metrics
            else:
                assert shared_report(a) is None
            answer = client_a.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
            assert answer.choices[0].message.content
            run = last_run(a)
            assert run["node"] == "spare"
            # With the report, straight there; without, refused first, then failed over.
            assert run["attempts"] == (1 if reports else 2)
    metrics = a.get("/metrics").text
    assert "iop_load_stale_instances 0.0" in metrics
