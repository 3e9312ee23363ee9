"""What the session module's docstring cites (``iop.protocol._session``)."""

from __future__ import annotations

import importlib
import re

import pytest

import iop.protocol._session as session_module


@pytest.mark.parametrize(
    "dotted", sorted(set(re.findall(r"``(iop(?:\.\w+)+)``", session_module.__doc__ or "")))
)
def test_the_session_docstring_names_what_exists(dotted: str) -> None:
    """Each ``iop.…`` name the module docstring cites can be opened (it once
    cited an ``iop.runtime.drive_link`` that did not exist)."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for name in parts[split:]:
            assert hasattr(obj, name), f"{dotted}: no {name}"
            obj = getattr(obj, name)
        return
    pytest.fail(f"{dotted}: no such module")  # pragma: no cover
