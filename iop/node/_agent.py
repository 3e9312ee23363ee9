"""The node agent: adapter instances, capacity, and the links to edges.

Theory of operation
-------------------
A ``NodeAgent`` (opened with ``open_node_agent``) owns three things for the
node's whole life: one adapter per configured instance with its
``InstanceSlots`` limiter (``iop.node._instances``), and a ``RunSupervisor``
whose nursery every run lives in. Links come and go; runs belong to the
supervisor, never to a link.

``serve()`` dials every configured edge (``iop.node._dial``: one task per
edge, reconnecting with backoff). ``serve_link`` drives one connected
``FrameChannel``: the handshake (hello with the current capabilities, then
the welcome within ``welcome_timeout_s``), then the one link driver
(``iop.runtime.LinkDriver``: a reader and a writer) over a ``NodeLink``
(``iop.node._link``), which says how a run's events reach the edge and how
every way a run ends produces exactly one terminal event.

A run is executed by the runtime as ``slots.acquire()`` then
``adapter.execute()``, so a full queue (``Error`` 429 ``queue_full``) and a
queue timeout (``Cancelled(queue_timeout)``) become the run's terminal event
like any other outcome. The instance's total deadline counts from the moment
the run was assigned; the first-token deadline starts once it has a slot.
When the probe finds that the instances changed, each link queues a
``CapabilitiesUpdate``.

An instance whose backend the node runs itself (a ``llamacpp`` instance:
``iop.managed``) has a supervisor, started in the agent's nursery before the
first probe (which so sees whether the first start served). Each change of
its state (gone, restarting, a crash loop, serving again) makes the probe
loop probe at once, so the edges hear of it without waiting for
``probe_interval_s``; ``restart_backends`` is the operator's restart
(SIGUSR1).

A config reload (``apply_config``; docs/operations.md, "Reloading") adds,
removes and replaces instances while the node runs: an instance removed is
no longer advertised (a ``CapabilitiesUpdate`` at once) and refuses new
runs, a changed one gets a new adapter for the runs that start from then on;
the runs already going keep the adapter they started on, which is closed
once the last of them ends. Then every instance is probed at once, and what
the probe finds goes to the edges as above. A ``llamacpp`` instance is
started once: a change of one waits for a restart (``iop._reload``).

Models on demand (``[[models]]``, docs/operations.md, "Models on demand")
are owned by a ``ModelManager`` (``iop.node._models``), started in the agent's
nursery before the first probe. Each model is an instance named after it
(its runs take the model's lease first: ``iop.node._instances``). The
models' states go to the edges in the hello and, at every change of a
state, in a ``CapabilitiesUpdate`` (with the instances, whose status
follows the model's); an edge's ``LoadModel`` is answered by a task in the
agent's nursery once the model is ready or not (``ModelLoadResult``).

Several edges may share the node; its slots are the authority on what an
instance takes, whichever edge sent the run. Every change of an instance's
slots or of its engine's figures (read by ``scrape_engine_load``, one task
per instance whose engine publishes its load, in the agent's nursery) tells
each link's session, which sends the edges a ``LoadReport``, coalesced to
``node.load_reports_per_s`` (``iop.protocol._session``, "Load reports").
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Final

import msgspec
import trio

from iop import __version__
from iop._secrets import SecretMasker, node_secrets
from iop.adapters import Adapter, EngineLoadReader, KVEventsFollower
from iop.capabilities import Capabilities, ProviderStatus
from iop.config import LlamaCppInstance, NodeConfig, NodeEdge
from iop.errors import (
    ConfigError,
    ErrorCode,
    InvariantError,
    IopError,
    LinkClosed,
    LinkError,
    LinkProtocolError,
    ModelLoadRefused,
)
from iop.events import CancelReason, Error
from iop.managed import SupervisedAdapter, Supervisor, build_instance_adapter
from iop.node._dial import MIN_RECONNECT_DELAY_S, STABLE_LINK_S, ConnectFactory, Dialer
from iop.node._instances import (
    PROBE_GUARD_S,
    Instance,
    RunExecutor,
    follow_kv_events,
    probe,
    scrape_engine_load,
)
from iop.node._link import NodeLink, NodeRun
from iop.node._models import ModelAdapter, ModelManager
from iop.node._ws import DEFAULT_CONNECT_TIMEOUT_S, client_tls_context, open_ws_link
from iop.ondemand import Decision, Refused
from iop.protocol import (
    CLOSE_GOING_AWAY,
    CLOSE_HEARTBEAT,
    AssignReceived,
    ControlModel,
    FrameChannel,
    InstanceLoad,
    LoadModel,
    ModelAction,
    ModelControlResult,
    ModelLoadResult,
    ModelOffer,
    NodeSession,
    Welcome,
    Welcomed,
    close_code,
    close_reason,
)
from iop.runtime import PeerSilent, RunSupervisor, open_run_supervisor
from iop.tracing import Tracing

__all__ = [
    "CLOSE_TIMEOUT_S",
    "DRAIN_FLUSH_TIMEOUT_S",
    "MIN_RECONNECT_DELAY_S",
    "PROBE_GUARD_S",
    "STABLE_LINK_S",
    "WELCOME_TIMEOUT_S",
    "ConnectFactory",
    "InstanceSnapshot",
    "LinkSnapshot",
    "NodeAgent",
    "NodeSnapshot",
    "RunSnapshot",
    "open_node_agent",
]

log = logging.getLogger("iop.node")

# From sending Hello to receiving Welcome. The edge answers at once; a longer
# wait means it is overloaded or not an IOP edge.
WELCOME_TIMEOUT_S: Final = 10.0
# Our side of closing a link (the WebSocket close handshake is bounded by
# its own 2 s disconnect timeout); shielded cleanup, so it must be short.
CLOSE_TIMEOUT_S: Final = 3.0
# Drain, after the runs: time to hand the runs' terminal events and the
# link close to the writers. Shutdown must not hang on a stuck socket.
DRAIN_FLUSH_TIMEOUT_S: Final = 2.0


# --- snapshots (admin / debug) ------------------------------------------------


class InstanceSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """One instance's live load.

    Attributes:
        name: The instance's name.
        adapter: The adapter kind.
        in_flight: Runs executing (slots held).
        queued: Runs waiting for a slot.
        max_concurrency: Slots.
        max_queue: Queue bound.
        provider_status: Status at the last probe.
        targets: Models served, at the last probe.
    """

    name: str
    adapter: str
    in_flight: int
    queued: int
    max_concurrency: int
    max_queue: int
    provider_status: ProviderStatus
    targets: tuple[str, ...]


class RunSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """One run on a link.

    Attributes:
        run_id: The run's id.
        instance: The instance executing it.
        edge: The URL of the edge it came from.
        state: The runtime's state of the run.
        credit: Events it may still send before the edge returns credit.
        age_s: Time since it was assigned.
    """

    run_id: str
    instance: str
    edge: str
    state: str
    credit: int
    age_s: float


class LinkSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """One connected edge.

    Attributes:
        edge: The edge's URL.
        state: The link session's state.
        runs: Runs on the link.
        connected_s: Time since the welcome.
    """

    edge: str
    state: str
    runs: int
    connected_s: float


class NodeSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """What the node is doing, for admin pages and debugging."""

    node_id: str
    draining: bool
    instances: list[InstanceSnapshot]
    links: list[LinkSnapshot]
    runs: list[RunSnapshot]
    models: list[ModelOffer] = []


# --- the agent ------------------------------------------------------------------


class NodeAgent:
    """The node: its adapter instances, their capacity, and its links to edges.

    Create it with ``open_node_agent``, which opens the run supervisor and
    the probe task it needs.

    Args:
        config: The node's config.
        supervisor: Where runs live.
        adapters: Adapters by instance name, replacing the ones
            ``build_adapter`` would make (tests inject stubs). Every
            configured instance needs one, built or injected.
        welcome_timeout_s: Deadline of the handshake.
        connect_timeout_s: Deadline of the default WebSocket connect.
    """

    def __init__(
        self,
        config: NodeConfig,
        supervisor: RunSupervisor,
        adapters: Mapping[str, Adapter],
        *,
        welcome_timeout_s: float = WELCOME_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        tracing: Tracing | None = None,
        owned: set[Adapter] | None = None,
        models: ModelManager | None = None,
    ) -> None:
        self.config = config
        self.models = models
        self._tracing = tracing
        # The adapters this agent built (closed by it or by open_node_agent).
        self._owned = owned if owned is not None else set()
        # Where scrapes and retired adapters' closes run (open_node_agent's).
        self._nursery: trio.Nursery | None = None
        self.node_id = config.node.id
        # The node is the only process that knows its instances' header
        # values: every message it sends the edge goes through this first.
        self._masker = SecretMasker(value for value, _ in node_secrets(config))
        self._supervisor = supervisor
        self._instances = {cfg.name: Instance(cfg, adapters[cfg.name]) for cfg in config.instances}
        if models is not None:
            for mcfg in config.models:
                self._instances[mcfg.name] = Instance(
                    mcfg, ModelAdapter(models, mcfg), models=models
                )
            models.on_change = self._models_changed
        # The models' states last told the edges (a change of one is pushed).
        self._model_states: list[tuple[object, ...]] = []
        for inst in self._instances.values():
            inst.slots.on_change = self._load_changed
        self._welcome_timeout_s = welcome_timeout_s
        self._connect_timeout_s = connect_timeout_s
        # Loaded once, at start-up: a bad CA or certificate file fails the
        # node with ConfigError naming it, not each dial.
        self._tls = {edge.url: client_tls_context(edge) for edge in config.node.edges}
        self._links: set[NodeLink] = set()
        self._draining = False
        self._serve_scope: trio.CancelScope | None = None
        self._dialer = Dialer(
            node_id=self.node_id,
            settings=config.node,
            instance_names=list(self._instances),
            serve_link=self.serve_link,
            draining=lambda: self._draining,
        )
        # Capabilities as last probed; links compare versions to push changes.
        self._capabilities: list[Capabilities] = [
            inst.fallback_capabilities() for inst in self._instances.values()
        ]
        self._caps_version = 0
        # Bumped by every reload: a probe of the instances before it is stale.
        self._generation = 0
        # Backends the node runs itself; a change of one's state makes a probe due.
        self._supervisors: list[Supervisor[object]] = []
        for adapter in adapters.values():
            if isinstance(adapter, SupervisedAdapter):
                adapter.supervisor.on_change = self._probe_soon
                self._supervisors.append(adapter.supervisor)
        self._probe_due = trio.Event()
        # Runs on links, across all links, for drain.
        self._link_runs = 0
        self._idle = trio.Event()
        self._idle.set()

    # --- capabilities -----------------------------------------------------------

    @property
    def capabilities(self) -> list[Capabilities]:
        """The instances' capabilities as last probed."""
        return list(self._capabilities)

    async def refresh_capabilities(self) -> list[Capabilities]:
        """Probe every instance concurrently; push the result to links if it changed.

        A probe that fails reports its instance as unavailable.

        Returns:
            The capabilities, in config order.
        """
        while True:
            generation = self._generation
            results = await probe(list(self._instances.values()))
            if generation == self._generation:
                break  # else a reload changed the instances meanwhile: again
        if results != self._capabilities:
            self._capabilities = results
            self._caps_version += 1
            for link in self._links:
                self._push_capabilities(link)
            # A model that is not loaded is not down: it loads when wanted.
            models = set(self.models.names) if self.models is not None else set()
            down = any(
                c.provider_status is ProviderStatus.UNAVAILABLE and c.instance not in models
                for c in results
            )
            log.log(
                logging.WARNING if down else logging.INFO,
                "instance status: %s",
                ", ".join(
                    f"{c.instance}={c.provider_status}"
                    + (f" ({c.provider_detail})" if c.provider_detail else "")
                    for c in results
                )
                or "(none)",
            )
        return list(results)

    def _push_capabilities(self, link: NodeLink) -> None:
        if link.caps_version != self._caps_version:
            link.caps_version = self._caps_version
            link.session.capabilities(self._capabilities, self._offers())
            link.driver.wake()

    # --- models on demand ----------------------------------------------------------

    def _offers(self) -> list[ModelOffer] | None:
        return None if self.models is None else self.models.offers()

    def _models_changed(self) -> None:
        """A model's state may have changed: the edges hear of it, its instance is probed."""
        assert self.models is not None
        # Not the clock's fields (loading_s, retry_in_s) nor each run's lease.
        states: list[tuple[object, ...]] = [
            msgspec.structs.astuple(
                msgspec.structs.replace(o, loading_s=0.0, retry_in_s=0.0, runs=0)
            )
            for o in self.models.offers()
        ]
        if states == self._model_states:
            return
        self._model_states = states
        self._caps_version += 1
        for link in self._links:
            self._push_capabilities(link)
        self._probe_due.set()

    def _on_load_model(self, link: NodeLink, request: LoadModel) -> None:
        """An edge asks for a model: answered once it is ready or not."""
        assert self._nursery is not None
        self._nursery.start_soon(self._answer_load, link, request)

    async def _answer_load(self, link: NodeLink, request: LoadModel) -> None:
        models = self.models
        name = request.model
        result = ModelLoadResult(request_id=request.request_id, model=name, ok=True)
        if self._draining:
            code, message = ErrorCode.NODE_DRAINING, f"node {self.node_id} is draining"
            result = msgspec.structs.replace(result, ok=False, code=code, message=message)
        elif models is None or name not in models.names:
            code, message = ErrorCode.UNKNOWN_INSTANCE, f"node {self.node_id} has no model {name!r}"
            result = msgspec.structs.replace(result, ok=False, code=code, message=message)
        else:
            try:
                await models.wait_ready(name, models.load_timeout_s)
            except IopError as exc:
                result = msgspec.structs.replace(
                    result,
                    ok=False,
                    code=exc.code,
                    message=self._masker.mask(exc.message),
                    pinned=exc.pinned if isinstance(exc, ModelLoadRefused) else (),
                )
        log.info(
            "edge %s asked for model %s: %s",
            link.edge.url,
            name,
            "ready" if result.ok else f"{result.code}: {result.message}",
        )
        if not link.closed:
            link.session.model_load_result(result)
            link.driver.wake()

    def _on_control_model(self, link: NodeLink, request: ControlModel) -> None:
        """An operator's action on a model (docs/operations.md, "Operator
        controls"): done (a load started, not waited for) and answered at once."""
        result = self._control_model(request)
        log.info(
            "model %s: %s by %s (via edge %s): %s",
            request.model,
            request.action.value,
            request.by or "an operator",
            link.edge.url,
            "done" if result.ok else f"{result.code}: {result.message}",
        )
        if not link.closed:
            link.session.model_control_result(result)
            link.driver.wake()

    def _control_model(self, request: ControlModel) -> ModelControlResult:
        models = self.models
        name, action = request.model, request.action
        result = ModelControlResult(request_id=request.request_id, model=name, ok=True)

        def refused(code: ErrorCode, message: str) -> ModelControlResult:
            return msgspec.structs.replace(
                result, ok=False, code=code, message=self._masker.mask(message)
            )

        if models is None or name not in models.names:
            return refused(ErrorCode.MODEL_NOT_FOUND, f"node {self.node_id} has no model {name!r}")
        if self._draining and action in (ModelAction.LOAD, ModelAction.PIN):
            return refused(ErrorCode.NODE_DRAINING, f"node {self.node_id} is draining")
        decision: Decision | None = None
        message = ""
        if action is ModelAction.LOAD:
            decision = models.load(name)
        elif action is ModelAction.PIN:
            decision = models.pin(name, True)
        elif action is ModelAction.UNPIN:
            models.pin(name, False)
        elif models.table.models[name].pinned:
            return refused(
                ErrorCode.MODEL_PINNED, f"model {name} is pinned: unpin it before unloading it"
            )
        elif not models.unload(name, f"unloaded by {request.by or 'an operator'}"):
            message = f"model {name} was not loaded"
        if isinstance(decision, Refused):
            if action is ModelAction.LOAD:
                code = (
                    ErrorCode.MODEL_LOAD_FAILED if decision.failed else ErrorCode.MODEL_LOAD_REFUSED
                )
                return refused(code, decision.reason)
            message = f"pinned; its load waits: {decision.reason}"
        offer = next(o for o in models.offers() if o.model == name)
        offer = msgspec.structs.replace(offer, detail=self._masker.mask(offer.detail))
        return msgspec.structs.replace(result, message=self._masker.mask(message), offer=offer)

    async def _probe_loop(self, *, task_status: trio.TaskStatus[None]) -> None:
        await self.refresh_capabilities()
        task_status.started()
        while True:
            # Every probe_interval_s (a reload may change it), or at once
            # after a reload or a managed backend's change.
            with trio.move_on_after(self.config.node.probe_interval_s):
                await self._probe_due.wait()
            # Before the probe: a change during it makes the next one due.
            self._probe_due = trio.Event()
            await self.refresh_capabilities()

    def _probe_soon(self) -> None:
        """A managed backend's state changed: probe now, not at the next interval."""
        self._probe_due.set()

    # --- managed backends -----------------------------------------------------------

    async def start_backends(self, nursery: trio.Nursery) -> None:
        """Start the supervisor of every backend the node runs itself, one after another.

        Each start returns once its backend's first start served or failed
        (a failed one is restarted in the background).
        """
        for sup in self._supervisors:
            await nursery.start(sup.serve, name=f"supervise {sup.name}")

    def restart_backends(self) -> list[str]:
        """The operator's restart: every managed backend that is down starts now.

        Returns:
            The names of the instances restarted (those down: in a backoff
            or a crash loop).
        """
        return [sup.name for sup in self._supervisors if sup.restart()]

    # --- load reports ------------------------------------------------------------

    def _load_report(self) -> list[InstanceLoad]:
        """Every instance's load now (a link's session asks when a report is due)."""
        now = trio.current_time()
        return [inst.load(now) for inst in self._instances.values()]

    def _load_changed(self) -> None:
        """An instance's slots or engine figures changed: each link reports it
        (coalesced by its session to ``node.load_reports_per_s``)."""
        now = trio.current_time()
        for link in self._links:
            if link.session.load_changed(now):
                link.driver.wake()

    def start_scrapers(self, nursery: trio.Nursery) -> None:
        """Start reading the engine load of every instance whose engine publishes
        it, in ``nursery``; a reload starts and stops its scrapes there too."""
        self._nursery = nursery
        for inst in self._instances.values():
            self._start_scraper(inst)

    def _start_scraper(self, inst: Instance) -> None:
        reader = inst.adapter
        assert self._nursery is not None
        if isinstance(reader, EngineLoadReader) and reader.load_scrape_interval_s > 0:
            scope = inst.scraper = trio.CancelScope()

            async def scrape() -> None:
                with scope:
                    async with trio.open_nursery() as nursery:
                        if isinstance(reader, KVEventsFollower):
                            nursery.start_soon(follow_kv_events, inst, reader)
                        await scrape_engine_load(inst, reader, self._load_changed)

            self._nursery.start_soon(scrape, name=f"load scrape {inst.name}")

    # --- reloading ---------------------------------------------------------------

    def apply_config(self, config: NodeConfig) -> None:
        """Run with a reloaded config, whose keys that need a restart are the
        running ones (``iop._reload.plan_reload``): instances added, removed
        or changed (module docstring), reconnect delays, probe interval.

        Synchronous: an assign is served by the instances either before or
        after. New adapters are built here (``build_adapter`` does no IO).

        Raises:
            ConfigError: Two instances share a name, or a ``llamacpp``
                instance would change (its server is started with the node:
                ``iop._reload.managed_instances`` keeps it as it runs).
        """
        names = [cfg.name for cfg in config.instances]
        if len(set(names)) != len(names):
            raise ConfigError(f"instance names must be unique, got {names}")
        assert self._nursery is not None, "apply_config needs open_node_agent's nursery"
        old = self._instances
        changed = [
            cfg for cfg in config.instances if cfg.name not in old or old[cfg.name].cfg != cfg
        ]
        # On-demand models are restart keys: their instances stay as they run.
        model_names = {m.name for m in self.config.models}
        removed = [
            inst.cfg for name, inst in old.items() if name not in names and name not in model_names
        ]
        managed = [
            cfg.name
            for cfg in (*changed, *removed, *(old[c.name].cfg for c in changed if c.name in old))
            if isinstance(cfg, LlamaCppInstance)
        ]
        if managed:
            raise ConfigError(
                f"instance {managed[0]!r} runs its own server: a change needs a restart"
            )
        # First what may fail (an adapter's constructor), then the swap.
        built = {cfg.name: build_instance_adapter(cfg) for cfg in changed}
        instances: dict[str, Instance] = {}
        for cfg in config.instances:
            inst = old.get(cfg.name)
            adapter = built.get(cfg.name)
            if adapter is None:
                assert inst is not None
                instances[cfg.name] = inst
                continue
            self._owned.add(adapter)
            if inst is None:
                inst = Instance(cfg, adapter)
                inst.slots.on_change = self._load_changed
            else:
                self._retire(inst, inst.replace(cfg, adapter))
            instances[cfg.name] = inst
            self._start_scraper(inst)
        for name in model_names:
            instances[name] = old[name]
        for name, inst in old.items():
            if name not in instances:
                inst.removed = True
                self._retire(inst, inst.adapter)
        self._instances = instances
        self._generation += 1
        self.config = config
        self._dialer.settings = config.node
        self._dialer.instance_names = list(instances)
        # Header values of new instances are masked too; old ones stay masked.
        self._masker = self._masker.with_secrets(value for value, _ in node_secrets(config))
        for link in self._links:
            link.masker = self._masker
        # Removed instances leave the edges now; the rest as the probe finds them.
        probed = {c.instance: c for c in self._capabilities}
        kept = [probed[name] for name in instances if name in probed and name in old]
        if kept != self._capabilities:
            self._capabilities = kept
            self._caps_version += 1
            for link in self._links:
                self._push_capabilities(link)
        self._probe_soon()
        self._load_changed()

    def _retire(self, inst: Instance, adapter: Adapter) -> None:
        """Stop ``adapter``'s scrape; close it once no run uses it."""
        if inst.scraper is not None:
            inst.scraper.cancel()
            inst.scraper = None
        assert self._nursery is not None
        self._nursery.start_soon(self._close_when_unused, inst, adapter)

    async def _close_when_unused(self, inst: Instance, adapter: Adapter) -> None:
        await inst.unused(adapter)
        if adapter not in self._owned:
            return  # injected: its owner closes it
        self._owned.discard(adapter)
        log.info("instance %s: an adapter it no longer uses is closed", inst.name)
        with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
            try:
                await adapter.aclose()
            except IopError as exc:
                log.warning("closing an old adapter of instance %s failed: %s", inst.name, exc)

    # --- dialling edges -----------------------------------------------------------

    def _default_connect(self, edge: NodeEdge) -> AbstractAsyncContextManager[FrameChannel]:
        return open_ws_link(
            edge.url,
            connect_timeout_s=self._connect_timeout_s,
            max_message_size=self.config.node.max_frame_bytes,
            ssl_context=self._dial_tls(edge),
        )

    def _dial_tls(self, edge: NodeEdge) -> ssl.SSLContext | None:
        """The TLS context of a dial: a pinned certificate is read again each
        time (the edge may have renewed it in place and reloaded), the last
        good one kept when the file cannot be read now."""
        if edge.tls_pin_certfile is not None:
            try:
                self._tls[edge.url] = client_tls_context(edge)
            except ConfigError as exc:
                log.warning("%s; dialling with the certificate pinned before", exc)
        return self._tls[edge.url]

    async def serve(
        self,
        *,
        connect: ConnectFactory | None = None,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Dial every configured edge and keep the links up until drained or cancelled.

        Args:
            connect: Opens a link to an edge (default: a WebSocket,
                ``open_ws_link``).
            task_status: Reports once every edge's dial task is running.
        """
        connect_fn: ConnectFactory = connect or self._default_connect
        if not self.config.node.edges:
            log.warning("node %s has no edges to dial", self.node_id)
        with trio.CancelScope() as scope:
            self._serve_scope = scope
            try:
                async with trio.open_nursery() as nursery:
                    for edge in self.config.node.edges:
                        nursery.start_soon(
                            self._dialer.dial, edge, connect_fn, name=f"dial {edge.url}"
                        )
                    task_status.started()
            finally:
                self._serve_scope = None

    # --- one link -------------------------------------------------------------------

    async def serve_link(
        self,
        chan: FrameChannel,
        *,
        edge: NodeEdge,
        task_status: trio.TaskStatus[Welcome] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve one link over a connected channel until it ends.

        Args:
            chan: The connected channel (closed on return).
            edge: The edge at the other end (token, URL for logs).
            task_status: Reports the edge's ``Welcome`` once the handshake is done.

        Returns:
            When the link was closed by ``drain``.

        Raises:
            LinkClosed: The edge closed the link (``close_code`` says why), or
                it stayed silent past the heartbeat deadline (``CLOSE_HEARTBEAT``).
            LinkProtocolError: The edge broke the protocol.
            LinkError: The handshake failed.
        """
        session = NodeSession(
            node_id=self.node_id,
            token=edge.token,
            now=trio.current_time(),
            heartbeat_timeout_s=self._welcome_timeout_s,
            max_frame_bytes=self.config.node.max_frame_bytes,
            load_reports_per_s=self.config.node.load_reports_per_s,
            load_source=self._load_report,
        )
        link = NodeLink(
            edge,
            chan,
            session,
            self._masker,
            on_assign=self._on_assign,
            on_run_closed=self._run_closed,
            run_backlog=self.config.node.run_backlog,
            frame_interval=self.config.node.frame_interval_ms / 1000,
            on_load_model=None if self.models is None else self._on_load_model,
            on_control_model=None if self.models is None else self._on_control_model,
        )
        try:
            welcome = await self._handshake(link)
            link.welcomed_at = trio.current_time()
            self._links.add(link)
            self._push_capabilities(link)  # what changed since the hello
            with link.scope:
                task_status.started(welcome)
                try:
                    await link.driver.run()
                except PeerSilent:
                    timeout = session.heartbeat_timeout_s
                    link.fail(
                        LinkClosed(
                            f"edge {edge.url} silent for {timeout:g}s",
                            close_code=CLOSE_HEARTBEAT,
                            reason="edge silent",
                        ),
                        CLOSE_HEARTBEAT,
                        "edge silent",
                    )
                except LinkClosed as exc:
                    link.fail(exc)
                except LinkProtocolError as exc:
                    log.error("edge %s broke the link protocol: %s", edge.url, exc)
                    link.fail(exc, close_code(exc), exc.message)
        finally:
            self._links.discard(link)
            link.shut()
            session.close()
            with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                await chan.aclose(link.close_code, link.close_reason)
            link.ended.set()
        if link.end is not None:
            raise link.end

    async def _handshake(self, link: NodeLink) -> Welcome:
        session = link.session
        with trio.move_on_after(self._welcome_timeout_s):
            # What changes after this hello is pushed once the link is up.
            link.caps_version = self._caps_version
            hello = session.hello(
                self._capabilities,
                software=f"iop/{__version__}",
                models=self._offers(),
                memory_mib=0 if self.models is None else self.models.budget_mib,
                model_controls=self.models is not None,
            )
            await link.chan.send(hello)
            frame = await link.chan.receive()
            try:
                (event,) = session.receive(frame, trio.current_time())
            except LinkProtocolError as exc:
                link.close_code, link.close_reason = close_code(exc), close_reason(exc.message)
                raise
            if not isinstance(event, Welcomed):  # the session accepts only a welcome here
                raise InvariantError(f"handshake produced {type(event).__name__}")
            return event.welcome
        link.close_code, link.close_reason = CLOSE_HEARTBEAT, "no welcome"
        raise LinkClosed(
            f"edge {link.edge.url} sent no welcome within {self._welcome_timeout_s:g}s",
            close_code=CLOSE_HEARTBEAT,
            reason="no welcome",
        )

    def _on_assign(self, link: NodeLink, received: AssignReceived) -> None:
        assign = received.assign
        run_id = assign.run_id
        inst = self._instances.get(assign.instance)
        if self._draining:
            self._reject(
                link, run_id, 503, ErrorCode.NODE_DRAINING, f"node {self.node_id} is draining"
            )
            return
        if inst is None:
            known = ", ".join(self._instances) or "none"
            self._reject(
                link,
                run_id,
                404,
                ErrorCode.UNKNOWN_INSTANCE,
                f"node {self.node_id} has no instance {assign.instance!r} (has: {known})",
            )
            return
        spec = assign.spec
        if spec.run_id != run_id:
            # The link's run id is the one every frame is keyed by.
            spec = msgspec.structs.replace(spec, run_id=run_id)
        nr = NodeRun(link, run_id, inst.name)
        try:
            nr.run = run = self._supervisor.start_run(
                RunExecutor(inst), spec, inst.deadlines, outlet=nr
            )
        except InvariantError:
            self._reject(
                link, run_id, 409, ErrorCode.RUN_ID_IN_USE, f"run {run_id} is already running"
            )
            return
        # The run's span, child of the edge's attempt; the backend request
        # carries its context (or the edge's, passed on, when not tracing).
        if self._tracing is not None:
            nr.trace = self._tracing.node_run(
                run.timeline, spec.traceparent, f"{spec.operation} {spec.model}"
            )
            run.timeline.traceparent = nr.trace.traceparent
        else:
            run.timeline.traceparent = spec.traceparent
        link.runs[run_id] = nr
        self._link_runs += 1
        if self._link_runs == 1:
            self._idle = trio.Event()

    def _run_closed(self, nr: NodeRun) -> None:
        if nr.trace is not None:
            nr.trace.finish()
        self._link_runs -= 1
        if self._link_runs == 0:
            self._idle.set()

    def _reject(
        self, link: NodeLink, run_id: str, status: int, code: ErrorCode, message: str
    ) -> None:
        log.info("run %s refused: %s (%s)", run_id, message, code)
        link.reject(run_id, Error(message=message, status=status, code=code))

    # --- drain --------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._draining

    async def drain(self, timeout_s: float) -> None:
        """Stop taking runs, let in-flight ones finish, then close the links.

        New assigns are answered with ``Error`` 503 ``node_draining`` and each
        edge is told with ``Goodbye``. Runs still going after ``timeout_s`` are
        cancelled with ``shutdown`` (their terminal event is still sent).
        Then each link is flushed and closed with ``CLOSE_GOING_AWAY``, and
        ``serve()`` returns. Takes at most ``timeout_s`` plus a few seconds of
        flushing (``DRAIN_FLUSH_TIMEOUT_S``).
        """
        self._draining = True
        log.info(
            "draining node %s: %d runs in flight, waiting up to %gs",
            self.node_id,
            self._link_runs,
            timeout_s,
        )
        for link in list(self._links):
            link.session.goodbye("node draining")
            link.driver.wake()
        with trio.move_on_after(timeout_s):
            await self._idle.wait()
        if self._link_runs:
            log.warning("drain timeout after %gs: cancelling %d runs", timeout_s, self._link_runs)
            for link in list(self._links):
                for nr in list(link.runs.values()):
                    nr.cut_off(CancelReason.SHUTDOWN, "node shutting down")
            with trio.move_on_after(DRAIN_FLUSH_TIMEOUT_S):
                await self._idle.wait()
        links = list(self._links)
        for link in links:
            link.close_when_flushed(CLOSE_GOING_AWAY, "node draining")
        with trio.move_on_after(DRAIN_FLUSH_TIMEOUT_S):
            for link in links:
                await link.ended.wait()
        for link in links:
            if not link.ended.is_set():
                link.fail(
                    LinkError(f"link to edge {link.edge.url} did not flush"),
                    CLOSE_GOING_AWAY,
                    "node draining",
                )
        if self._serve_scope is not None:
            self._serve_scope.cancel()

    # --- admin -----------------------------------------------------------------------

    def snapshot(self) -> NodeSnapshot:
        """Instances with their load, links and runs, right now."""
        now = trio.current_time()
        caps = {c.instance: c for c in self._capabilities}
        instances = []
        for inst in self._instances.values():
            c = caps.get(inst.name)
            instances.append(
                InstanceSnapshot(
                    name=inst.name,
                    adapter=inst.adapter.kind,
                    in_flight=inst.slots.in_flight,
                    queued=inst.slots.queued,
                    max_concurrency=inst.slots.max_concurrency,
                    max_queue=inst.slots.max_queue,
                    provider_status=c.provider_status if c else ProviderStatus.UNKNOWN,
                    targets=c.targets if c else (),
                )
            )
        links = []
        runs = []
        for link in self._links:
            links.append(
                LinkSnapshot(
                    edge=link.edge.url,
                    state=link.session.state.value,
                    runs=len(link.runs),
                    connected_s=max(0.0, now - link.welcomed_at),
                )
            )
            for nr in link.runs.values():
                if nr.run is None:
                    continue
                runs.append(
                    RunSnapshot(
                        run_id=nr.run_id,
                        instance=nr.instance,
                        edge=link.edge.url,
                        state=nr.run.state.value,
                        credit=link.session.credit(nr.run_id),
                        age_s=now - nr.assigned_at,
                    )
                )
        return NodeSnapshot(
            node_id=self.node_id,
            draining=self._draining,
            instances=instances,
            links=links,
            runs=runs,
            models=self._offers() or [],
        )


@asynccontextmanager
async def open_node_agent(
    config: NodeConfig,
    *,
    adapters: Mapping[str, Adapter] | None = None,
    welcome_timeout_s: float = WELCOME_TIMEOUT_S,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    models: ModelManager | None = None,
) -> AsyncIterator[NodeAgent]:
    """Open a node agent: build its adapters, start the backends it runs itself,
    probe them once, start the probe loop.

    On exit the probe loop stops, runs still going are cancelled with
    ``shutdown``, the backends the node runs are stopped, and the adapters
    this function built are closed (injected ones belong to the caller).

    Args:
        config: The node's config.
        adapters: Adapters by instance name to use instead of building them.
        welcome_timeout_s: Deadline of a link's handshake.
        connect_timeout_s: Deadline of the default WebSocket connect.
        models: The manager of the on-demand models, instead of one built
            from ``config.models`` (tests give one with fake backends).

    Raises:
        ConfigError: Two instances share a name.
        ValueError: An injected adapter names no configured instance.
    """
    names = [cfg.name for cfg in config.instances]
    if len(set(names)) != len(names):
        raise ConfigError(f"instance names must be unique, got {names}")
    injected = dict(adapters or {})
    unknown = set(injected) - set(names)
    if unknown:
        raise ValueError(f"adapters given for unconfigured instances: {sorted(unknown)}")
    built = {
        cfg.name: build_instance_adapter(cfg)
        for cfg in config.instances
        if cfg.name not in injected
    }
    # The adapters to close at exit: these, and those a reload builds.
    owned = set(built.values())
    tracing = Tracing.from_settings(config.tracing, "iop-node")
    if models is None and config.models:
        models = ModelManager(config.models, config.model_groups, config.node)
    try:
        async with (
            open_run_supervisor(logger="iop.node.run") as supervisor,
            trio.open_nursery() as nursery,
        ):
            agent = NodeAgent(
                config,
                supervisor,
                {**built, **injected},
                welcome_timeout_s=welcome_timeout_s,
                connect_timeout_s=connect_timeout_s,
                tracing=tracing,
                owned=owned,
                models=models,
            )
            agent._nursery = nursery
            if models is not None:
                await nursery.start(models.serve)
            await agent.start_backends(nursery)
            await nursery.start(agent._probe_loop)
            agent.start_scrapers(nursery)
            try:
                yield agent
            finally:
                nursery.cancel_scope.cancel()
                supervisor.cancel_all(CancelReason.SHUTDOWN)
    finally:
        with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
            for adapter in list(owned):
                try:
                    await adapter.aclose()
                except IopError as exc:
                    log.warning("closing instance %s failed: %s", adapter.name, exc)
        if tracing is not None:
            await tracing.aclose(config.tracing.export_timeout_s + 1.0)
