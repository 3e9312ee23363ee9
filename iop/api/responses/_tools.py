"""A Responses request's tools as chat functions, and the model's calls back (sans-IO).

Theory of operation
-------------------
The backends behind a run know one kind of tool: a chat function, named by
``^[a-zA-Z0-9_-]{1,64}$``, called with JSON arguments. The Responses API has
more kinds (docs/api.md, "OpenAI Responses", "Tools"). Those a client runs
itself are offered to the model as functions, and the model's calls are
turned back into the items the client expects:

* ``function``: as it is.
* ``custom`` (a freeform tool: Codex's ``apply_patch``): a function of one
  string argument, :data:`CUSTOM_ARGUMENT` (``input``), the tool's format
  (a Lark or regex grammar, or free text) written into the function's
  description, since a chat function cannot carry a grammar. A call comes
  back as a ``custom_tool_call`` whose ``input`` is that argument, unwrapped
  from the JSON arguments (:func:`custom_input`).
* ``namespace``: each function or custom tool inside becomes a function of
  its own, named ``<namespace>__<name>`` (the ``__`` Codex uses when it
  flattens names itself: ``codex-rs/protocol/src/tool_name.rs`` in
  https://github.com/openai/codex). A call
  comes back with the client's name and the ``namespace`` field OpenAI's
  ``FunctionToolCall`` and ``CustomToolCall`` carry: Codex 0.163.0 runs a
  namespaced tool only so (docs/api.md).

A flattened name that is not a legal function name (too long, other
characters) or that another tool already has is replaced by a
deterministic one: the legal characters of the flat name, cut to fit, then
``_`` and 8 hex digits of the SHA-256 of ``namespace NUL name``. Names are
never parsed back: :class:`ToolMap` maps each function name the model may
call to the client's tool (:class:`ToolOrigin`), and each client tool to its
function name, so the mapping is exact whatever the names hold.

Every other tool type (``web_search``, ``file_search``, ``mcp``, ...) needs
OpenAI's servers to run and is dropped (docs/api.md lists each).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Set as AbstractSet
from typing import Any, Final

import msgspec

from iop.spec import FunctionDef

__all__ = [
    "CUSTOM_ARGUMENT",
    "MAX_FUNCTION_NAME",
    "NAMESPACE_SEPARATOR",
    "CustomToolEcho",
    "FunctionToolEcho",
    "NamespaceToolEcho",
    "ToolEcho",
    "ToolMap",
    "ToolOrigin",
    "custom_arguments",
    "custom_function",
    "custom_input",
    "empty_map",
    "flat_name",
    "tool_key",
]

CUSTOM_ARGUMENT: Final = "input"
"""The one argument of a custom tool's function: the tool's free-form input."""
NAMESPACE_SEPARATOR: Final = "__"
"""Between a namespace and a tool's name in a flattened function name."""
MAX_FUNCTION_NAME: Final = 64
"""The longest function name OpenAI's function-name pattern allows."""
_LEGAL: Final = re.compile(rf"[a-zA-Z0-9_-]{{1,{MAX_FUNCTION_NAME}}}")
_ILLEGAL_CHAR: Final = re.compile(r"[^a-zA-Z0-9_-]")
_DIGEST_HEX: Final = 8


class FunctionToolEcho(msgspec.Struct, frozen=True, tag="function", tag_field="type"):
    """A function tool as the Response echoes it."""

    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None


class CustomToolEcho(
    msgspec.Struct, frozen=True, tag="custom", tag_field="type", omit_defaults=True
):
    """A custom tool as the Response echoes it (OpenAI's ``CustomToolParam``)."""

    name: str
    description: str | None = None
    format: dict[str, Any] | None = None


class NamespaceToolEcho(msgspec.Struct, frozen=True, tag="namespace", tag_field="type"):
    """A namespace as the Response echoes it (OpenAI's ``NamespaceToolParam``)."""

    name: str
    description: str
    tools: list[FunctionToolEcho | CustomToolEcho]


ToolEcho = FunctionToolEcho | CustomToolEcho | NamespaceToolEcho


class ToolOrigin(msgspec.Struct, frozen=True, kw_only=True):
    """The client's tool behind a function the model may call.

    Attributes:
        name: The tool's name as the client gave it.
        namespace: The namespace it was declared in, if any.
        custom: A custom (freeform) tool: calls come back as ``custom_tool_call``.
    """

    name: str
    namespace: str | None = None
    custom: bool = False


