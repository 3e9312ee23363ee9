"""The testing kit itself: transcripts, the FakeBackend on real sockets, FakeTransport."""

from __future__ import annotations

import json
import socket
import struct

import httpx
import msgspec
import pytest
import trio
import trio.testing

import iop.testing
from iop.testing import (
    CHAT_COMPLETIONS_PATH,
    MODELS_PATH,
    Abort,
    CloseCause,
    ConnectFailure,
    ConnState,
    FakeBackend,
    FakeTransport,
    Pause,
    Reply,
    Split,
    Stall,
    Write,
    captured_exchanges,
    list_transcripts,
    load_transcript,
    open_fake_backend,
    parse_capture,
    transcript_body,
)

BODY = b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"
# Generous bound for "the server noticed": loopback takes well under 1 ms.
NOTICE_S = 5.0


# --- public surface ---------------------------------------------------------------


def test_public_surface_is_explicit() -> None:
    exported = set(iop.testing.__all__)
    assert len(exported) == len(iop.testing.__all__), "duplicates in __all__"
    for name in exported:
        assert hasattr(iop.testing, name), name
    public = {n for n in vars(iop.testing) if not n.startswith("_")}
    submodules = {"annotations"} | {
        n for n in public if type(getattr(iop.testing, n)).__name__ == "module"
    }
    assert public - submodules == exported


# --- transcripts ------------------------------------------------------------------


def test_list_transcripts_has_the_recordings() -> None:
    names = list_transcripts()
    assert names == sorted(names)
    for expected in (
        "vllm_text_stream_with_usage.txt",
        "real-xllamacpp-chat-stream.txt",
        "vllm_400_auto_tool_choice_body.json",
    ):
        assert expected in names


def test_load_transcript_is_the_file_byte_for_byte() -> None:
    from importlib.resources import files

    raw = files("iop.testing").joinpath("transcripts", "llamacpp_stream.txt").read_bytes()
    assert load_transcript("llamacpp_stream.txt") == raw
    assert transcript_body("llamacpp_stream.txt") == raw


@pytest.mark.parametrize("name", ["../spec.py", "a/b.txt", ".hidden", "missing.txt"])
def test_load_transcript_rejects_what_is_not_a_transcript(name: str) -> None:
    with pytest.raises(FileNotFoundError):
        load_transcript(name)


def test_raw_body_has_only_index_zero() -> None:
    with pytest.raises(IndexError):
        transcript_body("vllm_text_stream_with_usage.txt", 1)


def test_capture_stream_body_is_exact() -> None:
    exchanges = captured_exchanges("real-xllamacpp-chat-stream.txt")
    assert len(exchanges) == 2
    stream, whole = exchanges
    assert stream.status == 200
    assert stream.reason == "OK"
    assert stream.header("transfer-encoding") == "chunked"
    assert stream.header("TRANSFER-ENCODING") == "chunked"
    assert stream.command.startswith("curl -sS -N -i")
    # The body starts at the first event and ends with [DONE]: no headers, no
    # curl trailer, no separator of the capture script.
    assert stream.body.startswith(b'data: {"choices":')
    assert stream.body.endswith(b"\n\ndata: [DONE]\n\n")
    assert b"--- curl" not in stream.body
    assert transcript_body("real-xllamacpp-chat-stream.txt") == stream.body
    assert whole.header("content-length") == str(len(whole.body))
    assert json.loads(whole.body)["choices"][0]["message"]["content"] == (
        "The capital of France is Paris."
    )
    assert transcript_body("real-xllamacpp-chat-stream.txt", 1) == whole.body
    assert transcript_body("real-xllamacpp-chat-stream.txt", -1) == whole.body
    with pytest.raises(IndexError):
        transcript_body("real-xllamacpp-chat-stream.txt", 2)


def test_capture_bodies_without_headers_lose_only_the_curl_trailer() -> None:
    exchanges = captured_exchanges("real-xllamacpp-errors.txt")
    statuses = [e.status for e in exchanges]
    assert statuses[:5] == [400, 400, 400, 400, 404]
    for e in exchanges[:5]:
        assert e.header("content-length") == str(len(e.body))
        assert "error" in json.loads(e.body)
    # `-w '\nHTTP %{http_code}\n'` and no -i: the body is the JSON alone.
    plain = exchanges[5]
    assert plain.status is None
    assert json.loads(plain.body)["object"] == "chat.completion"


