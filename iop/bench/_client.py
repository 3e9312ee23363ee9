"""The benchmarks' clients: raw HTTP/1.1 over trio sockets, httpx, and SSE decoding.

Three kinds of client, each for what it measures:

* ``RawClient`` (h11 over trio sockets, its own keep-alive free list): the
  load generator of ``overload`` and ``memory``. O(1) per event at any
  concurrency (httpcore's pool costs grow with the connections it holds,
  and would make the load generator the bottleneck); ``stream_answer``
  reads one streamed chat completion into an ``Answer``.
* ``one_request`` / ``one_completion`` (httpx): the clients of ``platform``,
  timing the first content chunk and the end of an answer.
* ``timed_stream`` / ``open_loop`` (httpx): the open-loop load of
  ``objectives``, ``ondemand`` and ``batches``: each streamed chat
  completion sent at its planned time (``poisson_arrivals``) whatever is in
  flight, its TTFT counted from that time (``TimedSample``).
* ``slow_reader`` / ``fast_stream`` (a bare socket, ``Connection: close``):
  the backpressure runners' readers; a slow reader's receive buffer is set
  small before it connects, so that it really stops reading.

SSE is decoded here once (``sse_data``: the ``data:`` payloads of the
complete events in a buffer, the WHATWG event stream's blank-line framing;
comments skipped), sans-IO, for every client above.
"""

from __future__ import annotations

import contextlib
import math
import random
import re
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import h11
import httpx
import msgspec
import trio

__all__ = [
    "MAX_HTTP_BYTES",
    "Answer",
    "FastResult",
    "RawClient",
    "Sample",
    "StreamEvent",
    "TimedSample",
    "admin_nodes",
    "chat_body",
    "decode_chunk",
    "fast_stream",
    "load_client",
    "next_event",
    "one_completion",
    "one_request",
    "open_loop",
    "poisson_arrivals",
    "read_sse",
    "sim_stream_body",
    "slow_reader",
    "sse_data",
    "stream_answer",
    "stream_body",
    "timed_stream",
    "wait_edge_idle",
]

# A request head or body either side reads (the node sends a few KiB).
MAX_HTTP_BYTES: Final = 1024 * 1024
# The slow client's receive buffer: the kernel doubles it (socket(7)); a few
# KiB, so that the edge's writes block after a few dozen chunks, not after
# the megabytes loopback autotuning would grant.
SLOW_RCVBUF: Final = 4096
# How long a backpressure runner's stream may take to connect and answer its
# first bytes (slow_reader), or to end (fast_stream): far above what one
# takes on a loaded 2-core box (a fast stream stalled behind a slow reader is
# cut by the edge's write_stall_timeout_s, 10 s by default), so that a server
# that never answers fails the run instead of hanging it.
STREAM_DEADLINE_S: Final = 120.0
# The model of the backpressure runners' sim.
SIM_MODEL: Final = "iop-sim"
_CONTENT: Final = re.compile(rb'"content":"[^"]')


# --------------------------------------------------------------------------- SSE


def sse_data(buf: bytes) -> tuple[list[bytes], bytes]:
    """The data of the complete events in ``buf``, and the incomplete rest to
    keep for the next piece.

    An event ends at a blank line; its data is its ``data:`` lines' values
    (one leading space off) joined by LF; an event with none (a comment such
    as a keep-alive, or only ``event:``/``id:`` lines) gives nothing. The
    gateway's own decoder (``iop.wire.SSEDecoder``) is the whole WHATWG
    algorithm with its limits; this is the subset the edge writes (LF line
    ends), at half its CPU, so that a client costs little beside what it
    measures.
    """
    *events, rest = buf.split(b"\n\n")
    out = []
    for ev in events:
        if ev.startswith(b"data: ") and b"\n" not in ev:
            out.append(ev[6:])  # the common case: one data line
            continue
        lines = [line for line in ev.split(b"\n") if line.startswith(b"data:")]
        if lines:
            out.append(b"\n".join(ln[6:] if ln[5:6] == b" " else ln[5:] for ln in lines))
    return out, rest


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta = msgspec.field(default_factory=_Delta)


class _ErrorBody(msgspec.Struct):
    code: str | None = None
    message: str = ""


class StreamEvent(msgspec.Struct):
    """A chat.completion.chunk of a stream, or an error event (the fields the clients read)."""

    choices: list[_Choice] = []
    error: _ErrorBody | None = None


class _ErrorDoc(msgspec.Struct):
    error: _ErrorBody | None = None


class _Message(msgspec.Struct):
    content: str | None = None


class _FullChoice(msgspec.Struct):
    message: _Message


