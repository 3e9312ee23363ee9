"""Streaming hold-back: find tags in text that arrives in pieces (sans-IO).

Two parts of the output policy watch a model's streamed text for markup
before the client may see it: ``<think>`` stripping (``iop.api._output``)
and the tool-call text filter (``ToolTextFilter``). Both need the same
thing, and this module is that one mechanism: split text, fed delta by
delta, at the *tags* it contains, and hold back a trailing part that could
still become a tag (``"<"``, ``"<thi"``, ``"{{tool"``) until the next delta
or the end of the text says whether it is one. What each policy does at a
tag (drop a block, hold everything after an opener) is its own business.

Guarantees, for every way of splitting a text into deltas:

* the parts returned by all ``split`` calls, then ``flush()``, concatenate
  to the text, and the tags among them are exactly the tags a single
  ``split`` of the whole text finds (leftmost first, not overlapping);
* nothing released as text is, or begins, a tag: at any moment the held
  tail is empty or a proper prefix of a tag.

Tags are matched ASCII case-insensitively (``Tags(folded=...)``), which keeps
indexes aligned and agrees with the tool-text parser's ``re.ASCII`` rules, or
exactly (``Tags(exact=...)``). The scan is one regular-expression pass per
delta plus a look at its last few characters, so a text full of tags costs
linear time, and a delta that holds no tag's first character and follows no
held tail is passed through untouched (``quiet``).
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable
from typing import Final

__all__ = ["HoldBack", "Tags"]

_ASCII_LOWER: Final = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def fold(text: str) -> str:
    """``text`` with ASCII letters lower-cased (same length, unlike ``str.lower``)."""
    return text.translate(_ASCII_LOWER)


class Tags:
    """The tags a ``HoldBack`` watches for.

    Args:
        folded: Tags matched ASCII case-insensitively (``"<think>"`` also
            matches ``"<THINK>"``).
        exact: Tags matched as written.
    """

    __slots__ = ("_exact", "_folded", "_longest", "_pattern", "_prefixes", "starts")

    def __init__(self, *, folded: Iterable[str] = (), exact: Iterable[str] = ()) -> None:
        self._folded = frozenset(fold(t) for t in folded)
        self._exact = frozenset(exact)
        tags = sorted(self._folded | self._exact, key=len, reverse=True)
        if not tags or not all(tags):
            raise ValueError("Tags needs at least one tag, and no empty one")
        alternatives = [
            f"(?i:{re.escape(t)})" if t in self._folded else re.escape(t)
            for t in sorted(self._folded, key=len, reverse=True)
        ] + [re.escape(t) for t in sorted(self._exact, key=len, reverse=True)]
        # Longest first: at one position the longest tag wins, as a greedy scan would.
        self._pattern = re.compile("|".join(alternatives), re.ASCII)
        self._longest = len(tags[0])
        # (prefix, folded?) for every proper prefix of every tag.
        self._prefixes = frozenset(
            [(t[:i], True) for t in self._folded for i in range(1, len(t))]
            + [(t[:i], False) for t in self._exact for i in range(1, len(t))]
        )
        self.starts: tuple[str, ...] = tuple({c for t in tags for c in (t[0], t[0].upper())})
        """Every character a tag may begin with."""

    def canonical(self, tag: str) -> str:
        """The tag as declared, for ``tag`` as it was found in the text."""
        low = fold(tag)
        return low if low in self._folded and tag not in self._exact else tag

    def may_start(self, text: str) -> bool:
        """False when no tag can begin anywhere in ``text`` (the fast path)."""
        for c in self.starts:  # noqa: SIM110 (any() costs a generator per delta)
            if c in text:
                return True
        return False

    def partial(self, text: str, start: int = 0) -> int:
        """Where the longest suffix of ``text[start:]`` that is a proper tag prefix
        begins; ``len(text)`` when there is none."""
        n = len(text)
        first = max(start, n - self._longest + 1)
        if not self.may_start(text[first:]):
            return n
        prefixes = self._prefixes
        for i in range(first, n):
            tail = text[i:]
            if (fold(tail), True) in prefixes or (tail, False) in prefixes:
                return i
        return n

    def finditer(self, text: str, start: int = 0) -> Iterable[re.Match[str]]:
        """The tags in ``text[start:]``, leftmost first, not overlapping."""
        return self._pattern.finditer(text, start)


class HoldBack:
    """Splits streamed text at tags, holding back what could still become one.

    Feed deltas to ``split``; each call returns the parts decided so far as
    ``[text, tag, text, tag, ..., text]``: even indexes are text (possibly
    ``""``), odd ones the tags found, as written. A trailing proper prefix of
    a tag is kept (``held``) and prepended to the next delta; ``flush()``
    returns it at the end of the text. See the module docstring for the
    guarantees.
    """

    __slots__ = ("_starts", "_tail", "tags")

    def __init__(self, tags: Tags) -> None:
        self.tags = tags
        self._starts = tags.starts
        self._tail = ""

    @property
    def held(self) -> str:
        """The text held back: empty, or a proper prefix of a tag."""
        return self._tail

    def quiet(self, text: str) -> bool:
        """True when ``split(text)`` would be ``[text]``, known cheaply: nothing is
        held and no tag can begin in ``text``."""
        if self._tail:
            return False
        for c in self._starts:  # noqa: SIM110 (may_start inlined: runs once per delta)
            if c in text:
                return False
        return True

    def split(self, text: str) -> list[str]:
        """Add ``text``; return ``[text, tag, ..., text]`` as decided so far."""
        s = self._tail + text if self._tail else text
        if not self._tail and not self.tags.may_start(s):
            return [s]
        parts: list[str] = []
        pos = 0
        for m in self.tags.finditer(s):
            parts.append(s[pos : m.start()])
            parts.append(m.group())
            pos = m.end()
        cut = self.tags.partial(s, pos)
        parts.append(s[pos:cut])
        self._tail = s[cut:]
        return parts

    def flush(self) -> str:
        """End of text: return the held tail (it did not become a tag) and reset."""
        tail, self._tail = self._tail, ""
        return tail
