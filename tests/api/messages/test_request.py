"""Anthropic Messages requests -> ChatRequest, and Anthropic-worded 400s."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from iop.api.messages import parse_count_tokens, parse_messages_request, reasoning_effort
from iop.api.messages._request import ThinkingAdaptive, ThinkingDisabled, ThinkingEnabled
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


def _body(**fields: Any) -> bytes:
    base: dict[str, Any] = {
        "model": "m",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
    }
    base.update(fields)
    return msgspec.json.encode({k: v for k, v in base.items() if v is not ...})


def _chat(**fields: Any) -> ChatRequest:
    return parse_messages_request(_body(**fields))[1]


def _error(body: bytes) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_messages_request(body)
    assert info.value.status == 400
    return info.value


def test_minimal_request() -> None:
    assert _chat() == ChatRequest(
        model="m", messages=[Message(role="user", content="hi")], max_tokens=64
    )


# --- system --------------------------------------------------------------------------


def test_system_string() -> None:
    req = _chat(system="be brief")
    assert req.messages[0] == Message(role="system", content="be brief")


def test_system_text_blocks_join_and_cache_control_is_ignored() -> None:
    system = [
        {"type": "text", "text": "one", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "two"},
    ]
    assert _chat(system=system).messages[0] == Message(role="system", content="one\ntwo")


def test_system_role_inside_messages_stays_in_place() -> None:
    # Claude Code sends these (docs/api.md).
    messages = [
        {"role": "user", "content": "a"},
        {"role": "system", "content": [{"type": "text", "text": "reminder"}]},
        {"role": "user", "content": "b"},
    ]
    assert [m.role for m in _chat(messages=messages).messages] == ["user", "system", "user"]
    assert _chat(messages=messages).messages[1].content == "reminder"


def test_system_blocks_must_be_text() -> None:
    img = {"type": "image", "source": {"type": "url", "url": "http://x/i.png"}}
    err = _error(_body(messages=[{"role": "system", "content": [img]}]))
    assert err.message == "messages.0.content.0.type: system content must be text blocks"


# --- user blocks -----------------------------------------------------------------------


def test_lone_text_block_becomes_a_string_several_become_parts() -> None:
    one = [{"role": "user", "content": [{"type": "text", "text": "x"}]}]
    assert _chat(messages=one).messages == [Message(role="user", content="x")]
    two = [
        {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}
    ]
    assert _chat(messages=two).messages == [
        Message(role="user", content=[TextPart(text="x"), TextPart(text="y")])
    ]


def test_images_base64_and_url() -> None:
    content = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
        {"type": "image", "source": {"type": "url", "url": "https://x/i.jpg"}},
        {"type": "text", "text": "what is this"},
    ]
    msg = _chat(messages=[{"role": "user", "content": content}]).messages[0]
    assert msg.content == [
        ImagePart(image_url=ImageURL(url="data:image/png;base64,AAAA")),
        ImagePart(image_url=ImageURL(url="https://x/i.jpg")),
        TextPart(text="what is this"),
    ]


def test_documents() -> None:
    content = [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"}},
        {
            "type": "document",
            "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"},
            "title": "a.pdf",
        },
    ]
    msg = _chat(messages=[{"role": "user", "content": content}]).messages[0]
    assert msg.content == [
        TextPart(text="doc"),
        FilePart(file=FileRef(file_data="data:application/pdf;base64,JVBE", filename="a.pdf")),
    ]


def test_tool_results_come_first_in_order_then_the_rest_of_the_turn() -> None:
    content = [
        {"type": "text", "text": "here you go"},
        {"type": "tool_result", "tool_use_id": "t1", "content": "one"},
        {
            "type": "tool_result",
            "tool_use_id": "t2",
            "content": [
                {"type": "text", "text": "two"},
                {"type": "image", "source": {"type": "url", "url": "https://x/s.png"}},
                {"type": "text", "text": "lines"},
            ],
        },
        {"type": "tool_result", "tool_use_id": "t3", "content": "boom", "is_error": True},
        {"type": "tool_result", "tool_use_id": "t4"},
    ]
    assert _chat(messages=[{"role": "user", "content": content}]).messages == [
        Message(role="tool", content="one", tool_call_id="t1"),
        Message(role="tool", content="two\nlines", tool_call_id="t2"),
        Message(role="tool", content="Error: boom", tool_call_id="t3"),
        Message(role="tool", content="", tool_call_id="t4"),
        # Images of tool results go to the user message, first (tool messages are text).
        Message(
            role="user",
            content=[
                ImagePart(image_url=ImageURL(url="https://x/s.png")),
                TextPart(text="here you go"),
            ],
        ),
    ]


def test_a_turn_of_only_tool_results_has_no_user_message() -> None:
    content = [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]
    assert _chat(messages=[{"role": "user", "content": content}]).messages == [
        Message(role="tool", content="ok", tool_call_id="t1")
    ]


def test_tool_use_is_refused_in_a_user_turn() -> None:
    block = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    err = _error(_body(messages=[{"role": "user", "content": [block]}]))
    assert err.message == (
        "messages.0.content.0.type: 'tool_use' blocks are only allowed in assistant messages"
    )


# --- assistant blocks ----------------------------------------------------------------------


def test_assistant_text_tool_use_and_thinking() -> None:
    content = [
        {"type": "thinking", "thinking": "hmm", "signature": "sig"},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "text", "text": "let me look"},
        {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"cmd": "ls", "n": [1]}},
        {"type": "tool_use", "id": "toolu_2", "name": "noargs", "input": {}},
    ]
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": content}]
    assert _chat(messages=msgs).messages[1] == Message(
        role="assistant",
        content="let me look",
        reasoning_content="hmm",
        tool_calls=[
            MessageToolCall(
                id="toolu_1", function=FunctionCall(name="bash", arguments='{"cmd":"ls","n":[1]}')
            ),
            MessageToolCall(id="toolu_2", function=FunctionCall(name="noargs", arguments="{}")),
        ],
    )


def test_assistant_only_tool_use_has_null_content() -> None:
    content = [{"type": "tool_use", "id": "t", "name": "f", "input": {"a": 1}}]
    msg = _chat(messages=[{"role": "assistant", "content": content}]).messages[0]
    assert msg.content is None
    assert msg.tool_calls is not None


def test_assistant_string_content() -> None:
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is ("}]
    assert _chat(messages=msgs).messages[1] == Message(role="assistant", content="The answer is (")


def test_tool_result_is_refused_in_an_assistant_turn() -> None:
    block = {"type": "tool_result", "tool_use_id": "t", "content": "x"}
    err = _error(_body(messages=[{"role": "assistant", "content": [block]}]))
    assert err.message == (
        "messages.0.content.0.type: 'tool_result' blocks are only allowed in user messages"
    )


def test_server_tool_blocks_are_dropped() -> None:
    content = [
        {"type": "server_tool_use", "id": "s1", "name": "web_search", "input": {"q": "x"}},
        {"type": "web_search_tool_result", "tool_use_id": "s1", "content": []},
        {"type": "text", "text": "found it"},
    ]
    msg = _chat(messages=[{"role": "assistant", "content": content}]).messages[0]
    assert msg == Message(role="assistant", content="found it")


def test_an_assistant_turn_of_only_redacted_thinking_vanishes() -> None:
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
    ]
    assert [m.role for m in _chat(messages=msgs).messages] == ["user"]


# --- tools and tool_choice -------------------------------------------------------------------

_TOOL = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    "cache_control": {"type": "ephemeral"},
}


def test_custom_tools_become_functions_server_tools_are_dropped() -> None:
    tools = [
        _TOOL,
        {"type": "custom", "name": "t2", "input_schema": {"type": "object"}},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        {"type": "bash_20250124", "name": "bash"},
        {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
    ]
    assert _chat(tools=tools).tools == [
        Tool(
            function=FunctionDef(
                name="get_weather",
                description="Weather for a city",
                parameters=_TOOL["input_schema"],
            )
        ),
        Tool(function=FunctionDef(name="t2", parameters={"type": "object"})),
    ]


def test_only_server_tools_means_no_tools() -> None:
    assert _chat(tools=[{"type": "web_search_20250305", "name": "web_search"}]).tools is None


def test_custom_tool_needs_input_schema() -> None:
    err = _error(_body(tools=[{"name": "f"}]))
    assert err.message == "tools.0.input_schema: Field required"
    assert err.param == "tools.0.input_schema"


@pytest.mark.parametrize(
    ("choice", "tool_choice", "parallel"),
    [
        ({"type": "auto"}, "auto", None),
        ({"type": "any"}, "required", None),
        ({"type": "none"}, "none", None),
        (
            {"type": "tool", "name": "get_weather"},
            NamedToolChoice(function=NamedFunction(name="get_weather")),
            None,
        ),
        ({"type": "auto", "disable_parallel_tool_use": True}, "auto", False),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "any", "disable_parallel_tool_use": False}, "required", None),
    ],
)
def test_tool_choice(choice: dict[str, Any], tool_choice: object, parallel: bool | None) -> None:
    req = _chat(tools=[_TOOL], tool_choice=choice)
    assert req.tool_choice == tool_choice
    assert req.parallel_tool_calls is parallel


def test_tool_choice_tool_must_name_a_tool() -> None:
    err = _error(_body(tools=[_TOOL], tool_choice={"type": "tool", "name": "nope"}))
    assert err.message == "tool_choice.name: Tool 'nope' not found in tools"


def test_tool_choice_any_needs_tools() -> None:
    err = _error(_body(tool_choice={"type": "any"}))
    assert err.message == "tool_choice: tool_choice may only be specified while providing tools"


def test_tool_choice_auto_and_none_need_no_tools() -> None:
    assert _chat(tool_choice={"type": "auto"}).tool_choice == "auto"
    assert _chat(tool_choice={"type": "none"}).tool_choice == "none"


def test_unknown_tool_choice_type() -> None:
    err = _error(_body(tool_choice={"type": "maybe"}))
    assert err.message == (
        "tool_choice.type: Input tag 'maybe' found using 'type' does not match any of the "
        "expected tags: 'auto', 'any', 'tool', 'none'"
    )


# --- sampling, thinking, metadata ------------------------------------------------------------


def test_sampling_fields() -> None:
    req = _chat(stop_sequences=["\n\nHuman:"], temperature=0.2, top_p=0.9, top_k=40, stream=True)
    assert req.stop == ["\n\nHuman:"]
    assert (req.temperature, req.top_p, req.stream) == (0.2, 0.9, True)
    assert req.extra_body == {"top_k": 40}


def test_metadata_user_id_is_the_affinity_key() -> None:
    assert _chat(metadata={"user_id": "u-42"}).user == "u-42"
    assert _chat(metadata={}).user is None


@pytest.mark.parametrize(
    ("thinking", "effort"),
    [
        ({"type": "enabled", "budget_tokens": 1024}, "low"),
        ({"type": "enabled", "budget_tokens": 4095}, "low"),
        ({"type": "enabled", "budget_tokens": 4096}, "medium"),
        ({"type": "enabled", "budget_tokens": 16383}, "medium"),
        ({"type": "enabled", "budget_tokens": 16384}, "high"),
        ({"type": "adaptive"}, None),
        ({"type": "disabled"}, None),
    ],
)
def test_thinking_to_reasoning_effort(thinking: dict[str, Any], effort: str | None) -> None:
    assert _chat(thinking=thinking).reasoning_effort == effort


def test_reasoning_effort_of_each_thinking_kind() -> None:
    assert reasoning_effort(None) is None
    assert reasoning_effort(ThinkingAdaptive()) is None
    assert reasoning_effort(ThinkingDisabled()) is None
    assert reasoning_effort(ThinkingEnabled(budget_tokens=32000)) == "high"


def test_ignored_fields_are_accepted_and_named() -> None:
    native, req = parse_messages_request(
        _body(
            context_management={"edits": [{"type": "clear_tool_uses_20250919"}]},
            output_config={"effort": "high"},
            service_tier="auto",
            container="c1",
            mcp_servers=[{"type": "url", "url": "https://x", "name": "m"}],
            some_future_beta={"x": 1},
        )
    )
    assert native.ignored == (
        "context_management",
        "service_tier",
        "container",
        "mcp_servers",
        "some_future_beta",
    )
    assert req.extra_body is None  # nothing Anthropic-only reaches the backend


def test_a_client_cannot_set_the_ignored_bookkeeping_field() -> None:
    native, _ = parse_messages_request(_body(ignored=["x"]))
    assert native.ignored == ("ignored",)


# --- errors, worded like Anthropic's ----------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        (_body(max_tokens=...), "max_tokens: Field required", "max_tokens"),
        (
            _body(max_tokens=0),
            "max_tokens: Input should be greater than or equal to 1",
            "max_tokens",
        ),
        (_body(max_tokens="5"), "max_tokens: Input should be a valid integer", "max_tokens"),
        (_body(model=...), "model: Field required", "model"),
        (_body(model=" "), "model: Field required", "model"),
        (_body(messages=...), "messages: Field required", "messages"),
        (_body(messages=[]), "messages: at least one message is required", "messages"),
        (
            _body(messages=[{"role": "bot", "content": "x"}]),
            "messages.0.role: Input should be 'user' or 'assistant'",
            "messages.0.role",
        ),
        (
            _body(messages=[{"role": "user"}]),
            "messages.0.content: Field required",
            "messages.0.content",
        ),
        (
            _body(messages=[{"role": "user", "content": [{"type": "text"}]}]),
            "messages.0.content.0.text: Field required",
            "messages.0.content.0.text",
        ),
        (
            _body(messages=[{"role": "user", "content": 5}]),
            "messages.0.content: Input should be a valid string or a valid list",
            "messages.0.content",
        ),
        (
            _body(temperature="hot"),
            "temperature: Input should be a valid number",
            "temperature",
        ),
        (
            _body(thinking={"type": "enabled"}),
            "thinking.budget_tokens: Field required",
            "thinking.budget_tokens",
        ),
        (
            _body(
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}],
                    }
                ]
            ),
            "messages.0.content.0.source.type: Input tag 'file' found using 'type' does not "
            "match any of the expected tags: 'base64', 'url', 'text'",
            "messages.0.content.0.source.type",
        ),
        (b"[1]", "Input should be a valid dictionary", None),
        (b'{"model": ', "There was an error parsing the body of your request as JSON.", None),
    ],
)
def test_errors(body: bytes, message: str, param: str | None) -> None:
    err = _error(body)
    assert err.message == message
    assert err.param == param


def test_unknown_block_type_lists_the_known_ones() -> None:
    err = _error(_body(messages=[{"role": "user", "content": [{"type": "audio"}]}]))
    assert err.message.startswith(
        "messages.0.content.0.type: Input tag 'audio' found using 'type' does not match any "
        "of the expected tags: 'text', 'image', 'document', 'tool_result', 'tool_use', "
        "'thinking', 'redacted_thinking', 'server_tool_use', "
    )


# --- count_tokens -------------------------------------------------------------------------------


def test_count_tokens_needs_no_max_tokens() -> None:
    _, req = parse_count_tokens(_body(max_tokens=...))
    assert req.max_tokens is None
    assert req.messages == [Message(role="user", content="hi")]


def test_count_tokens_shares_the_checks() -> None:
    with pytest.raises(RequestError, match=r"^messages: Field required$"):
        parse_count_tokens(_body(messages=...))


def test_a_claude_code_shaped_request() -> None:
    # What Claude Code is known to send (docs/api.md): system blocks with
    # cache_control, a system-role message, adaptive thinking,
    # context_management and output_config, metadata.user_id, custom tools.
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {
                "type": "text",
                "text": "You are Claude Code.",
                "cache_control": {"type": "ephemeral"},
            },
            {"type": "text", "text": "Be terse."},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                    {"type": "text", "text": "run ls", "cache_control": {"type": "ephemeral"}},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "need ls", "signature": ""},
                    {
                        "type": "tool_use",
                        "id": "toolu_01",
                        "name": "Bash",
                        "input": {"command": "ls"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_01", "content": "a.txt\nb.txt"},
                    {"type": "text", "text": "<system-reminder>todo</system-reminder>"},
                ],
            },
            {"role": "system", "content": "late reminder"},
        ],
        "tools": [
            {
                "name": "Bash",
                "description": "Run a shell command",
                "input_schema": {
                    "type": "object",
                    "properties": {"command": {"type": "string"}},
                    "required": ["command"],
                    "additionalProperties": False,
                    "$schema": "http://json-schema.org/draft-07/schema#",
                },
            }
        ],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
        "metadata": {"user_id": "user_abc_account__session_123"},
        "temperature": 1,
    }
    native, req = parse_messages_request(msgspec.json.encode(body))
    assert native.ignored == ("context_management",)
    assert req.reasoning_effort is None  # output_config.effort is not sent
    assert [m.role for m in req.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "user",
        "system",
    ]
    assert req.messages[0].content == "You are Claude Code.\nBe terse."
    assert req.messages[3] == Message(role="tool", content="a.txt\nb.txt", tool_call_id="toolu_01")
    assert req.messages[2].tool_calls == [
        MessageToolCall(
            id="toolu_01", function=FunctionCall(name="Bash", arguments='{"command":"ls"}')
        )
    ]
    assert req.user == "user_abc_account__session_123"
    assert (req.stream, req.max_tokens, req.tool_choice, req.reasoning_effort) == (
        True,
        32000,
        "auto",
        None,
    )
    assert req.temperature == 1.0


def test_output_config_format_is_a_json_schema_response_format() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    _, chat = parse_messages_request(
        _body(
            output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"},
            thinking={"type": "enabled", "budget_tokens": 20000},
        )
    )
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": True},
    }
    assert chat.reasoning_effort == "high"  # from thinking; effort is not sent
    req, chat = parse_messages_request(_body(output_config={}))
    assert chat.response_format is None
    assert "output_config" not in req.ignored


def test_an_output_format_that_is_not_a_json_schema_is_refused() -> None:
    with pytest.raises(RequestError, match=r"output_config\.format"):
        parse_messages_request(_body(output_config={"format": {"type": "text"}}))
