"""Adapters: one per kind of inference backend.

``build_adapter`` turns an instance config into its adapter. Where each
backend's quirks live: ``vllm`` (tool-choice fallback chain),
``openai_compat`` (provider label, headers, option pass-through), ``sim``
(the deterministic simulated backend); the OpenAI wire handling they share is
in ``iop.wire`` and ``iop.adapters._http``.
"""

from __future__ import annotations

import httpx

from iop.adapters._base import (
    Adapter,
    EngineLoadReader,
    KVEventsFollower,
    require_model_and_messages,
)
from iop.adapters._http import HTTP_OPERATIONS, build_chat_body, join_openai_path
from iop.adapters.openai_compat import OpenAICompatAdapter
from iop.adapters.sim import SimAdapter
from iop.adapters.vllm import VllmAdapter
from iop.config import InstanceConfig, OpenAICompatInstance, SimInstance, VllmInstance

__all__ = [
    "HTTP_OPERATIONS",
    "Adapter",
    "EngineLoadReader",
    "KVEventsFollower",
    "OpenAICompatAdapter",
    "SimAdapter",
    "VllmAdapter",
    "build_adapter",
    "build_chat_body",
    "join_openai_path",
    "require_model_and_messages",
]


def build_adapter(
    cfg: InstanceConfig, *, transport: httpx.AsyncBaseTransport | None = None
) -> Adapter:
    """The adapter for an instance config.

    Args:
        cfg: The instance's config; its type picks the adapter.
        transport: httpx transport for HTTP adapters (tests use in-memory ones).
    """
    if isinstance(cfg, VllmInstance):
        return VllmAdapter(cfg, transport=transport)
    if isinstance(cfg, OpenAICompatInstance):
        return OpenAICompatAdapter(cfg, transport=transport)
    if isinstance(cfg, SimInstance):
        return SimAdapter(cfg)
    raise TypeError(f"no adapter for {type(cfg).__name__}")
