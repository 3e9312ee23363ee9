"""``soak``: mixed traffic on every surface for a long while, with faults on
a schedule; memory and file descriptors of every process over time, every
run's single terminal, and the usage ledger against what clients saw.

Theory of operation
-------------------
One run starts a ``valkey-server`` (``iop.bench._edges.valkey_binary``),
``iop sim`` (a paced vLLM-compatible backend that answers tool calls), one
``iop edge`` (two tenants, a usage ledger, ``[cluster]`` on that Valkey, an
admin key) and two nodes: ``node-sim`` (the sim as a ``vllm`` instance) and
``node-llama`` (a managed ``adapter = "llamacpp"`` instance: the node runs
llama.cpp's server with the packaged SmolLM2-135M itself and supervises it).

Then, for ``duration_s``, three kinds of task run side by side:

* **traffic**: ``concurrency`` seeded workers, each a loop of one request at
  a time: chat, completions, Responses or Messages, streamed or not, on the
  sim or on llama.cpp, some with tools (sim), some cancelled by the client
  before their first token or right after it (sim, streams). Every request
  runs under a deadline (``request_deadline_s``): one that reaches it is a
  *hang*. Each ends in one outcome: ``complete`` (its surface's success
  terminal: ``finish_reason`` then ``[DONE]``, ``response.completed`` or
  ``response.incomplete``, ``message_stop``; a 200 body), ``error`` (the
  surface's error terminal in the stream), ``http NNN`` (an error status),
  ``cancelled`` (the client hung up on purpose), or an anomaly: no
  terminal, more than one, a transport error, a hang.
* **faults**, at fixed fractions of the duration: ``node-sim`` killed
  (SIGKILL) and started again, the managed ``llama-server`` killed
  (``kill -9``; the node restarts it), Valkey stopped and started again on
  its port, and ``reloads`` reloads of the edge spread over the run
  (SIGHUP and ``POST /admin/reload`` in turn, each changing one tenant's
  limit so that it is applied, docs/operations.md "Reloading").
* **samples** every ``sample_s``: RSS (``rss_kb``), open fds (the entries
  of ``/proc/PID/fd``) and CPU seconds of every process, a restarted one
  under its role's name with its new pid; a process that exits when no
  fault killed it is recorded as a death.

At the end the traffic stops, the edge is waited idle, its ``iop_runs``
counter is read from ``/metrics``, and the edge is stopped gracefully (a
graceful stop writes every queued ledger row). The ledger is then read back
(``iop usage --format json`` for its totals, ``LedgerStore`` for its rows
by outcome): the tokens of its ``complete`` rows must equal the usage the
clients received for their completed requests, its ``complete`` rows their
count, and its row count the runs the edge counted. Per process, the least
squares slope of RSS (KiB/min) and of fds (per minute) over the samples of
its last incarnation, after ``warmup_s``.

The run measures and records; the suite's two-minute run
(tests/test_bench_soak.py) asserts the invariants.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx
import msgspec
import trio

from iop.bench._edges import key_digest
from iop.bench._procs import descendants, fd_count, proc_cpu_s, rss_kb, start_valkey
from iop.bench._report import import_matplotlib
from iop.bench._runner import ReportInput, RunContext, register
from iop.ledger import LedgerStore
from iop.testing import EDGE_READY, NODE_READY, SIM_READY, Proc, free_port, poll, toml_dumps

__all__ = ["Options", "plot", "run", "slope", "tables"]

_TOKEN: Final = "iop-bench-soak-node-token"
_OPERATOR: Final = "iop-bench-soak-operator"
_KEYS: Final = {"alpha": "iop-bench-soak-alpha", "beta": "iop-bench-soak-beta"}
SIM_MODEL: Final = "iop-sim"
LLAMA_MODEL: Final = "SmolLM2-135M-Instruct"
SURFACES: Final = ("chat", "completions", "responses", "messages")
# The outcomes that are a request's one terminal; anything else is an anomaly.
TERMINAL_OUTCOMES: Final = ("complete", "error", "cancelled")
# Start-ups on a loaded 2-core box: llama.cpp loads its model in ~1 s alone.
START_S: Final = 90.0
# A fault's recovery (a node's re-dial, llama.cpp's restart) gets this long.
RECOVER_S: Final = 90.0
# The edge's last runs, after the traffic stops, end within this.
IDLE_S: Final = 60.0

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
    """The ``soak`` runner's options (``[args]`` of its scenario)."""

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


