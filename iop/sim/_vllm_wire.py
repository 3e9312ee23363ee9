"""vLLM's OpenAI-compatible wire format, byte for byte (sans-IO).

Encodes a ``SimScript`` the way vLLM's server sends it (docs/architecture.md,
"Facts about the backends: vLLM"; the transcripts
``iop/testing/transcripts/vllm_*.txt``):

* chunks are compact JSON with pydantic's field order: ``id, object,
  created, model, choices``; a choice is ``index, delta, logprobs,
  finish_reason`` (+ ``stop_reason`` on the finish chunk, ``token_ids``
  after the role chunk); the role chunk ``{"role":"assistant","content":""}``
  comes first and carries ``prompt_token_ids``;
* reasoning is the ``reasoning`` delta field (vLLM >= 0.16);
* the usage chunk (``choices: []``, ``prompt_tokens, total_tokens,
  completion_tokens``) only with ``stream_options.include_usage``;
* ``data: [DONE]`` ends every stream, also after an in-stream error, whose
  JSON uses ``json.dumps``'s default separators (vLLM's
  ``create_streaming_error_response``);
* error bodies are the nested ``{"error": {"message", "type", "param",
  "code": <int>}}`` of vLLM >= 0.10.1.

Injected failures (``SimConfig.failure``) change the plan: a ``StreamPlan``
is a list of timed frames plus how the stream ends (``Ending``): after
``[DONE]``, cut short (no ``[DONE]``), or stalled until the client leaves.

Requests are decoded here too, for every endpoint (``decode_request``): the
known fields into the endpoint's Struct, the rest into its ``extra_body``, as
vLLM passes unknown keys on (or dropped, for a Struct without one, as vLLM's
pydantic models do); ``parse_chat_request`` is chat's.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any, Final, TypeVar

import msgspec

from iop.config import SimConfig
from iop.errors import ErrorCode, RequestError
from iop.sim._script import (
    ContentToken,
    ReasoningToken,
    SimScript,
    Step,
    ToolCallBegin,
)
from iop.spec import ChatRequest

__all__ = [
    "MALFORMED_CHUNK",
    "SSE_CONTENT_TYPE",
    "Ending",
    "Frame",
    "StreamPlan",
    "cache_salt",
    "completion_body",
    "error_body",
    "error_type",
    "inject_failure",
    "injected_http_error",
    "model_not_found",
    "models_body",
    "parse_chat_request",
    "request_priority",
    "stream_plan",
    "streaming_error_event",
]

# Starlette appends the charset to StreamingResponse's media type.
SSE_CONTENT_TYPE: Final = "text/event-stream; charset=utf-8"
DONE: Final = b"data: [DONE]\n\n"
MALFORMED_CHUNK: Final = b"data: {not json\n\n"

# vLLM's default --max-model-len for small models; only shown in /v1/models.
MAX_MODEL_LEN: Final = 32768

# The "type" of vLLM's ErrorInfo by status (create_error_response's err_type).
_ERROR_TYPES: Final = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
}

_encode = msgspec.json.encode


class Ending(enum.Enum):
    """How a stream ends after its last frame."""

    DONE = "done"  # the frames end with [DONE]; close normally
    TRUNCATE = "truncate"  # cut short: no [DONE], connection closed
    STALL = "stall"  # silence until the client goes away


class Frame(msgspec.Struct, frozen=True):
    """SSE bytes to send after waiting ``delay_s``."""

    delay_s: float
    data: bytes


class StreamPlan(msgspec.Struct, frozen=True):
    """A whole streamed response: timed frames, then an ending."""

    frames: tuple[Frame, ...]
    ending: Ending

    @property
    def body(self) -> bytes:
        return b"".join(f.data for f in self.frames)


# --- requests -----------------------------------------------------------------------


_S = TypeVar("_S", bound=msgspec.Struct)


@functools.cache
def _fields(kind: type[msgspec.Struct]) -> tuple[frozenset[str], bool]:
    """``kind``'s fields but ``extra_body``, and whether it has ``extra_body``."""
    names = frozenset(f.name for f in msgspec.structs.fields(kind))
    return names - {"extra_body"}, "extra_body" in names


def decode_request(raw: bytes, kind: type[_S]) -> _S:
    """Decode a request body into ``kind``, as vLLM reads every endpoint's.

    Keys ``kind`` declares are converted (``msgspec.convert``, so types are
    checked); the others go into its ``extra_body`` if it has one (vLLM
    passes unknown keys on: ``top_k``, the sim's ``iop_sim``), else they are
    ignored, as vLLM's pydantic models ignore them.

    Raises:
        RequestError: Not JSON, not an object, or a field of the wrong type
            (msgspec's message, which names the field).
    """
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise RequestError(f"invalid JSON body: {exc}") from exc
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    fields, has_extra = _fields(kind)
    known = {k: v for k, v in data.items() if k in fields}
    if has_extra:
        extra = {k: v for k, v in data.items() if k not in fields}
        if extra:
            known["extra_body"] = extra
    try:
        return msgspec.convert(known, kind)
    except msgspec.ValidationError as exc:
        raise RequestError(str(exc)) from exc


