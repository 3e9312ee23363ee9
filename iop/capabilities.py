"""What an adapter instance can serve, and how healthy its provider is."""

from __future__ import annotations

import enum

import msgspec

__all__ = ["Capabilities", "ProbeResult", "ProviderStatus", "normalize_provider_status"]


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
