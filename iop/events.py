"""RuntimeEvents: what a run produces, from the adapter to the client.

A run emits, in order::

    Start  Output*  Terminal

where Terminal is exactly one of ``Complete``, ``Error`` or ``Cancelled``. The
runtime (``iop.runtime``) enforces that grammar; adapters only push events.
An ``Error`` may also come without a ``Start`` when a run fails before the
adapter reached its backend. What the output is depends on the run's
operation (``iop.spec.Operation``):

=============  ==============================================================
``chat``       ``(Delta | ReasoningDelta)*``
``completion``  ``Delta*`` (the completion's text)
``embedding``  ``EmbeddingData*``: one per input, in input order (``index``
               0..n-1), then ``Complete`` with the prompt tokens in usage
``tokenize``   ``TokenCount`` once, then ``Complete``
=============  ==============================================================

Every output event is one unit of the link's credit (``docs/protocol.md``),
and the first one ends the run's first-token phase and forbids failover,
whatever its type. An embedding is one event per input so that no frame
grows with the batch: 2048 inputs of 4096 dimensions are 32 MiB of float32,
one input's vector 16 KiB (the node cuts batches into frames that fit).

Events are frozen ``msgspec.Struct``s forming one tagged union (tag field
``"type"``), so they cross the edge-node link as they are and are dispatched
by type, never by string keys. Don't subclass them.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from typing import Final

import msgspec

# CancelReason lives beside ErrorCode (both are codes of how a run ended) and
# is part of this module's vocabulary: ``Cancelled.reason``.
from iop.errors import CancelReason, ErrorCode

__all__ = [
    "MAX_USAGE_TOKENS",
    "TERMINAL_EVENT_TYPES",
    "CancelReason",
    "Cancelled",
    "Complete",
    "Delta",
    "EmbeddingData",
    "Error",
    "FinishReason",
    "OutputEvent",
    "ReasoningDelta",
    "RuntimeEvent",
    "Start",
    "TerminalEvent",
    "TokenCount",
    "ToolCall",
    "Usage",
    "is_terminal",
]


class FinishReason(enum.StrEnum):
    """Why generation stopped, in OpenAI's vocabulary."""

    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    CONTENT_FILTER = "content_filter"
    FUNCTION_CALL = "function_call"


MAX_USAGE_TOKENS: Final = 2**40
"""The largest token count a run's outcome keeps. No run uses a trillion
tokens; a backend that says so lies, and its count, times a price and
summed over a day, must still fit the usage ledger's SQLite integers
(``iop.ledger``: at most 2**63 - 1)."""


