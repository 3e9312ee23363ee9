"""``[batches]``: every bound is crossed, and the store's default place."""

from __future__ import annotations

from typing import Any

import pytest

from iop.config import (
    MAX_BATCH_CONCURRENCY,
    MAX_BATCH_FILE_BYTES,
    MAX_BATCH_LINES,
    BatchSettings,
    EdgeConfig,
    Objective,
)


@pytest.mark.parametrize(
    ("key", "good", "bad"),
    [
        ("max_file_bytes", MAX_BATCH_FILE_BYTES, MAX_BATCH_FILE_BYTES + 1),
        ("max_file_bytes", 1, 0),
        ("max_lines", MAX_BATCH_LINES, MAX_BATCH_LINES + 1),
        ("max_lines", 1, 0),
        ("max_concurrent_per_batch", MAX_BATCH_CONCURRENCY, MAX_BATCH_CONCURRENCY + 1),
        ("max_concurrent", 1, 0),
        ("retry_initial_s", 0.01, 0.001),
        ("retry_max_s", 3600.0, 3601.0),
        ("objective", "nightly.batch", "no spaces"),
    ],
)
def test_each_bound_is_crossed(key: str, good: Any, bad: Any) -> None:
    BatchSettings(**{key: good})
    with pytest.raises(ValueError, match=key):
        BatchSettings(**{key: bad})


def test_the_initial_pause_is_no_longer_than_the_longest() -> None:
    with pytest.raises(ValueError, match="retry_initial_s"):
        BatchSettings(retry_initial_s=2.0, retry_max_s=1.0)


def test_the_store_is_beside_the_ledger_else_in_memory() -> None:
    assert BatchSettings(path="/x/b.db").store_path("/var/l.sqlite3") == "/x/b.db"
    assert BatchSettings().store_path("/var/iop/l.sqlite3") == "/var/iop/batches.sqlite3"
    assert BatchSettings().store_path("") == ":memory:"


def test_a_configured_objective_of_the_name_is_used_as_it_is() -> None:
    mine = Objective(name="batch", priority=-5, sheddable=False)
    assert EdgeConfig(objectives=[mine]).batch_objective() == mine
    built_in = EdgeConfig().batch_objective()
    assert (built_in.priority, built_in.sheddable) == (-1000, True)
