"""The edge places each operation only on instances that advertise it.

Over in-memory links, in virtual time, with nodes played by hand (the
helpers of ``test_core``): embeddings go to the instance that serves them,
a model nobody serves for an operation is a 400 that says so, and the new
events cross the link with credit like deltas.
"""

from __future__ import annotations

import msgspec
import pytest
import trio
import trio.testing

from iop.capabilities import Capabilities, ProviderStatus
from iop.edge import open_edge_core
from iop.errors import RequestError
from iop.events import Complete, EmbeddingData, Start, TokenCount, Usage
from iop.spec import CompletionRequest, EmbeddingRequest, ExecutionSpec, TokenizeRequest
from tests.edge.test_core import caps, config, connect, drain_events


def embed_spec(run_id: str = "e1", model: str = "m") -> ExecutionSpec:
    return ExecutionSpec(run_id=run_id, request=EmbeddingRequest(model=model, inputs=["a", "b"]))


def with_ops(base: Capabilities, *ops: str, instance: str = "i0") -> Capabilities:
    return msgspec.structs.replace(base, operations=ops, instance=instance)


async def test_embeddings_go_only_to_an_instance_that_serves_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        chat_only = await connect(core, nursery, [caps(slots=4)], "chat")
        embedder = await connect(
            core, nursery, [with_ops(caps(slots=1), "chat", "embedding")], "emb"
        )
        for i in range(3):  # the chat-only node has more free slots: still not chosen
            run = core.start_run(embed_spec(f"e{i}"))
            assign = await embedder.assigns.receive()
            assert isinstance(assign.assign.spec.request, EmbeddingRequest)
            await embedder.send(
                f"e{i}",
                Start(),
                EmbeddingData.of(0, [0.5]),
                EmbeddingData.of(1, [0.25]),
                Complete(usage=Usage(input_tokens=2)),
            )
            assert await drain_events(run) == [
                Start(),
                EmbeddingData.of(0, [0.5]),
                EmbeddingData.of(1, [0.25]),
                Complete(usage=Usage(input_tokens=2)),
            ]
        assert chat_only.assigned == []
        nursery.cancel_scope.cancel()


async def test_model_served_but_not_for_the_operation_is_a_400(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        await connect(core, nursery, [caps()], "n1")  # chat only (the old default)
        with pytest.raises(RequestError) as info:
            core.start_run(embed_spec())
        assert info.value.status == 400
        assert info.value.code == "operation_not_supported"
        assert info.value.param == "model"
        assert info.value.message == "The model `m` does not serve embeddings."
        with pytest.raises(RequestError) as info:
            core.start_run(embed_spec(model="other"))
        assert info.value.status == 404
        nursery.cancel_scope.cancel()


async def test_operation_served_only_by_an_unavailable_instance_is_a_503(
    autojump_clock: trio.testing.MockClock,
) -> None:
    down = with_ops(caps(status=ProviderStatus.UNAVAILABLE), "embedding", instance="i1")
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        await connect(core, nursery, [caps(), down], "n1")
        with pytest.raises(RequestError) as info:
            core.start_run(embed_spec())
        assert info.value.status == 503
        nursery.cancel_scope.cancel()


async def test_token_count_crosses_the_link(autojump_clock: trio.testing.MockClock) -> None:
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        node = await connect(core, nursery, [with_ops(caps(), "chat", "tokenize")], "n1")
        spec = ExecutionSpec(run_id="t1", request=TokenizeRequest(model="m", prompt="hi"))
        run = core.start_run(spec)
        assign = await node.assigns.receive()
        assert assign.assign.spec == spec
        await node.send("t1", Start(), TokenCount(count=2), Complete())
        assert await drain_events(run) == [Start(), TokenCount(count=2), Complete()]
        nursery.cancel_scope.cancel()


async def test_embedding_failover_before_the_first_vector(
    autojump_clock: trio.testing.MockClock,
) -> None:
    emb = with_ops(caps(slots=1), "embedding")
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        a = await connect(core, nursery, [emb], "a")
        b = await connect(core, nursery, [emb], "b")
        run = core.start_run(embed_spec())
        await trio.testing.wait_all_tasks_blocked()
        first, other = (a, b) if a.assigned else (b, a)
        await first.assigns.receive()
        await first.chan.aclose()  # lost before any vector
        await other.assigns.receive()
        await other.send("e1", Start(), EmbeddingData.of(0, [1.0]), EmbeddingData.of(1, [1.0]))
        await other.send("e1", Complete())
        events = await drain_events(run)
        assert events[-1] == Complete()
        assert len([e for e in events if isinstance(e, EmbeddingData)]) == 2
        nursery.cancel_scope.cancel()


def test_affinity_keys_of_the_other_operations() -> None:
    from iop.edge.scheduler._affinity import AFFINITY_PROMPT_HEAD_CHARS, affinity_key

    head = "x" * AFFINITY_PROMPT_HEAD_CHARS
    key = affinity_key(CompletionRequest(model="m", prompt=head + "tail one"))
    assert key is not None
    assert key.startswith("prompt:")
    assert affinity_key(CompletionRequest(model="m", prompt=head + "tail two")) == key
    assert affinity_key(CompletionRequest(model="m", prompt="y" + head)) != key
    assert affinity_key(CompletionRequest(model="m", prompt=[1, 2])) != key
    assert affinity_key(CompletionRequest(model="m", prompt="p", user="bob")) == "user:m:bob"
    assert affinity_key(EmbeddingRequest(model="m", inputs=["a"])) is None
    assert affinity_key(EmbeddingRequest(model="m", inputs=["a"], user="u")) == "user:m:u"
    assert affinity_key(TokenizeRequest(model="m", prompt="a")) is None
