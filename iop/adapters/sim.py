"""The ``sim`` adapter: the deterministic simulated backend, in-process.

No HTTP: ``execute`` plays the ``SimScript`` of the request (``iop.sim``)
straight into the run's event channel, sleeping the script's delays with
``trio.sleep``, so tests and benchmarks get realistic timing (TTFT, token
rate), backpressure (a full channel blocks the "generation") and
cancellation (any await may raise ``trio.Cancelled``) without a socket.

Injected failures map onto the errors an HTTP adapter would raise for the
same backend behaviour:

===========================  ====================================================
``http_500`` / ``http_429``  ``BackendHTTPError`` with that status
``http_401``                 ``BackendHTTPError`` 401 (no credential to echo)
``midstream_error``          ``BackendStreamError`` (vLLM's in-stream error, 500)
``truncate``                 ``BackendStreamError`` (no ``[DONE]``)
``stall_before_first_byte``  silence forever: the first-token deadline ends it
``stall_mid_stream``         silence forever: the idle deadline ends it
``malformed_chunk``          counted in ``Complete.malformed_chunks``
===========================  ====================================================

Every operation is served (``Capabilities.operations`` lists them all, or the
instance's ``operations``): ``completion`` plays the sim's completions script
(``build_completion_script``: the same timing, stops, ``echo``, failures as
the HTTP server's ``/v1/completions``), ``embedding`` sleeps the TTFT then
sends ``embedding_vector`` of each input, ``tokenize`` counts with the toy
tokenizer (``tokenize`` / ``tokenize_chat``, as the server's ``/tokenize``).

A request the simulated vLLM refuses (its 400s: ``auto`` tool choice without
a tool parser, invalid ``iop_sim`` overrides...) is a ``BackendHTTPError``
too, as the vLLM adapter would report it. Unlike the HTTP server, the
in-process sim serves whatever model the run names.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import ClassVar

import trio

from iop.adapters._base import require_model, require_model_and_messages
from iop.capabilities import Capabilities, ProbeResult, ProviderStatus
from iop.config import SimConfig, SimInstance
from iop.errors import BackendHTTPError, BackendStreamError, RequestError
from iop.events import (
    Complete,
    Delta,
    EmbeddingData,
    FinishReason,
    ReasoningDelta,
    Start,
    TokenCount,
    ToolCall,
    Usage,
)
from iop.runtime import EventSender
from iop.sim import _completions as sim_completions
from iop.sim import _embeddings as sim_embeddings
from iop.sim._script import (
    ContentToken,
    ReasoningToken,
    SimScript,
    ToolArgs,
    ToolCallBegin,
    apply_overrides,
    build_script,
)
from iop.sim._tokenizer import tokenize, tokenize_chat
from iop.sim._vllm_wire import error_body, injected_http_error
from iop.spec import (
    OPERATIONS,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    ExecutionSpec,
    TokenizeRequest,
)
from iop.wire._errors import excerpt, openai_error_code, parse_error_body

__all__ = ["SimAdapter"]


class SimAdapter:
    """Adapter for one in-process simulated backend.

    Attributes:
        cfg: The instance's config.
        active_runs: Runs currently inside ``execute`` (tests use it to see
            that cancellation really stopped the generation).
    """

    kind: ClassVar[str] = "sim"

    def __init__(self, cfg: SimInstance) -> None:
        self.cfg = cfg
        self.active_runs = 0

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def model(self) -> str:
        return self.cfg.sim.model

    async def capabilities(self) -> Capabilities:
        return Capabilities(
            adapter=self.kind,
            instance=self.cfg.name,
            provider="sim",
            targets=(self.model,),
            max_concurrency=self.cfg.max_concurrency,
            max_queue=self.cfg.max_queue,
            queue_timeout_s=self.cfg.queue_timeout_s,
            request_timeout_s=self.cfg.deadlines.request_timeout_s or 0.0,
            provider_status=ProviderStatus.AVAILABLE,
            operations=tuple(self.cfg.operations or OPERATIONS),
        )

    async def probe(self, target: str = "") -> ProbeResult:
        available = target in ("", self.model)
        return ProbeResult(
            adapter=self.kind,
            instance=self.cfg.name,
            target=target,
            status=ProviderStatus.AVAILABLE if available else ProviderStatus.UNAVAILABLE,
            targets=(self.model,),
            detail="" if available else f"target model {target!r} not found in provider models",
            provider="sim",
        )

    async def aclose(self) -> None:
        return None

    async def execute(self, spec: ExecutionSpec, send: EventSender) -> None:
        request = spec.request
        model = (
            require_model_and_messages(self.kind, spec)
            if isinstance(request, ChatRequest)
            else require_model(self.kind, spec)
        )
        self.active_runs += 1
        try:
            await send.send(Start(target=model))
            try:
                if isinstance(request, ChatRequest):
                    await self._play(build_script(request, self.cfg.sim), send)
                elif isinstance(request, CompletionRequest):
                    await self._complete(request, model, send)
                elif isinstance(request, EmbeddingRequest):
                    await self._embed(request, send)
                else:
                    await self._tokenize(request, send)
            except RequestError as exc:
                body = error_body(exc.message, status=exc.status, param=exc.param)
                raise _http_error(exc.status, exc.message, body) from exc
        finally:
            self.active_runs -= 1

    async def _complete(self, request: CompletionRequest, model: str, send: EventSender) -> None:
        """A legacy completion, as the sim server's ``/v1/completions`` plays it."""
        extra = dict(request.extra_body or {})
        sim_request = sim_completions.CompletionRequest(
            model=model,
            prompt=request.prompt,
            max_tokens=(
                sim_completions.DEFAULT_MAX_TOKENS
                if request.max_tokens is None
                else request.max_tokens
            ),
            stop=request.stop,
            echo=bool(request.echo),
            extra_body=extra or None,
        )
        script = sim_completions.build_completion_script(sim_request, self.cfg.sim)
        cfg = script.config
        injected = injected_http_error(cfg)
        if injected is not None:
            status, body = injected
            await _sleep(cfg.ttft_s)
            raise _http_error(status, f"sim: injected failure ({cfg.failure})", body)
        if cfg.failure == "stall_before_first_byte":
            await trio.sleep_forever()
        (choice,) = script.choices  # one prompt per run
        fail_at = min(max(cfg.fail_after_tokens, 0), len(choice.pieces) - 1)
        malformed = 0
        for i, piece in enumerate(choice.pieces):
            if i == fail_at:
                malformed += await _fail(cfg, piece.delay_s)
            await _sleep(piece.delay_s)
            if piece.text:
                await send.send(Delta(piece.text))
        await send.send(
            Complete(
                finish_reason=(
                    FinishReason.LENGTH if choice.finish_reason == "length" else FinishReason.STOP
                ),
                usage=Usage(
                    input_tokens=choice.prompt_tokens, output_tokens=choice.completion_tokens
                ),
                malformed_chunks=malformed,
            )
        )

    async def _embed(self, request: EmbeddingRequest, send: EventSender) -> None:
        """Embeddings: the TTFT, then ``embedding_vector`` of each input."""
        cfg = apply_overrides(request.extra_body, self.cfg.sim)
        sim_request = sim_embeddings.EmbeddingRequest(
            model=request.model, input=list(request.inputs), dimensions=request.dimensions
        )
        inputs = sim_embeddings.check_embedding_request(sim_request, cfg)
        injected = injected_http_error(cfg)
        await _sleep(cfg.ttft_s)
        if injected is not None:
            status, body = injected
            raise _http_error(status, f"sim: injected failure ({cfg.failure})", body)
        if cfg.failure in ("stall_before_first_byte", "stall_mid_stream"):
            await trio.sleep_forever()
        for index, (text, _) in enumerate(inputs):
            vector = sim_embeddings.embedding_vector(
                text, dim=cfg.embedding_dim, seed=cfg.seed, dimensions=request.dimensions
            )
            await send.send(EmbeddingData.of(index, vector))
        await send.send(Complete(usage=Usage(input_tokens=sum(n for _, n in inputs))))

    async def _tokenize(self, request: TokenizeRequest, send: EventSender) -> None:
        """A token count with the toy tokenizer (the server's ``/tokenize``)."""
        if request.messages is not None:
            ids = tokenize_chat(request.messages, tools=request.tools or ())
        else:
            ids = tokenize(request.prompt or "")
        await send.send(TokenCount(count=len(ids)))
        await send.send(Complete(usage=Usage(input_tokens=len(ids))))

    async def _play(self, script: SimScript, send: EventSender) -> None:
        cfg = script.config
        injected = injected_http_error(cfg)
        if injected is not None:
            status, body = injected
            await _sleep(cfg.ttft_s)
            raise _http_error(status, f"sim: injected failure ({cfg.failure})", body)
        if cfg.failure == "stall_before_first_byte":
            await trio.sleep_forever()

        steps = script.steps
        fail_at = min(max(cfg.fail_after_tokens, 0), len(steps))
        malformed = 0
        call_id = call_name = ""
        call_args: list[str] = []
        for i, step in enumerate(steps):
            if i == fail_at:
                malformed += await _fail(cfg, step.delay_s)
            await _sleep(step.delay_s)
            if isinstance(step, ContentToken):
                await send.send(Delta(step.text))
            elif isinstance(step, ReasoningToken):
                await send.send(ReasoningDelta(step.text))
            elif isinstance(step, ToolCallBegin):
                call_id, call_name = step.id, step.name
            elif isinstance(step, ToolArgs):
                call_args.append(step.text)
        if fail_at == len(steps):
            malformed += await _fail(cfg, 0.0 if script.capped else script.finish_delay_s)
        if not script.capped:
            await _sleep(script.finish_delay_s)

        tool_calls = (
            (ToolCall(id=call_id, name=call_name, arguments="".join(call_args)),)
            if call_name
            else ()
        )
        finish = script.finish_reason
        if tool_calls and finish is FinishReason.STOP:
            # A named tool choice finishes with "stop" on vLLM's wire; the
            # HTTP adapters' parser reports it as tool_calls, and so do we.
            finish = FinishReason.TOOL_CALLS
        await send.send(
            Complete(
                finish_reason=finish,
                usage=Usage(
                    input_tokens=script.prompt_tokens,
                    output_tokens=script.completion_tokens,
                    reasoning_tokens=script.reasoning_tokens,
                ),
                tool_calls=tool_calls,
                malformed_chunks=malformed,
            )
        )