def parse_chat_request(raw: bytes) -> ChatRequest:
    """Decode a ``/v1/chat/completions`` body; unknown keys go to ``extra_body``.

    Raises:
        RequestError: Not JSON, not an object, or not a valid request
            (missing ``model``/``messages``, wrong types...).
    """
    request = decode_request(raw, ChatRequest)
    if request.stream_options is not None and not request.stream:
        raise RequestError(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    return request


def request_priority(extra_body: Mapping[str, Any] | None, cfg: SimConfig) -> int:
    """A request's ``priority`` (0 when it has none), checked as vLLM checks
    it: an integer, and non-zero only on a server started with
    ``--scheduling-policy priority`` (docs/operations.md, "Engine
    priority")."""
    if not extra_body or "priority" not in extra_body:
        return 0
    priority = extra_body["priority"]
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise RequestError("Input should be a valid integer", param="priority")
    if priority != 0 and cfg.scheduling_policy != "priority":
        raise RequestError(f"Got priority {priority} but Priority scheduling is not enabled.")
    return priority


def cache_salt(extra_body: Mapping[str, Any] | None) -> str:
    """A request's ``cache_salt`` ("" when it has none), checked as vLLM
    checks it: a non-empty string (``check_cache_salt_support`` since
    https://github.com/vllm-project/vllm/pull/17045).

    Raises:
        RequestError: 400, the salt is not a non-empty string.
    """
    if not extra_body or "cache_salt" not in extra_body:
        return ""
    salt = extra_body["cache_salt"]
    if not isinstance(salt, str) or not salt:
        raise RequestError(
            "Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt"
        )
    return salt


def model_not_found(model: str) -> RequestError:
    """vLLM's 404 for a model it does not serve."""
    return RequestError(
        f"The model `{model}` does not exist.",
        status=404,
        code=ErrorCode.MODEL_NOT_FOUND,
        param="model",
    )


# --- errors -------------------------------------------------------------------------


def error_type(status: int) -> str:
    """vLLM's ``ErrorInfo.type`` for a status."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    try:
        return HTTPStatus(status).phrase.replace(" ", "")
    except ValueError:
        return "InternalServerError"


def error_body(
    message: str, *, status: int, type_: str | None = None, param: str | None = None
) -> bytes:
    """vLLM's error body: ``{"error":{"message","type","param","code":<int>}}``."""
    info = {
        "message": message,
        "type": type_ or error_type(status),
        "param": param,
        "code": status,
    }
    return _encode({"error": info})


def streaming_error_event(message: str, *, status: int = 500) -> bytes:
    """An in-stream error event (``json.dumps`` separators, as vLLM writes it)."""
    info = {"message": message, "type": error_type(status), "param": None, "code": status}
    return b"data: " + json.dumps({"error": info}).encode() + b"\n\n"


def injected_http_error(cfg: SimConfig, *, authorization: str = "") -> tuple[int, bytes] | None:
    """Status and body of an injected ``http_500``/``http_429``/``http_401``, else None.

    ``http_401`` echoes ``authorization`` (the request's header) the way
    OpenAI-compatible servers echo a refused key: the test of every place
    a credential must not leak to.
    """
    if cfg.failure == "http_401":
        return 401, error_body(
            f"Incorrect API key provided: {authorization or '(none)'}", status=401
        )
    if cfg.failure == "http_500":
        return 500, error_body("sim: injected failure (http_500)", status=500)
    if cfg.failure == "http_429":
        return 429, error_body("sim: injected failure (http_429): too many requests", status=429)
    return None


# --- streams ------------------------------------------------------------------------


class _Chunks:
    """Pre-encoded chunk templates for one response.

    docs/benchmarks.md, "Earlier measurements: The trio-stack spike".
    """

    def __init__(self, script: SimScript, created: int) -> None:
        head = (
            b'data: {"id":'
            + _encode(script.completion_id)
            + b',"object":"chat.completion.chunk","created":'
            + str(created).encode()
            + b',"model":'
            + _encode(script.model)
        )
        self.head = head
        self._token_prefix = head + b',"choices":[{"index":0,"delta":'
        self._token_suffix = b',"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'

    def role(self) -> bytes:
        return (
            self.head
            + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
            + b'"logprobs":null,"finish_reason":null}],"prompt_token_ids":null}\n\n'
        )

    def token(self, step: Step) -> bytes:
        return self._token_prefix + _delta(step) + self._token_suffix

    def finish(self, reason: str, delta: bytes = b'{"content":""}') -> bytes:
        return (
            self._token_prefix
            + delta
            + b',"logprobs":null,"finish_reason":'
            + _encode(reason)
            + b',"stop_reason":null,"token_ids":null}]}\n\n'
        )

    def usage(self, script: SimScript) -> bytes:
        return self.head + b',"choices":[],"usage":' + _encode(_usage(script)) + b"}\n\n"


def _delta(step: Step) -> bytes:
    if isinstance(step, ContentToken):
        return b'{"content":' + _encode(step.text) + b"}"
    if isinstance(step, ReasoningToken):
        return b'{"reasoning":' + _encode(step.text) + b"}"
    if isinstance(step, ToolCallBegin):
        call = {
            "id": step.id,
            "type": "function",
            "index": 0,
            "function": {"name": step.name},
        }
        return _encode({"tool_calls": [call]})
    return _encode({"tool_calls": [{"index": 0, "function": {"arguments": step.text}}]})


def _usage(script: SimScript) -> dict[str, Any]:
    prompt, completion = script.prompt_tokens, script.completion_tokens
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if script.cached_tokens is not None:
        # vLLM with --enable-prompt-tokens-details: what its prefix cache held.
        usage["prompt_tokens_details"] = {"cached_tokens": script.cached_tokens}
    if script.reasoning_tokens:
        # vLLM main with a reasoning parser (PR #45802; docs/architecture.md,
        # "Facts about the backends: Usage").
        usage["completion_tokens_details"] = {"reasoning_tokens": script.reasoning_tokens}
    return usage


def stream_plan(script: SimScript, *, created: int, include_usage: bool) -> StreamPlan:
    """The streamed response for ``script``, with its injected failure if any.

    The role chunk goes out with the first token (vLLM sends it with the
    first engine output, after prefill). Failures strike after
    ``fail_after_tokens`` token chunks (or before the finish chunk if the
    answer is shorter). ``http_500``/``http_429`` are not stream failures:
    check ``injected_http_error`` first.
    """
    cfg = script.config
    chunks = _Chunks(script, created)
    steps = script.steps
    failure = cfg.failure
    if failure == "stall_before_first_byte":
        return StreamPlan((), Ending.STALL)
    fail_at = min(max(cfg.fail_after_tokens, 0), len(steps))

    frames: list[Frame] = []
    first_delay = steps[0].delay_s if steps else script.finish_delay_s
    frames.append(Frame(first_delay, chunks.role()))
    for i, step in enumerate(steps):
        # The first token's delay (the TTFT) was spent before the role chunk.
        delay = 0.0 if i == 0 else step.delay_s
        if i == fail_at:
            ending = inject_failure(frames, failure, delay)
            if ending is not None:
                return StreamPlan(tuple(frames), ending)
        if script.capped and i == len(steps) - 1:
            frames.append(Frame(delay, chunks.finish(script.finish_reason.value, _delta(step))))
        else:
            frames.append(Frame(delay, chunks.token(step)))
    if fail_at == len(steps):
        tail_delay = 0.0 if script.capped or not steps else script.finish_delay_s
        ending = inject_failure(frames, failure, tail_delay)
        if ending is not None:
            return StreamPlan(tuple(frames), ending)
    if not script.capped:
        delay = script.finish_delay_s if steps else 0.0
        frames.append(Frame(delay, chunks.finish(script.finish_reason.value)))
    if include_usage:
        frames.append(Frame(0.0, chunks.usage(script)))
    frames.append(Frame(0.0, DONE))
    return StreamPlan(tuple(frames), Ending.DONE)


def inject_failure(frames: list[Frame], failure: str, delay: float) -> Ending | None:
    """Append the failure's frames; return the ending if the stream stops here."""
    if failure == "midstream_error":
        frames.append(Frame(delay, streaming_error_event("sim: injected mid-stream error")))
        frames.append(Frame(0.0, DONE))
        return Ending.DONE
    if failure == "truncate":
        return Ending.TRUNCATE
    if failure == "stall_mid_stream":
        return Ending.STALL
    if failure == "malformed_chunk":
        frames.append(Frame(0.0, MALFORMED_CHUNK))
    return None


# --- whole bodies ---------------------------------------------------------------------


def completion_body(script: SimScript, *, created: int) -> bytes:
    """vLLM's non-streaming ``chat.completion`` body (``model_dump`` field order)."""
    call = script.tool_call
    content = script.content
    reasoning = script.reasoning
    message = {
        "role": "assistant",
        "content": content if content or call is None else None,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": (
            []
            if call is None
            else [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ]
        ),
        "reasoning": reasoning or None,
    }
    usage = _usage(script)
    # model_dump of UsageInfo: prompt_tokens_details comes before the
    # completion details and is null without --enable-prompt-tokens-details.
    details = usage.pop("completion_tokens_details", None)
    usage["prompt_tokens_details"] = usage.pop("prompt_tokens_details", None)
    if details is not None:
        usage["completion_tokens_details"] = details
    body = {
        "id": script.completion_id,
        "object": "chat.completion",
        "created": created,
        "model": script.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": script.finish_reason.value,
                "stop_reason": None,
                "token_ids": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "kv_transfer_params": None,
    }
    return _encode(body)


def models_body(model: str, *, created: int) -> bytes:
    """vLLM's ``GET /v1/models`` body for one served model.

    docs/architecture.md, "Facts about the backends: vLLM".
    """
    perm_id = "modelperm-" + hashlib.sha256(model.encode()).hexdigest()[:32]
    card = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": model,
        "parent": None,
        "max_model_len": MAX_MODEL_LEN,
        "permission": [
            {
                "id": perm_id,
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }
    return _encode({"object": "list", "data": [card]})