# --------------------------------------------------------------------------- processes


@dataclass
class _Stack:
    """The soak's processes by role; a restarted one replaces its role's entry."""

    opts: Options
    ctx: RunContext
    procs: dict[str, Proc] = field(default_factory=dict)
    # Every process ever started, with whether a fault ended it on purpose.
    history: list[tuple[Proc, bool]] = field(default_factory=list)
    killed: set[int] = field(default_factory=set)  # pids a fault ended
    generation: dict[str, int] = field(default_factory=dict)
    reload_rpm: int = 1_000_000

    @property
    def wd(self) -> Path:
        return self.ctx.workdir

    def _launch(self, role: str, args: list[str], **kw: Any) -> Proc:
        gen = self.generation.get(role, 0) + 1
        self.generation[role] = gen
        name = role if gen == 1 else f"{role}-{gen}"
        proc = Proc(name, args, self.wd, python=self.ctx.python, **kw)
        self.procs[role] = proc
        self.history.append((proc, False))
        return proc

    def start_valkey(self) -> None:
        start_valkey(lambda argv: self._launch("valkey", [], argv=argv), self.valkey_port)

    def edge_config(self) -> dict[str, Any]:
        return {
            "server": {"admin_keys": [_OPERATOR]},
            "usage": {"ledger_path": str(self.wd / "usage.db"), "flush_interval_s": 0.5},
            "prices": {"*": {"input": 0.5, "output": 1.5}},
            "cluster": {
                "valkey_url": f"redis://127.0.0.1:{self.valkey_port}/0",
                "edge_id": "soak-edge",
                "key_prefix": "soak:",
            },
            "tenants": [
                {
                    "name": "alpha",
                    "keys": [{"sha256": key_digest(_KEYS["alpha"]), "name": "alpha-ci"}],
                    # Changed by every reload, never reached.
                    "requests_per_minute": self.reload_rpm,
                    "max_concurrent_runs": 1000,
                },
                {
                    "name": "beta",
                    "key_sha256": [key_digest(_KEYS["beta"])],
                    "tokens_per_minute": 100_000_000,
                },
            ],
        }

    def start(self) -> None:
        self.valkey_port = free_port()
        self.start_valkey()
        sim = self._launch(
            "sim",
            [
                "sim",
                "--port",
                "0",
                "--ttft",
                str(self.opts.sim_ttft_s),
                "--tokens-per-s",
                str(self.opts.sim_tokens_per_s),
                "--seed",
                str(self.opts.seed),
                "--log-level",
                "warning",
            ],
        )
        self.sim_url = sim.wait_stdout(SIM_READY, START_S).group(1)
        self.edge_path = self.wd / "edge.toml"
        self.edge_path.write_text(toml_dumps(self.edge_config()))
        edge = self._launch(
            "edge",
            ["edge", "--port", "0", "--node-token", _TOKEN, "--config", str(self.edge_path)],
        )
        m = edge.wait_stdout(EDGE_READY, START_S)
        self.url, self.link = m.group(1), m.group(2)
        self.start_node_sim()
        self.start_node_llama()
        self.wait_models({SIM_MODEL, LLAMA_MODEL})
        self.llama_pid()  # it runs

    def _node_config(self, node_id: str, instance: dict[str, Any]) -> Path:
        cfg = {
            "node": {
                "id": node_id,
                "reconnect_min_s": 0.1,
                "reconnect_max_s": 1.0,
                "edges": [{"url": self.link, "token": _TOKEN}],
            },
            "instances": [instance],
        }
        path = self.wd / f"{node_id}.toml"
        path.write_text(toml_dumps(cfg))
        return path

    def start_node_sim(self) -> None:
        path = self._node_config(
            "node-sim",
            {"adapter": "vllm", "name": "sim", "endpoint": self.sim_url, "max_concurrency": 32},
        )
        self._launch("node-sim", ["node", "--config", str(path)]).wait_stdout(NODE_READY, START_S)

    def start_node_llama(self) -> None:
        path = self._node_config(
            "node-llama",
            {
                "adapter": "llamacpp",
                "name": "llama",
                "parallel": 2,
                "ctx": 2048,
                "threads": 1,
                "supervise": {"restart_min_s": 1.0, "restart_max_s": 10.0},
            },
        )
        self._launch("node-llama", ["node", "--config", str(path)]).wait_stdout(NODE_READY, START_S)

    def llama_pid(self) -> int | None:
        """The managed llama.cpp server's pid while it serves, or None: the
        last one the node logged ready (docs/operations.md, "When a managed
        backend dies"), if it is still its descendant."""
        node = self.procs["node-llama"]
        ready = re.findall(r"llama\.cpp server is ready at .*\bpid (\d+)\)", node.stderr())
        if not ready or int(ready[-1]) not in descendants(node.pid):
            return None
        return int(ready[-1])

    def _get(self, path: str, key: str = _OPERATOR) -> httpx.Response:
        return httpx.get(
            self.url + path,
            headers={"Authorization": f"Bearer {key}"},
            timeout=10,
            trust_env=False,
        )

    def models(self) -> set[str]:
        try:
            r = self._get("/v1/models", _KEYS["alpha"])
        except httpx.TransportError:
            return set()
        return {m["id"] for m in r.json()["data"]} if r.status_code == 200 else set()

    def node_state(self) -> dict[str, Any]:
        r = self._get("/admin/nodes")
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data

    def ready(self, want: set[str]) -> bool:
        """Every model of ``want`` served by an available instance."""
        if not want <= self.models():
            return False
        up: set[str] = set()
        for node in self.node_state()["nodes"]:
            for inst in node.get("instances", []):
                if inst.get("status", "available") == "available":
                    up.update(inst.get("models", []))
        return want <= up if up else True

    def wait_models(self, want: set[str]) -> None:
        def check() -> bool:
            for role, proc in self.procs.items():
                if not proc.alive:
                    raise RuntimeError(f"{role} exited:\n{proc.logs()}")
            return self.ready(want)

        poll(check, timeout=START_S, what=f"the edge to serve {sorted(want)}", interval=0.2)

    def kill(self, role: str) -> Proc:
        proc = self.procs[role]
        self.killed.add(proc.pid)
        proc.kill()
        return proc

    def stop(self) -> dict[str, int | None]:
        """Stop every process still running (last started first); their exit codes."""
        codes: dict[str, int | None] = {}
        for proc, _ in reversed(self.history):
            if proc.alive:
                try:
                    codes[proc.name] = proc.stop()
                except Exception as exc:  # recorded: the run goes on stopping the rest
                    codes[proc.name] = None
                    print(f"bench soak: stopping {proc.name}: {exc!r}")
        return codes


