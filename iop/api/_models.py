"""The model list and model objects (``GET /v1/models``, ``GET /v1/models/{id}``), sans-IO.

Both routes exist in OpenAI's API and in Anthropic's, with different bodies.
A request carrying ``anthropic-version`` (every Anthropic SDK sends it; no
OpenAI client does) gets Anthropic's shapes; any other gets OpenAI's:

* OpenAI: ``{"object": "list", "data": [Model]}``, a ``Model`` being
  ``{"id", "object": "model", "created", "owned_by": "iop"}`` plus IOP's
  ``nodes`` (the nodes serving it); an unknown id is a 404 with code
  ``model_not_found`` (``iop.api._openai_errors``).
* Anthropic: ``{"data": [ModelInfo], "has_more": false, "first_id",
  "last_id"}``, a ``ModelInfo`` being ``{"type": "model", "id",
  "display_name", "created_at"}`` (RFC 3339) plus ``nodes``; an unknown id is
  a 404 ``not_found_error``. IOP lists every model on one page, so the
  pagination parameters (``limit``, ``after_id``, ``before_id``) are
  accepted and not acted on.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping

import msgspec

__all__ = [
    "anthropic_model_body",
    "anthropic_model_list_body",
    "model_body",
    "model_list_body",
    "wants_anthropic",
]


class _Model(msgspec.Struct, frozen=True):
    id: str
    object: str
    created: int
    owned_by: str
    nodes: list[str]


class _ModelList(msgspec.Struct, frozen=True):
    object: str
    data: list[_Model]


class _ModelInfo(msgspec.Struct, frozen=True):
    type: str
    id: str
    display_name: str
    created_at: str
    nodes: list[str]


class _ModelInfoList(msgspec.Struct, frozen=True):
    data: list[_ModelInfo]
    has_more: bool
    first_id: str | None
    last_id: str | None


def wants_anthropic(headers: Mapping[str, str]) -> bool:
    """Whether a request (lower-cased header names) is an Anthropic client's."""
    return "anthropic-version" in headers


def _model(id: str, nodes: Iterable[str], created: int) -> _Model:
    return _Model(id, "model", created, "iop", list(nodes))


def _info(id: str, nodes: Iterable[str], created: int) -> _ModelInfo:
    at = datetime.datetime.fromtimestamp(created, datetime.UTC)
    return _ModelInfo("model", id, id, at.isoformat().replace("+00:00", "Z"), list(nodes))


def model_list_body(models: Iterable[tuple[str, Iterable[str]]], created: int) -> bytes:
    """The ``{"object": "list", "data": [...]}`` body for ``(model id, node names)``
    pairs: OpenAI's model objects, owned by ``iop``, plus the nodes serving each."""
    data = [_model(id, nodes, created) for id, nodes in models]
    return msgspec.json.encode(_ModelList("list", data))


def model_body(id: str, nodes: Iterable[str], created: int) -> bytes:
    """One OpenAI model object (``GET /v1/models/{id}``, the SDK's ``models.retrieve``)."""
    return msgspec.json.encode(_model(id, nodes, created))


def anthropic_model_list_body(models: Iterable[tuple[str, Iterable[str]]], created: int) -> bytes:
    """Anthropic's ``ListResponse[ModelInfo]``, every model on one page."""
    data = [_info(id, nodes, created) for id, nodes in models]
    first, last = (data[0].id, data[-1].id) if data else (None, None)
    return msgspec.json.encode(_ModelInfoList(data, False, first, last))


def anthropic_model_body(id: str, nodes: Iterable[str], created: int) -> bytes:
    """One Anthropic ``ModelInfo`` (``GET /v1/models/{id}``, the SDK's ``models.retrieve``)."""
    return msgspec.json.encode(_info(id, nodes, created))
