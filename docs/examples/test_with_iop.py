"""A user's own tests against IOP, with the `iop` pytest plugin (docs/testing-kit.md).

Nothing to configure: `pip install iop-platform` registers the plugin, whose fixtures
start the platform (`iop_platform`) or run it in memory in virtual time
(`iop_virtual`). tests/plugin/ runs this very file through pytester.
"""

import pytest

from iop.testing import Fault

SLOW_CLIENT_EDGE = {"server": {"write_stall_timeout_s": 1}}


def test_a_stream_ends_with_exactly_one_terminal_event(iop_platform):
    stream = iop_platform.stream_chat("Hello!")
    assert stream.text == "Hello! How can I help you today?"
    assert iop_platform.assert_one_terminal(stream) == "finish_reason=stop"
    iop_platform.assert_no_leaks()


def test_a_backend_that_truncates_its_stream_is_one_error(iop_platform):
    iop_platform.replay("vllm_text_stream_with_usage.txt", Fault.truncate(after_chunks=3))
    stream = iop_platform.stream_chat()
    iop_platform.assert_one_terminal(stream, kind="error")
    assert stream.text == "Hello!"  # what came before the cut
    iop_platform.assert_no_leaks()


def test_a_reset_connection_is_one_error(iop_platform):
    iop_platform.replay_stream(50, Fault.reset(after_chunks=10))
    stream = iop_platform.stream_chat()
    iop_platform.assert_one_terminal(stream, kind="error")
    iop_platform.assert_no_leaks()


def test_a_client_that_hangs_up_closes_the_backend_socket(iop_platform):
    iop_platform.replay(fault=Fault.stall(after_chunks=6))  # then silent, forever
    stream = iop_platform.stream_chat(hang_up_after=2)
    iop_platform.assert_backend_closed_within(2000, after=stream.ended_at)
    assert iop_platform.assert_one_outcome() == "cancelled:client_disconnect"
    iop_platform.assert_no_leaks()


@pytest.mark.iop_platform(backend="sim", edge_config=SLOW_CLIENT_EDGE)
def test_a_client_that_stops_reading_is_cut_off(iop_platform):
    reader = iop_platform.slow_reader(iop_sim={"output_tokens": 20_000})
    try:
        reader.wait_closed_by_server()
    finally:
        reader.close()
    assert iop_platform.assert_one_outcome() == "cancelled:slow_client"
    iop_platform.assert_no_leaks()


@pytest.mark.iop_platform(backend="sim", edge_config=SLOW_CLIENT_EDGE)
def test_a_sim_fault_travels_in_the_request(iop_platform):
    stream = iop_platform.stream_chat(fault=Fault.truncate(after_chunks=4))
    iop_platform.assert_one_terminal(stream, kind="error")


def test_an_idle_backend_times_out_in_virtual_time(iop_virtual):
    async def scenario(platform):
        platform.replay(fault=Fault.stall(after_chunks=4))
        stream = await platform.stream_chat()
        # 30 s of silence, in no wall time at all.
        await platform.assert_one_terminal(stream, kind="error=idle_timeout")
        await platform.assert_backend_closed_within(1, after=stream.ended_at)
        await platform.assert_no_leaks()
        return stream.ended_at - stream.started_at

    took = iop_virtual.run(scenario, edge_config={"deadlines": {"idle_timeout_s": 30}})
    assert took == pytest.approx(30, abs=1)
