"""Adapter for vLLM's OpenAI-compatible server (seed 000).

vLLM's quirks live here. The request goes out as a streaming chat request; a
non-2xx answer runs the seed's fallback chain, in the seed's order:

1. The "auto tool choice requires --enable-auto-tool-choice" error with
   exactly one tool: retry with that tool forced.
2. If the (latest) answer is still a tool-support error: retry with the
   text-tool fallback: tools described in the prompt, and ``Complete``
   flagged so the edge synthesises tool calls from the text.
3. Otherwise: an error with the status and a bounded excerpt of the body.

Both of vLLM's error body shapes (nested since 0.10.1, flat before) are
understood (``iop.wire._errors``), reasoning is read from
``reasoning_content`` or ``reasoning``, and usage keeps cached and reasoning
tokens (``iop.wire._openai_stream``).

Chat and completion requests carry the run's ``cache_salt``
(``ExecutionSpec.cache_salt``), which vLLM hashes into a prompt's first KV
block so that only requests of the same salt share cached blocks
(https://docs.vllm.ai/en/latest/design/prefix_caching/, since
https://github.com/vllm-project/vllm/pull/17045; a vLLM on its V0 engine
refuses the field with a 400).

With ``engine_priority`` (docs/operations.md, "Engine priority"), a run's
objective priority (``ExecutionSpec.priority``, higher is more important)
goes to vLLM as the body's ``priority``, negated: vLLM handles lower values
first (its ``ChatCompletionRequest.priority``, default 0) and refuses a
non-zero one unless it runs ``--scheduling-policy priority``.
"""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack
from typing import Any, ClassVar, Final

import httpx
import msgspec

from iop.adapters._base import require_model_and_messages
from iop.adapters._http import HTTPAdapter, build_chat_body
from iop.capabilities import Capabilities
from iop.config import VllmInstance
from iop.errors import BackendProtocolError
from iop.events import Start
from iop.runtime import EventSender
from iop.spec import ChatRequest, ExecutionSpec
from iop.wire._engine_load import EngineDialect, EngineFigures
from iop.wire._errors import parse_error_body
from iop.wire._kv_events import CacheMirror, decode_kv_events
from iop.wire._tool_prompt import (
    fallback_messages,
    forced_tool_choice,
    is_auto_tool_choice_error,
    is_tool_support_error,
)

__all__ = ["VllmAdapter"]

log = logging.getLogger("iop.adapters.vllm")

# vLLM does not know Ollama's extensions; everything else of the request is
# passed through as the OpenAI fields vLLM understands.
_VLLM_PASSTHROUGH = ("tools", "tool_choice")
# The sim's /kv_events page: [[seq, payload], ...] (iop/sim/_server.py).
_EVENTS_PAGE: Final = msgspec.msgpack.Decoder(list[tuple[int, bytes]])


