"""Restarting the edge under a live node: the node comes back by itself.

The edge listens on a port chosen here (a restart must reuse it: nodes dial a
fixed URL). It is stopped mid-stream, gracefully (SIGTERM: drain, close the
links with 1001) or not (SIGKILL: the kernel closes the sockets). Either way
the node cancels the run it was executing (the backend sees its client go),
reconnects with backoff, and the new edge process serves the model again.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import openai
import pytest

from tests.e2e._platform import MODEL, Procs, Sim, StreamResult, free_port, read_more, read_stream

pytestmark = pytest.mark.slow

MESSAGES: list[Any] = [{"role": "user", "content": "Tell me a long story."}]
CONFIG: dict[str, Any] = {"server": {"keepalive_interval_s": 0.5, "drain_timeout_s": 0.5}}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_edge_restart_on_the_same_port(procs: Procs, sim: Sim, sig: signal.Signals) -> None:
    port = free_port()
    edge = procs.edge(CONFIG, port=port, name="edge-1")
    assert edge.port == port
    procs.node([edge], sim, node_id="n1")
    edge.wait_ready(node_id="n1")
    disconnects = sim.stats()["client_disconnects"]

    r = StreamResult([], "", [], "", {}, None, None)
    with (
        edge.openai() as client,
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            stream=True,
            extra_body={"iop_sim": {"output_tokens": 1000, "tokens_per_s": 20.0}},
        ) as stream,
    ):
        it = iter(stream)
        read_more(it, r, 3)
        edge.proc.send(sig)
        with pytest.raises(openai.APIError) as info:
            read_more(it, r)
    if sig is signal.SIGTERM:
        # Drained: the run is cut at drain_timeout_s with a clean SSE error.
        assert info.value.code == "shutdown"
        assert edge.proc.wait(15) == 0
    else:
        assert isinstance(info.value, openai.APIConnectionError)
        assert edge.proc.wait(5) == -signal.SIGKILL
    assert r.finish_reason is None
    # The node stopped the backend request of the run it lost.
    sim.wait_disconnects(disconnects)

    t0 = time.monotonic()
    new_edge = procs.edge(CONFIG, port=port, name="edge-2")
    new_edge.wait_ready(node_id="n1")
    print(
        f"\nedge restarted after {sig.name}: the node was back {time.monotonic() - t0:.2f}s later"
    )
    assert new_edge.models() == [MODEL]
    with new_edge.openai() as client:
        assert [m.id for m in client.models.list()] == [MODEL]
        with client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            stream=True,
            extra_body={"iop_sim": {"output_tokens": 5}},
        ) as stream:
            again = read_stream(stream)
    assert again.finish_reason == "stop"
    assert len(again.content_deltas) == 5
    sim.wait_idle()
