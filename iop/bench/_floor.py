"""The ``floor`` runner: what trio, h11, wsproto and msgspec cost alone, per operation.

A streamed token crosses, at the least, one socket read and one task wake-up
on the node (the backend's chunk), one WebSocket frame each way of the link
(shared by every token queued at that moment), and one task wake-up and one
socket write on the edge (the client's SSE chunk, which cannot be shared:
each client has its own connection). This runner measures each of those
operations alone, in the ``iop bench`` process, on this machine, so that
docs/benchmarks.md can say how much of IOP's CPU per token is the floor of
the libraries it is built on and how much is IOP.

Measured (median of ``repeat`` runs of ``n`` operations each, wall time per
operation, in µs):

* ``socket round trip``: a 100-byte ``send`` on one end of a trio
  socketpair and the ``receive_some`` on the other, by two tasks: two
  socket operations, two task wake-ups and the epoll calls between them;
* ``socket send (writable)``: a 100-byte ``send_all`` on a socket whose
  buffer has room, the reader draining in bulk: the cost of one write;
* ``socket receive (ready)``: a ``receive_some`` of a 100-byte write that
  is already in the socket's buffer: the cost of one read, without a wait;
* ``task hop``: a ``MemorySendChannel.send`` that wakes a task blocked in
  ``receive``: one scheduler round trip;
* ``cancel scope``: entering and leaving ``trio.move_on_after``;
* ``h11 chunk``: h11 framing one 100-byte chunk of a chunked response;
* ``h11 chunk read``: h11 (a client's) reading one HTTP chunk holding one
  vLLM SSE event (about 150 bytes): what httpcore paid per token;
* ``chat chunk parse``: that SSE event through the node's chat stream
  parser (SSE decoding, the chunk's JSON, one ``Delta``);
* ``chunked decoder read``: the node's own chunked decoder
  (``iop.wire.ChunkedDecoder``) reading that HTTP chunk: what the node pays
  per token since it replaced h11 there;
* ``wsproto frame``: wsproto framing a 100-byte binary message and parsing
  it back;
* ``node link frame``: the node's own WebSocket client (``iop.node._wsframes``)
  framing and masking a 100-byte binary message, and parsing a 100-byte
  frame from the server: the node's framing work per frame each way since
  it replaced trio-websocket (over wsproto);
* ``node link send (writable)``: the node's link channel
  (``iop.node.WebSocketFrameChannel``) sending a 100-byte frame on a socket
  whose buffer has room: framing, masking and the write;
* ``msgspec batch``: encoding and decoding a link frame of 32 one-token
  ``events`` messages, per message;

and three that are CPU time, not wall time, each of at most
``IDLE_OPS`` operations ``IDLE_GAP_S`` apart (a paced token's life: the
process sleeps between two), where another thread (on the other core)
plays the peer:

* ``wake-up from idle, trio (CPU)``: a trio task waiting readable on a
  socket pair, woken by a 100-byte message, reading it and waiting again:
  the CPU of the woken thread (``time.thread_time``) per message, system
  time included: what waking a trio process costs per token;
* ``wake-up from idle, bare epoll (CPU)``: the same wait with
  ``select.epoll`` and no event loop: the kernel's and CPython's part of it;
* ``loopback write that wakes its reader (CPU)``: a 150-byte ``os.write``
  on a loopback TCP connection whose reader sleeps in ``recv``: the
  writer's CPU per write, which includes the receiver's TCP work and its
  wake-up (the kernel does both inside the sender's write on loopback).

It starts no process: the operations are measured where nothing else of
IOP runs. Until December 2026 this was ``scripts/bench_floor.py``
(``git show b50e66e^:scripts/bench_floor.py``).
"""

from __future__ import annotations

import os
import select
import socket
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import h11
import msgspec
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, BytesMessage, Request

from iop.bench._runner import RunContext, register, tables_report
from iop.events import Delta
from iop.node import WebSocketFrameChannel
from iop.node._wsframes import ClientFrames
from iop.protocol import RunEvents, decode_node_batch, encode, encode_batch
from iop.wire import ChatStreamParser, ChunkedDecoder

