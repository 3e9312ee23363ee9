"""Cancellation, failover and deadlines on every API surface: one matrix, surfaces x windows.

The edge serves every surface through one handler over the same runs
(``iop.edge.routes._surfaces``, ``docs/api.md``), so a client disconnect, a lost node or
a wait timeout must behave the same whatever API the client speaks; only the
bytes differ. Each test here is one *window* (when the failure strikes),
parametrized over ``SURFACES``, a table with one row per surface: how to build
its request body, how to read its stream (tokens, keep-alives, the terminal
event, the in-stream error) and its HTTP error body, and which status and
error kind it documents for each IOP outcome. ``docs/testing.md`` has the
matrix as a table. Embeddings are not streamed: their row serves only the
windows of a non-streamed run (``NON_STREAMED``); the backend "works" for
``ttft_s`` on an embeddings request (``docs/testing.md``, "The simulated
backend"), so their long run is ``m-prefill``'s 3 s, not ``m-long``'s
instant vector.

Behaviour is chosen by **model name**, the one field every surface has: each
model is its own ``iop sim`` process with that behaviour built in (a long
time to first token, a slow endless answer, a stall...), one node instance
each. Per-request ``iop_sim`` overrides would not do: the Messages surface
passes no unknown key to the backend (``docs/api.md``, "Accepted and
ignored"). Each sim's ``/sim/stats`` proves its backend connection closed
(``client_disconnects``) in every cell.

Two edges share the node(s), which dial both:

* ``main`` commits response headers after 0.25 s without output
  (``keepalive_interval_s``), so a streaming client holds a 200 while its run
  waits, gets keep-alives, and learns of a failure before the first token in
  the stream;
* ``patient`` waits 30 s before committing, so a run that fails before output
  gets a real HTTP status; its total deadline is 2 s, its scheduler queue one
  run for 0.8 s.

The first-token and idle deadlines are the stalling instances' own
(``[instances.deadlines]``, enforced on the node), so they do not cut the
long runs the other cells use. Node-loss cells kill nodes; a small pool
starts replacements. Requests are raw ``httpx`` (or a raw socket, to vanish
mid-request): the SDKs retry and hide when things happen.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import httpx
import pytest

from tests.api.messages._sdk import validate_error as validate_anthropic_error
from tests.api.messages._sdk import validate_event as validate_anthropic_event
from tests.api.messages._sdk import validate_message
from tests.api.responses._schema import validate_event as validate_responses_event
from tests.api.responses._schema import validate_response
from tests.e2e._platform import Edge, Node, Proc, Sim, poll, start_edge, start_node
from tests.edge._openai_schema import validate_chunk, validate_completion, validate_error
from tests.sim._schemas import validate_completion as validate_text_completion
from tests.sim._schemas import validate_completion_chunk, validate_embeddings

# --- the backends: one sim per behaviour, named by model ---------------------------------

STEADY: Final = "m-steady"  # 1000 tokens at 20/s (50 s): the bystander of a cell
PREFILL: Final = "m-prefill"  # 3 s to the first token, then 5 tokens
LONG: Final = "m-long"  # 1000 tokens at 20/s (50 s), on a 1-slot instance
STALL_FIRST: Final = "m-stall-first"  # never sends a byte; first-token deadline 0.8 s
STALL_MID: Final = "m-stall-mid"  # 3 tokens, then silence; idle deadline 0.8 s

PREFILL_TOKENS: Final = 5
STALL_TOKENS: Final = 3
NODE_DEADLINE_S: Final = 0.8

SIM_FLAGS: Final[dict[str, list[str]]] = {
    STEADY: ["--tokens-per-s", "20", "--output-tokens", "1000"],
    PREFILL: ["--ttft", "3", "--output-tokens", str(PREFILL_TOKENS)],
    LONG: ["--tokens-per-s", "20", "--output-tokens", "1000"],
    STALL_FIRST: ["--failure", "stall_before_first_byte"],
    STALL_MID: ["--failure", "stall_mid_stream", "--fail-after-tokens", str(STALL_TOKENS)],
}
# Every instance serves embeddings too (opt-in for the vllm adapter,
# docs/configuration.md): the sim answers them after ttft_s.
OPERATIONS: Final = ["chat", "completion", "embedding", "tokenize"]
INSTANCE: Final[dict[str, dict[str, Any]]] = {
    STEADY: {},
    PREFILL: {},
    LONG: {"max_concurrency": 1},
    STALL_FIRST: {"deadlines": {"first_token_timeout_s": NODE_DEADLINE_S}},
    STALL_MID: {"deadlines": {"idle_timeout_s": NODE_DEADLINE_S}},
}

MAIN_CONFIG: Final[dict[str, Any]] = {"server": {"keepalive_interval_s": 0.25}}
PATIENT_TOTAL_S: Final = 2.0
PATIENT_QUEUE_S: Final = 0.8
PATIENT_CONFIG: Final[dict[str, Any]] = {
    "server": {"keepalive_interval_s": 30.0},
    "deadlines": {"request_timeout_s": PATIENT_TOTAL_S},
    "scheduler": {"max_queue": 1, "queue_timeout_s": PATIENT_QUEUE_S},
}

# Generous liveness bounds (a loaded 2-core machine); never "took < X ms".
PROMPT_S: Final = 5.0
READ_TIMEOUT_S: Final = 20.0
PROMPT: Final = "Tell me a long story."


# --- reading SSE -------------------------------------------------------------------------


@dataclass
class Sse:
    """One SSE event (``event:``/``data:`` lines), or a comment line."""

    event: str | None = None
    data: str | None = None
    comment: str | None = None

    def json(self) -> dict[str, Any]:
        assert self.data is not None
        obj: dict[str, Any] = json.loads(self.data)
        return obj


class SseReader:
    """Events of a streaming ``httpx.Response``, read on demand."""

    def __init__(self, resp: httpx.Response) -> None:
        self.resp = resp
        self.events: list[Sse] = []
        self._lines = resp.iter_lines()
        self.ended = False

    def next(self) -> Sse | None:
        """The next event, or None at the end of the body."""
        cur = Sse()
        for line in self._lines:
            if line.startswith(":"):
                if cur.event is None and cur.data is None:
                    self.events.append(Sse(comment=line[1:].strip()))
                    return self.events[-1]
                continue
            if not line:
                if cur.event is None and cur.data is None:
                    continue
                self.events.append(cur)
                return cur
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                cur.event = value
            elif name == "data":
                cur.data = value if cur.data is None else cur.data + "\n" + value
        self.ended = True
        return None

    def until(self, pred: Callable[[Sse], bool]) -> Sse:
        while (ev := self.next()) is not None:
            if pred(ev):
                return ev
        raise AssertionError(f"stream ended before the expected event: {self.events[-5:]}")

    def rest(self) -> list[Sse]:
        start = len(self.events)
        while self.next() is not None:
            pass
        return self.events[start:]


# --- the surfaces ------------------------------------------------------------------------


@dataclass(frozen=True)
class Failure:
    """A failure as the client saw it: HTTP status (None in a stream), kind, message."""

    status: int | None
    kind: str  # OpenAI: error.code; Anthropic: error.type
    message: str


@dataclass(frozen=True)
class SurfaceCase:
    """One API surface, as the matrix drives it (one row of the table)."""

    name: str
    path: str
    body: Callable[[str, bool], dict[str, Any]]
    headers: dict[str, str]
    # Stream events: validated; a token's text (None if no token); keep-alive;
    # the successful end; the in-stream failure (None if the event is none).
    validate: Callable[[Sse], None]
    token: Callable[[Sse], str | None]
    is_keepalive: Callable[[Sse], bool]
    is_done: Callable[[Sse], bool]
    stream_failure: Callable[[Sse], Failure | None]
    # The whole stream of a run that failed after it began: its documented
    # shape around the failure event (what closes before it, what follows).
    check_failed: Callable[[list[Sse]], None]
    answer_text: Callable[[dict[str, Any]], str]  # a non-streaming answer, validated
    http_failure: Callable[[httpx.Response], Failure]  # an error response, validated
    # IOP outcome (a cancel reason or error code) -> (HTTP status, kind) this surface sends.
    expect_http: Callable[[str], tuple[int, str]]
    # ... and the kind its in-stream failure carries.
    expect_stream: Callable[[str], str]
    # Whether anything follows the in-stream failure ([DONE] on chat's wire).
    done_after_failure: bool = False
    # Whether the surface streams at all (embeddings do not).
    streams: bool = True
    # A model whose non-streamed run keeps its backend working for seconds.
    busy_model: str = LONG


# OpenAI's statuses for IOP outcomes (docs/operations.md, "Errors clients see").
OPENAI_STATUS: Final = {
    "first_token_timeout": 504,
    "idle_timeout": 504,
    "total_timeout": 504,
    "queue_timeout": 504,
    "queue_full": 429,
    "node_lost": 503,
}
# Anthropic's (docs/api.md, "Anthropic Messages", "Errors and statuses").
ANTHROPIC: Final = {
    "first_token_timeout": (504, "timeout_error"),
    "idle_timeout": (504, "timeout_error"),
    "total_timeout": (504, "timeout_error"),
    "queue_timeout": (529, "overloaded_error"),
    "queue_full": (429, "rate_limit_error"),
    "node_lost": (529, "overloaded_error"),
}


def _openai_http_failure(resp: httpx.Response) -> Failure:
    body = resp.json()
    validate_error(body)
    return Failure(resp.status_code, body["error"]["code"], body["error"]["message"])


# chat ---------------------------------------------------------------------------------


def _chat_body(model: str, stream: bool) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": PROMPT}], "stream": stream}


def _chat_validate(ev: Sse) -> None:
    if ev.data is None or ev.data == "[DONE]":
        return
    obj = ev.json()
    if "error" in obj:
        validate_error(obj)
    else:
        validate_chunk(obj)


def _chat_token(ev: Sse) -> str | None:
    if ev.data is None or ev.data == "[DONE]":
        return None
    obj = ev.json()
    for choice in obj.get("choices") or ():
        text = (choice.get("delta") or {}).get("content")
        if text:
            return str(text)
    return None


def _chat_done(ev: Sse) -> bool:
    return ev.data == "[DONE]"


def _chat_failure(ev: Sse) -> Failure | None:
    if ev.data is None or ev.data == "[DONE]":
        return None
    err = ev.json().get("error")
    return None if err is None else Failure(None, err["code"], err["message"])


def _chat_failed(events: list[Sse]) -> None:
    # docs/operations.md: an SSE error object, then [DONE]; no finish_reason.
    data = [e for e in events if e.data is not None]
    assert data[-1].data == "[DONE]", data[-3:]
    assert _chat_failure(data[-2]) is not None, data[-3:]
    for e in data[:-2]:
        assert all(c.get("finish_reason") is None for c in e.json()["choices"]), e


def _chat_answer(body: dict[str, Any]) -> str:
    validate_completion(body)
    assert body["choices"][0]["finish_reason"] == "stop"
    return str(body["choices"][0]["message"]["content"])


CHAT = SurfaceCase(
    name="chat",
    path="/v1/chat/completions",
    body=_chat_body,
    headers={},
    validate=_chat_validate,
    token=_chat_token,
    is_keepalive=lambda ev: ev.comment is not None,
    is_done=_chat_done,
    stream_failure=_chat_failure,
    check_failed=_chat_failed,
    answer_text=_chat_answer,
    http_failure=_openai_http_failure,
    expect_http=lambda reason: (OPENAI_STATUS[reason], reason),
    expect_stream=lambda reason: reason,
    done_after_failure=True,
)


# responses ------------------------------------------------------------------------------


def _responses_body(model: str, stream: bool) -> dict[str, Any]:
    return {"model": model, "input": PROMPT, "stream": stream, "store": False}


def _responses_validate(ev: Sse) -> None:
    if ev.data is None:
        return
    obj = ev.json()
    assert ev.event == obj["type"], ev
    validate_responses_event(obj)


def _responses_token(ev: Sse) -> str | None:
    if ev.event == "response.output_text.delta":
        return str(ev.json()["delta"])
    return None


def _responses_failure(ev: Sse) -> Failure | None:
    if ev.event != "response.failed":
        return None
    err = ev.json()["response"]["error"]
    return Failure(None, err["code"], err["message"])


def _responses_failed(events: list[Sse]) -> None:
    # docs/api.md: response.failed last and alone; an item still open is
    # closed first (output_item.done, status incomplete); no [DONE].
    names = [e.event for e in events if e.event is not None]
    assert names[-1] == "response.failed", names[-3:]
    assert names.count("response.failed") == 1
    assert not {"response.completed", "response.incomplete", "error"} & set(names), names
    assert all(e.data != "[DONE]" for e in events)
    assert events[-1].json()["response"]["status"] == "failed"
    added = names.count("response.output_item.added")
    done = [e.json()["item"] for e in events if e.event == "response.output_item.done"]
    assert len(done) == added, names
    if added:
        assert done[-1]["status"] == "incomplete", done[-1]
    seq = [e.json()["sequence_number"] for e in events if e.data is not None]
    assert seq == list(range(len(seq))), seq


def _responses_answer(body: dict[str, Any]) -> str:
    validate_response(body)
    assert body["status"] == "completed"
    return "".join(
        part["text"]
        for item in body["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


RESPONSES = SurfaceCase(
    name="responses",
    path="/v1/responses",
    body=_responses_body,
    headers={},
    validate=_responses_validate,
    token=_responses_token,
    # docs/api.md: an SSE comment before response.created, OpenAI's
    # `keepalive` event once the stream started.
    is_keepalive=lambda ev: ev.comment is not None or ev.event == "keepalive",
    is_done=lambda ev: ev.event == "response.completed",
    stream_failure=_responses_failure,
    check_failed=_responses_failed,
    answer_text=_responses_answer,
    http_failure=_openai_http_failure,
    expect_http=lambda reason: (OPENAI_STATUS[reason], reason),
    # docs/api.md: error.code "server_error" (rate_limit_exceeded for a 429),
    # IOP's code at the end of the message.
    expect_stream=lambda reason: "server_error",
)


# messages -------------------------------------------------------------------------------


def _messages_body(model: str, stream: bool) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": 2000,
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": stream,
    }


def _messages_validate(ev: Sse) -> None:
    assert ev.comment is None, f"Anthropic streams carry no SSE comments: {ev}"
    assert ev.event is not None, f"every Anthropic event has an event: line: {ev}"
    validate_anthropic_event(ev.event, ev.json())


def _messages_token(ev: Sse) -> str | None:
    if ev.event != "content_block_delta":
        return None
    delta = ev.json()["delta"]
    return str(delta["text"]) if delta["type"] == "text_delta" else None


def _messages_failure(ev: Sse) -> Failure | None:
    if ev.event != "error":
        return None
    err = ev.json()["error"]
    return Failure(None, err["type"], err["message"])


def _messages_failed(events: list[Sse]) -> None:
    # docs/api.md: the open block is stopped, then one error event, last; no
    # message_delta or message_stop.
    names = [e.event for e in events if e.event != "ping"]
    assert names[0] == "message_start", names[:3]
    assert names[-1] == "error", names[-3:]
    assert names.count("error") == 1
    assert not {"message_delta", "message_stop"} & set(names), names
    assert names.count("content_block_start") == names.count("content_block_stop"), names
    if "content_block_start" in names:
        assert names[-2] == "content_block_stop", names[-3:]


def _messages_answer(body: dict[str, Any]) -> str:
    message = validate_message(body)
    assert message.stop_reason == "end_turn"
    return "".join(b.text for b in message.content if b.type == "text")


def _messages_http_failure(resp: httpx.Response) -> Failure:
    body = resp.json()
    validate_anthropic_error(body)
    return Failure(resp.status_code, body["error"]["type"], body["error"]["message"])


MESSAGES = SurfaceCase(
    name="messages",
    path="/v1/messages",
    body=_messages_body,
    headers={"anthropic-version": "2023-06-01"},
    validate=_messages_validate,
    token=_messages_token,
    is_keepalive=lambda ev: ev.event == "ping",
    is_done=lambda ev: ev.event == "message_stop",
    stream_failure=_messages_failure,
    check_failed=_messages_failed,
    answer_text=_messages_answer,
    http_failure=_messages_http_failure,
    expect_http=lambda reason: ANTHROPIC[reason],
    expect_stream=lambda reason: ANTHROPIC[reason][1],
)


# completions ----------------------------------------------------------------------------


def _completions_body(model: str, stream: bool) -> dict[str, Any]:
    # max_tokens defaults to 16 (docs/api.md): the long runs need more.
    return {"model": model, "prompt": PROMPT, "max_tokens": 2000, "stream": stream}


def _completions_validate(ev: Sse) -> None:
    if ev.data is None or ev.data == "[DONE]":
        return
    obj = ev.json()
    if "error" in obj:
        validate_error(obj)
    else:
        assert obj["object"] == "text_completion", obj
        validate_completion_chunk(obj)


def _completions_token(ev: Sse) -> str | None:
    if ev.data is None or ev.data == "[DONE]":
        return None
    for choice in ev.json().get("choices") or ():
        if choice.get("text"):
            return str(choice["text"])
    return None


def _completions_answer(body: dict[str, Any]) -> str:
    validate_text_completion(body)
    assert body["choices"][0]["finish_reason"] == "stop"
    return str(body["choices"][0]["text"])


COMPLETIONS = SurfaceCase(
    name="completions",
    path="/v1/completions",
    body=_completions_body,
    headers={},
    validate=_completions_validate,
    token=_completions_token,
    is_keepalive=lambda ev: ev.comment is not None,
    is_done=_chat_done,
    # docs/api.md, "Completions (`POST /v1/completions`)": chat's wire,
    # `data: {"error"}` then [DONE].
    stream_failure=_chat_failure,
    check_failed=_chat_failed,
    answer_text=_completions_answer,
    http_failure=_openai_http_failure,
    expect_http=lambda reason: (OPENAI_STATUS[reason], reason),
    expect_stream=lambda reason: reason,
    done_after_failure=True,
)


# embeddings -----------------------------------------------------------------------------


def _embeddings_body(model: str, stream: bool) -> dict[str, Any]:
    return {"model": model, "input": PROMPT}  # never streamed (a 400)


def _no_stream(*_args: object) -> Any:
    raise AssertionError("embeddings are not streamed")


def _embeddings_answer(body: dict[str, Any]) -> str:
    validate_embeddings(body)
    assert len(body["data"]) == 1, body
    return ""  # a vector, no text


EMBEDDINGS = SurfaceCase(
    name="embeddings",
    path="/v1/embeddings",
    body=_embeddings_body,
    headers={},
    validate=_no_stream,
    token=_no_stream,
    is_keepalive=_no_stream,
    is_done=_no_stream,
    stream_failure=_no_stream,
    check_failed=_no_stream,
    answer_text=_embeddings_answer,
    http_failure=_openai_http_failure,
    expect_http=lambda reason: (OPENAI_STATUS[reason], reason),
    expect_stream=_no_stream,
    streams=False,
    busy_model=PREFILL,
)

SURFACES: Final = {s.name: s for s in (CHAT, RESPONSES, MESSAGES, COMPLETIONS, EMBEDDINGS)}
# The streaming surfaces: every window. Embeddings only where a run is not streamed.
ALL: Final = [name for name, s in SURFACES.items() if s.streams]
NON_STREAMED: Final = list(SURFACES)


# --- the processes -----------------------------------------------------------------------


@dataclass
class Matrix:
    """Everything the module shares: sims by model, two edges, a pool of nodes."""

    sims: dict[str, Sim]
    main: Edge
    patient: Edge
    log_dir: Path
    nodes: list[Node] = field(default_factory=list)
    started: int = 0

    @property
    def edges(self) -> tuple[Edge, Edge]:
        return (self.main, self.patient)

    def start_node(self) -> Node:
        self.started += 1
        first, *more = list(SIM_FLAGS)
        node = start_node(
            self.log_dir,
            [e.link_url for e in self.edges],
            self.sims[first].url,
            name=f"node-{self.started}",
            node_id=f"n{self.started}",
            instance={"name": first, "operations": OPERATIONS, **INSTANCE[first]},
            more_instances=[
                {
                    "adapter": "vllm",
                    "name": m,
                    "endpoint": self.sims[m].url,
                    "operations": OPERATIONS,
                    **INSTANCE[m],
                }
                for m in more
            ],
        )
        self.nodes.append(node)
        return node

    def ensure_nodes(self, n: int, *, exactly: bool = False) -> None:
        """At least (or exactly) ``n`` live nodes, ready on both edges."""
        self.nodes = [node for node in self.nodes if node.proc.alive]
        while len(self.nodes) < n:
            self.start_node()
        while exactly and len(self.nodes) > n:
            self.nodes.pop().proc.stop()
        for node in self.nodes:
            for edge in self.edges:
                for model in SIM_FLAGS:
                    edge.wait_ready(model, node.node_id)
        for edge in self.edges:

            def all_seen(edge: Edge = edge) -> bool:
                return len(edge.admin()["nodes"]) == len(self.nodes)

            poll(
                all_seen,
                timeout=15,
                what=f"{edge.proc.name} to see exactly the {len(self.nodes)} live node(s)",
            )

    def settle(self) -> None:
        """Nothing left running anywhere (what an earlier cell started has ended)."""
        for edge in self.edges:
            edge.wait_no_runs(timeout=15)
        for sim in self.sims.values():
            sim.wait_idle()

    def disconnects(self) -> dict[str, int]:
        return {m: int(s.stats()["client_disconnects"]) for m, s in self.sims.items()}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Matrix]:
    log_dir = tmp_path_factory.mktemp("matrix")
    procs: list[Proc] = []
    closers: list[Sim | Edge] = []
    try:
        # Start every process, then wait for each: they boot in parallel.
        sim_procs = {
            m: Proc(f"sim-{m}", ["sim", "--port", "0", "--model", m, *flags], log_dir)
            for m, flags in SIM_FLAGS.items()
        }
        procs.extend(sim_procs.values())
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            edges = [
                pool.submit(start_edge, log_dir, config, name=name)
                for name, config in (("edge-main", MAIN_CONFIG), ("edge-patient", PATIENT_CONFIG))
            ]
            sims: dict[str, Sim] = {}
            try:
                for m, proc in sim_procs.items():
                    url = proc.wait_stdout(r"on (http://\S+)/v1").group(1)
                    sims[m] = Sim(proc, url)
                    closers.append(sims[m])
            finally:
                for started in edges:  # owned here even if a sim failed to start
                    if started.exception() is None:
                        procs.append(started.result().proc)
                        closers.append(started.result())
        main, patient = (started.result() for started in edges)
        shared = Matrix(sims, main, patient, log_dir)
        try:
            shared.ensure_nodes(1)
            yield shared
        finally:
            for node in shared.nodes:
                node.proc.stop()
    finally:
        for c in closers:
            c.close()
        for proc in reversed(procs):
            proc.stop()


@pytest.fixture
def mx(matrix: Matrix) -> Matrix:
    for sim in matrix.sims.values():
        assert sim.proc.alive, sim.proc.logs()
    for edge in matrix.edges:
        assert edge.proc.alive, edge.proc.logs()
    matrix.ensure_nodes(1)
    matrix.settle()
    return matrix


def _client(edge: Edge) -> httpx.Client:
    return httpx.Client(
        base_url=edge.url,
        timeout=httpx.Timeout(10.0, read=READ_TIMEOUT_S),
        trust_env=False,
    )


@dataclass
class Opened:
    """A streaming request: its reader if the edge answered 200, else its failure."""

    reader: SseReader | None
    failure: Failure | None


@contextlib.contextmanager
def open_stream(edge: Edge, s: SurfaceCase, model: str) -> Iterator[Opened]:
    """POST a streaming request; the body is read on demand, every event validated."""
    with (
        _client(edge) as client,
        client.stream("POST", s.path, json=s.body(model, True), headers=s.headers) as resp,
    ):
        if resp.status_code != 200:
            resp.read()
            yield Opened(None, s.http_failure(resp))
            return
        assert resp.headers["content-type"].startswith("text/event-stream")
        yield Opened(_Validating(resp, s), None)


class _Validating(SseReader):
    def __init__(self, resp: httpx.Response, s: SurfaceCase) -> None:
        super().__init__(resp)
        self.s = s

    def next(self) -> Sse | None:
        ev = super().next()
        if ev is not None:
            self.s.validate(ev)
        return ev

    def tokens(self) -> list[str]:
        return [t for e in self.events if (t := self.s.token(e)) is not None]


def reader(opened: Opened) -> _Validating:
    assert opened.failure is None, f"expected a stream, got {opened.failure}"
    assert isinstance(opened.reader, _Validating)
    return opened.reader


def post(edge: Edge, s: SurfaceCase, model: str) -> httpx.Response:
    with _client(edge) as client:
        return client.post(s.path, json=s.body(model, False), headers=s.headers)


def raw_request(edge: Edge, s: SurfaceCase, model: str, *, stream: bool) -> socket.socket:
    """Send a request on a bare socket and read nothing: closing it is the client leaving."""
    url = urlsplit(edge.url)
    assert url.hostname is not None
    assert url.port is not None
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    body = json.dumps(s.body(model, stream)).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in s.headers.items())
    sock.sendall(
        f"POST {s.path} HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n{head}"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def stream_failure(r: _Validating) -> tuple[Failure, list[Sse]]:
    """Read to the surface's in-stream failure; returns it and what followed it."""
    ev = r.until(lambda e: r.s.stream_failure(e) is not None or r.s.is_done(e))
    failure = r.s.stream_failure(ev)
    assert failure is not None, f"the stream ended normally: {r.events[-5:]}"
    return failure, r.rest()


