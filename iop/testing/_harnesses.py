"""The harnesses that make each adapter play the conformance scenarios.

The checks (``iop.testing._conformance``) know what a run must look like; a
harness here knows how to make one adapter produce a given ``Scenario``: it
sets up the backend, wires the adapter to it, and hands the check a
``ScenarioCase`` (the adapter, the run, its deadlines, what the backend will
send, and when the backend saw its connection close).

* ``OpenAICompatHarness`` and ``VllmHarness`` run a ``FakeBackend`` on
  loopback and replay real transcripts, cut at seeded random offsets so the
  adapters' framing is exercised. Their expectations come from a small
  independent reading of the same transcript (stdlib ``json``,
  ``_read_stream``), not from IOP's own parser.
* ``SimHarness`` plays them with the in-process ``sim`` adapter (no sockets):
  its ``upstream_closed`` reports when the sim's generation stopped, and its
  expectations come from the sim's own script for the same request.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Final, Protocol

import msgspec
import trio

from iop.config import DEFAULT_MAX_LINE_BYTES, Deadlines, OpenAICompatInstance, VllmInstance
from iop.events import FinishReason
from iop.runtime import Executor, new_run_id
from iop.spec import ChatRequest, ExecutionSpec, FunctionDef, Message, Tool
from iop.testing._conformance import (
    CANCEL_AFTER_DELTAS,
    STALL_DEADLINE_S,
    ConformanceError,
    Expectation,
    ExpectedToolCall,
    Scenario,
    ScenarioCase,
    ScenarioUnsupported,
)
from iop.testing._fake_backend import CHAT_COMPLETIONS_PATH, Reply, Split, open_fake_backend
from iop.testing._transcripts import transcript_body
from iop.wire._openai_stream import DEFAULT_MALFORMED_CHUNK_LIMIT

__all__ = ["OpenAICompatHarness", "SimHarness", "VllmHarness"]


# --- reading transcripts independently ------------------------------------------


class _Reading(msgspec.Struct, frozen=True, kw_only=True):
    """What a transcript's stream says, read with stdlib json only."""

    text: str
    reasoning: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    tool_calls: tuple[ExpectedToolCall, ...]
    # Offsets just past each event that carried content, and past each event.
    content_event_ends: tuple[int, ...]
    event_ends: tuple[int, ...]


def _events_with_ends(body: bytes) -> list[tuple[int, bytes]]:
    """(end offset, raw event) for each blank-line terminated event.

    The transcripts use LF line ends; this is a test oracle, not a general
    SSE decoder (that is ``iop.wire._sse``).
    """
    out: list[tuple[int, bytes]] = []
    pos = 0
    while (end := body.find(b"\n\n", pos)) >= 0:
        out.append((end + 2, body[pos:end]))
        pos = end + 2
    return out


def _read_stream(body: bytes) -> _Reading:
    text: list[str] = []
    reasoning: list[str] = []
    finish: str | None = None
    usage: dict[str, Any] = {}
    calls: dict[int, list[Any]] = {}
    content_ends: list[int] = []
    event_ends: list[int] = []
    for end, raw in _events_with_ends(body):
        event_ends.append(end)
        data = "\n".join(
            line[5:].removeprefix(" ")
            for line in raw.decode().split("\n")
            if line.startswith("data:")
        )
        if not data or data == "[DONE]":
            continue
        chunk = json.loads(data)
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or ():
            finish = choice.get("finish_reason") or finish
            delta = choice.get("delta") or {}
            reasoning.append(delta.get("reasoning_content") or delta.get("reasoning") or "")
            if delta.get("content"):
                text.append(delta["content"])
                content_ends.append(end)
            for tc in delta.get("tool_calls") or ():
                slot = calls.setdefault(tc.get("index", 0), ["", ""])
                fn = tc.get("function") or {}
                slot[0] = fn.get("name") or slot[0]
                slot[1] += fn.get("arguments") or ""
    return _Reading(
        text="".join(text),
        reasoning="".join(reasoning),
        finish_reason=finish,
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        tool_calls=tuple(
            ExpectedToolCall(name, json.loads(args)) for _, (name, args) in sorted(calls.items())
        ),
        content_event_ends=tuple(content_ends),
        event_ends=tuple(event_ends),
    )


def _expectation(reading: _Reading) -> Expectation:
    return Expectation(
        text=reading.text,
        reasoning=reading.reasoning,
        finish_reason=FinishReason(reading.finish_reason) if reading.finish_reason else None,
        input_tokens=reading.prompt_tokens,
        output_tokens=reading.completion_tokens,
        tool_calls=reading.tool_calls,
    )