# --------------------------------------------------------------------------- traffic


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
    # Anthropic's input_tokens leaves out the cache reads (iop/api/messages/_stream.py).
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
    key = _KEYS[req.tenant]
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
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                s.feed(line[5:].strip())
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


# --------------------------------------------------------------------------- faults


@dataclass
class Fault:
    at_s: float
    kind: str  # "reload-sighup", "reload-post", "node-kill", "llama-kill", "valkey-restart"
    done_s: float | None = None
    recovered_s: float | None = None  # from the fault to serving again
    detail: str = ""


def schedule(opts: Options, duration: float) -> list[Fault]:
    """The faults of a run of ``duration`` seconds, in time order."""
    faults = [
        Fault(0.2 * duration, "node-kill"),
        Fault(0.4 * duration, "llama-kill"),
        Fault(0.6 * duration, "valkey-restart"),
    ]
    for i in range(opts.reloads):
        kind = "reload-sighup" if i % 2 == 0 else "reload-post"
        faults.append(Fault((i + 0.5) / opts.reloads * duration * 0.9, kind))
    return sorted(faults, key=lambda f: f.at_s)


def apply_fault(stack: _Stack, fault: Fault) -> None:
    """Do ``fault`` and wait until the stack serves again (blocking: run in a thread)."""
    t0 = time.monotonic()
    if fault.kind.startswith("reload"):
        stack.reload_rpm += 1
        stack.edge_path.write_text(toml_dumps(stack.edge_config()))
        if fault.kind == "reload-sighup":
            edge = stack.procs["edge"]
            n = edge.stderr().count("reload (SIGHUP)")
            edge.send(signal.SIGHUP)
            m = poll(
                lambda: re.findall(r"reload \(SIGHUP\): (\w+)", edge.stderr())[n:] or None,
                timeout=RECOVER_S,
                what="the edge to log its reload",
                interval=0.1,
            )
            fault.detail = m[0]
        else:
            r = httpx.post(
                stack.url + "/admin/reload",
                headers={"Authorization": f"Bearer {_OPERATOR}"},
                timeout=30,
                trust_env=False,
            )
            fault.detail = r.json().get("status") if r.status_code == 200 else r.text[:200]
    elif fault.kind == "node-kill":
        stack.kill("node-sim")
        fault.done_s = round(time.monotonic() - t0, 2)
        stack.start_node_sim()
        stack.wait_models({SIM_MODEL})
    elif fault.kind == "llama-kill":
        pid = stack.llama_pid()
        if pid is None:
            raise RuntimeError("no llama.cpp server to kill")
        os.kill(pid, signal.SIGKILL)
        stack.killed.add(pid)
        poll(
            lambda: (p := stack.llama_pid()) is not None and p != pid,
            timeout=RECOVER_S,
            what="the node to restart llama.cpp",
            interval=0.2,
        )
        stack.wait_models({LLAMA_MODEL})
        fault.detail = f"pid {pid} killed"
    elif fault.kind == "valkey-restart":
        old = stack.procs["valkey"]
        stack.killed.add(old.pid)
        old.stop()
        fault.done_s = round(time.monotonic() - t0, 2)
        stack.start_valkey()
    else:
        raise ValueError(fault.kind)
    fault.recovered_s = round(time.monotonic() - t0, 2)


