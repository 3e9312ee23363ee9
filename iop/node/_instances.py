"""The node's adapter instances: their slots, their probes, and how a run uses them.

An ``Instance`` is one configured backend: its adapter, its deadlines and
its ``InstanceSlots`` limiter. ``RunExecutor`` is what the runtime executes
for one run: a slot of the instance (the wait is wrapped in
``sink.queued()``, so the first-token deadline starts once it has one), then
the adapter. ``probe`` asks every instance's adapter what it serves,
concurrently and within ``PROBE_GUARD_S``; a probe that fails or hangs
reports its instance as unavailable, with why.
"""

from __future__ import annotations

import logging
from typing import Final

import trio

from iop.adapters import Adapter
from iop.capabilities import Capabilities, ProviderStatus, provider_detail
from iop.config import Deadlines, InstanceConfig
from iop.node._slots import InstanceSlots
from iop.runtime import RunSink
from iop.spec import ExecutionSpec

__all__ = ["PROBE_GUARD_S", "Instance", "RunExecutor", "probe"]

log = logging.getLogger("iop.node")

# Outer bound of one instance's capabilities probe. Adapters apply their own
# probe timeout (2 s for HTTP ones); this only keeps a broken adapter from
# wedging the probe loop.
PROBE_GUARD_S: Final = 30.0


class Instance:
    """One configured backend: adapter, deadlines, slots."""

    def __init__(self, cfg: InstanceConfig, adapter: Adapter) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.adapter = adapter
        self.deadlines: Deadlines = cfg.deadlines
        self.slots = InstanceSlots(cfg.max_concurrency, cfg.max_queue, cfg.queue_timeout_s)

    def fallback_capabilities(self, detail: str = "not probed yet") -> Capabilities:
        """What to advertise when the adapter cannot say (its probe crashed)."""
        return Capabilities(
            adapter=self.adapter.kind,
            instance=self.name,
            targets=tuple(self.cfg.targets),
            max_concurrency=self.cfg.max_concurrency,
            max_queue=self.cfg.max_queue,
            queue_timeout_s=self.cfg.queue_timeout_s,
            request_timeout_s=self.deadlines.request_timeout_s or 0.0,
            provider_status=ProviderStatus.UNAVAILABLE,
            provider_detail=provider_detail(detail),
        )


class RunExecutor:
    """What the runtime executes for one run: a slot of the instance, then the adapter."""

    __slots__ = ("_instance",)

    def __init__(self, instance: Instance) -> None:
        self._instance = instance

    async def execute(self, spec: ExecutionSpec, send: RunSink) -> None:
        # take/release, not ``async with slots.acquire()`` in an exit stack:
        # the stack and the generator cost 1.4 KiB per open stream
        # (docs/benchmarks.md, "Memory", "Second pass").
        slots = self._instance.slots
        with send.queued():  # waiting for a slot is not the backend's latency
            await slots.take()
        try:
            await self._instance.adapter.execute(spec, send)
        finally:
            slots.release()


async def probe(instances: list[Instance]) -> list[Capabilities]:
    """Every instance's capabilities, probed concurrently, in order."""
    results = [inst.fallback_capabilities() for inst in instances]

    async def one(i: int, inst: Instance) -> None:
        with trio.move_on_after(PROBE_GUARD_S) as guard:
            try:
                results[i] = await inst.adapter.capabilities()
            except Exception as exc:
                log.warning("instance %s: capabilities probe failed: %r", inst.name, exc)
                results[i] = inst.fallback_capabilities(
                    f"capabilities probe failed: {type(exc).__name__}"
                )
        if guard.cancelled_caught:
            log.warning("instance %s: capabilities probe took over %gs", inst.name, PROBE_GUARD_S)
            results[i] = inst.fallback_capabilities(
                f"capabilities probe took over {PROBE_GUARD_S:g}s"
            )

    async with trio.open_nursery() as nursery:
        for i, inst in enumerate(instances):
            nursery.start_soon(one, i, inst)
    return results
