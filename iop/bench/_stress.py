"""Stress the platform from outside: cancellation, memory, overload, idle links.

Four measurements of issue 9's targets, each on real processes (``python -m
iop edge``, ``python -m iop node --config ...``, ``python -m iop sim``) on
loopback, each starting its own processes and stopping them all by PID at
the end, on error and on Ctrl-C or SIGTERM. Select them with ``--only``
(default: all four, in this order, about 6 minutes on 2 cores).

cancel (about 15 s)
  The backend is a mock OpenAI-compatible server inside this process (a
  small trio + h11 TCP server streaming ``chat.completion.chunk`` SSE, or
  holding its answer), so the client closing its connection and the backend
  seeing its socket end are timed on one clock (``time.perf_counter``,
  CLOCK_MONOTONIC, the clock of the edge's ``time.monotonic()`` too). The
  node has two ``openai_compat`` instances on it: ``bench`` with free slots,
  and ``bench-q`` with ``max_concurrency = 1``, whose slot a held request
  keeps busy. For each window, ``--trials`` times: a client (h11 on a trio
  socket of its own) sends a request, waits until the window is reached,
  waits ``--settle-ms``, and closes its socket; the time from that
  ``close()`` until the backend's read of that request's socket returns EOF
  (or a reset) is the sample. Windows:

    queued              the request waits in the edge's queue for bench-q's
                        one slot. No backend socket exists: the sample ends
                        at the edge's own time of the run's leaving the queue
                        (/admin/nodes ``queue.last_exit``, read --poll-ms
                        after the close), and the backend must never see the
                        request (counted as "leaked" otherwise);
    before-headers      the backend has read the request and sent nothing;
    before-first-token  the backend sent its 200 and SSE headers, no chunk;
    mid-stream          the backend sent --mid-chunks chunks and the client
                        read them all;
    non-streaming       a "stream": false request; the backend holds its
                        JSON answer.

  --perf-trace records the trials with ``perf record`` (the scheduler, and
  the cancel path's syscalls) on the same clock: ``scripts/trace_cancel.py``
  (removed; ``git show 37c0eb9^:scripts/trace_cancel.py``) then shows where
  one trial's time went, and how much of each sample was a wait for a CPU.

memory (about 50 s)
  The same mock backend sends its headers and one chunk, then stays silent.
  The script opens --streams streams (1,000; the file limit is raised to the
  hard limit), waits until every client has its first chunk, and samples
  VmRSS of edge and node (/proc/PID/status) before, with all open, and
  --settle-s after closing them all (clients close their sockets). Deadlines
  and the node's slots are configured out of the way (every timeout 3600 s,
  max_concurrency above --streams). --rounds times in one set of processes:
  the first round is the cost of a fresh process, the next ones show
  whether the memory is reused.

overload (about 4 min)
  ``iop sim`` as the backend (vLLM's wire format, 64 chunks, no TTFT, as fast
  as it can: --paced-rate for a paced one), one node with one ``vllm``
  instance (--max-concurrency slots), the edge with its default config
  (--edge-set to change it). A closed loop (--sat-concurrency workers for
  --sat-s, then --resat-s before every further level, as the box's other
  load moves) measures the saturated rate; an open loop then offers
  --levels percent of it (Poisson arrivals, or fixed with --arrivals fixed)
  for --duration-s each, a fresh request per arrival whatever is still
  outstanding. A last closed loop ends the run. The load generator speaks HTTP/1.1 with h11 over trio
  sockets with its own keep-alive free list: O(1) per event at any
  concurrency (httpcore's pool costs grow with the connections it holds,
  and would make the load generator the bottleneck). Each level reports the
  offered rate, goodput (answers with all 64 chunks and [DONE], completed
  inside the level's window, per second; ok/s counts the answers to the
  window's arrivals that succeeded at all), errors by kind (HTTP status and
  code, client timeouts after --client-timeout-s, broken streams), TTFT
  p50/p99 from the scheduled arrival, how fast refusals came, the edge's
  run outcomes (from /admin/nodes) and CPU per answer of each process.
  --levels repeats a level by listing it again (default: 90 % three times).

idle-nodes (about 45 s)
  One edge and --nodes idle nodes. --real-nodes of them are ``iop node``
  processes (each with an in-process sim instance); the rest are
  ``NodeAgent``s (``iop.node.open_node_agent``, the code ``iop node`` runs)
  in one helper process, each with its own node id, a sim instance and its
  own WebSocket link: the edge sees 100 real links either way, and one
  process keeps 100 Python interpreters (about 5 GiB and minutes of CPU to
  start on 2 cores) out of the measurement. Once /admin/nodes lists them
  all, edge CPU (utime+stime from /proc/PID/stat) is measured over
  --idle-s, with the nodes' CPU per node from both kinds of process.
  Then node-loss detection: SIGSTOP one real node (a frozen host) and time
  until /admin/nodes no longer lists it, --loss-trials times, and once
  with SIGKILL (the TCP connection closes at once).

Outputs: bench-results/stress-<timestamp>.json (every number, machine,
package versions, load averages; the directory is gitignored) and a summary
table per measurement on stdout. Absolute latencies on a shared 2-core box
are noisy: the load average and the machine's busy CPU not explained by the
benchmark's processes ("foreign") are recorded with each measurement.

Examples:
  python scripts/bench_stress.py                        # all four, defaults
  python scripts/bench_stress.py --only cancel --trials 50
  python scripts/bench_stress.py --only cancel --trials 50 --perf-trace
  python scripts/bench_stress.py --only memory --streams 2000 --rounds 3
  python scripts/bench_stress.py --only overload --levels 80,90,100,120,150
  python scripts/bench_stress.py --only overload --edge-set scheduler.max_queue=32
  python scripts/bench_stress.py --only idle-nodes --nodes 200 --real-nodes 4

docs/benchmarks.md ("Cancellation, memory, overload, idle links") explains the
method and quotes the results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import re
import resource
import signal
import sys
import tempfile
import time
import tomllib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import h11
import httpx
import msgspec
import trio

from iop.bench._platform import (
    REPO,
    _int_list,
    _term_as_int,
    find_py_spy,
    machine_cpu_s,
    machine_info,
    pct,
    proc_cpu_s,
    summarize_raw,
)
from iop.testing import Proc, toml_dumps

NODE_TOKEN: Final = "bench-token"
CHUNKS: Final = 64  # content chunks per overload answer (sim --output-tokens)
MODEL_SIM: Final = "iop-sim"
MODEL_FREE: Final = "bench"  # mock backend, free slots
MODEL_QUEUED: Final = "bench-q"  # mock backend, one slot
STEPS: Final = ("cancel", "memory", "overload", "idle-nodes")
WINDOWS: Final = ("queued", "before-headers", "before-first-token", "mid-stream", "non-streaming")
# A backend read of a request head or body (the node sends a few KiB).
MAX_REQUEST_BYTES: Final = 1024 * 1024

log = logging.getLogger("bench")


# --------------------------------------------------------------------------- processes


def rss_kb(pid: int) -> int:
    """VmRSS of a process, in KiB (proc(5))."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Child(Proc):
    """The shared runner's ``Proc`` (which also thaws a process this script
    froze before it stops it), with what this script reads of it."""

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first match of ``pattern`` in the process's stdout."""
        return self.wait_stdout(pattern, timeout)

    def tail(self, n: int = 15) -> str:
        return self.logs(tail=n)

    @property
    def err_path(self) -> Path:
        return self.stderr_path


class Stack:
    """The processes of one measurement; stopped by PID, last started first."""

    def __init__(self, python: str, logdir: Path) -> None:
        self.python = python
        self.logdir = logdir
        self.procs: list[Child] = []

    def launch(self, name: str, *args: str, argv: list[str] | None = None) -> Child:
        p = Child(name, list(args), self.logdir, argv=argv, python=self.python)
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        # Nodes were started after the edge, backends before it.
        for p in reversed(self.procs):
            try:
                p.stop()
            except Exception as exc:
                print(f"bench: stopping {p.name}: {exc!r}", file=sys.stderr)

    def tails(self) -> str:
        return "\n".join(f"--- {p.name} (tail)\n{p.tail()}" for p in self.procs)


@contextlib.contextmanager
def process_stack(python: str, logdir: Path) -> Iterator[Stack]:
    stack = Stack(python, logdir)
    try:
        yield stack
    except Exception:
        print(stack.tails(), file=sys.stderr)
        raise
    finally:
        stack.stop_all()


def apply_sets(config: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """``KEY.PATH=VALUE`` overrides (VALUE in TOML syntax) into a config tree."""
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"bench: --*-set wants KEY=VALUE, got {item!r}")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw  # a bare string
        *path, last = key.split(".")
        node = config
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return config


@dataclass
class Cluster:
    edge: Child
    nodes: list[Child]
    url: str  # http://host:port
    link: str  # ws://host:port/v1/link

    def pids(self) -> dict[str, int]:
        return {"edge": self.edge.pid} | {n.name: n.pid for n in self.nodes}


def start_edge(stack: Stack, config: dict[str, Any], name: str = "edge") -> tuple[Child, str, str]:
    path = stack.logdir / f"{name}.toml"
    path.write_text(toml_dumps(config))
    edge = stack.launch(
        name, "edge", "--port", "0", "--node-token", NODE_TOKEN, "--config", str(path)
    )
    m = edge.wait_for(r"OpenAI API on (http://\S+)/v1 .*nodes dial (ws://\S+)", 30)
    return edge, m[1], m[2]


def start_node(
    stack: Stack, name: str, link: str, node: dict[str, Any], instances: list[Any]
) -> Child:
    config = {
        "node": {"id": name, **node, "edges": [{"url": link, "token": NODE_TOKEN}]},
        "instances": instances,
    }
    path = stack.logdir / f"{name}.toml"
    path.write_text(toml_dumps(config))
    return stack.launch(name, "node", "--config", str(path))


def start_sim(stack: Stack, name: str, *flags: str) -> str:
    sim = stack.launch(name, "sim", "--port", "0", *flags)
    return sim.wait_for(r"on (http://\S+)/v1", 30)[1]


def admin(url: str) -> dict[str, Any]:
    with httpx.Client(timeout=5, trust_env=False) as c:
        r = c.get(url + "/admin/nodes")
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data