async def _sleep(delay_s: float) -> None:
    # A zero delay needs no sleep: the next send is a checkpoint anyway.
    if delay_s > 0:
        await trio.sleep(delay_s)


async def _fail(cfg: SimConfig, delay_s: float) -> int:
    """Strike the injected mid-stream failure; return malformed chunks to count."""
    if cfg.failure == "midstream_error":
        await _sleep(delay_s)
        # The status is the in-stream error's code, as the HTTP adapters report it.
        raise BackendStreamError("sim stream error: sim: injected mid-stream error", status=500)
    if cfg.failure == "truncate":
        await _sleep(delay_s)
        raise BackendStreamError("sim stream ended without [DONE]")
    if cfg.failure == "stall_mid_stream":
        await trio.sleep_forever()
    return 1 if cfg.failure == "malformed_chunk" else 0


def _http_error(status: int, message: str, body: bytes) -> BackendHTTPError:
    try:
        status_line = f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        status_line = str(status)
    # The same mapping as the HTTP adapters give the same body over the wire.
    openai = openai_error_code(parse_error_body(body), status)
    return BackendHTTPError(
        f"sim returned {status_line}: {message}",
        backend_status=status,
        body_excerpt=excerpt(body),
        code=openai.code if openai else None,
        param=openai.param if openai else None,
    )