async def run_faults(stack: _Stack, faults: list[Fault], t0: float) -> None:
    for fault in faults:
        await trio.sleep_until(t0 + fault.at_s)
        await trio.to_thread.run_sync(apply_fault, stack, fault)


# --------------------------------------------------------------------------- samples


def _roles(stack: _Stack) -> dict[str, int]:
    pids = {role: p.pid for role, p in stack.procs.items() if p.alive}
    llama = stack.llama_pid()
    if llama is not None:
        pids["llama-server"] = llama
    return pids


def take_sample(stack: _Stack, t: float) -> dict[str, Any]:
    """RSS, fds and CPU of every process of the stack at ``t`` seconds."""
    procs: dict[str, Any] = {}
    for role, pid in _roles(stack).items():
        try:
            procs[role] = {
                "pid": pid,
                "rss_kb": rss_kb(pid),
                "fds": fd_count(pid),
                "cpu_s": round(proc_cpu_s(pid), 2),
            }
        except (OSError, RuntimeError, IndexError):
            continue  # it ended between the listing and the reads
    return {"t": round(t, 1), "procs": procs}


def deaths(stack: _Stack) -> list[dict[str, Any]]:
    """Processes that exited when no fault ended them."""
    return [
        {"name": p.name, "pid": p.pid, "rc": p.returncode}
        for p, _ in stack.history
        if not p.alive and p.pid not in stack.killed
    ]


