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

# A path of this repository's code: a module (`iop/edge/_core.py`, `tests/x.py`)
# or a package (`iop/api/`). Other paths (`configs/bench/KEY.toml`, the seeds'
# `.go` files) name examples and files outside, and are not checked.
CODE_PATH = re.compile(
    r"(?<![\w./-])((?:iop|tests|scripts)/(?:[\w.-]+/)*(?:[\w-]+\.py\b|(?=[\s`'\"),:;|]|$)))"
)
# A dotted name in the package (`iop.runtime._run`, `iop.api.CHAT`).
DOTTED_NAME = re.compile(r"(?<![\w./])(iop(?:\.\w+)+)")
# A commit hash (`3f208b0`, `git show 9aa1fae:scripts/x.py`): a paragraph that
# names one tells history, and may name a module that is gone since (git show
# opens it). A hash has a digit and a letter, which dates and words have not.
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
# A placeholder in a path (`scripts/NAME.py`, `configs/bench/KEY.toml`).
PLACEHOLDER = re.compile(r"/[A-Z][A-Z_]*(\.py|/|$)")
# In a layout tree (a code block, docs/architecture.md "Layers"): a directory
# at the margin (`iop/wire/   sans-IO ...`), or a module or package named in a
# column of it, at the margin or four spaces in (`    _sse.py   WHATWG ...`,
# `    server/_tls.py   TLS ...`).
_TREE_HEAD = re.compile(r"^(iop/(?:[\w.-]+/)*)")
_TREE_NAME = re.compile(r"(?:^ {4}|^|\s{2})((?:[\w-]+/)*[\w-]+(?:\.py|/))(?=\s|$)")


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


def dotted_is_missing(name: str) -> bool:
    """``name`` (``iop.a._b.C``) goes through a private module that does not exist.

    Its parts are followed through packages and modules; the first that is
    neither is an attribute (``iop.api.CHAT``, ``iop.config.Settings``, a
    logger name like ``iop.edge.http``), unless it is private (``_b``) and
    its parent a package: that names a module.
    """
    parts = name.split(".")
    here = ROOT / parts[0]
    for part in parts[1:]:
        if not here.is_dir():
            return False
        if (here / part).is_dir():
            here = here / part
        elif (here / f"{part}.py").is_file():
            here = here / f"{part}.py"
        else:
            return part.startswith("_") and not part.startswith("__")
    return False


def _tree_paths(line: str, tree: str | None) -> tuple[list[str], str | None]:
    """The paths a layout-tree line names, and the directory the lines below it are in."""
    head = _TREE_HEAD.match(line)
    if head:
        tree = head.group(1)
        names = [m.group(1) for m in _TREE_NAME.finditer(line[head.end() :])]
        return [line[: head.end()].rstrip(), *(tree + n for n in names)], tree
    if tree is not None and line.startswith("    ") and not line.startswith("     "):
        return [tree + m.group(1) for m in _TREE_NAME.finditer(line)], tree
    if line.startswith(" ") or not line.strip():
        return [], tree
    return [], None


def missing_code_paths(text: str) -> list[tuple[int, str]]:
    """(line number, path) of every module or package ``text`` names that does not exist.

    Three forms: a path (``iop/edge/_core.py``, ``tests/api/``), a dotted name
    through a private module (``iop.runtime._run``), and the names in a
    layout tree of a code block (``iop/wire/`` at the margin, ``_sse.py``
    below it). A paragraph that cites a commit hash is history and is not
    checked, nor the code block right after it.
    """
    hits: list[tuple[int, str]] = []
    fenced = False
    tree: str | None = None
    history = False
    for paragraph_start, paragraph in _paragraphs(text):
        # A code block goes with the paragraph before it, which it shows.
        cited = COMMIT_HASH.search(paragraph) is not None
        history = cited or (history and paragraph.lstrip().startswith("```"))
        for offset, line in enumerate(paragraph.split("\n")):
            number = paragraph_start + offset
            if line.lstrip().startswith("```"):
                fenced, tree = not fenced, None
                continue
            names: list[str] = [m.group(1) for m in CODE_PATH.finditer(line)]
            if fenced:
                from_tree, tree = _tree_paths(line, tree)
                names += from_tree
            if history:
                continue
            hits.extend(
                (number, n) for n in names if not (ROOT / n).exists() and not PLACEHOLDER.search(n)
            )
            hits.extend(
                (number, m.group(1))
                for m in DOTTED_NAME.finditer(line)
                if dotted_is_missing(m.group(1))
            )
    return hits


