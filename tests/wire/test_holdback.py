"""The one hold-back mechanism (``<think>`` stripping and the tool-text filter share it)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iop.wire import HoldBack, Tags

THINK = Tags(folded=("<think>", "</think>"))
MIXED = Tags(folded=("<tool_call", "<function="), exact=("{{tool_call",))


def run(tags: Tags, deltas: list[str]) -> list[str]:
    """Every part of every split, then the flushed tail, merged into
    ``[text, tag, text, ...]`` (adjacent texts joined)."""
    hold = HoldBack(tags)
    merged = [""]
    for delta in deltas:
        parts = hold.split(delta)
        assert len(parts) % 2 == 1
        merged[-1] += parts[0]
        merged += parts[1:]
        held = hold.held
        assert held == "" or is_proper_prefix(tags, held)
    merged[-1] += hold.flush()
    assert hold.held == ""
    return merged


def is_proper_prefix(tags: Tags, text: str) -> bool:
    return tags.partial(text) == 0


def test_split_finds_tags_and_holds_a_prefix() -> None:
    hold = HoldBack(THINK)
    assert hold.split("a<think>b</THINK>c <thi") == ["a", "<think>", "b", "</THINK>", "c "]
    assert hold.held == "<thi"
    assert hold.split("nk") == [""]
    assert hold.split(">x") == ["", "<think>", "x"]
    assert hold.flush() == ""


def test_a_held_prefix_that_is_no_tag_is_released() -> None:
    hold = HoldBack(THINK)
    assert hold.split("x <th") == ["x "]
    assert hold.split("e") == ["<the"]
    assert hold.split("<") == [""]
    assert hold.flush() == "<"


def test_case_rules() -> None:
    hold = HoldBack(MIXED)
    assert hold.split("<TOOL_CALL>{{TOOL_CALL}}{{tool_call}}") == [
        "",
        "<TOOL_CALL",
        ">{{TOOL_CALL}}",
        "{{tool_call",
        "}}",
    ]
    assert MIXED.canonical("<TOOL_CALL") == "<tool_call"
    assert MIXED.canonical("{{tool_call") == "{{tool_call"
    # Non-ASCII look-alikes are not folded (str.lower would make "İ" two characters).
    assert HoldBack(THINK).split("<thİnk>") == ["<thİnk>"]


def test_the_earliest_possible_prefix_is_held() -> None:
    hold = HoldBack(MIXED)
    assert hold.split("a<<") == ["a<"]
    assert hold.held == "<"


def test_quiet_is_the_fast_path() -> None:
    hold = HoldBack(THINK)
    assert hold.quiet("plain text")
    assert not hold.quiet("a < b")
    hold.split("x<")
    assert not hold.quiet("plain")  # a held prefix must be resolved first


def test_tags_need_a_tag() -> None:
    with pytest.raises(ValueError, match="at least one tag"):
        Tags()
    with pytest.raises(ValueError, match="no empty one"):
        Tags(exact=("",))


def test_a_text_full_of_tags_is_linear() -> None:
    # 20 000 tags in one delta: one regex pass, not one search per tag.
    parts = HoldBack(THINK).split("</think>x" * 20_000)
    assert len(parts) == 40_001


PIECES = ["<", ">", "/", "think", "<think>", "</think>", "<THINK>", "<thi", "nk>", "a", " ", "é"]
PIECES += ["<tool_call", "<function=", "{{tool_call", "{", "{{", "TOOL", "_call", "<fun"]
texts = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=3)), max_size=20).map("".join)


@st.composite
def split_text(draw: st.DrawFn) -> tuple[str, list[str]]:
    text = draw(texts)
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in itertools.pairwise(bounds)]


@given(split_text(), st.sampled_from([THINK, MIXED]))
@settings(deadline=None)
def test_property_any_split_finds_what_the_whole_text_does(
    split: tuple[str, list[str]], tags: Tags
) -> None:
    text, deltas = split
    whole = run(tags, [text])
    assert run(tags, deltas) == whole
    assert "".join(whole) == text
    # No tag hides in a text part, nor straddles a part boundary.
    for i, part in enumerate(whole):
        if i % 2 == 0:
            assert list(tags.finditer(part)) == []
        else:
            assert [m.group() for m in tags.finditer(part)] == [part]