class VllmAdapter(HTTPAdapter):
    """Adapter for one vLLM server."""

    kind: ClassVar[str] = "vllm"

    def __init__(
        self, cfg: VllmInstance, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        super().__init__(cfg, provider="vllm", transport=transport, cache_salt=True)
        self.cfg = cfg
        self.engine = EngineDialect.VLLM
        # What the server's KV events say its prefix cache holds.
        self._kv_mirror = CacheMirror()

    async def engine_load(self) -> EngineFigures:
        """The load on ``/metrics``, and, when the node reads the server's KV
        cache events, what its prefix cache holds now
        (``iop.wire._kv_events``): over HTTP (``kv_events_path``, the sim's),
        read on from the last batch each time; over ZeroMQ
        (``kv_events_endpoint``, vLLM's), as ``follow_kv_events`` applied them.

        Raises:
            BackendError: A page could not be read, or is not what it should be.
        """
        figures = await super().engine_load()
        if not (self.cfg.kv_events_path or self.cfg.kv_events_endpoint):
            return figures
        mirror = self._kv_mirror
        if figures.cache_tokens is not None and mirror.block_size > 0:
            mirror.capacity_blocks = figures.cache_tokens // mirror.block_size
        if self.cfg.kv_events_path:
            page = await self._http.fetch_page(self.cfg.kv_events_path, f"after={mirror.last_seq}")
            try:
                batches = _EVENTS_PAGE.decode(page)
                for seq, payload in batches:
                    mirror.apply(seq, decode_kv_events(payload))
            except (msgspec.DecodeError, ValueError) as exc:
                raise BackendProtocolError(f"{self.cfg.kv_events_path}: {exc}") from exc
        return msgspec.structs.replace(figures, cached_tokens=mirror.tokens)

    async def follow_kv_events(self) -> None:
        """Subscribe to the server's KV cache events over ZeroMQ
        (``kv_events_endpoint``; ``iop.adapters._kv_zmq``) until cancelled;
        returns at once when it has none to follow."""
        if not self.cfg.kv_events_endpoint:
            return
        # The kvevents extra: imported only when a config asks for it.
        from iop.adapters._kv_zmq import KVEventsSubscriber

        await KVEventsSubscriber(self.cfg, self._kv_mirror).run()

    async def capabilities(self) -> Capabilities:
        caps = await super().capabilities()
        if self.cfg.engine_priority:
            caps = msgspec.structs.replace(caps, engine_priority=True)
        return caps

    async def execute_chat(self, spec: ExecutionSpec, send: EventSender) -> None:
        model = require_model_and_messages(self.kind, spec)
        await send.send(Start(target=model))
        body = build_chat_body(
            spec, model=model, passthrough=_VLLM_PASSTHROUGH, cache_salt=self._http.salt_of(spec)
        )
        if self.cfg.engine_priority:
            # The edge's, never the client's; vLLM: lower is earlier, IOP's
            # objectives: higher is more important.
            body.pop("priority", None)
            if spec.priority is not None:
                body["priority"] = -spec.priority
        log.info(
            "vllm executing run_id=%s target=%s endpoint=%s",
            spec.run_id,
            model,
            self._http.endpoint,
        )
        # The first try in a plain ``async with``: an exit stack (a deque, 760
        # bytes) per open stream only when vLLM refused it (docs/benchmarks.md,
        # "Memory", "Second pass").
        async with self._http.post_chat(body, what="vllm request failed") as response:
            if response.is_success:
                await self._http.pump(response, send, run_id=spec.run_id, text_tool_fallback=False)
                return
            error = await self._http.read_error_body(response)
        async with AsyncExitStack() as stack:
            response, text_tool_fallback = await self._fallback(stack, spec, body, response, error)
            await self._http.pump(
                response, send, run_id=spec.run_id, text_tool_fallback=text_tool_fallback
            )

    async def _fallback(
        self,
        stack: AsyncExitStack,
        spec: ExecutionSpec,
        body: dict[str, Any],
        response: httpx.Response,
        error: bytes | None,
    ) -> tuple[httpx.Response, bool]:
        """Apply the fallback chain to a request vLLM answered non-2xx (``response``, closed).

        Every response but the one returned is closed before the next try.
        Returns the 2xx streaming response and whether the text-tool
        fallback produced it.
        """
        assert error is not None
        message = parse_error_body(error).message

        request = spec.request
        assert isinstance(request, ChatRequest)
        tools = request.tools
        if is_auto_tool_choice_error(message):
            forced = forced_tool_choice(tools)
            if forced is not None:
                log.info("run %s: vllm has no auto tool choice; forcing the only tool", spec.run_id)
                body = {**body, "tool_choice": forced}
                response, error = await self._send(stack, body, "vllm retry request failed")
                if error is None:
                    return response, False
                message = parse_error_body(error).message

        if self.cfg.text_tool_fallback and tools and is_tool_support_error(message):
            log.info(
                "run %s: vllm refused tools (%s); using the text-tool fallback",
                spec.run_id,
                message,
            )
            fallback = {
                k: v
                for k, v in body.items()
                if k not in ("tools", "tool_choice", "parallel_tool_calls")
            }
            fallback["messages"] = fallback_messages(request.messages, tools, request.tool_choice)
            response, error = await self._send(
                stack, fallback, "vllm text tool fallback request failed"
            )
            if error is None:
                return response, True

        raise self._http.http_error(response, error)

    async def _send(
        self, stack: AsyncExitStack, body: dict[str, Any], what: str
    ) -> tuple[httpx.Response, bytes | None]:
        """POST ``body``. A 2xx response stays open in ``stack`` (error None);
        a non-2xx one is read (bounded), closed, and its body returned."""
        response = await stack.enter_async_context(self._http.post_chat(body, what=what))
        if response.is_success:
            return response, None
        error = await self._http.read_error_body(response)
        await response.aclose()
        return response, error
