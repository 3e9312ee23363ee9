"""Where a request belongs in the edge's queue, from its headers and body (sans-IO).

Every surface's ``parse`` ends with ``with_routing``: the request's
``routing`` (``iop.spec.Routing``) is set from the request alone, and a
``routing`` object a client put in its body is overwritten (it is the
edge's, never the client's to set by body).

The session key is the first of these that is set (docs/api.md, "Sessions
and objectives"):

1. ``x-iop-session-id``, IOP's own header;
2. ``x-llm-d-inference-fairness-id``, llm-d's fairness id
   (https://github.com/llm-d/llm-d-inference-scheduler), an alias;
3. ``x-claude-code-session-id``, which Claude Code sends on every request
   of one session;
4. ``session_id`` or ``session-id``, which Codex sends with its
   conversation's id;
5. the body's ``prompt_cache_key`` (OpenAI's key for requests that share a
   prefix: Chat Completions and legacy completions keep it in
   ``extra_body``; Responses folds it into ``user``);
6. Messages' ``metadata.user_id`` (folded into ``user`` by that surface);
7. the body's ``user``.

The objective is ``x-iop-objective`` or its alias
``x-llm-d-inference-objective``; ``x-llm-d-slo-ttft-ms`` overrides the
objective's time-to-first-token deadline. The edge resolves the name
against its config (``EdgeCore.start_run``): a surface does not know the
config's objectives.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from typing import Final, TypeVar

import msgspec

from iop.errors import ErrorCode, RequestError
from iop.spec import ChatRequest, CompletionRequest, EmbeddingRequest, Routing

__all__ = [
    "MAX_SESSION_CHARS",
    "OBJECTIVE_HEADERS",
    "SESSION_HEADERS",
    "SLO_TTFT_HEADER",
    "routing_of",
    "with_routing",
]

SESSION_HEADERS: Final = (
    "x-iop-session-id",
    "x-llm-d-inference-fairness-id",
    "x-claude-code-session-id",
    "session_id",
    "session-id",
)
"""Headers that carry a session key, first wins (module docstring)."""

OBJECTIVE_HEADERS: Final = ("x-iop-objective", "x-llm-d-inference-objective")
"""Headers that name an objective, first wins."""

SLO_TTFT_HEADER: Final = "x-llm-d-slo-ttft-ms"
"""llm-d's time-to-first-token objective, in milliseconds."""

# A session key the edge keeps as given: 256 characters hold any UUID,
# Claude Code's ``user_..._session_<uuid>`` and a hash; a longer one is kept
# as its digest, so that what the scheduler and timelines hold per session
# is bounded whatever a client sends.
MAX_SESSION_CHARS: Final = 256
# A deadline over a day is no deadline a queue can act on: refused as a typo.
_MAX_TTFT_MS: Final = 86_400_000.0

_Request = TypeVar("_Request", ChatRequest, CompletionRequest, EmbeddingRequest)


def _bounded(session: str) -> str:
    if len(session) <= MAX_SESSION_CHARS:
        return session
    return "blake2b:" + hashlib.blake2b(session.encode(), digest_size=16).hexdigest()


def routing_of(
    headers: Mapping[str, str],
    *,
    prompt_cache_key: object = None,
    user: str | None = None,
    user_from: str = "user",
) -> Routing | None:
    """The run's ``Routing`` from its (lower-cased) headers and body fields.

    Args:
        headers: The request's headers, names lower-cased.
        prompt_cache_key: The body's ``prompt_cache_key`` (used when a string).
        user: The body's user field, after the surface's own mapping.
        user_from: What ``user`` was read from, for the timeline.

    Returns:
        None when the request says nothing of its session or objective.

    Raises:
        RequestError: 400 for an ``x-llm-d-slo-ttft-ms`` that is not a
            positive number of milliseconds (at most a day).
    """
    session, source = "", ""
    for name in SESSION_HEADERS:
        value = headers.get(name, "").strip()
        if value:
            session, source = value, name
            break
    else:
        if isinstance(prompt_cache_key, str) and prompt_cache_key:
            session, source = prompt_cache_key, "prompt_cache_key"
        elif user:
            session, source = user, user_from
    objective, objective_from = "", ""
    for name in OBJECTIVE_HEADERS:
        objective = headers.get(name, "").strip()
        if objective:
            objective_from = name
            break
    deadline = _ttft_deadline(headers.get(SLO_TTFT_HEADER))
    if not session and not objective and deadline is None:
        return None
    return Routing(
        session=_bounded(session),
        session_from=source,
        objective=objective,
        objective_from=objective_from if objective_from != OBJECTIVE_HEADERS[0] else "",
        ttft_deadline_s=deadline,
    )


_DECIMAL: Final = re.compile(r"[0-9]{1,12}(?:\.[0-9]{1,9})?", re.ASCII)


def _ttft_deadline(raw: str | None) -> float | None:
    if raw is None or not raw.strip():
        return None
    # A plain decimal number: float() alone would also take "1_000", "1e3",
    # "+5" and digits of other scripts.
    ms = float(raw) if _DECIMAL.fullmatch(raw.strip()) else math.nan
    if not 0 < ms <= _MAX_TTFT_MS:  # NaN fails too
        raise RequestError(
            f"Invalid header '{SLO_TTFT_HEADER}': {raw!r} is not a number of milliseconds "
            f"in (0, {_MAX_TTFT_MS:.0f}].",
            param=SLO_TTFT_HEADER,
            code=ErrorCode.INVALID_VALUE,
        )
    return ms / 1000.0


def with_routing(
    request: _Request, headers: Mapping[str, str], user_from: str = "user"
) -> _Request:
    """``request`` with its ``routing`` read from ``headers`` and its body fields.

    ``user_from`` names where the surface took ``request.user`` from
    (Messages: ``metadata.user_id``).

    Raises:
        RequestError: 400, see ``routing_of``.
    """
    extra = request.extra_body or {}
    routing = routing_of(
        headers,
        prompt_cache_key=extra.get("prompt_cache_key"),
        user=request.user,
        user_from=user_from,
    )
    if routing == request.routing:
        return request
    return msgspec.structs.replace(request, routing=routing)