def test_every_content_length_matches_the_recovered_body() -> None:
    for name in list_transcripts():
        if not name.startswith("real-"):
            continue
        for e in captured_exchanges(name):
            length = e.header("content-length")
            if length is not None:
                assert len(e.body) == int(length), (name, e.command)


def test_capture_skips_non_curl_commands_and_sections() -> None:
    exchanges = captured_exchanges("real-xllamacpp-tools.txt")
    assert all(e.command.startswith("curl ") for e in exchanges)
    streamed = exchanges[6]
    assert streamed.header("content-type") == "text/event-stream"
    assert streamed.body.endswith(b"data: [DONE]\n\n")


def test_parse_capture_synthetic() -> None:
    data = (
        b"## section\n"
        b"# captured now\n"
        b"$ cat req.json\n"
        b'{"x": 1}\n'
        b"\n"
        b"# captured now\n"
        b"$ curl -sS -i -w '\\n--- curl: http=%{http_code}\\n' http://h/v1/models\n"
        b"HTTP/1.1 200 OK\r\n"
        b"Content-Type: text/event-stream\r\n"
        b"\r\n"
        b"data: a\n\n# not a record start\n"
        b"\n--- curl: http=200\n"
        b"\n"
    )
    [exchange] = parse_capture(data)
    assert exchange.status == 200
    assert exchange.body == b"data: a\n\n# not a record start\n"


# --- Split and the reply plan (sans-IO) ----------------------------------------------


@pytest.mark.parametrize(
    "split",
    [
        Split.whole(),
        Split.every(5),
        Split.bytewise(),
        Split.at(3, 1, 3, 999, 0, -4),
        Split.random(1),
        Split.random(2, max_piece=3),
    ],
    ids=lambda s: f"{s.mode.value}",
)
def test_split_pieces_join_back(split: Split) -> None:
    pieces = split.pieces(BODY)
    assert b"".join(pieces) == BODY
    assert all(pieces)
    points = split.cut_points(len(BODY))
    assert points == sorted(set(points))
    assert all(0 < p < len(BODY) for p in points)


def test_split_modes() -> None:
    assert Split.whole().pieces(BODY) == [BODY]
    assert [len(p) for p in Split.every(16).pieces(BODY)] == [16, 16, 4]
    assert len(Split.bytewise().pieces(BODY)) == len(BODY)
    assert Split.at(4, 9).pieces(b"data: one") == [b"data", b": one"]
    assert Split.random(7).pieces(BODY) == Split.random(7).pieces(BODY)
    assert Split.random(7, max_piece=4).pieces(BODY) != Split.random(8, max_piece=4).pieces(BODY)
    assert max(len(p) for p in Split.random(3, max_piece=4).pieces(BODY)) <= 4
    assert Split.every(4).pieces(b"") == []


@pytest.mark.parametrize("bad", [lambda: Split.every(0), lambda: Split.random(1, max_piece=0)])
def test_split_rejects_empty_pieces(bad: object) -> None:
    with pytest.raises(ValueError, match=">= 1"):
        bad()  # type: ignore[operator]


def test_plan_cuts_exactly_at_stall_and_truncation() -> None:
    reply = Reply.sse(BODY, split=Split.every(8), stall_after_bytes=11, truncate_after_bytes=20)
    plan = reply.body_plan()
    assert plan == [
        Write(BODY[0:8]),
        Write(BODY[8:11]),
        Stall(float("inf")),
        Write(BODY[11:16]),
        Write(BODY[16:20]),
        Abort(reset=False),
    ]


def test_plan_pauses_only_between_writes_and_stalls_after_headers() -> None:
    reply = Reply.sse(b"abcdef", split=Split.every(3), delay_s=0.5, stall_after_headers=True)
    assert reply.body_plan() == [Stall(float("inf")), Write(b"abc"), Pause(0.5), Write(b"def")]
    assert Reply.sse(b"ab", truncate_after_bytes=0, reset=True).body_plan() == [Abort(reset=True)]
    assert Reply.sse(b"ab", stall_after_bytes=0, stall_s=1.0).body_plan() == [
        Stall(1.0),
        Write(b"ab"),
    ]


