"""A config reload of the node agent (``NodeAgent.apply_config``) over an
in-memory link, in virtual time: instances added, removed and replaced while
runs stream, and those runs untouched."""

from __future__ import annotations

import logging

import msgspec
import pytest
import trio
import trio.testing

from iop.errors import ConfigError
from iop.events import Delta, Error
from tests.node.test_agent import assert_grammar, link, running_node, sim


def deltas(events: list[object]) -> int:
    return sum(isinstance(e, Delta) for e in events)


async def test_instances_added_removed_and_replaced_while_runs_stream(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="iop.node")
    slow = {"output_tokens": 40, "tokens_per_s": 10.0}
    async with (
        running_node(sim("a", **slow), sim("b", **slow), probe_interval_s=60.0) as agent,
        trio.open_nursery() as nursery,
    ):
        edge = await link(nursery, agent)
        await edge.assign("ra", instance="a")
        await edge.assign("rb", instance="b")
        await edge.wait_events("ra", 3)
        await edge.wait_events("rb", 3)
        new = msgspec.structs.replace(
            agent.config,
            instances=[sim("a", output_tokens=5, max_concurrency=3), sim("c", model="iop-c")],
        )
        agent.apply_config(new)
        await trio.testing.wait_all_tasks_blocked()
        # b left the edge at once; then the probe (at once, not in 60 s)
        # advertised a's new settings and c.
        assert [c.instance for c in edge.caps_updates[0]] == ["a"]
        latest = {c.instance: c for c in edge.caps_updates[-1]}
        assert sorted(latest) == ["a", "c"]
        assert latest["a"].max_concurrency == 3
        assert latest["c"].targets == ("iop-c",)
        # b refuses new runs; a's new runs get its new adapter; c serves.
        await edge.assign("rb2", instance="b")
        (refused,) = await edge.wait_finished("rb2")
        assert isinstance(refused, Error)
        assert refused.code == "unknown_instance"
        await edge.assign("ra2", instance="a")
        await edge.assign("rc", instance="c")
        assert deltas(await edge.wait_finished("ra2")) == 5
        assert_grammar(await edge.wait_finished("rc"))
        # The runs that were going finish whole, on the adapters they started on...
        for run_id in ("ra", "rb"):
            events = await edge.wait_finished(run_id)
            assert_grammar(events)
            assert deltas(events) == 40
        await trio.testing.wait_all_tasks_blocked()
        # ...which are closed once they end: a's old one and b's.
        assert caplog.text.count("an adapter it no longer uses is closed") == 2
        assert [i.name for i in agent.snapshot().instances] == ["a", "c"]
        await edge.close()


async def test_a_reload_that_cannot_apply_changes_nothing(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with running_node(sim("a")) as agent:
        twice = msgspec.structs.replace(agent.config, instances=[sim("a"), sim("a")])
        with pytest.raises(ConfigError, match="unique"):
            agent.apply_config(twice)
        assert agent.config.instances == [sim("a")]
