"""The node's adapter instances: their slots, their probes, and how a run uses them.

An ``Instance`` is one configured backend: its adapter, its deadlines and
its ``InstanceSlots`` limiter. ``RunExecutor`` is what the runtime executes
for one run: a slot of the instance (the wait is wrapped in
``sink.queued()``, so the first-token deadline starts once it has one), then
the adapter, with the conversation's system messages folded into one
leading system prompt unless the instance keeps them (``system_messages``,
``iop.wire._system_fold``). ``probe`` asks every instance's adapter what it serves,
concurrently and within ``PROBE_GUARD_S``; a probe that fails or hangs
reports its instance as unavailable, with why.

An on-demand model (``[[models]]``, ``iop.ondemand``) is an instance too,
with its ``ModelManager`` in ``models``: a run first takes the model's
lease (``acquire``: loading it if it is not, within
``node.model_load_timeout_s``), inside ``sink.queued()`` as the slot, then
a slot, and runs on the adapter of the life it holds.

``scrape_engine_load`` reads, every ``load_scrape_interval_s``, what an
instance's engine publishes about its load (``EngineLoadReader``), for the
node's load reports (``Instance.load``). A failed scrape keeps the last
figures, which age in the reports until the edge ignores them
(``scheduler.load_stale_s``); failures are logged when the scrape starts
failing and when it recovers, not once per scrape. Beside it,
``follow_kv_events`` applies the KV cache events an engine pushes
(``KVEventsFollower``: vLLM's over ZeroMQ), whose count the next scrape
reports.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Final

import msgspec
import trio

from iop.adapters import Adapter, EngineLoadReader, KVEventsFollower
from iop.capabilities import Capabilities, ProviderStatus, provider_detail
from iop.config import Deadlines, InstanceConfig, VllmInstance
from iop.errors import IopError
from iop.node._models import ModelLease, ModelManager
from iop.node._slots import InstanceSlots
from iop.protocol import EngineLoad, InstanceLoad
from iop.runtime import RunSink
from iop.spec import ChatRequest, ExecutionSpec, TokenizeRequest
from iop.wire import EngineFigures
from iop.wire._system_fold import fold_system_messages

__all__ = [
    "PROBE_GUARD_S",
    "SCRAPE_GUARD_S",
    "Instance",
    "RunExecutor",
    "follow_kv_events",
    "probe",
    "scrape_engine_load",
]

log = logging.getLogger("iop.node")

# Outer bound of one instance's capabilities probe. Adapters apply their own
# probe timeout (2 s for HTTP ones); this only keeps a broken adapter from
# wedging the probe loop.
PROBE_GUARD_S: Final = 30.0
# The same for one load scrape (the adapter's own deadline is
# ``load_scrape_timeout_s``, 1 s by default).
SCRAPE_GUARD_S: Final = 10.0


class Instance:
    """One configured backend: adapter, deadlines, slots.

    A config reload that changes the instance gives it a new adapter
    (``replace``) and keeps its slots (resized): runs that execute keep the
    adapter they started on, which is closed once the last of them ends
    (``unused``); runs that start afterwards, queued ones included, get the
    new one. A removed instance (``removed``) serves its queued and running
    runs to their end, then its adapter is closed.
    """

    def __init__(
        self, cfg: InstanceConfig, adapter: Adapter, *, models: ModelManager | None = None
    ) -> None:
        self.cfg = cfg
        # An on-demand model's manager (None: an instance the operator runs).
        self.models = models
        self.name = cfg.name
        self.adapter = adapter
        self.deadlines: Deadlines = cfg.deadlines
        self.slots = InstanceSlots(cfg.max_concurrency, cfg.max_queue, cfg.queue_timeout_s)
        # The engine's figures at the last good scrape, and when (trio clock).
        self.engine: EngineFigures | None = None
        self.engine_at = -math.inf
        self.removed = False
        # The engine-load scrape of the current adapter (the agent's task).
        self.scraper: trio.CancelScope | None = None
        # Runs executing, per adapter; and, while ``unused`` waits, set when
        # one of them ends.
        self._uses: dict[Adapter, int] = {}
        self._ended: trio.Event | None = None

    @property
    def engine_priority(self) -> bool:
        """Whether its engine preempts by priority (``engine_priority``): a run
        on an overflow seat then starts beyond its slots (``iop.node._slots``)."""
        return isinstance(self.cfg, VllmInstance) and self.cfg.engine_priority

    def replace(self, cfg: InstanceConfig, adapter: Adapter) -> Adapter:
        """Serve ``cfg`` with ``adapter`` from now on; returns the adapter replaced."""
        old = self.adapter
        self.cfg = cfg
        self.adapter = adapter
        self.deadlines = cfg.deadlines
        self.slots.resize(cfg.max_concurrency, cfg.max_queue, cfg.queue_timeout_s)
        return old

    def hold(self) -> Adapter:
        """The adapter a run starts on (``release`` it when the run ends)."""
        adapter = self.adapter
        self._uses[adapter] = self._uses.get(adapter, 0) + 1
        return adapter

    def release(self, adapter: Adapter) -> None:
        n = self._uses[adapter] - 1
        if n:
            self._uses[adapter] = n
        else:
            del self._uses[adapter]
        if self._ended is not None:
            self._ended.set()
            self._ended = None

    def in_use(self, adapter: Adapter) -> bool:
        """Whether a run executes on ``adapter``, or (the adapter of a removed
        instance) holds or waits for one of its slots."""
        if adapter in self._uses:
            return True
        return (
            adapter is self.adapter
            and self.removed
            and bool(self.slots.in_flight + self.slots.queued)
        )

    async def unused(self, adapter: Adapter) -> None:
        """Wait until no run uses ``adapter`` (``in_use``)."""
        while self.in_use(adapter):
            if self._ended is None:
                self._ended = trio.Event()
            await self._ended.wait()

    def load(self, now: float) -> InstanceLoad:
        """The instance's load for a load report, engine figures with their age."""
        slots = self.slots
        engine = None
        if self.engine is not None:
            e = self.engine
            engine = EngineLoad(
                running=e.running,
                waiting=e.waiting,
                kv_usage=e.kv_usage,
                age_s=round(max(0.0, now - self.engine_at), 3),
                cache_tokens=e.cache_tokens,
                cached_tokens=e.cached_tokens,
            )
        return InstanceLoad(
            instance=self.name,
            in_flight=slots.in_flight,
            queued=slots.queued,
            max_concurrency=slots.max_concurrency,
            max_queue=slots.max_queue,
            engine=engine,
        )

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
        instance = self._instance
        if instance.models is not None:
            await self._execute_model(instance.models, spec, send)
            return
        slots = instance.slots
        with send.queued():  # waiting for a slot is not the backend's latency
            await slots.take(spec.overflow and instance.engine_priority)
        adapter = instance.hold()  # a reload may replace it: this run keeps it
        if instance.cfg.system_messages == "fold":
            spec = _folded(spec)
        try:
            await adapter.execute(spec, send)
        finally:
            slots.release()
            instance.release(adapter)  # after the slot: ``unused`` counts both

    async def _execute_model(
        self, models: ModelManager, spec: ExecutionSpec, send: RunSink
    ) -> None:
        instance = self._instance
        slots = instance.slots
        lease: ModelLease | None = None
        try:
            # Waiting for the model's load is not the backend's latency either.
            with send.queued():
                lease = await models.acquire(instance.name, models.load_timeout_s)
                await slots.take(spec.overflow and instance.engine_priority)
            if instance.cfg.system_messages == "fold":
                spec = _folded(spec)
            try:
                await lease.adapter.execute(spec, send)
            finally:
                slots.release()
        finally:
            if lease is not None:
                models.release(lease)


