"""The adapter contract.

An adapter turns an ``ExecutionSpec`` into RuntimeEvents against one backend
instance. ``execute`` *pushes* events into the sender it is given (it is not
an async generator: no ``yield`` inside a cancel scope); it emits ``Start``
first and ends by sending ``Complete``, or by raising an ``IopError``, which
the runtime turns into the run's one ``Error`` event. Cancellation arrives as
``trio.Cancelled`` at any await; adapters never catch it, they only make sure
their ``async with`` blocks release the upstream connection.
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

from iop.capabilities import Capabilities, ProbeResult
from iop.errors import InvariantError, RequestError
from iop.runtime import EventSender
from iop.spec import ChatRequest, ExecutionSpec
from iop.wire._engine_load import EngineFigures

__all__ = [
    "Adapter",
    "EngineLoadReader",
    "KVEventsFollower",
    "require_model",
    "require_model_and_messages",
]


class Adapter(Protocol):
    """What every adapter offers to the node."""

    kind: ClassVar[str]

    @property
    def name(self) -> str:
        """The instance's name, unique on its node."""
        ...

    async def capabilities(self) -> Capabilities:
        """What the instance serves and how much, with a fresh provider status."""
        ...

    async def probe(self, target: str = "") -> ProbeResult:
        """Check the backend is up and, if given, serves ``target``."""
        ...

    async def execute(self, spec: ExecutionSpec, send: EventSender) -> None:
        """Run ``spec``, pushing ``Start``, deltas and ``Complete`` into ``send``."""
        ...

    async def aclose(self) -> None:
        """Release the instance's resources (idempotent)."""
        ...


@runtime_checkable
class EngineLoadReader(Protocol):
    """An adapter whose engine publishes its load (``vllm``; ``openai_compat``
    with ``engine`` set); the node scrapes it for its load reports."""

    @property
    def load_scrape_interval_s(self) -> float:
        """How often to call ``engine_load`` (0: never)."""
        ...

    async def engine_load(self) -> EngineFigures:
        """The engine's published load, read now.

        Raises:
            IopError: It could not be read.
        """
        ...


@runtime_checkable
class KVEventsFollower(Protocol):
    """An adapter whose engine pushes its KV cache events (``vllm`` with
    ``kv_events_endpoint``); the node follows them beside its load scrape,
    which reports what they say the cache holds."""

    async def follow_kv_events(self) -> None:
        """Apply the engine's events until cancelled (returns at once when
        there are none to follow). Never raises for what the engine sends."""
        ...


def require_model(kind: str, spec: ExecutionSpec) -> str:
    """The model to ask the backend for (any operation).

    Raises:
        RequestError: The run names no target or model.
    """
    model = spec.model
    if not model:
        raise RequestError(f"{kind} adapter: target/model is required", param="model")
    return model


def require_model_and_messages(kind: str, spec: ExecutionSpec) -> str:
    """Validate what every backend needs; return the model to ask for.

    Raises:
        RequestError: No target/model, or no messages (seed 000/003 order).
    """
    model = require_model(kind, spec)
    if not isinstance(spec.request, ChatRequest):
        raise InvariantError(f"{kind} adapter: a {spec.operation} run is not chat")
    if not spec.request.messages:
        raise RequestError(f"{kind} adapter: messages are required", param="messages")
    return model