class _Usage(msgspec.Struct):
    completion_tokens: int | None = None


class _Completion(msgspec.Struct):
    choices: list[_FullChoice]
    usage: _Usage | None = None


# A chat.completion.chunk (or an error event) of a stream.
decode_chunk = msgspec.json.Decoder(StreamEvent).decode
_decode_error = msgspec.json.Decoder(_ErrorDoc).decode
_decode_completion = msgspec.json.Decoder(_Completion).decode


def chat_body(model: str, stream: bool = True, **extra: Any) -> bytes:
    """A chat completion request, with ``extra`` keys at its top level."""
    req: dict[str, Any] = {
        "model": model,
        "stream": stream,
        "messages": [{"role": "user", "content": "Tell me about the benchmark."}],
        **extra,
    }
    return msgspec.json.encode(req)


# --------------------------------------------------------------------------- raw HTTP/1.1


async def next_event(stream: trio.SocketStream, conn: h11.Connection) -> Any:
    """The next h11 event of ``conn``, reading ``stream`` as it needs."""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
            continue
        return event


class _ClientConn:
    __slots__ = ("h", "stream")

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HTTP_BYTES)


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
            # The retry of a stale connection opens a new one: the next idle
            # one has waited longer still, and the server that closed the
            # first after its keep-alive timeout has closed it too.
            reused = bool(self._idle) and attempt == 0
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
                    event = await next_event(conn.stream, h)
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
                    event = await next_event(conn.stream, h)
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
    expect: int = 0  # content chunks of a whole answer

    @property
    def ok(self) -> bool:
        return not self.error and self.status == 200 and self.done and self.chunks == self.expect


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
        payloads, a.buf = sse_data(a.buf + data)
        for payload in payloads:
            if payload == b"[DONE]":
                a.done = True
                continue
            try:
                chunk = decode_chunk(payload)
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
    elif not a.done or a.chunks != a.expect:
        a.error = f"incomplete: {a.chunks} chunks, [DONE] {'seen' if a.done else 'missing'}"
    a.buf = b""


async def admin_nodes(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    """The edge's ``/admin/nodes``."""
    r = await client.get(url + "/admin/nodes")
    r.raise_for_status()
    data: dict[str, Any] = r.json()
    return data


async def wait_edge_idle(client: httpx.AsyncClient, url: str, timeout_s: float) -> bool:
    """Wait until the edge has no run and no queued run; False on timeout."""
    with trio.move_on_after(timeout_s):
        while True:
            a = await admin_nodes(client, url)
            if not a["runs"] and not a["queued"]:
                return True
            await trio.sleep(0.2)
    return False


# --------------------------------------------------------------------------- httpx


def load_client(timeout_s: float, *, keepalive: int) -> httpx.AsyncClient:
    """An httpx client for an open-loop load: no cap on connections (an
    arrival never waits for a free one), ``keepalive`` idle ones kept, each
    read bounded by ``timeout_s``, the connect by 10 s; no proxy from the
    environment."""
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=keepalive),
        timeout=httpx.Timeout(timeout_s, connect=10.0),
        trust_env=False,
    )


@dataclass
class Sample:
    ok: bool
    ttft_s: float  # request sent -> first content chunk (non-streaming: the whole body)
    total_s: float  # request sent -> end of the response
    chunks: int  # content chunks (non-streaming: completion tokens)
    reads: int  # body pieces received: about the number of the gateway's writes
    error: str = ""


async def read_sse(response: httpx.Response, on_payload: Callable[[bytes], None]) -> None:
    """Feed ``on_payload`` the data of each complete event of a streamed
    response as it arrives (``sse_data``), ``[DONE]`` left out."""
    buf = b""
    async for piece in response.aiter_raw():
        payloads, buf = sse_data(buf + piece)
        for payload in payloads:
            if payload != b"[DONE]":
                on_payload(payload)


async def one_request(client: httpx.AsyncClient, url: str, body: bytes, expect: int) -> Sample:
    t0 = time.perf_counter()
    ttft = math.nan
    chunks = reads = 0
    done = False
    try:
        async with client.stream(
            "POST", url, content=body, headers={"Content-Type": "application/json"}
        ) as r:
            if r.status_code != 200:
                text = (await r.aread())[:200].decode(errors="replace")
                err = f"HTTP {r.status_code} {text}"
                return Sample(False, ttft, time.perf_counter() - t0, 0, 0, err)
            buf = b""
            async for data in r.aiter_raw():
                reads += 1
                payloads, buf = sse_data(buf + data)
                for payload in payloads:
                    if payload == b"[DONE]":
                        done = True
                        continue
                    chunk = decode_chunk(payload)
                    if chunk.choices and chunk.choices[0].delta.content:
                        if chunks == 0:
                            ttft = time.perf_counter() - t0
                        chunks += 1
    except (httpx.HTTPError, msgspec.DecodeError) as exc:
        return Sample(False, ttft, time.perf_counter() - t0, chunks, reads, repr(exc))
    total = time.perf_counter() - t0
    if chunks != expect or not done:
        err = f"{chunks} content chunks (expected {expect}), [DONE] {'seen' if done else 'missing'}"
        return Sample(False, ttft, total, chunks, reads, err)
    return Sample(True, ttft, total, chunks, reads)


