"""A node with a backend it runs itself: the supervisor's changes reach the edge at once.

The backend is a ``sim`` adapter with a ``Supervisor`` over a fake process
(``tests/managed/test_supervise.py``), so the agent's part is what is
tested: it starts the supervisor before the first probe, probes as soon as
the backend's state changes (not at ``probe_interval_s``), and restarts a
crash loop when the operator asks (``restart_backends``, SIGUSR1).
"""

from __future__ import annotations

import msgspec
import trio
import trio.testing

from iop.adapters import SimAdapter
from iop.capabilities import Capabilities, ProviderStatus
from iop.config import SimInstance, SuperviseSettings
from iop.managed import BackendState, Supervisor
from tests.managed.test_supervise import FakeProcess
from tests.node.test_agent import link, running_node, sim


class SupervisedSim(SimAdapter):
    """A sim whose 'backend process' is supervised; unavailable unless it is up."""

    def __init__(self, cfg: SimInstance, proc: FakeProcess) -> None:
        super().__init__(cfg)
        settings = SuperviseSettings(restart_min_s=1.0, crash_loop_exits=3)
        self.supervisor: Supervisor[str] = Supervisor(cfg.name, proc.serve, settings)

    async def capabilities(self) -> Capabilities:
        caps = await super().capabilities()
        if self.supervisor.state is BackendState.UP:
            return caps
        return msgspec.structs.replace(
            caps,
            provider_status=ProviderStatus.UNAVAILABLE,
            provider_detail=self.supervisor.detail,
        )


async def test_a_managed_backends_changes_are_pushed_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    proc = FakeProcess(failing={2, 3})
    managed = SupervisedSim(sim("managed"), proc)
    async with (
        running_node(managed.cfg, adapters={"managed": managed}, probe_interval_s=3600.0) as agent,
        trio.open_nursery() as nursery,
    ):
        # Started before the first probe: the node says hello with it serving.
        assert [c.provider_status for c in agent.capabilities] == ["available"]
        edge = await link(nursery, agent)

        killed_at = trio.current_time()
        proc.kill()
        with trio.fail_after(60):  # virtual: far below the probe interval
            while not any(
                c.provider_status == "unavailable" and "crash loop" in c.provider_detail
                for update in edge.caps_updates
                for c in update
            ):
                await trio.sleep(0.01)
        details = [c.provider_detail for update in edge.caps_updates for c in update]
        assert details[0].startswith("start 1 was killed")
        assert trio.current_time() - killed_at < 60
        assert proc.starts == 3
        assert agent.restart_backends() == ["managed"]
        with trio.fail_after(60):
            while edge.caps_updates[-1][0].provider_status != "available":
                await trio.sleep(0.01)
        assert proc.starts == 4
        assert agent.restart_backends() == []  # serving: nothing to restart
        await edge.close()
