"""Where configs/multi-node/README.md says requests go, on that example's own files.

The example's edge.toml and node-a.toml are loaded as ``iop edge`` and
``iop node`` load them; the two nodes are played by hand over memory links
(``tests/edge/test_core.py``'s ``FakeNode``), each with the example's
instance slots. With the defaults (``[scheduler] affinity = true``,
``placement = "least_loaded"``) the same prompt goes back to the node that
served it until that node is full; with ``affinity = false``, as the README
shows, concurrent requests spread.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from iop.config import EdgeConfig, NodeConfig, load_config
from iop.edge import EdgeCore, open_edge_core
from iop.events import Complete, Start
from iop.runtime import Run
from iop.spec import ChatRequest, ExecutionSpec, Message
from tests.edge.test_core import TOKEN, FakeNode, caps, connect, drain_events

EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "multi-node"


@pytest.fixture(autouse=True)
def _node_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_NODE_TOKEN", TOKEN)  # what the README exports


def _edge_config(tmp_path: Path, extra: str = "") -> EdgeConfig:
    path = tmp_path / "edge.toml"
    path.write_text((EXAMPLE / "edge.toml").read_text() + extra)
    return load_config(path, EdgeConfig)


def _slots() -> int:
    (instance,) = load_config(EXAMPLE / "node-a.toml", NodeConfig).instances
    assert instance.max_concurrency is not None
    return instance.max_concurrency


async def _placed(
    core: EdgeCore, nodes: dict[str, FakeNode], specs: list[ExecutionSpec]
) -> list[str]:
    """Start ``specs`` at once; the node each went to, in order; then finish them."""
    runs: list[Run] = [core.start_run(s) for s in specs]
    await trio.testing.wait_all_tasks_blocked()
    where = [next(n for n, node in nodes.items() if s.run_id in node.assigned) for s in specs]
    for spec, name, run in zip(specs, where, runs, strict=True):
        await nodes[name].assigns.receive()
        await nodes[name].send(spec.run_id, Start(), Complete())
        await drain_events(run)
    return where


async def _with_example_nodes(
    cfg: EdgeConfig, batches: list[list[ExecutionSpec]]
) -> list[list[str]]:
    async with open_edge_core(cfg) as core, trio.open_nursery() as nursery:
        nodes = {
            name: await connect(core, nursery, [caps(slots=_slots(), model="qwen")], name)
            for name in ("node-a", "node-b")
        }
        placed = [await _placed(core, nodes, batch) for batch in batches]
        nursery.cancel_scope.cancel()
    return placed


def _chat(prompt: str, run_id: str) -> ExecutionSpec:
    messages = [Message(role="system", content="Be brief."), Message(role="user", content=prompt)]
    return ExecutionSpec(run_id=run_id, request=ChatRequest(model="qwen", messages=messages))


def _same(n: int, tag: str) -> list[ExecutionSpec]:
    return [_chat("Say hello.", f"{tag}{i}") for i in range(n)]


async def test_with_the_defaults_the_same_prompt_stays_on_one_node_until_it_is_full(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    cfg = _edge_config(tmp_path)
    assert (cfg.scheduler.affinity, cfg.scheduler.placement) == (True, "least_loaded")
    slots = _slots()
    *one_at_a_time, at_once = await _with_example_nodes(
        cfg, [*(_same(1, f"s{i}-") for i in range(4)), _same(slots + 1, "c")]
    )
    # curl in a loop: every request on the node that served the first.
    ((pinned,),) = set(map(tuple, one_at_a_time))
    # At once (runs start in any order): that node's slots fill first, only
    # the overflow goes to the other.
    assert at_once.count(pinned) == slots
    assert len(set(at_once)) == 2


async def test_one_at_a_time_even_different_prompts_go_to_one_node(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # Least-loaded among idle nodes is a tie, and a tie goes to the first
    # node registered: no round robin.
    placed = await _with_example_nodes(
        _edge_config(tmp_path), [[_chat(f"question {i}", f"d{i}")] for i in range(4)]
    )
    assert len({name for (name,) in placed}) == 1


async def test_concurrent_different_prompts_spread(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    (placed,) = await _with_example_nodes(
        _edge_config(tmp_path), [[_chat(f"question {i}", f"d{i}") for i in range(4)]]
    )
    assert sorted(placed) == ["node-a", "node-a", "node-b", "node-b"]


async def test_without_affinity_the_same_prompt_spreads_least_loaded_first(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    cfg = _edge_config(tmp_path, "\n[scheduler]\naffinity = false\n")  # as the README says
    assert not cfg.scheduler.affinity
    (placed,) = await _with_example_nodes(cfg, [_same(4, "c")])
    assert sorted(placed) == ["node-a", "node-a", "node-b", "node-b"]
