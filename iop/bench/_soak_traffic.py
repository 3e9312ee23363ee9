"""The soak's options and its traffic: what the clients send, and how each request ended.

``traffic`` runs ``concurrency`` seeded workers, each a loop of one request
at a time (``plan``, ``body``, ``send``): chat, completions, Responses or
Messages, streamed or not, on the sim or on llama.cpp, some with tools, some
cancelled by the client before their first token or right after it. Each
request ends in one outcome (``iop/bench/_soak.py`` says which); a stream's
events are read surface by surface (``_Stream``: its terminals counted, its
usage and tool calls taken), and ``outcomes`` sums them up.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Final

import httpx
import msgspec
import trio

from iop.bench._client import sse_data

__all__ = [
    "KEYS",
    "LLAMA_MODEL",
    "SIM_MODEL",
    "SURFACES",
    "TERMINAL_OUTCOMES",
    "Options",
    "Request",
    "body",
    "outcomes",
    "plan",
    "send",
    "traffic",
]

KEYS: Final = {"alpha": "iop-bench-soak-alpha", "beta": "iop-bench-soak-beta"}
SIM_MODEL: Final = "iop-sim"
LLAMA_MODEL: Final = "SmolLM2-135M-Instruct"
SURFACES: Final = ("chat", "completions", "responses", "messages")
# The outcomes that are a request's one terminal; anything else is an anomaly.
TERMINAL_OUTCOMES: Final = ("complete", "error", "cancelled")

_PARAMETERS: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
_TOOLS_CHAT: Final[list[dict[str, Any]]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city.",
            "parameters": _PARAMETERS,
        },
    }
]
_TOOLS_RESPONSES: Final[list[dict[str, Any]]] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": _PARAMETERS,
    }
]
_TOOLS_MESSAGES: Final[list[dict[str, Any]]] = [
    {
        "name": "get_weather",
        "description": "The weather of a city.",
        "input_schema": _PARAMETERS,
    }
]


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``soak`` runner's options (``[args]`` of its scenario, ``iop/bench/_soak.py``)."""

    duration_s: float = 1800.0
    # Workers, one request at a time each: modest, for a shared 2-core box.
    concurrency: int = 4
    sample_s: float = 5.0
    seed: int = 1
    reloads: int = 10
    # Of the requests, the share sent to llama.cpp (the rest to the sim).
    llama_share: float = 0.15
    # Of the sim's streams, the shares the client cancels before its first
    # token and right after it.
    cancel_before_share: float = 0.08
    cancel_after_share: float = 0.08
    # Of the sim's chat, Responses and Messages requests, the share with tools.
    tools_share: float = 0.25
    # Mean pause of a worker between two requests (exponential).
    think_s: float = 0.15
    request_deadline_s: float = 60.0
    # A process's first seconds (imports, pools filling) are not its slope.
    warmup_s: float = 60.0
    # The sim's pace: a stream of N tokens lasts about N / rate seconds.
    sim_ttft_s: float = 0.1
    sim_tokens_per_s: float = 200.0


@dataclass
class Request:
    """One client request, as planned and as it ended."""

    surface: str
    stream: bool
    model: str
    action: str  # "plain", "cancel-before", "cancel-after"
    tools: bool
    tenant: str
    t: float = 0.0
    outcome: str = ""
    detail: str = ""
    usage: tuple[int, int, int] = (0, 0, 0)  # input, output, cached
    terminals: int = 0
    saw_output: bool = False
    tool_call: bool = False


def plan(rng: random.Random, opts: Options) -> Request:
    """The next request of a worker (all choices from its seeded ``rng``)."""
    surface = rng.choice(SURFACES)
    stream = rng.random() < 0.6
    llama = rng.random() < opts.llama_share
    action = "plain"
    if stream and not llama:
        x = rng.random()
        if x < opts.cancel_before_share:
            action = "cancel-before"
        elif x < opts.cancel_before_share + opts.cancel_after_share:
            action = "cancel-after"
    tools = not llama and surface != "completions" and rng.random() < opts.tools_share
    return Request(
        surface=surface,
        stream=stream,
        model=LLAMA_MODEL if llama else SIM_MODEL,
        action=action,
        tools=tools,
        tenant=rng.choice(("alpha", "beta")),
    )


