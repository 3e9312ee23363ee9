"""OpenTelemetry traces of runs: one trace per request, across the link to the
node and on to the backend.

The trace context is W3C Trace Context's ``traceparent``
(https://www.w3.org/TR/trace-context/). It travels with a run:

* a client's ``traceparent`` header (checked, ``valid_traceparent``) is the
  parent of the edge's request span, else the edge starts a trace;
* the edge's attempt span goes to the node in the run's spec
  (``ExecutionSpec.traceparent``, inside the ``assign``);
* the node's run span is its child, and the context adapters send to the
  backend (the ``traceparent`` header on the request to vLLM, llama.cpp...,
  from ``Timeline.traceparent``), so a backend that traces joins the trace.

With tracing off (no ``[tracing] otlp_endpoint``, the default), nothing is
recorded and a client's ``traceparent`` is passed on to the backend
unchanged, as W3C Trace Context asks of a system that does not trace.

Spans are made from the run's timeline (``iop.timeline``) when the run ends,
with the times it recorded, so tracing adds no work to the hot path but a few
span objects per run: on the edge, the request span (received to terminal)
with a ``queue`` child and one ``attempt`` child per placement; on the node,
the run span (the Assign's arrival to its terminal) with a ``backend``
child (request sent to response closed). Stalls, the first output and the
cancel are span events; the outcome, node, instance and model are
attributes. Spans go to an OTLP/HTTP collector through the SDK's batch
processor (its own thread); ``Tracing.shutdown`` flushes them at exit.

The SDK is an extra (``pip install 'iop-platform[otel]'``); a config that asks for
tracing without it is refused at start-up with that command.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Final

from iop._extras import Extra, install_line
from iop.config import TracingSettings
from iop.errors import ConfigError
from iop.timeline import Timeline

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

__all__ = ["RunTrace", "Tracing", "valid_traceparent"]

# version "00": 2-32-16-2 lower-case hex digits; trace id and span id not all
# zeros (W3C Trace Context, section 3.2). A later version may append fields
# after a dash; its first four parse the same way (section 3.2.4).
_TRACEPARENT: Final = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_MAX_TRACEPARENT: Final = 512


def valid_traceparent(value: str | None) -> str:
    """``value`` if it is a well-formed ``traceparent``, else "" (then ignored)."""
    if not value or len(value) > _MAX_TRACEPARENT:
        return ""
    value = value.strip()
    m = _TRACEPARENT.fullmatch(value)
    if m is None:
        return ""
    version, trace_id, span_id, _flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest):
        return ""
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return ""
    return value


def _unix_ns(timeline: Timeline, t: float | None) -> int | None:
    """A time of ``timeline``'s clock as Unix nanoseconds (its received_unix anchors it)."""
    if t is None:
        return None
    return int((timeline.received_unix + (t - timeline.received)) * 1e9)


class RunTrace:
    """The spans of one run: the root is open from the run's start, the rest are
    made from its timeline when it ends (``finish``)."""

    def __init__(self, tracing: Tracing, root: Span, timeline: Timeline) -> None:
        self._tracing = tracing
        self.root = root
        self._timeline = timeline
        self._attempts: list[Span] = []
        self.traceparent = tracing.traceparent_of(root)

    def attempt(self, node: str, instance: str, number: int, at: float) -> str:
        """Open the span of an attempt on ``node``; the context to send it with."""
        tracer = self._tracing.tracer
        from opentelemetry import trace

        span = tracer.start_span(
            "attempt",
            context=trace.set_span_in_context(self.root),
            start_time=_unix_ns(self._timeline, at),
            attributes={"iop.node": node, "iop.instance": instance, "iop.attempt": number},
        )
        self._attempts.append(span)
        return self._tracing.traceparent_of(span)

    def finish(self) -> None:
        """End every span with the times of the run's timeline."""
        from opentelemetry import trace

        t = self._timeline
        tracer = self._tracing.tracer
        end = _unix_ns(t, t.terminal)
        root_ctx = trace.set_span_in_context(self.root)
        if t.queued is not None:
            queue = tracer.start_span(
                "queue",
                context=root_ctx,
                start_time=_unix_ns(t, t.queued),
                attributes={"iop.why_queued": t.why_queued or ""},
            )
            queue.end(end_time=_unix_ns(t, t.dequeued) or end)
        load = t.model_load
        if load is not None:
            # The wait for an on-demand model's load (docs/operations.md,
            # "Models on demand"): inside the queue's span, beside it here.
            span = tracer.start_span(
                "model_load",
                context=root_ctx,
                start_time=_unix_ns(t, load.started),
                attributes={
                    "iop.node": load.node,
                    "iop.model": load.model,
                    "iop.result": load.result or "",
                },
            )
            span.end(end_time=_unix_ns(t, load.ended) or end)
        for i, span in enumerate(self._attempts):
            placement = t.placements[i] if i < len(t.placements) else None
            if placement is not None and placement.result:
                span.set_attribute("iop.result", placement.result)
            following = t.placements[i + 1].at if i + 1 < len(t.placements) else t.terminal
            span.end(end_time=_unix_ns(t, following))
        _describe(self.root, t)
        self.root.end(end_time=end)


