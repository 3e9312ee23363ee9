"""How an attempt ends on what its node sends (``iop.edge.runs._attempt``).

The boundary of failover: a backend's failure before any output with a 5xx
fails the attempt over to another instance (``AttemptEnd.FAILED``); a
backend's 4xx, or any failure after output, is the run's own outcome. A
``Start`` is no output (end to end: tests/e2e/test_failover_surfaces.py).
"""

from __future__ import annotations

from typing import Any, cast

import pytest

from iop._secrets import SecretMasker
from iop.edge.runs._attempt import AttemptEnd, RemoteRun, RunStart
from iop.errors import BACKEND_FAILURE_CODES, ErrorCode, backend_fails_over
from iop.events import Delta, Error, RuntimeEvent, Start
from iop.runtime import RunSink


class _Sink:
    """What a RemoteRun pushes into: the events the consumer would read."""

    def __init__(self) -> None:
        self.got: list[RuntimeEvent] = []

    def push_nowait(self, event: RuntimeEvent) -> None:
        self.got.append(event)


def _attempt(*events: RuntimeEvent) -> tuple[RemoteRun, _Sink]:
    sink = _Sink()
    rr = RemoteRun("r1", cast(RunSink, cast(Any, sink)), SecretMasker(), RunStart())
    rr.deliver(list(events))
    return rr, sink


@pytest.mark.parametrize("code", sorted(BACKEND_FAILURE_CODES))
@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_a_backend_5xx_before_output_fails_over_even_after_start(code: str, status: int) -> None:
    failure = Error(message="backend died", status=status, code=code)
    rr, sink = _attempt(Start(target="m"), failure)
    assert rr.end is AttemptEnd.FAILED
    assert rr.refusal == failure
    assert rr.detail == "backend died"
    # The consumer has the Start (a later attempt's is not forwarded again),
    # never the failure.
    assert sink.got == [Start(target="m")]


@pytest.mark.parametrize("status", [400, 404, 413, 422, 429])
def test_a_backend_4xx_is_the_runs_answer(status: int) -> None:
    refused = Error(message="context too long", status=status, code=ErrorCode.BACKEND_HTTP_ERROR)
    rr, sink = _attempt(Start(), refused)
    assert rr.end is AttemptEnd.COMPLETED
    assert sink.got == [Start(), refused]


def test_a_backend_failure_after_output_is_the_runs_error() -> None:
    broke = Error(message="stream broke", status=502, code=ErrorCode.BACKEND_STREAM_ERROR)
    rr, sink = _attempt(Start(), Delta("hi"), broke)
    assert rr.end is AttemptEnd.COMPLETED
    assert sink.got == [Start(), Delta("hi"), broke]


def test_other_5xx_codes_do_not_fail_over() -> None:
    assert not backend_fails_over(ErrorCode.INTERNAL_ERROR, 500)
    assert not backend_fails_over(ErrorCode.BAD_NODE_EVENTS, 502)
    assert backend_fails_over("backend_stream_error", 502)  # a plain str off the link
