"""IOP's public testing kit.

* **Transcripts**: byte-exact recordings of real backends in
  ``transcripts/``, read with ``load_transcript`` / ``transcript_body``
  (which also unpacks the ``real-*`` terminal captures).
* **FakeBackend**: a real HTTP/1.1 server on loopback (trio + h11) that
  replays scripted ``Reply``s and misbehaves on request: split writes,
  pauses, stalls, truncation, resets; it records requests and sees when its
  client hangs up. ``FakeTransport`` plays the same scripts in memory.
* **Conformance kit**: ``Scenario``s and the ``check_*`` functions that every
  adapter passes (``_conformance``), and a ``Harness`` per adapter that makes
  it play them (``_harnesses``).
* **Processes**: ``Proc`` runs ``python -m iop ...`` (or any command) with its
  output in files and stops it by PID; ``poll`` waits with a deadline; the
  ``*_READY`` patterns parse the CLIs' start-up lines. The end-to-end tests
  and ``scripts/bench_platform.py`` share it.
* **Platforms** for users' own tests (docs/testing-kit.md): ``start_platform``
  runs a fake backend (or ``iop sim``), ``iop edge`` and ``iop node`` on
  loopback (``LoopbackPlatform``); ``open_virtual_platform`` wires the same
  parts in memory for virtual time (``VirtualPlatform``); ``Fault`` says how
  the backend misbehaves; ``ClientStream`` and ``assert_one_terminal`` check
  what a client received. The pytest plugin (``iop.testing._plugin``, entry
  point ``iop``) turns them into fixtures.

Names are imported on first use (PEP 562), so that importing this package,
as pytest does when it loads the plugin, costs nothing until a name is used.
"""

from __future__ import annotations

# Private aliases: every public name of this module is in __all__.
import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from iop.testing._conformance import (
        CANCEL_LATENCIES,
        CHECKS,
        DEADLINE_SLACK_S,
        MAX_ERROR_MESSAGE_BYTES,
        PROTOCOL_ERROR_CODES,
        STALL_DEADLINE_S,
        UPSTREAM_CLOSE_BOUND_S,
        CancelLatency,
        ConformanceError,
        Expectation,
        ExpectedToolCall,
        Harness,
        LatencySummary,
        Scenario,
        ScenarioCase,
        ScenarioUnsupported,
        UpstreamClosed,
        check_backend_4xx,
        check_backend_5xx,
        check_cancel_mid_stream,
        check_connection_refused,
        check_malformed_chunk,
        check_malformed_chunk_over_limit,
        check_missing_done,
        check_oversize_line,
        check_plain_stream,
        check_reasoning,
        check_scenario,
        check_stall_before_first_byte,
        check_stall_mid_stream,
        check_streamed_tool_calls,
        check_truncated_stream,
        latency_summary,
    )
    from iop.testing._fake_backend import (
        CHAT_COMPLETIONS_PATH,
        MODELS_PATH,
        Abort,
        CloseCause,
        ConnectFailure,
        Connection,
        ConnState,
        FakeBackend,
        FakeTransport,
        Pause,
        RecordedRequest,
        Reply,
        ReplyHandler,
        Split,
        SplitMode,
        Stall,
        Step,
        TransportResponse,
        Write,
        open_fake_backend,
    )
    from iop.testing._faults import (
        Fault,
        FaultKind,
        event_ends,
        synthetic_stream,
    )
    from iop.testing._harnesses import OpenAICompatHarness, SimHarness, VllmHarness
    from iop.testing._memory_link import (
        MEMORY_LINK_BUFFER,
        MemoryFrameChannel,
        memory_link_pair,
    )
    from iop.testing._platform import (
        FAKE_MODEL,
        NODE_TOKEN,
        LoopbackPlatform,
        PlatformMark,
        SlowReader,
        loopback_platform,
        start_platform,
    )
    from iop.testing._plugin import PlatformFactory, VirtualRunner
    from iop.testing._processes import (
        EDGE_READY,
        NODE_READY,
        POLL_S,
        SIM_READY,
        START_TIMEOUT_S,
        STOP_GRACE_S,
        UP_READY,
        Proc,
        free_port,
        poll,
        toml_dumps,
    )
    from iop.testing._replay_server import RequestRecord
    from iop.testing._streams import (
        ClientStream,
        StreamEnd,
        assert_one_terminal,
        count_terminals,
    )
    from iop.testing._transcripts import (
        CapturedExchange,
        captured_exchanges,
        list_transcripts,
        load_transcript,
        parse_capture,
        transcript_body,
    )
    from iop.testing._virtual import (
        ASGIStreamTransport,
        VirtualMark,
        VirtualPlatform,
        open_virtual_platform,
        run_virtual,
        task_count,
    )