def check_stream_failure(s: SurfaceCase, failure: Failure, reason: str) -> None:
    assert failure.status is None
    assert failure.kind == s.expect_stream(reason), failure
    if s is RESPONSES:
        assert failure.message.endswith(f"({reason})"), failure


def check_http_failure(s: SurfaceCase, failure: Failure | None, reason: str) -> None:
    assert failure is not None, "expected an HTTP error, got a stream"
    assert (failure.status, failure.kind) == s.expect_http(reason), failure


def check_full_answer(s: SurfaceCase, r: _Validating, n_tokens: int) -> None:
    assert r.s.is_done(r.events[-1])
    assert not any(s.stream_failure(e) for e in r.events), r.events
    assert len(r.tokens()) == n_tokens, r.tokens()


@contextlib.contextmanager
def bystander(mx: Matrix, s: SurfaceCase) -> Iterator[None]:
    """A healthy stream of the same surface (chat for embeddings), open across
    the cell's failure.

    Once the cell's run is gone, the bystander's backend connection is still
    open and its stream goes on: it reads more tokens, then leaves (its own
    client disconnect, which the cell counts)."""
    s = s if s.streams else CHAT
    steady = mx.sims[STEADY]
    before = steady.stats()["client_disconnects"]
    with open_stream(mx.main, s, STEADY) as opened:
        r = reader(opened)
        r.until(lambda e: s.token(e) is not None)
        yield
        assert steady.stats()["client_disconnects"] == before
        assert steady.open() == 1
        seen = len(r.tokens())
        while len(r.tokens()) < seen + 3:
            r.until(lambda e: s.token(e) is not None)
        assert not any(s.stream_failure(e) for e in r.events)
    steady.wait_disconnects(before)


