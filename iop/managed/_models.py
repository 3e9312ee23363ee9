"""How each engine of an on-demand model is started: one load is one supervised life.

A ``ModelBackend`` pairs a ``Supervisor`` (``iop.managed._supervise``),
which the model manager runs with ``once=True`` (a load is one life: a
process that exits is the model failing, never restarted behind the
manager's back), with the adapter runs use once it is up:

- ``llamacpp``: the node's managed llama.cpp server
  (``ManagedLlamaCppAdapter``: its settings are the model's keys);
- ``vllm``: the model's ``command`` (``iop.managed._command``), then the
  ``vllm`` adapter on the URL it serves;
- ``sim``: nothing to start; the load takes ``sim.load_time_s``, then the
  in-process ``sim`` adapter serves.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import trio

from iop.adapters import Adapter, SimAdapter, build_adapter
from iop.config import (
    LlamaCppModel,
    ModelConfig,
    SimModel,
    SuperviseSettings,
    VllmInstance,
    VllmModel,
)
from iop.errors import InvariantError
from iop.managed._adapter import ManagedLlamaCppAdapter
from iop.managed._command import serve_command
from iop.managed._supervise import Supervisor

__all__ = ["BackendFactory", "ModelBackend", "build_model_backend"]


class ModelBackend(Protocol):
    """One load of a model: its life's supervisor and the adapter runs use."""

    @property
    def supervisor(self) -> Supervisor[Any]: ...

    @property
    def adapter(self) -> Adapter:
        """The adapter of the serving backend (once the supervisor is ``UP``)."""
        ...

    async def aclose(self) -> None: ...


BackendFactory = Callable[[ModelConfig], ModelBackend]


class _LlamaCpp:
    def __init__(self, cfg: LlamaCppModel) -> None:
        self._adapter = ManagedLlamaCppAdapter(cfg)

    @property
    def supervisor(self) -> Supervisor[Any]:
        return self._adapter.supervisor

    @property
    def adapter(self) -> Adapter:
        return self._adapter

    async def aclose(self) -> None:
        await self._adapter.aclose()


class _Command:
    def __init__(self, cfg: VllmModel) -> None:
        self._cfg = cfg
        self._adapter: Adapter | None = None
        serve = partial(
            serve_command,
            cfg.command,
            name=cfg.name,
            model=cfg.model,
            host=cfg.host,
            port=cfg.port,
            health_path=cfg.health_path,
            ready_timeout_s=cfg.ready_timeout_s,
            stop_grace_s=cfg.stop_grace_s,
        )
        self.supervisor: Supervisor[str] = Supervisor(
            cfg.name, serve, SuperviseSettings(), on_up=self._up
        )

    def _up(self, url: str) -> None:
        # A vllm instance on the started process's URL (the model's own
        # keys dropped: a VllmModel refuses an endpoint).
        keys = {f: getattr(self._cfg, f) for f in VllmInstance.__struct_fields__}
        self._adapter = build_adapter(VllmInstance(**{**keys, "endpoint": url}))

    @property
    def adapter(self) -> Adapter:
        if self._adapter is None:
            raise InvariantError(f"model {self._cfg.name} has no adapter before it serves")
        return self._adapter

    async def aclose(self) -> None:
        if self._adapter is not None:
            await self._adapter.aclose()


class _Sim:
    def __init__(self, cfg: SimModel) -> None:
        self._load_time_s = cfg.sim.load_time_s
        self._adapter = SimAdapter(cfg)
        self.supervisor: Supervisor[None] = Supervisor(cfg.name, self._serve, SuperviseSettings())

    async def _serve(
        self, *, on_exit: Callable[[str], None], task_status: trio.TaskStatus[None]
    ) -> None:
        await trio.sleep(self._load_time_s)
        task_status.started(None)
        await trio.sleep_forever()

    @property
    def adapter(self) -> Adapter:
        return self._adapter

    async def aclose(self) -> None:
        await self._adapter.aclose()


def build_model_backend(cfg: ModelConfig) -> ModelBackend:
    """A new backend for one load of ``cfg``."""
    if isinstance(cfg, LlamaCppModel):
        return _LlamaCpp(cfg)
    if isinstance(cfg, VllmModel):
        return _Command(cfg)
    return _Sim(cfg)