def wait_models(url: str, models: set[str], procs: list[Child], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    with httpx.Client(timeout=2, trust_env=False) as c:
        while time.monotonic() < deadline:
            for p in procs:
                if not p.alive:
                    raise RuntimeError(f"{p.name} exited during start-up:\n{p.tail()}")
            try:
                r = c.get(url + "/readyz")
                if r.status_code == 200:
                    have = {m["id"] for m in c.get(url + "/v1/models").json()["data"]}
                    if models <= have:
                        return
                    last = f"models: {sorted(have)}"
                else:
                    last = f"/readyz {r.status_code}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.1)
    raise RuntimeError(f"edge not ready with {sorted(models)} within {timeout}s ({last})")


def wait_idle(url: str, timeout: float) -> bool:
    """Wait until the edge has no run and no queued run; False on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        a = admin(url)
        if not a["runs"] and not a["queued"]:
            return True
        time.sleep(0.2)
    return False


@dataclass
class CpuWindow:
    """CPU seconds of some processes (and of this one) over a stretch of time."""

    pids: dict[str, int]
    cpu0: dict[str, float] = field(default_factory=dict)
    own0: float = 0.0
    busy0: float = 0.0
    total0: float = 0.0
    t0: float = 0.0

    def __post_init__(self) -> None:
        self.cpu0 = {k: proc_cpu_s(p) for k, p in self.pids.items()}
        self.own0 = time.process_time()
        self.busy0, self.total0 = machine_cpu_s()
        self.t0 = time.perf_counter()

    def stop(self) -> dict[str, Any]:
        wall = time.perf_counter() - self.t0
        cpu = {k: proc_cpu_s(p) - self.cpu0[k] for k, p in self.pids.items()}
        own = time.process_time() - self.own0
        busy1, total1 = machine_cpu_s()
        busy = busy1 - self.busy0
        ours = sum(cpu.values()) + own
        return {
            "wall_s": round(wall, 3),
            "cpu_s": {k: round(v, 3) for k, v in cpu.items()} | {"client": round(own, 3)},
            "cpu_pct_of_core": {k: round(100 * v / wall, 1) for k, v in cpu.items()}
            | {"client": round(100 * own / wall, 1)},
            "machine_busy_pct": round(100 * busy / (total1 - self.total0), 1)
            if total1 > self.total0
            else None,
            # Busy CPU, in % of one core, that none of the benchmark's processes used.
            "foreign_cpu_pct_of_core": round(100 * max(0.0, busy - ours) / wall, 1),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
        }


def summary(values: list[float]) -> dict[str, float | int]:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return {"n": 0}
    return {
        "n": len(vals),
        "p50": round(pct(vals, 50), 2),
        "p99": round(pct(vals, 99), 2),
        "max": round(max(vals), 2),
    }


# --------------------------------------------------------------------------- mock backend


@dataclass(eq=False)
class BackendTrial:
    """What the mock backend saw of one request (by its ``bench.trial`` id)."""

    reached: trio.Event = field(default_factory=trio.Event)  # its window is reached
    closed: trio.Event = field(default_factory=trio.Event)  # its socket ended
    arrived_at: float = math.nan
    eof_at: float = math.nan


def _chunk(model: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


class MockBackend:
    """An OpenAI-compatible chat backend in this process (h11 over trio sockets).

    ``GET /v1/models`` lists ``model``. ``POST /v1/chat/completions`` reads
    the request's ``bench`` object (passed through by edge and node as an
    unknown key): ``{"trial": id, "mode": m, "chunks": n}``. Modes:
    ``complete`` answers in full (``chunks`` chunks, or one JSON answer);
    ``head`` sends nothing; ``first`` sends the SSE headers; ``mid`` the
    headers and ``chunks`` chunks; ``idle`` the headers and one chunk;
    ``holder`` the headers and one chunk, then the rest once ``release`` is
    set. Every mode but ``complete`` then waits for the connection to end
    and records when in ``trials[id]``.
    """

    def __init__(self, model: str) -> None:
        self.model = model
        self.trials: dict[str, BackendTrial] = {}
        self.release = trio.Event()
        self.open_streams = 0
        self.requests = 0
        self.errors: Counter[str] = Counter()
        self.port = 0

    def trial(self, tid: str) -> BackendTrial:
        return self.trials.setdefault(tid, BackendTrial())

    async def start(self, nursery: trio.Nursery) -> str:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1", backlog=4096)
        self.port = listeners[0].socket.getsockname()[1]
        nursery.start_soon(trio.serve_listeners, self._handle, listeners)
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
        try:
            while True:
                req, body = await _read_request(stream, conn)
                if req is None:
                    return
                target = req.target.split(b"?")[0]
                if req.method == b"GET" and target.endswith(b"/models"):
                    models = {"object": "list", "data": [{"id": self.model, "object": "model"}]}
                    await _send_whole(stream, conn, 200, msgspec.json.encode(models))
                elif req.method == b"POST" and target.endswith(b"/chat/completions"):
                    self.requests += 1
                    if not await self._chat(stream, conn, msgspec.json.decode(body)):
                        return
                else:
                    await _send_whole(stream, conn, 404, b'{"error": {"message": "not found"}}')
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the node went away: what the held modes wait for anyway
        except (h11.ProtocolError, msgspec.DecodeError) as exc:
            self.errors[type(exc).__name__] += 1
            log.warning("mock backend: bad request: %r", exc)
        finally:
            stream.socket.close()

    async def _chat(self, stream: trio.SocketStream, conn: h11.Connection, body: Any) -> bool:
        """Answer one chat request; False when the connection must end."""
        bench = body.get("bench") or {}
        mode = bench.get("mode", "complete")
        tid = str(bench.get("trial", ""))
        chunks = int(bench.get("chunks", 8))
        streaming = bool(body.get("stream"))
        model = body.get("model", self.model)
        trial = self.trial(tid) if tid else BackendTrial()
        trial.arrived_at = time.perf_counter()
        if mode == "complete":
            await self._complete(stream, conn, model, streaming, chunks)
            return True
        if mode != "head":
            await _send(stream, conn, _sse_head())
            await _send(stream, conn, h11.Data(data=_chunk(model, {"role": "assistant"})))
            n = {"first": 0, "mid": chunks, "idle": 1, "holder": 1}.get(mode, 0)
            for _ in range(n):
                await _send(stream, conn, h11.Data(data=_chunk(model, {"content": "tok "})))
        trial.reached.set()
        self.open_streams += 1
        try:
            if mode == "holder":
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._until_eof, stream, trial, nursery.cancel_scope)
                    await self.release.wait()
                    await self._finish(stream, conn, model, chunks)
                    nursery.cancel_scope.cancel()
                return False
            await self._until_eof(stream, trial)
            return False
        finally:
            self.open_streams -= 1

    async def _until_eof(
        self, stream: trio.SocketStream, trial: BackendTrial, scope: trio.CancelScope | None = None
    ) -> None:
        try:
            while await stream.receive_some(4096):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # a reset is an end too
        trial.eof_at = time.perf_counter()
        trial.closed.set()
        if scope is not None:
            scope.cancel()

    async def _complete(
        self, stream: trio.SocketStream, conn: h11.Connection, model: str, streaming: bool, n: int
    ) -> None:
        if not streaming:
            answer = {
                "id": "chatcmpl-bench",
                "object": "chat.completion",
                "created": 0,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "tok " * n},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1},
            }
            await _send_whole(stream, conn, 200, msgspec.json.encode(answer))
            return
        await _send(stream, conn, _sse_head())
        await _send(stream, conn, h11.Data(data=_chunk(model, {"role": "assistant"})))
        await self._finish(stream, conn, model, n)

    async def _finish(
        self, stream: trio.SocketStream, conn: h11.Connection, model: str, n: int
    ) -> None:
        data = b"".join(_chunk(model, {"content": "tok "}) for _ in range(n))
        data += _chunk(model, {}, "stop") + b"data: [DONE]\n\n"
        await _send(stream, conn, h11.Data(data=data))
        await _send(stream, conn, h11.EndOfMessage())


def _sse_head() -> h11.Response:
    return h11.Response(
        status_code=200,
        headers=[("content-type", "text/event-stream"), ("transfer-encoding", "chunked")],
    )


async def _send(stream: trio.SocketStream, conn: h11.Connection, event: h11.Event) -> None:
    data = conn.send(event)
    if data:
        await stream.send_all(data)


async def _send_whole(
    stream: trio.SocketStream, conn: h11.Connection, status: int, body: bytes
) -> None:
    head = h11.Response(
        status_code=status,
        headers=[("content-type", "application/json"), ("content-length", str(len(body)))],
    )
    await _send(stream, conn, head)
    await _send(stream, conn, h11.Data(data=body))
    await _send(stream, conn, h11.EndOfMessage())


async def _next_event(stream: trio.SocketStream, conn: h11.Connection) -> Any:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
            continue
        return event


async def _read_request(
    stream: trio.SocketStream, conn: h11.Connection
) -> tuple[h11.Request | None, bytes]:
    event = await _next_event(stream, conn)
    if isinstance(event, h11.ConnectionClosed):
        return None, b""
    if not isinstance(event, h11.Request):
        raise h11.RemoteProtocolError(f"expected a request, got {event!r}")
    req = event
    body = b""
    while True:
        event = await _next_event(stream, conn)
        if isinstance(event, h11.Data):
            body += event.data
            if len(body) > MAX_REQUEST_BYTES:
                raise h11.RemoteProtocolError("request body too large")
        elif isinstance(event, h11.EndOfMessage):
            return req, body
        else:
            raise h11.RemoteProtocolError(f"unexpected {event!r}")


# --------------------------------------------------------------------------- load generator


class _ClientConn:
    __slots__ = ("h", "stream")

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_REQUEST_BYTES)


class RawClient:
    """HTTP/1.1 client: h11 over trio sockets, with a free list of keep-alive connections.

    O(1) per request and per event whatever the number of connections, so
    the load generator stays cheap at any concurrency. A request on a
    keep-alive connection the server closed meanwhile is retried once on a
    new connection; a cancelled request closes its connection (what a
    client that gives up does).
    """

    def __init__(self, url: str, max_idle: int = 1024) -> None:
        u = httpx.URL(url)
        self.host = u.host
        self.port = u.port or 80
        self.max_idle = max_idle
        self._idle: list[_ClientConn] = []
        self.connects = 0

    def close_idle(self) -> None:
        for c in self._idle:
            c.stream.socket.close()
        self._idle.clear()

    async def post(
        self,
        path: str,
        body: bytes,
        on_head: Callable[[int, list[tuple[bytes, bytes]]], None],
        on_data: Callable[[bytes], None],
    ) -> None:
        """POST ``body``; ``on_head(status, headers)``, then ``on_data`` per body piece.

        Raises:
            h11.ProtocolError, trio.BrokenResourceError, OSError: the
                response broke off.
        """
        for attempt in range(2):
            reused = bool(self._idle)
            if reused:
                conn = self._idle.pop()
            else:
                self.connects += 1
                conn = _ClientConn(await trio.open_tcp_stream(self.host, self.port))
            keep = False
            try:
                head = h11.Request(
                    method="POST",
                    target=path,
                    headers=[
                        ("host", f"{self.host}:{self.port}"),
                        ("content-type", "application/json"),
                        ("content-length", str(len(body))),
                    ],
                )
                h = conn.h
                try:
                    await conn.stream.send_all(
                        h.send(head) + h.send(h11.Data(data=body)) + h.send(h11.EndOfMessage())
                    )
                    event = await _next_event(conn.stream, h)
                except (h11.ProtocolError, trio.BrokenResourceError, OSError):
                    if reused and attempt == 0:
                        continue  # a stale keep-alive connection: once more, on a new one
                    raise
                if isinstance(event, h11.ConnectionClosed):
                    if reused and attempt == 0:
                        continue
                    raise h11.RemoteProtocolError("connection closed before the response")
                assert isinstance(event, h11.Response), event
                on_head(event.status_code, list(event.headers))
                while True:
                    event = await _next_event(conn.stream, h)
                    if isinstance(event, h11.Data):
                        on_data(bytes(event.data))
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    else:
                        raise h11.RemoteProtocolError(f"response broke off: {event!r}")
                if h.our_state is h11.DONE and h.their_state is h11.DONE:
                    h.start_next_cycle()
                    keep = len(self._idle) < self.max_idle
                return
            finally:
                if keep:
                    self._idle.append(conn)
                else:
                    conn.stream.socket.close()


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta = msgspec.field(default_factory=_Delta)


class _ErrorBody(msgspec.Struct):
    code: str | None = None
    message: str = ""


class _StreamEvent(msgspec.Struct):
    choices: list[_Choice] = []
    error: _ErrorBody | None = None


class _ErrorDoc(msgspec.Struct):
    error: _ErrorBody | None = None


_decode_event = msgspec.json.Decoder(_StreamEvent).decode
_decode_error = msgspec.json.Decoder(_ErrorDoc).decode


@dataclass(slots=True)
class Answer:
    """One request of the load generator (times on trio's clock, seconds)."""

    arrival: float  # scheduled (open loop) or issued (closed loop)
    start: float = math.nan
    status: int = 0
    head_at: float = math.nan
    first_at: float = math.nan
    end_at: float = math.nan
    chunks: int = 0
    done: bool = False
    retry_after: str | None = None
    error: str = ""
    buf: bytes = b""

    @property
    def ok(self) -> bool:
        return not self.error and self.status == 200 and self.done and self.chunks == CHUNKS


def _error_code(body: bytes) -> str:
    with contextlib.suppress(msgspec.DecodeError):
        doc = _decode_error(body)
        if doc.error is not None:
            return doc.error.code or "?"
    return "?"


async def stream_answer(client: RawClient, body: bytes, a: Answer) -> None:
    """One streamed chat completion into ``a`` (its error kind, if any, in ``a.error``)."""

    def on_head(status: int, headers: list[tuple[bytes, bytes]]) -> None:
        a.status = status
        a.head_at = trio.current_time()
        for k, v in headers:
            if k == b"retry-after":
                a.retry_after = v.decode()

    def on_data(data: bytes) -> None:
        if a.status != 200:
            a.buf = (a.buf + data)[:4096]
            return
        a.buf += data
        *events, a.buf = a.buf.split(b"\n\n")
        for ev in events:
            if not ev.startswith(b"data: "):
                continue  # an SSE comment (keep-alive)
            payload = ev[6:]
            if payload == b"[DONE]":
                a.done = True
                continue
            try:
                chunk = _decode_event(payload)
            except msgspec.DecodeError:
                a.error = a.error or "stream: undecodable chunk"
                continue
            if chunk.error is not None:
                a.error = a.error or f"stream error {chunk.error.code or '?'}"
            elif chunk.choices and chunk.choices[0].delta.content:
                if a.chunks == 0:
                    a.first_at = trio.current_time()
                a.chunks += 1

    a.start = trio.current_time()
    try:
        await client.post("/v1/chat/completions", body, on_head, on_data)
    except (h11.ProtocolError, trio.BrokenResourceError, OSError) as exc:
        a.error = a.error or f"broken: {type(exc).__name__}"
    a.end_at = trio.current_time()
    if a.error:
        return
    if a.status != 200:
        a.error = f"HTTP {a.status} {_error_code(a.buf)}"
    elif not a.done or a.chunks != CHUNKS:
        a.error = f"incomplete: {a.chunks} chunks, [DONE] {'seen' if a.done else 'missing'}"
    a.buf = b""


def chat_body(model: str, stream: bool = True, **extra: Any) -> bytes:
    req: dict[str, Any] = {
        "model": model,
        "stream": stream,
        "messages": [{"role": "user", "content": "Tell me about the benchmark."}],
        **extra,
    }
    return msgspec.json.encode(req)


@dataclass
class LoadStats:
    peak_outstanding: int = 0
    late_max_s: float = 0.0
    overflow: int = 0


async def _timed(
    client: RawClient, body: bytes, a: Answer, timeout_s: float, st: LoadStats, n: list[int]
) -> None:
    n[0] += 1
    st.peak_outstanding = max(st.peak_outstanding, n[0])
    try:
        with trio.move_on_at(a.arrival + timeout_s) as scope:
            await stream_answer(client, body, a)
        if scope.cancelled_caught:
            a.error = "client_timeout"
            a.end_at = trio.current_time()
    finally:
        n[0] -= 1


async def open_loop(
    client: RawClient,
    body: bytes,
    rate: float,
    duration_s: float,
    timeout_s: float,
    rng: random.Random,
    poisson: bool,
    max_outstanding: int,
) -> tuple[list[Answer], LoadStats, float]:
    """Arrivals at ``rate``/s for ``duration_s``, each a new request whatever is outstanding."""
    answers: list[Answer] = []
    st = LoadStats()
    n = [0]
    async with trio.open_nursery() as nursery:
        start = trio.current_time() + 0.05
        t = start
        while True:
            t += rng.expovariate(rate) if poisson else 1.0 / rate
            if t >= start + duration_s:
                break
            await trio.sleep_until(t)
            st.late_max_s = max(st.late_max_s, trio.current_time() - t)
            a = Answer(arrival=t)
            answers.append(a)
            if n[0] >= max_outstanding:
                a.error = "client_overflow"
                st.overflow += 1
                continue
            nursery.start_soon(_timed, client, body, a, timeout_s, st, n)
    return answers, st, start


async def closed_loop(
    client: RawClient, body: bytes, concurrency: int, duration_s: float, timeout_s: float
) -> tuple[list[Answer], float, float]:
    """``concurrency`` workers, each issuing its next request when the last one ended."""
    answers: list[Answer] = []
    st = LoadStats()
    n = [0]
    start = trio.current_time()
    end = start + duration_s

    async def worker() -> None:
        while trio.current_time() < end:
            a = Answer(arrival=trio.current_time())
            answers.append(a)
            await _timed(client, body, a, timeout_s, st, n)

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return answers, start, trio.current_time()


async def sample_admin(url: str, period_s: float, into: list[dict[str, Any]]) -> None:
    """Every ``period_s``: the edge's runs in flight and queue (until cancelled)."""
    async with httpx.AsyncClient(timeout=5, trust_env=False) as c:
        while True:
            t = trio.current_time()
            try:
                a = (await c.get(url + "/admin/nodes")).json()
                in_flight = sum(i["in_flight"] for n in a["nodes"] for i in n["instances"])
                into.append(
                    {"t": t, "runs": len(a["runs"]), "queued": a["queued"], "placed": in_flight}
                )
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                into.append({"t": t, "error": repr(exc)})
            await trio.sleep(period_s)


# --------------------------------------------------------------------------- overload


async def _admin_async(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    r = await client.get(url + "/admin/nodes")
    r.raise_for_status()
    data: dict[str, Any] = r.json()
    return data


async def _wait_idle_async(client: httpx.AsyncClient, url: str, timeout_s: float) -> bool:
    with trio.move_on_after(timeout_s):
        while True:
            a = await _admin_async(client, url)
            if not a["runs"] and not a["queued"]:
                return True
            await trio.sleep(0.2)
    return False


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in sorted(after.items()) if v != before.get(k, 0)}


def level_report(
    answers: list[Answer], start: float, duration_s: float, cpu: dict[str, Any]
) -> dict[str, Any]:
    """The numbers of one load level (times in ms)."""
    ok = [a for a in answers if a.ok]
    in_window = [a for a in ok if a.end_at <= start + duration_s]
    refused = [a for a in answers if a.status == 429]
    errors = Counter(a.error for a in answers if not a.ok)
    ms = cpu["cpu_s"]
    per_ok = {k: round(1000 * v / len(ok), 3) for k, v in ms.items()} if ok else {}
    return {
        "issued": len(answers),
        "offered_rps": round(len(answers) / duration_s, 1),
        "goodput_rps": round(len(in_window) / duration_s, 1),
        # Answers to this window's arrivals that succeeded, finished in it or later.
        "ok_rps": round(len(ok) / duration_s, 1),
        "ok": len(ok),
        "ok_after_window": len(ok) - len(in_window),
        "errors": dict(errors.most_common()),
        "refused_429": len(refused),
        "refused_with_retry_after": sum(1 for a in refused if a.retry_after),
        "refusal_ms": summary([1000 * (a.head_at - a.arrival) for a in refused]),
        "ttft_ms": summary([1000 * (a.first_at - a.arrival) for a in ok]),
        "total_ms": summary([1000 * (a.end_at - a.arrival) for a in ok]),
        "failed_late_ms": summary(
            [1000 * (a.end_at - a.arrival) for a in answers if a.error and a.status != 429]
        ),
        "cpu_ms_per_ok": per_ok,
        "edge_node_cpu_ms_per_ok": round(per_ok.get("edge", 0) + per_ok.get("node", 0), 3)
        if ok
        else None,
        **cpu,
    }


def _py_spy(
    py_spy: str, pid: int, out: Path, seconds: float
) -> Any:  # pragma: no cover - py-spy attaches by ptrace: not in the suite
    import subprocess

    argv = [py_spy, "record", "--nonblocking", "--rate", "100", "--format", "raw"]
    argv += ["-d", str(max(1, int(seconds))), "-p", str(pid), "-o", str(out)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _spies(  # pragma: no cover - py-spy attaches by ptrace: not in the suite
    args: argparse.Namespace, pids: dict[str, int], label: str, seconds: float
) -> dict[str, tuple[Path, Any]]:
    """py-spy on edge and node for ``seconds`` (empty without py-spy)."""
    py_spy = find_py_spy(args.python)
    if py_spy is None:
        print("bench: --profile needs py-spy (pip install py-spy)", file=sys.stderr)
        return {}
    out = {}
    for name in ("edge", "node"):
        raw = args.out_dir / f"stress-{args.stamp}-{label}-{name}.txt"
        out[name] = (raw, _py_spy(py_spy, pids[name], raw, seconds))
    return out


def _idle_spies(  # pragma: no cover - py-spy attaches by ptrace: not in the suite
    args: argparse.Namespace, pids: dict[str, int], seconds: float
) -> dict[str, tuple[Path, Any]]:
    """py-spy at 1000 Hz on ``pids`` for ``seconds`` (an idle edge spends a few
    ms per second: 100 Hz would sample it a handful of times)."""
    import subprocess

    py_spy = find_py_spy(args.python)
    if py_spy is None:
        print("bench: --idle-profile needs py-spy (pip install py-spy)", file=sys.stderr)
        return {}
    out = {}
    for name, pid in pids.items():
        raw = args.out_dir / f"stress-{args.stamp}-idle-{name}.txt"
        argv = [py_spy, "record", "--nonblocking", "--rate", "1000", "--format", "raw"]
        argv += ["-d", str(max(1, int(seconds))), "-p", str(pid), "-o", str(raw)]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        out[name] = (raw, proc)
    return out


def _spy_report(
    spies: dict[str, tuple[Path, Any]],
) -> dict[str, Any]:  # pragma: no cover - py-spy attaches by ptrace: not in the suite
    rep: dict[str, Any] = {}
    for name, (raw, proc) in spies.items():
        try:
            proc.communicate(timeout=30)
            rep[name] = summarize_raw(raw) | {"raw_file": str(raw)}
        except Exception as exc:
            rep[name] = {"error": repr(exc)}
    return rep


async def _closed_level(
    args: argparse.Namespace,
    ac: httpx.AsyncClient,
    client: RawClient,
    body: bytes,
    url: str,
    pids: dict[str, int],
    seconds: float,
    profile: bool,
) -> dict[str, Any]:
    await _wait_idle_async(ac, url, 60)
    client.close_idle()
    o0 = (await _admin_async(ac, url))["outcomes"]
    spies = _spies(args, pids, "closed", seconds) if profile else {}
    win = CpuWindow(pids)
    answers, t0, t1 = await closed_loop(
        client, body, args.sat_concurrency, seconds, args.client_timeout_s
    )
    cpu = win.stop()
    sat = level_report(answers, t0, t1 - t0, cpu)
    sat["concurrency"] = args.sat_concurrency
    sat["edge_outcomes"] = _delta((await _admin_async(ac, url))["outcomes"], o0)
    if spies:
        sat["profile"] = _spy_report(spies)
    return sat


async def _overload(args: argparse.Namespace, url: str, pids: dict[str, int]) -> dict[str, Any]:
    body = chat_body(MODEL_SIM)
    rng = random.Random(args.seed)
    client = RawClient(url)
    out: dict[str, Any] = {"levels": []}
    async with httpx.AsyncClient(timeout=10, trust_env=False) as ac:
        print(f"bench: overload: warm-up, closed loop c={args.sat_concurrency}", flush=True)
        await closed_loop(client, body, args.sat_concurrency, 3.0, args.client_timeout_s)
        sat = await _closed_level(args, ac, client, body, url, pids, args.sat_s, args.profile == 0)
        rate = sat["goodput_rps"]
        out["saturation"] = sat
        print(
            f"bench: overload: saturated at {rate:.1f} req/s closed loop "
            f"({sat['edge_node_cpu_ms_per_ok']} ms edge+node CPU per answer)",
            flush=True,
        )
        if not rate:
            raise RuntimeError(f"no answer in the closed loop: {sat['errors']}")
        profiled = False
        for i, level in enumerate(args.levels):
            if args.resat_s and i:
                # What the box gives now: its other load moves by tens of percent.
                again = await _closed_level(args, ac, client, body, url, pids, args.resat_s, False)
                rate = again["goodput_rps"] or rate
            await _wait_idle_async(ac, url, 60)
            client.close_idle()
            await trio.sleep(args.pause_s)
            offered = rate * level / 100
            print(
                f"bench: overload: [{i + 1}/{len(args.levels)}] {level} % = {offered:.1f} req/s "
                f"for {args.duration_s:g} s",
                flush=True,
            )
            spies: dict[str, tuple[Path, Any]] = {}
            if args.profile == level and not profiled:
                profiled = True
                spies = _spies(args, pids, f"overload{level}", args.duration_s)
            o0 = (await _admin_async(ac, url))["outcomes"]
            samples: list[dict[str, Any]] = []
            win = CpuWindow(pids)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sample_admin, url, 1.0, samples)
                answers, st, start = await open_loop(
                    client,
                    body,
                    offered,
                    args.duration_s,
                    args.client_timeout_s,
                    rng,
                    args.arrivals == "poisson",
                    args.max_outstanding,
                )
                nursery.cancel_scope.cancel()
            cpu = win.stop()
            rep = level_report(answers, start, args.duration_s, cpu)
            rep |= {
                "level_pct": level,
                "saturated_rps": rate,
                "goodput_pct_of_saturated": round(100 * rep["goodput_rps"] / rate, 1),
                "target_rps": round(offered, 1),
                "edge_outcomes": _delta((await _admin_async(ac, url))["outcomes"], o0),
                "client_peak_outstanding": st.peak_outstanding,
                "client_late_max_ms": round(1000 * st.late_max_s, 1),
                "client_connects": client.connects,
                "edge_peak_runs": max((s.get("runs", 0) for s in samples), default=0),
                "edge_peak_queued": max((s.get("queued", 0) for s in samples), default=0),
                "edge_peak_placed": max((s.get("placed", 0) for s in samples), default=0),
                "edge_samples": [
                    {k: (round(v - start, 1) if k == "t" else v) for k, v in s.items()}
                    for s in samples
                ],
            }
            if spies:
                rep["profile"] = _spy_report(spies)
            out["levels"].append(rep)
            print(
                f"bench: overload: {level} %: goodput {rep['goodput_rps']} req/s, "
                f"errors {rep['errors']}, ttft p50 {rep['ttft_ms'].get('p50')} ms",
                flush=True,
            )
        # The box's other load moves: the saturated rate again, at the end.
        end = await _closed_level(args, ac, client, body, url, pids, args.sat_s, False)
        out["saturation_end"] = end
        print(f"bench: overload: closed loop again: {end['goodput_rps']} req/s", flush=True)
    return out


def _log_counts(p: Proc) -> dict[str, int]:
    """WARNING and ERROR lines of a process's stderr, by logger and the message's head."""
    counts: Counter[str] = Counter()
    with contextlib.suppress(OSError):
        for line in p.stderr_path.read_text(errors="replace").splitlines():
            parts = line.split(" ", 3)
            if len(parts) == 4 and parts[1] in ("WARNING", "ERROR"):
                words = parts[3].split()
                head = " ".join(w for w in words[:6] if not any(ch.isdigit() for ch in w))
                counts[f"{parts[1]} {parts[2]} {head}"] += 1
    return dict(counts.most_common(20))


def run_overload(args: argparse.Namespace, stack: Stack) -> dict[str, Any]:
    flags = ["--ttft", "0", "--output-tokens", str(CHUNKS), "--model", MODEL_SIM]
    flags += ["--tokens-per-s", f"{args.paced_rate:g}"]
    sim_url = start_sim(stack, "sim", *flags)
    sim = stack.procs[-1]
    edge_cfg = apply_sets({}, args.edge_set)
    edge, url, link = start_edge(stack, edge_cfg)
    inst = {
        "adapter": "vllm",
        "name": "sim",
        "endpoint": sim_url,
        "max_concurrency": args.max_concurrency,
        "max_queue": args.node_max_queue,
    }
    inst = apply_sets(inst, args.instance_set)
    node = start_node(stack, "node", link, {"probe_interval_s": 30.0}, [inst])
    wait_models(url, {MODEL_SIM}, stack.procs)
    pids = {"edge": edge.pid, "node": node.pid, "sim": sim.pid}
    result = trio.run(_overload, args, url, pids)
    result["config"] = {"edge": edge_cfg, "instance": inst}
    result["pids"] = pids
    result["log_warnings"] = {"edge": _log_counts(edge), "node": _log_counts(node)}
    return result


def print_overload(res: dict[str, Any]) -> None:
    cfg = res["config"]["instance"]
    for key in ("saturation", "saturation_end"):
        sat = res[key]
        print(
            f"\noverload: closed loop c={sat['concurrency']} ({'start' if key == 'saturation' else 'end'}): "
            f"{sat['goodput_rps']} req/s, edge+node {sat['edge_node_cpu_ms_per_ok']} ms CPU "
            f"per answer, ttft p50 {sat['ttft_ms'].get('p50')} ms, foreign "
            f"{sat['foreign_cpu_pct_of_core']} %"
        )
    print(
        f"open loop, node slots {cfg['max_concurrency']}, edge "
        f"{res['config']['edge'] or 'defaults'}; goodput = answers done inside the level, "
        "ok/s = answers to its arrivals done at all"
    )
    print(
        f"{'level':>6}{'sat':>7}{'offered':>9}{'goodput':>9}{'ok/s':>7}{'429':>6}"
        f"{'other err':>10}"
        f"{'ttft p50/p99 ms':>18}{'429 p50 ms':>11}{'e+n ms/ok':>10}{'peak runs':>10}"
        f"{'load1':>7}{'foreign%':>9}"
    )
    for lv in res["levels"]:
        other = sum(v for k, v in lv["errors"].items() if not k.startswith("HTTP 429"))
        t = lv["ttft_ms"]
        print(
            f"{lv['level_pct']:>5}%{lv['saturated_rps']:>7.1f}"
            f"{lv['offered_rps']:>9.1f}{lv['goodput_rps']:>9.1f}"
            f"{lv['ok_rps']:>7.1f}{lv['refused_429']:>6}{other:>10}"
            f"{t.get('p50', math.nan):>9.0f}/{t.get('p99', math.nan):<8.0f}"
            f"{lv['refusal_ms'].get('p50', math.nan):>11.1f}"
            f"{lv['edge_node_cpu_ms_per_ok'] or math.nan:>10.2f}{lv['edge_peak_runs']:>10}"
            f"{lv['loadavg'][0]:>7.2f}{lv['foreign_cpu_pct_of_core']:>9.0f}"
        )
        if lv["errors"]:
            print(f"        errors: {lv['errors']}; edge outcomes: {lv['edge_outcomes']}")


# --------------------------------------------------------------------------- cancel


def _mock_instance(name: str, url: str, slots: int, **extra: Any) -> dict[str, Any]:
    return {
        "adapter": "openai_compat",
        "name": name,
        "endpoint": url,
        "max_concurrency": slots,
        **extra,
    }


async def _start_mock_cluster(
    stack: Stack,
    edge_cfg: dict[str, Any],
    instances: list[dict[str, Any]],
    models: set[str],
) -> Cluster:
    """Edge and node started from a trio task (the mock backends must keep serving)."""
    edge, url, link = await trio.to_thread.run_sync(start_edge, stack, edge_cfg)
    node = await trio.to_thread.run_sync(
        start_node, stack, "node", link, {"probe_interval_s": 30.0}, instances
    )
    await trio.to_thread.run_sync(wait_models, url, models, stack.procs)
    return Cluster(edge, [node], url, link)


async def _poll_until(
    client: httpx.AsyncClient, url: str, cond: Callable[[dict[str, Any]], bool], period_s: float
) -> tuple[float, dict[str, Any]]:
    """perf_counter() at the send of the first /admin/nodes poll whose answer
    meets ``cond``, and that answer."""
    while True:
        sent = time.perf_counter()
        admin = await _admin_async(client, url)
        if cond(admin):
            return sent, admin
        await trio.sleep(period_s)


def _queue_cancels(admin: dict[str, Any]) -> int | None:
    """Runs that left the edge's queue cancelled (None: an edge that does not say)."""
    queue = admin.get("queue")
    return None if queue is None else int(queue["exits"]["cancelled"])


async def _cancel_trial(
    args: argparse.Namespace,
    poller: httpx.AsyncClient,
    url: str,
    backends: dict[str, MockBackend],
    window: str,
    tid: str,
    eof_timeout_s: float = 10.0,
) -> dict[str, Any]:
    """One close in ``window``: milliseconds from the client's close to the backend's EOF.

    The client is h11 on a trio socket of its own, so that the close is one
    ``close()`` of that socket (the FIN leaves then) at a known time. An
    httpx client closes its socket somewhere in the unwinding of its
    response, 0.5 ms after the cancel at the median and up to 2.5 ms on this
    box (measured: docs/benchmarks.md, "Cancellation"), time the old samples
    counted as the platform's.
    """
    queued = window == "queued"
    backend = backends[MODEL_QUEUED if queued else MODEL_FREE]
    mode = {"before-headers": "head", "before-first-token": "first", "mid-stream": "mid"}
    body = chat_body(
        MODEL_QUEUED if queued else MODEL_FREE,
        stream=window != "non-streaming",
        bench={"trial": tid, "mode": mode.get(window, "head"), "chunks": args.mid_chunks},
    )
    got = trio.Event()
    res: dict[str, Any] = {"window": window, "trial": tid}
    u = httpx.URL(url)
    stream = await trio.open_tcp_stream(u.host, u.port or 80)
    h = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_REQUEST_BYTES)
    head = h11.Request(
        method="POST",
        target="/v1/chat/completions",
        headers=[
            ("host", f"{u.host}:{u.port}"),
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
        ],
    )
    await stream.send_all(h.send(head) + h.send(h11.Data(data=body)) + h.send(h11.EndOfMessage()))

    async def read() -> None:
        try:
            event = await _next_event(stream, h)
            if not isinstance(event, h11.Response) or event.status_code != 200:
                res["error"] = f"HTTP {getattr(event, 'status_code', event)}"
                got.set()
                return
            a = Answer(arrival=0.0, status=200)
            while isinstance(event := await _next_event(stream, h), h11.Data):
                # The load generator's SSE reading, to count content chunks.
                a.buf += event.data
                *events, a.buf = a.buf.split(b"\n\n")
                for ev in events:
                    if ev.startswith(b"data: {"):
                        chunk = _decode_event(ev[6:])
                        if chunk.choices and chunk.choices[0].delta.content:
                            a.chunks += 1
                if a.chunks >= args.mid_chunks:
                    got.set()
            res["error"] = "the response ended in the window"
            got.set()
        except trio.ClosedResourceError:
            pass  # our own close (below)

    cancels: int | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        with trio.move_on_after(10) as waiting:
            if queued:
                _, admin = await _poll_until(poller, url, lambda a: a["queued"] >= 1, 0.005)
                cancels = _queue_cancels(admin)
            else:
                await backend.trial(tid).reached.wait()
            if window == "mid-stream":
                await got.wait()
        if waiting.cancelled_caught:
            res["error"] = "window not reached within 10 s"
        elif "error" not in res:
            await trio.sleep(args.settle_ms / 1000)
        closed_at = time.perf_counter()
        stream.socket.close()
        nursery.cancel_scope.cancel()
    res["t_close"] = closed_at
    if "error" in res:
        return res
    if queued:
        with trio.move_on_after(10):
            if cancels is None:
                # An edge that does not say when its queue's runs leave: the
                # first poll that shows the queue empty (resolution: a poll
                # and its period; answering polls slows the edge down).
                gone, _ = await _poll_until(
                    poller, url, lambda a: a["queued"] == 0, args.poll_ms / 1000
                )
                res["ms"] = round(1000 * (gone - closed_at), 3)
                return res
            # No poll at once: answering one (about 1 ms of the edge's CPU)
            # would compete with the dequeue it is meant to see.
            await trio.sleep(args.poll_ms / 1000)
            seen, admin = await _poll_until(
                poller, url, lambda a: (_queue_cancels(a) or 0) > cancels, args.poll_ms / 1000
            )
            # The edge's own time of the dequeue, on the clock this process
            # shares with it (CLOCK_MONOTONIC: _check_clock); the poll only
            # says when it is known, not how precisely.
            last = admin["queue"]["last_exit"]
            res["t_end"] = last["monotonic_s"]
            res["ms"] = round(1000 * (last["monotonic_s"] - closed_at), 3)
            res["poll_ms"] = round(1000 * (seen - closed_at), 3)
            return res
        res["error"] = "still queued 10 s after the close"
        return res
    trial = backend.trial(tid)
    with trio.move_on_after(eof_timeout_s):
        await trial.closed.wait()
        res["t_end"] = trial.eof_at
        res["ms"] = round(1000 * (trial.eof_at - closed_at), 3)
        return res
    res["error"] = f"no EOF at the backend within {eof_timeout_s:g} s"
    return res