async def one_completion(client: httpx.AsyncClient, url: str, body: bytes, expect: int) -> Sample:
    """A non-streaming request: the answer must have content and, when the
    gateway reports usage, ``expect`` completion tokens."""
    t0 = time.perf_counter()
    try:
        r = await client.post(url, content=body, headers={"Content-Type": "application/json"})
        total = time.perf_counter() - t0
        if r.status_code != 200:
            err = f"HTTP {r.status_code} {r.text[:200]}"
            return Sample(False, math.nan, total, 0, 1, err)
        c = _decode_completion(r.content)
    except (httpx.HTTPError, msgspec.DecodeError) as exc:
        return Sample(False, math.nan, time.perf_counter() - t0, 0, 0, repr(exc))
    tokens = c.usage.completion_tokens if c.usage and c.usage.completion_tokens else expect
    # The sim counts the end-of-sequence token in the usage, as vLLM does.
    if not c.choices or not c.choices[0].message.content or tokens not in (expect, expect + 1):
        return Sample(False, total, total, tokens, 1, f"{tokens} tokens (expected {expect})")
    return Sample(True, total, total, tokens, 1)


# --------------------------------------------------------------------------- open loop


@dataclass
class TimedSample:
    """One streamed chat completion of an open-loop load (``timed_stream``).

    Timed from when it was *scheduled*, not sent: a load generator that falls
    behind its plan shows in the TTFT instead of hiding it.

    Attributes:
        label: Which stream of the plan it is (a kind of request, a model).
        scheduled: When it was due (``trio.current_time``).
        ttft_s: ``scheduled`` to its first content chunk (nan: none came).
        end: When its 200 stream ended (nan: it did not).
        status: The answer's status (0: none came).
        error: Why it failed, but for its status: an error event's code
            (``stream error`` without one), ``no content``, the httpx
            error's name, or ``timeout``.
        refusal: A non-200 answer's first 200 bytes (a runner may count it
            as its error).
    """

    label: str
    scheduled: float
    ttft_s: float = math.nan
    end: float = math.nan
    status: int = 0
    error: str = ""
    refusal: str = ""

    def row(self, label: str, *, end: bool = True) -> dict[str, Any]:
        """The sample as a line of its runner's ``samples-*.jsonl``: the label
        under the runner's key (``kind``, ``model``), then the figures
        (``end`` where the runner records it)."""
        out: dict[str, Any] = {label: self.label, "scheduled": self.scheduled}
        out["ttft_s"] = self.ttft_s
        if end:
            out["end"] = self.end
        out["status"] = self.status
        out["error"] = self.error
        return out

    def take(self, chunk: StreamEvent) -> None:
        """One event of its stream: an error's code, or the first content's time."""
        if chunk.error is not None:
            self.error = chunk.error.code or "stream error"
        if math.isnan(self.ttft_s) and any(c.delta.content for c in chunk.choices):
            self.ttft_s = trio.current_time() - self.scheduled


def stream_body(model: str, s: TimedSample, **extra: Any) -> dict[str, Any]:
    """The body of ``s``: a streamed chat completion of ``model`` whose
    prompt says which request it is (its label and time), with ``extra``."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"{s.label} at {s.scheduled:.6f}"}],
        "stream": True,
        **extra,
    }


def sim_stream_body(model: str, s: TimedSample, output_tokens: int) -> dict[str, Any]:
    """``stream_body`` for a sim, ``output_tokens`` long by the sim's own knob."""
    return stream_body(model, s, iop_sim={"output_tokens": output_tokens})