def test_reply_framing() -> None:
    sse = Reply.sse(BODY)
    assert sse.is_chunked
    assert ("transfer-encoding", "chunked") in sse.response_headers()
    js = Reply.json({"a": 1}, status=404)
    assert not js.is_chunked
    assert js.body == b'{"a":1}'
    assert ("content-length", "7") in js.response_headers()
    assert js.reason_phrase == "Not Found"
    assert Reply.json(b"raw").body == b"raw"
    forced = Reply.text("x", chunked=True, close_connection=True, reason="Nope")
    assert ("transfer-encoding", "chunked") in forced.response_headers()
    assert ("connection", "close") in forced.response_headers()
    assert forced.reason_phrase == "Nope"
    assert Reply(status=599).reason_phrase == ""


# --- raw client helpers ------------------------------------------------------------


def _request(path: str = CHAT_COMPLETIONS_PATH, body: bytes = b"{}") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _read_until_closed(stream: trio.SocketStream) -> tuple[bytes, bool]:
    """Everything the server sends until it closes; True if it reset."""
    data = bytearray()
    try:
        while chunk := await stream.receive_some(65536):
            data += chunk
    except trio.BrokenResourceError:
        return bytes(data), True
    return bytes(data), False


def _dechunk(raw: bytes) -> tuple[list[bytes], bool]:
    """The chunks of a chunked body after the head, and whether it terminated."""
    _, _, rest = raw.partition(b"\r\n\r\n")
    chunks: list[bytes] = []
    while rest:
        size_line, sep, rest = rest.partition(b"\r\n")
        if not sep:
            break
        size = int(size_line, 16)
        if size == 0:
            return chunks, True
        if len(rest) < size + 2:
            chunks.append(rest[:size])
            break
        chunks.append(rest[:size])
        rest = rest[size + 2 :]
    return chunks, False


async def _raw_exchange(fb: FakeBackend, reply: Reply) -> tuple[bytes, bool]:
    fb.script(CHAT_COMPLETIONS_PATH, reply)
    stream = await trio.open_tcp_stream("127.0.0.1", fb.port)
    async with stream:
        # Connection: close, so a complete reply ends with the server's FIN.
        await stream.send_all(_request().replace(b"Host: test", b"Host: test\r\nConnection: close"))
        with trio.fail_after(NOTICE_S):
            return await _read_until_closed(stream)


# --- FakeBackend on real sockets ---------------------------------------------------


@pytest.mark.parametrize(
    ("split", "sizes"),
    [
        (Split.whole(), [len(BODY)]),
        (Split.every(10), [10, 10, 10, 6]),
        (Split.at(9), [9, len(BODY) - 9]),
        (Split.bytewise(), [1] * len(BODY)),
    ],
    ids=["whole", "every", "at", "bytewise"],
)
async def test_each_piece_is_one_chunk_on_the_wire(split: Split, sizes: list[int]) -> None:
    async with open_fake_backend() as fb:
        raw, reset = await _raw_exchange(fb, Reply.sse(BODY, split=split))
    assert not reset
    assert raw.startswith(b"HTTP/1.1 200 OK\r\n")
    chunks, terminated = _dechunk(raw)
    assert terminated
    assert [len(c) for c in chunks] == sizes
    assert b"".join(chunks) == BODY


async def test_random_split_is_seeded_on_the_wire() -> None:
    async with open_fake_backend() as fb:
        raw, _ = await _raw_exchange(fb, Reply.sse(BODY, split=Split.random(5, max_piece=7)))
    chunks, terminated = _dechunk(raw)
    assert terminated
    assert chunks == Split.random(5, max_piece=7).pieces(BODY)


