"""The whole chain below HTTP, on real sockets: EdgeCore -> link -> NodeAgent ->
vLLM adapter -> the sim's HTTP server (vLLM's wire format) and back.

Each operation is started the way the edge's HTTP layer starts a surface's
run (``EdgeCore.start_run``), and its events are fed to the surface's
encoder or collector, as the HTTP layer will: the bytes a client would get.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import msgspec
import trio

from iop.api._surface import RunContext
from iop.api.completions import COMPLETIONS
from iop.api.embeddings import EMBEDDINGS
from iop.config import (
    Deadlines,
    EdgeConfig,
    LinkSettings,
    NodeConfig,
    NodeEdge,
    NodeSection,
    OutputPolicy,
    SchedulerSettings,
    SimConfig,
    VllmInstance,
)
from iop.edge import EdgeCore, open_edge_core
from iop.events import RuntimeEvent, TokenCount
from iop.node import open_node_agent
from iop.runtime import Run
from iop.sim import CompletionRequest as SimCompletionRequest
from iop.sim import build_completion_script, embedding_vector, serve_sim, tokenize
from iop.spec import ExecutionSpec, OperationRequest, TokenizeRequest
from iop.testing._memory_link import memory_link_pair
from tests.sim._schemas import validate_completion_chunk, validate_embeddings

TOKEN = "chain-token"
SIM = SimConfig(ttft_s=0.0, output_tokens=8, embedding_dim=8)
CTX = RunContext(run_id="r1", created=1700000000, policy=OutputPolicy())
WAIT_S = 20.0


@asynccontextmanager
async def chain() -> AsyncIterator[EdgeCore]:
    edge_cfg = EdgeConfig(
        link=LinkSettings(node_tokens=[TOKEN], run_window=8),
        scheduler=SchedulerSettings(max_queue=4, queue_timeout_s=5.0),
        deadlines=Deadlines(first_token_timeout_s=10, idle_timeout_s=10, request_timeout_s=30),
    )
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        url: str = await nursery.start(
            partial(serve_sim, SIM, "127.0.0.1", 0, shutdown_trigger=stop.wait)
        )
        instance = VllmInstance(
            name="v", endpoint=url, operations=["chat", "completion", "embedding", "tokenize"]
        )
        edge = NodeEdge(url="ws://edge.test/v1/link", token=TOKEN)
        node_cfg = NodeConfig(node=NodeSection(id="n1", edges=[edge]), instances=[instance])
        async with open_edge_core(edge_cfg) as core, open_node_agent(node_cfg) as agent:
            edge_end, node_end = memory_link_pair()
            nursery.start_soon(core.handle_link, edge_end, "test")
            nursery.start_soon(partial(agent.serve_link, node_end, edge=edge))
            with trio.fail_after(WAIT_S):
                while not core.scheduler.serves(SIM.model):
                    await trio.sleep(0.01)
            try:
                yield core
            finally:
                nursery.cancel_scope.cancel()
        stop.set()


async def events_of(run: Run) -> list[RuntimeEvent]:
    with trio.fail_after(WAIT_S):
        async with run.events:
            return [ev async for ev in run.events]


def start(core: EdgeCore, request: OperationRequest, run_id: str = "r1") -> Run:
    return core.start_run(ExecutionSpec(run_id=run_id, request=request))


async def test_completions_embeddings_and_token_counts_through_edge_and_node() -> None:
    async with chain() as core:
        body = {"model": SIM.model, "prompt": "Once upon", "max_tokens": 5, "stream": True}
        call = COMPLETIONS.parse(json.dumps(body).encode(), {})
        enc = COMPLETIONS.stream(call, CTX)
        streamed = enc.start() + enc.feed_many(await events_of(start(core, call.request, "c1")))

        body = {"model": SIM.model, "input": ["alpha", "beta"], "encoding_format": "float"}
        call = EMBEDDINGS.parse(json.dumps(body).encode(), {})
        col = EMBEDDINGS.collector(call, CTX)
        for ev in await events_of(start(core, call.request, "e1")):
            col.feed(ev)
        status, embedded = col.result()

        counted = await events_of(start(core, TokenizeRequest(model=SIM.model, prompt="a b"), "t1"))

    frames = streamed.decode().split("\n\n")[:-1]
    assert frames[-1] == "data: [DONE]"
    chunks = [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]
    for chunk in chunks:
        validate_completion_chunk(chunk)
    expected = build_completion_script(
        SimCompletionRequest(model=SIM.model, prompt="Once upon", max_tokens=5), SIM
    ).choices[0]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    assert status == 200
    obj = msgspec.json.decode(embedded)
    validate_embeddings(obj)
    assert [d["embedding"] for d in obj["data"]] == [
        embedding_vector(t, dim=8, seed=SIM.seed) for t in ("alpha", "beta")
    ]
    assert obj["usage"]["prompt_tokens"] == len(tokenize("alpha")) + len(tokenize("beta"))

    assert TokenCount(count=len(tokenize("a b"))) in counted
