"""Adapter for any OpenAI-compatible server (seed 003).

Lemonade, llama.cpp's ``llama-server``, Ollama's ``/v1``, SGLang, LM Studio...
What it adds over the bare protocol, after the seed: a provider label,
configured headers (auth) with the adapter owning Content-Type, ``options``
copied to top-level fields with the adapter's own fields winning,
pass-through of ``tools``/``format``/``think``/``keep_alive``, and probing via
``/v1/models``. Unlike the seed, messages keep their full OpenAI shape (tool
calls, tool results, content parts) and standard sampling fields are passed.

The run's ``cache_salt`` goes only to SGLang (``engine = "sglang"``), whose
OpenAI server keeps prefix caches apart by it as vLLM does (it isolates
since https://github.com/sgl-project/sglang/pull/23300); the other servers
have no such field (llama.cpp, Ollama, Lemonade), and one that refuses
unknown fields would fail every run (docs/operations.md, "Tenants and
limits", "Prefix caches").
"""

from __future__ import annotations

import logging
from typing import ClassVar

import httpx

from iop.adapters._base import require_model_and_messages
from iop.adapters._http import HTTPAdapter, build_chat_body
from iop.config import OpenAICompatInstance
from iop.events import Start
from iop.runtime import EventSender
from iop.spec import ExecutionSpec
from iop.wire._engine_load import EngineDialect

__all__ = ["OpenAICompatAdapter"]

log = logging.getLogger("iop.adapters.openai_compat")


class OpenAICompatAdapter(HTTPAdapter):
    """Adapter for one OpenAI-compatible backend instance."""

    kind: ClassVar[str] = "openai_compat"

    def __init__(
        self, cfg: OpenAICompatInstance, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        super().__init__(
            cfg, provider=cfg.provider, transport=transport, cache_salt=cfg.engine == "sglang"
        )
        self.cfg = cfg
        self.engine = EngineDialect(cfg.engine)

    async def execute_chat(self, spec: ExecutionSpec, send: EventSender) -> None:
        model = require_model_and_messages(self.kind, spec)
        await send.send(Start(target=model))
        body = build_chat_body(spec, model=model, cache_salt=self._http.salt_of(spec))
        log.info(
            "openai_compat executing run_id=%s provider=%s target=%s endpoint=%s",
            spec.run_id,
            self.cfg.provider,
            model,
            self._http.endpoint,
        )
        async with self._http.post_chat(body, what="openai_compat request failed") as response:
            if not response.is_success:
                raise self._http.http_error(response, await self._http.read_error_body(response))
            await self._http.pump(response, send, run_id=spec.run_id)