# What --perf-trace records: the scheduler (every process: the foreign load
# is what it shows) and the syscalls of the cancel path, of ours only.
_PERF_SCHED: Final = ("sched:sched_switch", "sched:sched_wakeup")
_PERF_SYSCALLS: Final = (
    "syscalls:sys_enter_close",  # the client's close, the node's close of the backend socket
    "syscalls:sys_exit_recvfrom",  # reads: 0 is the EOF
    "syscalls:sys_enter_write",  # the edge's writes (its socket guard writes with os.write)
    "syscalls:sys_enter_sendto",  # the node's and this process's writes
    "syscalls:sys_exit_epoll_wait",  # each pass of a trio run loop
)


@contextlib.contextmanager
def _perf_record(args: argparse.Namespace, pids: dict[str, int]) -> Iterator[Path | None]:
    """``perf record`` of the trials on CLOCK_MONOTONIC (the samples' clock),
    for ``scripts/trace_cancel.py`` (``git show 37c0eb9^:scripts/trace_cancel.py``);
    None without --perf-trace."""
    if not args.perf_trace:
        yield None
        return
    import subprocess

    data = args.out_dir / f"stress-{args.stamp}-cancel.perf.data"
    ours = " || ".join(f"common_pid == {pid}" for pid in pids.values())
    argv = ["perf", "record", "-q", "-k", "CLOCK_MONOTONIC", "-a", "-o", str(data)]
    for event in _PERF_SCHED:
        argv += ["-e", event]
    for event in _PERF_SYSCALLS:
        argv += ["-e", event, "--filter", ours]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # perf opens its events before the first trial
    if proc.poll() is not None:
        err = proc.stderr.read().decode()[-500:] if proc.stderr else ""
        raise SystemExit(f"bench: perf record failed: {err}")
    try:
        yield data
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        print(f"bench: perf trace in {data}", file=sys.stderr)


