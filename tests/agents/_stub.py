"""A recording stub model server for the real coding agents (test-only).

``Stub`` is a threaded ``http.server`` on 127.0.0.1 that records every request
(method, path, query, headers with secrets masked, the body bytes exactly as
sent) and answers with small hand-written but valid streams, so Codex CLI
(OpenAI Responses) and Claude Code (Anthropic Messages) proceed:

* ``POST /v1/responses``: a Responses SSE stream (``response.created`` …
  ``response.completed``, each with ``event:`` and a ``sequence_number``).
* ``POST /v1/messages``: an Anthropic Messages SSE stream (``message_start`` …
  ``message_stop``), or a JSON message when the request is not streaming.
* ``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``.
* ``CONNECT`` (the agents' ``HTTPS_PROXY`` points here, so anything they try
  to reach beyond loopback shows up as a recorded ``CONNECT``): 403.
* anything else: 404 with an OpenAI error body.

The answer to a model request depends only on its body, so runs are
deterministic: with ``scenario="tool"`` a request that offers the shell tool
and carries no tool result yet gets a shell tool call (Codex: a
``function_call`` to ``SHELL_TOOL``; Claude Code: a ``tool_use`` of ``Bash``)
running ``TOOL_COMMAND``; a request carrying a tool result gets text that
quotes the result. With ``scenario="patch"`` a Codex request that offers the
``custom`` tool ``apply_patch`` and carries no custom tool output yet gets a
``custom_tool_call`` of it adding ``PATCH_FILE`` (streamed with
``response.custom_tool_call_input.delta``/``.done``, as OpenAI streams
one). ``Variant`` breaks the streams on purpose, to learn what an agent needs.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final, Literal
from urllib.parse import urlsplit

TOOL_COMMAND: Final = "echo iop-tool-ok"
TOOL_MARKER: Final = "iop-tool-ok"
PLAIN_TEXT: Final = "Hello from the IOP stub."
REASONING_TEXT: Final = "The user wants the command run."
# Stands for the opaque blob (Codex's encrypted_content, Claude's signature).
REASONING_BLOB: Final = "iop-stub-opaque-reasoning"
# The text the model "says" once it has seen the tool's output.
AFTER_TOOL_TEXT: Final = "The command printed iop-tool-ok."
AFTER_PATCH_TEXT: Final = "The patch was applied."
SECRET_HEADERS: Final = frozenset({"authorization", "x-api-key", "proxy-authorization", "cookie"})
MASK: Final = "<masked>"
# A fixed timestamp: the same request always gets the same bytes back.
CREATED_AT: Final = 1_796_000_000

# Codex's freeform file-editing tool, and the patch the "patch" scenario calls
# it with: a new file in the working directory.
PATCH_TOOL: Final = "apply_patch"
PATCH_FILE: Final = "iop-patch.txt"
PATCH_TEXT: Final = "patched by the model"
PATCH_INPUT: Final = f"*** Begin Patch\n*** Add File: {PATCH_FILE}\n+{PATCH_TEXT}\n*** End Patch\n"

Scenario = Literal["plain", "tool", "patch"]


@dataclass(frozen=True)
class Variant:
    """Deliberate departures from a well-formed stream."""

    # Codex: leave out every ``response.output_item.done``.
    omit_output_item_done: bool = False
    # Send an SSE comment (``: ping``) before every event.
    comment_keepalives: bool = False
    # Write ``data:`` lines only, no ``event:`` lines.
    omit_event_lines: bool = False
    # Codex: leave out ``response.completed`` (the stream just ends).
    omit_completed: bool = False
    # Claude: an Anthropic ``ping`` event (``event: ping``) before every event
    # after ``message_start``, as Anthropic's keep-alive.
    ping_events: bool = False
    # End the stream with an error instead of the answer: Codex gets
    # ``response.failed`` after ``response.in_progress``, Claude an Anthropic
    # ``error`` event (``overloaded_error``) after ``message_start``.
    error_event: bool = False
    # Put a reasoning item (Codex: ``reasoning`` with a summary and
    # ``encrypted_content``; Claude: a ``thinking`` block with a signature)
    # before the answer, to see whether the agent passes it back.
    reasoning: bool = False
    # End the answer as cut off by the token limit: Codex gets
    # ``response.incomplete`` (``max_output_tokens``) instead of
    # ``response.completed``, Claude ``stop_reason: "max_tokens"``.
    truncated: bool = False
    # Answer every model request with this HTTP status and the API's error
    # body instead (0: don't).
    http_status: int = 0


@dataclass
class Recorded:
    """One request as the agent sent it."""

    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes
    # What the stub answered: status and the exact response body.
    status: int = 0
    response: bytes = b""
    # Which header carried the stub's key (``authorization`` as ``Bearer``,
    # or ``x-api-key``), before it was masked; None if neither did.
    key_header: str | None = None

    def json(self) -> Any:
        return json.loads(self.body)

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name.lower():
                return value
        return None


@dataclass
class Stub:
    scenario: Scenario = "plain"
    variant: Variant = field(default_factory=Variant)
    # The key the agents are given; the stub answers without checking it.
    api_key: str = "sk-iop-agent-test"
    requests: list[Recorded] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> Stub:
        stub = self

        class Handler(_Handler):
            owner = stub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> Stub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def record(self, rec: Recorded) -> None:
        with self._lock:
            self.requests.append(rec)

    def model_requests(self) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.method == "POST"]


class _Handler(BaseHTTPRequestHandler):
    owner: Stub
    protocol_version = "HTTP/1.1"
    server_version = "iop-agent-stub"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _record(self) -> Recorded:
        url = urlsplit(self.path)
        headers = [(k, MASK if k.lower() in SECRET_HEADERS else v) for k, v in self.headers.items()]
        body = self._read_body() if self.command != "CONNECT" else b""
        path = self.path if self.command == "CONNECT" else url.path
        rec = Recorded(self.command, path, url.query, headers, body)
        key = self.owner.api_key
        if self.headers.get("authorization") == f"Bearer {key}":
            rec.key_header = "authorization"
        elif self.headers.get("x-api-key") == key:
            rec.key_header = "x-api-key"
        self.owner.record(rec)
        return rec

    def _send(self, rec: Recorded, status: int, ctype: str, body: bytes) -> None:
        rec.status, rec.response = status, body
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_stream(self, rec: Recorded, frames: Iterator[bytes]) -> None:
        rec.status = 200
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        out = bytearray()
        for frame in frames:
            out += frame
            self.wfile.write(frame)
            self.wfile.flush()
        rec.response = bytes(out)
        self.close_connection = True

    def do_CONNECT(self) -> None:
        rec = self._record()
        self._send(rec, 403, "text/plain", b"no network here\n")
        self.close_connection = True

    def do_GET(self) -> None:
        self._not_found(self._record())

    def do_HEAD(self) -> None:
        rec = self._record()
        rec.status = 404
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        rec = self._record()
        path = rec.path
        status = self.owner.variant.http_status
        if status and path.endswith(("/responses", "/messages")):
            self._send(rec, status, "application/json", json.dumps(_error_body(path)).encode())
        elif path.endswith("/responses"):
            self._send_stream(
                rec, codex_stream(rec.json(), self.owner.scenario, self.owner.variant)
            )
        elif path.endswith("/messages/count_tokens"):
            self._send(rec, 200, "application/json", json.dumps({"input_tokens": 42}).encode())
        elif path.endswith("/messages"):
            req = rec.json()
            if req.get("stream"):
                self._send_stream(rec, claude_stream(req, self.owner.scenario, self.owner.variant))
            else:
                message = claude_message(req, self.owner.scenario, self.owner.variant)
                self._send(rec, 200, "application/json", json.dumps(message).encode())
        else:
            self._not_found(rec)

    def _not_found(self, rec: Recorded) -> None:
        body = {
            "error": {
                "message": f"stub: no route {rec.method} {rec.path}",
                "type": "invalid_request_error",
                "param": None,
                "code": "not_found",
            }
        }
        self._send(rec, 404, "application/json", json.dumps(body).encode())


def _error_body(path: str) -> dict[str, Any]:
    if path.endswith("/messages"):
        error = {"type": "overloaded_error", "message": "stub: overloaded"}
        return {"type": "error", "error": error}
    error = {"message": "stub: overloaded", "type": "server_error", "param": None, "code": None}
    return {"error": error}


def _sse(event: str | None, data: dict[str, Any], keepalive: bool) -> bytes:
    head = b": ping\n\n" if keepalive else b""
    line = f"event: {event}\n" if event is not None else ""
    return head + (line + "data: " + json.dumps(data, separators=(",", ":")) + "\n\n").encode()


# ---------------------------------------------------------------- Codex (Responses)

# Codex CLI 0.163's shell tool (from its captured request): a function taking
# ``cmd`` (a string); see tests/data/agents/README.md.
SHELL_TOOL: Final = "exec_command"


def _responses_tool_output(req: dict[str, Any]) -> str | None:
    for item in req.get("input") or []:
        outputs = ("function_call_output", "custom_tool_call_output")
        if isinstance(item, dict) and item.get("type") in outputs:
            output = item.get("output")
            return output if isinstance(output, str) else json.dumps(output)
    return None


def _offers_tool(req: dict[str, Any], name: str) -> bool:
    return any(isinstance(t, dict) and t.get("name") == name for t in req.get("tools") or [])


def codex_stream(req: dict[str, Any], scenario: Scenario, variant: Variant) -> Iterator[bytes]:
    model = req.get("model", "stub-model")
    resp_id = "resp_stub0001"
    seq = iter(range(1_000_000))
    created = CREATED_AT

    def response(status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        # Every field OpenAI's schema (Response) requires; usage only at the end.
        body: dict[str, Any] = {
            "id": resp_id,
            "object": "response",
            "created_at": created,
            "status": status,
            "model": model,
            "output": output,
            "error": None,
            "incomplete_details": None,
            "instructions": None,
            "metadata": {},
            "parallel_tool_calls": True,
            "temperature": 1.0,
            "top_p": 1.0,
            "tool_choice": "auto",
            "tools": [],
        }
        if status in ("completed", "incomplete"):
            body["usage"] = {
                "input_tokens": 10,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": 5,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": 15,
            }
        return body

    def ev(kind: str, **fields: Any) -> bytes:
        name = None if variant.omit_event_lines else kind
        data = {"type": kind, "sequence_number": next(seq), **fields}
        return _sse(name, data, variant.comment_keepalives)

    yield ev("response.created", response=response("in_progress", []))
    yield ev("response.in_progress", response=response("in_progress", []))
    if variant.error_event:
        failed = response("failed", [])
        failed["error"] = {"code": "server_error", "message": "stub: the backend failed"}
        yield ev("response.failed", response=failed)
        return
    output: list[dict[str, Any]] = []
    if variant.reasoning:
        summary = {"type": "summary_text", "text": REASONING_TEXT}
        reasoning = {
            "id": "rs_stub0001",
            "type": "reasoning",
            "summary": [summary],
            "encrypted_content": REASONING_BLOB,
        }
        yield ev("response.output_item.added", output_index=0, item={**reasoning, "summary": []})
        at = {"item_id": reasoning["id"], "output_index": 0, "summary_index": 0}
        yield ev("response.reasoning_summary_part.added", **at, part={**summary, "text": ""})
        yield ev("response.reasoning_summary_text.delta", **at, delta=REASONING_TEXT)
        yield ev("response.reasoning_summary_text.done", **at, text=REASONING_TEXT)
        yield ev("response.reasoning_summary_part.done", **at, part=summary)
        if not variant.omit_output_item_done:
            yield ev("response.output_item.done", output_index=0, item=reasoning)
        output.append(reasoning)
    index = len(output)
    tool_output = _responses_tool_output(req)
    if scenario == "patch" and tool_output is None and _offers_tool(req, PATCH_TOOL):
        item = {
            "id": "ctc_stub0001",
            "type": "custom_tool_call",
            "call_id": "call_stub0001",
            "name": PATCH_TOOL,
            "input": PATCH_INPUT,
        }
        yield ev("response.output_item.added", output_index=index, item={**item, "input": ""})
        at = {"item_id": item["id"], "output_index": index}
        yield ev("response.custom_tool_call_input.delta", **at, delta=PATCH_INPUT)
        yield ev("response.custom_tool_call_input.done", **at, input=PATCH_INPUT)
    elif scenario == "tool" and tool_output is None and _offers_tool(req, SHELL_TOOL):
        args = json.dumps({"cmd": TOOL_COMMAND})
        item = {
            "id": "fc_stub0001",
            "type": "function_call",
            "status": "completed",
            "call_id": "call_stub0001",
            "name": SHELL_TOOL,
            "arguments": args,
        }
        yield ev(
            "response.output_item.added",
            output_index=index,
            item={**item, "status": "in_progress", "arguments": ""},
        )
        yield ev(
            "response.function_call_arguments.delta",
            item_id=item["id"],
            output_index=index,
            delta=args,
        )
        yield ev(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            name=SHELL_TOOL,
            arguments=args,
        )
    else:
        after = AFTER_PATCH_TEXT if scenario == "patch" else AFTER_TOOL_TEXT
        text = PLAIN_TEXT if tool_output is None else f"{after} (saw: {tool_output!r})"
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item = {
            "id": "msg_stub0001",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [part],
        }
        yield ev(
            "response.output_item.added",
            output_index=index,
            item={**item, "status": "in_progress", "content": []},
        )
        common = {"item_id": item["id"], "output_index": index, "content_index": 0}
        yield ev("response.content_part.added", **common, part={**part, "text": ""})
        yield ev("response.output_text.delta", **common, delta=text, logprobs=[])
        yield ev("response.output_text.done", **common, text=text, logprobs=[])
        yield ev("response.content_part.done", **common, part=part)
    if not variant.omit_output_item_done:
        yield ev("response.output_item.done", output_index=index, item=item)
    if variant.truncated:
        incomplete = response("incomplete", [*output, item])
        incomplete["incomplete_details"] = {"reason": "max_output_tokens"}
        yield ev("response.incomplete", response=incomplete)
    elif not variant.omit_completed:
        yield ev("response.completed", response=response("completed", [*output, item]))


# ---------------------------------------------------------------- Claude Code (Messages)


def _messages_tool_result(req: dict[str, Any]) -> str | None:
    for message in req.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for block in content:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                inner = block.get("content")
                if isinstance(inner, list):
                    return "".join(b.get("text", "") for b in inner if isinstance(b, dict))
                return str(inner)
    return None


def _claude_blocks(
    req: dict[str, Any], scenario: Scenario, variant: Variant
) -> list[dict[str, Any]]:
    thinking = {"type": "thinking", "thinking": REASONING_TEXT, "signature": REASONING_BLOB}
    head = [thinking] if variant.reasoning else []
    result = _messages_tool_result(req)
    if scenario == "tool" and result is None and _offers_tool(req, "Bash"):
        use = {
            "type": "tool_use",
            "id": "toolu_stub0001",
            "name": "Bash",
            "input": {"command": TOOL_COMMAND, "description": "Print a marker"},
        }
        return [*head, use]
    text = PLAIN_TEXT if result is None else f"{AFTER_TOOL_TEXT} (saw: {result!r})"
    return [*head, {"type": "text", "text": text}]


def _usage(output: int) -> dict[str, int]:
    return {
        "input_tokens": 10,
        "output_tokens": output,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def claude_message(req: dict[str, Any], scenario: Scenario, variant: Variant) -> dict[str, Any]:
    blocks = _claude_blocks(req, scenario, variant)
    return {
        "id": "msg_stub0001",
        "type": "message",
        "role": "assistant",
        "model": req.get("model", "stub-model"),
        "content": blocks,
        "stop_reason": "tool_use"
        if blocks[-1]["type"] == "tool_use"
        else ("max_tokens" if variant.truncated else "end_turn"),
        "stop_sequence": None,
        "usage": _usage(5),
    }


def claude_stream(req: dict[str, Any], scenario: Scenario, variant: Variant) -> Iterator[bytes]:
    message = claude_message(req, scenario, variant)
    blocks = message.pop("content")

    def ev(kind: str, **fields: Any) -> bytes:
        name = None if variant.omit_event_lines else kind
        frame = _sse(name, {"type": kind, **fields}, variant.comment_keepalives)
        if variant.ping_events and kind != "message_start":
            frame = (
                _sse(None if variant.omit_event_lines else "ping", {"type": "ping"}, False) + frame
            )
        return frame

    yield ev(
        "message_start",
        message={
            **message,
            "content": [],
            "stop_reason": None,
            "usage": _usage(1),
        },
    )
    if variant.error_event:
        error = {"type": "overloaded_error", "message": "stub: overloaded"}
        yield ev("error", error=error)
        return
    for index, block in enumerate(blocks):
        if block["type"] == "thinking":
            start = {**block, "thinking": "", "signature": ""}
            yield ev("content_block_start", index=index, content_block=start)
            delta = {"type": "thinking_delta", "thinking": block["thinking"]}
            yield ev("content_block_delta", index=index, delta=delta)
            delta = {"type": "signature_delta", "signature": block["signature"]}
            yield ev("content_block_delta", index=index, delta=delta)
        elif block["type"] == "text":
            yield ev("content_block_start", index=index, content_block={"type": "text", "text": ""})
            yield ev(
                "content_block_delta",
                index=index,
                delta={"type": "text_delta", "text": block["text"]},
            )
        else:
            yield ev("content_block_start", index=index, content_block={**block, "input": {}})
            yield ev(
                "content_block_delta",
                index=index,
                delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])},
            )
        yield ev("content_block_stop", index=index)
    yield ev(
        "message_delta",
        delta={"stop_reason": message["stop_reason"], "stop_sequence": None},
        usage={"output_tokens": 5},
    )
    yield ev("message_stop")
