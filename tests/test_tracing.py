"""OpenTelemetry traces of runs (iop.tracing): the W3C context check, and the
spans a run's timeline becomes, with the SDK's in-memory exporter."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from iop.config import TracingSettings
from iop.events import Cancelled, CancelReason, Complete
from iop.timeline import ModelLoad, Placement, Stall, StallKind, Timeline
from iop.tracing import Tracing, valid_traceparent

CLIENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
UNSAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        (CLIENT, True),
        (UNSAMPLED, True),
        ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-future", True),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x", False),  # 00 has no more
        ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", False),
        ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", False),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", False),
        ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", False),  # upper case
        ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", False),
        ("", False),
        (None, False),
        ("x" * 10_000, False),
    ],
)
def test_a_traceparent_is_checked(value: str | None, ok: bool) -> None:
    assert valid_traceparent(value) == (value if ok else "")


@given(st.text(max_size=80))
def test_any_header_value_is_either_kept_whole_or_dropped(value: str) -> None:
    assert valid_traceparent(value) in ("", value.strip())


def tracing(ratio: float = 1.0) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    settings = TracingSettings(otlp_endpoint="http://collector:4318/v1/traces", sample_ratio=ratio)
    return Tracing(settings, "iop-edge", exporter=exporter), exporter


def edge_timeline() -> Timeline:
    t = Timeline(run_id="r1", model="m", operation="chat", received_unix=1000.0, received=50.0)
    t.queued, t.why_queued, t.dequeued = 50.0, "every slot busy: n1/i 1/1", 50.2
    t.placements.append(Placement(attempt=1, node="a", instance="i", at=50.2, result="lost: x"))
    t.placements.append(Placement(attempt=2, node="b", instance="i", at=50.3, result="ran"))
    t.first_output = 50.5
    t.stalls.append(Stall(kind=StallKind.CREDIT, start=50.6, end=50.7, size=8))
    t.end(51.0, Complete())
    return t


def test_a_runs_wait_for_its_models_load_is_a_span_of_its_own() -> None:
    tr, exporter = tracing()
    t = edge_timeline()
    t.model_load = ModelLoad(node="a", model="m", started=50.0, ended=50.15, result="ready")
    trace = tr.request(t, CLIENT, "chat m")
    trace.finish()
    tr.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    load = spans["model_load"]
    assert load.parent is not None
    assert load.parent.span_id == spans["chat m"].context.span_id
    assert (load.start_time, load.end_time) == (1000 * 10**9, int(1000.15 * 1e9))
    assert dict(load.attributes or {}) == {"iop.node": "a", "iop.model": "m", "iop.result": "ready"}


def test_a_run_becomes_a_request_span_with_queue_and_attempts() -> None:
    tr, exporter = tracing()
    t = edge_timeline()
    trace = tr.request(t, CLIENT, "chat m")
    first = trace.attempt("a", "i", 1, 50.2)
    second = trace.attempt("b", "i", 2, 50.3)
    trace.finish()
    tr.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"chat m", "queue", "attempt"}
    attempts = [s for s in exporter.get_finished_spans() if s.name == "attempt"]
    root = spans["chat m"]
    # The client's trace, the client's span as the parent.
    assert f"{root.context.trace_id:032x}" == CLIENT[3:35]
    assert root.parent is not None
    assert f"{root.parent.span_id:016x}" == CLIENT[36:52]
    assert root.kind is SpanKind.SERVER
    assert (root.start_time, root.end_time) == (1000 * 10**9, 1001 * 10**9)
    for span in (spans["queue"], *attempts):
        assert span.parent is not None
        assert span.parent.span_id == root.context.span_id
    assert spans["queue"].end_time == int(1000.2 * 1e9)
    # Each attempt lasts until the next one started, the last until the end.
    assert [(s.start_time, s.end_time) for s in attempts] == [
        (int(1000.2 * 1e9), int(1000.3 * 1e9)),
        (int(1000.3 * 1e9), 1001 * 10**9),
    ]
    assert [s.attributes["iop.result"] for s in attempts] == ["lost: x", "ran"]
    # What goes to each node names its attempt's span, in the same trace.
    assert first != second
    assert first[3:35] == second[3:35] == CLIENT[3:35]
    assert first[36:52] == f"{attempts[0].context.span_id:016x}"
    assert root.attributes["iop.outcome"] == "complete:stop"
    assert root.attributes["iop.node"] == "b"
    assert [e.name for e in root.events] == ["first_output", "credit_stall"]
    assert root.status.status_code is StatusCode.UNSET


def test_a_cancelled_run_is_an_error_span_with_its_cause() -> None:
    tr, exporter = tracing()
    t = Timeline(run_id="r2", model="m", received_unix=1000.0, received=0.0)
    trace = tr.request(t, "", "chat m")  # no client context: a trace of its own
    t.cancel(0.5, CancelReason.CLIENT_DISCONNECT)
    t.end(0.6, Cancelled(reason=CancelReason.CLIENT_DISCONNECT))
    trace.finish()
    tr.shutdown()
    (root,) = exporter.get_finished_spans()
    assert root.parent is None
    assert root.status.status_code is StatusCode.ERROR
    (cancel,) = root.events
    assert cancel.name == "cancel"
    assert cancel.attributes is not None
    assert cancel.attributes["iop.cause"] == "client_disconnect"


def test_a_node_run_span_is_the_child_of_the_edges_attempt_with_its_backend() -> None:
    tr, exporter = tracing()
    edge = tr.request(edge_timeline(), "", "chat m")
    sent = edge.attempt("n1", "i", 1, 50.2)
    t = Timeline(run_id="r1", model="m", received_unix=2000.0, received=7.0)
    t.backend_sent, t.backend_first_byte, t.backend_closed = 7.01, 7.1, 7.9
    t.first_output = 7.2
    t.end(8.0, Complete())
    node = tr.node_run(t, sent, "chat m")
    node.finish()
    tr.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    run, backend = spans["chat m"], spans["backend"]
    assert run.parent is not None
    assert f"{run.parent.span_id:016x}" == sent[36:52]
    assert backend.parent is not None
    assert backend.parent.span_id == run.context.span_id
    assert (backend.start_time, backend.end_time) == (int(2000.01 * 1e9), int(2000.9 * 1e9))
    # The backend is sent the node run's context.
    assert node.traceparent[36:52] == f"{run.context.span_id:016x}"


def test_an_unsampled_client_trace_records_nothing_but_still_propagates() -> None:
    tr, exporter = tracing()
    t = edge_timeline()
    trace = tr.request(t, UNSAMPLED, "chat m")
    sent = trace.attempt("a", "i", 1, 50.2)
    trace.finish()
    tr.shutdown()
    assert exporter.get_finished_spans() == ()
    assert sent[3:35] == UNSAMPLED[3:35]
    assert sent.endswith("-00")


def test_a_sample_ratio_of_zero_keeps_no_new_trace() -> None:
    tr, exporter = tracing(ratio=0.0)
    trace = tr.request(edge_timeline(), "", "chat m")
    trace.finish()
    tr.shutdown()
    assert exporter.get_finished_spans() == ()


def test_tracing_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="otlp_endpoint"):
        TracingSettings(otlp_endpoint="collector:4318")
    with pytest.raises(ValueError, match="sample_ratio"):
        TracingSettings(sample_ratio=1.5)
    assert Tracing.from_settings(TracingSettings(), "iop-edge") is None
