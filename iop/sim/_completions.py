"""Legacy ``/v1/completions`` for the sim (sans-IO): prompt in, text out, vLLM's bytes.

Theory of operation
-------------------
Each prompt is answered by the chat script machinery (``build_script``) as
if it were one user message, so the same timing, token cap, per-request
``iop_sim`` overrides and injected failures apply; a completions model has
no reasoning parser and no tools, so the answer is content tokens only
(``reasoning_tokens`` is ignored). What differs from chat:

* ``max_tokens`` defaults to 16, as in vLLM and OpenAI (null means 16 too);
* ``stop`` strings end the text before the first one found, with
  ``finish_reason: "stop"`` and ``stop_reason: <the string>``; the chunk in
  which the stop string completes carries the text before it (vLLM may
  hold back a few characters earlier in the stream: the joined text is
  the same);
* ``echo`` puts the prompt before the first token's text;
* ``prompt`` is a string, a list of strings, a list of token ids or a list
  of lists of ids (read back to text with the toy tokenizer); each prompt
  is a choice (``index`` = its position), generated side by side: their
  chunks interleave, one round per token;
* prompt tokens are counted with the toy tokenizer.

The bytes are vLLM's (``CompletionStreamResponse`` chunks with
``exclude_unset``: ``id, object, created, model, choices``, a choice is
``index, text, logprobs, finish_reason, stop_reason, prompt_token_ids,
token_ids``; no role chunk; the usage chunk only with
``stream_options.include_usage``; ``data: [DONE]`` last; the full
``CompletionResponse`` body with ``model_dump`` order). ``logprobs`` are not
simulated (always null) and ``n`` must be 1.
"""

from __future__ import annotations

import hashlib
from typing import Any, Final

import msgspec

from iop.config import SimConfig
from iop.errors import RequestError
from iop.events import FinishReason
from iop.sim._script import ContentToken, apply_overrides, build_script
from iop.sim._tokenizer import is_token_ids, texts_with_counts
from iop.sim._vllm_wire import DONE, Ending, Frame, StreamPlan, decode_request, inject_failure
from iop.spec import ChatRequest, Message, StreamOptions

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "CompletionChoice",
    "CompletionRequest",
    "CompletionScript",
    "Piece",
    "build_completion_script",
    "completion_prompts",
    "completion_stream_plan",
    "completion_text_body",
    "parse_completion_request",
]

# vLLM's and OpenAI's default for the legacy endpoint.
DEFAULT_MAX_TOKENS: Final = 16

_encode = msgspec.json.encode


class CompletionRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A ``/v1/completions`` body; unknown keys land in ``extra_body``."""

    model: str | None = None
    prompt: str | list[Any] | None = None
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    echo: bool = False
    n: int = 1
    extra_body: dict[str, Any] | None = None


def parse_completion_request(raw: bytes) -> CompletionRequest:
    """Decode a ``/v1/completions`` body, with vLLM's validations.

    Raises:
        RequestError: Not a JSON object, wrong types, no prompt,
            ``stream_options`` without ``stream``, or ``n`` other than 1.
    """
    request = decode_request(raw, CompletionRequest)
    if request.max_tokens is None:  # vLLM: null means the default
        request = msgspec.structs.replace(request, max_tokens=DEFAULT_MAX_TOKENS)
    if request.stream_options is not None and not request.stream:
        raise RequestError(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    if request.prompt is None or request.prompt in ("", []):
        raise RequestError(
            "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
        )
    if request.n != 1:
        raise RequestError("sim: only n=1 is simulated", param="n")
    return request


def completion_prompts(request: CompletionRequest, cfg: SimConfig) -> list[tuple[str, int]]:
    """Each prompt's text and token count, in order (token ids are read back
    with the toy tokenizer, and counted as given).

    Raises:
        RequestError: A prompt of another shape, or more than
            ``cfg.max_inputs`` prompts.
    """
    value = request.prompt
    items: list[Any] = (
        [value] if isinstance(value, str) or (value and is_token_ids(value)) else list(value or [])
    )
    if len(items) > cfg.max_inputs:
        raise RequestError(
            f"prompt list length {len(items)} exceeds the maximum allowed count "
            f"of {cfg.max_inputs}",
            param="prompt",
        )
    return texts_with_counts(items, "prompt")


class Piece(msgspec.Struct, frozen=True):
    """Text streamed after ``delay_s``: one chunk."""

    delay_s: float
    text: str


class CompletionChoice(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt's answer. The last piece carries the finish reason.

    Attributes:
        pieces: One per chunk (at least one).
        finish_reason: ``stop`` or ``length``.
        stop_reason: The stop string that ended it, else None.
        prompt_tokens: The prompt's toy-tokenizer count.
        completion_tokens: Generated tokens (the end-of-sequence token
            counts, as in vLLM).
    """

    pieces: tuple[Piece, ...]
    finish_reason: str
    stop_reason: str | None
    prompt_tokens: int
    completion_tokens: int

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)

    @property
    def total_delay_s(self) -> float:
        return sum(p.delay_s for p in self.pieces)


