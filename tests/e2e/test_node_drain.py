"""An operator drains a node, end to end: ``iop edge``, two ``iop node``s (one
slot each) and the sim, real processes on loopback, driven with the OpenAI SDK
and ``POST /admin/nodes/{id}/drain`` as ``curl`` would send it.

The run in flight on the drained node completes; the next runs go to the
other node; a run that finds the other node's slot taken waits in the queue
rather than go to the idle drained node; the drain outlives the node's
restart; the undrain hands the waiting run to it at once.
"""

from __future__ import annotations

import threading
from typing import Any, Final

import pytest

from tests.e2e._platform import MODEL, Edge, Procs, Sim, StreamResult, poll, read_more

pytestmark = pytest.mark.slow

ADMIN_KEY: Final = "sk-e2e-admin"
MESSAGES: list[Any] = [{"role": "user", "content": "Tell me a story."}]
# 6 s of tokens: long enough to drain the node under it, on a loaded machine too.
SHORT = {"iop_sim": {"output_tokens": 60, "tokens_per_s": 10.0}}
# 50 s of tokens: holds a slot until the test closes the stream.
LONG = {"iop_sim": {"output_tokens": 1000, "tokens_per_s": 20.0}}
QUICK = {"iop_sim": {"output_tokens": 3}}


def admin_post(edge: Edge, path: str, **kwargs: Any) -> dict[str, Any]:
    resp = edge.post(path, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, **kwargs)
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def placed_on(edge: Edge, completion_id: str) -> str:
    run_id = completion_id.removeprefix("chatcmpl-")
    resp = edge._client.get(
        f"/admin/runs/{run_id}", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    resp.raise_for_status()
    node: str = resp.json()["placements"][-1]["node"]
    return node


def node_runs(edge: Edge) -> dict[str, int]:
    return {n["id"]: len(n["runs"]) for n in edge.admin()["nodes"]}


def test_a_drained_node_finishes_its_run_and_the_next_go_elsewhere(procs: Procs, sim: Sim) -> None:
    edge = procs.edge(
        {
            "server": {"keepalive_interval_s": 0.5, "admin_keys": [ADMIN_KEY]},
            "scheduler": {"queue_timeout_s": 30.0},
        }
    )
    node_cfg = {"instance": {"max_concurrency": 1}}
    nodes = {n: procs.node([edge], sim, node_id=n, name=n, **node_cfg) for n in ("n1", "n2")}
    edge.wait_ready(node_id="n1")
    edge.wait_ready(node_id="n2")

    with edge.openai() as client:
        # A run in flight; drain the node it is on.
        r = StreamResult([], "", [], "", {}, None, None)
        with client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, extra_body=SHORT
        ) as stream:
            chunks = iter(stream)
            read_more(chunks, r, 3)
            [busy] = [n for n, runs in node_runs(edge).items() if runs]
            other = "n2" if busy == "n1" else "n1"
            drained = admin_post(
                edge, f"/admin/nodes/{busy}/drain", json={"reason": "e2e: kernel upgrade"}
            )
            assert drained["changed"] is True
            assert drained["runs"] == 1
            read_more(chunks, r)
        assert r.finish_reason == "stop"
        assert len(r.content_deltas) == 60

        # The next runs all go to the other node.
        for _ in range(3):
            answer = client.chat.completions.create(
                model=MODEL, messages=MESSAGES, extra_body=QUICK
            )
            assert placed_on(edge, answer.id) == other
        metrics = edge.get("/metrics").text
        assert f'iop_node_drained{{node="{busy}"}} 1.0' in metrics
        assert f'iop_node_drained{{node="{other}"}} 0.0' in metrics

        # The drained node restarts: it comes back drained.
        nodes[busy].proc.stop()
        poll(lambda: busy not in node_runs(edge), timeout=10, what=f"{busy} to leave")
        procs.node([edge], sim, node_id=busy, name=f"{busy}-again", **node_cfg)
        poll(lambda: busy in node_runs(edge), timeout=20, what=f"{busy} to come back")
        [view] = [n for n in edge.admin()["nodes"] if n["id"] == busy]
        assert view["drained"]["reason"] == "e2e: kernel upgrade"
        assert edge.get("/v1/models").json()["data"][0]["nodes"] == [other]

        # The other node's only slot is taken: a new run waits in the queue
        # rather than go to the idle drained node...
        results: dict[str, Any] = {}

        def queued() -> None:
            with edge.openai() as c:
                try:
                    results["answer"] = c.chat.completions.create(
                        model=MODEL, messages=MESSAGES, extra_body=QUICK
                    )
                except Exception as exc:
                    results["error"] = exc

        with client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, extra_body=LONG
        ) as holder:
            read_more(iter(holder), StreamResult([], "", [], "", {}, None, None), 2)
            waiter = threading.Thread(target=queued)
            waiter.start()
            try:
                poll(lambda: edge.admin()["queued"] == 1, timeout=10, what="a queued run")
                assert node_runs(edge)[busy] == 0
                # ...until the undrain hands it the drained node's free slot.
                undrained = admin_post(edge, f"/admin/nodes/{busy}/undrain")
                assert undrained["drained"] is None
                waiter.join(30)
            finally:
                waiter.join(30)
        assert "error" not in results, results
        assert placed_on(edge, results["answer"].id) == busy
    assert edge.admin()["drained"] == {}
    log = edge.proc.stderr()
    assert f"node {busy} drained by admin key from 127.0.0.1 (e2e: kernel upgrade)" in log
    assert f"node {busy} undrained by admin key from 127.0.0.1" in log