def _check_clock() -> None:
    """The samples compare this process's perf_counter() with the edge's
    time.monotonic(): on Linux both are CLOCK_MONOTONIC, one clock for every
    process on the host."""
    ours = time.get_clock_info("perf_counter").implementation
    theirs = time.get_clock_info("monotonic").implementation
    if ours != theirs:
        raise SystemExit(f"bench: perf_counter ({ours}) is not the monotonic clock ({theirs})")


# LiteLLM's proxy in front of the cancel measurement's free mock backend, set
# up as bench_platform's (docs/benchmarks.md, "What is measured": no
# database, one worker, offline cost map); the `bench` body key reaches the
# backend as the OpenAI provider's extra_body.
_LITELLM_CANCEL_YAML = """\
model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: {url}/v1
      api_key: bench-unused
litellm_settings:
  turn_off_message_logging: true
  telemetry: false
  request_timeout: 600
general_settings:
  disable_spend_logs: true
  dangerously_permit_weak_or_unset_master_key: true
{extra}"""
# LiteLLM has no queue of its own: the queued window is the edge's.
LITELLM_WINDOWS: Final = ("before-headers", "before-first-token", "mid-stream", "non-streaming")


def _start_litellm(args: argparse.Namespace, stack: Stack, backend_url: str) -> tuple[Child, str]:
    """LiteLLM's proxy (``args.litellm``) on a free port, ready, serving ``bench``."""
    from iop.bench._platform import _LITELLM_ENV, READY_TIMEOUT_S
    from iop.testing import free_port, poll

    extra = "  cancel_on_disconnect: true\n" if args.litellm_cancel_on_disconnect else ""
    cfg = stack.logdir / "litellm.yaml"
    cfg.write_text(_LITELLM_CANCEL_YAML.format(model=MODEL_FREE, url=backend_url, extra=extra))
    port = free_port()
    argv = [str(args.litellm), "--config", str(cfg), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--num_workers", "1"]
    lite = Child("litellm", [], stack.logdir, argv=argv, env=_LITELLM_ENV)
    stack.procs.append(lite)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if not lite.alive:
            raise RuntimeError(f"litellm exited during start-up:\n{lite.tail()}")
        try:
            with httpx.Client(base_url=url, timeout=2, trust_env=False) as c:
                if c.get("/health/liveliness").status_code != 200:
                    return False
                return MODEL_FREE in {m["id"] for m in c.get("/v1/models").json()["data"]}
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    poll(ready, timeout=READY_TIMEOUT_S, what="LiteLLM to be ready", interval=0.2)
    return lite, url


def _window_summary(trials: list[dict[str, Any]], window: str) -> dict[str, Any]:
    rs = [t for t in trials if t["window"] == window]
    return {
        "ms": summary([t["ms"] for t in rs if "ms" in t]),
        "errors": dict(Counter(t["error"] for t in rs if "error" in t)),
        "samples_ms": [t.get("ms") for t in rs],
    }


async def _cancel(args: argparse.Namespace, stack: Stack) -> dict[str, Any]:
    _check_clock()
    backends = {MODEL_FREE: MockBackend(MODEL_FREE), MODEL_QUEUED: MockBackend(MODEL_QUEUED)}
    # Long enough for the held request of the queued window to outlive the run.
    long = {"idle_timeout_s": 600.0, "first_token_timeout_s": 600.0}
    out: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        free_url = await backends[MODEL_FREE].start(nursery)
        q_url = await backends[MODEL_QUEUED].start(nursery)
        instances = [
            _mock_instance("free", free_url, 64, deadlines=long),
            _mock_instance("one", q_url, 1, max_queue=8, deadlines=long),
        ]
        edge_cfg = {"deadlines": long}
        cl = await _start_mock_cluster(stack, edge_cfg, instances, set(backends))
        out["pids"] = cl.pids()
        lite_url = ""
        lite_windows = [w for w in args.window_list if w in LITELLM_WINDOWS]
        if args.litellm is not None and lite_windows:
            lite, lite_url = await trio.to_thread.run_sync(_start_litellm, args, stack, free_url)
            out["pids"]["litellm"] = lite.pid
            from iop.bench._platform import litellm_version

            out["litellm_version"] = await trio.to_thread.run_sync(litellm_version, args.litellm)
        out["config"] = {"edge": edge_cfg, "instances": instances}
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=8)
        async with (
            httpx.AsyncClient(timeout=30, limits=limits, trust_env=False) as client,
            httpx.AsyncClient(timeout=10, trust_env=False) as poller,
        ):
            # Warm every path once, then hold bench-q's one slot for the queued window.
            for model in backends:
                for stream in (True, False):
                    r = await client.post(
                        cl.url + "/v1/chat/completions",
                        content=chat_body(model, stream=stream, bench={"mode": "complete"}),
                        headers={"Content-Type": "application/json"},
                    )
                    r.raise_for_status()
            holder_done = trio.Event()

            async def hold() -> None:
                body = chat_body(MODEL_QUEUED, bench={"trial": "holder", "mode": "holder"})
                r = await client.post(
                    cl.url + "/v1/chat/completions",
                    content=body,
                    headers={"Content-Type": "application/json"},
                )
                out["holder_status"] = r.status_code
                holder_done.set()

            nursery.start_soon(hold)
            with trio.fail_after(10):
                await backends[MODEL_QUEUED].trial("holder").reached.wait()
            o0 = (await _admin_async(poller, cl.url))["outcomes"]
            warm = 2
            trials: list[dict[str, Any]] = []
            lite_trials: list[dict[str, Any]] = []
            pids = {"edge": cl.edge.pid, "node": cl.nodes[0].pid, "bench": os.getpid()}
            with _perf_record(args, pids) as perf:
                win = CpuWindow({"edge": cl.edge.pid, "node": cl.nodes[0].pid})
                for i in range(warm + args.trials):
                    # Round robin: a noisy moment of the box hits every window alike.
                    for window in args.window_list:
                        tid = f"{window}-{i}"
                        t = await _cancel_trial(args, poller, cl.url, backends, window, tid)
                        if i >= warm:
                            trials.append(t)
                        if "error" in t:
                            print(f"bench: cancel {t['trial']}: {t['error']}", file=sys.stderr)
                            await _wait_idle_async(poller, cl.url, 10)
                        # LiteLLM in the same window, right after: the same
                        # moment of the box's load (fewer trials: a window it
                        # never cancels costs the whole EOF wait).
                        if lite_url and window in lite_windows and i < 1 + args.litellm_trials:
                            t = await _cancel_trial(
                                args,
                                poller,
                                lite_url,
                                backends,
                                window,
                                f"litellm-{tid}",
                                eof_timeout_s=args.litellm_eof_s,
                            )
                            if i >= 1:
                                lite_trials.append(t)
                out["cpu"] = win.stop()
            if perf is not None:
                out["perf_trace"] = {"data": str(perf), "pids": pids}
            backends[MODEL_QUEUED].release.set()
            with trio.fail_after(10):
                await holder_done.wait()
            await trio.sleep(0.5)
            leaked = [t for t in backends[MODEL_QUEUED].trials if t.startswith("queued-")]
            out["edge_outcomes"] = _delta((await _admin_async(poller, cl.url))["outcomes"], o0)
        nursery.cancel_scope.cancel()
    out["windows"] = {}
    if lite_url:
        out["litellm"] = {
            "windows": {w: _window_summary(lite_trials, w) for w in lite_windows},
            "trials": args.litellm_trials,
            "eof_wait_s": args.litellm_eof_s,
            "cancel_on_disconnect": args.litellm_cancel_on_disconnect,
        }
    for window in args.window_list:
        rs = [t for t in trials if t["window"] == window]
        out["windows"][window] = _window_summary(trials, window)
        if window == "queued":
            # The old measure, kept to compare: the first /admin/nodes poll
            # that showed the exit (resolution: the poll period plus a poll).
            polls = [t["poll_ms"] for t in rs if "poll_ms" in t]
            out["windows"][window]["poll_ms"] = summary(polls)
    out["windows"].get("queued", {})["leaked_to_backend"] = leaked
    # Per trial, the close and the end on the host's monotonic clock
    # (perf_counter): where to look in a trace of the run (--perf-trace).
    out["trials"] = trials
    out["settings"] = {
        "trials": args.trials,
        "warmup_per_window": warm,
        "settle_ms": args.settle_ms,
        "mid_chunks": args.mid_chunks,
        "poll_ms": args.poll_ms,
    }
    out["backend_errors"] = {k: dict(b.errors) for k, b in backends.items()}
    return out