# Each public name and the module it lives in.
_EXPORTS: dict[str, str] = {
    # The plugin's fixture types (importing them imports pytest).
    "PlatformFactory": "iop.testing._plugin",
    "VirtualRunner": "iop.testing._plugin",
    "RequestRecord": "iop.testing._replay_server",
    "CANCEL_LATENCIES": "iop.testing._conformance",
    "CHECKS": "iop.testing._conformance",
    "DEADLINE_SLACK_S": "iop.testing._conformance",
    "MAX_ERROR_MESSAGE_BYTES": "iop.testing._conformance",
    "PROTOCOL_ERROR_CODES": "iop.testing._conformance",
    "STALL_DEADLINE_S": "iop.testing._conformance",
    "UPSTREAM_CLOSE_BOUND_S": "iop.testing._conformance",
    "CancelLatency": "iop.testing._conformance",
    "ConformanceError": "iop.testing._conformance",
    "Expectation": "iop.testing._conformance",
    "ExpectedToolCall": "iop.testing._conformance",
    "Harness": "iop.testing._conformance",
    "LatencySummary": "iop.testing._conformance",
    "OpenAICompatHarness": "iop.testing._harnesses",
    "Scenario": "iop.testing._conformance",
    "ScenarioCase": "iop.testing._conformance",
    "ScenarioUnsupported": "iop.testing._conformance",
    "SimHarness": "iop.testing._harnesses",
    "UpstreamClosed": "iop.testing._conformance",
    "VllmHarness": "iop.testing._harnesses",
    "check_backend_4xx": "iop.testing._conformance",
    "check_backend_5xx": "iop.testing._conformance",
    "check_cancel_mid_stream": "iop.testing._conformance",
    "check_connection_refused": "iop.testing._conformance",
    "check_malformed_chunk": "iop.testing._conformance",
    "check_malformed_chunk_over_limit": "iop.testing._conformance",
    "check_missing_done": "iop.testing._conformance",
    "check_oversize_line": "iop.testing._conformance",
    "check_plain_stream": "iop.testing._conformance",
    "check_reasoning": "iop.testing._conformance",
    "check_scenario": "iop.testing._conformance",
    "check_stall_before_first_byte": "iop.testing._conformance",
    "check_stall_mid_stream": "iop.testing._conformance",
    "check_streamed_tool_calls": "iop.testing._conformance",
    "check_truncated_stream": "iop.testing._conformance",
    "latency_summary": "iop.testing._conformance",
    "CHAT_COMPLETIONS_PATH": "iop.testing._fake_backend",
    "MODELS_PATH": "iop.testing._fake_backend",
    "Abort": "iop.testing._fake_backend",
    "CloseCause": "iop.testing._fake_backend",
    "ConnectFailure": "iop.testing._fake_backend",
    "Connection": "iop.testing._fake_backend",
    "ConnState": "iop.testing._fake_backend",
    "FakeBackend": "iop.testing._fake_backend",
    "FakeTransport": "iop.testing._fake_backend",
    "Pause": "iop.testing._fake_backend",
    "RecordedRequest": "iop.testing._fake_backend",
    "Reply": "iop.testing._fake_backend",
    "ReplyHandler": "iop.testing._fake_backend",
    "Split": "iop.testing._fake_backend",
    "SplitMode": "iop.testing._fake_backend",
    "Stall": "iop.testing._fake_backend",
    "Step": "iop.testing._fake_backend",
    "Write": "iop.testing._fake_backend",
    "open_fake_backend": "iop.testing._fake_backend",
    "TransportResponse": "iop.testing._fake_backend",
    "MEMORY_LINK_BUFFER": "iop.testing._memory_link",
    "MemoryFrameChannel": "iop.testing._memory_link",
    "memory_link_pair": "iop.testing._memory_link",
    "EDGE_READY": "iop.testing._processes",
    "NODE_READY": "iop.testing._processes",
    "POLL_S": "iop.testing._processes",
    "SIM_READY": "iop.testing._processes",
    "START_TIMEOUT_S": "iop.testing._processes",
    "STOP_GRACE_S": "iop.testing._processes",
    "UP_READY": "iop.testing._processes",
    "Proc": "iop.testing._processes",
    "free_port": "iop.testing._processes",
    "poll": "iop.testing._processes",
    "toml_dumps": "iop.testing._processes",
    "CapturedExchange": "iop.testing._transcripts",
    "captured_exchanges": "iop.testing._transcripts",
    "list_transcripts": "iop.testing._transcripts",
    "load_transcript": "iop.testing._transcripts",
    "parse_capture": "iop.testing._transcripts",
    "transcript_body": "iop.testing._transcripts",
    "Fault": "iop.testing._faults",
    "FaultKind": "iop.testing._faults",
    "event_ends": "iop.testing._faults",
    "synthetic_stream": "iop.testing._faults",
    "ClientStream": "iop.testing._streams",
    "StreamEnd": "iop.testing._streams",
    "assert_one_terminal": "iop.testing._streams",
    "count_terminals": "iop.testing._streams",
    "FAKE_MODEL": "iop.testing._platform",
    "NODE_TOKEN": "iop.testing._platform",
    "LoopbackPlatform": "iop.testing._platform",
    "PlatformMark": "iop.testing._platform",
    "SlowReader": "iop.testing._platform",
    "loopback_platform": "iop.testing._platform",
    "start_platform": "iop.testing._platform",
    "ASGIStreamTransport": "iop.testing._virtual",
    "VirtualMark": "iop.testing._virtual",
    "VirtualPlatform": "iop.testing._virtual",
    "open_virtual_platform": "iop.testing._virtual",
    "run_virtual": "iop.testing._virtual",
    "task_count": "iop.testing._virtual",
}