def released(mx: Matrix, model: str, before: dict[str, int], *, settle: bool = True) -> None:
    """The backend of ``model`` saw its connection close, once; no other backend did."""
    mx.sims[model].wait_disconnects(before[model])
    if settle:
        mx.settle()
    after = mx.disconnects()
    assert after == {**before, model: before[model] + 1}, (before, after)


def outcome_delta(edge: Edge, before: dict[str, int]) -> dict[str, int]:
    now: dict[str, int] = edge.admin()["outcomes"]
    return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


def wait_outcome(edge: Edge, before: dict[str, int], key: str) -> dict[str, int]:
    return poll(
        lambda: d if (d := outcome_delta(edge, before)).get(key) else None,
        timeout=PROMPT_S,
        what=f"{edge.proc.name} to record {key}",
    )


# --- client disconnect -------------------------------------------------------------------


def _victim_released(
    mx: Matrix, model: str, before: dict[str, int], outcomes: dict[str, int]
) -> None:
    """The client left: the edge says so, the backend's socket closed, nothing else moved."""
    assert wait_outcome(mx.main, outcomes, "cancelled:client_disconnect") == {
        "cancelled:client_disconnect": 1
    }
    released(mx, model, before, settle=False)


def _bystander_left(mx: Matrix, outcomes: dict[str, int]) -> None:
    mx.settle()
    assert outcome_delta(mx.main, outcomes) == {"cancelled:client_disconnect": 2}