def tool_key(namespace: str | None, name: str) -> str:
    """A client tool's key in :attr:`ToolMap.names`."""
    return name if namespace is None else f"{namespace}\0{name}"


def flat_name(namespace: str | None, name: str, taken: AbstractSet[str] = frozenset()) -> str:
    """The function name of a client tool (module docstring).

    Args:
        namespace: The tool's namespace, None for a top-level tool.
        name: The tool's name.
        taken: Function names other tools already have.
    """
    flat = name if namespace is None else f"{namespace}{NAMESPACE_SEPARATOR}{name}"
    if _LEGAL.fullmatch(flat) and flat not in taken:
        return flat
    digest = hashlib.sha256(tool_key(namespace, name).encode("utf-8", "replace")).hexdigest()
    stem = _ILLEGAL_CHAR.sub("_", flat)[: MAX_FUNCTION_NAME - _DIGEST_HEX - 1]
    return f"{stem}_{digest[:_DIGEST_HEX]}"


class ToolMap(msgspec.Struct, frozen=True, kw_only=True):
    """Function names to client tools and back, for the tools that differ.

    A plain top-level function is in neither map: its name is its own.

    Attributes:
        origins: Function name -> the client's tool (custom or namespaced).
        names: ``namespace NUL name`` (or ``name``) -> function name.
    """

    origins: dict[str, ToolOrigin] = {}
    names: dict[str, str] = {}

    def origin(self, function: str) -> ToolOrigin | None:
        """The client's tool behind ``function``; None for a plain function."""
        return self.origins.get(function)

    def function(self, namespace: str | None, name: str) -> str:
        """The function name the client's tool ``namespace``/``name`` goes by.

        A namespaced tool this request does not offer (a call from an earlier
        turn whose tools differed) gets the name it would have had
        (:func:`flat_name`); a top-level one keeps its name.
        """
        if namespace is None:
            return self.names.get(name, name)  # a plain function keeps its name
        return self.names.get(tool_key(namespace, name)) or flat_name(namespace, name)


_NO_TOOLS: Final = ToolMap()


def _format_text(fmt: Any) -> str:
    """What the function's description says of a custom tool's input format."""
    lead = (
        f"Call this tool with one argument, `{CUSTOM_ARGUMENT}`: a string holding the tool's "
        "whole input as raw text (the input itself is not JSON)."
    )
    if isinstance(fmt, dict) and fmt.get("type") == "grammar":
        syntax = fmt.get("syntax")
        definition = fmt.get("definition")
        if isinstance(definition, str):
            kind = syntax if isinstance(syntax, str) else "grammar"
            return f"{lead} The input must match this {kind} grammar:\n```{kind}\n{definition}\n```"
    return f"{lead} The input is free-form text."


def custom_function(
    name: str, description: str | None, fmt: Any, namespace_note: str | None = None
) -> FunctionDef:
    """The chat function a custom tool is offered as (module docstring)."""
    parts = [p for p in (description, namespace_note, _format_text(fmt)) if p]
    return FunctionDef(
        name=name,
        description="\n\n".join(parts),
        parameters={
            "type": "object",
            "properties": {
                CUSTOM_ARGUMENT: {"type": "string", "description": "The tool's input, as raw text."}
            },
            "required": [CUSTOM_ARGUMENT],
            "additionalProperties": False,
        },
    )


def custom_input(arguments: str) -> str:
    """A custom tool's input from the model's JSON arguments.

    ``{"input": "<text>"}`` (and nothing else) gives ``<text>``; anything
    else the model wrote is passed on as the raw arguments text.
    """
    try:
        decoded = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return arguments
    if isinstance(decoded, dict) and len(decoded) == 1:
        value = decoded.get(CUSTOM_ARGUMENT)
        if isinstance(value, str):
            return value
    return arguments


def custom_arguments(text: str) -> str:
    """The JSON arguments a custom tool's ``input`` is replayed to the model as."""
    return msgspec.json.encode({CUSTOM_ARGUMENT: text}).decode()


def empty_map() -> ToolMap:
    """The map of a request without custom or namespaced tools."""
    return _NO_TOOLS
