"""Custom and namespace tools on the Responses surface: offered to the model as
functions, its calls turned back into the client's items, and replayed.

What Codex CLI 0.163.0 sends and expects is in tests/data/agents
(``codex-apply-patch``: a ``custom`` ``apply_patch`` tool with a Lark
grammar, the ``multi_agent_v1`` namespace, ``web_search``; its follow-up
replays the ``custom_tool_call`` and a ``custom_tool_call_output``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai.types.responses import Response

from iop.api import Call, RunContext
from iop.api.responses import ResponsesCall, ResponsesSurface, ResponseStore
from iop.api.responses._tools import (
    CUSTOM_ARGUMENT,
    MAX_FUNCTION_NAME,
    custom_arguments,
    custom_input,
    flat_name,
)
from iop.config import OutputPolicy
from iop.errors import RequestError
from iop.events import Complete, Delta, FinishReason, ToolCall
from iop.spec import (
    ChatRequest,
    FunctionCall,
    Message,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
)
from tests.api.responses._schema import validate_event, validate_response
from tests.api.responses.test_encode import _client

CREATED: Final = 1_700_000_000
DATA: Final = Path(__file__).resolve().parents[2] / "data" / "agents"
GRAMMAR: Final = 'start: "*** Begin Patch" LF body\n%import common.LF\n'
PATCH: Final = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n"
APPLY_PATCH: Final = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR},
}
SHELL: Final = {"type": "function", "name": "shell", "parameters": {"type": "object"}}
SPAWN: Final = {
    "type": "function",
    "name": "spawn_agent",
    "description": "Spawn a sub-agent.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"message": {"type": "string"}}},
}
AGENTS: Final = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for sub-agents.",
    "tools": [SPAWN, {"type": "custom", "name": "note"}],
}


def _surface() -> ResponsesSurface:
    return ResponsesSurface(
        ResponseStore(max_entries=64, max_bytes=1 << 22, ttl_s=600), clock=lambda: 5.0
    )


def _call(surface: ResponsesSurface | None = None, **body: Any) -> Call:
    body.setdefault("model", "m")
    return (surface or _surface()).parse(json.dumps(body).encode(), {})


def _parse(**body: Any) -> ChatRequest:
    return _call(**body).request


def _events(data: bytes) -> list[dict[str, Any]]:
    out = []
    for block in data.decode().split("\n\n"):
        if block:
            event_line, data_line = block.split("\n")
            obj = json.loads(data_line.removeprefix("data: "))
            assert event_line == f"event: {obj['type']}"
            out.append(obj)
    return out


def _ctx(run_id: str = "r1") -> RunContext:
    return RunContext(run_id=run_id, created=CREATED, policy=OutputPolicy())


# --- offered to the model ----------------------------------------------------------------


def test_a_custom_tool_is_a_function_of_one_string_with_its_grammar_described() -> None:
    req = _parse(input="edit", tools=[APPLY_PATCH])
    assert req.tools is not None
    (tool,) = req.tools
    fn = tool.function
    assert fn.name == "apply_patch"
    assert fn.parameters == {
        "type": "object",
        "properties": {
            "input": {"type": "string", "description": "The tool's input, as raw text."}
        },
        "required": ["input"],
        "additionalProperties": False,
    }
    assert fn.description is not None
    assert fn.description.startswith("Edit files.\n\n")
    assert f"```lark\n{GRAMMAR}\n```" in fn.description
    assert "`input`" in fn.description


def test_a_custom_tool_of_free_text_says_so() -> None:
    req = _parse(input="x", tools=[{"type": "custom", "name": "say", "format": {"type": "text"}}])
    assert req.tools is not None
    assert req.tools[0].function.description is not None
    assert req.tools[0].function.description.endswith("The input is free-form text.")


def test_a_namespace_is_flattened_into_qualified_functions() -> None:
    req = _parse(input="x", tools=[SHELL, AGENTS, {"type": "web_search"}])
    assert req.tool_names() == ["shell", "multi_agent_v1__spawn_agent", "multi_agent_v1__note"]
    assert req.tools is not None
    spawn = req.tools[1].function
    assert spawn.parameters == SPAWN["parameters"]
    assert spawn.strict is False
    assert (
        spawn.description
        == "Spawn a sub-agent.\n\n(A tool of multi_agent_v1: Tools for sub-agents.)"
    )
    note = req.tools[2].function
    assert note.parameters is not None
    assert note.parameters["required"] == [CUSTOM_ARGUMENT]


def test_a_namespace_without_a_description_is_named_alone() -> None:
    bare = {"type": "namespace", "name": "ns", "description": "", "tools": [SHELL]}
    req = _parse(input="x", tools=[bare])
    assert req.tools is not None
    assert req.tools[0].function.description == "(A tool of ns)"


def test_the_response_echoes_the_clients_tools_as_given() -> None:
    call = _call(input="x", tools=[SHELL, AGENTS, APPLY_PATCH, {"type": "web_search"}])
    assert isinstance(call.native, ResponsesCall)
    col = _surface().collector(call, _ctx())
    col.feed(Complete())
    body = json.loads(col.result()[1])
    validate_response(body)
    assert [t["type"] for t in body["tools"]] == ["function", "namespace", "custom"]
    assert body["tools"][1]["name"] == "multi_agent_v1"
    assert [t["name"] for t in body["tools"][1]["tools"]] == ["spawn_agent", "note"]
    assert body["tools"][2] == APPLY_PATCH


@pytest.mark.parametrize(
    ("namespace", "name"),
    [
        ("n" * 40, "tool_with_a_long_name_too"),  # 67 characters flat
        ("crm.v2", "find"),  # '.' is no function-name character
        ("ns", "t" * 64),
    ],
)
def test_a_flat_name_that_is_not_legal_is_made_legal_deterministically(
    namespace: str, name: str
) -> None:
    flat = flat_name(namespace, name)
    assert len(flat) <= MAX_FUNCTION_NAME
    assert flat.replace("_", "a").replace("-", "a").isalnum()
    assert flat == flat_name(namespace, name)
    assert flat != flat_name(namespace, name + "x")


def test_a_flat_name_another_function_has_is_made_unique() -> None:
    taken = {"type": "function", "name": "multi_agent_v1__spawn_agent"}
    req = _parse(input="x", tools=[AGENTS, taken])
    names = req.tool_names()
    assert len(set(names)) == 3
    assert names[2] == "multi_agent_v1__spawn_agent"  # the client's own function keeps it
    assert names[0].startswith("multi_agent_v1__spawn_agent_")


@given(namespace=st.text(min_size=1, max_size=80), name=st.text(min_size=1, max_size=80))
def test_every_flat_name_is_a_legal_function_name(namespace: str, name: str) -> None:
    flat = flat_name(namespace, name)
    assert 1 <= len(flat) <= MAX_FUNCTION_NAME
    assert all(c.isascii() and (c.isalnum() or c in "_-") for c in flat)


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (
            {"type": "custom", "name": "apply_patch"},
            NamedToolChoice(function=NamedFunction(name="apply_patch")),
        ),
        (
            {"type": "function", "name": "shell"},
            NamedToolChoice(function=NamedFunction(name="shell")),
        ),
    ],
)
def test_a_custom_tool_can_be_chosen(choice: Any, expected: Any) -> None:
    call = _call(input="x", tools=[SHELL, APPLY_PATCH], tool_choice=choice)
    assert call.request.tool_choice == expected
    col = _surface().collector(call, _ctx())
    col.feed(Complete())
    assert json.loads(col.result()[1])["tool_choice"] == choice


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "function", "name": "apply_patch"},  # a custom tool is no function
        {"type": "custom", "name": "shell"},  # and a function no custom tool
        {"type": "custom", "name": "missing"},
    ],
)
def test_a_choice_of_the_wrong_kind_is_a_400(choice: Any) -> None:
    with pytest.raises(RequestError) as info:
        _call(input="x", tools=[SHELL, APPLY_PATCH], tool_choice=choice)
    assert (info.value.status, info.value.param) == (400, "tool_choice")


def test_allowed_tools_may_list_custom_tools() -> None:
    req = _parse(
        input="x",
        tools=[SHELL, APPLY_PATCH],
        tool_choice={
            "type": "allowed_tools",
            "mode": "required",
            "tools": [{"type": "custom", "name": "apply_patch"}],
        },
    )
    assert (req.tool_names(), req.tool_choice) == (["apply_patch"], "required")


def test_a_malformed_custom_or_namespaced_tool_is_a_400_naming_it() -> None:
    with pytest.raises(RequestError) as info:
        _parse(input="x", tools=[SHELL, {"type": "custom"}])
    assert info.value.param == "tools[1].name"
    with pytest.raises(RequestError) as info:
        _parse(input="x", tools=[{**AGENTS, "tools": [SPAWN, {"type": "function"}]}])
    assert info.value.param == "tools[0].tools[1].name"


# --- the model's calls, back to the client -----------------------------------------------

# The model's arguments as IOP replays them (compact JSON), so that the stored
# and the resent turn compare whole.
CUSTOM_CALL: Final = ToolCall(id="call_p", name="apply_patch", arguments=custom_arguments(PATCH))
NAMESPACED_CALL: Final = ToolCall(
    id="call_s", name="multi_agent_v1__spawn_agent", arguments='{"message":"go"}'
)


def test_a_custom_tool_call_streams_as_openai_streams_it_byte_for_byte() -> None:
    surface = _surface()
    call = _call(surface, input="edit", tools=[APPLY_PATCH], stream=True)
    enc = surface.stream(call, _ctx())
    enc.start()  # response.created, response.in_progress: sequence numbers 0 and 1
    out = enc.feed_many(
        [Complete(finish_reason=FinishReason.TOOL_CALLS, tool_calls=(CUSTOM_CALL,))]
    )
    patch = json.dumps(PATCH)
    item = '{"type":"custom_tool_call","id":"ctc_r1_0","call_id":"call_p","name":"apply_patch","input":INPUT}'
    expected = (
        "event: response.output_item.added\n"
        'data: {"type":"response.output_item.added","sequence_number":2,"output_index":0,'
        f'"item":{item.replace("INPUT", chr(34) * 2)}}}\n\n'
        "event: response.custom_tool_call_input.delta\n"
        'data: {"type":"response.custom_tool_call_input.delta","sequence_number":3,'
        f'"item_id":"ctc_r1_0","output_index":0,"delta":{patch}}}\n\n'
        "event: response.custom_tool_call_input.done\n"
        'data: {"type":"response.custom_tool_call_input.done","sequence_number":4,'
        f'"item_id":"ctc_r1_0","output_index":0,"input":{patch}}}\n\n'
        "event: response.output_item.done\n"
        'data: {"type":"response.output_item.done","sequence_number":5,"output_index":0,'
        f'"item":{item.replace("INPUT", patch)}}}\n\n'
    )
    assert out.decode().startswith(expected)
    events = _events(out)
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"] == [json.loads(item.replace("INPUT", patch))]
    for event in events:
        validate_event(event)
    validate_response(events[-1]["response"])


def test_a_namespaced_call_is_the_clients_name_with_its_namespace() -> None:
    surface = _surface()
    call = _call(surface, input="go", tools=[AGENTS], stream=True)
    enc = surface.stream(call, _ctx())
    events = _events(enc.start() + enc.feed_many([Complete(tool_calls=(NAMESPACED_CALL,))]))
    for event in events:
        validate_event(event)
    done = [e for e in events if e["type"] == "response.output_item.done"]
    # Codex 0.163.0 runs a namespaced tool only as name + namespace
    # (a flattened name is an "unsupported call": docs/api.md).
    assert done[0]["item"] == {
        "type": "function_call",
        "id": "fc_r1_0",
        "status": "completed",
        "call_id": "call_s",
        "name": "spawn_agent",
        "arguments": '{"message":"go"}',
        "namespace": "multi_agent_v1",
    }
    args_done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert args_done[0]["name"] == "spawn_agent"


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (json.dumps({"input": PATCH}), PATCH),
        ('{"input": ""}', ""),
        ('{"input": 3}', '{"input": 3}'),  # not a string: passed on as written
        ('{"input": "a", "b": 1}', '{"input": "a", "b": 1}'),
        ("*** Begin Patch", "*** Begin Patch"),  # the patch itself, no JSON
        ("", ""),
        ('["input"]', '["input"]'),
    ],
)
def test_a_custom_tools_input_is_unwrapped_or_passed_on_raw(arguments: str, expected: str) -> None:
    assert custom_input(arguments) == expected


@given(text=st.text())
def test_any_input_round_trips_through_the_models_arguments(text: str) -> None:
    assert custom_input(custom_arguments(text)) == text
    assert custom_input(json.dumps({"input": text}, indent=2)) == text


def test_the_collector_returns_custom_and_namespaced_calls() -> None:
    surface = _surface()
    call = _call(surface, input="x", tools=[APPLY_PATCH, AGENTS, SHELL])
    col = surface.collector(call, _ctx())
    note = ToolCall(id="call_n", name="multi_agent_v1__note", arguments="raw text")
    plain = ToolCall(id="call_x", name="shell", arguments="{}")
    col.feed(Delta("ok"))
    col.feed(Complete(tool_calls=(CUSTOM_CALL, NAMESPACED_CALL, note, plain)))
    status, body = col.result()
    obj = json.loads(body)
    validate_response(obj)
    Response.model_validate(obj)
    assert status == 200
    assert obj["output"][1:] == [
        {
            "type": "custom_tool_call",
            "id": "ctc_r1_1",
            "call_id": "call_p",
            "name": "apply_patch",
            "input": PATCH,
        },
        {
            "type": "function_call",
            "id": "fc_r1_2",
            "status": "completed",
            "call_id": "call_s",
            "name": "spawn_agent",
            "arguments": '{"message":"go"}',
            "namespace": "multi_agent_v1",
        },
        {
            "type": "custom_tool_call",
            "id": "ctc_r1_3",
            "call_id": "call_n",
            "name": "note",
            "input": "raw text",
            "namespace": "multi_agent_v1",
        },
        {
            "type": "function_call",
            "id": "fc_r1_4",
            "status": "completed",
            "call_id": "call_x",
            "name": "shell",
            "arguments": "{}",
        },
    ]


# --- replayed: the next turn ----------------------------------------------------------------

TURN: Final = [
    Message(role="user", content="edit"),
    Message(
        role="assistant",
        tool_calls=[
            MessageToolCall(
                id="call_p",
                function=FunctionCall(name="apply_patch", arguments=custom_arguments(PATCH)),
            ),
            MessageToolCall(
                id="call_s",
                function=FunctionCall(
                    name="multi_agent_v1__spawn_agent", arguments='{"message":"go"}'
                ),
            ),
        ],
    ),
    Message(role="tool", tool_call_id="call_p", content="Success."),
    Message(role="tool", tool_call_id="call_s", content="spawned"),
]


def test_custom_calls_and_their_outputs_replay_as_the_models_calls_and_tool_results() -> None:
    req = _parse(
        tools=[APPLY_PATCH, AGENTS],
        input=[
            {"role": "user", "content": "edit"},
            # As Codex resends them (tests/data/agents/codex-apply-patch/02-request.json).
            {
                "type": "custom_tool_call",
                "id": "ctc_1",
                "call_id": "call_p",
                "name": "apply_patch",
                "input": PATCH,
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "status": "completed",
                "call_id": "call_s",
                "name": "spawn_agent",
                "namespace": "multi_agent_v1",
                "arguments": '{"message":"go"}',
            },
            {
                "type": "custom_tool_call_output",
                "id": "ctco_1",
                "call_id": "call_p",
                "output": "Success.",
            },
            {"type": "function_call_output", "call_id": "call_s", "output": "spawned"},
        ],
    )
    assert req.messages == TURN


def test_a_custom_output_may_be_content_parts() -> None:
    req = _parse(
        input=[
            {"type": "custom_tool_call", "call_id": "c", "name": "apply_patch", "input": "p"},
            {
                "type": "custom_tool_call_output",
                "call_id": "c",
                "output": [{"type": "input_text", "text": "done"}],
            },
        ]
    )
    assert req.messages[-1].role == "tool"
    assert req.messages[-1].text() == "done"


def test_a_stored_turn_and_a_resent_one_are_the_same_conversation() -> None:
    """previous_response_id replays the stored calls exactly as the model made
    them; a client that resends the items gets the same messages."""
    surface = _surface()
    first = _call(surface, input="edit", tools=[APPLY_PATCH, AGENTS], stream=True)
    enc = surface.stream(first, _ctx())
    events = _events(
        enc.start()
        + enc.feed_many(
            [
                Complete(
                    finish_reason=FinishReason.TOOL_CALLS, tool_calls=(CUSTOM_CALL, NAMESPACED_CALL)
                )
            ]
        )
    )
    response = events[-1]["response"]
    outputs = [
        {"type": "custom_tool_call_output", "call_id": "call_p", "output": "Success."},
        {"type": "function_call_output", "call_id": "call_s", "output": "spawned"},
    ]
    chained = _call(
        surface,
        input=outputs,
        tools=[APPLY_PATCH, AGENTS],
        previous_response_id=response["id"],
    ).request
    resent = _call(
        surface,
        input=[{"role": "user", "content": "edit"}, *response["output"], *outputs],
        tools=[APPLY_PATCH, AGENTS],
    ).request
    assert chained.messages == TURN
    assert resent.messages == TURN


# --- what Codex CLI really sends ------------------------------------------------------------


def _capture(name: str, number: int) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((DATA / name / f"{number:02d}-request.json").read_bytes())
    return body


def test_every_tool_codex_sends_reaches_the_model_but_web_search() -> None:
    body = _capture("codex-apply-patch", 1)
    kinds = sorted({t["type"] for t in body["tools"]})
    assert kinds == ["custom", "function", "namespace", "web_search"]
    expected = []
    for tool in body["tools"]:
        if tool["type"] in ("function", "custom"):
            expected.append(tool["name"])
        elif tool["type"] == "namespace":
            expected += [f"{tool['name']}__{t['name']}" for t in tool["tools"]]
    req = _surface().parse(json.dumps(body).encode(), {}).request
    assert req.tool_names() == expected
    assert "apply_patch" in expected
    assert "multi_agent_v1__spawn_agent" in expected


def test_codexs_apply_patch_follow_up_replays_its_call_and_output() -> None:
    body = _capture("codex-apply-patch", 2)
    req = _surface().parse(json.dumps(body).encode(), {}).request
    call, result = req.messages[-2:]
    assert call.tool_calls is not None
    (made,) = call.tool_calls
    assert made.function.name == "apply_patch"
    sent = json.loads(made.function.arguments)
    assert sent == {"input": body["input"][-2]["input"]}
    assert result.role == "tool"
    assert result.tool_call_id == made.id
    assert "A iop-patch.txt" in result.text()


def test_the_sdk_stream_helper_accumulates_custom_and_namespaced_calls() -> None:
    run = [
        Complete(finish_reason=FinishReason.TOOL_CALLS, tool_calls=(CUSTOM_CALL, NAMESPACED_CALL))
    ]
    client = _client(_surface(), lambda: run, byte_by_byte=True)
    with client.responses.stream(
        model="m",
        input="edit",
        tools=[APPLY_PATCH, AGENTS],  # type: ignore[list-item]
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.custom_tool_call_input.delta" in kinds
    custom, function = final.output
    assert custom.type == "custom_tool_call"
    assert (custom.call_id, custom.name, custom.input) == ("call_p", "apply_patch", PATCH)
    assert function.type == "function_call"
    assert (function.name, function.namespace) == ("spawn_agent", "multi_agent_v1")
