"""The trio driver of the node's on-demand models: loads, unloads, leases.

``ModelManager`` does what its ``ModelTable`` (``iop.ondemand._table``,
the decisions) says, and tells it what happened. ``serve`` is its service
(``nursery.start``): it loads the pinned models, then unloads idle ones
when their ``idle_ttl_s`` passes, and owns every model's *life* task.

A life (``_life``) is one load: a fresh ``ModelBackend``
(``iop.managed._models``) whose supervisor runs one life
(``Supervisor.serve(once=True)``, the same supervision as a ``llamacpp``
instance's server: its start deadlines, liveness check and stop). The load
succeeded when the supervisor is ``UP`` (``ModelTable.loaded``) or failed
with its reason (``load_failed``); a life that ends on its own later is
``exited``; one the table unloads is cancelled, which stops its process,
then ``unloaded``. Each is logged on ``iop.node.models`` with the reason and
how long it took.

``acquire(name, timeout_s)`` is what a run does: it wants the model until
it is ready (one load however many runs want it at once: the table plans
it once, the others wait for the next change), then takes a lease, which
``release`` returns when the run ends. A refusal, a failed load, or no
load within ``timeout_s`` raises ``BackendUnavailable`` with the codes
``model_load_refused``, ``model_load_failed``, ``model_load_timeout``:
errors before the run's start, which the edge fails over.

A model as one of the node's instances
--------------------------------------
A model is an instance named after it (``iop.node._agent``): the edge
assigns its runs to that instance, and the node's ``RunExecutor``
(``iop.node._instances``) gets the model's lease before the run's slot
(``ModelManager.acquire``: loading it if needed), then runs it on the
adapter of the life it holds. ``ModelAdapter`` is the instance's adapter
for everything else: its capabilities say the model's state (``available``
while ready, ``degraded`` while loading, ``unavailable`` otherwise, the
state in ``provider_detail``); its targets are always the model's
``targets`` (its name by default), whatever the backend's own names.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import trio

from iop.adapters import HTTP_OPERATIONS, Adapter
from iop.capabilities import Capabilities, ProbeResult, ProviderStatus, provider_detail
from iop.config import LlamaCppModel, ModelConfig, ModelGroup, NodeSection, SimModel
from iop.errors import BackendUnavailable, ErrorCode, InvariantError, IopError, ModelLoadRefused
from iop.managed import BackendFactory, BackendState, ModelBackend, build_model_backend
from iop.ondemand import (
    Decision,
    GroupSpec,
    ModelSpec,
    ModelState,
    ModelTable,
    Ready,
    Refused,
    StartLoad,
    StartUnload,
)
from iop.protocol import ModelOffer
from iop.runtime import EventSender
from iop.spec import OPERATIONS, ExecutionSpec

__all__ = ["ModelAdapter", "ModelLease", "ModelManager", "model_table"]

log = logging.getLogger("iop.node.models")

# Closing a life's adapter, shielded: it must be short.
CLOSE_TIMEOUT_S = 3.0


def model_table(
    models: Iterable[ModelConfig], groups: Iterable[ModelGroup], node: NodeSection
) -> ModelTable:
    """The table of a node's ``[[models]]`` and ``[[model_groups]]``."""
    by_member = {
        member: GroupSpec(g.name, swap=g.swap, exclusive=g.exclusive, persistent=g.persistent)
        for g in groups
        for member in g.members
    }
    specs = [
        ModelSpec(
            name=m.name,
            memory_mib=m.memory_mib or 0,
            pinned=m.pinned,
            idle_ttl_s=m.idle_ttl_s,
            min_residency_s=m.min_residency_s,
            group=by_member.get(m.name),
        )
        for m in models
    ]
    return ModelTable(
        specs,
        node.memory_mib,
        retry_min_s=node.model_retry_min_s,
        retry_max_s=node.model_retry_max_s,
    )


@dataclass(frozen=True)
class ModelLease:
    """A run's hold on a loaded model: it is not unloaded while held.

    Attributes:
        model: The model's name.
        adapter: The adapter of the life the run holds.
        life: Which load of the model it holds.
    """

    model: str
    adapter: Adapter
    life: int


def _nothing() -> None:
    pass