@pytest.mark.parametrize("surface", ALL)
def test_disconnect_streaming_before_first_token(mx: Matrix, surface: str) -> None:
    """In prefill (3 s to the first token) the client holds a 200 and gets the
    surface's keep-alives (the keep-alive-in-prefill cell), then leaves."""
    s = SURFACES[surface]
    before, outcomes = mx.disconnects(), mx.main.admin()["outcomes"]
    with bystander(mx, s):
        with open_stream(mx.main, s, PREFILL) as opened:
            r = reader(opened)
            mx.sims[PREFILL].wait_open()
            r.until(s.is_keepalive)  # waiting in prefill, headers committed
            assert r.tokens() == []
        _victim_released(mx, PREFILL, before, outcomes)
    _bystander_left(mx, outcomes)


@pytest.mark.parametrize("surface", ALL)
def test_disconnect_mid_stream(mx: Matrix, surface: str) -> None:
    s = SURFACES[surface]
    before, outcomes = mx.disconnects(), mx.main.admin()["outcomes"]
    with bystander(mx, s):
        with open_stream(mx.main, s, LONG) as opened:
            r = reader(opened)
            while len(r.tokens()) < 3:
                r.until(lambda e: s.token(e) is not None)
        _victim_released(mx, LONG, before, outcomes)
    _bystander_left(mx, outcomes)


