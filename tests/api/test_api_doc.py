"""docs/api.md names every field each surface's parser accepts, and what IOP does with it.

The lists are taken from the parsers themselves, so a field added to a
parser without a row in the doc fails here:

* the request Structs' fields (msgspec ``__struct_fields__``): chat's
  ``ChatRequest`` and its messages, Responses' ``ResponsesRequest``,
  Messages' ``MessagesRequest``, the completions and embeddings bodies; a
  field holding one Struct (``reasoning``, ``output_config``...) needs a
  row per field of it (``reasoning.effort``), one holding a tagged union
  (``thinking``, ``tool_choice``) a row naming each tag beside the field;
* the keys a parser accepts and ignores by name (Messages'
  ``IGNORED_FIELDS``), the Responses input item types it translates or
  drops, and the Messages content blocks it knows;
* every tool type the APIs define, each offered or dropped: Responses'
  from OpenAI's schema (``tests/data/openai-schemas.json``, ``Tool``),
  Messages' from the ``anthropic`` SDK's ``BetaToolUnionParam`` (Claude
  Code speaks the beta API).

A row is a table line in the surface's section whose first cell names the
field in backticks: ``field``, ``field.sub`` or ``field`` followed by
what it holds (`` `tool_choice` `auto` ``). A backticked name ending in
``*`` covers the names it begins (``web_search_*``: Anthropic dates each
tool version).
"""

from __future__ import annotations

import fnmatch
import json
import re
import types
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest
from anthropic.types.beta import BetaToolUnionParam

from iop.api.completions import _request as completions_request
from iop.api.embeddings import _request as embeddings_request
from iop.api.messages import _request as messages_request
from iop.api.messages._request import IGNORED_FIELDS, MessagesRequest
from iop.api.responses import _request as responses_request
from iop.api.responses._request import ResponsesRequest
from iop.spec import ChatRequest, Message

ROOT = Path(__file__).resolve().parents[2]
API_DOC = ROOT / "docs" / "api.md"
OPENAI_SCHEMAS = ROOT / "tests" / "data" / "openai-schemas.json"

# Struct fields that are not keys of the wire body: Messages' ``ignored`` is
# filled by the parser with the names of the keys it ignored (for the log);
# a request's ``routing`` is the edge's, from its headers (iop/api/_routing.py,
# docs/api.md "Sessions and objectives").
NOT_ON_THE_WIRE = frozenset({"ignored", "routing"})

_HEADING = re.compile(r"^(#{2,6}) (.+)$")
_TICKED = re.compile(r"`([^`]+)`")


def section(doc: str, title: str) -> str:
    """The text under the heading ``title`` up to the next heading of its level or above."""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        found = _HEADING.match(line)
        if found and found.group(2).strip() == title:
            level = len(found.group(1))
            end = next(
                (
                    j
                    for j in range(i + 1, len(lines))
                    if (m := _HEADING.match(lines[j])) and len(m.group(1)) <= level
                ),
                len(lines),
            )
            return "\n".join(lines[i + 1 : end])
    raise AssertionError(f"docs/api.md has no section {title!r}")


def row_heads(text: str) -> list[list[str]]:
    """The backticked names in the first cell of each table row of ``text``."""
    heads = []
    for line in text.splitlines():
        cells = line.strip().split("|")
        if len(cells) < 3 or not line.lstrip().startswith("|"):
            continue
        first = cells[1]
        if re.fullmatch(r"\s*:?-+:?\s*", first):
            continue
        heads.append(_TICKED.findall(first))
    return heads


def names(head: str) -> str:
    """A backticked name without what follows it (``tool_choice.x: true`` -> its path)."""
    return re.split(r"[\s:=(]", head.strip(), maxsplit=1)[0]


def covers(token: str, path: str) -> bool:
    name = names(token)
    if name.endswith("*"):
        return fnmatch.fnmatchcase(path, name)
    return name == path or name.startswith((path + ".", path + "["))


def missing(doc_section: str, paths: list[str]) -> list[str]:
    heads = row_heads(doc_section)
    return [p for p in paths if not any(covers(t, p) for head in heads for t in head)]


def missing_tags(doc_section: str, field: str, tags: list[str]) -> list[str]:
    """Tags of ``field``'s union without a row naming both the field and the tag."""
    heads = row_heads(doc_section)
    out = []
    for tag in tags:
        if not any(
            any(covers(t, field) for t in head) and any(names(t) == tag for t in head)
            for head in heads
        ):
            out.append(f"{field} {tag}")
    return out


def _structs_of(annotation: Any) -> list[type[msgspec.Struct]] | None:
    """The Structs a field holds when it holds nothing else (``None`` aside):
    a Struct, or a union of them; None for anything else (a list, a string)."""
    args = [a for a in (typing.get_args(annotation) or (annotation,)) if a is not type(None)]
    if typing.get_origin(annotation) not in (None, typing.Union, types.UnionType):
        return None
    if args and all(isinstance(a, type) and issubclass(a, msgspec.Struct) for a in args):
        return args
    return None


