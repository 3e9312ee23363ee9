"""Hostile HTTP input against the edge on a real socket: bodies, content types,
framing (smuggling, header size) and slow bodies. Every answer is a 4xx in
OpenAI's error body; raw sockets check what reaches the wire and that the
connection is closed when it must be."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess

import pytest
import trio

from iop.api import ChatSurface
from iop.config import EdgeServer
from tests.api.chat.test_request import TOO_DEEP_BODIES
from tests.edge._openai_schema import validate_error
from tests.edge.test_app import CHAT, answer, config, edge, sse_objects

pytestmark = pytest.mark.timeout(60)

JSON = {"content-type": "application/json"}


def _chat(**fields: object) -> bytes:
    return json.dumps({**CHAT, **fields}).encode()


HOSTILE = [
    *((f"deep {where}", raw, None) for where, raw in sorted(TOO_DEEP_BODIES.items())),
    ("invalid utf-8", _chat().replace(b'"hi"', b'"h\xff\xfei"'), None),
    ("seed below int64", _chat(seed=-(2**63) - 1), "seed"),
    ("max_tokens 2**90", _chat(max_tokens=2**90), "max_tokens"),
    ("huge int in an unknown key", _chat(zz={"a": [2**70]}), "zz.a[0]"),
    ("temperature 99", _chat(temperature=99), "temperature"),
    ("top_p 5", _chat(top_p=5), "top_p"),
    ("logit_bias 500", _chat(logit_bias={"7": 500}), "logit_bias.7"),
]


@pytest.mark.parametrize(
    ("raw", "param"), [(r, p) for _, r, p in HOSTILE], ids=[n for n, _, _ in HOSTILE]
)
async def test_hostile_bodies_are_a_400_in_openais_body(raw: bytes, param: str | None) -> None:
    async with edge() as (_, _, client):
        resp = await client.post("/v1/chat/completions", content=raw, headers=JSON)
        assert resp.status_code == 400, resp.text
        obj = resp.json()
        validate_error(obj)
        assert obj["error"]["type"] == "invalid_request_error"
        if param is not None:
            assert obj["error"]["param"] == param


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
async def test_a_body_that_is_not_json_is_a_415(content_type: str) -> None:
    async with edge() as (_, node, client):
        assert node is not None
        resp = await client.post(
            "/v1/chat/completions", content=_chat(), headers={"content-type": content_type}
        )
        assert resp.status_code == 415
        obj = resp.json()
        validate_error(obj)
        assert obj["error"]["code"] == "unsupported_media_type"
        assert "application/json" in obj["error"]["message"]
        assert node.assigned == []


@pytest.mark.parametrize(
    "headers",
    [
        {},  # no Content-Type at all: read as JSON
        {"content-type": "application/json; charset=utf-8"},
        {"content-type": "Application/JSON"},
        {"content-type": "application/vnd.api+json"},
    ],
)
async def test_json_content_types_and_none_are_served(headers: dict[str, str]) -> None:
    from iop.events import Complete, Delta, Start
    from tests.edge.test_app import answer

    async with edge() as (_, node, client), trio.open_nursery() as n:
        assert node is not None
        n.start_soon(answer, node, Start(), Delta("ok"), Complete())
        resp = await client.post("/v1/chat/completions", content=_chat(), headers=headers)
        assert resp.status_code == 200, resp.text


async def _raw_exchange(url: str, data: bytes, *, pause_s: float = 0.0) -> bytes:
    """Send ``data`` on a fresh connection and read until the edge closes it."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(data)
        got = b""
        with trio.fail_after(20):
            while chunk := await stream.receive_some(65536):
                got += chunk
        return got


