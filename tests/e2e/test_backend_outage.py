"""The backend behind a node goes down and comes back, end to end.

Each test has its own sim on a fixed port (so it can be restarted at the same
address), its own edge and its own node.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.e2e._platform import MODEL, Proc, Procs, Sim, free_port, poll, read_stream
from tests.edge._openai_schema import validate_error

pytestmark = pytest.mark.slow

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
EDGE_CONFIG: dict[str, Any] = {"server": {"keepalive_interval_s": 0.5}}


def sim_on(procs: Procs, port: int, name: str) -> Sim:
    """An ``iop sim`` on ``port`` (owned by the test)."""
    proc = Proc(name, ["sim", "--port", str(port)], procs.log_dir)
    procs.adopt(proc)
    proc.wait_stdout(r"serving model")
    sim = Sim(proc, f"http://127.0.0.1:{port}")
    procs.adopt_client(sim)
    return sim


def test_backend_restart_is_transparent(procs: Procs) -> None:
    """While the backend is down, clients get a retryable 503 naming the cause;
    once it is back (same address), requests succeed again without any restart."""
    port = free_port()
    sim = sim_on(procs, port, "sim-1")
    edge = procs.edge(EDGE_CONFIG)
    # Probes far apart: this test is about the run path, not the probe.
    procs.node([edge], sim, node={"probe_interval_s": 60.0})
    edge.wait_ready()
    sim.proc.kill()
    with edge.openai() as client:
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as info:
                client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream)
            assert info.value.status_code == 503
            assert info.value.code == "backend_unavailable"
            validate_error(info.value.response.json())
        sim_on(procs, port, "sim-2")
        with client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            stream=True,
            extra_body={"iop_sim": {"output_tokens": 5}},
        ) as s:
            r = read_stream(s)
    assert r.finish_reason == "stop"
    assert len(r.content_deltas) == 5


def test_model_of_an_unavailable_backend_is_unavailable_not_unknown(procs: Procs) -> None:
    port = free_port()
    sim = sim_on(procs, port, "sim-1")
    edge = procs.edge(EDGE_CONFIG)
    procs.node([edge], sim, node={"probe_interval_s": 0.2})
    edge.wait_ready()
    sim.proc.kill()

    def unavailable() -> bool:
        nodes = edge.admin()["nodes"]
        return bool(nodes) and nodes[0]["instances"][0]["provider_status"] == "unavailable"

    poll(unavailable, timeout=10, what="the node's probe to report the backend unavailable")
    with edge.openai() as client, pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert info.value.status_code == 503
