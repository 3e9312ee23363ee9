"""The repository stands alone: what its code and docs cite, a reader can open.

Comments, docstrings, tests, scripts and docs cite files of this repository,
sections of its docs, public specs, issues and URLs. Notes that live outside
the repository (the project's research notes, its design brief, its style
guide) are not citable: a fact taken from them is written into docs/ and the
docs section is cited (docs/architecture.md, "Facts about the backends" and
"Facts about our dependencies"; docs/benchmarks.md, "Earlier measurements").
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# What is scanned: everything a reader of the repository reads.
SCANNED = (
    "iop",
    "tests",
    "scripts",
    "docs",
    "configs",
    "deploy",
    ".ci",
    "README.md",
    "pyproject.toml",
)
SKIPPED_DIRS = frozenset({"__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"})

# The names of the notes outside the repository. Built from parts so that
# this file does not cite them itself (it is scanned like any other).
_MD = r"\.md\b"
OUTSIDE_NOTES: tuple[re.Pattern[str], ...] = tuple(
    re.compile(p)
    for p in (
        r"\btrio-stack" + _MD,
        r"\bprotocols" + _MD,
        r"\blitellm-peer" + _MD,
        r"\breal-backend" + _MD,
        r"\bpeers(-\d{4}-\d{2})?" + _MD,
        r"\bDESIGN" + _MD,
        r"\bDESIGN \u00a7",
        r"\bSTYLE" + _MD,
        r"\.\./" + "shared" + r"\b",
        r"/work/" + "shared" + r"\b",
        r"\b" + "shared" + r"/(reference|seeds|transcripts)\b",
    )
)

# A section mark cites a public spec: "RFC 9112 §6.1", "WHATWG HTML §9.2".
SECTION_MARK = "\u00a7"
PUBLIC_SECTION = re.compile(r"(RFC \d+|HTML) " + SECTION_MARK)

# `docs/<page>.md, "<heading>"` (the comma is optional); a heading path is
# written "<heading>: <subheading>".
DOCS_CITATION = re.compile(r'docs/([a-z]+)\.md,?\s+"([^"]+)"')
# A comment's line break and leader, so a citation may wrap across comment lines.
_COMMENT_BREAK = re.compile(r"\s*\n\s*(#\s*)?")


def _files() -> list[Path]:
    out: list[Path] = []
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            out.append(path)
            continue
        for file in sorted(path.rglob("*")):
            if file.is_file() and not SKIPPED_DIRS.intersection(file.parts):
                out.append(file)
    return out


def _text(path: Path) -> str | None:
    """The file as text, or None for a binary file (an image)."""
    raw = path.read_bytes()
    if b"\0" in raw:
        return None
    return raw.decode("utf-8", errors="replace")


def _texts() -> list[tuple[Path, str]]:
    return [(f, t) for f in _files() if (t := _text(f)) is not None]


def outside_citations(text: str) -> list[tuple[int, str]]:
    """(line number, matched text) of every mention of a note outside the repository."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern in OUTSIDE_NOTES:
            hits.extend((number, m.group(0)) for m in pattern.finditer(line))
    return hits


def stray_section_marks(text: str) -> list[int]:
    """Line numbers of section marks that cite no public spec."""
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.count(SECTION_MARK) > len(PUBLIC_SECTION.findall(line)):
            lines.append(number)
    return lines


def _headings(page: str) -> list[str]:
    path = DOCS / f"{page}.md"
    if not path.is_file():
        return []
    return [
        line.lstrip("#").strip().lower()
        for line in path.read_text().splitlines()
        if re.match(r"#{1,6} ", line)
    ]


def section_exists(page: str, title: str) -> bool:
    """``title`` is a heading of docs/<page>.md, or a path "A: B" of headings in order."""
    headings = _headings(page)
    if title.lower() in headings:
        return True
    at = 0
    for part in title.lower().split(": "):
        if part not in headings[at:]:
            return False
        at = headings.index(part, at) + 1
    return True


def docs_citations(text: str) -> list[tuple[str, str]]:
    """(page, title) of every ``docs/<page>.md, "<title>"`` citation in ``text``."""
    flat = _COMMENT_BREAK.sub(" ", text)
    return [(m.group(1), m.group(2)) for m in DOCS_CITATION.finditer(flat)]


# --- the checks on the repository -------------------------------------------------


def test_nothing_cites_notes_outside_the_repository() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {match}"
        for path, text in _texts()
        for number, match in outside_citations(text)
    ]
    assert not offenders, "cite docs/ instead:\n" + "\n".join(offenders)


def test_section_marks_cite_public_specs() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path, text in _texts()
        if not path.is_relative_to(ROOT / "tests" / "data")  # captured third-party bodies
        for number in stray_section_marks(text)
    ]
    assert not offenders, "a section mark that names no RFC or spec:\n" + "\n".join(offenders)


def test_cited_docs_sections_exist() -> None:
    citations = [
        (path, page, title) for path, text in _texts() for page, title in docs_citations(text)
    ]
    assert len(citations) > 20, "the citation pattern no longer finds the repository's citations"
    missing = [
        f'{path.relative_to(ROOT)}: docs/{page}.md, "{title}"'
        for path, page, title in citations
        if not section_exists(page, title)
    ]
    assert not missing, "no such section:\n" + "\n".join(missing)


# --- the checks themselves ------------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        "# see " + "trio-stack" + ".md \u00a74",
        "(" + "protocols" + ".md, rule 7)",
        "LiteLLM (" + "litellm-peer" + ".md)",
        "built from source: " + "real-backend" + ".md.",
        "peers" + ".md and " + "peers-2026-12" + ".md",
        "Each cause has its own reason (" + "DESIGN" + " \u00a72).",
        "../" + "shared/" + "STYLE" + ".md",
        "/work/" + "shared" + "/reference/transcripts/x.txt",
    ],
)
def test_outside_notes_are_recognised(line: str) -> None:
    assert outside_citations(line)


@pytest.mark.parametrize(
    "line",
    [
        "iop/testing/transcripts/vllm_text_stream_with_usage.txt",
        "seed 001's streamChatCompletion",
        "docs/architecture.md, 'Facts about our dependencies: trio-websocket'",
        "the DESIGN of the link; shared state",
        "https://github.com/encode/httpcore/pull/1035",
    ],
)
def test_repository_citations_are_not_flagged(line: str) -> None:
    assert not outside_citations(line)


def test_a_section_mark_needs_a_spec() -> None:
    assert stray_section_marks("ok (RFC 6455 \u00a75.5), ok (WHATWG HTML \u00a79.2)") == []
    assert stray_section_marks("(RFC 6455 \u00a75.5) but (\u00a75e)") == [1]


def test_a_docs_citation_may_wrap_across_comment_lines() -> None:
    text = '# (docs/architecture.md,\n    # "Facts about our dependencies:\n    # hypercorn")'
    assert docs_citations(text) == [("architecture", "Facts about our dependencies: hypercorn")]
    assert section_exists("architecture", "Layers")
    assert section_exists("architecture", "A run's life: Deadlines")
    assert not section_exists("architecture", "Deadlines: A run's life")
    assert not section_exists("architecture", "No such section")
    assert not section_exists("nosuchpage", "Layers")