def _responses(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The HTTP/1.1 responses in ``raw`` (Content-Length framed)."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in lines[1:])}
        size = int(headers.get("content-length", "0"))
        out.append((status, headers, rest[:size]))
        raw = rest[size:]
    return out


async def _first_read(url: str, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; the first bytes that come back."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(data)
        with trio.fail_after(20):
            return await stream.receive_some(65536)


async def test_the_response_head_goes_out_with_the_body() -> None:
    # One write, not two (iop/edge/server/_http1.py): the head alone would be the first read.
    async with edge(with_node=False) as (handle, _, _):
        got = await _first_read(handle.url, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    [(status, _, body)] = _responses(got)
    assert (status, body) == (200, b'{"status":"ok"}')


async def test_a_stream_head_goes_out_with_its_first_chunk() -> None:
    from iop.events import Complete, Delta, Start

    async with edge() as (handle, node, _), trio.open_nursery() as n:
        assert node is not None
        n.start_soon(answer, node, Start(), Delta("ok"), Complete())
        got = await _first_read(
            handle.url,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\n\r\n" % len(_chat(stream=True)) + _chat(stream=True),
        )
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"text/event-stream" in head
    assert b"data: {" in body


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every write the edge makes to a client's socket, as the kernel took it."""
    from iop.edge.server import _stall

    got: list[bytes] = []
    real = _stall._write_now

    def record(sock: trio.socket.SocketType, view: memoryview) -> int:
        n = real(sock, view)
        got.append(bytes(view[:n]))
        return n

    monkeypatch.setattr(_stall, "_write_now", record)
    return got


def _post_closing(body: bytes) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )


async def test_a_stream_opens_with_its_first_chunk_and_ends_with_its_last(
    writes: list[bytes],
) -> None:
    # iop/edge/routes/_surfaces.py _sse_body and iop/edge/server/_http1.py: the head, the opening
    # chunk and the first output in one write; the last events and the chunked
    # terminator in one write (it was 4 writes: head and opening, first chunk,
    # last chunk, terminator).
    from iop.events import Complete, Delta, Start

    async with edge() as (handle, node, _), trio.open_nursery() as n:
        assert node is not None
        n.start_soon(answer, node, Start(), Delta("ok"), Complete())
        got = await _raw_exchange(handle.url, _post_closing(_chat(stream=True)))
    assert b"".join(writes) == got
    assert len(writes) <= 2, writes
    assert writes[0].startswith(b"HTTP/1.1 200")
    assert b'"role":"assistant"' in writes[0]
    assert b'"content":"ok"' in writes[0]
    assert writes[-1].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    objects = sse_objects(h11_dechunk(got.partition(b"\r\n\r\n")[2]))
    assert objects[-1] == "[DONE]"
    assert [o["choices"][0]["delta"].get("content") for o in objects[:-1]] == ["", "ok", None]  # type: ignore[index]


async def test_a_json_answer_is_one_write(writes: list[bytes]) -> None:
    from iop.events import Complete, Delta, Start

    async with edge() as (handle, node, _), trio.open_nursery() as n:
        assert node is not None
        n.start_soon(answer, node, Start(), Delta("ok"), Complete())
        got = await _raw_exchange(handle.url, _post_closing(_chat()))
    assert writes == [got]
    [(status, _, body)] = _responses(got)
    assert status == 200
    assert json.loads(body)["choices"][0]["message"]["content"] == "ok"


def _head(raw: bytes) -> tuple[str, list[str]]:
    """The status line and the header lines of a response, in order, but ``date``."""
    status, *lines = raw.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    return status, [h for h in lines if not h.lower().startswith("date:")]


async def test_the_heads_of_a_stream_a_json_answer_and_an_early_error() -> None:
    # Every header the surface routes send, and their order, as quart sent them
    # when it built each answer (iop/edge/routes/_surfaces.py builds them itself).
    from iop.errors import ErrorCode
    from iop.events import Complete, Delta, Error, Start

    async with edge() as (handle, node, _):
        assert node is not None
        heads = []
        for body, events in [
            (_chat(stream=True), (Start(), Delta("ok"), Complete())),
            (_chat(), (Start(), Delta("ok"), Complete())),
            (
                _chat(stream=True),
                (Start(), Error(message="busy", status=429, code=ErrorCode.RATE_LIMIT_EXCEEDED)),
            ),
        ]:
            async with trio.open_nursery() as n:
                n.start_soon(answer, node, *events)
                heads.append(_head(await _raw_exchange(handle.url, _post_closing(body))))
    stream, collected, early = heads
    assert stream == (
        "HTTP/1.1 200 ",
        [
            "content-type: text/event-stream",
            "cache-control: no-cache",
            "x-accel-buffering: no",
            "server: hypercorn-h11",
            "Transfer-Encoding: chunked",
            "Connection: close",
        ],
    )
    assert collected[0] == "HTTP/1.1 200 "
    assert collected[1][:1] == ["content-type: application/json"]
    assert collected[1][1].startswith("content-length: ")
    assert collected[1][2:] == ["server: hypercorn-h11", "Connection: close"]
    assert early[0] == "HTTP/1.1 429 "
    assert early[1][:2] == ["retry-after: 1", "content-type: application/json"]
    assert early[1][2].startswith("content-length: ")
    assert early[1][3:] == ["server: hypercorn-h11", "Connection: close"]


@pytest.mark.parametrize("stream", [True, False])
async def test_a_surface_path_with_a_doubled_slash_is_answered_as_the_path(stream: bool) -> None:
    # Quart's routing (werkzeug merges the slashes) matches a path the surface
    # layer does not (iop/edge/server/_surface_asgi.py): it is the same answer.
    from iop.events import Complete, Delta, Start

    async with edge() as (handle, node, client), trio.open_nursery() as n:
        assert node is not None
        n.start_soon(answer, node, Start(), Delta("ok"), Complete())
        resp = await client.post(
            handle.url + "//v1/chat/completions", json={**CHAT, "stream": stream}
        )
    assert resp.status_code == 200, resp.text
    if stream:
        assert resp.headers["content-type"] == "text/event-stream"
        assert sse_objects(resp.content)[-1] == "[DONE]"
    else:
        assert resp.json()["choices"][0]["message"]["content"] == "ok"


def h11_dechunk(chunked: bytes) -> bytes:
    """The payload of a chunked body (every chunk, up to the terminator)."""
    out = b""
    while True:
        size_line, _, rest = chunked.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert rest == b"\r\n"
            return out
        out += rest[:size]
        assert rest[size : size + 2] == b"\r\n"
        chunked = rest[size + 2 :]


async def test_content_length_with_chunked_is_refused_and_the_connection_closed() -> None:
    # The first request's chunked body ends at once; what a proxy would count
    # as its Content-Length body is a second request, which must never run.
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    data = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        % (5 + len(smuggled))
        + smuggled
    )
    async with edge(config(api_keys=["k"])) as (handle, _, _):
        got = await _raw_exchange(handle.url, data)
    responses = _responses(got)
    assert len(responses) == 1, got  # then EOF: the smuggled request was not read
    status, headers, body = responses[0]
    assert status == 400
    assert headers["connection"] == "close"
    obj = json.loads(body)
    validate_error(obj)
    assert "Transfer-Encoding" in obj["error"]["message"]


async def test_an_http2_preface_in_clear_text_is_a_505_and_the_connection_closed() -> None:
    # HTTP/2 with prior knowledge (RFC 9113 section 3.3): hypercorn would
    # switch to its HTTP/2 code, which has none of the edge's HTTP/1 guards
    # (header size, smuggling, stalls). The edge serves HTTP/1.1 only.
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    settings = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty SETTINGS frame
    async with edge(config(api_keys=["k"])) as (handle, _, _):
        got = await _raw_exchange(handle.url, preface + settings)
    [(status, headers, body)] = _responses(got)
    assert status == 505
    assert headers["connection"] == "close"
    obj = json.loads(body)
    validate_error(obj)
    assert obj["error"]["code"] == "http_version_not_supported"
    assert "HTTP/1.1" in obj["error"]["message"]


async def test_an_h2c_upgrade_is_ignored_and_the_request_served_in_http1() -> None:
    # RFC 9110 section 7.8: a server may ignore Upgrade. Switching would take
    # the connection out of the edge's HTTP/1 guards; a 431 for a too-large
    # head must still come in HTTP/1.1 after the upgrade was asked for.
    upgrade = (
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings, close\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n\r\n"
    )
    async with edge(config(api_keys=["k"])) as (handle, _, _):
        got = await _raw_exchange(handle.url, upgrade)
    assert got.startswith(b"HTTP/1.1 200 "), got[:200]
    assert b" 101 " not in got.split(b"\r\n", 1)[0]


@pytest.mark.parametrize("split", [False, True], ids=["one read", "incomplete head"])
async def test_too_large_headers_are_a_431_in_openais_body(split: bool) -> None:
    limit = 4096
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * limit + b"\r\n"
    async with edge(config(max_header_bytes=limit)) as (handle, _, _):
        # Split: the head never completes, h11 refuses it past the limit.
        got = await _raw_exchange(handle.url, head if split else head + b"\r\n")
        fine = await _raw_exchange(
            handle.url, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
    [(status, headers, body)] = _responses(got)
    assert status == 431
    assert headers["connection"] == "close"
    obj = json.loads(body)
    validate_error(obj)
    assert obj["error"]["code"] == "request_header_fields_too_large"
    assert str(limit) in obj["error"]["message"]
    assert _responses(fine)[0][0] == 200


async def test_a_too_large_body_is_a_413_and_the_connection_closed() -> None:
    async with edge(config(max_body_bytes=1000)) as (handle, _, _):
        got = await _raw_exchange(
            handle.url,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 99999999\r\n\r\n{",
        )
    [(status, headers, body)] = _responses(got)  # and then EOF, the body unread
    assert status == 413
    assert headers["connection"] == "close"
    validate_error(json.loads(body))


async def test_a_chunked_body_over_the_limit_is_a_413_and_the_connection_closed() -> None:
    # No Content-Length to refuse it by: the bytes pass the limit as they arrive.
    chunk = b"x" * 600
    data = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 2
    )
    async with edge(config(max_body_bytes=1000)) as (handle, node, _):
        assert node is not None
        got = await _raw_exchange(handle.url, data)
        assert node.assigned == []
    [(status, headers, body)] = _responses(got)  # and then EOF
    assert status == 413
    assert headers["connection"] == "close"
    validate_error(json.loads(body))


async def test_many_small_headers_count_against_the_same_limit() -> None:
    limit = 4096
    pads = b"".join(b"X-%d: y\r\n" % i for i in range(1000))
    async with edge(config(max_header_bytes=limit)) as (handle, _, _):
        got = await _raw_exchange(
            handle.url, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + pads + b"\r\n"
        )
    [(status, _, body)] = _responses(got)
    assert status == 431
    validate_error(json.loads(body))


async def test_a_head_that_never_ends_is_closed_after_keep_alive_timeout_s() -> None:
    async with edge(config(keep_alive_timeout_s=0.5)) as (handle, _, _):
        host, port = handle.url.removeprefix("http://").rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            # Half a request head, then nothing: a slow-loris client.
            await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            # 6x the limit, and below hypercorn's own 5 s default: this fails
            # if the key is not what the edge applies.
            with trio.fail_after(3):
                assert await _receive_or_eof(stream) == b""


async def test_an_idle_connection_after_a_get_is_closed_after_keep_alive_timeout_s() -> None:
    """After a response from a quart route, hypercorn restarts the idle timer
    from the app's task while quart-trio cancels that task's nursery (on the
    ``http.disconnect`` that ends the stream): the timer died at birth and an
    idle keep-alive connection stayed open for good (iop/edge/server/_http1.py)."""
    async with edge(config(keep_alive_timeout_s=0.5)) as (handle, _, _):
        host, port = handle.url.removeprefix("http://").rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            with trio.fail_after(3):  # 6x the limit, a hang without the fix
                head = await _receive_or_eof(stream)
                assert head.startswith(b"HTTP/1.1 200")
                while await _receive_or_eof(stream):
                    pass


async def test_a_connection_the_client_closes_is_released_at_once() -> None:
    """A client that closes its keep-alive connection after an answer takes
    its handler with it: hypercorn's reader sees the EOF, but its task group
    used to wait for the idle timer, so the socket and two tasks stayed for
    ``keep_alive_timeout_s`` after the client left (iop/edge/server/_http1.py)."""
    from iop.events import Complete, Delta, Start

    async with edge(config(keep_alive_timeout_s=30)) as (handle, node, _):
        assert node is not None
        assert _connection_handlers() == 0
        host, port = handle.url.removeprefix("http://").rsplit(":", 1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer, node, Start(), Delta("hi"), Complete())
            stream = await trio.open_tcp_stream(host, int(port))
            body = _chat()
            await stream.send_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            with trio.fail_after(10):
                assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200")
        await stream.aclose()
        # Its handler ends once the edge reads the EOF, well before the 30 s timer.
        with trio.fail_after(3):
            while _connection_handlers():
                await trio.sleep(0.01)


def _connection_handlers() -> int:
    """Tasks serving an accepted connection (trio's ``serve_listeners`` names them)."""
    root = trio.lowlevel.current_root_task()
    todo = [] if root is None else [root]
    count = 0
    while todo:
        task = todo.pop()
        count += task.name.endswith("._run_handler")
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return count


async def test_a_dribbled_body_gets_408_and_the_connection_is_closed() -> None:
    async with edge(config(body_read_timeout_s=0.5)) as (handle, node, _):
        assert node is not None
        host, port = handle.url.removeprefix("http://").rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            body = _chat()
            await stream.send_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            )
            got = b""
            with trio.fail_after(20):
                # Keep dribbling one byte at a time, as a slow-loris client
                # does, until the edge hangs up; then read what it said.
                for byte in body:
                    try:
                        await stream.send_all(bytes([byte]))
                    except trio.BrokenResourceError:
                        break
                    with trio.move_on_after(0.2):
                        chunk = await stream.receive_some(65536)
                        if not chunk:
                            break
                        got += chunk
                else:
                    pytest.fail(f"the edge read the whole dribbled body; got {got!r}")
                while chunk := await _receive_or_eof(stream):
                    got += chunk
        [(status, headers, raw)] = _responses(got)
        assert status == 408
        assert headers["connection"] == "close"
        validate_error(json.loads(raw))
        assert node.assigned == []


async def _receive_or_eof(stream: trio.SocketStream) -> bytes:
    try:
        return await stream.receive_some(65536)
    except trio.BrokenResourceError:  # reset after close: as good as EOF
        return b""


@pytest.mark.parametrize(
    ("name", "headers"),
    [
        ("415", b"Authorization: Bearer k\r\nContent-Type: text/plain\r\n"),
        ("401", b"Content-Type: application/json\r\n"),
    ],
)
async def test_an_answer_sent_before_the_body_arrived_says_the_connection_closes(
    name: str, headers: bytes
) -> None:
    """An error answered before the request's body is in (the client sent its
    head, its body is still on the way) ends the connection, since the body
    is not read: the head must say ``connection: close`` (RFC 9112 section
    9.6), or a client reuses the connection and its next request finds it
    closed ("Server disconnected without sending a response": how
    ``test_every_error_the_edge_sends_is_openais_error_response`` failed now
    and then, when httpx's head and body went out in two segments)."""
    body = _chat()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        + headers
        + b"Content-Length: %d\r\n\r\n" % len(body)
    )
    async with edge(config(api_keys=["k"])) as (handle, _, _):
        host, port = handle.url.removeprefix("http://").rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(head)
            got = b""
            with trio.fail_after(20):
                while b"\r\n\r\n" not in got:
                    got += await stream.receive_some(65536)
            with contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(body)
            with trio.fail_after(20):
                while chunk := await stream.receive_some(65536):
                    got += chunk
    [(status, response_headers, _)] = _responses(got)
    assert status == int(name)
    assert response_headers.get("connection") == "close"