def body(req: Request, rng: random.Random) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of ``req``."""
    sim = req.model == SIM_MODEL
    # Long enough that a stream cancelled after its first token is still running.
    n = rng.randint(40, 120) if req.action != "plain" else rng.randint(4, 48)
    # 16 at least: OpenAI's floor of max_output_tokens (Responses).
    max_tokens = n + 16 if sim else rng.randint(16, 24)
    text = f"Say something about the number {rng.randint(1, 10_000)}."
    extra: dict[str, Any] = {"iop_sim": {"output_tokens": n}} if sim else {}
    b: dict[str, Any]
    if req.surface == "chat":
        path = "/v1/chat/completions"
        b = {"model": req.model, "messages": [{"role": "user", "content": text}]}
        b["max_tokens"] = max_tokens
        if req.tools:
            b["tools"] = _TOOLS_CHAT
        if req.stream:
            b["stream_options"] = {"include_usage": True}
    elif req.surface == "completions":
        path = "/v1/completions"
        b = {"model": req.model, "prompt": text, "max_tokens": max_tokens}
        if req.stream:
            b["stream_options"] = {"include_usage": True}
    elif req.surface == "responses":
        path = "/v1/responses"
        b = {"model": req.model, "input": text, "max_output_tokens": max_tokens}
        if req.tools:
            b["tools"] = _TOOLS_RESPONSES
    else:
        path = "/v1/messages"
        b = {
            "model": req.model,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": text}],
        }
        if req.tools:
            b["tools"] = _TOOLS_MESSAGES
    b["stream"] = req.stream
    return path, b | extra


def _chat_usage(u: dict[str, Any] | None) -> tuple[int, int, int]:
    if not u:
        return (0, 0, 0)
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return (u.get("prompt_tokens", 0), u.get("completion_tokens", 0), cached)


def _responses_usage(u: dict[str, Any] | None) -> tuple[int, int, int]:
    if not u:
        return (0, 0, 0)
    cached = (u.get("input_tokens_details") or {}).get("cached_tokens") or 0
    return (u.get("input_tokens", 0), u.get("output_tokens", 0), cached)


def _messages_usage(u: dict[str, Any]) -> tuple[int, int, int]:
    # Anthropic's input_tokens leaves out the cache reads (iop/api/messages/_encode.py).
    cached = u.get("cache_read_input_tokens") or 0
    return (u.get("input_tokens", 0) + cached, u.get("output_tokens", 0), cached)


class _Stream:
    """What one SSE stream carried, surface by surface (the terminals counted)."""

    def __init__(self, surface: str) -> None:
        self.surface = surface
        self.terminals: list[str] = []  # "complete" / "error", in order
        self.after_terminal = 0  # events after the last terminal
        self.output = False
        self.tool_call = False
        self.usage: tuple[int, int, int] = (0, 0, 0)
        self._finish = False
        self._error = False
        self._msg_in: dict[str, Any] = {}
        self.error = ""  # the error terminal's own words

    def feed(self, data: str) -> None:
        if self.terminals and not (self.surface in ("chat", "completions") and data == "[DONE]"):
            self.after_terminal += 1
        if self.surface in ("chat", "completions"):
            self._feed_chat(data)
        elif self.surface == "responses":
            self._feed_responses(json.loads(data))
        else:
            self._feed_messages(json.loads(data))

    def _feed_chat(self, data: str) -> None:
        if data == "[DONE]":
            # [DONE] closes either a finished or a failed stream: one terminal.
            if self._error:
                self.terminals.append("error")
            elif self._finish:
                self.terminals.append("complete")
            else:
                self.terminals.append("no finish")
            return
        obj = json.loads(data)
        if "error" in obj:
            self._error = True
            self.error = str(obj["error"])[:200]
            return
        for ch in obj.get("choices") or []:
            delta = ch.get("delta") or {}
            if delta.get("content") or ch.get("text") or delta.get("tool_calls"):
                self.output = True
            if delta.get("tool_calls"):
                self.tool_call = True
            if ch.get("finish_reason"):
                self._finish = True
        if obj.get("usage"):
            self.usage = _chat_usage(obj["usage"])

    def _feed_responses(self, obj: dict[str, Any]) -> None:
        kind = obj.get("type", "")
        if kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
            self.output = True
        if kind == "response.output_item.added" and obj.get("item", {}).get("type") == (
            "function_call"
        ):
            self.tool_call = True
        if kind in ("response.completed", "response.incomplete"):
            self.usage = _responses_usage(obj["response"].get("usage"))
            self.terminals.append("complete")
        elif kind in ("response.failed", "error"):
            self.terminals.append("error")
            self.error = str(obj.get("response", {}).get("error") or obj)[:200]

    def _feed_messages(self, obj: dict[str, Any]) -> None:
        kind = obj.get("type", "")
        if kind == "message_start":
            self._msg_in = obj["message"].get("usage") or {}
        elif kind == "content_block_start" and obj["content_block"].get("type") == "tool_use":
            self.tool_call = True
        elif kind == "content_block_delta":
            self.output = True
        elif kind == "message_delta":
            self.usage = _messages_usage({**self._msg_in, **(obj.get("usage") or {})})
        elif kind == "message_stop":
            self.terminals.append("complete")
        elif kind == "error":
            self.terminals.append("error")
            self.error = str(obj.get("error"))[:200]


def _non_stream_usage(surface: str, doc: dict[str, Any]) -> tuple[tuple[int, int, int], bool]:
    if surface in ("chat", "completions"):
        choices = doc.get("choices") or [{}]
        tool = bool((choices[0].get("message") or {}).get("tool_calls"))
        return _chat_usage(doc.get("usage")), tool
    if surface == "responses":
        tool = any(item.get("type") == "function_call" for item in doc.get("output") or [])
        return _responses_usage(doc.get("usage")), tool
    tool = any(block.get("type") == "tool_use" for block in doc.get("content") or [])
    return _messages_usage(doc.get("usage") or {}), tool


async def send(client: httpx.AsyncClient, req: Request, rng: random.Random, opts: Options) -> None:
    """Send ``req`` and record how it ended (never raises but Cancelled)."""
    path, b = body(req, rng)
    key = KEYS[req.tenant]
    headers = (
        {"x-api-key": key, "anthropic-version": "2023-06-01"}
        if req.surface == "messages"
        else {"Authorization": f"Bearer {key}"}
    )
    cancel_before = rng.uniform(0.0, opts.sim_ttft_s / 2)
    with trio.move_on_after(opts.request_deadline_s) as deadline:
        try:
            if req.stream:
                await _stream(client, path, b, headers, req, cancel_before)
            else:
                r = await client.post(path, json=b, headers=headers)
                if r.status_code != 200:
                    req.outcome, req.detail = f"http {r.status_code}", r.text[:200]
                    req.terminals = 1
                else:
                    doc = r.json()
                    req.usage, req.tool_call = _non_stream_usage(req.surface, doc)
                    req.terminals = 1
                    failed = req.surface == "responses" and doc.get("status") == "failed"
                    req.outcome = "error" if failed else "complete"
        except httpx.TransportError as exc:
            req.outcome, req.detail = f"transport {type(exc).__name__}", str(exc)[:200]
        except (json.JSONDecodeError, KeyError) as exc:  # a body not of its surface's shape
            req.outcome, req.detail = f"malformed {type(exc).__name__}", str(exc)[:200]
    if deadline.cancelled_caught:
        req.outcome = "hang"


async def _stream(
    client: httpx.AsyncClient,
    path: str,
    b: dict[str, Any],
    headers: dict[str, str],
    req: Request,
    cancel_before: float,
) -> None:
    s = _Stream(req.surface)
    with trio.CancelScope() as scope:
        if req.action == "cancel-before":
            scope.deadline = trio.current_time() + cancel_before
        async with client.stream("POST", path, json=b, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                req.outcome, req.detail = f"http {r.status_code}", r.text[:200]
                req.terminals = 1
                return
            buf = b""
            async for piece in r.aiter_raw():
                payloads, buf = sse_data(buf + piece)
                for payload in payloads:
                    s.feed(payload.decode())
                    if req.action == "cancel-after" and s.output:
                        scope.cancel()
    req.saw_output, req.tool_call, req.usage = s.output, s.tool_call, s.usage
    if req.outcome:
        return
    if scope.cancelled_caught:
        req.outcome = "cancelled"
        req.terminals = 1
        return
    req.terminals = len(s.terminals)
    if len(s.terminals) == 1 and s.after_terminal == 0 and s.terminals[0] in TERMINAL_OUTCOMES:
        req.outcome, req.detail = s.terminals[0], s.error
    elif not s.terminals:
        req.outcome = "no terminal"
    else:
        req.outcome = "bad terminals"
        req.detail = f"{s.terminals} then {s.after_terminal} events"


async def traffic(url: str, opts: Options, until: float, out: list[Request]) -> None:
    """``opts.concurrency`` seeded workers, each one request at a time until ``until``."""
    t0 = trio.current_time()

    async def worker(i: int) -> None:
        rng = random.Random(opts.seed * 1000 + i)
        async with httpx.AsyncClient(base_url=url, timeout=None, trust_env=False) as client:
            while trio.current_time() < until:
                req = plan(rng, opts)
                req.t = round(trio.current_time() - t0, 2)
                await send(client, req, rng, opts)
                out.append(req)
                await trio.sleep(rng.expovariate(1 / opts.think_s))

    async with trio.open_nursery() as n:
        for i in range(opts.concurrency):
            n.start_soon(worker, i)


def outcomes(requests: list[Request]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    by_surface: dict[str, dict[str, int]] = {}
    for r in requests:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
        key = f"{r.surface} {'stream' if r.stream else 'whole'}"
        cell = by_surface.setdefault(key, {})
        cell[r.outcome] = cell.get(r.outcome, 0) + 1
    anomalies = [
        {
            "t": r.t,
            "surface": r.surface,
            "stream": r.stream,
            "model": r.model,
            "action": r.action,
            "outcome": r.outcome,
            "detail": r.detail,
        }
        for r in requests
        if not (r.outcome in TERMINAL_OUTCOMES or r.outcome.startswith("http "))
    ]
    examples: dict[str, str] = {}
    per_surface: dict[str, list[int]] = {}
    for r in requests:
        if r.detail and r.outcome not in examples:
            examples[r.outcome] = f"{r.surface} {r.model}: {r.detail}"
        if r.outcome == "complete":
            key = f"{r.surface} {'stream' if r.stream else 'whole'} {r.model}"
            sums = per_surface.setdefault(key, [0, 0, 0, 0])
            for i in range(3):
                sums[i] += r.usage[i]
            sums[3] += 1
    return {
        "requests": len(requests),
        "counts": dict(sorted(counts.items())),
        "examples": dict(sorted(examples.items())),
        # Per surface, shape and model: input, output, cached tokens, requests.
        "client_usage": dict(sorted(per_surface.items())),
        "by_surface": dict(sorted(by_surface.items())),
        "tool_calls": sum(r.tool_call for r in requests if r.outcome == "complete"),
        "cancel_before_with_output": sum(
            r.saw_output for r in requests if r.action == "cancel-before"
        ),
        "single_terminal": sum(r.terminals == 1 for r in requests),
        "anomalies": anomalies[:50],
        "anomaly_count": len(anomalies),
    }