async def sampler(
    stack: _Stack, t0: float, until: float, period: float, out: list[dict[str, Any]]
) -> None:
    while True:
        out.append(take_sample(stack, trio.current_time() - t0))
        if trio.current_time() + period > until:
            return
        await trio.sleep(period)


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least squares slope of ``(x, y)`` points (None for fewer than 3)."""
    n = len(points)
    if n < 3:
        return None
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def slopes(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    """Per role: RSS (KiB/min) and fds (per minute) slopes over its last
    incarnation's samples after its first ``warmup_s``, and their ranges."""
    out: dict[str, Any] = {}
    roles = sorted({r for s in samples for r in s["procs"]})
    for role in roles:
        series = [(s["t"], s["procs"][role]) for s in samples if role in s["procs"]]
        last_pid = series[-1][1]["pid"]
        mine = [(t, p) for t, p in series if p["pid"] == last_pid]
        born = mine[0][0]
        steady = [(t, p) for t, p in mine if t >= born + warmup_s] or mine
        rss = slope([(t / 60, p["rss_kb"]) for t, p in steady])
        fds = slope([(t / 60, p["fds"]) for t, p in steady])
        out[role] = {
            "incarnations": len({p["pid"] for _, p in series}),
            "samples": len(steady),
            "from_s": steady[0][0],
            "rss_kib_per_min": None if rss is None else round(rss, 1),
            "fds_per_min": None if fds is None else round(fds, 3),
            "rss_first_kb": steady[0][1]["rss_kb"],
            "rss_last_kb": steady[-1][1]["rss_kb"],
            "rss_max_kb": max(p["rss_kb"] for _, p in series),
            "fds_first": steady[0][1]["fds"],
            "fds_last": steady[-1][1]["fds"],
            "fds_max": max(p["fds"] for _, p in series),
            "cpu_s": round(sum(_cpu_of(series, pid) for pid in {p["pid"] for _, p in series}), 1),
        }
    return out


def _cpu_of(series: list[tuple[float, dict[str, Any]]], pid: int) -> float:
    mine = [p["cpu_s"] for _, p in series if p["pid"] == pid]
    return mine[-1] - mine[0] if mine else 0.0


# --------------------------------------------------------------------------- the ledger


def _edge_runs(stack: _Stack) -> dict[str, int]:
    """The edge's ``iop_runs_total`` by outcome (``/metrics``)."""
    text = stack._get("/metrics").text
    runs: dict[str, int] = {}
    for labels, value in re.findall(r"^iop_runs_total\{([^}]*)\} (\S+)$", text, re.MULTILINE):
        outcome = re.search(r'outcome="([^"]*)"', labels)
        key = outcome.group(1) if outcome else "?"
        runs[key] = runs.get(key, 0) + int(float(value))
    return runs