@pytest.mark.parametrize("surface", NON_STREAMED)
def test_disconnect_non_streaming_while_generating(mx: Matrix, surface: str) -> None:
    s = SURFACES[surface]
    before, outcomes = mx.disconnects(), mx.main.admin()["outcomes"]
    with bystander(mx, s):
        sock = raw_request(mx.main, s, s.busy_model, stream=False)
        try:
            mx.sims[s.busy_model].wait_open()
        finally:
            sock.close()
        _victim_released(mx, s.busy_model, before, outcomes)
    _bystander_left(mx, outcomes)


# --- keep-alives -------------------------------------------------------------------------


@pytest.mark.parametrize("surface", ALL)
def test_keepalive_while_queued(mx: Matrix, surface: str) -> None:
    """The 1-slot instance is busy: the next run waits in the edge's queue with
    keep-alives, and streams once the slot is free."""
    s = SURFACES[surface]
    with open_stream(mx.main, s, LONG) as holder_opened:
        holder = reader(holder_opened)
        holder.until(lambda e: s.token(e) is not None)
        with open_stream(mx.main, s, LONG) as opened:
            r = reader(opened)
            r.until(s.is_keepalive)
            assert r.tokens() == []
            holder.resp.close()  # frees the slot
            r.until(lambda e: s.token(e) is not None)
    mx.settle()


