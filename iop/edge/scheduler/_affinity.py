"""Session affinity: the key of the conversation a request belongs to.

A run whose conversation was served before by an instance that still has a
free slot goes there again, so the backend's prefix cache holds the
prompt's head (``Scheduler``); a conversation is its tenant's alone unless
tenants share their caches (``scope``).
"""

from __future__ import annotations

import hashlib
from typing import Final

import msgspec

from iop.spec import ChatRequest, CompletionRequest, OperationRequest

__all__ = ["affinity_key"]

# Messages of the conversation's head that make its affinity key: the system
# prompt and the first user turn. Agent loops and chats resend them on every
# turn, and they are what a backend's prefix cache holds.
AFFINITY_HEAD_MESSAGES: Final = 2
# The head of a legacy completion's prompt that makes its key: 2048
# characters (or 512 token ids) hold a shared instruction or few-shot
# preamble, what a prefix cache would reuse, and prompts that differ there
# spread across instances like unrelated conversations.
AFFINITY_PROMPT_HEAD_CHARS: Final = 2048
AFFINITY_PROMPT_HEAD_IDS: Final = 512


def affinity_key(
    request: OperationRequest, scope: str = "", *, session: str = "", tenant: str = ""
) -> str | None:
    """A stable key for the conversation ``request`` belongs to.

    The client's session key when it has one (``session``: a header, its
    ``prompt_cache_key`` or ``user``, ``iop.api._routing``), else its
    ``user`` field, else a hash of the model and the conversation's head
    messages (chat) or the prompt's head (legacy completions). Embeddings
    and token counts without either have no conversation and no prefix to
    reuse: None. ``scope`` (the run's cache salt: its tenant's,
    ``iop.edge.tenancy._tenants``) comes first, so that another tenant's
    identical head or ``user`` is another conversation; the empty scope is
    the shared cache. A session key is its ``tenant``'s even then: two
    tenants that share their caches do not share session ids (one's
    ``"1"`` is not the other's).
    """
    if session:
        key: str | None = f"session:{len(tenant)}:{tenant}:{request.model}:{session}"
    else:
        key = _unscoped_affinity_key(request)
    if key is None or not scope:
        return key
    return f"{len(scope)}:{scope}:{key}"  # the length keeps any scope unambiguous


def _unscoped_affinity_key(request: OperationRequest) -> str | None:
    user = getattr(request, "user", None)
    if user:
        return f"user:{request.model}:{user}"
    if isinstance(request, CompletionRequest):
        prompt = request.prompt
        cut = (
            prompt[:AFFINITY_PROMPT_HEAD_CHARS]
            if isinstance(prompt, str)
            else prompt[:AFFINITY_PROMPT_HEAD_IDS]
        )
        digest = hashlib.blake2b(msgspec.json.encode([request.model, cut]), digest_size=16)
        return "prompt:" + digest.hexdigest()
    if not isinstance(request, ChatRequest):
        return None
    head = msgspec.json.encode([request.model, request.messages[:AFFINITY_HEAD_MESSAGES]])
    return "head:" + hashlib.blake2b(head, digest_size=16).hexdigest()