def run_cancel(args: argparse.Namespace, stack: Stack) -> dict[str, Any]:
    return trio.run(_cancel, args, stack)


def print_cancel(res: dict[str, Any]) -> None:
    print(f"\ncancel: client closes -> backend sees EOF, ms ({res['settings']['trials']} trials)")
    print(f"{'window':<20}{'n':>4}{'p50':>8}{'p99':>8}{'max':>8}  errors")
    for window, w in res["windows"].items():
        m = w["ms"]
        extra = dict(w["errors"])
        if window == "queued":
            extra["leaked"] = len(w["leaked_to_backend"])
        print(
            f"{window:<20}{m['n']:>4}{m.get('p50', math.nan):>8.1f}{m.get('p99', math.nan):>8.1f}"
            f"{m.get('max', math.nan):>8.1f}  {extra or ''}"
        )
    print(f"edge outcomes: {res['edge_outcomes']}")
    q = res["windows"].get("queued")
    if q is not None and q.get("poll_ms", {}).get("n"):
        print(
            "queued: the edge's own dequeue time (/admin/nodes queue.last_exit); "
            f"the first poll that saw it: p50 {q['poll_ms']['p50']:.1f}, "
            f"p99 {q['poll_ms']['p99']:.1f} ms"
        )


# --------------------------------------------------------------------------- memory