# --- wait timeouts -----------------------------------------------------------------------


def _timeout_cell(
    mx: Matrix, edge: Edge, s: SurfaceCase, model: str, reason: str, *, output: bool
) -> None:
    """A streaming run whose deadline strikes: before output on ``patient``
    an HTTP error, else (output, or headers committed by a keep-alive) the
    surface's in-stream error, promptly; the backend's socket closes."""
    before, outcomes = mx.disconnects(), edge.admin()["outcomes"]
    with open_stream(edge, s, model) as opened:
        if edge is mx.patient and not output:
            check_http_failure(s, opened.failure, reason)
        else:
            r = reader(opened)
            failure, rest = stream_failure(r)
            assert rest == [] or s.done_after_failure, rest
            check_stream_failure(s, failure, reason)
            s.check_failed(r.events)
            assert bool(r.tokens()) is output, r.tokens()
    wait_outcome(edge, outcomes, f"cancelled:{reason}")
    released(mx, model, before)
    assert outcome_delta(edge, outcomes) == {f"cancelled:{reason}": 1}


@pytest.mark.parametrize("surface", ALL)
def test_first_token_timeout_before_headers(mx: Matrix, surface: str) -> None:
    _timeout_cell(
        mx, mx.patient, SURFACES[surface], STALL_FIRST, "first_token_timeout", output=False
    )