__all__ = ["CASES", "Options", "plots", "run", "tables"]


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``[args]`` of a ``floor`` scenario.

    Attributes:
        n: Operations per run of a case.
        repeat: Runs per case; the median is reported.
    """

    n: int = 10_000
    repeat: int = 3


PAYLOAD = b"x" * 100


async def socket_round_trip(n: int) -> float:
    a, b = trio.socket.socketpair()
    sa, sb = trio.SocketStream(a), trio.SocketStream(b)
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:

        async def echo() -> None:
            for _ in range(n):
                await sb.receive_some(65536)
                await sb.send_all(PAYLOAD)

        nursery.start_soon(echo)
        for _ in range(n):
            await sa.send_all(PAYLOAD)
            await sa.receive_some(65536)
    dt = time.perf_counter() - t0
    await sa.aclose()
    await sb.aclose()
    return dt / (2 * n)  # two send+receive pairs per loop


async def socket_send_writable(n: int) -> float:
    a, b = trio.socket.socketpair()
    sa, sb = trio.SocketStream(a), trio.SocketStream(b)
    done = trio.Event()

    async def drain() -> None:
        while not done.is_set():
            with trio.move_on_after(0.05):
                await sb.receive_some(1 << 20)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(drain)
        t0 = time.perf_counter()
        for _ in range(n):
            await sa.send_all(PAYLOAD)
        dt = time.perf_counter() - t0
        done.set()
    await sa.aclose()
    await sb.aclose()
    return dt / n


async def socket_receive_ready(n: int) -> float:
    a, b = socket.socketpair()
    sa = trio.SocketStream(trio.socket.from_stdlib_socket(a))
    t0 = time.perf_counter()
    for _ in range(n):
        b.send(PAYLOAD)  # the peer's write, not a trio operation: not counted apart
        await sa.receive_some(65536)
    dt = time.perf_counter() - t0
    await sa.aclose()
    b.close()
    return dt / n


async def task_hop(n: int) -> float:
    send, receive = trio.open_memory_channel[int](0)
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:

        async def consumer() -> None:
            for _ in range(n):
                await receive.receive()

        nursery.start_soon(consumer)
        for i in range(n):
            await send.send(i)
    return (time.perf_counter() - t0) / n


async def cancel_scope(n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        with trio.move_on_after(10):  # noqa: ASYNC100 - the scope's own cost is the point
            pass
    return (time.perf_counter() - t0) / n


async def h11_chunk(n: int) -> float:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    conn.next_event()
    conn.send(h11.Response(status_code=200, headers=[("Transfer-Encoding", "chunked")]))
    t0 = time.perf_counter()
    for _ in range(n):
        conn.send(h11.Data(data=PAYLOAD))
    return (time.perf_counter() - t0) / n


# One chunk of a streamed chat answer as vLLM (and ``iop sim``) writes it:
# one SSE event in one HTTP chunk.
_SSE_EVENT = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":" token"},"finish_reason":null}]}\n\n'
)
_HTTP_CHUNK = b"%x\r\n%s\r\n" % (len(_SSE_EVENT), _SSE_EVENT)


async def h11_chunk_read(n: int) -> float:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    conn.next_event()
    t0 = time.perf_counter()
    for _ in range(n):
        conn.receive_data(_HTTP_CHUNK)
        while conn.next_event() is not h11.NEED_DATA:
            pass
    return (time.perf_counter() - t0) / n


async def chunked_decoder_read(n: int) -> float:
    decoder = ChunkedDecoder()
    t0 = time.perf_counter()
    for _ in range(n):
        decoder.feed(_HTTP_CHUNK)
    return (time.perf_counter() - t0) / n


async def chat_chunk_parse(n: int) -> float:
    parser = ChatStreamParser(label="bench")
    t0 = time.perf_counter()
    for _ in range(n):
        parser.feed(_SSE_EVENT)
    return (time.perf_counter() - t0) / n


async def wsproto_frame(n: int) -> float:
    client = WSConnection(ConnectionType.CLIENT)
    server = WSConnection(ConnectionType.SERVER)
    server.receive_data(client.send(Request(host="x", target="/")))
    next(server.events())
    client.receive_data(server.send(AcceptConnection()))
    next(client.events())
    t0 = time.perf_counter()
    for _ in range(n):
        server.receive_data(client.send(BytesMessage(data=PAYLOAD)))
        for _ in server.events():
            pass
    return (time.perf_counter() - t0) / n


_SERVER_FRAME = b"\x82" + bytes([len(PAYLOAD)]) + PAYLOAD  # unmasked (RFC 6455 §5.1)


async def node_link_frame(n: int) -> float:
    frames = ClientFrames(1 << 20)
    t0 = time.perf_counter()
    for _ in range(n):
        frames.binary(PAYLOAD)
        frames.receive_data(_SERVER_FRAME)
        frames.next_event()
    return (time.perf_counter() - t0) / n


async def node_link_send_writable(n: int) -> float:
    a, b = trio.socket.socketpair()
    with a, b:
        chan = WebSocketFrameChannel(trio.SocketStream(a), ClientFrames(1 << 20), "bench")

        async def drain() -> None:
            while await b.recv(1 << 20):
                pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            t0 = time.perf_counter()
            for i in range(n):
                await chan.send(PAYLOAD)
                if i % 64 == 63:
                    await trio.lowlevel.checkpoint()  # let the reader drain the buffer
            elapsed = time.perf_counter() - t0
            nursery.cancel_scope.cancel()
    return elapsed / n


async def msgspec_batch(n: int) -> float:
    rounds = max(1, n // 32)
    t0 = time.perf_counter()
    for _ in range(rounds):
        encoded = [
            encode(RunEvents(run_id=f"{i:032x}", seq=7, events=[Delta(" token")]))
            for i in range(32)
        ]
        decode_node_batch(encode_batch(encoded))
    return (time.perf_counter() - t0) / (rounds * 32)


# The idle cases: operations per run, and the gap between two (a stream of
# 50 tokens/s is 20 ms; 32 of them make a token every 0.6 ms).
IDLE_OPS = 1000
IDLE_GAP_S = 0.001


def _paced_writer(sock: socket.socket, n: int, payload: bytes) -> threading.Thread:
    """A thread writing ``payload`` to ``sock`` ``n`` times, ``IDLE_GAP_S`` apart."""

    def write() -> None:
        for _ in range(n):
            time.sleep(IDLE_GAP_S)
            sock.sendall(payload)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


async def trio_idle_wakeup(n: int) -> float:
    n = min(n, IDLE_OPS)
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        writer = _paced_writer(a, n, PAYLOAD)
        got = 0
        t0 = time.thread_time()
        while got < n * len(PAYLOAD):
            await trio.lowlevel.wait_readable(b)
            got += len(b.recv(65536))
        spent = time.thread_time() - t0
        writer.join()
    return spent / n


async def epoll_idle_wakeup(n: int) -> float:
    n = min(n, IDLE_OPS)
    a, b = socket.socketpair()
    with a, b, select.epoll() as ep:
        b.setblocking(False)
        ep.register(b.fileno(), select.EPOLLIN)
        writer = _paced_writer(a, n, PAYLOAD)
        got = 0
        t0 = time.thread_time()
        while got < n * len(PAYLOAD):
            ep.poll()
            got += len(b.recv(65536))
        spent = time.thread_time() - t0
        writer.join()
    await trio.lowlevel.checkpoint()
    return spent / n


async def loopback_write_waking(n: int) -> float:
    await trio.lowlevel.checkpoint()
    return _loopback_write_waking(min(n, IDLE_OPS))


def _loopback_write_waking(n: int) -> float:
    """The writer sleeps between writes on purpose: nothing else runs here."""
    payload = b"x" * 150  # an SSE chunk of one token, chunked framing included
    with socket.create_server(("127.0.0.1", 0)) as listener:
        reader = socket.create_connection(listener.getsockname()[:2])
        writer, _ = listener.accept()
    with reader, writer:
        writer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def read() -> None:
            got = 0
            while got < n * len(payload):
                got += len(reader.recv(65536))

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        spent = 0.0
        for _ in range(n):
            time.sleep(IDLE_GAP_S)  # the reader is asleep in recv again
            t0 = time.thread_time()
            os.write(writer.fileno(), payload)
            spent += time.thread_time() - t0
        thread.join()
    return spent / n


CASES: dict[str, Callable[[int], Awaitable[float]]] = {
    "socket round trip": socket_round_trip,
    "socket send (writable)": socket_send_writable,
    "socket receive (ready)": socket_receive_ready,
    "task hop": task_hop,
    "cancel scope": cancel_scope,
    "h11 chunk": h11_chunk,
    "h11 chunk read": h11_chunk_read,
    "chunked decoder read": chunked_decoder_read,
    "chat chunk parse": chat_chunk_parse,
    "wsproto frame": wsproto_frame,
    "node link frame": node_link_frame,
    "node link send (writable)": node_link_send_writable,
    "msgspec batch": msgspec_batch,
    "wake-up from idle, trio (CPU)": trio_idle_wakeup,
    "wake-up from idle, bare epoll (CPU)": epoll_idle_wakeup,
    "loopback write that wakes its reader (CPU)": loopback_write_waking,
}


@register(
    "floor",
    Options,
    "What trio, h11, wsproto and msgspec cost alone per operation (in process, µs).",
    report=tables_report(__name__),
)
def run(opts: Options, ctx: RunContext) -> dict[str, Any]:
    if ctx.smoke:
        opts = msgspec.structs.replace(opts, n=min(opts.n, 50), repeat=1)
    us_per_op: dict[str, float] = {}
    for name, case in CASES.items():
        runs = [trio.run(case, opts.n) for _ in range(opts.repeat)]
        us_per_op[name] = round(statistics.median(runs) * 1e6, 3)
    return {
        "options": msgspec.to_builtins(opts),
        "us_per_op": us_per_op,
        "versions": {
            "trio": trio.__version__,
            "h11": version("h11"),
            "msgspec": msgspec.__version__,
        },
    }


def tables(result: dict[str, Any]) -> str:
    """One row per operation: its median µs."""
    rows = [f"| {name} | {us:.2f} |" for name, us in result["us_per_op"].items()]
    return "\n".join(["| operation | µs per operation |", "| --- | ---: |", *rows])


def plots(result: dict[str, Any], img_dir: Path) -> list[Path]:
    """None: the table is the figure."""
    return []
