"""The node agent: adapter instances, capacity, and the links to edges.

Theory of operation
-------------------
A ``NodeAgent`` (opened with ``open_node_agent``) owns three things for the
node's whole life: one adapter per configured instance, one
``InstanceSlots`` limiter per instance, and a ``RunSupervisor`` whose nursery
every run lives in. Links come and go; runs belong to the supervisor, never
to a link.

``serve()`` dials every configured edge (one task per edge) and keeps it
dialled: connect, ``serve_link``, and on loss reconnect with exponential
backoff and jitter. An edge that refuses the node's token, or says another
node took its id, is retried only at the maximum backoff, with an error log
naming the edge, so a misconfiguration is visible and never a hot loop.

``serve_link`` drives one connected ``FrameChannel`` through the sans-IO
``iop.protocol.NodeSession``. After the handshake (hello with the current
capabilities, then the welcome within ``welcome_timeout_s``) the link's
nursery holds:

* the **reader** (the ``serve_link`` task itself). It turns frames into link
  events and only does non-blocking work: start a run, wake a forwarder,
  cancel a run, queue a pong. It never waits on one run, so one slow run
  cannot stall the others or the heartbeats (no head-of-line blocking). The
  reader runs inside the **liveness watchdog**: a cancel scope whose deadline
  is pushed to ``session.liveness_deadline`` on every frame; when it expires
  the edge is frozen or partitioned and the link is closed with
  ``CLOSE_HEARTBEAT`` "edge silent".
* the **writer**, the only task that calls ``chan.send``. Everyone else puts
  whole frames into the link's bounded outbox (``OUTBOX_CAPACITY``).
* a **capabilities pusher**, which sends ``CapabilitiesUpdate`` whenever the
  periodic probe (``probe_interval_s``) finds that the instances changed.
* one **forwarder per run**. It waits for the run's first queued event, then
  takes whatever else is already queued (``receive_nowait``) as far as the
  run's credit allows, plus the terminal event, which needs no credit, and
  sends them as one ``RunEvents`` frame (adaptive batching). With no credit
  left it sleeps on the run's wake-up event, set when ``Credit`` arrives:
  meanwhile the run's bounded channel fills and the adapter blocks in
  ``send``, which stops it reading its backend's socket. That is the
  end-to-end backpressure, per run.

A run is executed by the runtime as ``slots.acquire()`` then
``adapter.execute()``, so a full queue (``Error`` 429 ``queue_full``) and a
queue timeout (``Cancelled(queue_timeout)``) become the run's terminal event
like any other outcome. The instance's total deadline counts from the moment
the run was assigned; the first-token deadline starts once it has a slot
(the wait is wrapped in ``sink.queued()``).

Every way a run ends produces exactly one terminal event on the link:

==========================  =================================================
``Cancel`` from the edge    ``run.cancel(reason)``; events still queued are
                            dropped (the edge forgot the run) and the
                            ``Cancelled`` is sent without credit
link lost                   forwarders are cancelled; each cancels its run
                            with ``node_lost`` so the adapter stops at once
drain                       new assigns get ``Error`` 503 ``node_draining``;
                            in-flight runs may finish until the timeout, then
                            are cancelled with ``shutdown``
run cancelled while starved a run whose outcome is ``Cancelled`` while it has
                            no credit drops its undelivered deltas and sends
                            the terminal at once
==========================  =================================================
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Final

import msgspec
import trio

from iop import __version__
from iop._secrets import SecretMasker, mask_event, node_secrets
from iop.adapters import Adapter, build_adapter
from iop.capabilities import Capabilities, ProviderStatus, provider_detail
from iop.config import Deadlines, InstanceConfig, NodeConfig, NodeEdge
from iop.errors import (
    ConfigError,
    ErrorCode,
    InvariantError,
    IopError,
    LinkAuthError,
    LinkError,
    LinkLimitError,
    LinkProtocolError,
)
from iop.events import Cancelled, CancelReason, Error, RuntimeEvent, is_terminal
from iop.node._slots import InstanceSlots
from iop.node._ws import DEFAULT_CONNECT_TIMEOUT_S, open_ws_link
from iop.protocol import (
    CLOSE_BAD_TOKEN,
    CLOSE_GOING_AWAY,
    CLOSE_HEARTBEAT,
    CLOSE_ID_IN_USE,
    CLOSE_NORMAL,
    CLOSE_PROTOCOL,
    CLOSE_REPLACED,
    Assign,
    AssignReceived,
    CancelReceived,
    CreditReceived,
    FrameChannel,
    LinkClosed,
    NodeSession,
    PingReceived,
    Welcome,
    Welcomed,
)
from iop.runtime import Run, RunSink, RunState, RunSupervisor, open_run_supervisor
from iop.spec import ExecutionSpec

__all__ = [
    "CLOSE_TIMEOUT_S",
    "DRAIN_FLUSH_TIMEOUT_S",
    "MIN_RECONNECT_DELAY_S",
    "OUTBOX_CAPACITY",
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

# Frames waiting for the link's single writer. The writer drains it at socket
# speed, so it only fills when the socket stalls; then forwarders block here,
# stop taking their runs' events, and the adapters block in turn. Small,
# because a frame carries up to RUN_EVENT_BUFFER + 2 events (what the run's
# channel held, the adapter's blocked send, and the event the forwarder woke
# up with), and the memory a stalled link holds is this times that.
OUTBOX_CAPACITY: Final = 16
# From sending Hello to receiving Welcome. The edge answers at once; a longer
# wait means it is overloaded or not an IOP edge.
WELCOME_TIMEOUT_S: Final = 10.0
# Our side of closing a link (the WebSocket close handshake is bounded by
# its own 2 s disconnect timeout); shielded cleanup, so it must be short.
CLOSE_TIMEOUT_S: Final = 3.0
# A link that stayed up this long was healthy: the reconnect backoff restarts
# from reconnect_min_s.
STABLE_LINK_S: Final = 5.0
# Floor of the reconnect delay: reconnect_min_s = 0 must not become a hot loop.
MIN_RECONNECT_DELAY_S: Final = 0.05
# Drain, after the runs: time to hand the runs' terminal events and the
# link close to the writers. Shutdown must not hang on a stuck socket.
DRAIN_FLUSH_TIMEOUT_S: Final = 2.0
# Outer bound of one instance's capabilities probe. Adapters apply their own
# probe timeout (2 s for HTTP ones); this only keeps a broken adapter from
# wedging the probe loop.
PROBE_GUARD_S: Final = 30.0

ConnectFactory = Callable[[NodeEdge], AbstractAsyncContextManager[FrameChannel]]
"""Opens a link to an edge: ``connect(edge)`` yields a connected ``FrameChannel``."""


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


# --- instances ------------------------------------------------------------------


class _Instance:
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


class _Wakeup:
    """A re-armable wake-up call: ``set()`` ends the current ``wait()``, if any."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = trio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        """Wait for the next ``set()`` (one made before this call does not count)."""
        self._event = trio.Event()
        await self._event.wait()


class _RunExecutor:
    """What the runtime executes for one run: a slot of the instance, then the adapter.

    When it ends, however it ends, the run's outcome is being decided (the
    runtime sets ``Run.outcome`` before it tries to deliver a terminal event
    of its own), so it wakes the run's forwarder: one starved of credit can
    then send a ``Cancelled`` at once instead of after the runtime's delivery
    timeout.
    """

    def __init__(self, instance: _Instance, wake: _Wakeup) -> None:
        self._instance = instance
        self._wake = wake

    async def execute(self, spec: ExecutionSpec, send: RunSink) -> None:
        try:
            async with contextlib.AsyncExitStack() as stack:
                with send.queued():  # waiting for a slot is not the backend's latency
                    await stack.enter_async_context(self._instance.slots.acquire())
                await self._instance.adapter.execute(spec, send)
        finally:
            self._wake.set()


# --- links --------------------------------------------------------------------


class _CloseLink(msgspec.Struct, frozen=True):
    """Outbox item: everything queued before it is sent, then the link closes."""

    code: int
    reason: str


_OutboxItem = bytes | _CloseLink


class _LinkRun:
    """A run as one link sees it: the run handle and its forwarder's wake-up."""

    __slots__ = ("assigned_at", "delivered", "discard", "instance", "run", "wake")

    def __init__(self, run: Run, instance: str, wake: _Wakeup) -> None:
        self.run = run
        self.instance = instance
        self.assigned_at = trio.current_time()
        # The forwarder may proceed: credit arrived, the run was cancelled,
        # or its executor ended.
        self.wake = wake
        # The edge no longer wants this run's non-terminal events.
        self.discard = False
        self.delivered = False

    @property
    def run_id(self) -> str:
        return self.run.run_id

    def cut_off(self, reason: CancelReason, message: str) -> None:
        """Cancel the run; only its terminal event will still be sent."""
        self.discard = True
        self.run.cancel(reason, message)
        self.wake.set()


