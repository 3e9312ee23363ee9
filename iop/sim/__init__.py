"""The deterministic simulated backend (``sim``), for tests, benchmarks and research.

* ``build_script`` (sans-IO) decides what the simulated model says for a
  request and when: reasoning, content, tool calls, usage, delays.
* The ``_vllm_wire`` encoders (sans-IO) turn a script into vLLM's exact bytes,
  with injected failures.
* ``create_sim_app``/``serve_sim`` serve it over HTTP (``iop sim``); the
  ``sim`` adapter (``iop.adapters.sim``) plays it in-process, with no HTTP.

The server's names are imported lazily, on first use, so that importing the
sans-IO modules (``iop.sim._script``, ``iop.sim._vllm_wire``) pulls in no IO
library (trio, quart, hypercorn).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from iop.sim._script import (
    AUTO_TOOL_CHOICE_ERROR,
    SIM_OVERRIDE_KEY,
    ContentToken,
    ReasoningToken,
    ScriptToolCall,
    SimFile,
    SimScript,
    Step,
    ToolArgs,
    ToolCallBegin,
    build_script,
    effective_config,
    estimate_prompt_tokens,
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
    "MAX_REQUEST_BYTES",
    "SIM_OVERRIDE_KEY",
    "ContentToken",
    "Ending",
    "Frame",
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
    "build_script",
    "completion_body",
    "create_sim_app",
    "effective_config",
    "error_body",
    "estimate_prompt_tokens",
    "models_body",
    "parse_chat_request",
    "serve_sim",
    "stream_plan",
    "streaming_error_event",
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
