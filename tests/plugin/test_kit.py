"""The plugin's parts in this process: faults, stream assertions, both platforms.

``test_plugin.py`` runs the plugin as a user does, in another process; here
the same parts are driven directly, including the ways each assertion must
fail (a test kit whose assertions cannot fail tests nothing).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import trio

from iop.testing import (
    CHAT_COMPLETIONS_PATH,
    ClientStream,
    FakeBackend,
    Fault,
    LoopbackPlatform,
    Stall,
    StreamEnd,
    Write,
    assert_one_terminal,
    count_terminals,
    event_ends,
    loopback_platform,
    open_virtual_platform,
    synthetic_stream,
    transcript_body,
)
from iop.testing._replay_server import (
    CONTROL_REQUESTS,
    CONTROL_SCRIPT,
    RequestRecord,
    ScriptCommand,
    _control,
)

BODY = transcript_body("vllm_text_stream_with_usage.txt")

# --- faults (sans-IO) ------------------------------------------------------------------


def test_event_ends_are_past_each_blank_line() -> None:
    assert event_ends(b"data: a\n\ndata: b\r\n\r\ndata: c\r\rtail") == [9, 20, 29]
    assert len(event_ends(BODY)) == 13


def test_a_stall_cuts_the_body_at_the_end_of_the_nth_event() -> None:
    reply = Fault.stall(after_chunks=3).reply(BODY)
    plan = reply.body_plan()
    at = next(i for i, step in enumerate(plan) if isinstance(step, Stall))
    sent = b"".join(s.data for s in plan[:at] if isinstance(s, Write))
    assert sent == BODY[: event_ends(BODY)[2]]
    assert plan[at] == Stall(math.inf)
    assert b"".join(s.data for s in plan if isinstance(s, Write)) == BODY


def test_truncate_and_reset_drop_the_connection_after_n_events() -> None:
    cut = event_ends(BODY)[1]
    truncate, reset = Fault.truncate(2).reply(BODY), Fault.reset(2).reply(BODY)
    assert (truncate.truncate_after_bytes, truncate.reset) == (cut, False)
    assert (reset.truncate_after_bytes, reset.reset) == (cut, True)


def test_the_other_faults() -> None:
    assert Fault.none().reply(BODY).body == BODY
    stop = Fault.stop_reading().reply(BODY)
    assert (stop.stop_reading, stop.stall_before_headers, stop.stall_s) == (True, True, math.inf)
    early = Fault.stop_reading(answer_status=413).reply(BODY)
    assert (early.stop_reading, early.status) == (True, 413)
    assert Fault.paced(0.5).reply(BODY).delay_s == 0.5
    assert Fault.stall_before_headers(2.0).reply(BODY).stall_before_headers
    error = Fault.http_error(503).reply(BODY)
    assert error.status == 503
    assert b"injected HTTP 503" in error.body


def test_a_fault_past_the_body_is_refused() -> None:
    with pytest.raises(ValueError, match="13 SSE events, fewer than 14"):
        Fault.truncate(14).reply(BODY)
    with pytest.raises(ValueError, match=">= 0"):
        Fault.stall(-1).reply(BODY)


def test_faults_as_sim_overrides() -> None:
    assert Fault.none().sim_overrides() == {}
    assert Fault.stall(3).sim_overrides() == {"failure": "stall_mid_stream", "fail_after_tokens": 3}
    assert Fault.truncate(4).sim_overrides() == {"failure": "truncate", "fail_after_tokens": 4}
    assert Fault.http_error(429).sim_overrides() == {"failure": "http_429"}
    assert Fault.paced(0.5).sim_overrides() == {"tokens_per_s": 2.0}
    for unplayable in (Fault.reset(2), Fault.stall(2, seconds=1.0), Fault.http_error(503)):
        with pytest.raises(ValueError, match="use the fake backend"):
            unplayable.sim_overrides()


# --- what a client saw (sans-IO) ---------------------------------------------------------


def test_a_synthetic_stream_reads_back_whole() -> None:
    stream = ClientStream.from_bytes(synthetic_stream(5, text="x"))
    assert (stream.text, stream.content_chunks, stream.finish_reason) == ("xxxxx", 5, "stop")
    assert stream.usage == {"prompt_tokens": 8, "completion_tokens": 5, "total_tokens": 13}
    assert stream.done
    assert assert_one_terminal(stream, kind="finish") == "finish_reason=stop"
    assert assert_one_terminal(stream, kind="finish_reason=stop") == "finish_reason=stop"


def test_fed_byte_by_byte_the_same_events() -> None:
    whole = ClientStream.from_bytes(BODY)
    stream = ClientStream()
    for i in range(len(BODY)):
        stream.feed(BODY[i : i + 1])
    assert stream.events == whole.events
    assert stream.body_bytes == len(BODY)


ERROR = b'data: {"error": {"message": "m", "type": "server_error", "code": "idle_timeout"}}\n\n'
DONE = b"data: [DONE]\n\n"
SECOND_EVENT = BODY[event_ends(BODY)[0] : event_ends(BODY)[1]]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (BODY[: event_ends(BODY)[3]], "found 0: none"),
        (BODY.replace(DONE, ERROR + DONE), "found 2: finish_reason=stop, error=idle_timeout"),
        (BODY.replace(DONE, b""), "terminal finish_reason=stop but no [DONE]"),
        (ERROR + SECOND_EVENT + DONE, "events after the terminal error=idle_timeout"),
    ],
)
def test_a_stream_without_exactly_one_terminal_fails(body: bytes, message: str) -> None:
    with pytest.raises(AssertionError, match=message.replace("[", r"\[").replace("]", r"\]")):
        assert_one_terminal(ClientStream.from_bytes(body))


def test_the_wrong_terminal_fails_by_name() -> None:
    stream = ClientStream.from_bytes(ERROR + DONE)
    assert count_terminals(stream) == (1, ["error=idle_timeout"])
    assert assert_one_terminal(stream, kind="error") == "error=idle_timeout"
    with pytest.raises(
        AssertionError, match="expected a terminal 'finish', the run ended with error=idle_timeout"
    ):
        assert_one_terminal(stream, kind="finish")
    assert "ended: closed" in stream.describe()


# --- the virtual platform (virtual time) -------------------------------------------------


async def test_virtual_a_plain_stream(autojump_clock: trio.abc.Clock) -> None:
    async with open_virtual_platform() as platform:
        platform.test_mark = platform.mark()
        stream = await platform.stream_chat()
        assert stream.text == "Hello! How can I help you today?"
        assert await platform.assert_one_terminal(stream) == "finish_reason=stop"
        assert platform.outcomes_since() == {"complete": 1}
        await platform.assert_no_leaks()
        # The backend ended its answer itself: "closed by the node" must fail.
        with pytest.raises(AssertionError, match="the node did not close it"):
            await platform.assert_backend_closed_within(1000)


async def test_virtual_a_hang_up_closes_the_backend_at_once(autojump_clock: trio.abc.Clock) -> None:
    async with open_virtual_platform() as platform:
        platform.test_mark = platform.mark()
        platform.replay_stream(10, Fault.stall(after_chunks=5))
        stream = await platform.stream_chat(hang_up_after=2)
        assert stream.end is StreamEnd.HUNG_UP
        record = await platform.assert_backend_closed_within(1, after=stream.ended_at)
        assert record.closed_at == stream.ended_at  # no virtual time passes
        await platform.assert_no_leaks()
        assert platform.outcomes_since() == {"cancelled:client_disconnect": 1}
        with pytest.raises(AssertionError, match=r"found 0: none"):
            await platform.assert_one_terminal(stream)


async def test_virtual_leaks_and_open_backends_are_seen(autojump_clock: trio.abc.Clock) -> None:
    async with open_virtual_platform(
        edge_config={"deadlines": {"idle_timeout_s": 100}}
    ) as platform:
        platform.test_mark = platform.mark()
        platform.replay(fault=Fault.stall(after_chunks=4))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(platform.stream_chat)
            await trio.sleep(1)
            with pytest.raises(AssertionError, match=r"leaked: .* runs on the edge: \[."):
                await platform.assert_no_leaks(within_s=5)
            with pytest.raises(AssertionError, match="still open 10 ms"):
                await platform.assert_backend_closed_within(10)
        # The idle deadline (100 s, virtual) ended it.
        assert platform.outcomes_since() == {"cancelled:idle_timeout": 1}
        await platform.assert_no_leaks()


# --- the loopback platform (real processes) ----------------------------------------------


@pytest.fixture(scope="module")
def loopback(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackPlatform]:
    with loopback_platform(
        tmp_path_factory.mktemp("loopback"),
        edge_config={"deadlines": {"idle_timeout_s": 30}},
        # The node's write deadline (docs/configuration.md): a backend that
        # stops reading is given up on after 1 s.
        instance={"connect_timeout_s": 1.0},
    ) as platform:
        yield platform


def test_loopback_a_run_and_its_records(loopback: LoopbackPlatform) -> None:
    loopback.test_mark = loopback.mark()
    stream = loopback.stream_chat(stream_options={"include_usage": True})
    assert loopback.assert_one_terminal(stream, kind="finish") == "finish_reason=stop"
    assert stream.usage is not None
    (record,) = loopback.backend_requests(loopback.test_mark)
    assert record.method == "POST"
    assert b'"stream":true' in record.body
    # A finished answer leaves the node's keep-alive connection open: a
    # "closed within" must fail, and a pool is not a leak.
    with pytest.raises(AssertionError, match=r"still open \(idle\) 50 ms"):
        loopback.assert_backend_closed_within(50)
    loopback.assert_no_leaks()
    assert loopback.chat(max_tokens=5).json()["choices"][0]["finish_reason"] == "stop"


def test_loopback_a_held_run_is_a_leak_until_it_ends(loopback: LoopbackPlatform) -> None:
    loopback.test_mark = loopback.mark()
    loopback.replay(fault=Fault.stall(after_chunks=6))
    reader = loopback.slow_reader()
    try:
        with pytest.raises(AssertionError, match="leaked: runs still on the edge"):
            loopback.assert_no_leaks(timeout=1.0)
        assert loopback.outcomes_since() == {}
    finally:
        left = time.monotonic()
        reader.close()
    loopback.assert_backend_closed_within(5000, after=left)
    assert loopback.assert_one_outcome() == "cancelled:client_disconnect"
    loopback.assert_no_leaks()


# More than the sockets between node and backend buffer (the node's send
# buffer grows to 4 MiB, tcp_wmem's default maximum), less than the edge's
# 8 MiB body limit.
BIG_PROMPT = "x" * 6_000_000


def test_loopback_a_backend_that_stops_reading_the_body(loopback: LoopbackPlatform) -> None:
    loopback.test_mark = loopback.mark()
    loopback.replay(fault=Fault.stop_reading())
    stream = loopback.stream_chat(BIG_PROMPT)
    assert loopback.assert_one_terminal(stream, kind="error=backend_timeout")
    (record,) = loopback.backend_requests(loopback.test_mark)
    assert record.reading_stopped
    assert record.body == b""
    loopback.assert_no_leaks()


def test_loopback_an_early_answer_to_an_unread_body_is_the_outcome(
    loopback: LoopbackPlatform,
) -> None:
    loopback.test_mark = loopback.mark()
    loopback.replay(fault=Fault.stop_reading(answer_status=413))
    stream = loopback.stream_chat(BIG_PROMPT)
    loopback.assert_one_terminal(stream, kind="error")
    assert "413" in stream.describe()
    loopback.assert_no_leaks()


def test_loopback_reset_drops_the_queued_replies(loopback: LoopbackPlatform) -> None:
    loopback.replay(fault=Fault.truncate(2), times=3)
    loopback.reset_backend()
    loopback.test_mark = loopback.mark()
    assert loopback.assert_one_terminal(loopback.stream_chat()) == "finish_reason=stop"


def test_loopback_scripting_needs_the_fake_backend(loopback: LoopbackPlatform) -> None:
    with pytest.raises(ValueError, match="script the fault"):
        loopback.stream_chat(fault=Fault.truncate(2))
    loopback.test_mark = None
    with pytest.raises(ValueError, match="no mark"):
        loopback.outcomes_since()


# --- the fake backend's control port (in process) ----------------------------------------


async def test_the_control_port_scripts_the_backend_and_reports_its_connections() -> None:
    backend, control = FakeBackend(), FakeBackend()
    _control(backend, control)
    async with trio.open_nursery() as nursery:
        await nursery.start(backend.serve)
        await nursery.start(control.serve)
        async with httpx.AsyncClient(base_url=control.url) as ctl:
            cmd = ScriptCommand(replies=[Fault.truncate(2).reply(BODY)])
            resp = await ctl.post(CONTROL_SCRIPT, content=msgspec.msgpack.encode(cmd))
            assert msgspec.msgpack.decode(resp.content) == {"queued": 1}
            bad = await ctl.post(CONTROL_SCRIPT, content=b"\xc1")
            assert bad.status_code == 400
            async with httpx.AsyncClient(base_url=backend.url) as client:
                with pytest.raises(httpx.RemoteProtocolError):
                    await client.post(CHAT_COMPLETIONS_PATH, json={})
            await backend.wait_connection_closed(5.0)
            records = msgspec.msgpack.decode(
                (await ctl.get(CONTROL_REQUESTS)).content, type=list[RequestRecord]
            )
        (record,) = records
        assert (record.path, record.close_cause, record.closed_in) == (
            CHAT_COMPLETIONS_PATH,
            "server_abort",
            "sending",
        )
        assert record.closed_at is not None
        assert record.received_at <= record.closed_at <= time.monotonic()
        await backend.aclose()
        await control.aclose()
