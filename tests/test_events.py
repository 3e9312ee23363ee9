"""``iop.events``: what the hot path assumes of the event types."""

from __future__ import annotations

import importlib
import typing

import pytest

from iop.events import (
    TERMINAL_EVENT_TYPES,
    Cancelled,
    CancelReason,
    Complete,
    Delta,
    Error,
    ReasoningDelta,
    RuntimeEvent,
    Start,
    is_terminal,
)


def _all_subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_all_subclasses(sub)]
    return out


@pytest.mark.parametrize("cls", typing.get_args(RuntimeEvent))
def test_event_types_have_no_subclasses(cls: type) -> None:
    # is_terminal looks the exact type up in a set (it is called several
    # times per event): a subclass of a terminal type would not be terminal.
    # Every package that might define one is imported first.
    for package in ("iop.api", "iop.edge", "iop.node", "iop.runtime", "iop.adapters"):
        importlib.import_module(package)

    assert _all_subclasses(cls) == []


def test_is_terminal() -> None:
    terminal = [Complete(), Error(code="x", message="y"), Cancelled(reason=CancelReason.EXPLICIT)]
    assert {type(e) for e in terminal} == set(TERMINAL_EVENT_TYPES)
    assert all(is_terminal(e) for e in terminal)
    assert not any(is_terminal(e) for e in (Start(), Delta("a"), ReasoningDelta("b")))
