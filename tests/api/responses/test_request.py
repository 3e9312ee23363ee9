"""Responses request bodies -> the run's ChatRequest, and OpenAI's 400s."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iop.api.responses import ResponsesCall, ResponsesSurface, ResponseStore
from iop.errors import RequestError
from iop.spec import (
    ChatRequest,
    FilePart,
    FileRef,
    FunctionCall,
    FunctionDef,
    ImagePart,
    ImageURL,
    Message,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
    TextPart,
    Tool,
)


def _surface() -> ResponsesSurface:
    return ResponsesSurface(
        ResponseStore(max_entries=8, max_bytes=1 << 20, ttl_s=60), clock=lambda: 0.0
    )


def _parse(**body: Any) -> ChatRequest:
    body.setdefault("model", "m")
    return _surface().parse(json.dumps(body).encode(), {}).request


def _error(body: Any) -> RequestError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(RequestError) as info:
        _surface().parse(raw, {})
    return info.value


SHELL = {"type": "function", "name": "shell", "parameters": {"type": "object"}, "strict": False}
SHELL_TOOL = Tool(function=FunctionDef(name="shell", parameters={"type": "object"}, strict=False))


def test_string_input_is_one_user_message_after_the_instructions() -> None:
    req = _parse(input="hi", instructions="be brief")
    assert req.messages == [
        Message(role="system", content="be brief"),
        Message(role="user", content="hi"),
    ]


def test_every_message_part_kind() -> None:
    req = _parse(
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "look"},
                    {
                        "type": "input_image",
                        "image_url": "data:image/png;base64,AAAA",
                        "detail": "low",
                    },
                    {"type": "input_image", "image_url": "https://x/y.png", "detail": "original"},
                    {
                        "type": "input_file",
                        "file_data": "data:application/pdf;base64,AA",
                        "filename": "a.pdf",
                    },
                ],
            },
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [
                    {"type": "output_text", "text": "I see ", "annotations": [], "logprobs": []},
                    {"type": "refusal", "refusal": "nothing"},
                ],
            },
        ]
    )
    assert req.messages == [
        Message(
            role="user",
            content=[
                TextPart(text="look"),
                ImagePart(image_url=ImageURL(url="data:image/png;base64,AAAA", detail="low")),
                ImagePart(image_url=ImageURL(url="https://x/y.png")),
                FilePart(
                    file=FileRef(file_data="data:application/pdf;base64,AA", filename="a.pdf")
                ),
            ],
        ),
        Message(role="assistant", content="I see nothing"),
    ]


def test_system_and_developer_become_one_leading_system_message() -> None:
    req = _parse(
        instructions="base",
        input=[
            {"role": "developer", "content": [{"type": "input_text", "text": "dev"}]},
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "hi"},
            {"role": "developer", "content": "later"},
        ],
    )
    assert req.messages == [
        Message(role="system", content="base\n\ndev\n\nsys"),
        Message(role="user", content="hi"),
        Message(role="system", content="later"),
    ]


def test_function_calls_group_into_one_assistant_turn_and_outputs_become_tool_messages() -> None:
    req = _parse(
        tools=[SHELL],
        input=[
            {"role": "user", "content": "run two"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "plan"}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "ok"}],
            },
            {
                "type": "function_call",
                "call_id": "a",
                "name": "shell",
                "arguments": '{"c":1}',
                "id": "fc_1",
            },
            {"type": "function_call", "call_id": "b", "name": "shell", "arguments": '{"c":2}'},
            {"type": "function_call_output", "call_id": "a", "output": "one"},
            {
                "type": "function_call_output",
                "call_id": "b",
                "output": [{"type": "input_text", "text": "two"}],
            },
            {"type": "function_call", "call_id": "c", "name": "shell", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "three"},
        ],
    )
    call = lambda i, a: MessageToolCall(id=i, function=FunctionCall(name="shell", arguments=a))  # noqa: E731
    assert req.messages == [
        Message(role="user", content="run two"),
        Message(
            role="assistant",
            content="ok",
            tool_calls=[call("a", '{"c":1}'), call("b", '{"c":2}')],
            reasoning_content="plan",
        ),
        Message(role="tool", tool_call_id="a", content="one"),
        Message(role="tool", tool_call_id="b", content=[TextPart(text="two")]),
        Message(role="assistant", tool_calls=[call("c", "{}")]),
        Message(role="tool", tool_call_id="c", content="three"),
    ]


def test_reasoning_passed_back_maps_to_the_next_turn_or_is_dropped() -> None:
    req = _parse(
        input=[
            {"role": "user", "content": "q"},
            # summary only: its text is the reasoning
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [{"type": "summary_text", "text": "sum"}],
            },
            {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "a", "output": "r"},
            # encrypted only: nothing IOP can use
            {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "gAAA"},
            {"type": "message", "role": "assistant", "content": "done"},
            # trailing reasoning that no turn follows: dropped
            {"type": "reasoning", "id": "rs_3", "summary": [{"type": "summary_text", "text": "x"}]},
            {"role": "user", "content": "next"},
        ]
    )
    assert req.messages == [
        Message(role="user", content="q"),
        Message(
            role="assistant",
            tool_calls=[MessageToolCall(id="a", function=FunctionCall(name="f", arguments="{}"))],
            reasoning_content="sum",
        ),
        Message(role="tool", tool_call_id="a", content="r"),
        Message(role="assistant", content="done"),
        Message(role="user", content="next"),
    ]


DROPPED_TOOLS = [
    {"type": "web_search"},
    {"type": "web_search_preview"},
    {"type": "local_shell"},
    {"type": "shell"},
    {"type": "file_search", "vector_store_ids": ["v"]},
    {"type": "mcp", "server_label": "s"},
    {"type": "image_generation"},
    {"type": "code_interpreter", "container": {"type": "auto"}},
    {
        "type": "computer_use_preview",
        "display_width": 1,
        "display_height": 1,
        "environment": "linux",
    },
    {"type": "tool_search"},
    {"type": "some_future_tool"},
]


def test_tools_are_flattened_and_tools_iop_cannot_run_are_dropped() -> None:
    # (custom and namespace tools are offered too: tests/api/responses/test_tools.py)
    req = _parse(
        input="hi", tools=[*DROPPED_TOOLS, SHELL], tool_choice="auto", parallel_tool_calls=False
    )
    assert req.tools == [SHELL_TOOL]
    assert req.tool_choice == "auto"
    assert req.parallel_tool_calls is False


def test_only_dropped_tools_leave_no_tools_and_no_choice() -> None:
    req = _parse(input="hi", tools=DROPPED_TOOLS, tool_choice="auto", parallel_tool_calls=True)
    assert req.tools is None
    assert req.tool_choice is None
    assert req.parallel_tool_calls is None


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ("none", "none"),
        ("required", "required"),
        (
            {"type": "function", "name": "shell"},
            NamedToolChoice(function=NamedFunction(name="shell")),
        ),
    ],
)
def test_tool_choice_maps_onto_chat(choice: Any, expected: Any) -> None:
    assert _parse(input="hi", tools=[SHELL], tool_choice=choice).tool_choice == expected


def test_allowed_tools_keeps_the_listed_functions() -> None:
    other = {**SHELL, "name": "other"}
    req = _parse(
        input="hi",
        tools=[SHELL, other],
        tool_choice={
            "type": "allowed_tools",
            "mode": "required",
            "tools": [{"type": "function", "name": "shell"}],
        },
    )
    assert req.tools == [SHELL_TOOL]
    assert req.tool_choice == "required"


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "web_search_preview"},
        {"type": "custom", "name": "apply_patch"},
        {"type": "mcp", "server_label": "s"},
        {"type": "function", "name": "missing"},
        "sometimes",
    ],
)
def test_a_choice_iop_cannot_honour_is_a_400_on_tool_choice(choice: Any) -> None:
    err = _error(
        {
            "model": "m",
            "input": "hi",
            "tools": [SHELL, {"type": "web_search"}],
            "tool_choice": choice,
        }
    )
    assert (err.status, err.param, err.code) == (400, "tool_choice", "invalid_value")


def test_required_with_only_dropped_tools_is_a_400() -> None:
    err = _error(
        {"model": "m", "input": "hi", "tools": [{"type": "web_search"}], "tool_choice": "required"}
    )
    assert err.param == "tool_choice"
    assert "function" in err.message


def test_sampling_reasoning_format_and_affinity_fields_map_onto_the_run() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = _parse(
        input="hi",
        max_output_tokens=16,
        temperature=0.5,
        top_p=0.9,
        reasoning={"effort": "high", "summary": "auto"},
        text={
            "format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True},
            "verbosity": "low",
        },
        user="u",
        prompt_cache_key="k",
        stream=True,
    )
    assert req.max_completion_tokens == 16
    assert req.max_tokens is None
    assert (req.temperature, req.top_p, req.reasoning_effort, req.stream) == (
        0.5,
        0.9,
        "high",
        True,
    )
    assert req.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": schema, "strict": True},
    }
    assert req.user == "k"
    assert _parse(input="hi", user="u").user == "u"
    assert _parse(input="hi", safety_identifier="s").user == "s"
    assert _parse(input="hi", text={"format": {"type": "json_object"}}).response_format == {
        "type": "json_object"
    }
    assert _parse(input="hi", text={"format": {"type": "text"}}).response_format is None


def test_accepted_keys_are_not_sent_but_unknown_keys_pass_through() -> None:
    req = _parse(
        input="hi",
        metadata={"k": "v"},
        store=False,
        include=["reasoning.encrypted_content"],
        client_metadata={"x": 1},
        truncation="auto",
        service_tier="auto",
        stream_options={"include_obfuscation": False},
        top_logprobs=2,
        max_tool_calls=3,
        prompt_cache_retention="24h",
        context_management=[{"type": "compaction"}],
        background=False,
        top_k=40,
        chat_template_kwargs={"enable_thinking": False},
    )
    assert req.extra_body == {"top_k": 40, "chat_template_kwargs": {"enable_thinking": False}}


def test_native_call_keeps_the_history_without_instructions() -> None:
    call = _surface().parse(
        json.dumps({"model": "m", "input": "hi", "instructions": "sys"}).encode(), {}
    )
    assert isinstance(call.native, ResponsesCall)
    assert call.native.history == (Message(role="user", content="hi"),)
    assert call.native.echo.instructions == "sys"
    assert (call.model, call.stream) == ("m", False)


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (b"{nope", None, "invalid_json"),
        (b"[1]", None, "invalid_type"),
        ({"input": "hi"}, "model", "missing_required_parameter"),
        ({"model": " ", "input": "hi"}, "model", "missing_required_parameter"),
        ({"model": "m"}, "input", "missing_required_parameter"),
        ({"model": "m", "input": []}, "input", "empty_array"),
        ({"model": "m", "input": 3}, "input", "invalid_type"),
        (
            {"model": "m", "input": "hi", "temperature": 2.5},
            "temperature",
            "decimal_above_max_value",
        ),
        (
            {"model": "m", "input": "hi", "temperature": -1},
            "temperature",
            "decimal_below_min_value",
        ),
        ({"model": "m", "input": "hi", "top_p": 1.5}, "top_p", "decimal_above_max_value"),
        (
            {"model": "m", "input": "hi", "max_output_tokens": 15},
            "max_output_tokens",
            "integer_below_min_value",
        ),
        (
            {"model": "m", "input": "hi", "top_logprobs": 21},
            "top_logprobs",
            "integer_above_max_value",
        ),
        ({"model": "m", "input": "hi", "stream": "yes"}, "stream", "invalid_type"),
        (
            {"model": "m", "input": [{"role": "robot", "content": "x"}]},
            "input[0].role",
            "invalid_value",
        ),
        (
            {"model": "m", "input": [{"role": "user", "content": 5}]},
            "input[0].content",
            "invalid_type",
        ),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input[0].content[0].text",
            "missing_required_parameter",
        ),
        (
            {"model": "m", "input": ["hi", {"type": "function_call", "name": "f"}]},
            "input[0]",
            "invalid_type",
        ),
        (
            {"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
            "missing_required_parameter",
        ),
        ({"model": "m", "input": [{"type": "bogus"}]}, "input[0].type", "invalid_value"),
        (
            {"model": "m", "input": [{"type": "item_reference", "id": "msg_1"}]},
            "input[0].type",
            "unsupported_value",
        ),
        (
            {
                "model": "m",
                "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}],
            },
            "input[0].content[0].image_url",
            "unsupported_value",
        ),
        (
            {
                "model": "m",
                "input": [
                    {"role": "user", "content": [{"type": "input_file", "file_url": "https://f"}]}
                ],
            },
            "input[0].content[0].file_url",
            "unsupported_value",
        ),
        (
            {"model": "m", "input": "hi", "tools": [{"type": "function"}]},
            "tools[0].name",
            "missing_required_parameter",
        ),
        (
            {"model": "m", "input": "hi", "reasoning": {"effort": "huge"}},
            "reasoning.effort",
            "invalid_value",
        ),
        (
            {"model": "m", "input": "hi", "text": {"format": {"type": "xml"}}},
            "text.format.type",
            "invalid_value",
        ),
        (
            {"model": "m", "input": "hi", "text": {"format": {"type": "json_schema", "name": "n"}}},
            "text.format.schema",
            "missing_required_parameter",
        ),
        ({"model": "m", "input": "hi", "truncation": "sometimes"}, "truncation", "invalid_value"),
        ({"model": "m", "input": "hi", "background": True}, "background", "unsupported_parameter"),
        (
            {"model": "m", "input": "hi", "conversation": "conv_1"},
            "conversation",
            "unsupported_parameter",
        ),
        ({"model": "m", "input": "hi", "prompt": {"id": "p"}}, "prompt", "unsupported_parameter"),
        (
            {"model": "m", "input": "hi", "metadata": {str(i): "v" for i in range(17)}},
            "metadata",
            "object_above_max_properties",
        ),
        (
            {"model": "m", "input": "hi", "metadata": {"k": "v" * 513}},
            "metadata.k",
            "string_above_max_length",
        ),
    ],
)
def test_invalid_requests_get_openai_400s_with_param(
    body: Any, param: str | None, code: str
) -> None:
    err = _error(body)
    assert (err.status, err.param, err.code) == (400, param, code)
    assert err.message


def test_range_errors_read_like_openai() -> None:
    err = _error({"model": "m", "input": "hi", "temperature": 3})
    assert err.message == (
        "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, but got 3.0 instead."
    )
    err = _error({"model": "m", "input": "hi", "max_output_tokens": 1})
    assert err.message == (
        "Invalid 'max_output_tokens': integer below minimum value. Expected a value >= 16, but got 1 instead."
    )


def test_trailing_garbage_is_invalid_json() -> None:
    err = _error(b'{"model": "m", "input": "hi"} x')
    assert (err.status, err.code) == (400, "invalid_json")


def test_a_codex_turn_and_its_follow_up() -> None:
    """The shape Codex sends (docs/clients.md, "Codex CLI"): developer messages, namespace and
    web_search tools beside functions, store false, include, prompt_cache_key,
    client_metadata; later turns resend reasoning, calls and their outputs."""
    tools = [
        {
            "type": "function",
            "name": "exec_command",
            "description": "Runs a command",
            "strict": False,
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
        {"type": "namespace", "name": "mcp__docs", "description": "docs", "tools": [SHELL]},
        {"type": "web_search", "external_web_access": False},
    ]
    common = {
        "model": "m",
        "instructions": "You are Codex.",
        "tools": tools,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "thread-1",
        "client_metadata": {"originator": "codex_exec"},
        "text": {"verbosity": "low"},
    }
    first = [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "<permissions/>"}],
        },
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<env/>"}]},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "list files"}],
        },
    ]
    call = _surface().parse(json.dumps({**common, "input": first}).encode(), {})
    req = call.request
    assert req.messages[0] == Message(role="system", content="You are Codex.\n\n<permissions/>")
    assert [m.role for m in req.messages] == ["system", "user", "user"]
    assert req.tool_names() == ["exec_command", "mcp__docs__shell"]
    assert (req.tool_choice, req.parallel_tool_calls, req.reasoning_effort) == (
        "auto",
        False,
        "medium",
    )
    assert (req.user, req.stream, req.extra_body) == ("thread-1", True, None)
    assert isinstance(call.native, ResponsesCall)
    assert call.native.echo.store is False

    follow_up = [
        *first,
        {
            "type": "reasoning",
            "id": "rs_x",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "ls"}],
        },
        {
            "type": "function_call",
            "id": "fc_x",
            "call_id": "call_1",
            "name": "exec_command",
            "arguments": '{"cmd":"ls"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "a.txt\n"},
    ]
    req = _surface().parse(json.dumps({**common, "input": follow_up}).encode(), {}).request
    assert req.messages[3:] == [
        Message(
            role="assistant",
            tool_calls=[
                MessageToolCall(
                    id="call_1",
                    function=FunctionCall(name="exec_command", arguments='{"cmd":"ls"}'),
                )
            ],
            reasoning_content="ls",
        ),
        Message(role="tool", tool_call_id="call_1", content="a.txt\n"),
    ]


_KEYS = st.sampled_from(
    [
        "type",
        "content",
        "text",
        "name",
        "call_id",
        "output",
        "arguments",
        "tools",
        "mode",
        "role",
        "schema",
        "format",
        "image_url",
        "file_id",
        "file_url",
        "summary",
        "detail",
        "id",
        "input",
        "namespace",
        "description",
        "definition",
        "syntax",
    ]
)
_WORDS = st.sampled_from(
    [
        "",
        *[
            "a",
            "function",
            "message",
            "user",
            "assistant",
            "developer",
            "auto",
            "required",
            "input_text",
            "input_image",
            "input_file",
            "output_text",
            "refusal",
            "reasoning",
            "function_call",
            "function_call_output",
            "custom_tool_call",
            "custom_tool_call_output",
            "custom",
            "namespace",
            "grammar",
            "allowed_tools",
            "json_schema",
            "web_search",
        ],
    ]
)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-3, 3) | _WORDS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=4),
    max_leaves=10,
)
_obj = st.dictionaries(_KEYS, _json, max_size=5)


@given(
    input=st.lists(_obj, max_size=4) | _json,
    tools=st.lists(_obj, max_size=3) | _json,
    tool_choice=_obj | _json,
    text=st.fixed_dictionaries({"format": _obj}) | _json,
    reasoning=_obj | _json,
)
@settings(max_examples=200, deadline=None)
def test_any_json_is_a_request_or_a_400_never_a_crash(
    input: Any, tools: Any, tool_choice: Any, text: Any, reasoning: Any
) -> None:
    body = {
        "model": "m",
        "input": input,
        "tools": tools,
        "tool_choice": tool_choice,
        "text": text,
        "reasoning": reasoning,
    }
    error: RequestError | None = None
    try:
        _surface().parse(json.dumps(body).encode(), {})
    except RequestError as exc:
        error = exc
    assert error is None or (error.status == 400 and error.message)


def test_non_string_types_are_400s() -> None:
    err = _error({"model": "m", "input": [{"type": ["x"]}]})
    assert (err.param, err.code) == ("input[0].type", "invalid_type")
    err = _error(
        {
            "model": "m",
            "input": "hi",
            "tools": [SHELL],
            "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": 5},
        }
    )
    assert (err.param, err.code) == ("tool_choice.tools", "invalid_type")