async def _open_idle_streams(
    client: RawClient, n: int, concurrency: int, nursery: trio.Nursery, timeout_s: float
) -> tuple[int, Counter[str]]:
    """Start ``n`` idle streams in ``nursery``; return once each has its first chunk."""
    limiter = trio.CapacityLimiter(concurrency)
    opened = [0]
    errors: Counter[str] = Counter()
    all_open = trio.Event()
    body = chat_body(MODEL_FREE, bench={"mode": "idle"})

    async def one() -> None:
        await limiter.acquire()
        held = [True]

        def on_head(status: int, headers: list[tuple[bytes, bytes]]) -> None:
            if status != 200:
                errors[f"HTTP {status}"] += 1

        def on_data(data: bytes) -> None:
            if held[0] and b'"content"' in data:
                held[0] = False
                limiter.release()
                opened[0] += 1
                if opened[0] + sum(errors.values()) >= n:
                    all_open.set()

        try:
            await client.post("/v1/chat/completions", body, on_head, on_data)
            errors["ended"] += 1
        except (h11.ProtocolError, trio.BrokenResourceError, OSError) as exc:
            errors[type(exc).__name__] += 1
        finally:
            if held[0]:
                limiter.release()
                if opened[0] + sum(errors.values()) >= n:
                    all_open.set()

    for _ in range(n):
        nursery.start_soon(one)
    with trio.move_on_after(timeout_s):
        await all_open.wait()
    return opened[0], errors