class _Link:
    """State of one link: its session, outbox, runs and how it ended."""

    def __init__(self, edge: NodeEdge, chan: FrameChannel, session: NodeSession) -> None:
        self.edge = edge
        self.chan = chan
        self.session = session
        self.runs: dict[str, _LinkRun] = {}
        self.outbox_send, self.outbox_receive = trio.open_memory_channel[_OutboxItem](
            OUTBOX_CAPACITY
        )
        self.nursery: trio.Nursery | None = None
        self.welcomed_at = math.inf
        self.caps_version = 0
        # Why the link ended (None: closed by us on drain), and how we close it.
        self.end: LinkError | None = None
        self.close_code = CLOSE_NORMAL
        self.close_reason = ""
        self.ended = trio.Event()

    def fail(self, exc: LinkError, code: int | None = None, reason: str = "") -> None:
        """Record why the link ends (first cause wins) and stop its tasks."""
        if self.end is None:
            self.end = exc
            if code is not None:
                self.close_code, self.close_reason = code, _close_reason(reason)
        if self.nursery is not None:
            self.nursery.cancel_scope.cancel()


def _close_reason(text: str) -> str:
    # A WebSocket close reason is at most 123 bytes of UTF-8 (RFC 6455 §5.5).
    data = text.encode()
    return text if len(data) <= 120 else data[:120].decode(errors="ignore")