class CompletionScript(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the simulated model produces for one completions request."""

    completion_id: str
    model: str
    config: SimConfig
    choices: tuple[CompletionChoice, ...]

    @property
    def prompt_tokens(self) -> int:
        return sum(c.prompt_tokens for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    @property
    def total_delay_s(self) -> float:
        """The prompts are generated side by side: the slowest one's time."""
        return max(c.total_delay_s for c in self.choices)


def _stops(request: CompletionRequest) -> list[str]:
    stop = request.stop
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


def _choice(
    prompt: str, prompt_tokens: int, request: CompletionRequest, cfg: SimConfig, model: str
) -> CompletionChoice:
    chat = ChatRequest(
        model=model,
        messages=[Message(role="user", content=prompt)],
        max_tokens=request.max_tokens,
    )
    script = build_script(chat, cfg)
    # No tools and no reasoning: every step is a content token.
    steps = [s for s in script.steps if isinstance(s, ContentToken)]
    texts = [s.text for s in steps]
    delays = [s.delay_s for s in steps]
    full = "".join(texts)
    hits = [(full.find(s), s) for s in _stops(request) if s in full]
    echo = prompt if request.echo else ""

    if hits:
        start, stop = min(hits)
        end = start + len(stop)
        pieces: list[Piece] = []
        offset = 0
        last = 0  # index of the token in which the stop string completes
        for i, text in enumerate(texts):
            if offset + len(text) <= start:
                pieces.append(Piece(delays[i], text))
            if offset + len(text) >= end:
                last = i
                break
            offset += len(text)
        emitted = sum(len(p.text) for p in pieces)
        held_delay = sum(delays[len(pieces) : last + 1])
        pieces.append(Piece(held_delay, full[emitted:start]))
        finish, stop_reason, generated = "stop", stop, last + 1
    elif script.capped:
        pieces = [Piece(d, t) for d, t in zip(delays, texts, strict=True)]
        finish, stop_reason, generated = FinishReason.LENGTH.value, None, len(texts)
    else:
        pieces = [Piece(d, t) for d, t in zip(delays, texts, strict=True)]
        # The end-of-sequence token: no text, the finish reason.
        pieces.append(Piece(script.finish_delay_s, ""))
        finish, stop_reason, generated = script.finish_reason.value, None, len(texts) + 1
    if echo:
        pieces[0] = Piece(pieces[0].delay_s, echo + pieces[0].text)
    return CompletionChoice(
        pieces=tuple(pieces),
        finish_reason=finish,
        stop_reason=stop_reason,
        prompt_tokens=prompt_tokens,
        completion_tokens=generated,
    )


def build_completion_script(request: CompletionRequest, config: SimConfig) -> CompletionScript:
    """Decide, deterministically, what the simulated model completes.

    Raises:
        RequestError: Invalid ``iop_sim`` overrides or prompts, or
            ``max_tokens`` below 1.
    """
    cfg = msgspec.structs.replace(apply_overrides(request.extra_body, config), reasoning_tokens=0)
    model = request.model or config.model
    prompts = completion_prompts(request, cfg)
    choices = tuple(_choice(p, n, request, cfg, model) for p, n in prompts)
    digest = hashlib.sha256(_encode([cfg.seed, model, [p for p, _ in prompts]])).hexdigest()
    return CompletionScript(
        completion_id="cmpl-" + digest[:32], model=model, config=cfg, choices=choices
    )


def _usage(script: CompletionScript) -> dict[str, Any]:
    prompt, completion = script.prompt_tokens, script.completion_tokens
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }


def completion_stream_plan(
    script: CompletionScript, *, created: int, include_usage: bool
) -> StreamPlan:
    """The streamed response, with the injected failure if any.

    Failures strike after ``fail_after_tokens`` chunks (before the last
    chunk if the answer is shorter); ``http_*`` failures are not stream
    failures: check ``injected_http_error`` first.
    """
    head = (
        b'data: {"id":'
        + _encode(script.completion_id)
        + b',"object":"text_completion","created":'
        + str(created).encode()
        + b',"model":'
        + _encode(script.model)
    )
    chunks: list[Frame] = []
    rounds = max(len(c.pieces) for c in script.choices)
    for r in range(rounds):
        live = [(i, c) for i, c in enumerate(script.choices) if r < len(c.pieces)]
        delay = max(c.pieces[r].delay_s for _, c in live)
        for k, (index, choice) in enumerate(live):
            final = r == len(choice.pieces) - 1
            body = {
                "index": index,
                "text": choice.pieces[r].text,
                "logprobs": None,
                "finish_reason": choice.finish_reason if final else None,
                "stop_reason": choice.stop_reason if final else None,
                "prompt_token_ids": None,
                "token_ids": None,
            }
            data = head + b',"choices":[' + _encode(body) + b"]}\n\n"
            chunks.append(Frame(delay if k == 0 else 0.0, data))

    cfg = script.config
    if cfg.failure == "stall_before_first_byte":
        return StreamPlan((), Ending.STALL)
    fail_at = min(max(cfg.fail_after_tokens, 0), len(chunks) - 1)
    frames: list[Frame] = []
    for i, frame in enumerate(chunks):
        if i == fail_at:
            ending = inject_failure(frames, cfg.failure, frame.delay_s)
            if ending is not None:
                return StreamPlan(tuple(frames), ending)
        frames.append(frame)
    if include_usage:
        usage = head + b',"choices":[],"usage":' + _encode(_usage(script)) + b"}\n\n"
        frames.append(Frame(0.0, usage))
    frames.append(Frame(0.0, DONE))
    return StreamPlan(tuple(frames), Ending.DONE)


def completion_text_body(script: CompletionScript, *, created: int) -> bytes:
    """vLLM's non-streaming ``text_completion`` body (``model_dump`` field order)."""
    choices = [
        {
            "index": index,
            "text": c.text,
            "logprobs": None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "token_ids": None,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
        }
        for index, c in enumerate(script.choices)
    ]
    body = {
        "id": script.completion_id,
        "object": "text_completion",
        "created": created,
        "model": script.model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {**_usage(script), "prompt_tokens_details": None},
        "kv_transfer_params": None,
    }
    return _encode(body)
