"""``POST /v1/completions`` request parsing (sans-IO).

OpenAI's ``CreateCompletionRequest`` in, a ``CompletionRequest`` (one run's
operation) out, or a 400 worded like OpenAI's with ``param`` set. What maps
where (``docs/api.md``, "Completions"):

* ``prompt``: a string, token ids, or a list of exactly one of them. A run
  answers one prompt (its events carry one text): a list of several prompts
  is a 400 naming ``prompt``, send one request per prompt.
* ``max_tokens``: OpenAI's default of 16 when absent or null, so a backend
  whose own default is "until the context is full" (llama.cpp) answers as
  OpenAI would.
* ``n`` must be 1 (one choice per run); ``logprobs`` is refused (runs carry
  no log probabilities), ``best_of`` above 1 with ``stream`` is OpenAI's
  400. ``echo``, ``suffix``, ``best_of``, ``seed``, penalties and
  ``logit_bias`` are passed on: a backend that does not support one
  answers its own 400, relayed.
* keys OpenAI does not define go to ``extra_body``, passed through (vLLM's
  ``top_k``, the sim's ``iop_sim``).
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from iop.api._json_guard import DEFAULT_MAX_JSON_DEPTH
from iop.api._openai_validation import missing_parameter
from iop.api.completions._errors import decode_object, from_validation, invalid
from iop.spec import CompletionRequest, StreamOptions

__all__ = ["DEFAULT_MAX_TOKENS", "MAX_STOP_SEQUENCES", "ParsedCompletion", "parse_completion"]

# OpenAI's (and vLLM's) default for the legacy endpoint.
DEFAULT_MAX_TOKENS: Final = 16
# OpenAI's limit on ``stop`` sequences.
MAX_STOP_SEQUENCES: Final = 4


class _Body(msgspec.Struct, frozen=True, kw_only=True):
    """The fields of ``CreateCompletionRequest``, typed (msgspec checks them)."""

    model: str
    prompt: str | list[Any] | None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    best_of: int | None = None
    user: str | None = None


_KNOWN: Final = frozenset(_Body.__struct_fields__)


class ParsedCompletion(msgspec.Struct, frozen=True, kw_only=True):
    """A valid request: the run's operation and how to answer it."""

    request: CompletionRequest
    stream: bool
    include_usage: bool


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )


_PROMPT_FORMS: Final = (
    "'prompt' must be a string, an array of strings, an array of integers "
    "or an array of arrays of integers."
)


def _prompt(value: str | list[Any] | None) -> str | list[int]:
    if value is None:
        raise missing_parameter("prompt")
    if isinstance(value, str):
        return value
    if not value:
        raise invalid("'prompt' must not be an empty array.", "prompt")
    if _is_ids(value):
        return list(value)
    if not all(isinstance(v, str) for v in value) and not all(_is_ids(v) for v in value):
        raise invalid(_PROMPT_FORMS, "prompt")
    if len(value) > 1:
        raise invalid(
            f"'prompt' has {len(value)} prompts: IOP runs one prompt per request, "
            "send one request per prompt.",
            "prompt",
        )
    first = value[0]
    if isinstance(first, list) and not first:
        raise invalid("'prompt' must not hold an empty token array.", "prompt")
    return first if isinstance(first, str) else list(first)


def _range(name: str, value: float | None, low: float, high: float) -> None:
    if value is not None and not low <= value <= high:
        raise invalid(
            f"{value!r} is not a valid value for '{name}': it must be between {low:g} and {high:g}.",
            name,
        )


def parse_completion(body: bytes, *, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> ParsedCompletion:
    """Decode and check a ``/v1/completions`` body.

    Raises:
        RequestError: A 400 with OpenAI's wording and ``param``.
    """
    top = decode_object(body, max_depth=max_depth)
    known = {k: v for k, v in top.items() if k in _KNOWN}
    extra: dict[str, Any] = {k: v for k, v in top.items() if k not in _KNOWN}
    if "prompt" not in known:
        raise missing_parameter("prompt")
    try:
        req = msgspec.convert(known, _Body)
    except msgspec.ValidationError as exc:
        raise from_validation(exc) from exc
    if not req.model.strip():
        raise missing_parameter("model")
    prompt = _prompt(req.prompt)
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise invalid(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            "stream_options",
        )
    if req.n is not None and req.n != 1:
        raise invalid("IOP returns one choice per request: 'n' must be 1.", "n")
    if req.logprobs is not None:
        raise invalid(
            "IOP does not return log probabilities: 'logprobs' is not supported.", "logprobs"
        )
    if req.best_of is not None and req.best_of > 1 and stream:
        raise invalid("'best_of' cannot be used with 'stream'.", "best_of")
    if req.max_tokens is not None and req.max_tokens < 0:
        raise invalid(
            f"{req.max_tokens} is less than the minimum of 0 - 'max_tokens'", "max_tokens"
        )
    _range("temperature", req.temperature, 0.0, 2.0)
    _range("top_p", req.top_p, 0.0, 1.0)
    _range("presence_penalty", req.presence_penalty, -2.0, 2.0)
    _range("frequency_penalty", req.frequency_penalty, -2.0, 2.0)
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOP_SEQUENCES:
        raise invalid(
            f"'stop' has {len(req.stop)} sequences; at most {MAX_STOP_SEQUENCES} are allowed.",
            "stop",
        )
    request = CompletionRequest(
        model=req.model,
        prompt=prompt,
        stream=stream,
        max_tokens=DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stop=req.stop,
        seed=req.seed,
        echo=req.echo,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=req.logit_bias,
        suffix=req.suffix,
        best_of=req.best_of,
        user=req.user,
        extra_body=extra or None,
    )
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return ParsedCompletion(request=request, stream=stream, include_usage=include_usage)
