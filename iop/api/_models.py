"""OpenAI's model list (``GET /v1/models``), sans-IO."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

__all__ = ["model_list_body"]


class _Model(msgspec.Struct, frozen=True):
    id: str
    object: str
    created: int
    owned_by: str
    nodes: list[str]


class _ModelList(msgspec.Struct, frozen=True):
    object: str
    data: list[_Model]


def model_list_body(models: Iterable[tuple[str, Iterable[str]]], created: int) -> bytes:
    """The ``{"object": "list", "data": [...]}`` body for ``(model id, node names)``
    pairs: OpenAI's model objects, owned by ``iop``, plus the nodes serving each."""
    data = [_Model(id, "model", created, "iop", list(nodes)) for id, nodes in models]
    return msgspec.json.encode(_ModelList("list", data))
