"""The WebSocket FrameChannel against a real loopback trio-websocket server (real time).

These tests use real sockets, so no virtual clock: every wait is bounded by
``fail_after``. ``gc.collect()`` at the end of a test makes a leaked socket
show up as a ``ResourceWarning`` (an error under ``filterwarnings=error``).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Awaitable, Callable
from functools import partial

import pytest
import trio
from trio_websocket import ConnectionClosed, WebSocketRequest, serve_websocket
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Request

from iop.config import NodeConfig, NodeEdge, NodeSection, SimConfig, SimInstance
from iop.errors import LinkError, LinkProtocolError
from iop.events import Complete, RuntimeEvent, Start, is_terminal
from iop.node import WebSocketFrameChannel, open_node_agent, open_ws_link
from iop.protocol import (
    CLOSE_BAD_TOKEN,
    CLOSE_GOING_AWAY,
    CLOSE_PROTOCOL,
    EdgeSession,
    LinkClosed,
    NodeJoined,
    RunEventsReceived,
)
from iop.spec import ChatRequest, ExecutionSpec, Message

Handler = Callable[[WebSocketRequest], Awaitable[None]]
DEADLINE_S = 10.0


async def start_server(nursery: trio.Nursery, handler: Handler) -> str:
    server = await nursery.start(partial(serve_websocket, handler, "127.0.0.1", 0, None))
    return f"ws://127.0.0.1:{server.port}/v1/link"


async def test_frames_round_trip_and_close_code_reaches_the_client() -> None:
    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept()
        await ws.send_message(await ws.get_message())
        await ws.aclose(CLOSE_BAD_TOKEN, "bad token")

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            url = await start_server(nursery, handler)
            async with open_ws_link(url) as chan:
                await chan.send(b"\x00frame\xff")
                assert await chan.receive() == b"\x00frame\xff"
                with pytest.raises(LinkClosed) as info:
                    await chan.receive()
                with pytest.raises(LinkClosed):
                    await chan.send(b"late")
            assert (info.value.close_code, info.value.reason) == (CLOSE_BAD_TOKEN, "bad token")
            nursery.cancel_scope.cancel()
    gc.collect()  # a leaked client socket would warn here


async def test_client_close_reaches_the_server_with_its_code() -> None:
    seen: list[tuple[int | None, str | None]] = []
    closed = trio.Event()

    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept()
        try:
            await ws.get_message()
        except Exception:
            reason = ws.closed
            seen.append((reason.code, reason.reason) if reason else (None, None))
        closed.set()

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            url = await start_server(nursery, handler)
            async with open_ws_link(url) as chan:
                await chan.aclose(CLOSE_GOING_AWAY, "node draining")
                await chan.aclose()  # idempotent
            await closed.wait()
            nursery.cancel_scope.cancel()
    assert seen == [(CLOSE_GOING_AWAY, "node draining")]
    gc.collect()


async def test_a_text_frame_is_a_protocol_error() -> None:
    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept()
        await ws.send_message("not binary")
        try:
            await ws.get_message()
        except Exception:
            closed_with.append(ws.closed.code if ws.closed else None)

    closed_with: list[int | None] = []
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            url = await start_server(nursery, handler)
            async with open_ws_link(url) as chan:
                with pytest.raises(LinkProtocolError, match="text frame"):
                    await chan.receive()
            await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    assert closed_with == [CLOSE_PROTOCOL]
    gc.collect()


async def test_connection_refused_names_the_url() -> None:
    with trio.socket.socket() as sock:  # a port nobody listens on
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"ws://127.0.0.1:{port}/v1/link"
    with trio.fail_after(DEADLINE_S), pytest.raises(LinkError, match=f"127.0.0.1:{port}"):
        async with open_ws_link(url):
            pytest.fail("connected to nothing")
    gc.collect()


async def test_node_agent_serves_a_run_over_a_real_websocket() -> None:
    """The whole node path on a real socket: dial, hello, assign, events, close."""
    received: list[RuntimeEvent] = []
    done = trio.Event()

    async def edge(request: WebSocketRequest) -> None:
        ws = await request.accept()
        session = EdgeSession(
            tokens=["t0k"],
            heartbeat_interval_s=0.5,
            heartbeat_timeout_s=5.0,
            now=trio.current_time(),
        )
        (joined,) = session.receive(await ws.get_message(), trio.current_time())  # type: ignore[arg-type]
        assert isinstance(joined, NodeJoined)
        await ws.send_message(session.welcome())
        spec = ExecutionSpec(
            run_id="r1",
            request=ChatRequest(model="iop-sim", messages=[Message(role="user", content="hi")]),
        )
        session.assign("r1", "sim", spec, credit=64)
        for frame in session.data_to_send(trio.current_time()):
            await ws.send_message(frame)
        while not received or not is_terminal(received[-1]):
            frame = await ws.get_message()
            for event in session.receive(frame, trio.current_time()):  # type: ignore[arg-type]
                if isinstance(event, RunEventsReceived):
                    received.extend(event.events)
        await ws.aclose(CLOSE_GOING_AWAY, "edge restarting")
        done.set()

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            url = await start_server(nursery, edge)
            cfg = NodeConfig(
                node=NodeSection(id="n1", edges=[NodeEdge(url=url, token="t0k")]),
                instances=[SimInstance(name="sim", sim=SimConfig(ttft_s=0.0, output_tokens=5))],
            )
            async with open_node_agent(cfg) as agent, trio.open_nursery() as node_nursery:
                await node_nursery.start(agent.serve)
                await done.wait()
                node_nursery.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
    assert isinstance(received[0], Start)
    assert isinstance(received[-1], Complete)
    gc.collect()


async def _tcp_server(
    nursery: trio.Nursery, handler: Callable[[trio.SocketStream], Awaitable[None]]
) -> str:
    (listener,) = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return f"ws://127.0.0.1:{listener.socket.getsockname()[1]}/v1/link"


async def test_an_edge_that_closes_during_the_upgrade_fails_at_once_not_at_the_timeout() -> None:
    async def close_at_once(stream: trio.SocketStream) -> None:
        await stream.receive_some()
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        url = await _tcp_server(nursery, close_at_once)
        # The connect timeout is the test's own deadline: failing by the
        # timeout would fail the test (the message differs too).
        with pytest.raises(LinkError, match="closed the connection during the upgrade") as info:
            async with open_ws_link(url, connect_timeout_s=DEADLINE_S):
                pass
        assert "dial it with wss://" in str(info.value)
        nursery.cancel_scope.cancel()
    gc.collect()


async def test_an_edge_that_never_answers_the_upgrade_times_out_by_name() -> None:
    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        url = await _tcp_server(nursery, silent)
        with pytest.raises(LinkError, match=r"no answer within 0\.2s"):
            async with open_ws_link(url, connect_timeout_s=0.2):
                pass
        nursery.cancel_scope.cancel()
    gc.collect()


class _Steps(trio.abc.Instrument):
    """Counts the times a task gave the CPU back (each schedule point it passed)."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.steps = 0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.steps += 1