async def test_non_stream_reply_has_content_length() -> None:
    async with open_fake_backend() as fb:
        raw, _ = await _raw_exchange(fb, Reply.json({"ok": True}, status=400))
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert b"content-length: 11" in head.lower()
    assert b"transfer-encoding" not in head.lower()
    assert body == b'{"ok":true}'


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
async def test_truncation_never_terminates_the_chunked_body(reset: bool) -> None:
    async with open_fake_backend() as fb:
        reply = Reply.sse(BODY, split=Split.every(4), truncate_after_bytes=14, reset=reset)
        raw, was_reset = await _raw_exchange(fb, reply)
        [conn] = fb.connections
    assert was_reset is reset
    chunks, terminated = _dechunk(raw)
    if not reset:  # after an RST the client may have lost what was in flight
        assert b"".join(chunks) == BODY[:14]
    assert not terminated
    assert conn.close_cause is CloseCause.SERVER_ABORT
    assert conn.body_bytes_sent == 14


async def test_httpx_sees_truncation_as_a_broken_body() -> None:
    async with open_fake_backend() as fb, httpx.AsyncClient() as client:
        fb.script(CHAT_COMPLETIONS_PATH, Reply.sse(BODY, truncate_after_bytes=14))
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post(fb.url + CHAT_COMPLETIONS_PATH, json={})
        fb.script(CHAT_COMPLETIONS_PATH, Reply.sse(BODY, truncate_after_bytes=14, reset=True))
        with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
            await client.post(fb.url + CHAT_COMPLETIONS_PATH, json={})


async def test_delay_paces_the_writes() -> None:
    async with open_fake_backend() as fb, httpx.AsyncClient() as client:
        fb.script(CHAT_COMPLETIONS_PATH, Reply.sse(BODY, split=Split.every(12), delay_s=0.02))
        started = trio.current_time()
        response = await client.post(fb.url + CHAT_COMPLETIONS_PATH, json={})
        elapsed = trio.current_time() - started
    assert response.content == BODY
    assert elapsed >= 2 * 0.02  # three writes, two pauses


async def test_finite_stall_resumes() -> None:
    async with open_fake_backend() as fb, httpx.AsyncClient() as client:
        fb.script(CHAT_COMPLETIONS_PATH, Reply.sse(BODY, stall_after_bytes=5, stall_s=0.03))
        started = trio.current_time()
        response = await client.post(fb.url + CHAT_COMPLETIONS_PATH, json={})
        assert trio.current_time() - started >= 0.03
    assert response.content == BODY


@pytest.mark.parametrize(
    "reply",
    [
        Reply.sse(BODY, stall_before_headers=True),
        Reply.sse(BODY, stall_after_headers=True),
        Reply.sse(BODY, stall_after_bytes=11),
    ],
    ids=["before-headers", "after-headers", "mid-body"],
)
async def test_stalled_server_notices_the_client_leaving(reply: Reply) -> None:
    async with open_fake_backend() as fb, httpx.AsyncClient() as client:
        fb.script(CHAT_COMPLETIONS_PATH, reply)
        with trio.move_on_after(0.05):
            async with client.stream("POST", fb.url + CHAT_COMPLETIONS_PATH, json={}) as r:
                async for _ in r.aiter_raw():
                    pass
        left_at = trio.current_time()
        conn = await fb.wait_client_closed(NOTICE_S)
    assert conn.closed_by_client
    assert conn.closed_in is ConnState.STALLED
    assert conn.closed_at is not None
    assert conn.closed_at - left_at < NOTICE_S


async def test_client_reset_is_told_apart_from_eof() -> None:
    async with open_fake_backend() as fb:
        # Stalled before anything is sent: no send of the server's can see the
        # RST first (see CloseCause), so the reader must.
        fb.script(CHAT_COMPLETIONS_PATH, Reply.sse(BODY, stall_before_headers=True))
        stream = await trio.open_tcp_stream("127.0.0.1", fb.port)
        await stream.send_all(_request())
        await fb.wait_requests(1, NOTICE_S)
        # SO_LINGER 0 makes close() send an RST instead of a FIN.
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()
        conn = await fb.wait_client_closed(NOTICE_S)
    assert conn.close_cause is CloseCause.CLIENT_RESET
    assert conn.closed_in is ConnState.STALLED


async def test_client_leaving_while_paused_or_blocked() -> None:
    # The reply is paced; the client reads a little, then goes away while the
    # server is between writes or sending.
    async with open_fake_backend() as fb, httpx.AsyncClient() as client:
        fb.script(CHAT_COMPLETIONS_PATH, Reply.sse(BODY * 50, split=Split.every(10), delay_s=0.01))
        async with client.stream("POST", fb.url + CHAT_COMPLETIONS_PATH, json={}) as r:
            async for _ in r.aiter_raw():
                break
        conn = await fb.wait_client_closed(NOTICE_S)
    assert conn.closed_in in (ConnState.PAUSED, ConnState.SENDING)