def _close_code(exc: LinkProtocolError) -> int:
    """The close code for a protocol error: a crossed limit carries its own."""
    return exc.close_code if isinstance(exc, LinkLimitError) else CLOSE_PROTOCOL


def _first_link_error(group: BaseExceptionGroup[LinkError]) -> LinkError:
    leaf: BaseException = group
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    assert isinstance(leaf, LinkError)
    return leaf


def _refused(exc: LinkError) -> bool:
    """The edge refused this node itself: retrying soon would only repeat it."""
    if isinstance(exc, LinkAuthError):
        return True
    return isinstance(exc, LinkClosed) and exc.close_code in (
        CLOSE_BAD_TOKEN,
        CLOSE_REPLACED,
        CLOSE_ID_IN_USE,
    )


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
    ) -> None:
        self.config = config
        self.node_id = config.node.id
        # The node is the only process that knows its instances' header
        # values: every message it sends the edge goes through this first.
        self._masker = SecretMasker(value for value, _ in node_secrets(config))
        self._supervisor = supervisor
        self._instances = {cfg.name: _Instance(cfg, adapters[cfg.name]) for cfg in config.instances}
        self._welcome_timeout_s = welcome_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._links: set[_Link] = set()
        self._draining = False
        self._serve_scope: trio.CancelScope | None = None
        self._rng = random.Random()
        # Capabilities as last probed; links compare versions to push changes.
        self._capabilities: list[Capabilities] = [
            inst.fallback_capabilities() for inst in self._instances.values()
        ]
        self._caps_version = 0
        self._caps_changed = trio.Event()
        # Forwarders alive across all links, for drain.
        self._forwarders = 0
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
        instances = list(self._instances.values())
        results = [inst.fallback_capabilities() for inst in instances]

        async def probe(i: int, inst: _Instance) -> None:
            with trio.move_on_after(PROBE_GUARD_S) as guard:
                try:
                    results[i] = await inst.adapter.capabilities()
                except Exception as exc:
                    log.warning("instance %s: capabilities probe failed: %r", inst.name, exc)
                    results[i] = inst.fallback_capabilities(
                        f"capabilities probe failed: {type(exc).__name__}"
                    )
            if guard.cancelled_caught:
                log.warning(
                    "instance %s: capabilities probe took over %gs", inst.name, PROBE_GUARD_S
                )
                results[i] = inst.fallback_capabilities(
                    f"capabilities probe took over {PROBE_GUARD_S:g}s"
                )

        async with trio.open_nursery() as nursery:
            for i, inst in enumerate(instances):
                nursery.start_soon(probe, i, inst)
        if results != self._capabilities:
            self._capabilities = results
            self._caps_version += 1
            self._caps_changed.set()
            self._caps_changed = trio.Event()
            down = any(c.provider_status is ProviderStatus.UNAVAILABLE for c in results)
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

    async def _probe_loop(self, *, task_status: trio.TaskStatus[None]) -> None:
        await self.refresh_capabilities()
        task_status.started()
        while True:
            await trio.sleep(self.config.node.probe_interval_s)
            await self.refresh_capabilities()

    # --- dialling edges -----------------------------------------------------------

    def _default_connect(self, edge: NodeEdge) -> AbstractAsyncContextManager[FrameChannel]:
        return open_ws_link(
            edge.url,
            connect_timeout_s=self._connect_timeout_s,
            max_message_size=self.config.node.max_frame_bytes,
        )

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
                        nursery.start_soon(self._dial, edge, connect_fn, name=f"dial {edge.url}")
                    task_status.started()
            finally:
                self._serve_scope = None

    async def _dial(self, edge: NodeEdge, connect: ConnectFactory) -> None:
        """Keep one edge dialled: connect, serve the link, back off, repeat."""
        failures = 0
        while not self._draining:
            log.info("connecting to edge %s", edge.url)
            connected_at = math.inf
            failure: LinkError | None = None
            try:
                async with connect(edge) as chan, trio.open_nursery() as nursery:
                    await nursery.start(partial(self.serve_link, chan, edge=edge))
                    connected_at = trio.current_time()
                    log.info(
                        "connected to edge %s as node %s, instances: %s",
                        edge.url,
                        self.node_id,
                        ", ".join(self._instances) or "(none)",
                    )
            except* LinkError as group:
                failure = _first_link_error(group)
            except* Exception as group:
                # A bug must not take the node off the network for good: log
                # it loudly and reconnect like after any other failure.
                log.error("link to edge %s crashed", edge.url, exc_info=group)
                failure = LinkError(f"link to edge {edge.url} crashed")
            if self._draining or failure is None:
                return
            lived = trio.current_time() - connected_at
            if _refused(failure):
                delay = self.config.node.reconnect_max_s
                if isinstance(failure, LinkClosed) and failure.close_code == CLOSE_ID_IN_USE:
                    hint = (
                        f"another live node already uses the id {self.node_id!r} on that "
                        "edge; give each node its own node.id"
                    )
                else:
                    hint = "check the node's id and the token of this edge in the config"
                log.error(
                    "edge %s refused node %s: %s; %s; retrying in %.1fs",
                    edge.url,
                    self.node_id,
                    failure,
                    hint,
                    delay,
                )
                failures = 0
            else:
                if lived >= STABLE_LINK_S:
                    failures = 0
                delay = self._backoff(failures)
                failures += 1
                if connected_at == math.inf:
                    where = "" if edge.url in failure.message else f"edge {edge.url}: "
                    log.warning("%s%s; retrying in %.1fs", where, failure, delay)
                elif isinstance(failure, LinkClosed):
                    clean = failure.close_code in (CLOSE_NORMAL, CLOSE_GOING_AWAY)
                    log.log(
                        logging.INFO if clean else logging.WARNING,
                        "link to edge %s %s (close %s %s) after %.1fs; reconnecting in %.1fs",
                        edge.url,
                        "closed" if clean else "lost",
                        failure.close_code,
                        failure.reason or failure.message,
                        lived,
                        delay,
                    )
                else:
                    log.warning(
                        "link to edge %s lost: %s; reconnecting in %.1fs", edge.url, failure, delay
                    )
            await trio.sleep(delay)

    def _backoff(self, failures: int) -> float:
        """Exponential backoff with jitter, within [reconnect_min_s, reconnect_max_s]."""
        lo = max(self.config.node.reconnect_min_s, MIN_RECONNECT_DELAY_S)
        hi = self.config.node.reconnect_max_s
        nominal = min(hi, lo * 2.0 ** min(failures, 32))
        # "Equal jitter": spread reconnects of many nodes after an edge restart.
        return max(lo, self._rng.uniform(nominal / 2, nominal))

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
        )
        link = _Link(edge, chan, session)
        try:
            welcome = await self._handshake(link)
            link.welcomed_at = trio.current_time()
            self._links.add(link)
            async with trio.open_nursery() as nursery:
                link.nursery = nursery
                nursery.start_soon(self._write_loop, link, name=f"link writer {edge.url}")
                nursery.start_soon(self._push_capabilities, link, name=f"link caps {edge.url}")
                task_status.started(welcome)
                await self._read_loop(link)
                nursery.cancel_scope.cancel()
        finally:
            self._links.discard(link)
            session.close()
            with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                await chan.aclose(link.close_code, link.close_reason)
            link.ended.set()
        if link.end is not None:
            raise link.end

    async def _handshake(self, link: _Link) -> Welcome:
        session = link.session
        with trio.move_on_after(self._welcome_timeout_s):
            # The pusher sends whatever changes after this hello.
            link.caps_version = self._caps_version
            await link.chan.send(session.hello(self._capabilities, software=f"iop/{__version__}"))
            frame = await link.chan.receive()
            try:
                event = session.receive(frame, trio.current_time())
            except LinkProtocolError as exc:
                link.close_code, link.close_reason = _close_code(exc), _close_reason(exc.message)
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

    async def _read_loop(self, link: _Link) -> None:
        """Read frames until the link ends; record why in ``link.end``."""
        session = link.session
        with trio.CancelScope(deadline=session.liveness_deadline) as liveness:
            try:
                while True:
                    frame = await link.chan.receive()
                    event = session.receive(frame, trio.current_time())
                    liveness.deadline = session.liveness_deadline
                    self._on_link_event(link, event)
            except LinkClosed as exc:
                link.fail(exc)
            except LinkProtocolError as exc:
                log.error("edge %s broke the link protocol: %s", link.edge.url, exc)
                link.fail(exc, _close_code(exc), exc.message)
        if liveness.cancelled_caught:
            timeout = session.heartbeat_timeout_s
            link.fail(
                LinkClosed(
                    f"edge {link.edge.url} silent for {timeout:g}s",
                    close_code=CLOSE_HEARTBEAT,
                    reason="edge silent",
                ),
                CLOSE_HEARTBEAT,
                "edge silent",
            )

    def _on_link_event(
        self,
        link: _Link,
        event: Welcomed | AssignReceived | CreditReceived | CancelReceived | PingReceived,
    ) -> None:
        """Handle one link event without blocking (the reader must never wait)."""
        if isinstance(event, AssignReceived):
            self._on_assign(link, event.assign)
        elif isinstance(event, CreditReceived):
            lr = link.runs.get(event.run_id)
            if lr is not None:
                lr.wake.set()
        elif isinstance(event, CancelReceived):
            lr = link.runs.get(event.cancel.run_id)
            if lr is not None:
                lr.cut_off(event.cancel.reason, event.cancel.message)
        elif isinstance(event, PingReceived):
            try:
                link.outbox_send.send_nowait(event.reply)
            except trio.WouldBlock:
                # The outbox is full: frames are queued to go out, and any
                # frame proves we are alive. If the writer is stuck instead,
                # the link is dead anyway and the edge will notice.
                log.debug("edge %s: outbox full, pong dropped", link.edge.url)
        else:
            raise LinkProtocolError("second welcome on an open link")

    def _on_assign(self, link: _Link, assign: Assign) -> None:
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
        wake = _Wakeup()
        try:
            run = self._supervisor.start_run(_RunExecutor(inst, wake), spec, inst.deadlines)
        except InvariantError:
            self._reject(
                link, run_id, 409, ErrorCode.RUN_ID_IN_USE, f"run {run_id} is already running"
            )
            return
        lr = _LinkRun(run, inst.name, wake)
        link.runs[run_id] = lr
        self._forwarders += 1
        if self._forwarders == 1:
            self._idle = trio.Event()
        assert link.nursery is not None
        link.nursery.start_soon(self._run_task, link, lr, name=f"forward {run_id}")

    def _reject(self, link: _Link, run_id: str, status: int, code: ErrorCode, message: str) -> None:
        log.info("run %s refused: %s (%s)", run_id, message, code)
        error = Error(message=self._masker.mask(message), status=status, code=code)
        frame = link.session.run_events(run_id, [error])
        assert link.nursery is not None
        link.nursery.start_soon(link.outbox_send.send, frame)

    async def _write_loop(self, link: _Link) -> None:
        """The only task that sends on the channel."""
        try:
            while True:
                item = await link.outbox_receive.receive()
                if isinstance(item, _CloseLink):
                    link.close_code, link.close_reason = item.code, item.reason
                    assert link.nursery is not None
                    link.nursery.cancel_scope.cancel()
                    return
                await link.chan.send(item)
        except LinkClosed as exc:
            link.fail(exc)

    async def _push_capabilities(self, link: _Link) -> None:
        while True:
            if link.caps_version == self._caps_version:
                await self._caps_changed.wait()
                continue
            link.caps_version = self._caps_version
            await link.outbox_send.send(link.session.capabilities(self._capabilities))

    # --- one run on a link ------------------------------------------------------------

    async def _run_task(self, link: _Link, lr: _LinkRun) -> None:
        try:
            await self._forward(link, lr)
        finally:
            link.runs.pop(lr.run_id, None)
            if not lr.delivered:
                # The link went away under the run: stop the adapter now.
                lr.run.cancel(CancelReason.NODE_LOST, "link to edge lost")
            lr.run.events.close()
            self._forwarders -= 1
            if self._forwarders == 0:
                self._idle.set()

    async def _forward(self, link: _Link, lr: _LinkRun) -> None:
        """Send the run's events in credit-bounded batches until its terminal event."""
        session, run_id, events = link.session, lr.run_id, lr.run.events
        held: RuntimeEvent | None = None
        while True:
            if held is None:
                try:
                    held = await events.receive()
                except trio.EndOfChannel:
                    held = _outcome(lr.run)
            if not is_terminal(held) and (lr.discard or session.credit(run_id) == 0):
                if lr.discard or isinstance(lr.run.outcome, Cancelled):
                    # Nobody will read these: the edge cancelled the run, or
                    # the run was cancelled while its consumer was starved.
                    lr.discard = True
                    held = None
                    continue
                await lr.wake.wait()
                continue
            batch = [held]
            held = None
            budget = session.credit(run_id) - (0 if is_terminal(batch[0]) else 1)
            # Bounded by the run's channel (RUN_EVENT_BUFFER): no frame limit needed.
            while not is_terminal(batch[-1]):
                try:
                    event = events.receive_nowait()
                except trio.WouldBlock:
                    break
                except trio.EndOfChannel:
                    event = _outcome(lr.run)
                if not is_terminal(event):
                    if lr.discard:
                        continue
                    if budget == 0:
                        held = event
                        break
                    budget -= 1
                batch.append(event)
            if is_terminal(batch[-1]):
                batch[-1] = mask_event(batch[-1], self._masker)
            for part in _fit_frames(run_id, batch, session.peer_max_frame_bytes):
                if part is None:
                    # One event larger than the edge accepts: sending it would
                    # close the link under every other run. This run alone ends.
                    lr.cut_off(CancelReason.EXPLICIT, "event too large for the link")
                    part = [
                        Error(
                            message=f"run {run_id}: the backend produced an event larger "
                            f"than the edge accepts on the link "
                            f"({session.peer_max_frame_bytes} bytes)",
                            status=502,
                            code=ErrorCode.EVENT_TOO_LARGE,
                        )
                    ]
                await link.outbox_send.send(session.run_events(run_id, part))
                if is_terminal(part[-1]):
                    lr.delivered = True
                    return

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
            self._forwarders,
            timeout_s,
        )
        links = list(self._links)
        goodbyes = [(link, link.session.goodbye("node draining")) for link in links]
        await self._post_all(goodbyes)
        with trio.move_on_after(timeout_s):
            await self._idle.wait()
        if self._forwarders:
            log.warning("drain timeout after %gs: cancelling %d runs", timeout_s, self._forwarders)
            for link in list(self._links):
                for lr in list(link.runs.values()):
                    lr.cut_off(CancelReason.SHUTDOWN, "node shutting down")
            with trio.move_on_after(DRAIN_FLUSH_TIMEOUT_S):
                await self._idle.wait()
        links = list(self._links)
        await self._post_all(
            [(link, _CloseLink(CLOSE_GOING_AWAY, "node draining")) for link in links]
        )
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

    @staticmethod
    async def _post_all(items: Sequence[tuple[_Link, _OutboxItem]]) -> None:
        """Queue one item per link, concurrently, each within the flush timeout."""

        async def post(link: _Link, item: _OutboxItem) -> None:
            with trio.move_on_after(DRAIN_FLUSH_TIMEOUT_S):
                await link.outbox_send.send(item)

        async with trio.open_nursery() as nursery:
            for link, item in items:
                nursery.start_soon(post, link, item)

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
            for lr in link.runs.values():
                runs.append(
                    RunSnapshot(
                        run_id=lr.run_id,
                        instance=lr.instance,
                        edge=link.edge.url,
                        state=lr.run.state.value,
                        credit=link.session.credit(lr.run_id),
                        age_s=now - lr.assigned_at,
                    )
                )
        return NodeSnapshot(
            node_id=self.node_id,
            draining=self._draining,
            instances=instances,
            links=links,
            runs=runs,
        )


