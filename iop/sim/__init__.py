"""The deterministic simulated backend (``sim``), for tests, benchmarks and research.

* ``build_script`` (sans-IO) decides what the simulated model says for a
  request and when: reasoning, content, tool calls, usage, delays.
* The ``_vllm_wire`` encoders (sans-IO) turn a script into vLLM's exact bytes,
  with injected failures.
* ``build_completion_script`` and its encoders (sans-IO) do the same for
  the legacy ``/v1/completions``; ``embedding_vector``/``embedding_body``
  (sans-IO) compute ``/v1/embeddings``; ``tokenize``/``detokenize`` are the
  toy tokenizer behind ``/tokenize``, ``/detokenize`` and the prompt counts.
* ``create_sim_app``/``serve_sim`` serve it over HTTP (``iop sim``); the
  ``sim`` adapter (``iop.adapters.sim``) plays it in-process, with no HTTP.

The server's names are imported lazily, on first use, so that importing the
sans-IO names (everything but the server's) pulls in no IO library
(trio, quart, hypercorn, httpx).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from iop.sim._completions import (
    DEFAULT_MAX_TOKENS,
    CompletionChoice,
    CompletionRequest,
    CompletionScript,
    Piece,
    build_completion_script,
    completion_prompts,
    completion_stream_plan,
    completion_text_body,
    parse_completion_request,
)
from iop.sim._embeddings import (
    EmbeddingRequest,
    check_embedding_request,
    embedding_body,
    embedding_inputs,
    embedding_vector,
    parse_embedding_request,
)
from iop.sim._script import (
    AUTO_TOOL_CHOICE_ERROR,
    SIM_OVERRIDE_KEY,
    TOOL_RESULT_QUOTE_CHARS,
    ContentToken,
    ReasoningToken,
    ScriptToolCall,
    SimFile,
    SimScript,
    Step,
    ToolArgs,
    ToolCallBegin,
    apply_overrides,
    build_script,
    effective_config,
    estimate_prompt_tokens,
)
from iop.sim._tokenize_api import detokenize_body, tokenize_body
from iop.sim._tokenizer import (
    MAX_TOKEN_ID,
    detokenize,
    render_chat,
    token_strs,
    tokenize,
    tokenize_chat,
)
from iop.sim._vllm_wire import (
    Ending,
    Frame,
    StreamPlan,
    completion_body,
    error_body,
    models_body,
    parse_chat_request,
    stream_plan,
    streaming_error_event,
)

__all__ = [
    "AUTO_TOOL_CHOICE_ERROR",
    "DEFAULT_MAX_TOKENS",
    "MAX_REQUEST_BYTES",
    "MAX_TOKEN_ID",
    "SIM_OVERRIDE_KEY",
    "TOOL_RESULT_QUOTE_CHARS",
    "CompletionChoice",
    "CompletionRequest",
    "CompletionScript",
    "ContentToken",
    "EmbeddingRequest",
    "Ending",
    "Frame",
    "Piece",
    "ReasoningToken",
    "ScriptToolCall",
    "SimApp",
    "SimFile",
    "SimScript",
    "SimStats",
    "Step",
    "StreamPlan",
    "ToolArgs",
    "ToolCallBegin",
    "apply_overrides",
    "build_completion_script",
    "build_script",
    "check_embedding_request",
    "completion_body",
    "completion_prompts",
    "completion_stream_plan",
    "completion_text_body",
    "create_sim_app",
    "detokenize",
    "detokenize_body",
    "effective_config",
    "embedding_body",
    "embedding_inputs",
    "embedding_vector",
    "error_body",
    "estimate_prompt_tokens",
    "models_body",
    "parse_chat_request",
    "parse_completion_request",
    "parse_embedding_request",
    "render_chat",
    "serve_sim",
    "stream_plan",
    "streaming_error_event",
    "token_strs",
    "tokenize",
    "tokenize_body",
    "tokenize_chat",
]

if TYPE_CHECKING:
    from iop.sim._server import MAX_REQUEST_BYTES, SimApp, SimStats, create_sim_app, serve_sim

_SERVER_NAMES = frozenset(
    {"MAX_REQUEST_BYTES", "SimApp", "SimStats", "create_sim_app", "serve_sim"}
)


def __getattr__(name: str) -> Any:
    if name in _SERVER_NAMES:
        from iop.sim import _server

        return getattr(_server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
