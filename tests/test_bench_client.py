"""``iop.bench._client.sse_data``: the benchmarks' one SSE framing, sans-IO.

Every client of the benchmarks (the load generator, the platform's httpx
clients, the cancel trials) keeps the incomplete tail of what it read and
feeds it back with the next piece; whatever the pieces, the payloads must
come out the same and in order, comments and keep-alives skipped.

The backpressure runners' bare-socket readers have a deadline: a server that
never answers fails them (in virtual time, on a real loopback socket).

The open-loop runners' one timed stream (``timed_stream``, ``open_loop``:
objectives, ondemand, batches) over ``httpx.MockTransport`` in virtual time:
TTFT from when a request was scheduled, and each way a request fails
recorded as those runners count it.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import AsyncIterator, Callable

import h11
import httpx
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from iop.bench._client import (
    STREAM_DEADLINE_S,
    RawClient,
    TimedSample,
    fast_stream,
    open_loop,
    poisson_arrivals,
    slow_reader,
    sse_data,
    timed_stream,
)

STREAM = (
    b": keep-alive\n\n"
    b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n'
    b"data: [DONE]\n\n"
)
PAYLOADS = [
    b'{"choices":[{"delta":{"content":"a"}}]}',
    b'{"choices":[{"delta":{"content":"b"}}]}',
    b"[DONE]",
]


def feed(pieces: list[bytes]) -> tuple[list[bytes], bytes]:
    got: list[bytes] = []
    rest = b""
    for piece in pieces:
        payloads, rest = sse_data(rest + piece)
        got += payloads
    return got, rest


def test_a_whole_stream() -> None:
    assert feed([STREAM]) == (PAYLOADS, b"")


def test_byte_by_byte() -> None:
    assert feed([bytes([b]) for b in STREAM]) == (PAYLOADS, b"")


def test_an_incomplete_event_is_kept_not_given() -> None:
    got, rest = feed([STREAM + b'data: {"choices"'])
    assert got == PAYLOADS
    assert rest == b'data: {"choices"'


def test_event_and_id_lines_and_multi_line_data() -> None:
    # The Responses and Messages surfaces name their events; data may span lines.
    stream = (
        b'event: response.created\ndata: {"type":"response.created"}\n\n'
        b"id: 7\ndata:no space\ndata: second line\n\n"
        b"event: ping\n\n"
    )
    assert feed([stream]) == ([b'{"type":"response.created"}', b"no space\nsecond line"], b"")


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_any_cut(cuts: list[int]) -> None:
    points = [0, *sorted(cuts), len(STREAM)]
    pieces = [STREAM[a:b] for a, b in itertools.pairwise(points)]
    assert feed(pieces) == (PAYLOADS, b"")


async def _mute_server(nursery: trio.Nursery) -> int:
    """A server that accepts, reads the request and never answers: its port."""

    async def mute(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        await trio.sleep_forever()

    listeners = await nursery.start(trio.serve_tcp, mute, 0)
    port: int = listeners[0].socket.getsockname()[1]
    return port


async def test_the_backpressure_readers_fail_on_a_server_that_never_answers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A hung server fails the run (``STREAM_DEADLINE_S``) instead of hanging it."""
    async with trio.open_nursery() as nursery:
        port = await _mute_server(nursery)
        with trio.move_on_after(10 * STREAM_DEADLINE_S) as outer:
            with pytest.raises(trio.TooSlowError):
                await fast_stream("127.0.0.1", port, 5)
            with pytest.raises(trio.TooSlowError):
                await slow_reader("127.0.0.1", port, 5, read_bytes_per_s=0, hold_s=1.0)
        assert not outer.cancelled_caught
        nursery.cancel_scope.cancel()


# --- the open-loop runners' timed stream ------------------------------------------

URL = "http://edge.test/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def _event(**doc: object) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def _content(text: str) -> bytes:
    return _event(choices=[{"delta": {"content": text}}])


ROLE = _event(choices=[{"delta": {"role": "assistant"}}])
DONE = b"data: [DONE]\n\n"