async def test_requests_are_recorded_and_keep_alive_is_served() -> None:
    async with open_fake_backend() as fb:
        fb.script(CHAT_COMPLETIONS_PATH, Reply.sse(BODY), Reply.json({"n": 2}))
        fb.route(MODELS_PATH, Reply.json({"object": "list", "data": []}))
        assert fb.pending(CHAT_COMPLETIONS_PATH) == 2
        async with httpx.AsyncClient(headers={"Authorization": "Bearer k"}) as client:
            first = await client.post(fb.url + CHAT_COMPLETIONS_PATH, json={"model": "m"})
            second = await client.post(fb.url + CHAT_COMPLETIONS_PATH + "?x=1", json=[1])
            third = await client.post(fb.url + CHAT_COMPLETIONS_PATH, content=b"")
            models = [await client.get(fb.url + MODELS_PATH) for _ in range(2)]
    assert first.content == BODY
    assert second.json() == {"n": 2}
    assert third.status_code == 404
    assert "no reply scripted for POST /v1/chat/completions" in third.json()["error"]["message"]
    assert [m.json()["object"] for m in models] == ["list", "list"]
    req = fb.requests[0]
    assert (req.method, req.path, req.json) == ("POST", CHAT_COMPLETIONS_PATH, {"model": "m"})
    assert req.header("AUTHORIZATION") == "Bearer k"
    assert req.header_values("content-type") == ["application/json"]
    assert req.header("x-missing") is None
    assert fb.requests[1].target == CHAT_COMPLETIONS_PATH + "?x=1"
    assert fb.requests[1].path == CHAT_COMPLETIONS_PATH
    assert fb.requests[2].json is None
    assert fb.requests[3].method == "GET"
    # One keep-alive connection served all five requests.
    assert len(fb.connections) == 1
    assert {r.connection for r in fb.requests} == {fb.connections[0]}


async def test_handlers_see_the_request() -> None:
    def echo(request: iop.testing.RecordedRequest) -> Reply:
        return Reply.json({"you_sent": request.json})

    async with open_fake_backend() as fb, httpx.AsyncClient() as client:
        fb.route(CHAT_COMPLETIONS_PATH, echo)
        response = await client.post(fb.url + CHAT_COMPLETIONS_PATH, json={"a": [1]})
    assert response.json() == {"you_sent": {"a": [1]}}


async def test_close_connection_reply_closes_after_it() -> None:
    async with open_fake_backend() as fb:
        # A raw client that keeps its socket open: only the server can close.
        fb.script(CHAT_COMPLETIONS_PATH, Reply.json({"a": 1}, close_connection=True))
        stream = await trio.open_tcp_stream("127.0.0.1", fb.port)
        async with stream:
            await stream.send_all(_request())
            with trio.fail_after(NOTICE_S):
                raw, reset = await _read_until_closed(stream)
            conn = await fb.wait_connection_closed(NOTICE_S)
            with pytest.raises(AssertionError, match="not by the client"):
                await fb.wait_client_closed(NOTICE_S)
    assert raw.endswith(b'{"a":1}')
    assert b"connection: close" in raw.lower()
    assert not reset
    assert conn.close_cause is CloseCause.SERVER_CLOSE
    assert conn.closed_in is ConnState.IDLE


async def test_connect_failure_resets_before_any_response() -> None:
    async with open_fake_backend() as fb, httpx.AsyncClient() as client:
        fb.script(CHAT_COMPLETIONS_PATH, ConnectFailure())
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            await client.post(fb.url + CHAT_COMPLETIONS_PATH, json={})
    assert fb.connections[0].close_cause is CloseCause.SERVER_ABORT