@pytest.mark.parametrize("surface", ALL)
def test_first_token_timeout_after_keepalive(mx: Matrix, surface: str) -> None:
    _timeout_cell(mx, mx.main, SURFACES[surface], STALL_FIRST, "first_token_timeout", output=False)


@pytest.mark.parametrize("surface", ALL)
def test_idle_timeout_after_output(mx: Matrix, surface: str) -> None:
    _timeout_cell(mx, mx.main, SURFACES[surface], STALL_MID, "idle_timeout", output=True)


@pytest.mark.parametrize("surface", ALL)
def test_total_timeout_before_output(mx: Matrix, surface: str) -> None:
    _timeout_cell(mx, mx.patient, SURFACES[surface], PREFILL, "total_timeout", output=False)


@pytest.mark.parametrize("surface", ALL)
def test_total_timeout_after_output(mx: Matrix, surface: str) -> None:
    _timeout_cell(mx, mx.patient, SURFACES[surface], LONG, "total_timeout", output=True)


NON_STREAMING: Final[dict[str, Callable[[SurfaceCase], str]]] = {
    # reason: the model (on the patient edge)
    "first_token_timeout": lambda s: STALL_FIRST,
    "idle_timeout": lambda s: STALL_MID,
    "total_timeout": lambda s: s.busy_model,
}


@pytest.mark.parametrize(
    ("surface", "reason"),
    [
        (surface, reason)
        for surface in NON_STREAMED
        for reason in NON_STREAMING
        # One vector is one piece of output: no idle gap to time out.
        if SURFACES[surface].streams or reason != "idle_timeout"
    ],
)
def test_non_streaming_timeout(mx: Matrix, surface: str, reason: str) -> None:
    s = SURFACES[surface]
    edge, model = mx.patient, NON_STREAMING[reason](s)
    before, outcomes = mx.disconnects(), edge.admin()["outcomes"]
    check_http_failure(s, s.http_failure(post(edge, s, model)), reason)
    released(mx, model, before)
    assert outcome_delta(edge, outcomes) == {f"cancelled:{reason}": 1}


# --- the queue ---------------------------------------------------------------------------


@pytest.mark.parametrize("surface", NON_STREAMED)
def test_queue_timeout_and_queue_full(mx: Matrix, surface: str) -> None:
    """The 1-slot instance busy (a stream of the same surface, chat for
    embeddings): a second run waits in the patient edge's 1-place queue until
    queue_timeout; a third, while it waits, is refused."""
    s = SURFACES[surface]
    hs = s if s.streams else CHAT
    mx.ensure_nodes(1, exactly=True)
    outcomes = mx.patient.admin()["outcomes"]
    with open_stream(mx.patient, hs, LONG) as holder_opened:
        holder = reader(holder_opened)
        holder.until(lambda e: hs.token(e) is not None)
        waiting = raw_request(mx.patient, s, LONG, stream=True)
        try:
            poll(
                lambda: mx.patient.admin()["queued"] > 0,  # a count of 0 would not wait
                timeout=PROMPT_S,
                what="the second run to wait in the queue",
                interval=0.005,
            )
            with _client(mx.patient) as client:
                full = client.post(s.path, json=s.body(LONG, False), headers=s.headers)
            assert full.headers["retry-after"] == "1"
            check_http_failure(s, s.http_failure(full), "queue_full")
            answer = _read_http_response(waiting)
        finally:
            waiting.close()
    check_http_failure(s, s.http_failure(answer), "queue_timeout")
    mx.settle()
    delta = outcome_delta(mx.patient, outcomes)
    assert delta.get("cancelled:queue_timeout") == 1, delta


def _read_http_response(sock: socket.socket) -> httpx.Response:
    """The (non-streamed, Content-Length) response on a raw socket."""
    sock.settimeout(READ_TIMEOUT_S)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = dict(line.split(": ", 1) for line in lines[1:])
    length = int({k.lower(): v for k, v in headers.items()}["content-length"])
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return httpx.Response(status, headers=headers, content=body[:length])


