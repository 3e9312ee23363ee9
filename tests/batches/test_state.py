"""A batch's one state machine (iop.batches._state): the table, walked by hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop.batches import (
    ACTIVE,
    FINAL,
    TIMESTAMPS,
    TRANSITIONS,
    BadTransition,
    BatchEvent,
    BatchRow,
    BatchStatus,
    advance,
)

S, E = BatchStatus, BatchEvent


def _row() -> BatchRow:
    return BatchRow(
        id="batch_1",
        tenant="t",
        endpoint="/v1/chat/completions",
        model="m",
        input_file_id="file-1",
        completion_window="24h",
        created_at=1,
        expires_at=86_401,
    )


def test_the_happy_path_stamps_each_state() -> None:
    row = _row()
    for t, event in enumerate((E.VALIDATED, E.LINES_DONE, E.FINALIZED), start=10):
        row.advance(event, t)
    assert row.status is S.COMPLETED
    assert (row.in_progress_at, row.finalizing_at, row.completed_at) == (10, 11, 12)


@pytest.mark.parametrize("final", sorted(FINAL))
def test_a_final_batch_cannot_be_cancelled_409(final: BatchStatus) -> None:
    with pytest.raises(BadTransition) as info:
        advance(final, E.CANCEL)
    assert info.value.status == 409
    assert f"'{final.value}'" in info.value.message


def test_every_state_is_final_or_active_and_reachable() -> None:
    assert set(BatchStatus) == FINAL | ACTIVE
    assert not FINAL & ACTIVE
    reached = {S.VALIDATING} | set(TRANSITIONS.values())
    assert reached == set(BatchStatus)
    assert all(s in TIMESTAMPS for s in BatchStatus if s is not S.VALIDATING)
    assert not any(s in FINAL for s, _ in TRANSITIONS)


@given(st.lists(st.sampled_from(list(BatchEvent)), max_size=30))
def test_any_sequence_of_events_keeps_the_table(events: list[BatchEvent]) -> None:
    row = _row()
    stamped: set[str] = set()
    for now, event in enumerate(events, start=1):
        before = row.status
        try:
            row.advance(event, now)
        except BadTransition:
            assert (before, event) not in TRANSITIONS
            assert row.status is before  # a refused event changes nothing
            continue
        assert row.status is TRANSITIONS[before, event]
        field = TIMESTAMPS[row.status]
        assert getattr(row, field) == now
        assert field not in stamped  # no state is entered twice
        stamped.add(field)
        if row.status in FINAL:
            # Nothing leaves a final state.
            assert all((row.status, e) not in TRANSITIONS for e in BatchEvent)
    # Cancelling is only ever left for cancelled.
    assert row.status is not S.CANCELLING or row.cancelled_at is None