def _paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each run of lines between blank lines."""
    out: list[tuple[int, str]] = []
    start, lines = 1, []
    for number, line in enumerate(text.split("\n"), 1):
        if line.strip():
            if not lines:
                start = number
            lines.append(line)
        elif lines:
            out.append((start, "\n".join(lines)))
            lines = []
    if lines:
        out.append((start, "\n".join(lines)))
    return out


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


def test_named_modules_exist() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {name}"
        for path, text in _texts()
        if not path.is_relative_to(ROOT / "tests" / "data")  # captured third-party bodies
        for number, name in missing_code_paths(text)
    ]
    assert not offenders, "no such module (moved? renamed?):\n" + "\n".join(offenders)


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


# Built from parts, so that this file names no missing module itself.
_GONE = "iop/wire/" + "_gone.py"
_GONE_DOTTED = "iop.runtime." + "_gone"


@pytest.mark.parametrize(
    ("text", "missing"),
    [
        (f"see `{_GONE}` for that", [(1, _GONE)]),
        (f"first line\n({_GONE}, which)", [(2, _GONE)]),
        ("iop/api/chat/_encode.py and iop/api/chat/ and tests/test_docs.py", []),
        ("`iop/" + "nowhere/` is a package", [(1, "iop/" + "nowhere/")]),
        (f"{_GONE_DOTTED}.Timeline keeps it", [(1, _GONE_DOTTED + ".Timeline")]),
        ("iop.runtime._run.Run, iop.api.CHAT, the logger iop.edge.http, iop.x", []),
        ("configs/bench/KEY.toml, iop/apps/node/stream.go, iop/events", []),
        (f"* `3f208b0` (reverted): a sans-IO\n  `{_GONE}`, which", []),
        (f"Profiled with `{_GONE}` (`git show\n9aa1fae:{_GONE}`)", []),
        ("`git show COMMIT:scripts/NAME.py` prints it", []),
        (f"2026-12-01, or deadbeef: not hashes, so `{_GONE}`", [(1, _GONE)]),
        (f"`3f208b0` was then.\n\nNow `{_GONE}`.", [(3, _GONE)]),
        (f"At `3f208b0`:\n\n```bash\npython {_GONE}\n```\n\nThen {_GONE}", [(7, _GONE)]),
    ],
)
def test_missing_modules_are_found(text: str, missing: list[tuple[int, str]]) -> None:
    assert missing_code_paths(text) == missing


def test_a_layout_tree_names_its_modules() -> None:
    tree = (
        "```\n"
        "iop/events.py  errors.py  gone" + ".py      pure data\n"
        "iop/wire/                sans-IO\n"
        "    _sse.py            WHATWG SSE decoder     _gone" + ".py  a column\n"
        "    _tooltext.py       tool calls: _also_gone" + ".py, in prose, is not a column\n"
        "                       _still_not" + ".py: deeper lines are prose\n"
        "iop/api/                 the surfaces\n"
        "    chat/_encode.py    a nested name     chat/_gone" + ".py  and its column\n"
        "    nowhere/           no such package\n"
        "client --HTTP-- edge\n"
        "    _x" + ".py           no tree above: not checked\n"
        "```\n"
        "    _y" + ".py           outside a code block: not a tree\n"
    )
    assert missing_code_paths(tree) == [
        (2, "iop/gone" + ".py"),
        (4, "iop/wire/_gone" + ".py"),
        (8, "iop/api/chat/_gone" + ".py"),
        (9, "iop/api/" + "nowhere/"),
    ]