# --- node loss ---------------------------------------------------------------------------


def _holder(edge: Edge) -> str | None:
    for n in edge.admin()["nodes"]:
        if n["runs"]:
            return str(n["id"])
    return None


def _kill_holder(mx: Matrix) -> Node:
    victim_id = poll(lambda: _holder(mx.main), timeout=PROMPT_S, what="the run to be placed")
    victim = next(n for n in mx.nodes if n.node_id == victim_id)
    victim.proc.kill()
    return victim


@pytest.mark.parametrize("surface", ALL)
def test_node_lost_before_output_fails_over(mx: Matrix, surface: str) -> None:
    s = SURFACES[surface]
    mx.ensure_nodes(2)
    before, outcomes = mx.disconnects(), mx.main.admin()["outcomes"]
    with open_stream(mx.main, s, PREFILL) as opened:
        r = reader(opened)
        r.until(s.is_keepalive)
        mx.sims[PREFILL].wait_open()
        _kill_holder(mx)
        r.rest()
    check_full_answer(s, r, PREFILL_TOKENS)
    # The dead node's backend connection closed (the kernel closed its socket).
    mx.sims[PREFILL].wait_disconnects(before[PREFILL])
    mx.ensure_nodes(1)
    released(mx, PREFILL, before)
    assert outcome_delta(mx.main, outcomes) == {"complete": 1}


@pytest.mark.parametrize("surface", ALL)
def test_node_lost_after_output_is_the_surface_error(mx: Matrix, surface: str) -> None:
    s = SURFACES[surface]
    before, outcomes = mx.disconnects(), mx.main.admin()["outcomes"]
    with open_stream(mx.main, s, LONG) as opened:
        r = reader(opened)
        while len(r.tokens()) < 3:
            r.until(lambda e: s.token(e) is not None)
        victim = _kill_holder(mx)
        t0 = time.monotonic()
        failure, rest = stream_failure(r)
        took = time.monotonic() - t0
    assert took < PROMPT_S, took
    check_stream_failure(s, failure, "node_lost")
    assert rest == [] or s.done_after_failure, rest
    s.check_failed(r.events)
    if s is not MESSAGES:  # Anthropic's error message is IOP's, but not checked here
        assert f"node {victim.node_id}" in failure.message, failure
    mx.sims[LONG].wait_disconnects(before[LONG])
    assert outcome_delta(mx.main, outcomes) == {"cancelled:node_lost": 1}
    mx.ensure_nodes(1)
    released(mx, LONG, before)


@pytest.mark.parametrize("surface", ALL)
def test_node_lost_non_streaming_while_generating(mx: Matrix, surface: str) -> None:
    """No failover once the run had output: the one body is the surface's
    error for a lost node (OpenAI 503 ``node_lost``, Anthropic 529)."""
    s = SURFACES[surface]
    before, outcomes = mx.disconnects(), mx.main.admin()["outcomes"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(post, mx.main, s, LONG)
        mx.sims[LONG].wait_open()
        # The edge's run has seen output: no failover from here.
        poll(
            lambda: [r["state"] for r in mx.main.admin()["runs"]] == ["streaming"],
            timeout=PROMPT_S,
            what="the edge's run to have output",
        )
        _kill_holder(mx)
        resp = answer.result(timeout=READ_TIMEOUT_S)
    check_http_failure(s, s.http_failure(resp), "node_lost")
    mx.sims[LONG].wait_disconnects(before[LONG])
    assert outcome_delta(mx.main, outcomes) == {"cancelled:node_lost": 1}
    mx.ensure_nodes(1)
    released(mx, LONG, before)


# An embeddings run has no output before its one answer: a node lost while
# the backend works is always "before output".


def _post_then_kill_holder(mx: Matrix, s: SurfaceCase) -> httpx.Response:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(post, mx.main, s, s.busy_model)
        mx.sims[s.busy_model].wait_open()
        _kill_holder(mx)
        return answer.result(timeout=READ_TIMEOUT_S)


def test_embeddings_node_lost_while_working(mx: Matrix) -> None:
    """No other node to fail over to: 503 ``node_lost``."""
    s = EMBEDDINGS
    mx.ensure_nodes(1, exactly=True)
    before, outcomes = mx.disconnects(), mx.main.admin()["outcomes"]
    resp = _post_then_kill_holder(mx, s)
    check_http_failure(s, s.http_failure(resp), "node_lost")
    mx.sims[s.busy_model].wait_disconnects(before[s.busy_model])
    assert outcome_delta(mx.main, outcomes) == {"cancelled:node_lost": 1}
    mx.ensure_nodes(1)
    released(mx, s.busy_model, before)


def test_embeddings_node_lost_fails_over(mx: Matrix) -> None:
    """A second node up: the run is retried there and answers normally."""
    s = EMBEDDINGS
    mx.ensure_nodes(2)
    before, outcomes = mx.disconnects(), mx.main.admin()["outcomes"]
    resp = _post_then_kill_holder(mx, s)
    assert resp.status_code == 200, resp.text
    s.answer_text(resp.json())
    mx.sims[s.busy_model].wait_disconnects(before[s.busy_model])
    mx.ensure_nodes(1)
    released(mx, s.busy_model, before)
    assert outcome_delta(mx.main, outcomes) == {"complete": 1}
