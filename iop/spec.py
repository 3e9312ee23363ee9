"""The execution spec: what a node is asked to run.

``ChatRequest`` is the full OpenAI chat-completions request, typed: messages
keep their whole shape (assistant tool calls, tool results, content parts), so
nothing the client sent is flattened away before it reaches the backend (seed
003 kept only string role/content; we do not). Ollama-style extensions
(``options``, ``format``, ``think``, ``keep_alive``) ride along, and request
keys IOP does not know are kept in ``extra_body`` and passed through to the
backend (vLLM's ``top_k``, ``chat_template_kwargs``, ...).

A run is one *operation* (``Operation``): a chat completion
(``ChatRequest``), a legacy text completion (``CompletionRequest``), an
embedding of inputs (``EmbeddingRequest``) or a token count
(``TokenizeRequest``, for Anthropic's ``count_tokens``).
``ExecutionSpec.request`` is one of them: a tagged union on the link (tag
field ``"op"``, see ``docs/protocol.md``).

All structs are frozen and use ``omit_defaults`` so that what goes to a
backend is exactly what was set.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec

__all__ = [
    "OPERATIONS",
    "AudioPart",
    "ChatRequest",
    "CompletionRequest",
    "ContentPart",
    "EmbeddingInput",
    "EmbeddingRequest",
    "ExecutionSpec",
    "FilePart",
    "FunctionCall",
    "FunctionDef",
    "ImagePart",
    "Message",
    "MessageToolCall",
    "NamedFunction",
    "NamedToolChoice",
    "Operation",
    "OperationRequest",
    "Prompt",
    "RefusalPart",
    "Routing",
    "StreamOptions",
    "TextPart",
    "TokenizeRequest",
    "Tool",
    "ToolChoice",
    "operation_of",
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


class Routing(_Base, frozen=True):
    """What a client said about where its run belongs in the edge's queue.

    Read by the API surfaces from the request's headers and body
    (``iop.api._routing``), used by the edge's scheduler and never sent to
    a node or a backend (``EdgeCore.start_run`` takes it off the request).

    Attributes:
        session: The client's session key ("" for none): the conversation
            or agent session a run belongs to, for affinity and fair
            queueing between a tenant's sessions (docs/operations.md,
            "Sessions and objectives").
        session_from: Where ``session`` came from (a header's name,
            ``prompt_cache_key``, ``metadata.user_id`` or ``user``).
        objective: The named objective the client asked for ("" for its
            tenant's default).
        objective_from: The alias header ``objective`` came from, for an
            error that names it ("": ``x-iop-objective``, the first of
            ``iop.api._routing.OBJECTIVE_HEADERS``).
        ttft_deadline_s: A time-to-first-token deadline that overrides the
            objective's (``x-llm-d-slo-ttft-ms``).
    """

    session: str = ""
    session_from: str = ""
    objective: str = ""
    objective_from: str = ""
    ttft_deadline_s: float | None = None


# --- the request ----------------------------------------------------------------


class ChatRequest(_Base, frozen=True, tag="chat", tag_field="op"):
    """An OpenAI chat-completions request, plus Ollama-style extensions.

    Tagged ``"op": "chat"`` on the link. Decoded on its own (a client's
    body) the tag may be absent; a client body whose ``op`` is not ``"chat"``
    does not decode (a 400 naming ``op``).
    """

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
    # The edge's, from the request's headers (``Routing``): never sent on.
    routing: Routing | None = None

    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools or ()]


# A legacy completions prompt: text, or token ids (OpenAI's
# CreateCompletionRequest also takes lists of them: the surface sends one
# prompt per run, see ``iop.api.completions``).
Prompt = str | list[int]


class CompletionRequest(_Base, frozen=True, tag="completion", tag_field="op"):
    """A legacy ``/v1/completions`` request: one prompt in, text out.

    Streams like chat: ``Start Delta* Complete``. ``echo`` and ``logprobs``
    are passed to the backend, which may refuse them; ``extra_body`` holds
    the keys IOP does not model (vLLM's ``top_k``...), passed through.
    """

    model: str
    prompt: Prompt
    stream: bool = False
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
    extra_body: dict[str, Any] | None = None
    routing: Routing | None = None


# One ``/v1/embeddings`` input: text or token ids.
EmbeddingInput = str | list[int]


class EmbeddingRequest(_Base, frozen=True, tag="embedding", tag_field="op"):
    """An ``/v1/embeddings`` request: each input becomes one vector.

    ``inputs`` is always a list (OpenAI's single string or single id list is
    one input). The node always asks its backend for floats; the edge
    encodes them as the client asked (``encoding_format``), so the event
    carries float32 bytes either way.
    """

    model: str
    inputs: list[EmbeddingInput]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    extra_body: dict[str, Any] | None = None
    routing: Routing | None = None


class TokenizeRequest(_Base, frozen=True, tag="tokenize", tag_field="op"):
    """Count the tokens of a prompt or of chat messages (Anthropic's
    ``count_tokens``). Exactly one of ``prompt`` and ``messages`` is set;
    ``tools`` are counted with the messages where the backend can.

    Answered ``Start TokenCount Complete``.
    """

    model: str
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[Tool] | None = None


OperationRequest = ChatRequest | CompletionRequest | EmbeddingRequest | TokenizeRequest
"""What a run executes: one of the operations."""

Operation = Literal["chat", "completion", "embedding", "tokenize"]
"""An operation's name: its request's tag, and what ``Capabilities.operations`` lists."""

OPERATIONS: Final[tuple[Operation, ...]] = ("chat", "completion", "embedding", "tokenize")


def operation_of(request: OperationRequest) -> Operation:
    """The operation ``request`` asks for (its tag)."""
    if isinstance(request, CompletionRequest):
        return "completion"
    if isinstance(request, EmbeddingRequest):
        return "embedding"
    if isinstance(request, TokenizeRequest):
        return "tokenize"
    return "chat"


class ExecutionSpec(_Base, frozen=True):
    """One run, as a node receives it.

    Attributes:
        run_id: Unique id of the run (also the completion id's suffix).
        target: The backend model to run on; empty means ``request.model``.
        request: The operation and its request (a tagged union: ``"op"``).
        traceparent: The W3C trace context the run belongs to (the edge's
            attempt span, or the client's context when the edge does not
            trace; ``iop.tracing``); empty when there is none.
        cache_salt: The backend prefix cache the run may use and fill:
            runs of one salt share it, runs of another never do (vLLM's
            per-request ``cache_salt``). The edge's digest of the run's
            tenant (``iop.edge.tenancy._tenants``), never its name or key; empty:
            no salt (a tenant that shares its cache, or an edge with one
            tenant). Adapters of backends that isolate per request send it;
            the others ignore it.
        priority: The run's objective priority (higher is more important;
            docs/operations.md, "Sessions and objectives"), for an engine
            that schedules by it; None: the edge sends none (the instance
            does not advertise ``engine_priority``). An adapter passes it on
            only when its instance has ``engine_priority`` set
            (docs/operations.md, "Engine priority").
        overflow: The edge placed the run on an *overflow* seat beyond the
            instance's slots, counting on the engine to preempt a run of a
            lower priority for it (``scheduler.priority_overflow_slots``):
            the node runs it at once instead of queueing it
            (``iop.node._slots``). Added after the first release: an older
            peer sends neither field and ignores both.
    """

    run_id: str
    request: OperationRequest
    target: str = ""
    traceparent: str = ""
    cache_salt: str = ""
    priority: int | None = None
    overflow: bool = False

    @property
    def operation(self) -> Operation:
        """Which operation the run is (``chat``, ``completion``...)."""
        return operation_of(self.request)

    @property
    def model(self) -> str:
        """The model name to send to the backend."""
        return self.target.strip() or self.request.model.strip()
