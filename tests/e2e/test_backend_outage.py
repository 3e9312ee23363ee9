"""The backend behind a node goes down and comes back, end to end.

Each test has its own sim on a fixed port (so it can be restarted at the same
address), its own edge and its own node.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import openai
import pytest

from tests.e2e._platform import (
    MODEL,
    Proc,
    Procs,
    Sim,
    free_port,
    poll,
    read_stream,
    start_node,
)
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


def test_a_backend_that_is_down_says_why_everywhere(procs: Procs) -> None:
    """A node whose only instance points at a closed port: the node's log, the
    edge's admin view, ``iop probe`` and the 503 a client gets all name the
    instance and the cause; ``/readyz`` is 503 although a node is connected."""
    port = free_port()  # nothing listens there
    cause = f"connection refused by 127.0.0.1:{port}"
    edge = procs.edge(EDGE_CONFIG)
    node = start_node(procs.log_dir, [edge.link_url], f"http://127.0.0.1:{port}", node_id="n1")
    procs.adopt(node.proc)
    # poll stops at anything but None and False: an empty list would not wait.
    poll(lambda: edge.admin()["nodes"] != [], timeout=20, what="the node to connect")

    node.proc.wait_stderr(rf"instance status: vllm-sim=unavailable \(.*{cause}\)", timeout=10)
    assert f"vllm-sim (vllm http://127.0.0.1:{port}, unavailable: " in node.proc.stdout()

    (inst,) = edge.admin()["nodes"][0]["instances"]
    assert inst["provider_status"] == "unavailable"
    assert cause in inst["provider_detail"]
    assert cause in edge.get("/admin").text

    ready = edge.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["status"] == "no node can serve a model right now"

    with edge.openai() as client, pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert info.value.status_code == 503
    body = info.value.response.json()
    validate_error(body)
    assert body["error"]["code"] == "model_unavailable"
    assert "instance n1/vllm-sim" in body["error"]["message"]
    assert cause in body["error"]["message"]

    probe = subprocess.run(
        [sys.executable, "-m", "iop", "probe", "--config", str(procs.log_dir / "node.toml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert probe.returncode == 1, probe.stderr
    caps = json.loads(probe.stdout)
    assert caps["provider_status"] == "unavailable"
    assert cause in caps["provider_detail"]