class ModelManager:
    """The node's on-demand models; see the module docstring.

    Args:
        models: ``[[models]]``.
        groups: ``[[model_groups]]``.
        node: ``[node]`` (budget, retry delays).
        backends: Builds one load's backend (tests give fakes).

    Attributes:
        on_change: Called after every change of a model's state (the node
            tells its edges).
    """

    def __init__(
        self,
        models: Iterable[ModelConfig],
        groups: Iterable[ModelGroup],
        node: NodeSection,
        *,
        backends: BackendFactory = build_model_backend,
    ) -> None:
        models = list(models)
        self._configs = {m.name: m for m in models}
        self.table = model_table(models, groups, node)
        self._backends = backends
        self.load_timeout_s = node.model_load_timeout_s
        self._live: dict[str, ModelBackend] = {}
        self._scopes: dict[str, trio.CancelScope] = {}
        self._nursery: trio.Nursery | None = None
        # Replaced at every change: waiters wait on the current one.
        self._changed_event = trio.Event()
        self._wake = trio.Event()
        self.on_change: Callable[[], None] = _nothing

    @property
    def names(self) -> list[str]:
        return list(self._configs)

    @property
    def budget_mib(self) -> int:
        return self.table.budget_mib

    def config(self, name: str) -> ModelConfig:
        return self._configs[name]

    # --- the service -------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the models' lives until cancelled (which stops every model)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                self.table.tick(trio.current_time())
                self._apply()
                # After the apply, which sets the old one: a later change wakes us.
                self._wake = trio.Event()
                with trio.move_on_at(self.table.next_deadline()):
                    await self._wake.wait()

    def _apply(self, *, changed: bool = False) -> None:
        """Do what the table says; if it said anything, or ``changed`` (a state
        changed), tell whoever waits. Only then: a waiter that wants a model
        again must not wake the service, nor the service the waiter."""
        assert self._nursery is not None, "ModelManager.serve is not running"
        actions = self.table.actions()
        if not (actions or changed):
            return
        for action in actions:
            if isinstance(action, StartLoad):
                m = self.table.models[action.model]
                log.info(
                    "model %s: loading (%d MiB of %d; %s)",
                    action.model,
                    m.spec.memory_mib,
                    self.table.budget_mib,
                    m.detail or "memory free",
                )
                self._nursery.start_soon(self._life, action.model, name=f"model {action.model}")
            elif isinstance(action, StartUnload):
                log.info("model %s: unloading: %s", action.model, action.reason)
                scope = self._scopes.get(action.model)
                if scope is not None:
                    scope.cancel()
        self._changed_event.set()
        self._changed_event = trio.Event()
        self._wake.set()
        self.on_change()

    async def _life(self, name: str) -> None:
        backend = self._backends(self._configs[name])
        sup = backend.supervisor
        began = trio.current_time()
        served = False
        with trio.CancelScope() as scope:
            self._scopes[name] = scope
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(partial(sup.serve, once=True))
                    if sup.state is BackendState.UP:
                        served = True
                        self._live[name] = backend
                        took = trio.current_time() - began
                        self.table.loaded(name, trio.current_time())
                        log.info("model %s: ready, loaded in %.3gs", name, took)
                        self._apply(changed=True)
            finally:
                self._scopes.pop(name, None)
                self._live.pop(name, None)
                with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                    try:
                        await backend.aclose()
                    except IopError as exc:
                        log.warning("model %s: closing its adapter failed: %s", name, exc)
        now = trio.current_time()
        state = self.table.models[name].state
        if state is ModelState.UNLOADING:
            self.table.unloaded(name)
            log.info("model %s: unloaded after %.3gs", name, now - began)
        elif not served:
            delay = self.table.load_failed(name, sup.detail, now)
            log.error(
                "model %s: load failed after %.3gs: %s; not loaded again for %gs",
                name,
                now - began,
                sup.detail,
                delay,
            )
        else:
            delay = self.table.exited(name, sup.detail, now)
            log.error("model %s: exited: %s; not loaded again for %gs", name, sup.detail, delay)
        self._apply(changed=True)

    # --- runs ------------------------------------------------------------------------

    async def acquire(self, name: str, timeout_s: float) -> ModelLease:
        """Wait until ``name`` is loaded (loading it if needed), then hold it.

        Raises:
            BackendUnavailable: As ``wait_ready``.
        """
        if self.table.models[name].state is not ModelState.READY or name not in self._live:
            self.table.cold_start(name)
        await self.wait_ready(name, timeout_s)
        # No checkpoint since wait_ready saw it READY and live.
        life = self.table.lease(name, trio.current_time())
        self._apply()
        return ModelLease(name, self._live[name].adapter, life)

    async def wait_ready(self, name: str, timeout_s: float) -> None:
        """Want ``name`` until it is ready (a run's lease, an edge's ``LoadModel``).

        Raises:
            ModelLoadRefused: Models that must stay are in the way (its
                ``pinned`` names the pinned ones when that lasts).
            BackendUnavailable: Failed, or not loaded in ``timeout_s``
                (codes ``model_load_failed``, ``model_load_timeout``).
        """
        with trio.move_on_after(timeout_s):
            while True:
                decision = self.table.want(name, trio.current_time())
                self._apply()
                changed = self._changed_event
                if isinstance(decision, Ready) and name in self._live:
                    return
                if isinstance(decision, Refused):
                    log.warning("model %s: load refused: %s", name, decision.reason)
                    if decision.failed:
                        raise BackendUnavailable(decision.reason, code=ErrorCode.MODEL_LOAD_FAILED)
                    raise ModelLoadRefused(decision.reason, pinned=decision.pinned)
                await changed.wait()
        raise BackendUnavailable(
            f"model {name} was not loaded within {timeout_s:g}s (node.model_load_timeout_s)",
            code=ErrorCode.MODEL_LOAD_TIMEOUT,
        )

    async def wait_state(self, name: str, *states: ModelState) -> None:
        """Wait until ``name`` is in one of ``states`` (unbounded: the caller bounds it)."""
        while self.table.models[name].state not in states:
            await self._changed_event.wait()

    def release(self, lease: ModelLease) -> None:
        """A run that held ``lease`` ended."""
        self.table.release(lease.model, lease.life, trio.current_time())
        self._apply()

    def unload(self, name: str, reason: str) -> bool:
        """Unload ``name`` once its runs end (the operator's)."""
        done = self.table.unload(name, reason)
        self._apply(changed=done)
        return done

    def load(self, name: str) -> Decision:
        """Start loading ``name`` if it is not loaded (the operator's: not
        waited for, unlike ``wait_ready``); the table's decision."""
        decision = self.table.want(name, trio.current_time())
        self._apply()
        return decision

    def pin(self, name: str, pinned: bool) -> Decision | None:
        """Pin or unpin ``name`` until the node restarts (``ModelTable.pin``)."""
        decision = self.table.pin(name, pinned, trio.current_time())
        self._apply(changed=True)
        return decision

    # --- what the node reports ---------------------------------------------------------

    def offers(self) -> list[ModelOffer]:
        """Every model's state and cost, for the edges and the node's status."""
        now = trio.current_time()
        out = []
        for m in self.table.models.values():
            retry = m.retry_at - now if m.state is ModelState.FAILED else 0.0
            loading = now - m.loading_since if m.state is ModelState.LOADING else 0.0
            out.append(
                ModelOffer(
                    model=m.name,
                    state=m.state.value,
                    memory_mib=m.spec.memory_mib,
                    load_s=round(m.last_load_s, 3),
                    pinned=m.pinned,
                    runs=m.leases,
                    detail=m.detail,
                    retry_in_s=round(max(0.0, retry), 3) if math.isfinite(retry) else 0.0,
                    loading_s=round(max(0.0, loading), 3),
                    loads=m.loads,
                    load_failures=m.load_failures,
                    evictions=m.evictions,
                    cold_starts=m.cold_starts,
                )
            )
        return out