def struct_paths(
    struct: type[msgspec.Struct], prefix: str = ""
) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """Every field path of ``struct`` (and of a field holding one untagged
    Struct: ``reasoning.effort``), and the tags of each field holding tagged
    Structs (``thinking``: ``enabled``, ``adaptive``, ``disabled``)."""
    paths: list[str] = []
    unions: list[tuple[str, list[str]]] = []
    hints = typing.get_type_hints(struct)
    for name in struct.__struct_fields__:
        if name in NOT_ON_THE_WIRE:
            continue
        path = prefix + name
        paths.append(path)
        inner = _structs_of(hints[name]) or []
        tags = [str(s.__struct_config__.tag) for s in inner if s.__struct_config__.tag]
        if tags:
            unions.append((path, tags))
        elif len(inner) == 1:
            paths += [f"{path}.{sub}" for sub in inner[0].__struct_fields__]
    return paths, unions


def _doc() -> str:
    return API_DOC.read_text()


def _check_struct(title: str, struct: type[msgspec.Struct], prefix: str = "") -> None:
    text = section(_doc(), title)
    paths, unions = struct_paths(struct, prefix)
    gaps = missing(text, paths)
    for field, tags in unions:
        gaps += missing_tags(text, field, tags)
    assert not gaps, f"docs/api.md, {title!r} has no row for: {', '.join(gaps)}"


# --------------------------------------------------------------------- fields


def test_chat_fields() -> None:
    _check_struct("Chat Completions", ChatRequest)


def test_chat_message_fields() -> None:
    _check_struct("Chat Completions", Message, "messages[].")


def test_responses_fields() -> None:
    _check_struct("OpenAI Responses", ResponsesRequest)


def test_messages_fields() -> None:
    _check_struct("Anthropic Messages", MessagesRequest)


def test_completions_fields() -> None:
    _check_struct("Completions (`POST /v1/completions`)", completions_request._Body)


def test_embeddings_fields() -> None:
    _check_struct("Embeddings (`POST /v1/embeddings`)", embeddings_request._Body)


def test_messages_ignored_keys() -> None:
    gaps = missing(section(_doc(), "Anthropic Messages"), sorted(IGNORED_FIELDS))
    assert not gaps, f"docs/api.md, 'Anthropic Messages' has no row for: {', '.join(gaps)}"


def test_messages_content_blocks() -> None:
    gaps = missing(section(_doc(), "Anthropic Messages"), list(messages_request._BLOCK_TAGS))
    assert not gaps, f"docs/api.md, 'Anthropic Messages' has no row for block: {gaps}"


def test_responses_input_items() -> None:
    items = [
        *responses_request._ITEM_TYPES,
        *sorted(responses_request._DROPPED_ITEMS),
        "item_reference",
    ]
    gaps = missing(section(_doc(), "Input items"), items)
    assert not gaps, f"docs/api.md, 'Input items' has no row for: {', '.join(gaps)}"


# --------------------------------------------------------------------- tool types


def openai_tool_types() -> list[str]:
    """Every ``type`` of OpenAI's Responses ``Tool`` union, from its OpenAPI schema."""
    schemas = json.loads(OPENAI_SCHEMAS.read_text())["components"]["schemas"]
    found: list[str] = []
    for ref in schemas["Tool"]["oneOf"]:
        tool = schemas[ref["$ref"].rsplit("/", 1)[1]]
        found += tool["properties"]["type"]["enum"]
    return found


def anthropic_tool_types() -> list[str]:
    """Every ``type`` of Anthropic's beta tool union, from the ``anthropic`` SDK."""
    found: list[str] = []
    for param in typing.get_args(BetaToolUnionParam):
        hint = typing.get_type_hints(param)["type"]
        while typing.get_origin(hint) is not typing.Literal:
            hint = typing.get_args(hint)[0]
        found += [str(a) for a in typing.get_args(hint)]
    return found


@pytest.mark.parametrize(
    ("title", "types"),
    [("Tools", openai_tool_types()), ("Tool types", anthropic_tool_types())],
    ids=["responses", "messages"],
)
def test_every_tool_type_has_a_row(title: str, types: list[str]) -> None:
    assert len(types) > 10, types  # the sources were read
    gaps = missing(section(_doc(), title), types)
    assert not gaps, f"docs/api.md, {title!r} has no row for tool type: {', '.join(gaps)}"


# --------------------------------------------------------------------- the checker


def test_the_checker_finds_rows_and_gaps() -> None:
    text = (
        "| field | what |\n| --- | --- |\n"
        "| `tool_choice` `auto` / `any` | x |\n"
        "| `reasoning.effort` | y |\n"
        "| `web_search_*` | dropped |\n"
        "prose naming `top_k` is no row\n"
    )
    assert missing(text, ["tool_choice", "reasoning", "reasoning.effort"]) == []
    assert missing(text, ["top_k", "reasoning.summary"]) == ["top_k", "reasoning.summary"]
    assert missing(text, ["web_search_20250305", "web_fetch_20250910"]) == ["web_fetch_20250910"]
    assert missing_tags(text, "tool_choice", ["auto", "any", "none"]) == ["tool_choice none"]