class Usage(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Token counts for a run.

    Attributes:
        input_tokens: Prompt tokens.
        output_tokens: Completion tokens (reasoning included, as OpenAI counts).
        cached_input_tokens: Prompt tokens served from the prefix cache.
        reasoning_tokens: Completion tokens spent on reasoning.
        estimated: True when the backend reported no usage and the counts were
            estimated from the stream (one token per streamed chunk).
    """

    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    reasoning_tokens: int = 0
    estimated: bool = False

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def bounded(self) -> Usage:
        """These counts, each within 0 … ``MAX_USAGE_TOKENS``: a backend's
        negative count is none, an absurd one the most the counters, the
        usage ledger and the limits can take (``Run`` applies it to every
        run's outcome)."""
        counts = (
            self.input_tokens,
            self.output_tokens,
            self.cached_input_tokens,
            self.reasoning_tokens,
        )
        if all(0 <= n <= MAX_USAGE_TOKENS for n in counts):
            return self
        i, o, c, r = (min(max(n, 0), MAX_USAGE_TOKENS) for n in counts)
        return Usage(
            input_tokens=i,
            output_tokens=o,
            cached_input_tokens=c,
            reasoning_tokens=r,
            estimated=self.estimated,
        )


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """One complete tool call.

    Attributes:
        id: The call id (backend's, or synthesised when the backend gave none).
        name: The function name.
        arguments: The arguments as JSON text, exactly as the model produced them.
        index: Position among the calls of one message.
    """

    id: str
    name: str
    arguments: str = ""
    index: int = 0


class Start(msgspec.Struct, frozen=True, kw_only=True, tag="start", tag_field="type"):
    """The adapter accepted the run and is about to call its backend.

    Attributes:
        target: The backend model the run is served by.
    """

    target: str = ""


class Delta(msgspec.Struct, frozen=True, tag="delta", tag_field="type"):
    """A fragment of the answer's content."""

    text: str


class ReasoningDelta(msgspec.Struct, frozen=True, tag="reasoning_delta", tag_field="type"):
    """A fragment of the model's reasoning."""

    text: str


class EmbeddingData(msgspec.Struct, frozen=True, kw_only=True, tag="embedding", tag_field="type"):
    """The vector of one input of an embedding run.

    Attributes:
        index: The input's position in the request (0..n-1, sent in order).
        vector: The components as little-endian float32 bytes (4 per
            component): exact for the float32 a model computes, a quarter
            of a JSON or float64 msgpack encoding, and already what
            OpenAI's ``encoding_format: "base64"`` sends.
    """

    index: int
    vector: bytes

    @classmethod
    def of(cls, index: int, floats: Sequence[float]) -> EmbeddingData:
        """The event for ``floats`` (rounded to float32)."""
        return cls(index=index, vector=struct.pack(f"<{len(floats)}f", *floats))

    def floats(self) -> list[float]:
        """The components as Python floats (float32 values)."""
        return list(struct.unpack(f"<{len(self.vector) // 4}f", self.vector))


class TokenCount(msgspec.Struct, frozen=True, kw_only=True, tag="token_count", tag_field="type"):
    """The answer of a tokenize run.

    Attributes:
        count: Tokens of the prompt or messages.
        estimated: True when the backend has no tokenizer endpoint and the
            count is IOP's estimate (about 4 characters per token).
    """

    count: int
    estimated: bool = False


class Complete(msgspec.Struct, frozen=True, kw_only=True, tag="complete", tag_field="type"):
    """The run finished successfully (terminal).

    Attributes:
        finish_reason: Why generation stopped.
        usage: Token counts.
        tool_calls: Tool calls the backend parsed natively.
        text_tool_fallback: The run used the text-tool fallback: tools were
            described in the prompt and the edge must synthesise tool calls
            from the text.
        malformed_chunks: Chunks the adapter could not decode and skipped.
    """

    finish_reason: FinishReason = FinishReason.STOP
    usage: Usage = Usage()
    tool_calls: tuple[ToolCall, ...] = ()
    text_tool_fallback: bool = False
    malformed_chunks: int = 0


class Error(msgspec.Struct, frozen=True, kw_only=True, tag="error", tag_field="type"):
    """The run failed (terminal).

    Attributes:
        message: Human readable, safe for clients.
        status: The HTTP status that describes the failure.
        code: Stable machine-readable code: an ``iop.errors.ErrorCode``
            where IOP produces it, OpenAI's where the backend's error has
            one (``context_length_exceeded``). A plain ``str`` on the wire, so
            a code this version does not know (a backend's, a newer node's)
            still decodes; compare it with ``ErrorCode`` members.
        param: The request parameter at fault, for OpenAI's error body.
    """

    message: str
    status: int = 502
    code: str = ErrorCode.BACKEND_ERROR
    param: str | None = None


class Cancelled(msgspec.Struct, frozen=True, kw_only=True, tag="cancelled", tag_field="type"):
    """The run was cancelled (terminal).

    Attributes:
        reason: What cancelled it.
        message: Human readable detail.
        usage: What the run had produced when it was cancelled (estimated).
    """

    reason: CancelReason
    message: str = ""
    usage: Usage = Usage()


RuntimeEvent = (
    Start | Delta | ReasoningDelta | EmbeddingData | TokenCount | Complete | Error | Cancelled
)
OutputEvent = Delta | ReasoningDelta | EmbeddingData | TokenCount
"""The events between ``Start`` and the terminal one."""
TerminalEvent = Complete | Error | Cancelled

TERMINAL_EVENT_TYPES: Final = (Complete, Error, Cancelled)
_TERMINAL_TYPES: Final = frozenset(TERMINAL_EVENT_TYPES)


def is_terminal(event: RuntimeEvent) -> bool:
    """Return True for the events that end a run.

    A set lookup of the event's type, not ``isinstance``: against a msgspec
    ``Struct`` class, ``isinstance`` goes through the metaclass's
    ``__instancecheck__`` (``StructMeta`` is not ``type``), several times
    slower, and this runs a few times per event on each side of the link
    (docs/benchmarks.md, "Per chunk and non-streaming (second pass)"). The
    event types have no subclasses (``tests/test_events.py`` checks it).
    """
    return type(event) in _TERMINAL_TYPES
