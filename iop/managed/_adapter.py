"""The node's adapter for a llama.cpp server it starts itself (a ``llamacpp`` instance).

``ManagedLlamaCppAdapter`` is an ``Adapter`` whose backend is a child
process: its ``supervisor`` (``iop.managed._supervise``) keeps the server
serving, and each run goes to the server through an ``OpenAICompatAdapter``
(the same one a configured ``openai_compat`` instance would use, so nothing
a client sees differs while the server is up). The node starts the
supervisor in its own nursery (``open_node_agent``).

A run's end when the server dies under it
-----------------------------------------
Killing the server breaks the run's connection a moment before the
supervisor sees the process gone: the inner adapter raises a
``BackendError`` (the stream broke, or the connection was refused). The
run then waits, at most ``LOSS_CONFIRM_S``, for the life it started on to
be ``gone``; if it is, the run ends ``BackendLost`` (503 ``backend_lost``,
the server's fate in the message), which the edge fails over when no
output went out yet and otherwise turns into the terminal of the client's
own protocol. An error from a server that is still alive is the run's
error as it was. A frozen server (SIGSTOP) answers nothing: the liveness
check kills it (``iop.managed._llamacpp``), which breaks the connection the
same way. A run that arrives while the server is down ends
``BackendUnavailable`` (503, fails over) with the supervisor's reason.

``open_adapter`` gives any instance's adapter for one use (``iop probe``,
``iop run``): a ``llamacpp`` instance's server is started once for it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import ClassVar, Final
from urllib.parse import urlsplit

import msgspec
import trio

from iop.adapters import Adapter, OpenAICompatAdapter, build_adapter
from iop.capabilities import Capabilities, ProbeResult, ProviderStatus, provider_detail
from iop.config import InstanceConfig, LlamaCppInstance, OpenAICompatInstance
from iop.errors import BackendError, BackendLost, BackendUnavailable
from iop.managed._llamacpp import LlamaCppEndpoint, LlamaCppSettings, serve_llamacpp
from iop.managed._supervise import BackendState, ServeFn, Supervisor
from iop.runtime import EventSender
from iop.spec import ExecutionSpec

__all__ = [
    "LOSS_CONFIRM_S",
    "ManagedLlamaCppAdapter",
    "build_instance_adapter",
    "llamacpp_settings",
    "open_adapter",
]

# From a run's broken connection to the supervisor seeing the process gone.
# Both follow from the one exit: the kernel closes the sockets, then makes
# the process waitable (microseconds apart), and the supervisor's task is
# woken in the same event loop. A second is far more than that takes even
# on a loaded machine; it delays only the error of a run whose server is
# alive and broke the stream itself.
LOSS_CONFIRM_S: Final = 1.0
# Closing the adapters' connection pools, shielded: it must be short.
CLOSE_TIMEOUT_S: Final = 3.0
PROVIDER: Final = "llama.cpp"


def llamacpp_settings(cfg: LlamaCppInstance) -> LlamaCppSettings:
    """How to run the server of a ``llamacpp`` instance."""
    s = cfg.supervise
    return LlamaCppSettings(
        host=cfg.host,
        port=cfg.port,
        model=cfg.model,
        alias=cfg.alias,
        ctx=cfg.ctx,
        parallel=cfg.parallel,
        threads=cfg.threads,
        cache_ram_mib=cfg.cache_ram_mib,
        chat_template_file=cfg.chat_template_file,
        embeddings=cfg.embeddings,
        log_file=cfg.log_file,
        ready_timeout_s=cfg.ready_timeout_s,
        health_timeout_s=cfg.health_timeout_s,
        stop_grace_s=cfg.stop_grace_s,
        liveness_interval_s=s.liveness_interval_s,
        liveness_timeout_s=s.liveness_timeout_s,
        liveness_failures=s.liveness_failures,
    )


class ManagedLlamaCppAdapter:
    """The adapter of a ``llamacpp`` instance: its supervised server and the runs on it.

    Args:
        cfg: The instance's config.
        serve: Runs one life of the server; by default ``serve_llamacpp``
            with the instance's settings (tests give a fake process).

    Attributes:
        supervisor: Keeps the server serving; the node runs its ``serve``.
    """

    kind: ClassVar[str] = "llamacpp"

    def __init__(
        self, cfg: LlamaCppInstance, *, serve: ServeFn[LlamaCppEndpoint] | None = None
    ) -> None:
        self.cfg = cfg
        self._settings = llamacpp_settings(cfg)
        self.supervisor: Supervisor[LlamaCppEndpoint] = Supervisor(
            cfg.name, serve or self._serve_one, cfg.supervise, on_up=self._up
        )
        # The adapter of the server's URL (one per URL: the port is kept
        # across restarts, so there is one unless the first port was lost).
        self._inner: OpenAICompatAdapter | None = None
        self._retired: list[OpenAICompatAdapter] = []

    @property
    def name(self) -> str:
        return self.cfg.name

    async def _serve_one(
        self,
        *,
        on_exit: Callable[[str], None],
        task_status: trio.TaskStatus[LlamaCppEndpoint],
    ) -> None:
        await serve_llamacpp(self._settings, on_exit=on_exit, task_status=task_status)

    def _up(self, endpoint: LlamaCppEndpoint) -> None:
        """A life serves: later lives ask for its port; runs go to its URL."""
        port = urlsplit(endpoint.url).port
        if self._settings.port == 0 and port:
            # The same URL after a restart: one adapter, one connection pool,
            # and what the logs and the admin views say stays true.
            self._settings = msgspec.structs.replace(self._settings, port=port)
        if self._inner is not None and self._inner.cfg.endpoint == endpoint.url:
            return
        if self._inner is not None:
            # Runs of the old server may still hold it; closed with the adapter.
            self._retired.append(self._inner)
        cfg = self.cfg
        self._inner = OpenAICompatAdapter(
            OpenAICompatInstance(
                name=cfg.name,
                provider=PROVIDER,
                endpoint=endpoint.url,
                max_concurrency=cfg.max_concurrency,
                max_queue=cfg.max_queue,
                queue_timeout_s=cfg.queue_timeout_s,
                deadlines=cfg.deadlines,
                targets=list(cfg.targets),
                operations=cfg.operations,
            )
        )

    def _serving(self) -> OpenAICompatAdapter | None:
        if self.supervisor.state is BackendState.UP:
            return self._inner
        return None

    async def capabilities(self) -> Capabilities:
        inner = self._serving()
        if inner is not None:
            caps = await inner.capabilities()
            return msgspec.structs.replace(caps, adapter=self.kind)
        cfg = self.cfg
        return Capabilities(
            adapter=self.kind,
            instance=cfg.name,
            provider=PROVIDER,
            targets=tuple(cfg.targets),
            max_concurrency=cfg.max_concurrency,
            max_queue=cfg.max_queue,
            queue_timeout_s=cfg.queue_timeout_s,
            request_timeout_s=cfg.deadlines.request_timeout_s or 0.0,
            provider_status=ProviderStatus.UNAVAILABLE,
            provider_detail=provider_detail(self.supervisor.detail),
            operations=tuple(cfg.operations or ()),
        )

    async def probe(self, target: str = "") -> ProbeResult:
        inner = self._serving()
        if inner is not None:
            result = await inner.probe(target)
            return msgspec.structs.replace(result, adapter=self.kind)
        return ProbeResult(
            adapter=self.kind,
            instance=self.cfg.name,
            target=target,
            status=ProviderStatus.UNAVAILABLE,
            detail=provider_detail(self.supervisor.detail),
            provider=PROVIDER,
        )

    async def execute(self, spec: ExecutionSpec, send: EventSender) -> None:
        life = self.supervisor.life
        inner = self._serving()
        if inner is None or life is None:
            raise BackendUnavailable(f"instance {self.name}: {self.supervisor.detail}")
        try:
            await inner.execute(spec, send)
        except BackendError as exc:
            with trio.move_on_after(LOSS_CONFIRM_S):
                await life.gone.wait()
            if life.gone.is_set():
                raise BackendLost(f"instance {self.name}: {life.reason}") from exc
            raise

    async def aclose(self) -> None:
        """Close the adapters of the server's URLs (the supervisor stops the server)."""
        adapters, self._retired = [*self._retired, self._inner], []
        self._inner = None
        for adapter in adapters:
            if adapter is not None:
                await adapter.aclose()


def build_instance_adapter(cfg: InstanceConfig) -> Adapter:
    """The adapter of any instance config: ``build_adapter``'s, or a managed one."""
    if isinstance(cfg, LlamaCppInstance):
        return ManagedLlamaCppAdapter(cfg)
    return build_adapter(cfg)


@asynccontextmanager
async def open_adapter(cfg: InstanceConfig) -> AsyncIterator[Adapter]:
    """The adapter of ``cfg`` for one use (``iop probe``, ``iop run``), closed after.

    A ``llamacpp`` instance's server is started once, for the body, and never
    restarted: if it cannot start, the adapter reports it unavailable with
    the reason (its log says more), and a run on it fails.
    """
    if not isinstance(cfg, LlamaCppInstance):
        adapter = build_adapter(cfg)
        try:
            yield adapter
        finally:
            await adapter.aclose()
        return
    managed = ManagedLlamaCppAdapter(cfg)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(managed.supervisor.serve, once=True))
            yield managed
            nursery.cancel_scope.cancel()
    finally:
        with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
            await managed.aclose()
