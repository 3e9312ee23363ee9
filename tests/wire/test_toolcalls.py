"""ToolCallAccumulator: streamed tool-call deltas into complete calls."""

from __future__ import annotations

import json
from importlib.resources import files

import msgspec

from iop.events import ToolCall
from iop.wire._chunks import ChatChunk, ChunkFunction, ChunkToolCall
from iop.wire._toolcalls import ToolCallAccumulator


def tc(
    index: int | None = 0,
    id: str | int | None = None,
    name: str | None = None,
    arguments: str | None = None,
) -> ChunkToolCall:
    function = None if name is None and arguments is None else ChunkFunction(name, arguments)
    return ChunkToolCall(index=index, id=id, type="function" if id else None, function=function)


def accumulate(*chunks: list[ChunkToolCall]) -> tuple[ToolCall, ...]:
    acc = ToolCallAccumulator()
    for deltas in chunks:
        acc.add(deltas)
    return acc.calls()


def test_vllm_hermes_shape_id_and_name_first_then_fragments() -> None:
    calls = accumulate(
        [tc(0, "chatcmpl-tool-1", "get_weather")],
        [tc(0, arguments='{"city": "')],
        [tc(0, arguments="Paris")],
        [tc(0, arguments='"}')],
    )
    assert calls == (
        ToolCall(id="chatcmpl-tool-1", name="get_weather", arguments='{"city": "Paris"}', index=0),
    )


def test_whole_call_in_one_chunk() -> None:
    calls = accumulate([tc(0, "call_abc", "get_weather", '{"city":"Paris"}')])
    assert calls == (
        ToolCall(id="call_abc", name="get_weather", arguments='{"city":"Paris"}', index=0),
    )


def test_parallel_calls_with_distinct_indexes() -> None:
    calls = accumulate(
        [tc(0, "a", "f", '{"x":1}')],
        [tc(1, "b", "g", '{"y":2}')],
    )
    assert [(c.id, c.name, c.arguments, c.index) for c in calls] == [
        ("a", "f", '{"x":1}', 0),
        ("b", "g", '{"y":2}', 1),
    ]


def test_parallel_calls_in_one_chunk() -> None:
    calls = accumulate([tc(0, "a", "f", "{}"), tc(1, "b", "g", "{}")])
    assert [(c.id, c.index) for c in calls] == [("a", 0), ("b", 1)]


def test_parallel_calls_reusing_index_zero_with_distinct_ids() -> None:
    calls = accumulate(
        [tc(0, "a", "f", '{"x":')],
        [tc(0, arguments="1}")],
        [tc(0, "b", "g", '{"y":2}')],
        [tc(0, "c", "f", "{}")],
    )
    assert [(c.id, c.name, c.arguments, c.index) for c in calls] == [
        ("a", "f", '{"x":1}', 0),
        ("b", "g", '{"y":2}', 1),
        ("c", "f", "{}", 2),
    ]


def test_same_id_repeated_continues_the_call() -> None:
    # vLLM's Mistral parser repeats id and name on every delta.
    calls = accumulate(
        [tc(0, "abcdefghi", "add", '{"a": ')],
        [tc(0, "abcdefghi", "add", "3.5}")],
    )
    assert calls == (ToolCall(id="abcdefghi", name="add", arguments='{"a": 3.5}', index=0),)


def test_empty_name_repeated_later_never_overwrites() -> None:
    # LM Studio <= 0.3.15.
    calls = accumulate(
        [tc(0, "a", "get_weather", "")],
        [tc(0, name="", arguments='{"city":')],
        [tc(0, name="", arguments='"Paris"}')],
    )
    assert calls[0].name == "get_weather"
    assert calls[0].arguments == '{"city":"Paris"}'


def test_name_is_assigned_not_appended() -> None:
    calls = accumulate([tc(0, "a", "get_")], [tc(0, name="get_weather")])
    assert calls[0].name == "get_weather"


def test_integer_id_becomes_str() -> None:
    calls = accumulate([tc(0, 7, "f", "{}")], [tc(0, 8, "g", "{}")])
    assert [(c.id, c.name) for c in calls] == [("7", "f"), ("8", "g")]


def test_missing_index_means_zero() -> None:
    calls = accumulate([tc(None, "a", "f")], [tc(None, arguments='{"x":1}')], [tc(0, arguments="")])
    assert calls == (ToolCall(id="a", name="f", arguments='{"x":1}', index=0),)


def test_missing_id_is_synthesised_deterministically() -> None:
    chunks = ([tc(0, name="f", arguments="{}")], [tc(1, name="g", arguments="{}")])
    first = accumulate(*chunks)
    assert [(c.id, c.index) for c in first] == [("call_0", 0), ("call_1", 1)]
    assert accumulate(*chunks) == first


def test_id_prefix() -> None:
    acc = ToolCallAccumulator(id_prefix="call_run42_")
    acc.add([tc(0, name="f")])
    assert acc.calls()[0].id == "call_run42_0"


def test_synthesised_id_is_stable_while_streaming() -> None:
    acc = ToolCallAccumulator()
    acc.add([tc(0, name="f", arguments="{")])
    early = acc.calls()[0].id
    acc.add([tc(0, arguments="}")])
    acc.add([tc(1, name="g")])
    assert acc.calls()[0].id == early