def _without_done(body: bytes) -> bytes:
    kept = [raw + b"\n\n" for _, raw in _events_with_ends(body) if raw.strip() != b"data: [DONE]"]
    return b"".join(kept)


def _insert_after_first_event(body: bytes, extra: bytes) -> bytes:
    first_end = _events_with_ends(body)[0][0]
    return body[:first_end] + extra + body[first_end:]


# --- HTTP harnesses ---------------------------------------------------------------

TranscriptRef = tuple[str, int]
"""A transcript name and the index of the exchange in it (0 for raw bodies)."""

# A chunk that is not JSON, as a crashing proxy or a buggy server sends it.
MALFORMED_EVENT: Final = b'data: {"choices":[{"index":0,"delta":{"content":"never shown"\n\n'
# Max line length given to the adapter in OVERSIZE_LINE, and the line sent.
OVERSIZE_LIMIT_BYTES: Final = 4096
OVERSIZE_LINE_BYTES: Final = 64 * 1024
# Size of the 4xx body: well past the 4 KiB excerpt the adapters keep.
BIG_ERROR_BODY_BYTES: Final = 10 * 1024
# Pause between the events of the cancellation scenario: the backend is
# visibly streaming when the client goes away.
CANCEL_EVENT_DELAY_S: Final = 0.005

_HAPPY_DEADLINES: Final = Deadlines(
    first_token_timeout_s=10.0, idle_timeout_s=10.0, request_timeout_s=30.0
)
_WEATHER_TOOL: Final = Tool(
    function=FunctionDef(
        name="get_weather",
        description="Get the current weather for a city",
        parameters={
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city"],
        },
    )
)


def _big_error_body() -> bytes:
    message = "request (31031 tokens) exceeds the available context size (2048 tokens) "
    padding = "x" * BIG_ERROR_BODY_BYTES
    return msgspec.json.encode(
        {"error": {"code": 400, "message": message + padding, "type": "exceed_context_size_error"}}
    )


_SERVER_ERROR_BODY: Final = (
    b'{"error":{"message":"EngineCore encountered an issue. See stack trace for the root cause.",'
    b'"type":"InternalServerError","param":null,"code":500}}'
)


