"""The node runs every operation: embeddings, token counts and completions
through the sim adapter, in credit-bounded frames that fit the edge's limit."""

from __future__ import annotations

import msgspec
import trio
import trio.testing

from iop.adapters.sim import SimAdapter
from iop.errors import LinkError
from iop.events import Complete, Delta, EmbeddingData, Start, TokenCount, is_terminal
from iop.node import NodeAgent
from iop.protocol import EdgeSession, RunEvents, decode_node_batch
from iop.sim import embedding_vector, tokenize
from iop.spec import CompletionRequest, EmbeddingRequest, ExecutionSpec, TokenizeRequest
from iop.testing._memory_link import memory_link_pair
from tests.node.test_agent import (
    EDGE,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    TOKEN,
    FakeEdge,
    assert_grammar,
    link,
    running_node,
    sim,
)

# Below what one batch of the run's buffer holds (16 vectors of 4 KiB and
# more): the node must cut its batches.
LIMIT = 32 * 1024


async def link_with_limit(nursery: trio.Nursery, agent: NodeAgent) -> FakeEdge:
    """``link``, with an edge that accepts frames of at most ``LIMIT`` bytes."""
    edge_chan, node_chan = memory_link_pair()
    edge = FakeEdge(edge_chan)
    edge.session = EdgeSession(
        tokens=(TOKEN,),
        heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        now=trio.current_time(),
        max_frame_bytes=LIMIT,
    )

    async def serve() -> None:
        try:
            await agent.serve_link(node_chan, edge=EDGE)
        except LinkError as exc:  # the link's end, as ``link`` records it
            edge.node_error = exc
        finally:
            edge.node_done.set()

    nursery.start_soon(serve)
    await edge.handshake()
    edge.start(nursery)
    return edge


async def test_embeddings_of_a_large_batch_cross_in_frames_that_fit(
    autojump_clock: trio.abc.Clock,
) -> None:
    inputs = 300
    dim = 1024  # 4 KiB a vector: 1.2 MiB for the batch
    adapter = SimAdapter(sim(embedding_dim=dim, max_inputs=inputs))
    async with (
        running_node(adapter.cfg, adapters={"sim": adapter}) as agent,
        trio.open_nursery() as nursery,
    ):
        edge = await link_with_limit(nursery, agent)
        largest = 0
        original = edge.chan.receive

        async def measuring_receive() -> bytes:
            nonlocal largest
            frame = await original()
            if any(isinstance(m, RunEvents) for m in decode_node_batch(frame)):
                largest = max(largest, len(frame))
            return frame

        edge.chan.receive = measuring_receive  # type: ignore[method-assign]
        texts = [f"input {i}" for i in range(inputs)]
        spec = ExecutionSpec(run_id="e1", request=EmbeddingRequest(model="iop-sim", inputs=texts))
        edge.session.assign("e1", "sim", spec, credit=128)
        await edge.flush()
        seen = 0
        while not edge._finished("e1").is_set():
            await edge.wait_events("e1", seen + 1)
            new = edge.events["e1"][seen:]
            seen += len(new)
            used = sum(not is_terminal(e) for e in new)
            if used and not edge._finished("e1").is_set():
                await edge.grant("e1", used)  # the credit comes back as the edge reads
        events = await edge.wait_finished("e1")
        await edge.close()
    assert_grammar(events)
    assert isinstance(events[-1], Complete), events[-1]
    vectors = [e for e in events if isinstance(e, EmbeddingData)]
    assert [v.index for v in vectors] == list(range(inputs))
    assert vectors[7].floats() == embedding_vector(texts[7], dim=dim, seed=adapter.cfg.sim.seed)
    assert isinstance(events[-1], Complete)
    assert 0 < largest <= LIMIT


async def test_token_count_and_completion_runs(autojump_clock: trio.abc.Clock) -> None:
    adapter = SimAdapter(sim())
    async with (
        running_node(adapter.cfg, adapters={"sim": adapter}) as agent,
        trio.open_nursery() as nursery,
    ):
        edge = await link(nursery, agent)
        hello = edge.hello
        assert hello is not None
        assert hello.instances[0].operations == ("chat", "completion", "embedding", "tokenize")
        count = ExecutionSpec(run_id="t1", request=TokenizeRequest(model="iop-sim", prompt="a b c"))
        edge.session.assign("t1", "sim", count, credit=8)
        await edge.flush()
        assert await edge.wait_finished("t1") == [
            Start(target="iop-sim"),
            TokenCount(count=len(tokenize("a b c"))),
            Complete(usage=msgspec.structs.replace(Complete().usage, input_tokens=3)),
        ]
        completion = ExecutionSpec(
            run_id="c1", request=CompletionRequest(model="iop-sim", prompt="Once", max_tokens=4)
        )
        edge.session.assign("c1", "sim", completion, credit=64)
        await edge.flush()
        events = await edge.wait_finished("c1")
        await edge.close()
    assert_grammar(events)
    assert sum(isinstance(e, Delta) for e in events) == 4
