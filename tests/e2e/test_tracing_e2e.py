"""OpenTelemetry across processes: a client's ``traceparent`` through a real
edge and node (each with ``[tracing] otlp_endpoint``) to the sim backend; the
spans both processes export over OTLP/HTTP to a collector played here (the
protobuf bodies decoded with OpenTelemetry's own ``opentelemetry-proto``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.e2e._platform import MODEL, Procs, poll

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"
SLACK_NS = 20_000_000


class Collector:
    """An OTLP/HTTP traces endpoint: every span received, with its service."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                export = ExportTraceServiceRequest()
                export.ParseFromString(body)
                collector._add(export)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/traces"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _add(self, export: ExportTraceServiceRequest) -> None:
        with self._lock:
            for resource_spans in export.resource_spans:
                service = next(
                    a.value.string_value
                    for a in resource_spans.resource.attributes
                    if a.key == "service.name"
                )
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        self.spans.append(
                            {
                                "service": service,
                                "name": span.name,
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent": span.parent_span_id.hex(),
                                "start": span.start_time_unix_nano,
                                "end": span.end_time_unix_nano,
                                "attributes": {
                                    a.key: a.value.string_value or a.value.int_value
                                    for a in span.attributes
                                },
                            }
                        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    try:
        yield c
    finally:
        c.close()


def test_one_trace_from_the_client_through_edge_and_node_to_the_backend(
    procs: Procs, collector: Collector
) -> None:
    sim = procs.sim()
    tracing = {"otlp_endpoint": collector.url}
    edge = procs.edge({"tracing": tracing})
    procs.node([edge], sim, tracing=tracing)
    edge.wait_ready()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.Client(base_url=edge.url, timeout=30) as client:
        resp = client.post("/v1/chat/completions", json=body, headers={"traceparent": CLIENT})
    assert resp.status_code == 200
    run_id = resp.text.split('"id":"chatcmpl-', 1)[1].split('"', 1)[0]

    def ours() -> list[dict[str, Any]]:
        return [s for s in collector.spans if s["trace_id"] == TRACE_ID]

    poll(
        lambda: {"iop-edge", "iop-node"} <= {s["service"] for s in ours()} and len(ours()) >= 4,
        timeout=20.0,
        what="the edge's and the node's spans at the collector (batched every 5 s)",
    )
    spans = {(s["service"], s["name"]): s for s in ours()}
    request = spans[("iop-edge", f"chat {MODEL}")]
    attempt = spans[("iop-edge", "attempt")]
    node_run = spans[("iop-node", f"chat {MODEL}")]
    backend = spans[("iop-node", "backend")]
    # One trace, parented all the way down from the client's span.
    assert request["parent"] == CLIENT[36:52]
    assert attempt["parent"] == request["span_id"]
    assert node_run["parent"] == attempt["span_id"]
    assert backend["parent"] == node_run["span_id"]
    assert request["attributes"]["iop.run_id"] == run_id
    assert request["attributes"]["iop.outcome"] == "complete:stop"
    assert node_run["attributes"]["iop.run_id"] == run_id
    # The backend was sent the node run's context.
    (sent,) = [t for t in sim.stats()["traceparents"] if t[3:35] == TRACE_ID]
    assert sent[36:52] == node_run["span_id"]
    # And the run's timeline names the trace.
    timeline = edge.get(f"/admin/runs/{run_id}").json()
    assert timeline["trace_id"] == TRACE_ID
    # Times are wall-clock and nested (within the clocks' round trip: one host here).
    # Times are wall-clock and nested: exactly within a process; across the
    # two, each process maps its own clock (SLACK_NS: a loaded 2-core box).
    assert request["start"] <= attempt["start"] <= attempt["end"] <= request["end"]
    assert node_run["start"] <= backend["start"] <= backend["end"] <= node_run["end"]
    assert attempt["start"] <= node_run["start"] + SLACK_NS
    assert node_run["end"] <= request["end"] + SLACK_NS


def test_without_tracing_the_clients_context_reaches_the_backend_unchanged(
    procs: Procs,
) -> None:
    sim = procs.sim()
    edge = procs.edge({})
    procs.node([edge], sim)
    edge.wait_ready()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=edge.url, timeout=30) as client:
        resp = client.post("/v1/chat/completions", json=body, headers={"traceparent": CLIENT})
        assert resp.status_code == 200
        bad = client.post(
            "/v1/chat/completions", json=body, headers={"traceparent": "00-zz-not-a-context"}
        )
        assert bad.status_code == 200
    assert sim.stats()["traceparents"] == [CLIENT]