async def _memory(args: argparse.Namespace, stack: Stack) -> dict[str, Any]:
    backend = MockBackend(MODEL_FREE)
    n = args.streams
    big = {"first_token_timeout_s": 3600.0, "idle_timeout_s": 3600.0, "request_timeout_s": 3600.0}
    out: dict[str, Any] = {"streams": n, "rounds": []}
    async with trio.open_nursery() as nursery:
        url = await backend.start(nursery)
        instances = [_mock_instance("free", url, n + 64, max_queue=64, deadlines=big)]
        edge_cfg = {"deadlines": big, "scheduler": {"max_queue": max(256, n)}}
        cl = await _start_mock_cluster(stack, edge_cfg, instances, {MODEL_FREE})
        out["config"] = {"edge": edge_cfg, "instances": instances}
        out["pids"] = cl.pids()
        pids = {"edge": cl.edge.pid, "node": cl.nodes[0].pid}

        def rss() -> dict[str, int]:
            return {k: rss_kb(p) for k, p in pids.items()}

        async with httpx.AsyncClient(timeout=30, trust_env=False) as ac:
            client = RawClient(cl.url)
            for rnd in range(args.rounds + 1):  # round 0 warms up
                warm = rnd == 0
                count = min(50, n) if warm else n
                await trio.sleep(args.settle_s)
                before = rss()
                t0 = time.perf_counter()
                async with trio.open_nursery() as streams:
                    opened, errors = await _open_idle_streams(
                        client, count, args.open_concurrency, streams, 120
                    )
                    open_s = time.perf_counter() - t0
                    await trio.sleep(args.settle_s)
                    a = await _admin_async(ac, cl.url)
                    during = rss()
                    runs = len(a["runs"])
                    streams.cancel_scope.cancel()  # every client closes its socket
                with trio.move_on_after(60):
                    while True:
                        if (
                            not backend.open_streams
                            and not (await _admin_async(ac, cl.url))["runs"]
                        ):
                            break
                        await trio.sleep(0.2)
                await trio.sleep(args.settle_s)
                after = rss()
                if warm:
                    continue
                grew = {k: during[k] - before[k] for k in pids}
                kept = {k: after[k] - before[k] for k in pids}
                total_grew = sum(grew.values())
                out["rounds"].append(
                    {
                        "round": rnd,
                        "opened": opened,
                        "errors": dict(errors),
                        "edge_runs_while_open": runs,
                        "open_s": round(open_s, 2),
                        "rss_kb": {"before": before, "open": during, "after": after},
                        "kb_per_stream": {k: round(v / opened, 1) for k, v in grew.items()}
                        | {"edge+node": round(total_grew / opened, 1)},
                        "returned_pct": {
                            k: round(100 * (during[k] - after[k]) / grew[k], 1) if grew[k] else None
                            for k in pids
                        }
                        | {
                            "edge+node": round(
                                100 * (total_grew - sum(kept.values())) / total_grew, 1
                            )
                            if total_grew
                            else None
                        },
                    }
                )
                r = out["rounds"][-1]
                print(
                    f"bench: memory round {rnd}: {opened} open, {r['kb_per_stream']} KB per "
                    f"stream, returned {r['returned_pct']} %",
                    flush=True,
                )
        nursery.cancel_scope.cancel()
    out["backend_errors"] = dict(backend.errors)
    return out


def run_memory(args: argparse.Namespace, stack: Stack) -> dict[str, Any]:
    return trio.run(_memory, args, stack)


def print_memory(res: dict[str, Any]) -> None:
    print(f"\nmemory: {res['streams']} idle streams, RSS (KiB) of edge and node")
    print(
        f"{'round':>6}{'opened':>8}{'edge before/open/after':>26}{'node before/open/after':>26}"
        f"{'KB/stream e/n/e+n':>22}{'returned % e+n':>16}"
    )
    for r in res["rounds"]:
        rk, kb = r["rss_kb"], r["kb_per_stream"]

        def col(k: str, rk: dict[str, Any] = rk) -> str:
            return f"{rk['before'][k]}/{rk['open'][k]}/{rk['after'][k]}"

        print(
            f"{r['round']:>6}{r['opened']:>8}{col('edge'):>26}{col('node'):>26}"
            f"{kb['edge']:>8.1f}/{kb['node']:.1f}/{kb['edge+node']:<6.1f}"
            f"{r['returned_pct']['edge+node']!s:>14}"
        )


# --------------------------------------------------------------------------- idle nodes


def _sim_instance() -> dict[str, Any]:
    return {"adapter": "sim", "name": "sim"}


def _node_ids(c: httpx.Client, url: str) -> set[str]:
    r = c.get(url + "/admin/nodes")
    r.raise_for_status()
    return {n["id"] for n in r.json()["nodes"]}


def run_idle_nodes(args: argparse.Namespace, stack: Stack) -> dict[str, Any]:
    edge, url, link = start_edge(stack, {})
    with httpx.Client(timeout=10, trust_env=False) as c:
        return _idle_nodes(args, stack, c, edge, url, link)


def _idle_nodes(
    args: argparse.Namespace, stack: Stack, c: httpx.Client, edge: Child, url: str, link: str
) -> dict[str, Any]:
    out: dict[str, Any] = {"nodes": args.nodes, "real_nodes": args.real_nodes}
    time.sleep(1.0)
    w = CpuWindow({"edge": edge.pid})
    time.sleep(5.0)
    out["edge_alone"] = w.stop()
    reals = [
        start_node(stack, f"idle-real-{i}", link, {}, [_sim_instance()])
        for i in range(args.real_nodes)
    ]
    agents = args.nodes - args.real_nodes
    helper = None
    if agents:
        helper = stack.launch(
            "agents",
            argv=[
                args.python,
                "-m",
                "iop.bench._stress",
                "--serve-agents",
                str(agents),
                "--link",
                link,
            ],
        )
    t0 = time.monotonic()
    deadline = t0 + 90
    while len(_node_ids(c, url)) < args.nodes:
        for p in stack.procs:
            if not p.alive:
                raise RuntimeError(f"{p.name} exited:\n{p.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"only {len(_node_ids(c, url))} of {args.nodes} nodes joined in 90 s"
            )
        time.sleep(0.5)
    out["join_s"] = round(time.monotonic() - t0, 1)
    print(f"bench: idle-nodes: {args.nodes} nodes joined in {out['join_s']} s", flush=True)
    time.sleep(3.0)  # the joins' own work is over
    polls = []
    for _ in range(5):
        t = time.perf_counter()
        _node_ids(c, url)
        polls.append(1000 * (time.perf_counter() - t))
    # The resolution of the loss times below: one /admin/nodes poll.
    out["admin_poll_ms"] = summary(polls)
    time.sleep(1.0)
    pids = {"edge": edge.pid} | {p.name: p.pid for p in reals}
    if helper is not None:
        pids["agents"] = helper.pid
    rss0 = {k: rss_kb(p) for k, p in pids.items()}
    w = CpuWindow(pids)
    time.sleep(args.idle_s)
    idle = w.stop()
    out["idle"] = idle
    out["rss_kb"] = rss0
    if args.idle_profile > 0:
        # After the CPU window, so the sampler's own reads stay out of it.
        spies = _idle_spies(args, {"edge": edge.pid}, args.idle_profile)
        time.sleep(args.idle_profile)
        out["profile"] = _spy_report(spies)
    cpu = idle["cpu_s"]
    wall = idle["wall_s"]
    real_pct = [100 * cpu[p.name] / wall for p in reals]
    out["edge_cpu_pct_of_core"] = round(100 * cpu["edge"] / wall, 2)
    out["edge_cpu_ms_per_node_s"] = round(1000 * cpu["edge"] / wall / args.nodes, 3)
    out["real_node_cpu_pct_of_core"] = [round(x, 2) for x in real_pct]
    out["real_node_cpu_ms_per_s"] = round(10 * sum(real_pct) / len(real_pct), 3)
    if helper is not None:
        out["agent_cpu_ms_per_node_s"] = round(1000 * cpu["agents"] / wall / agents, 3)
    # Node loss: a frozen node (SIGSTOP) is only noticed by the heartbeat timeout.
    losses: list[float] = []
    for p in reals[: args.loss_trials]:
        os.kill(p.pid, signal.SIGSTOP)
        t0 = time.perf_counter()
        while p.name in _node_ids(c, url):
            if time.perf_counter() - t0 > 30:
                break
            time.sleep(0.02)
        losses.append(round(time.perf_counter() - t0, 3))
        os.kill(p.pid, signal.SIGCONT)
    out["loss_sigstop_s"] = losses
    killed = reals[-1]
    os.kill(killed.pid, signal.SIGKILL)
    t0 = time.perf_counter()
    while killed.name in _node_ids(c, url) and time.perf_counter() - t0 < 30:
        time.sleep(0.005)
    out["loss_sigkill_s"] = round(time.perf_counter() - t0, 3)
    killed.popen.wait(5)
    out["edge_log_warnings"] = _log_counts(edge)
    return out


def print_idle_nodes(res: dict[str, Any]) -> None:
    idle = res["idle"]
    print(
        f"\nidle-nodes: {res['nodes']} nodes ({res['real_nodes']} `iop node` processes), "
        f"{idle['wall_s']:.0f} s idle"
    )
    print(
        f"  edge: {res['edge_cpu_pct_of_core']} % of a core "
        f"({res['edge_cpu_ms_per_node_s']} ms CPU per node per second; "
        f"alone, no nodes: {res['edge_alone']['cpu_pct_of_core']['edge']} %)"
    )
    print(
        f"  a node process: {res['real_node_cpu_ms_per_s']} ms CPU per second "
        f"({res['real_node_cpu_pct_of_core']} % of a core each)"
    )
    if "agent_cpu_ms_per_node_s" in res:
        print(f"  an in-process NodeAgent: {res['agent_cpu_ms_per_node_s']} ms CPU per second")
    print(
        f"  node loss: SIGSTOP detected after {res['loss_sigstop_s']} s, "
        f"SIGKILL after {res['loss_sigkill_s']} s (one /admin/nodes poll: "
        f"{res['admin_poll_ms'].get('p50')} ms); "
        f"load {idle['loadavg']}, foreign {idle['foreign_cpu_pct_of_core']} %"
    )
    for name, rep in res.get("profile", {}).items():
        print(f"  py-spy {name}: {rep.get('samples')} samples, {rep.get('raw_file')}")
        for fn, share in rep.get("inclusive_pct_top_functions", [])[:12]:
            print(f"    {share:5.1f} %  {fn}")