# msgpack envelope of an events frame besides its events and run id (tag,
# keys, seq, array header), generously.
_EVENTS_FRAME_OVERHEAD: Final = 64


def _fit_frames(
    run_id: str, batch: list[RuntimeEvent], limit: int
) -> list[list[RuntimeEvent] | None]:
    """``batch`` cut into frames of at most ``limit`` bytes, in order.

    A None stands for an event too large for any frame: nothing after it is
    kept (the caller ends the run there).
    """
    room = limit - _EVENTS_FRAME_OVERHEAD - len(run_id.encode())
    sizes = [len(_EVENT_ENCODER.encode(ev)) for ev in batch]
    if sum(sizes) <= room:
        return [batch]
    parts: list[list[RuntimeEvent] | None] = []
    current: list[RuntimeEvent] = []
    used = 0
    for ev, size in zip(batch, sizes, strict=True):
        if size > room:
            if current:
                parts.append(current)
            parts.append(None)
            return parts
        if used + size > room:
            parts.append(current)
            current, used = [], 0
        current.append(ev)
        used += size
    parts.append(current)
    return parts


_EVENT_ENCODER: Final = msgspec.msgpack.Encoder()


def _outcome(run: Run) -> RuntimeEvent:
    """The terminal event of a run whose channel ended without delivering it."""
    if run.state is RunState.DONE and run.outcome is not None:
        return run.outcome
    return Error(
        message="run ended without a terminal event", status=500, code=ErrorCode.INTERNAL_ERROR
    )


@asynccontextmanager
async def open_node_agent(
    config: NodeConfig,
    *,
    adapters: Mapping[str, Adapter] | None = None,
    welcome_timeout_s: float = WELCOME_TIMEOUT_S,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
) -> AsyncIterator[NodeAgent]:
    """Open a node agent: build its adapters, probe them once, start the probe loop.

    On exit the probe loop stops, runs still going are cancelled with
    ``shutdown``, and the adapters this function built are closed (injected
    ones belong to the caller).

    Args:
        config: The node's config.
        adapters: Adapters by instance name to use instead of building them.
        welcome_timeout_s: Deadline of a link's handshake.
        connect_timeout_s: Deadline of the default WebSocket connect.

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
    built = {cfg.name: build_adapter(cfg) for cfg in config.instances if cfg.name not in injected}
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
            )
            await nursery.start(agent._probe_loop)
            try:
                yield agent
            finally:
                nursery.cancel_scope.cancel()
                supervisor.cancel_all(CancelReason.SHUTDOWN)
    finally:
        with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
            for adapter in built.values():
                try:
                    await adapter.aclose()
                except IopError as exc:
                    log.warning("closing instance %s failed: %s", adapter.name, exc)