def ledger(stack: _Stack, requests: list[Request]) -> dict[str, Any]:
    """The ledger (read after the edge's graceful stop) against the clients."""
    path = stack.wd / "usage.db"
    usage_cli = subprocess.run(
        [stack.ctx.python, "-m", "iop", "usage", "--ledger", str(path), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if usage_cli.returncode != 0:
        raise RuntimeError(f"iop usage failed: {usage_cli.stderr}")
    report = json.loads(usage_cli.stdout)
    store = LedgerStore(path, readonly=True)
    try:
        records = store.since(0)
    finally:
        store.close()
    by_outcome: dict[str, int] = {}
    tokens = [0, 0, 0]
    for rec in records:
        by_outcome[rec.outcome] = by_outcome.get(rec.outcome, 0) + 1
        if rec.outcome == "complete":
            tokens[0] += rec.input_tokens
            tokens[1] += rec.output_tokens
            tokens[2] += rec.cached_tokens
    done = [r for r in requests if r.outcome == "complete"]
    client = [sum(r.usage[i] for r in done) for i in range(3)]
    return {
        "records": len(records),
        "usage_cli": report.get("total", report),
        "by_outcome": by_outcome,
        "complete_tokens": {"input": tokens[0], "output": tokens[1], "cached": tokens[2]},
        "client_complete": len(done),
        "client_tokens": {"input": client[0], "output": client[1], "cached": client[2]},
        "tokens_equal": tokens == client,
        "complete_equal": by_outcome.get("complete", 0) == len(done),
    }


# --------------------------------------------------------------------------- the run


def _outcomes(requests: list[Request]) -> dict[str, Any]:
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


async def _soak(stack: _Stack, opts: Options, duration: float) -> dict[str, Any]:
    requests: list[Request] = []
    samples: list[dict[str, Any]] = []
    faults = schedule(opts, duration)
    t0 = trio.current_time()
    until = t0 + duration
    async with trio.open_nursery() as n:
        n.start_soon(traffic, stack.url, opts, until, requests)
        n.start_soon(run_faults, stack, faults, t0)
        n.start_soon(sampler, stack, t0, until, opts.sample_s, samples)
    return {"requests": requests, "samples": samples, "faults": faults}


@register(
    "soak",
    Options,
    "Mixed traffic on every surface with faults on a schedule: RSS and fd slopes of every "
    "process, one terminal per request, the usage ledger against the clients.",
    report=lambda r: report(r),
)
def run(opts: Options, ctx: RunContext) -> dict[str, Any]:
    if ctx.smoke:
        opts = msgspec.structs.replace(
            opts,
            duration_s=min(opts.duration_s, 120.0),
            concurrency=min(opts.concurrency, 3),
            sample_s=min(opts.sample_s, 2.0),
            warmup_s=min(opts.warmup_s, 10.0),
        )
    stack = _Stack(opts, ctx)
    try:
        stack.start()
        got = trio.run(_soak, stack, opts, opts.duration_s)
        died = deaths(stack)
        idle = True
        try:
            poll(
                lambda: not (s := stack.node_state())["runs"] and not s["queued"],
                timeout=IDLE_S,
                what="the edge to be idle",
                interval=0.2,
            )
        except AssertionError:
            idle = False
        final = take_sample(stack, time.monotonic())
        edge_runs = _edge_runs(stack)
        edge_rc = stack.procs["edge"].stop()
        book = ledger(stack, got["requests"])
    finally:
        codes = stack.stop()
    samples = got["samples"]
    return {
        "options": msgspec.to_builtins(opts),
        "cores": os.cpu_count(),
        "outcomes": _outcomes(got["requests"]),
        "faults": [msgspec.to_builtins(_fault_dict(f)) for f in got["faults"]],
        "deaths": died,
        "idle_at_end": idle,
        "final_fds": {k: v["fds"] for k, v in final["procs"].items()},
        "edge_runs": edge_runs,
        "edge_runs_total": sum(edge_runs.values()),
        "edge_exit": edge_rc,
        "exit_codes": codes,
        "ledger": book,
        "ledger_equals_edge": book["records"] == sum(edge_runs.values()),
        "slopes": slopes(samples, opts.warmup_s),
        "series": {
            "t": [s["t"] for s in samples],
            "procs": {
                role: {
                    "rss_kb": [s["procs"].get(role, {}).get("rss_kb") for s in samples],
                    "fds": [s["procs"].get(role, {}).get("fds") for s in samples],
                }
                for role in sorted({r for s in samples for r in s["procs"]})
            },
        },
    }


def _fault_dict(f: Fault) -> dict[str, Any]:
    return {
        "at_s": round(f.at_s, 1),
        "kind": f.kind,
        "recovered_s": f.recovered_s,
        "detail": f.detail,
    }


# --------------------------------------------------------------------------- report


def tables(result: dict[str, Any]) -> str:
    """The Markdown tables of one result."""
    o = result["outcomes"]
    lines = [
        "| process | incarnations | RSS first → last (MiB) | RSS slope (KiB/min) "
        "| fds first → last (max) | fd slope (/min) | CPU s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for role, s in result["slopes"].items():
        lines.append(
            f"| {role} | {s['incarnations']} | {s['rss_first_kb'] / 1024:.1f} → "
            f"{s['rss_last_kb'] / 1024:.1f} | {_num(s['rss_kib_per_min'])} "
            f"| {s['fds_first']} → {s['fds_last']} ({s['fds_max']}) "
            f"| {_num(s['fds_per_min'], 3)} | {s['cpu_s']} |"
        )
    counts = ", ".join(f"{k} {v}" for k, v in o["counts"].items())
    lines += [
        "",
        "| requests | outcomes | exactly one terminal | anomalies | tool calls |",
        "| ---: | --- | ---: | ---: | ---: |",
        f"| {o['requests']} | {counts} | {o['single_terminal']} | {o['anomaly_count']} "
        f"| {o['tool_calls']} |",
    ]
    b = result["ledger"]
    ct, lt = b["client_tokens"], b["complete_tokens"]
    lines += [
        "",
        "| | runs | complete | input tokens | output tokens | cached |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        f"| clients | \u2013 | {b['client_complete']} | {ct['input']} | {ct['output']} "
        f"| {ct['cached']} |",
        f"| ledger | {b['records']} | {b['by_outcome'].get('complete', 0)} | {lt['input']} "
        f"| {lt['output']} | {lt['cached']} |",
        f"| edge (`iop_runs_total`) | {result['edge_runs_total']} "
        f"| {result['edge_runs'].get('complete', 0)} | | | |",
    ]
    faults = ", ".join(
        f"{f['kind']} at {f['at_s']:.0f} s (back in {f['recovered_s']} s)"
        for f in result["faults"]
        if not f["kind"].startswith("reload")
    )
    reloads = [f for f in result["faults"] if f["kind"].startswith("reload")]
    died = ", ".join(f"{d['name']} (rc {d['rc']})" for d in result["deaths"]) or "none"
    lines += [
        "",
        f"Faults: {faults}; {len(reloads)} reloads "
        f"({', '.join(sorted({f['detail'] for f in reloads}))}). "
        f"Unplanned exits: {died}.",
    ]
    return "\n".join(lines) + "\n"


def _num(v: float | None, nd: int = 1) -> str:
    return "\u2013" if v is None else f"{v:+.{nd}f}"


def plot(result: dict[str, Any], path: Path) -> Path:
    """RSS of IOP's processes and Valkey, RSS of llama.cpp's server (ten times
    theirs: its own axis), and every process's open fds, the faults marked."""
    import_matplotlib()
    import matplotlib.pyplot as plt

    series = result["series"]
    minutes = [t / 60 for t in series["t"]]
    fig, (ax_rss, ax_llama, ax_fd) = plt.subplots(
        3, 1, figsize=(9, 9), sharex=True, gridspec_kw={"height_ratios": [3, 2, 3]}
    )
    for role, s in series["procs"].items():
        rss = [None if v is None else v / 1024 for v in s["rss_kb"]]
        (ax_llama if role == "llama-server" else ax_rss).plot(
            minutes, rss, label=role, linewidth=1.2
        )
        ax_fd.plot(minutes, s["fds"], label=role, linewidth=1.0)
    for f in result["faults"]:
        reload = f["kind"].startswith("reload")
        for ax in (ax_rss, ax_llama, ax_fd):
            ax.axvline(
                f["at_s"] / 60,
                color="#bbbbbb" if reload else "#C44E52",
                linestyle=":" if reload else "--",
                linewidth=0.8,
            )
    ax_rss.set_ylabel("RSS (MiB)")
    ax_rss.set_ylim(bottom=0)
    ax_llama.set_ylabel("llama-server\nRSS (MiB)")
    ax_llama.set_ylim(bottom=0)
    ax_fd.set_ylabel("open fds")
    ax_fd.set_ylim(bottom=0)
    ax_fd.set_xlabel("minutes (red dashes: kills and restarts; grey dots: reloads)")
    ax_rss.legend(fontsize=8, ncol=3, loc="lower right")
    ax_fd.legend(fontsize=8, ncol=3, loc="lower right")
    ax_rss.set_title("Soak: every process's memory and file descriptors over the run")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(r: ReportInput) -> dict[str, str]:
    """The scenario's table, and its plot ``bench_SCENARIO.png`` in ``r.img_dir``."""
    plot(r.median, r.img_dir / f"bench_{r.scenario}.png")
    return {r.scenario: f"{tables(r.median)}\n{r.footer}"}