def _folded(spec: ExecutionSpec) -> ExecutionSpec:
    """``spec`` with its conversation's system messages folded (or itself)."""
    req = spec.request
    if not isinstance(req, ChatRequest | TokenizeRequest) or not req.messages:
        return spec
    folded = fold_system_messages(req.messages)
    if folded is None:
        return spec
    log.debug("run %s: %d messages folded to %d", spec.run_id, len(req.messages), len(folded))
    return msgspec.structs.replace(spec, request=msgspec.structs.replace(req, messages=folded))


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


async def scrape_engine_load(
    inst: Instance,
    reader: EngineLoadReader,
    on_change: Callable[[], None],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Read ``inst``'s engine load every ``reader.load_scrape_interval_s`` until cancelled.

    New figures are kept in ``inst`` (``engine``, ``engine_at``) and, when
    they differ from the last, ``on_change`` is called (a load report is
    due). Returns at once if the interval is 0.
    """
    interval = reader.load_scrape_interval_s
    task_status.started()
    if not interval > 0:
        return
    failing = False
    while True:
        why = ""
        figures: EngineFigures | None = None
        with trio.move_on_after(SCRAPE_GUARD_S) as guard:
            try:
                figures = await reader.engine_load()
            except IopError as exc:
                why = exc.message
            except Exception as exc:  # a broken adapter: logged, the loop goes on
                why = f"{type(exc).__name__}: {exc}"
        if guard.cancelled_caught:
            why = f"no answer within {SCRAPE_GUARD_S:g}s"
        if figures is None:
            if not failing:
                log.warning(
                    "instance %s: reading the engine's load failed (%s); its figures age "
                    "until the edge ignores them. Logged again when it recovers.",
                    inst.name,
                    why,
                )
                failing = True
        else:
            if failing:
                log.info("instance %s: the engine's load is read again", inst.name)
                failing = False
            inst.engine_at = trio.current_time()
            if figures != inst.engine:
                inst.engine = figures
                on_change()
        await trio.sleep(interval)


async def follow_kv_events(inst: Instance, follower: KVEventsFollower) -> None:
    """Follow ``inst``'s engine's KV cache events until cancelled. A broken
    follower is logged and stops: the scrape goes on, and the edge's index
    then works from the cache's size alone."""
    try:
        await follower.follow_kv_events()
    except Exception:
        log.exception(
            "instance %s: following the engine's KV cache events stopped; what its "
            "cache holds is no longer reported",
            inst.name,
        )