async def _sink(request: WebSocketRequest) -> None:
    ws = await request.accept()
    with contextlib.suppress(ConnectionClosed):
        while True:
            await ws.get_message()


async def test_a_frame_the_kernel_takes_at_once_passes_no_schedule_point() -> None:
    """The link's writer sends one frame per paced token: through trio-websocket
    each passed two schedule points (its send lock's ``acquire``, a scheduler
    pass even when free, and trio's socket ``send``). The writer's own wait
    is its schedule point per round (``iop.runtime._link``)."""
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            url = await start_server(nursery, _sink)
            async with open_ws_link(url) as chan:
                await chan.send(b"first")
                steps = _Steps(trio.lowlevel.current_task())
                trio.lowlevel.add_instrument(steps)
                try:
                    for _ in range(10):
                        await chan.send(b"x" * 100)
                finally:
                    trio.lowlevel.remove_instrument(steps)
            nursery.cancel_scope.cancel()
    assert steps.steps == 0
    gc.collect()


async def test_a_ping_from_the_edge_is_answered_while_the_node_reads() -> None:
    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept()
        await ws.ping(b"are you there")  # returns once the pong came
        await ws.send_message(b"after the pong")
        with contextlib.suppress(ConnectionClosed):
            await ws.get_message()

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            url = await start_server(nursery, handler)
            async with open_ws_link(url) as chan:
                assert await chan.receive() == b"after the pong"
            nursery.cancel_scope.cancel()
    gc.collect()


async def test_a_message_over_the_limit_closes_the_link_with_1009() -> None:
    seen: list[int | None] = []

    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept()
        await ws.send_message(b"x" * 2000)
        try:
            await ws.get_message()
        except ConnectionClosed as exc:
            seen.append(None if exc.reason is None else exc.reason.code)

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            url = await start_server(nursery, handler)
            async with open_ws_link(url, max_message_size=1000) as chan:
                with pytest.raises(LinkClosed) as info:
                    await chan.receive()
                assert chan.closed
            assert info.value.close_code == 1009
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
    assert seen == [1009]
    gc.collect()


async def test_an_edge_gone_without_a_close_frame_is_1006_for_reads_and_writes() -> None:
    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept()
        await ws._stream.aclose()  # TCP closed, no close frame

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            url = await start_server(nursery, handler)
            async with open_ws_link(url) as chan:
                with pytest.raises(LinkClosed) as info:
                    await chan.receive()
                assert info.value.close_code == 1006
                with pytest.raises(LinkClosed) as sent:
                    await chan.send(b"late")
                assert sent.value.close_code == 1006
            nursery.cancel_scope.cancel()
    gc.collect()


async def _send_until_it_fails(chan: WebSocketFrameChannel) -> None:
    while True:  # until the kernel reports the edge gone
        await chan.send(b"x" * 65536)
        await trio.lowlevel.checkpoint()


async def test_a_write_that_fails_reports_the_edges_close_code() -> None:
    """The edge sent a close 4409 and hung up while the node was writing: the
    dialer must see 4409 (it backs off on it: ``iop.node._dial``), not the
    broken pipe."""

    async def edge(stream: trio.SocketStream) -> None:
        ws = WSConnection(ConnectionType.SERVER)
        while not any(isinstance(e, Request) for e in ws.events()):
            ws.receive_data(await stream.receive_some())
        await stream.send_all(ws.send(AcceptConnection()))
        await stream.send_all(ws.send(CloseConnection(code=4409, reason="replaced")))
        await stream.aclose()

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            url = await _tcp_server(nursery, edge)
            async with open_ws_link(url) as chan:
                with pytest.raises(LinkClosed) as info:
                    await _send_until_it_fails(chan)
            assert (info.value.close_code, info.value.reason) == (4409, "replaced")
            nursery.cancel_scope.cancel()
    gc.collect()
