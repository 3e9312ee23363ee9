"""Error codes: one enum, documented in full, never matched as strings."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import msgspec
import pytest

from iop.errors import RETRYABLE_CODES, ErrorCode, RunAborted
from iop.events import CancelReason, Error

ROOT = Path(__file__).resolve().parent.parent
IOP_DIR = Path(importlib.import_module("iop").__file__ or "").parent
API_DOC = ROOT / "docs" / "api.md"


def _documented() -> dict[str, str]:
    """The "Error codes" table of docs/api.md: code -> its "fails over" cell."""
    text = API_DOC.read_text()
    section = text.split("\n## Error codes\n", 1)[1].split("\n## ", 1)[0]
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| `")
    ]
    codes = [row[0].strip("`") for row in rows]
    assert len(codes) == len(set(codes)), "a code is listed twice"
    return {code: row[2] for code, row in zip(codes, rows, strict=True)}


def test_the_docs_list_exactly_the_error_codes() -> None:
    documented = _documented()
    assert sorted(documented) == sorted(c.value for c in ErrorCode)


def test_the_docs_say_which_codes_fail_over() -> None:
    documented = _documented()
    assert {c for c, cell in documented.items() if cell == "yes"} == set(RETRYABLE_CODES)
    assert set(documented.values()) <= {"yes", ""}


def test_a_code_is_its_members_name_in_snake_case() -> None:
    for code in ErrorCode:
        assert code.value == code.name.lower()
        assert re.fullmatch(r"[a-z]+(?:_[a-z]+)*", code.value)


def test_a_code_decoded_from_the_link_is_a_plain_str_that_still_fails_over() -> None:
    """The edge tests a node's ``Error.code`` against the enum after msgpack."""
    sent = Error(message="busy", status=429, code=ErrorCode.QUEUE_FULL)
    got = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=Error)
    assert type(got.code) is str
    assert got.code == ErrorCode.QUEUE_FULL
    assert got.code in RETRYABLE_CODES
    assert got == sent
    assert msgspec.json.encode(sent) == msgspec.json.encode(
        Error(message="busy", status=429, code="queue_full")
    )


def test_a_code_iop_does_not_know_still_decodes() -> None:
    wire = msgspec.msgpack.encode(Error(message="x", code="some_newer_code"))
    got = msgspec.msgpack.decode(wire, type=Error)
    assert got.code == "some_newer_code"
    assert got.code not in RETRYABLE_CODES


def test_run_aborted_carries_the_cancel_reason_itself() -> None:
    exc = RunAborted("lost", reason=CancelReason.NODE_LOST)
    assert exc.reason is CancelReason.NODE_LOST
    assert exc.code is ErrorCode.RUN_CANCELLED


# --- no module matches codes as strings ---------------------------------------------


def _is_code(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "code") or (
        isinstance(node, ast.Name) and node.id == "code"
    )


def _has_str_literal(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_has_str_literal(e) for e in node.elts)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        # frozenset({"a", "b"}), set(...), tuple(...)
        return node.func.id in {"frozenset", "set", "tuple"} and any(
            _has_str_literal(a) for a in node.args
        )
    return False


def string_codes(source: str) -> list[int]:
    """Lines of ``source`` that compare a code with a string, or pass one as ``code=``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_code(s) for s in sides) and any(_has_str_literal(s) for s in sides):
                lines.append(node.lineno)
        elif isinstance(node, ast.keyword) and node.arg == "code" and _has_str_literal(node.value):
            lines.append(node.value.lineno)
    return lines


@pytest.mark.parametrize(
    "source",
    [
        'if ev.code == "queue_full": pass',
        'if "queue_full" != error.code: pass',
        'ok = exc.code in ("node_draining", "unknown_instance")',
        'ok = code in {"a"}',
        'ok = code not in frozenset({"a"})',
        'raise RequestError("x", code="invalid_value")',
        'raise RequestError("x", code=f"{kind}_below_min_value")',
    ],
)
def test_the_scan_finds_a_string_code(source: str) -> None:
    assert string_codes(source) == [1]


@pytest.mark.parametrize(
    "source",
    [
        "if ev.code == ErrorCode.QUEUE_FULL: pass",
        "ok = ev.code in RETRYABLE_CODES",
        'raise RequestError("x", code=ErrorCode.INVALID_VALUE)',
        'ok = exc.close_code == 1000 and exc.status == "x"',
    ],
)
def test_the_scan_lets_enum_codes_pass(source: str) -> None:
    assert string_codes(source) == []


def test_no_module_matches_or_produces_a_code_as_a_string() -> None:
    bad = [
        f"{path.relative_to(IOP_DIR.parent)}:{line}"
        for path in sorted(IOP_DIR.rglob("*.py"))
        for line in string_codes(path.read_text())
    ]
    assert bad == [], "use an ErrorCode member (iop/errors.py)"