# --- a model as one of the node's instances ---------------------------------------

_STATUS = {
    ModelState.READY: ProviderStatus.AVAILABLE,
    ModelState.LOADING: ProviderStatus.DEGRADED,
}


def _engine(cfg: ModelConfig) -> str:
    if isinstance(cfg, LlamaCppModel):
        return "llamacpp"
    if isinstance(cfg, SimModel):
        return "sim"
    return "vllm"


class ModelAdapter:
    """The instance adapter of an on-demand model (capabilities, probes).

    Runs never reach ``execute``: the node's executor runs them on the
    leased life's adapter.
    """

    kind: ClassVar[str] = "model"

    def __init__(self, manager: ModelManager, cfg: ModelConfig) -> None:
        self._manager = manager
        self.cfg = cfg
        self.engine = _engine(cfg)

    @property
    def name(self) -> str:
        return self.cfg.name

    def _status(self) -> tuple[ProviderStatus, str]:
        m = self._manager.table.models[self.cfg.name]
        status = _STATUS.get(m.state, ProviderStatus.UNAVAILABLE)
        if status is ProviderStatus.AVAILABLE:
            return status, ""
        detail = f"model {m.state.value}" + (f": {m.detail}" if m.detail else "")
        return status, provider_detail(detail)

    async def capabilities(self) -> Capabilities:
        cfg = self.cfg
        status, detail = self._status()
        # Unlisted: what the model's server serves as a configured instance would.
        ops = cfg.operations or (OPERATIONS if self.engine == "sim" else HTTP_OPERATIONS)
        return Capabilities(
            adapter=self.engine,
            instance=cfg.name,
            provider=f"on-demand {self.engine}",
            targets=tuple(cfg.targets),
            max_concurrency=cfg.max_concurrency,
            max_queue=cfg.max_queue,
            queue_timeout_s=cfg.queue_timeout_s,
            request_timeout_s=cfg.deadlines.request_timeout_s or 0.0,
            provider_status=status,
            provider_detail=detail,
            operations=tuple(ops),
        )

    async def probe(self, target: str = "") -> ProbeResult:
        caps = await self.capabilities()
        return ProbeResult(
            adapter=caps.adapter,
            instance=caps.instance,
            target=target,
            status=caps.provider_status,
            targets=caps.targets,
            detail=caps.provider_detail,
            provider=caps.provider,
        )

    async def execute(self, spec: ExecutionSpec, send: EventSender) -> None:
        raise InvariantError(f"model {self.name}: runs go to the leased life's adapter")

    async def aclose(self) -> None:
        pass
