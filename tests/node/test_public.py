"""``iop.node``'s public surface is explicit."""

from __future__ import annotations

import iop.node


def test_all_names_exist_and_are_public() -> None:
    for name in iop.node.__all__:
        assert hasattr(iop.node, name), name
        assert not name.startswith("_"), name


def test_nothing_public_outside_all() -> None:
    # "@py_builtins" and "@pytest_ar": pytest's assertion rewriting, which it
    # applies to the packages of installed plugins (iop.testing's is one).
    public = {n for n in dir(iop.node) if not n.startswith(("_", "@"))}
    assert public <= set(iop.node.__all__)
