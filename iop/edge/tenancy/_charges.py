"""What a run's tenant reserves before it runs and is charged when it ends.

``estimate_tokens`` is a request's reservation against its tenant's
tokens-per-minute (its prompt, estimated as ``count_tokens`` does, plus the
output it may produce); ``charged_usage`` is what the tenant pays for a run
by its outcome (the table in ``iop/runtime/_run.py``, "What a ``Cancelled``
run used"). Sans-IO.
"""

from __future__ import annotations

import math
from typing import Final

from iop.api import estimate_input_tokens
from iop.events import Cancelled, Complete, Error, Usage
from iop.spec import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    Operation,
    OperationRequest,
    TokenizeRequest,
)

__all__ = ["charged_usage", "estimate_prompt_tokens", "estimate_tokens"]

# The chars-per-token ratio of iop.api.messages._tokens, for prompts that are
# not chat messages.
_CHARS_PER_TOKEN: Final = 4


def estimate_tokens(request: OperationRequest, default_max_tokens: int) -> int:
    """What a request reserves against ``tokens_per_minute``: its prompt
    (``estimate_prompt_tokens``) plus the output it may produce."""
    prompt = estimate_prompt_tokens(request)
    if isinstance(request, ChatRequest):
        return prompt + (request.max_completion_tokens or request.max_tokens or default_max_tokens)
    if isinstance(request, CompletionRequest):
        return prompt + (request.max_tokens or default_max_tokens)
    return prompt


def estimate_prompt_tokens(request: OperationRequest) -> int:
    """A request's prompt, estimated as ``count_tokens`` does (docs/api.md,
    "count_tokens"): what it reserves, and what it is charged for its prompt
    when it is cancelled after its first output (``iop.runtime``'s
    ``Run.prompt_tokens``). A token count's is 0: it generates nothing, so
    it reserves and is charged no tokens."""
    if isinstance(request, ChatRequest):
        return estimate_input_tokens(request)
    if isinstance(request, CompletionRequest):
        prompt = request.prompt
        # A prompt of token ids is its length in tokens.
        return math.ceil(len(prompt) / _CHARS_PER_TOKEN) if isinstance(prompt, str) else len(prompt)
    if isinstance(request, EmbeddingRequest):
        return sum(
            math.ceil(len(i) / _CHARS_PER_TOKEN) if isinstance(i, str) else len(i)
            for i in request.inputs
        )
    assert isinstance(request, TokenizeRequest)
    return 0


def charged_usage(outcome: object, operation: Operation) -> Usage | None:
    """What a run's tenant is charged: the usage a completed or cancelled run
    reported (a cancelled run's is its prompt once the backend had read it,
    and what it streamed: ``iop.runtime``, "What a ``Cancelled`` run used");
    nothing for a run that failed (the platform's failure, not the tenant's
    use) nor for a token count (it generates nothing); None (the
    reservation stands) when the outcome is unknown."""
    if isinstance(outcome, Complete | Cancelled):
        return Usage() if operation == "tokenize" else outcome.usage
    if isinstance(outcome, Error):
        return Usage()
    return None