def test_synthesised_id_avoids_backend_ids() -> None:
    calls = accumulate([tc(0, name="f")], [tc(1, "call_0", "g")])
    assert [c.id for c in calls] == ["call_0_1", "call_0"]


def test_late_id_is_adopted() -> None:
    calls = accumulate([tc(0, name="f")], [tc(0, "real", arguments="{}")])
    assert calls == (ToolCall(id="real", name="f", arguments="{}", index=0),)


def test_empty_string_id_counts_as_missing() -> None:
    calls = accumulate([tc(0, "a", "f", "{")], [ChunkToolCall(index=0, id="", function=None)])
    acc_args = calls[0].arguments
    assert [c.id for c in calls] == ["a"]
    assert acc_args == "{"


def test_interleaved_fragments_of_two_calls() -> None:
    calls = accumulate(
        [tc(0, "a", "f")],
        [tc(1, "b", "g")],
        [tc(0, arguments='{"x":')],
        [tc(1, arguments='{"y":')],
        [tc(1, arguments="2}"), tc(0, arguments="1}")],
    )
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"x":1}'), ("g", '{"y":2}')]


def test_indexes_renumbered_in_first_seen_order() -> None:
    calls = accumulate([tc(5, "a", "f")], [tc(2, "b", "g")])
    assert [(c.id, c.index) for c in calls] == [("a", 0), ("b", 1)]


def test_empty_slots_dropped_nameless_with_arguments_kept() -> None:
    acc = ToolCallAccumulator()
    acc.add([tc(0, "empty")])  # id only: nothing else ever comes
    acc.add([tc(1, arguments='{"x":1}')])  # arguments, never a name
    acc.add([ChunkToolCall(index=2, id="also-empty", function=ChunkFunction())])
    assert len(acc) == 1
    assert acc.calls() == (ToolCall(id="call_1", name="", arguments='{"x":1}', index=0),)


def test_empty_accumulator() -> None:
    acc = ToolCallAccumulator()
    acc.add([])
    assert len(acc) == 0
    assert acc.calls() == ()


def test_len_counts_calls() -> None:
    acc = ToolCallAccumulator()
    acc.add([tc(0, "a", "f")])
    acc.add([tc(0, "b", "g")])
    assert len(acc) == 2


def _transcript_tool_deltas(name: str) -> list[list[ChunkToolCall]]:
    raw = (files("iop.testing") / "transcripts" / name).read_bytes()
    out: list[list[ChunkToolCall]] = []
    for line in raw.splitlines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = msgspec.json.decode(line[len(b"data: ") :], type=ChatChunk)
        for choice in chunk.choices or ():
            if choice.delta is not None and choice.delta.tool_calls:
                out.append(choice.delta.tool_calls)
    return out


def test_real_vllm_hermes_transcript() -> None:
    chunks = _transcript_tool_deltas("vllm_tool_call_stream_hermes.txt")
    assert len(chunks) > 2
    calls = accumulate(*chunks)
    assert len(calls) == 1
    (call,) = calls
    assert call.id == "chatcmpl-tool-01124f84c71ff641dd8be1b9f42082ac"
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}


# --- the size limit --------------------------------------------------------------------


def test_arguments_past_the_limit_raise_a_protocol_error() -> None:
    import pytest

    from iop.errors import BackendProtocolError, ErrorCode
    from iop.wire._toolcalls import SLOT_COST_BYTES

    limit = SLOT_COST_BYTES + len("a") + len("f") + 100
    acc = ToolCallAccumulator(max_bytes=limit)
    acc.add([tc(0, "a", "f", "x" * 60)])
    acc.add([tc(0, arguments="x" * 40)])  # exactly at the limit: accepted
    assert acc.size_bytes == limit
    with pytest.raises(BackendProtocolError) as info:
        acc.add([tc(0, arguments="x")])
    assert info.value.code == ErrorCode.TOOL_CALLS_TOO_LARGE
    assert str(info.value) == f"tool calls exceed {limit} bytes (1 call(s) so far)"


def test_limit_counts_utf8_bytes_and_every_call() -> None:
    import pytest

    from iop.errors import BackendProtocolError
    from iop.wire._toolcalls import SLOT_COST_BYTES

    acc = ToolCallAccumulator(max_bytes=3 * SLOT_COST_BYTES + 6)
    acc.add([tc(0, arguments="é")])  # 2 bytes
    acc.add([tc(1, arguments="€")])  # 3 bytes
    assert acc.size_bytes == 2 * SLOT_COST_BYTES + 5
    # Endless empty calls (a new index per delta) reach the limit too.
    acc.add([tc(2)])  # a third empty call still fits
    with pytest.raises(BackendProtocolError):
        acc.add([tc(3)])


def test_repeated_name_is_not_counted_twice() -> None:
    acc = ToolCallAccumulator(max_bytes=1000)
    acc.add([tc(0, "id", "get_weather")])
    before = acc.size_bytes
    for _ in range(100):
        acc.add([tc(0, name="get_weather")])
    assert acc.size_bytes == before
