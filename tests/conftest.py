"""Fixtures shared by test folders: a real Valkey (tests/_valkey.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests._valkey import Valkey


@pytest.fixture(scope="session")
def valkey_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Valkey]:
    """One ``valkey-server`` for the session (tests flush it or use their own prefix)."""
    v = Valkey(tmp_path_factory.mktemp("valkey"))
    v.start()
    try:
        yield v
    finally:
        v.kill()
