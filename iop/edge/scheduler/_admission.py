"""Whether a run may start at all: a model no instance serves now is refused
up front, with the status that says why.

Before a run is admitted to the queue (``Scheduler.admit``), ``refuse_unservable``
tells a client's mistake from the cluster's state when no usable instance
serves the run's model and operation: 400 ``operation_not_supported`` (the
model is listed, but not for this operation), 503 ``no_nodes`` (no node is
connected), 503 ``model_unavailable`` with each instance's reason (drained,
draining, or its backend down: retryable), else 404 ``model_not_found``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from iop.errors import ErrorCode, RequestError

if TYPE_CHECKING:
    from iop.edge.runs._nodes import NodeRegistry
    from iop.edge.scheduler._scheduler import Scheduler

__all__ = ["refuse_unservable"]

# How a 400 names an operation a model does not serve.
_OP_NOUNS: Final = {
    "chat": "chat completions",
    "completion": "text completions",
    "embedding": "embeddings",
    "tokenize": "token counts",
}


def refuse_unservable(registry: NodeRegistry, scheduler: Scheduler, model: str, op: str) -> None:
    """Refuse a run for ``op`` on ``model`` when no instance may take it now.

    Raises:
        RequestError: 400 operation not served, 404 unknown model, 503 no
            node or the model unavailable.
    """
    if scheduler.serves(model, op):
        return
    if _advertised(registry, model) and not _advertised(registry, model, op):
        # Listed, but by no instance for this operation (a chat model
        # asked for embeddings): the client's mistake, said as such.
        raise RequestError(
            f"The model `{model}` does not serve {_OP_NOUNS.get(op, op)}.",
            status=400,
            code=ErrorCode.OPERATION_NOT_SUPPORTED,
            param="model",
        )
    if not registry.nodes:
        raise RequestError("no inference node is connected", status=503, code=ErrorCode.NO_NODES)
    blocked = _why_unavailable(registry, model)
    if blocked:
        # Known (or maybe served by a backend that is down and never
        # listed its models): a retryable 503 that says why, not
        # "does not exist".
        raise RequestError(
            f"model `{model}` is temporarily unavailable: {'; '.join(blocked)}",
            status=503,
            code=ErrorCode.MODEL_UNAVAILABLE,
            param="model",
        )
    raise RequestError(
        f"The model `{model}` does not exist or no node serves it.",
        status=404,
        code=ErrorCode.MODEL_NOT_FOUND,
        param="model",
    )


def _advertised(registry: NodeRegistry, model: str, operation: str | None = None) -> bool:
    """Whether a connected instance lists ``model`` (for ``operation``), up or not."""
    return any(
        model in inst.caps.targets and (operation is None or inst.caps.serves(operation))
        for _, inst in registry.instances()
    )


def _why_unavailable(registry: NodeRegistry, model: str) -> list[str]:
    """Why no instance can take ``model`` now, one phrase per instance that might.

    An instance might serve it if it advertises it, or if it is
    unavailable without having listed any model (its backend was down
    since the node started). Empty: no instance might, the model is unknown.
    """
    why: list[str] = []
    for conn, inst in registry.instances():
        caps = inst.caps
        listed = model in caps.targets
        if not listed and (caps.targets or inst.usable):
            continue
        name = f"{conn.node_id}/{caps.instance}"
        drained = registry.drained.get(conn.node_id)
        if drained is not None:
            said = f" ({drained.reason})" if drained.reason else ""
            why.append(f"node {conn.node_id} is drained by an operator{said}")
        elif conn.draining:
            why.append(f"node {conn.node_id} is draining")
        elif not inst.usable:
            cause = caps.provider_detail or "no reason given"
            maybe = "" if listed else " (its models are unknown)"
            why.append(f"instance {name}{maybe} is unavailable: {cause}")
    return list(dict.fromkeys(why))  # one "node X is draining" (or drained) per node
