"""What an adapter instance can serve, and how healthy its provider is."""

from __future__ import annotations

import enum
from typing import Final

import msgspec

__all__ = [
    "PROVIDER_DETAIL_MAX_CHARS",
    "Capabilities",
    "ProbeResult",
    "ProviderStatus",
    "normalize_provider_status",
    "provider_detail",
]


class ProviderStatus(enum.StrEnum):
    """Normalised provider status: the only values that leave a node."""

    AVAILABLE = "available"
    UNAVAILABLE = "unavailable"
    DEGRADED = "degraded"
    UNKNOWN = "unknown"


_ALIASES: dict[str, ProviderStatus] = {
    "ok": ProviderStatus.AVAILABLE,
    "up": ProviderStatus.AVAILABLE,
    "ready": ProviderStatus.AVAILABLE,
    "healthy": ProviderStatus.AVAILABLE,
    "down": ProviderStatus.UNAVAILABLE,
    "error": ProviderStatus.UNAVAILABLE,
    "unhealthy": ProviderStatus.UNAVAILABLE,
    "unreachable": ProviderStatus.UNAVAILABLE,
    "loading": ProviderStatus.DEGRADED,
    "busy": ProviderStatus.DEGRADED,
}


def normalize_provider_status(raw: str | ProviderStatus | None) -> ProviderStatus:
    """Map any provider's status word onto the public baseline values.

    Unknown words become ``UNKNOWN`` rather than leaking a provider's
    vocabulary to the edge.
    """
    if raw is None:
        return ProviderStatus.UNKNOWN
    if isinstance(raw, ProviderStatus):
        return raw
    word = raw.strip().lower()
    try:
        return ProviderStatus(word)
    except ValueError:
        return _ALIASES.get(word, ProviderStatus.UNKNOWN)


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What one adapter instance offers, as advertised to the edge.

    Attributes:
        adapter: The adapter kind (``vllm``, ``openai_compat``, ``sim``).
        instance: The instance's name, unique on its node.
        provider: Free-form provider label (``lemonade``, ``ollama``, ...).
        targets: Models the backend serves (from its ``/v1/models``).
        max_concurrency: Runs executed at once.
        max_queue: Runs allowed to wait for a slot.
        queue_timeout_s: How long a run may wait for a slot.
        request_timeout_s: Total deadline of a run.
        provider_status: Health of the backend at the last probe.
        provider_detail: Why the status is not ``available`` (from the
            probe: ``request failed: connection refused by HOST:PORT``,
            ``status code 503``, a timeout), "" when it is. Short and
            secret-free: host and port, never URL paths, headers or
            bodies. Added after the first release; a peer that predates it
            decodes without it (and sends none: "").
        operations: The operations the instance serves
            (``iop.spec.OPERATIONS``: ``chat``, ``completion``,
            ``embedding``, ``tokenize``). A peer that predates the field
            decodes as chat-only, the only operation it had.
        engine_priority: The engine schedules runs by the priority the
            adapter passes on, preempting lower ones for higher ones
            (``engine_priority`` in the node's config: vLLM started with
            ``--scheduling-policy priority``); the edge may then place a run
            of a higher objective on an overflow seat there
            (docs/operations.md, "Engine priority"). A peer that predates
            the field decodes as False.
    """

    adapter: str
    instance: str
    provider: str = ""
    targets: tuple[str, ...] = ()
    max_concurrency: int = 8
    max_queue: int = 0
    queue_timeout_s: float = 0.0
    request_timeout_s: float = 0.0
    provider_status: ProviderStatus = ProviderStatus.UNKNOWN
    provider_detail: str = ""
    operations: tuple[str, ...] = ("chat",)
    engine_priority: bool = False

    def serves(self, operation: str) -> bool:
        """Whether the instance serves ``operation``."""
        return operation in self.operations


# Longest provider_detail a node sends: a status line, not a log excerpt.
PROVIDER_DETAIL_MAX_CHARS: Final = 200


def provider_detail(text: str) -> str:
    """``text`` as a ``provider_detail``: one line, at most ``PROVIDER_DETAIL_MAX_CHARS``."""
    line = " ".join(text.split())
    if len(line) <= PROVIDER_DETAIL_MAX_CHARS:
        return line
    return line[: PROVIDER_DETAIL_MAX_CHARS - 1] + "…"


class ProbeResult(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of probing a backend (``GET /v1/models``).

    Attributes:
        adapter: The adapter kind.
        instance: The instance's name.
        target: The model that was asked about ("" for none).
        status: Normalised status.
        targets: Models the backend listed.
        detail: Why the status is not ``available``.
        provider: The provider label, if configured.
    """

    adapter: str
    instance: str
    target: str = ""
    status: ProviderStatus = ProviderStatus.UNKNOWN
    targets: tuple[str, ...] = ()
    detail: str = ""
    provider: str = ""