def serve_agents(
    args: argparse.Namespace,
) -> int:  # pragma: no cover - runs in the idle-nodes helper process
    """The helper process of idle-nodes: ``--serve-agents N`` NodeAgents on one link URL."""
    from iop.config import NodeConfig, decode_config
    from iop.node import open_node_agent

    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    async def agents() -> None:
        async with contextlib.AsyncExitStack() as stack, trio.open_nursery() as nursery:
            for i in range(args.serve_agents):
                cfg = decode_config(
                    {
                        "node": {
                            "id": f"idle-{args.first_id + i:03d}",
                            "edges": [{"url": args.link, "token": NODE_TOKEN}],
                        },
                        "instances": [_sim_instance()],
                    },
                    NodeConfig,
                    source="bench_stress --serve-agents",
                )
                agent = await stack.enter_async_context(open_node_agent(cfg))
                await nursery.start(agent.serve)
            print(f"agents: {args.serve_agents} serving", flush=True)
            await trio.sleep_forever()

    try:
        trio.run(agents)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt) or (
            isinstance(exc, BaseExceptionGroup) and exc.subgroup(KeyboardInterrupt) is not None
        ):
            return 0
        raise
    return 0


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--only",
        default=",".join(STEPS),
        help="comma-separated measurements to run, in this order (default: %(default)s)",
    )
    ap.add_argument("--seed", type=int, default=1, help="seed of the arrival times (default: 1)")
    g = ap.add_argument_group("cancel")
    g.add_argument("--trials", type=int, default=20, help="per window (default: %(default)s)")
    g.add_argument(
        "--windows",
        default=",".join(WINDOWS),
        help="windows to measure (default: %(default)s)",
    )
    g.add_argument(
        "--settle-ms",
        type=float,
        default=20.0,
        help="wait in the window before closing, so every process has handled it "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--mid-chunks",
        type=int,
        default=8,
        help="chunks sent (and read by the client) before the mid-stream close "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--perf-trace",
        action="store_true",
        help="record the trials with perf (scheduler and syscalls, on the samples' clock) "
        "for trace_cancel.py (git show 37c0eb9^:scripts/trace_cancel.py; needs perf and root)",
    )
    g.add_argument(
        "--poll-ms",
        type=float,
        default=20.0,
        help="queued window: /admin/nodes poll period after the close, and the wait "
        "before the first poll; the sample is the edge's own dequeue time, so this "
        "sets when it is read, not its resolution (default: %(default)s)",
    )
    g.add_argument(
        "--litellm",
        type=Path,
        default=None,
        help="LiteLLM's `litellm` executable: measure its cancellation in the same windows "
        "(but queued), in front of the same mock backend (default: IOP only)",
    )
    g.add_argument(
        "--litellm-trials",
        type=int,
        default=5,
        help="LiteLLM trials per window, after one unmeasured (default: %(default)s)",
    )
    g.add_argument(
        "--litellm-eof-s",
        type=float,
        default=2.0,
        help="how long a LiteLLM trial waits for the backend's EOF; a window it never "
        "cancels in counts a 'no EOF' error per trial (default: %(default)s)",
    )
    g.add_argument(
        "--litellm-cancel-on-disconnect",
        action="store_true",
        help="LiteLLM's general_settings.cancel_on_disconnect: true (default: its default)",
    )
    g = ap.add_argument_group("memory")
    g.add_argument("--streams", type=int, default=1000, help="idle streams (default: %(default)s)")
    g.add_argument("--rounds", type=int, default=1, help="open/close rounds (default: %(default)s)")
    g.add_argument(
        "--open-concurrency",
        type=int,
        default=64,
        help="streams being opened at once (default: %(default)s)",
    )
    g.add_argument(
        "--settle-s",
        type=float,
        default=3.0,
        help="wait before each RSS sample (default: %(default)s)",
    )
    g = ap.add_argument_group("overload")
    g.add_argument(
        "--levels",
        default="80,90,100,90,120,90,150",
        help="open-loop levels, percent of the saturated rate; repeat one to rerun it "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--duration-s", type=float, default=15.0, help="per level (default: %(default)s)"
    )
    g.add_argument(
        "--arrivals",
        choices=("poisson", "fixed"),
        default="poisson",
        help="inter-arrival times (default: %(default)s)",
    )
    g.add_argument(
        "--sat-concurrency",
        type=int,
        default=32,
        help="closed-loop workers measuring the saturated rate (default: %(default)s)",
    )
    g.add_argument(
        "--sat-s", type=float, default=10.0, help="closed-loop duration (default: %(default)s)"
    )
    g.add_argument(
        "--resat-s",
        type=float,
        default=5.0,
        help="before every level after the first, a closed loop this long measures the "
        "saturated rate again and the level offers its share of that (the box's other "
        "load moves); 0 keeps the first one (default: %(default)s)",
    )
    g.add_argument(
        "--client-timeout-s",
        type=float,
        default=10.0,
        help="a request not done this long after its arrival is abandoned "
        "(client_timeout; the client closes its connection) (default: %(default)s)",
    )
    g.add_argument(
        "--max-outstanding",
        type=int,
        default=4000,
        help="the load generator's own cap on open requests (client_overflow above) "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--pause-s",
        type=float,
        default=1.0,
        help="idle time between levels, once the edge has no run (default: %(default)s)",
    )
    g.add_argument(
        "--paced-rate",
        type=float,
        default=0.0,
        help="the sim's tokens/s per stream, 0 as fast as it can (default: %(default)s)",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=32,
        help="the node instance's slots: the most runs it streams at once, the rest wait "
        "in the edge's queue. 32 is the closed loop's concurrency, where this box "
        "saturates; bench_platform.py's 256 lets the node stream 256 answers at once, "
        "which share its CPU (default: %(default)s)",
    )
    g.add_argument(
        "--node-max-queue",
        type=int,
        default=256,
        help="the node instance's max_queue (default: %(default)s)",
    )
    g.add_argument(
        "--edge-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="edge config override, TOML value, e.g. scheduler.max_queue=32 (repeatable)",
    )
    g.add_argument(
        "--instance-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="node instance config override, e.g. queue_timeout_s=5 (repeatable)",
    )
    g.add_argument(
        "--profile",
        type=int,
        default=None,
        metavar="PCT",
        help="attach py-spy to edge and node during the first level PCT, 0 for the closed "
        "loop (needs py-spy; raw stacks go to --out-dir)",
    )
    g = ap.add_argument_group("idle-nodes")
    g.add_argument("--nodes", type=int, default=100, help="idle nodes (default: %(default)s)")
    g.add_argument(
        "--real-nodes",
        type=int,
        default=4,
        help="of them, `iop node` processes; the rest are NodeAgents in one helper "
        "process (default: %(default)s)",
    )
    g.add_argument(
        "--idle-s", type=float, default=20.0, help="CPU measurement (default: %(default)s)"
    )
    g.add_argument(
        "--loss-trials",
        type=int,
        default=3,
        help="SIGSTOP node-loss detections, one per real node (default: %(default)s)",
    )
    g.add_argument(
        "--idle-profile",
        type=float,
        default=0.0,
        metavar="S",
        help="after the CPU window, py-spy (1000 Hz, idle stacks left out) on the edge "
        "for S seconds; raw stacks go to --out-dir (default: none)",
    )
    ap.add_argument(
        "--out-dir",
        type=Path,
        default=REPO / "bench-results",
        help="where the JSON (and py-spy files) go (default: bench-results/)",
    )
    ap.add_argument(
        "--python",
        default=sys.executable,
        help="interpreter that runs `-m iop` for the children (default: this one)",
    )
    # The helper process of idle-nodes: this script runs it itself.
    ap.add_argument("--serve-agents", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--link", default="", help=argparse.SUPPRESS)
    ap.add_argument("--first-id", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.steps = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in args.steps if s not in STEPS]
    if bad:
        ap.error(f"--only: unknown {bad}; choose from {list(STEPS)}")
    args.window_list = [w.strip() for w in args.windows.split(",") if w.strip()]
    bad = [w for w in args.window_list if w not in WINDOWS]
    if bad:
        ap.error(f"--windows: unknown {bad}; choose from {list(WINDOWS)}")
    args.levels = _int_list(args.levels, "--levels", ap)
    if not 1 <= args.trials <= 1000:
        ap.error("--trials must be within 1..1000")
    if not 1 <= args.streams <= 20_000 or not 1 <= args.rounds <= 10:
        ap.error("--streams must be within 1..20000 and --rounds within 1..10")
    if args.real_nodes > args.nodes or args.real_nodes < 1:
        ap.error("--real-nodes must be within 1..--nodes")
    if args.loss_trials >= args.real_nodes:
        ap.error("--loss-trials must be below --real-nodes (the last one is SIGKILLed)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _term_as_int)
    if args.serve_agents:
        return serve_agents(args)
    try:
        return _main(args)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt) or (
            isinstance(exc, BaseExceptionGroup) and exc.subgroup(KeyboardInterrupt) is not None
        ):
            print("bench: interrupted; every process it started is stopped", file=sys.stderr)
            return 130
        raise


def _raise_fd_limit() -> dict[str, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the children inherit it
    return {"before": soft, "now": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}


def _git_commit() -> str:
    import subprocess

    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


STEP_RUNNERS: dict[
    str,
    tuple[Callable[[argparse.Namespace, Stack], dict[str, Any]], Callable[[dict[str, Any]], None]],
] = {}


def _main(args: argparse.Namespace) -> int:
    args.stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "timestamp": args.stamp,
        "commit": _git_commit(),
        "argv": sys.argv[1:],
        "machine": machine_info(),
        "fd_limit": _raise_fd_limit(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }
    t_start = time.monotonic()
    out = args.out_dir / f"stress-{args.stamp}.json"
    failed = False
    for step in args.steps:
        run = STEP_RUNNERS[step][0]
        t0 = time.monotonic()
        print(f"bench: --- {step}", flush=True)
        with tempfile.TemporaryDirectory(prefix=f"iop-stress-{step}-") as tmp:
            try:
                with process_stack(args.python, Path(tmp)) as stack:
                    res = run(args, stack)
            except Exception as exc:
                print(f"bench: {step} failed: {exc!r}", file=sys.stderr)
                result[step] = {"error": repr(exc)}
                failed = True
                continue
        res["duration_s"] = round(time.monotonic() - t0, 1)
        result[step] = res
        out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["duration_s"] = round(time.monotonic() - t_start, 1)
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    for step in args.steps:
        if "error" not in result[step]:
            STEP_RUNNERS[step][1](result[step])
    print(
        f"\nbench: commit {result['commit']}, load average {result['loadavg_start']} at start, "
        f"{result['loadavg_end']} at end"
    )
    print(f"bench: results in {out} ({result['duration_s']} s)")
    return 1 if failed else 0


STEP_RUNNERS["cancel"] = (run_cancel, print_cancel)
STEP_RUNNERS["memory"] = (run_memory, print_memory)
STEP_RUNNERS["overload"] = (run_overload, print_overload)
STEP_RUNNERS["idle-nodes"] = (run_idle_nodes, print_idle_nodes)

if __name__ == "__main__":
    sys.exit(main())
