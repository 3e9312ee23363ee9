"""The execution spec: what a node is asked to run.

``ChatRequest`` is the full OpenAI chat-completions request, typed: messages
keep their whole shape (assistant tool calls, tool results, content parts), so
nothing the client sent is flattened away before it reaches the backend (seed
003 kept only string role/content; we do not). Ollama-style extensions
(``options``, ``format``, ``think``, ``keep_alive``) ride along, and request
keys IOP does not know are kept in ``extra_body`` and passed through to the
backend (vLLM's ``top_k``, ``chat_template_kwargs``, ...).

All structs are frozen and use ``omit_defaults`` so that what goes to a
backend is exactly what was set.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = [
    "AudioPart",
    "ChatRequest",
    "ContentPart",
    "ExecutionSpec",
    "FilePart",
    "FunctionCall",
    "FunctionDef",
    "ImagePart",
    "Message",
    "MessageToolCall",
    "NamedFunction",
    "NamedToolChoice",
    "RefusalPart",
    "StreamOptions",
    "TextPart",
    "Tool",
    "ToolChoice",
]


class _Base(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    pass


class _Always(msgspec.Struct, frozen=True, kw_only=True):
    """Structs whose defaulted fields must still be sent: servers require
    ``"type": "function"`` (llama.cpp answers 500 "Missing tool type" without
    it) and an assistant call's ``arguments`` even when empty."""


# --- content parts (OpenAI ChatCompletionRequestMessageContentPart*) ---------


class TextPart(_Base, frozen=True, tag="text", tag_field="type"):
    text: str


class ImageURL(_Base, frozen=True):
    url: str
    detail: str | None = None


class ImagePart(_Base, frozen=True, tag="image_url", tag_field="type"):
    image_url: ImageURL


class InputAudio(_Base, frozen=True):
    data: str
    format: str


class AudioPart(_Base, frozen=True, tag="input_audio", tag_field="type"):
    input_audio: InputAudio


class FileRef(_Base, frozen=True):
    file_data: str | None = None
    file_id: str | None = None
    filename: str | None = None


class FilePart(_Base, frozen=True, tag="file", tag_field="type"):
    file: FileRef


class RefusalPart(_Base, frozen=True, tag="refusal", tag_field="type"):
    refusal: str


ContentPart = TextPart | ImagePart | AudioPart | FilePart | RefusalPart


# --- messages -----------------------------------------------------------------


class FunctionCall(_Always, frozen=True):
    name: str
    arguments: str = ""


class MessageToolCall(_Always, frozen=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class Message(_Base, frozen=True):
    """One chat message of any role.

    ``content`` is a string, a list of parts, or None (an assistant message
    that only calls tools). ``tool_calls`` is set on assistant messages,
    ``tool_call_id`` on tool results.
    """

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        """The message's text: the string content, or its text parts joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


# --- tools --------------------------------------------------------------------


class FunctionDef(_Base, frozen=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Always, frozen=True):
    function: FunctionDef
    type: Literal["function"] = "function"


class NamedFunction(_Base, frozen=True):
    name: str


class NamedToolChoice(_Always, frozen=True):
    function: NamedFunction
    type: Literal["function"] = "function"


# "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
ToolChoice = str | NamedToolChoice


class StreamOptions(_Base, frozen=True):
    include_usage: bool | None = None


# --- the request ----------------------------------------------------------------


class ChatRequest(_Base, frozen=True):
    """An OpenAI chat-completions request, plus Ollama-style extensions."""

    model: str
    messages: list[Message]
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    user: str | None = None
    # Ollama-style extensions, passed through by the adapters (seed 003).
    options: dict[str, Any] | None = None
    format: Any = None
    think: bool | str | None = None
    keep_alive: str | int | float | None = None
    # Keys of the client's request that IOP does not model, passed through.
    extra_body: dict[str, Any] | None = None

    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools or ()]


class ExecutionSpec(_Base, frozen=True):
    """One run, as a node receives it.

    Attributes:
        run_id: Unique id of the run (also the completion id's suffix).
        target: The backend model to run on; empty means ``request.model``.
        request: The client's request.
    """

    run_id: str
    request: ChatRequest
    target: str = ""

    @property
    def model(self) -> str:
        """The model name to send to the backend."""
        return self.target.strip() or self.request.model.strip()