async def test_every_error_the_edge_sends_is_openais_error_response(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One of each error the edge can answer, each validated against OpenAI's
    ``ErrorResponse`` schema (tests/data/openai-chat-schemas.json)."""
    from iop.events import Error as RunError
    from tests.edge.test_app import answer

    got: dict[str, tuple[int, bytes]] = {}
    key = {"authorization": "Bearer k", **JSON}
    cfg = config(
        api_keys=["k"],
        admin_keys=["admin"],
        max_body_bytes=2000,
        max_header_bytes=4096,
        body_read_timeout_s=0.5,
    )
    async with edge(cfg) as (handle, node, client), trio.open_nursery() as nursery:
        assert node is not None

        async def post(name: str, content: bytes, headers: dict[str, str] = key) -> None:
            resp = await client.post("/v1/chat/completions", content=content, headers=headers)
            got[name] = (resp.status_code, resp.content)

        await post("400 invalid json", b"{")
        await post("400 out of range", _chat(temperature=3))
        await post("401", _chat(), JSON)
        await post("404 model", json.dumps({**CHAT, "model": "nope"}).encode())
        await post("413", b"x" * 5000)
        await post("415", _chat(), {**key, "content-type": "text/plain"})
        resp = await client.get("/v1/nope")
        got["404 route"] = (resp.status_code, resp.content)
        resp = await client.get("/v1/chat/completions")
        got["405"] = (resp.status_code, resp.content)

        # The backend's refusal before any output keeps its status (early failure).
        nursery.start_soon(
            answer, node, RunError(message="context too long", status=400, code="bad")
        )
        await post("400 from the backend", _chat())

        # 429: the only slot busy, the queue (max_queue=1) full.
        nursery.start_soon(post, "held", _chat())
        held = await node.assigns.receive()
        nursery.start_soon(post, "queued", _chat())
        with trio.fail_after(5):
            admin = {"authorization": "Bearer admin"}
            while not (await client.get("/admin/nodes", headers=admin)).json()["queued"]:
                await trio.sleep(0.01)
        await post("429", _chat())
        await node.send(
            held.assign.run_id, RunError(message="boom", status=502, code="backend_error")
        )
        queued = await node.assigns.receive()
        await node.send(queued.assign.run_id, RunError(message="timeout", status=504, code="t"))

        # Framing errors, answered below the app.
        for name, raw in {
            "400 smuggling": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            "400 malformed": b"NOT HTTP AT ALL\r\n\r\n",
            "431": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 5000 + b"\r\n\r\n",
            "408": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{",
        }.items():
            [(status, _, body)] = _responses(await _raw_exchange(handle.url, raw))
            got[name] = (status, body)

        # The 500 handler: a bug in the request path.
        def broken(*_: object, **__: object) -> None:
            raise RuntimeError("a bug")

        monkeypatch.setattr(ChatSurface, "parse", broken)
        await post("500", _chat())
        monkeypatch.undo()
        nursery.cancel_scope.cancel()

    async with edge(with_node=False) as (_, _, client):
        resp = await client.post("/v1/chat/completions", content=_chat(), headers=JSON)
        got["503"] = (resp.status_code, resp.content)

    statuses = {name: status for name, (status, _) in got.items()}
    assert statuses == {
        "400 invalid json": 400,
        "400 out of range": 400,
        "401": 401,
        "404 model": 404,
        "413": 413,
        "415": 415,
        "404 route": 404,
        "405": 405,
        "400 from the backend": 400,
        "held": 502,
        "queued": 504,
        "429": 429,
        "400 smuggling": 400,
        "400 malformed": 400,
        "431": 431,
        "408": 408,
        "500": 500,
        "503": 503,
    }
    for name, (_, body) in got.items():
        try:
            validate_error(json.loads(body))
        except Exception as exc:
            raise AssertionError(f"{name}: {body!r}") from exc


@pytest.mark.parametrize(
    ("path", "head"),
    [
        ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]'),
        ("/v1/responses", b'{"model": "m", "input": "hi"'),
        ("/v1/messages", b'{"model": "m", "max_tokens": 8, "messages": []'),
        ("/v1/messages/count_tokens", b'{"model": "m", "messages": []'),
        ("/v1/completions", b'{"model": "m", "prompt": "hi"'),
        ("/v1/embeddings", b'{"model": "m", "input": "hi"'),
    ],
)
async def test_server_max_json_depth_is_the_limit_every_surface_applies(
    path: str, head: bytes
) -> None:
    nested = head + b', "zz": [[[[1]]]]}'  # depth 5
    async with edge(config(max_json_depth=4)) as (_, _, client):
        resp = await client.post(path, content=nested, headers=JSON)
    assert resp.status_code == 400
    error = resp.json()["error"]
    if path.startswith("/v1/messages"):
        assert error["type"] == "invalid_request_error"
    else:
        assert error["code"] == "json_too_deep"
    assert "more than 4 levels" in error["message"]


@pytest.mark.parametrize(
    "bad",
    [
        {"max_json_depth": 0},
        {"max_json_depth": 257},
        {"max_header_bytes": 100},
        {"body_read_timeout_s": 0},
        {"keep_alive_timeout_s": 0},
    ],
)
def test_http_input_limits_refuse_nonsense_values(bad: dict[str, object]) -> None:
    import msgspec

    from iop.config import EdgeServer

    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(bad, EdgeServer)


async def test_count_tokens_estimates_and_says_so_when_no_instance_tokenizes() -> None:
    # The test node's instance serves chat only: no tokenize run is possible.
    async with edge() as (_, _, client):
        resp = await client.post(
            "/v1/messages/count_tokens",
            json={"model": "m", "messages": [{"role": "user", "content": "hello there"}]},
        )
    assert resp.status_code == 200
    assert resp.headers["x-iop-token-count"] == "estimated"
    assert resp.json()["input_tokens"] > 0


def _listen_backlog(port: int) -> int:
    """The backlog of the listening socket on ``port``, as the kernel holds it
    (``ss``: a listener's Send-Q is its backlog)."""
    out = subprocess.run(
        ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout.split()
    return int(out[2])


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
@pytest.mark.parametrize(("backlog", "expected"), [(None, 1024), (7, 7)])
async def test_the_listener_holds_server_listen_backlog_connections(
    backlog: int | None, expected: int
) -> None:
    """hypercorn's own backlog (100) reset connections opened at once by a
    fleet of 1,024 streams (docs/benchmarks.md, "Frames paced on the node")."""
    cfg = config() if backlog is None else config(listen_backlog=backlog)
    async with edge(cfg) as (handle, _, _):
        port = int(handle.url.rsplit(":", 1)[1])
        assert _listen_backlog(port) == expected


def test_listen_backlog_is_bounded() -> None:
    with pytest.raises(ValueError, match="listen_backlog"):
        EdgeServer(listen_backlog=0)
    with pytest.raises(ValueError, match="listen_backlog"):
        EdgeServer(listen_backlog=65536)
