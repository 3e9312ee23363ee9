"""An on-demand model as one of the node's instances: what it advertises.

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

from typing import ClassVar

from iop.capabilities import Capabilities, ProbeResult, ProviderStatus, provider_detail
from iop.config import LlamaCppModel, ModelConfig, SimModel
from iop.errors import InvariantError
from iop.ondemand._manager import ModelManager
from iop.ondemand._table import ModelState
from iop.runtime import EventSender
from iop.spec import OPERATIONS, ExecutionSpec

__all__ = ["ModelAdapter"]

# What a vllm model serves when it lists no ``operations`` (as a vllm instance).
_VLLM_OPERATIONS = ("chat", "completion", "tokenize")

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
        ops = cfg.operations or (OPERATIONS if self.engine == "sim" else _VLLM_OPERATIONS)
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
