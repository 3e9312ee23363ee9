"""``POST /v1/messages/count_tokens``: the answer, and an estimate when no tokenizer is at hand.

Anthropic answers ``{"input_tokens": N}``. The exact count needs the
backend's own tokenizer (llama.cpp and vLLM serve ``/tokenize``); until the
adapters offer that operation, the edge answers with
:func:`estimate_input_tokens` and says so in a response header,
``x-iop-token-count: estimated`` (``exact`` once a tokenizer counted). The
body stays Anthropic's one field: the SDK's ``MessageTokensCount`` would
tolerate more, but other clients (Claude Code's own) need not.

The estimate (``docs/api.md``, "count_tokens"), over the request as the run
would send it (the translated ``ChatRequest``):

* every text the model reads (message text, reasoning passed back, tool
  call names and arguments, tool result text, and each tool's name,
  description and JSON schema) counts ``ceil(chars / 4)``: the usual
  ratio for English text and code under BPE tokenizers;
* every message adds 4 tokens, for its role and the chat template's
  delimiters;
* every image or document adds :data:`IMAGE_TOKENS`, never its base64 size.

It is meant for what clients use it for (is the context nearly full?), not
for billing.
"""

from __future__ import annotations

import math
from typing import Final

import msgspec

from iop.spec import ChatRequest, Message, RefusalPart, TextPart

__all__ = [
    "CHARS_PER_TOKEN",
    "COUNT_HEADER",
    "IMAGE_TOKENS",
    "MESSAGE_TOKENS",
    "count_tokens_response",
    "estimate_input_tokens",
]

CHARS_PER_TOKEN: Final = 4
"""Characters per token of the estimate (BPE tokenizers on English and code)."""

MESSAGE_TOKENS: Final = 4
"""Tokens per message for its role and the template's delimiters (OpenAI's
cookbook counts 3-4 for its chat formats)."""

IMAGE_TOKENS: Final = 1600
"""Tokens per image or document part: Anthropic's ``width * height / 750``
at its 1.15 megapixel cap, the most an image costs there."""

COUNT_HEADER: Final = "x-iop-token-count"
"""Response header saying how the count was made: ``estimated`` or ``exact``."""


class _Count(msgspec.Struct, frozen=True):
    input_tokens: int


def _message_chars(msg: Message) -> tuple[int, int]:
    """Characters of text and number of non-text parts in one message."""
    chars, media = len(msg.reasoning_content or ""), 0
    if isinstance(msg.content, str):
        chars += len(msg.content)
    elif msg.content is not None:
        for part in msg.content:
            if isinstance(part, TextPart):
                chars += len(part.text)
            elif isinstance(part, RefusalPart):
                chars += len(part.refusal)
            else:  # an image, a document (file) or audio
                media += 1
    for call in msg.tool_calls or ():
        chars += len(call.function.name) + len(call.function.arguments)
    return chars, media


def estimate_input_tokens(request: ChatRequest) -> int:
    """The estimated prompt tokens of ``request`` (the module docstring's method)."""
    chars = 0
    media = 0
    for msg in request.messages:
        c, m = _message_chars(msg)
        chars += c
        media += m
    for tool in request.tools or ():
        fn = tool.function
        chars += len(fn.name) + len(fn.description or "")
        if fn.parameters:
            chars += len(msgspec.json.encode(fn.parameters))
    return (
        math.ceil(chars / CHARS_PER_TOKEN)
        + MESSAGE_TOKENS * len(request.messages)
        + IMAGE_TOKENS * media
    )


def count_tokens_response(input_tokens: int, *, estimated: bool) -> tuple[bytes, dict[str, str]]:
    """The body and headers of a count_tokens answer."""
    body = msgspec.json.encode(_Count(input_tokens))
    return body, {COUNT_HEADER: "estimated" if estimated else "exact"}