async def test_garbage_request_closes_the_connection() -> None:
    async with open_fake_backend() as fb:
        stream = await trio.open_tcp_stream("127.0.0.1", fb.port)
        async with stream:
            await stream.send_all(b"NOT HTTP AT ALL\r\n\r\n")
            with trio.fail_after(NOTICE_S):
                await _read_until_closed(stream)
        [conn] = fb.connections
        assert conn.protocol_error
        assert conn.close_cause is CloseCause.SERVER_CLOSE
    assert fb.requests == []


async def test_waits_time_out() -> None:
    async with open_fake_backend() as fb:
        with pytest.raises(trio.TooSlowError):
            await fb.wait_requests(1, 0.01)
        with pytest.raises(trio.TooSlowError):
            await fb.wait_client_closed(0.01)


async def test_lifecycle_in_a_callers_nursery() -> None:
    async with trio.open_nursery() as nursery:
        async with open_fake_backend(nursery) as fb:
            assert fb.url == f"http://127.0.0.1:{fb.port}"
            fb.script(CHAT_COMPLETIONS_PATH, Reply.sse(BODY, stall_before_headers=True))
            stream = await trio.open_tcp_stream("127.0.0.1", fb.port)
            await stream.send_all(_request())
            await fb.wait_requests(1, NOTICE_S)
        # Closed while its client still waited: the server ended it.
        [conn] = fb.connections
        assert conn.close_cause is CloseCause.SHUTDOWN
        assert conn.closed_in is ConnState.STALLED
        await fb.aclose()  # idempotent
        with pytest.raises(RuntimeError, match="only once"):
            await nursery.start(fb.serve)
        data, _ = await _read_until_closed(stream)
        assert data == b""
        await stream.aclose()


async def test_unstarted_backend() -> None:
    fb = FakeBackend()
    with pytest.raises(RuntimeError, match="not serving"):
        _ = fb.url
    await fb.aclose()
    await fb.aclose()


# --- FakeTransport (in memory, virtual time) ----------------------------------------


async def test_fake_transport_plays_scripts(autojump_clock: trio.testing.MockClock) -> None:
    transport = FakeTransport()
    transport.script(
        CHAT_COMPLETIONS_PATH,
        Reply.sse(BODY, split=Split.every(7), delay_s=1.0),
        ConnectFailure(),
        Reply.sse(BODY, truncate_after_bytes=5),
        Reply.sse(BODY, truncate_after_bytes=5, reset=True),
        Reply.sse(BODY, stall_before_headers=True, stall_s=30.0),
    )
    transport.route(MODELS_PATH, Reply.json({"data": []}, status=503))
    url = "http://backend" + CHAT_COMPLETIONS_PATH
    async with httpx.AsyncClient(transport=transport) as client:
        started = trio.current_time()
        async with client.stream("POST", url, json={"a": 1}) as response:
            pieces = [p async for p in response.aiter_raw()]
        assert pieces == Split.every(7).pieces(BODY)
        assert trio.current_time() - started == pytest.approx(len(pieces) - 1)
        with pytest.raises(httpx.ConnectError, match="refused"):
            await client.post(url, json={})
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post(url, json={})
        with pytest.raises(httpx.ReadError):
            await client.post(url, json={})
        started = trio.current_time()
        assert (await client.post(url, json={})).content == BODY
        assert trio.current_time() - started == pytest.approx(30.0)
        models = await client.get("http://backend" + MODELS_PATH)
        assert (models.status_code, models.reason_phrase) == (503, "Service Unavailable")
    assert [r.json for r in transport.requests[:2]] == [{"a": 1}, {}]
    assert transport.requests[0].connection is None


async def test_fake_transport_stall_is_cancellable(autojump_clock: trio.testing.MockClock) -> None:
    transport = FakeTransport()
    transport.script(CHAT_COMPLETIONS_PATH, Reply.sse(BODY, stall_after_bytes=4))
    async with httpx.AsyncClient(transport=transport) as client:
        with trio.move_on_after(100) as scope:
            async with client.stream("POST", "http://b" + CHAT_COMPLETIONS_PATH) as response:
                async for _ in response.aiter_raw():
                    pass
    assert scope.cancelled_caught


def test_reply_is_a_frozen_struct() -> None:
    reply = Reply.sse(BODY)
    with pytest.raises(AttributeError):
        reply.status = 500  # type: ignore[misc]
    assert msgspec.structs.replace(reply, status=500).status == 500