__all__ = [
    "CANCEL_LATENCIES",
    "CHAT_COMPLETIONS_PATH",
    "CHECKS",
    "DEADLINE_SLACK_S",
    "EDGE_READY",
    "FAKE_MODEL",
    "MAX_ERROR_MESSAGE_BYTES",
    "MEMORY_LINK_BUFFER",
    "MODELS_PATH",
    "NODE_READY",
    "NODE_TOKEN",
    "POLL_S",
    "PROTOCOL_ERROR_CODES",
    "SIM_READY",
    "STALL_DEADLINE_S",
    "START_TIMEOUT_S",
    "STOP_GRACE_S",
    "UPSTREAM_CLOSE_BOUND_S",
    "UP_READY",
    "ASGIStreamTransport",
    "Abort",
    "CancelLatency",
    "CapturedExchange",
    "ClientStream",
    "CloseCause",
    "ConformanceError",
    "ConnState",
    "ConnectFailure",
    "Connection",
    "Expectation",
    "ExpectedToolCall",
    "FakeBackend",
    "FakeTransport",
    "Fault",
    "FaultKind",
    "Harness",
    "LatencySummary",
    "LoopbackPlatform",
    "MemoryFrameChannel",
    "OpenAICompatHarness",
    "Pause",
    "PlatformFactory",
    "PlatformMark",
    "Proc",
    "RecordedRequest",
    "Reply",
    "ReplyHandler",
    "RequestRecord",
    "Scenario",
    "ScenarioCase",
    "ScenarioUnsupported",
    "SimHarness",
    "SlowReader",
    "Split",
    "SplitMode",
    "Stall",
    "Step",
    "StreamEnd",
    "TransportResponse",
    "UpstreamClosed",
    "VirtualMark",
    "VirtualPlatform",
    "VirtualRunner",
    "VllmHarness",
    "Write",
    "assert_one_terminal",
    "captured_exchanges",
    "check_backend_4xx",
    "check_backend_5xx",
    "check_cancel_mid_stream",
    "check_connection_refused",
    "check_malformed_chunk",
    "check_malformed_chunk_over_limit",
    "check_missing_done",
    "check_oversize_line",
    "check_plain_stream",
    "check_reasoning",
    "check_scenario",
    "check_stall_before_first_byte",
    "check_stall_mid_stream",
    "check_streamed_tool_calls",
    "check_truncated_stream",
    "count_terminals",
    "event_ends",
    "free_port",
    "latency_summary",
    "list_transcripts",
    "load_transcript",
    "loopback_platform",
    "memory_link_pair",
    "open_fake_backend",
    "open_virtual_platform",
    "parse_capture",
    "poll",
    "run_virtual",
    "start_platform",
    "synthetic_stream",
    "task_count",
    "toml_dumps",
    "transcript_body",
]


def __getattr__(name: str) -> _typing.Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # once found, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