def poisson_arrivals(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Seconds from the start of the requests of a Poisson process of
    ``rate`` a second within ``duration_s`` (none at rate 0)."""
    out: list[float] = []
    at = rng.expovariate(rate) if rate > 0 else duration_s
    while at < duration_s:
        out.append(at)
        at += rng.expovariate(rate)
    return out


async def timed_stream(
    client: httpx.AsyncClient,
    url: str,
    s: TimedSample,
    body: dict[str, Any],
    timeout_s: float,
    headers: Mapping[str, str] | None = None,
) -> None:
    """POST ``body`` (a streamed chat completion) to ``url`` and record how
    it went in ``s``; ``timeout_s`` bounds the whole answer (the client's
    own timeout, each read)."""
    with trio.move_on_after(timeout_s) as deadline:
        try:
            async with client.stream("POST", url, json=body, headers=headers) as r:
                s.status = r.status_code
                if r.status_code != 200:
                    s.refusal = (await r.aread())[:200].decode(errors="replace")
                    return
                await read_sse(r, lambda payload: s.take(decode_chunk(payload)))
            s.end = trio.current_time()
            if math.isnan(s.ttft_s) and not s.error:
                s.error = "no content"
        except httpx.HTTPError as exc:
            s.error = type(exc).__name__
    if deadline.cancelled_caught:
        s.error = "timeout"


async def open_loop(
    t0: float,
    plan: Iterable[tuple[float, str]],
    send: Callable[[TimedSample], Awaitable[None]],
) -> list[TimedSample]:
    """``send`` a sample for each ``(seconds after t0, label)`` of ``plan``
    (in time order) at its time, whatever is still in flight: an open loop,
    whose arrivals do not wait for the answers. The samples, in plan order,
    once every send has returned."""
    samples: list[TimedSample] = []
    async with trio.open_nursery() as nursery:
        for at, label in plan:
            await trio.sleep_until(t0 + at)
            s = TimedSample(label, t0 + at)
            samples.append(s)
            nursery.start_soon(send, s)
    return samples


# --------------------------------------------------------------------------- bare sockets


def _request(host: str, port: int, max_tokens: int) -> bytes:
    body = msgspec.json.encode(
        {
            "model": SIM_MODEL,
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "stream": True,
            "max_tokens": max_tokens,
            # The sim's answer length for this request only: it generates a
            # whole answer's words before it streams, so a server default as
            # long as the slow readers' answers would cost every short
            # request that CPU too (iop/sim/_script.py).
            "iop_sim": {"output_tokens": max_tokens},
        }
    )
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


async def _connect(host: str, port: int, rcvbuf: int | None = None) -> trio.SocketStream:
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect((host, port))
    return trio.SocketStream(sock)


async def slow_reader(
    host: str,
    port: int,
    max_tokens: int,
    *,
    read_bytes_per_s: float,
    hold_s: float,
    first_bytes: trio.Event | None = None,
) -> int:
    """Stream ``max_tokens`` and read them slowly (0: not at all after the
    first bytes) for ``hold_s``, then hang up; returns the bytes read.

    Raises:
        trio.TooSlowError: No first bytes within ``STREAM_DEADLINE_S``.
    """
    with trio.fail_after(STREAM_DEADLINE_S):
        stream = await _connect(host, port, SLOW_RCVBUF)
    got = 0
    try:
        with trio.fail_after(STREAM_DEADLINE_S):
            await stream.send_all(_request(host, port, max_tokens))
            got = len(await stream.receive_some(1024))
        if first_bytes is not None:
            first_bytes.set()
        end = trio.current_time() + hold_s
        if read_bytes_per_s <= 0:
            await trio.sleep_until(end)
            return got
        step = 1024 / read_bytes_per_s
        while trio.current_time() < end:
            await trio.sleep(step)
            data = await stream.receive_some(1024)
            if not data:
                break
            got += len(data)
        return got
    finally:
        # RST, not FIN: a client that goes away (its process ended), with
        # unread data in its buffer, which Linux resets anyway.
        with trio.move_on_after(1):
            await stream.aclose()


@dataclass
class FastResult:
    ttft_s: float | None
    total_s: float
    events: int
    ok: bool


async def fast_stream(host: str, port: int, max_tokens: int) -> FastResult:
    """Stream ``max_tokens`` as fast as we can read; time the first content and the end.

    Raises:
        trio.TooSlowError: The stream did not end within ``STREAM_DEADLINE_S``.
    """
    t0 = trio.current_time()
    ttft: float | None = None
    events = 0
    tail = b""
    with trio.fail_after(STREAM_DEADLINE_S):
        stream = await _connect(host, port)
        async with stream:
            await stream.send_all(_request(host, port, max_tokens))
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    break
                if ttft is None and _CONTENT.search(tail + data):
                    ttft = trio.current_time() - t0
                events += data.count(b"data: ")
                tail = data[-64:]
    return FastResult(ttft, trio.current_time() - t0, events, b"[DONE]" in tail)