def _closed_port_socket() -> socket.socket:
    """A bound loopback port nobody listens on: connecting to it is refused.

    Kept bound (not listening) for the case's lifetime, so no other process
    can take the port meanwhile.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


async def _no_upstream(timeout_s: float) -> float:
    raise ConformanceError("no backend connection exists in this scenario")


class _ClosableExecutor(Executor, Protocol):
    async def aclose(self) -> None: ...


class _Plan(msgspec.Struct, frozen=True, kw_only=True):
    reply: Reply
    expected: Expectation
    deadlines: Deadlines = _HAPPY_DEADLINES
    with_tools: bool = False
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    malformed_chunk_limit: int = DEFAULT_MALFORMED_CHUNK_LIMIT


class _OpenAIHTTPHarness:
    """Shared by the harnesses of adapters that speak OpenAI's wire over HTTP.

    Args:
        plain: Transcript of a plain streamed answer.
        reasoning: Transcript of a streamed answer with reasoning.
        tools: Transcript of streamed tool calls.
        seed: Seed of the random cuts of the replayed bodies.
        split: How to cut the replayed bodies instead (e.g. ``Split.bytewise()``).
        name: Name in test ids; defaults to the adapter kind.
    """

    kind = "openai"

    def __init__(
        self,
        *,
        plain: TranscriptRef,
        reasoning: TranscriptRef,
        tools: TranscriptRef,
        seed: int = 0,
        split: Split | None = None,
        name: str | None = None,
    ) -> None:
        self._plain = transcript_body(*plain)
        self._reasoning = transcript_body(*reasoning)
        self._tools = transcript_body(*tools)
        self._split = split or Split.random(seed)
        self._name = name or self.kind

    @property
    def name(self) -> str:
        return self._name

    def unsupported(self, scenario: Scenario) -> str | None:
        return None

    def _build_adapter(
        self, endpoint: str, *, max_line_bytes: int, malformed_chunk_limit: int
    ) -> _ClosableExecutor:
        raise NotImplementedError

    def _spec(self, *, with_tools: bool) -> ExecutionSpec:
        request = ChatRequest(
            model="conformance-model",
            messages=[Message(role="user", content="What is the weather in Paris?")],
            stream=True,
            tools=[_WEATHER_TOOL] if with_tools else None,
        )
        return ExecutionSpec(run_id=new_run_id(), request=request)

    def _plan(self, scenario: Scenario) -> _Plan:
        split = self._split
        plain = _read_stream(self._plain)
        stall_deadlines = Deadlines(
            first_token_timeout_s=STALL_DEADLINE_S, idle_timeout_s=None, request_timeout_s=30.0
        )
        idle_deadlines = Deadlines(
            first_token_timeout_s=10.0, idle_timeout_s=STALL_DEADLINE_S, request_timeout_s=30.0
        )
        malformed = _insert_after_first_event(self._plain, MALFORMED_EVENT)
        if scenario is Scenario.PLAIN_STREAM:
            return _Plan(reply=Reply.sse(self._plain, split=split), expected=_expectation(plain))
        if scenario is Scenario.REASONING:
            reading = _read_stream(self._reasoning)
            return _Plan(
                reply=Reply.sse(self._reasoning, split=split),
                expected=_expectation(reading),
            )
        if scenario is Scenario.STREAMED_TOOL_CALLS:
            reading = _read_stream(self._tools)
            return _Plan(
                reply=Reply.sse(self._tools, split=split),
                expected=_expectation(reading),
                with_tools=True,
            )
        if scenario is Scenario.BACKEND_4XX:
            return _Plan(
                reply=Reply.json(_big_error_body(), status=400),
                expected=Expectation(backend_status=400),
            )
        if scenario is Scenario.BACKEND_5XX:
            return _Plan(
                reply=Reply.json(_SERVER_ERROR_BODY, status=500),
                expected=Expectation(backend_status=500),
            )
        if scenario is Scenario.STALL_BEFORE_FIRST_BYTE:
            return _Plan(
                reply=Reply.sse(self._plain, stall_before_headers=True),
                expected=Expectation(),
                deadlines=stall_deadlines,
            )
        if scenario is Scenario.STALL_MID_STREAM:
            return _Plan(
                reply=Reply.sse(
                    self._plain,
                    split=split,
                    stall_after_bytes=plain.content_event_ends[2],
                ),
                expected=Expectation(deltas_before_stall=3),
                deadlines=idle_deadlines,
            )
        if scenario is Scenario.TRUNCATED_STREAM:
            # Cut in the middle of the event after the third content event.
            cut = plain.content_event_ends[2] + 20
            return _Plan(
                reply=Reply.sse(self._plain, split=split, truncate_after_bytes=cut),
                expected=Expectation(deltas_before_stall=3),
            )
        if scenario is Scenario.MISSING_DONE:
            return _Plan(
                reply=Reply.sse(_without_done(self._plain), split=split),
                expected=_expectation(plain),
            )
        if scenario is Scenario.MALFORMED_CHUNK:
            return _Plan(reply=Reply.sse(malformed, split=split), expected=_expectation(plain))
        if scenario is Scenario.MALFORMED_CHUNK_OVER_LIMIT:
            return _Plan(
                reply=Reply.sse(malformed, split=split),
                expected=_expectation(plain),
                malformed_chunk_limit=0,
            )
        if scenario is Scenario.OVERSIZE_LINE:
            line = b'data: {"choices":[{"index":0,"delta":{"content":"'
            line += b"x" * OVERSIZE_LINE_BYTES + b'"}}]}\n\n'
            return _Plan(
                reply=Reply.sse(_insert_after_first_event(self._plain, line), split=split),
                expected=_expectation(plain),
                max_line_bytes=OVERSIZE_LIMIT_BYTES,
            )
        if scenario is Scenario.CANCEL_MID_STREAM:
            # One event per write, paced, and a stall before the answer ends:
            # the client always leaves while the backend is mid-stream.
            return _Plan(
                reply=Reply.sse(
                    self._plain,
                    split=Split.at(*plain.event_ends),
                    delay_s=CANCEL_EVENT_DELAY_S,
                    stall_after_bytes=plain.content_event_ends[CANCEL_AFTER_DELTAS + 1],
                ),
                expected=_expectation(plain),
            )
        raise ValueError(f"no plan for {scenario}")

    @asynccontextmanager
    async def case(self, scenario: Scenario) -> AsyncIterator[ScenarioCase]:
        """Run a FakeBackend playing ``scenario`` and an adapter pointed at it."""
        if scenario is Scenario.CONNECTION_REFUSED:
            with _closed_port_socket() as sock:
                port = sock.getsockname()[1]
                adapter = self._build_adapter(
                    f"http://127.0.0.1:{port}",
                    max_line_bytes=DEFAULT_MAX_LINE_BYTES,
                    malformed_chunk_limit=DEFAULT_MALFORMED_CHUNK_LIMIT,
                )
                try:
                    yield ScenarioCase(
                        scenario=scenario,
                        adapter=adapter,
                        spec=self._spec(with_tools=False),
                        deadlines=_HAPPY_DEADLINES,
                        expected=Expectation(),
                        upstream_closed=_no_upstream,
                    )
                finally:
                    await adapter.aclose()
            return
        plan = self._plan(scenario)
        async with open_fake_backend() as fb:
            fb.script(CHAT_COMPLETIONS_PATH, plan.reply)
            adapter = self._build_adapter(
                fb.url,
                max_line_bytes=plan.max_line_bytes,
                malformed_chunk_limit=plan.malformed_chunk_limit,
            )

            async def upstream_closed(timeout_s: float) -> float:
                conn = await fb.wait_client_closed(timeout_s)
                assert conn.closed_at is not None
                return conn.closed_at

            try:
                yield ScenarioCase(
                    scenario=scenario,
                    adapter=adapter,
                    spec=self._spec(with_tools=plan.with_tools),
                    deadlines=plan.deadlines,
                    expected=plan.expected,
                    upstream_closed=upstream_closed,
                )
            finally:
                await adapter.aclose()


class OpenAICompatHarness(_OpenAIHTTPHarness):
    """``openai_compat`` against a FakeBackend replaying llama.cpp's real streams.

    Args:
        plain: Plain answer (default: the real xllamacpp capture).
        seed: Seed of the random cuts.
        split: How to cut the bodies instead of at random.
        name: Name in test ids.
    """

    kind = "openai_compat"

    def __init__(
        self,
        *,
        plain: TranscriptRef = ("real-xllamacpp-chat-stream.txt", 0),
        seed: int = 0,
        split: Split | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(
            plain=plain,
            reasoning=("vllm_reasoning_stream_ge_v0.16.txt", 0),
            # The real server's native tool-call stream (two parallel calls).
            tools=("real-xllamacpp-tools.txt", 6),
            seed=seed,
            split=split,
            name=name,
        )

    def _build_adapter(
        self, endpoint: str, *, max_line_bytes: int, malformed_chunk_limit: int
    ) -> _ClosableExecutor:
        # Imported here, not at the top, so that loading a transcript or the
        # fake backend does not import every adapter.
        from iop.adapters.openai_compat import OpenAICompatAdapter

        cfg = OpenAICompatInstance(
            name=f"conformance-{self.name}",
            endpoint=endpoint,
            provider="llamacpp",
            max_line_bytes=max_line_bytes,
            malformed_chunk_limit=malformed_chunk_limit,
        )
        return OpenAICompatAdapter(cfg)


class VllmHarness(_OpenAIHTTPHarness):
    """``vllm`` against a FakeBackend replaying vLLM's recorded streams.

    Args:
        seed: Seed of the random cuts.
        split: How to cut the bodies instead of at random.
        name: Name in test ids.
    """

    kind = "vllm"

    def __init__(
        self, *, seed: int = 0, split: Split | None = None, name: str | None = None
    ) -> None:
        super().__init__(
            plain=("vllm_text_stream_with_usage.txt", 0),
            reasoning=("vllm_reasoning_stream_ge_v0.16.txt", 0),
            tools=("vllm_tool_call_stream_hermes.txt", 0),
            seed=seed,
            split=split,
            name=name,
        )

    def _build_adapter(
        self, endpoint: str, *, max_line_bytes: int, malformed_chunk_limit: int
    ) -> _ClosableExecutor:
        # Imported here for the same reason as in OpenAICompatHarness.
        from iop.adapters.vllm import VllmAdapter

        cfg = VllmInstance(
            name=f"conformance-{self.name}",
            endpoint=endpoint,
            max_line_bytes=max_line_bytes,
            malformed_chunk_limit=malformed_chunk_limit,
        )
        return VllmAdapter(cfg)


class _TimedExecutor:
    """Wraps an in-process adapter to record when its ``execute`` stopped."""

    def __init__(self, inner: Executor) -> None:
        self._inner = inner
        self.stopped = trio.Event()
        self.stopped_at = 0.0

    async def execute(self, spec: ExecutionSpec, send: Any) -> None:
        try:
            await self._inner.execute(spec, send)
        finally:
            self.stopped_at = trio.current_time()
            self.stopped.set()


class SimHarness:
    """Plays the scenarios with the in-process ``sim`` adapter (no sockets).

    The simulated backend has no wire, so the framing scenarios (oversize
    line, a malformed chunk past a tolerance, an unreachable backend) do not
    apply to it; ``upstream_closed`` reports when its generation stopped.
    Expectations come from the sim's own script for the same request.
    """

    _UNSUPPORTED: Final = {
        Scenario.CONNECTION_REFUSED: "an in-process backend cannot be unreachable",
        Scenario.OVERSIZE_LINE: "the sim has no wire, so no line to be too long",
        Scenario.MALFORMED_CHUNK_OVER_LIMIT: "the sim has no decoder tolerance to exceed",
    }

    @property
    def name(self) -> str:
        return "sim"

    def unsupported(self, scenario: Scenario) -> str | None:
        return self._UNSUPPORTED.get(scenario)

    @asynccontextmanager
    async def case(self, scenario: Scenario) -> AsyncIterator[ScenarioCase]:
        from iop.adapters.sim import SimAdapter
        from iop.config import SimConfig, SimInstance
        from iop.sim import ContentToken, ReasoningToken, build_script

        if (why := self.unsupported(scenario)) is not None:
            raise ScenarioUnsupported(self.name, scenario, why)
        settings: dict[str, Any] = {"ttft_s": 0.0, "output_tokens": 12, "fail_after_tokens": 3}
        deadlines = Deadlines(first_token_timeout_s=5, idle_timeout_s=5, request_timeout_s=30)
        with_tools = scenario is Scenario.STREAMED_TOOL_CALLS
        expected_status: int | None = None
        if scenario is Scenario.REASONING:
            settings["reasoning_tokens"] = 6
        elif scenario is Scenario.BACKEND_4XX:
            settings["failure"], expected_status = "http_429", 429
        elif scenario is Scenario.BACKEND_5XX:
            settings["failure"], expected_status = "http_500", 500
        elif scenario is Scenario.STALL_BEFORE_FIRST_BYTE:
            settings["failure"] = "stall_before_first_byte"
            deadlines = Deadlines(
                first_token_timeout_s=STALL_DEADLINE_S, idle_timeout_s=30, request_timeout_s=60
            )
        elif scenario is Scenario.STALL_MID_STREAM:
            settings["failure"] = "stall_mid_stream"
            deadlines = Deadlines(
                first_token_timeout_s=30, idle_timeout_s=STALL_DEADLINE_S, request_timeout_s=60
            )
        elif scenario in (Scenario.TRUNCATED_STREAM, Scenario.MISSING_DONE):
            settings["failure"] = "truncate"
        elif scenario is Scenario.MALFORMED_CHUNK:
            settings["failure"] = "malformed_chunk"
        elif scenario is Scenario.CANCEL_MID_STREAM:
            settings.update(output_tokens=10_000, tokens_per_s=500.0)
        sim = msgspec.convert(settings, SimConfig)
        spec = self._spec(with_tools=with_tools)
        assert isinstance(spec.request, ChatRequest)
        script = build_script(spec.request, msgspec.structs.replace(sim, failure="none"))
        text = "".join(s.text for s in script.steps if isinstance(s, ContentToken))
        reasoning = "".join(s.text for s in script.steps if isinstance(s, ReasoningToken))
        calls: tuple[ExpectedToolCall, ...] = ()
        if with_tools:
            from iop.sim import ToolArgs, ToolCallBegin

            name = next(s.name for s in script.steps if isinstance(s, ToolCallBegin))
            args = "".join(s.text for s in script.steps if isinstance(s, ToolArgs))
            calls = (ExpectedToolCall(name=name, arguments=json.loads(args)),)
        expected = Expectation(
            text=text,
            reasoning=reasoning or None,
            input_tokens=script.prompt_tokens,
            output_tokens=script.completion_tokens,
            tool_calls=calls,
            backend_status=expected_status,
            deltas_before_stall=sim.fail_after_tokens,
        )
        adapter = _TimedExecutor(SimAdapter(SimInstance(name="sim", sim=sim)))

        async def upstream_closed(timeout_s: float) -> float:
            with trio.fail_after(timeout_s):
                await adapter.stopped.wait()
            return adapter.stopped_at

        yield ScenarioCase(
            scenario=scenario,
            adapter=adapter,
            spec=spec,
            deadlines=deadlines,
            expected=expected,
            upstream_closed=upstream_closed,
        )

    def _spec(self, *, with_tools: bool) -> ExecutionSpec:
        tools = (
            [
                Tool(
                    function=FunctionDef(
                        name="get_weather",
                        parameters={
                            "type": "object",
                            "properties": {"city": {"type": "string"}},
                            "required": ["city"],
                        },
                    )
                )
            ]
            if with_tools
            else None
        )
        request = ChatRequest(
            model="iop-sim",
            messages=[Message(role="user", content="What is the weather in Paris?")],
            stream=True,
            tools=tools,
        )
        return ExecutionSpec(run_id=new_run_id(), request=request)
