"""The edge leaves hypercorn as it found it (``iop/edge/server/_hypercorn.py``).

The edge's HTTP/1.1 guards, its app queue and its connection handling are
hypercorn subclasses that only the edge's own server builds: no name in any
of hypercorn's modules (nor any attribute of its classes) is replaced, so
another hypercorn server in the same process (``iop up``'s sim) is plain
hypercorn, and a hypercorn upgrade cannot route around the edge's classes by
building its own. Real sockets: the edge serves an answer, a stream and a
refusal first, so every class the edge uses has been built.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from functools import partial

import hypercorn.protocol
import hypercorn.protocol.h11
import hypercorn.trio.task_group
import hypercorn.trio.tcp_server
import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from iop.events import Complete, Delta, Start
from tests.edge.test_app import CHAT, answer, config, edge

pytestmark = pytest.mark.timeout(60)

# Identity of every value a hypercorn module or class holds, by dotted name.
Snapshot = dict[str, int]

BIG_HEAD = b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 5000 + b"\r\n\r\n"


def _hypercorn_namespaces() -> Iterator[tuple[str, dict[str, object]]]:
    for name, module in sorted(sys.modules.items()):
        if name != "hypercorn" and not name.startswith("hypercorn."):
            continue
        yield name, vars(module)
        for attr, value in vars(module).items():
            if isinstance(value, type) and value.__module__.startswith("hypercorn"):
                yield f"{name}.{attr}", dict(vars(value))


def snapshot() -> Snapshot:
    return {
        f"{where}.{key}": id(value)
        for where, namespace in _hypercorn_namespaces()
        for key, value in namespace.items()
        if key != "__warningregistry__"  # the warnings module's, not a replacement
    }


def changed(before: Snapshot, after: Snapshot) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


async def _exchange(url: str, data: bytes) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    async with await trio.open_tcp_stream(host, int(port)) as stream:
        await stream.send_all(data)
        got = b""
        with trio.fail_after(20):
            while chunk := await stream.receive_some(65536):
                got += chunk
        return got


async def test_serving_the_edge_replaces_nothing_in_hypercorn() -> None:
    before = snapshot()
    async with edge(config(max_header_bytes=4096)) as (handle, node, client):
        assert node is not None
        assert (await client.get("/healthz")).status_code == 200
        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer, node, Start(), Delta("ok"), Complete())
            async with client.stream(
                "POST", "/v1/chat/completions", json={**CHAT, "stream": True}
            ) as resp:
                assert resp.status_code == 200
                assert "[DONE]" in "".join([t async for t in resp.aiter_text()])
        refused = await _exchange(handle.url, BIG_HEAD)
        assert refused.startswith(b"HTTP/1.1 431")
        assert b"request_header_fields_too_large" in refused  # the edge's own answer
    assert changed(before, snapshot()) == []
    # Whatever ran before in this process: hypercorn builds its own classes.
    assert hypercorn.protocol.H11Protocol is hypercorn.protocol.h11.H11Protocol
    assert hypercorn.trio.tcp_server.TaskGroup is hypercorn.trio.task_group.TaskGroup
    assert hypercorn.trio.tcp_server.ProtocolWrapper is hypercorn.protocol.ProtocolWrapper


async def test_a_plain_hypercorn_beside_the_edge_answers_as_hypercorn() -> None:
    """``iop up`` runs the sim on hypercorn in the edge's process: its 431 is
    hypercorn's (an empty body), not the edge's, while the edge serves."""

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        raise AssertionError("a refused head never reaches the app")

    hc = HypercornConfig()
    hc.bind = ["127.0.0.1:0"]
    hc.h11_max_incomplete_size = 1024
    async with (
        edge(config(max_header_bytes=1024), with_node=False) as (handle, _, _),
        trio.open_nursery() as nursery,
    ):
        binds = await nursery.start(partial(serve, app, hc))
        plain = await _exchange(binds[0], BIG_HEAD[:2000])  # an incomplete head
        ours = await _exchange(handle.url, BIG_HEAD[:2000])
        nursery.cancel_scope.cancel()
    assert plain.startswith(b"HTTP/1.1 431")
    assert plain.endswith(b"\r\n\r\n")  # no body: hypercorn's own answer
    assert ours.startswith(b"HTTP/1.1 431")
    assert b"request_header_fields_too_large" in ours
