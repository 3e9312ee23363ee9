"""Typed views of what OpenAI-compatible backends stream.

Only the fields IOP reads are declared: msgspec skips the rest without
building objects for them, which makes a typed decode about 8x cheaper than
``json.loads`` (docs/benchmarks.md, "Earlier measurements: The trio-stack
spike"). Every field is optional and tolerant of ``null`` because backends
disagree on what they send (docs/architecture.md, "Facts about the backends").
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "ChatChunk",
    "ChunkChoice",
    "ChunkDelta",
    "ChunkFunction",
    "ChunkToolCall",
    "ChunkUsage",
    "CompletionTokensDetails",
    "PromptTokensDetails",
]


class ChunkFunction(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ChunkToolCall(msgspec.Struct, frozen=True, omit_defaults=True):
    """One entry of ``delta.tool_calls``.

    ``index`` may be missing (some servers), ``id`` may be an integer
    (poolside), and later fragments usually carry only ``index`` and
    ``function.arguments``.
    """

    index: int | None = None
    id: str | int | None = None
    type: str | None = None
    function: ChunkFunction | None = None


class ChunkDelta(msgspec.Struct, frozen=True):
    content: str | None = None
    # vLLM <= 0.11.0, llama.cpp, SGLang: reasoning_content; vLLM >= 0.16 and
    # Ollama: reasoning; vLLM 0.11.1-0.15 sends both (docs/architecture.md,
    # "Facts about the backends: Reasoning fields").
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ChunkToolCall] | None = None

    def reasoning_text(self) -> str:
        """The reasoning fragment, whichever field carried it."""
        return self.reasoning_content or self.reasoning or ""


class ChunkChoice(msgspec.Struct, frozen=True):
    index: int = 0
    delta: ChunkDelta | None = None
    finish_reason: str | None = None
    # A legacy ``/v1/completions`` chunk's text (``text_completion``).
    text: str | None = None


class PromptTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int | None = None


class CompletionTokensDetails(msgspec.Struct, frozen=True):
    reasoning_tokens: int | None = None


class ChunkUsage(msgspec.Struct, frozen=True):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None
    # SGLang puts reasoning_tokens at the top level of usage.
    reasoning_tokens: int | None = None


class ChatChunk(msgspec.Struct, frozen=True):
    """A ``chat.completion.chunk`` (or a ``text_completion`` chunk), or an
    in-stream error object.

    vLLM, SGLang, new llama.cpp and Lemonade report mid-stream failures as
    ``data: {"error": ...}`` (docs/architecture.md, "Facts about the backends:
    SSE framing"), so ``error`` is checked before
    the chunk is treated as one.
    """

    choices: list[ChunkChoice] | None = None
    usage: ChunkUsage | None = None
    error: Any = None
    # llama.cpp adds timings to the last chunk; cache_n is its cached-token count.
    timings: dict[str, Any] | None = None