def _describe(span: Span, t: Timeline) -> None:
    """The run's facts on ``span``: attributes and its moments as events."""
    span.set_attribute("iop.run_id", t.run_id)
    span.set_attribute("gen_ai.request.model", t.model)
    span.set_attribute("iop.operation", t.operation)
    span.set_attribute("iop.stream", t.stream)
    if t.outcome:
        span.set_attribute("iop.outcome", t.outcome)
    if t.placements:
        span.set_attribute("iop.node", t.placements[-1].node)
        span.set_attribute("iop.instance", t.placements[-1].instance)
    if t.first_output is not None:
        span.add_event("first_output", timestamp=_unix_ns(t, t.first_output))
    for stall in t.stalls:
        span.add_event(
            f"{stall.kind.value}_stall",
            attributes={
                "iop.stall_ms": round(((stall.end or stall.start) - stall.start) * 1000, 3),
                "iop.size": stall.size,
            },
            timestamp=_unix_ns(t, stall.start),
        )
    if t.stalls_dropped:
        span.set_attribute("iop.stalls_dropped", t.stalls_dropped)
    if t.cancel_requested is not None and t.cancel_cause is not None:
        span.add_event(
            "cancel",
            attributes={"iop.cause": t.cancel_cause.value},
            timestamp=_unix_ns(t, t.cancel_requested),
        )
    if t.outcome and not t.outcome.startswith("complete"):
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, t.outcome))


class NodeRunTrace:
    """A node's run span (open from the Assign) and its backend child."""

    def __init__(self, tracing: Tracing, root: Span, timeline: Timeline) -> None:
        self._tracing = tracing
        self.root = root
        self._timeline = timeline
        self.traceparent = tracing.traceparent_of(root)

    def finish(self) -> None:
        from opentelemetry import trace

        t = self._timeline
        if t.backend_sent is not None:
            backend = self._tracing.tracer.start_span(
                "backend",
                context=trace.set_span_in_context(self.root),
                start_time=_unix_ns(t, t.backend_sent),
            )
            if t.backend_first_byte is not None:
                backend.add_event("response_head", timestamp=_unix_ns(t, t.backend_first_byte))
            backend.end(end_time=_unix_ns(t, t.backend_closed or t.terminal))
        _describe(self.root, t)
        # The adapter closes its backend response after its terminal event.
        ends = [x for x in (t.terminal, t.backend_closed) if x is not None]
        self.root.end(end_time=_unix_ns(t, max(ends)) if ends else None)


class Tracing:
    """The process's tracer (one per edge or node, even in one process).

    Args:
        settings: ``[tracing]``.
        service: The ``service.name`` when the settings give none.
        exporter: Where spans go instead of OTLP (tests).
    """

    def __init__(
        self, settings: TracingSettings, service: str, *, exporter: SpanExporter | None = None
    ) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as exc:  # pragma: no cover - the extra is in dev
            raise ConfigError(
                "tracing.otlp_endpoint is set but OpenTelemetry's SDK is not installed: "
                + install_line(Extra.OTEL)
            ) from exc
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(
                endpoint=settings.otlp_endpoint,
                headers=dict(settings.otlp_headers),
                timeout=settings.export_timeout_s,
            )
        self.provider: TracerProvider = TracerProvider(
            resource=Resource.create({"service.name": settings.service_name or service}),
            sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
        )
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer: Tracer = self.provider.get_tracer("iop")
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def from_settings(cls, settings: TracingSettings, service: str) -> Tracing | None:
        """A tracer when ``settings`` ask for one, else None (tracing off)."""
        return cls(settings, service) if settings.otlp_endpoint else None

    def traceparent_of(self, span: Span) -> str:
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier.get("traceparent", "")

    def _parent(self, traceparent: str) -> Any:
        return self._propagator.extract({"traceparent": traceparent}) if traceparent else None

    def request(self, timeline: Timeline, traceparent: str, name: str) -> RunTrace:
        """The edge's trace of a run: its request span, child of ``traceparent``."""
        from opentelemetry.trace import SpanKind

        root = self.tracer.start_span(
            name,
            context=self._parent(traceparent),
            kind=SpanKind.SERVER,
            start_time=_unix_ns(timeline, timeline.received),
        )
        return RunTrace(self, root, timeline)

    def node_run(self, timeline: Timeline, traceparent: str, name: str) -> NodeRunTrace:
        """The node's trace of a run: its run span, child of the edge's attempt."""
        from opentelemetry.trace import SpanKind

        root = self.tracer.start_span(
            name,
            context=self._parent(traceparent),
            kind=SpanKind.SERVER,
            start_time=_unix_ns(timeline, timeline.received),
        )
        return NodeRunTrace(self, root, timeline)

    def shutdown(self) -> None:
        """Send what is buffered and stop (blocking: ``aclose`` runs it in a thread)."""
        self.provider.shutdown()

    async def aclose(self, timeout_s: float) -> None:
        """``shutdown`` in a worker thread, given up after ``timeout_s`` (the
        exporter's own timeout bounds each export; the thread is abandoned
        past this one)."""
        import trio

        with trio.move_on_after(timeout_s, shield=True):
            await trio.to_thread.run_sync(self.shutdown, abandon_on_cancel=True)