def _client(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def _streamed(*pieces: bytes, pause_s: float = 0.0) -> Callable[[httpx.Request], httpx.Response]:
    """A 200 stream of ``pieces``, ``pause_s`` before each but the first."""

    async def body() -> AsyncIterator[bytes]:
        for i, piece in enumerate(pieces):
            if i:
                await trio.sleep(pause_s)
            yield piece

    return lambda request: httpx.Response(200, content=body())


async def _timed(
    handler: Callable[[httpx.Request], httpx.Response], late_s: float = 0.0, timeout_s: float = 30.0
) -> tuple[TimedSample, httpx.Request | None]:
    seen: list[httpx.Request] = []

    def recording(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return handler(request)

    s = TimedSample("interactive", trio.current_time() - late_s)
    async with _client(recording) as client:
        await timed_stream(client, URL, s, BODY, timeout_s, headers={"x-iop-objective": "batch"})
    return s, (seen[0] if seen else None)


async def test_a_timed_stream_counts_its_ttft_from_when_it_was_scheduled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Sent 0.5 s late; its first content 2 s after the role chunk.
    began = trio.current_time()
    s, request = await _timed(_streamed(ROLE, _content("a"), _content("b"), DONE, pause_s=1.0), 0.5)
    assert (s.status, s.error, s.refusal) == (200, "", "")
    assert s.ttft_s == pytest.approx(1.5)
    assert s.end - began == pytest.approx(3.0)
    assert request is not None
    assert json.loads(request.content) == BODY
    assert request.headers["x-iop-objective"] == "batch"


@pytest.mark.parametrize(
    ("handler", "status", "error", "refusal"),
    [
        (
            lambda r: httpx.Response(429, json={"error": {"code": "queue_full"}}),
            429,
            "",
            '{"error":{"code":"queue_full"}}',
        ),
        (
            _streamed(ROLE, _event(error={"code": "model_load_failed"})),
            200,
            "model_load_failed",
            "",
        ),
        (_streamed(ROLE, _event(error={"message": "?"})), 200, "stream error", ""),
        (_streamed(ROLE, DONE), 200, "no content", ""),
    ],
    ids=["refused", "error event", "error event without code", "no content"],
)
async def test_a_timed_stream_records_why_it_failed(
    autojump_clock: trio.testing.MockClock,
    handler: Callable[[httpx.Request], httpx.Response],
    status: int,
    error: str,
    refusal: str,
) -> None:
    s, _ = await _timed(handler)
    assert (s.status, s.error, s.refusal) == (status, error, refusal)
    assert math.isnan(s.ttft_s)
    # Only a 200 stream that ended has an end.
    assert math.isnan(s.end) == (status != 200)


async def test_a_timed_stream_that_breaks_or_never_ends_says_so(
    autojump_clock: trio.testing.MockClock,
) -> None:
    def broken(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    s, _ = await _timed(broken)
    assert (s.status, s.error) == (0, "ConnectError")
    began = trio.current_time()
    s, _ = await _timed(_streamed(ROLE, _content("a"), DONE, pause_s=math.inf), timeout_s=7.0)
    assert (s.status, s.error) == (200, "timeout")
    assert trio.current_time() - began == pytest.approx(7.0)


async def test_open_loop_sends_each_at_its_time_whatever_is_in_flight(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sent: list[tuple[str, float]] = []

    async def send(s: TimedSample) -> None:
        sent.append((s.label, trio.current_time()))
        await trio.sleep(10.0)  # still in flight when the next is due

    t0 = trio.current_time() + 0.05
    samples = await open_loop(t0, [(0.0, "a"), (1.0, "b"), (1.5, "a")], send)
    assert [(s.label, s.scheduled - t0) for s in samples] == [("a", 0.0), ("b", 1.0), ("a", 1.5)]
    assert [(label, at - t0) for label, at in sent] == [("a", 0.0), ("b", 1.0), ("a", 1.5)]
    assert trio.current_time() - t0 == pytest.approx(11.5)


def test_poisson_arrivals_are_seeded_and_within_the_duration() -> None:
    plan = poisson_arrivals(20.0, 10.0, random.Random("s"))
    assert plan == poisson_arrivals(20.0, 10.0, random.Random("s"))
    assert plan == sorted(plan)
    assert all(0 < at < 10.0 for at in plan)
    assert 100 < len(plan) < 300  # about rate x duration
    assert poisson_arrivals(0.0, 10.0, random.Random("s")) == []


def test_a_sample_row_keeps_each_runners_samples_file_keys() -> None:
    s = TimedSample("batch", 1.0, ttft_s=0.5, end=2.0, status=200)
    assert list(s.row("kind")) == ["kind", "scheduled", "ttft_s", "end", "status", "error"]
    assert list(s.row("model", end=False)) == ["model", "scheduled", "ttft_s", "status", "error"]
    assert s.row("model", end=False)["model"] == "batch"


# --- the load generator's keep-alive connections ------------------------------------


async def test_a_stale_keep_alive_connection_is_retried_on_a_new_one() -> None:
    """The server closed every idle connection (its keep-alive timeout):
    the request on the first fails, and its one retry must not take the next
    idle one, which is just as dead, but connect anew (the fleet runner
    counted such requests as broken streams at 1,024 open)."""
    expired = trio.Event()
    connections: list[int] = []

    async def serve(stream: trio.SocketStream) -> None:
        connections.append(len(connections))
        h = h11.Connection(h11.SERVER)
        while True:
            event = h.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data:
                    return
                h.receive_data(data)
                continue
            if isinstance(event, h11.EndOfMessage):
                body = b"ok"
                await stream.send_all(
                    h.send(h11.Response(status_code=200, headers=[("content-length", "2")]))
                    + h.send(h11.Data(data=body))
                    + h.send(h11.EndOfMessage())
                )
                h.start_next_cycle()
                await expired.wait()  # idle past the server's keep-alive timeout
                await stream.aclose()
                return

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, serve, 0)
        port = listeners[0].socket.getsockname()[1]
        client = RawClient(f"http://127.0.0.1:{port}", max_idle=4)
        got: list[bytes] = []

        async def post() -> None:
            await client.post("/x", b"{}", lambda status, headers: None, got.append)

        async with trio.open_nursery() as clients:  # two connections, both kept idle
            clients.start_soon(post)
            clients.start_soon(post)
        assert got == [b"ok", b"ok"]
        assert len(connections) == 2
        expired.set()
        await trio.testing.wait_all_tasks_blocked()
        await post()  # the first idle one fails; the retry connects anew
        assert got[-1] == b"ok"
        assert client.connects == 3
        client.close_idle()
        nursery.cancel_scope.cancel()
