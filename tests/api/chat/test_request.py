"""Chat-completions request bodies: parse_chat_request and its OpenAI-style 400s."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iop.api._openai_errors import error_body, openai_error_type
from iop.api.chat._request import parse_chat_request
from iop.errors import RequestError
from iop.spec import (
    ChatRequest,
    ImagePart,
    NamedToolChoice,
    StreamOptions,
    TextPart,
)
from tests.edge._openai_schema import validate_error

USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [USER], **fields}).encode()


def reject(raw: bytes) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_chat_request(raw)
    err = info.value
    assert err.status == 400
    assert err.message
    # What the HTTP layer will send for it is a valid OpenAI error body.
    validate_error(
        json.loads(
            error_body(
                err.message, type=openai_error_type(err.status), code=err.code, param=err.param
            )
        )
    )
    return err


@pytest.mark.parametrize(
    ("raw", "param", "code", "message"),
    [
        (b"{", None, "invalid_json", "We could not parse the JSON body of your request."),
        (b"", None, "invalid_json", "We could not parse the JSON body"),
        (b"\xff\xfe", None, "invalid_json", "not valid JSON"),
        (b'{"model": "m", "messages": []} trailing', None, "invalid_json", "could not parse"),
        (b"[1, 2]", None, "invalid_type", "expected a JSON object"),
        (b'"just a string"', None, "invalid_type", "expected a JSON object"),
        (
            b'{"messages": [{"role": "user"}]}',
            "model",
            "missing_required_parameter",
            "Missing required parameter: 'model'.",
        ),
        (
            b'{"model": "  ", "messages": [{"role": "user"}]}',
            "model",
            "missing_required_parameter",
            "Missing required parameter: 'model'.",
        ),
        (
            b'{"model": "m"}',
            "messages",
            "missing_required_parameter",
            "Missing required parameter: 'messages'.",
        ),
        (
            b'{"model": "m", "messages": []}',
            "messages",
            "empty_array",
            "Invalid 'messages': empty array.",
        ),
        (
            b'{"model": 5, "messages": []}',
            "model",
            "invalid_type",
            "Invalid type for 'model': expected a string, but got an integer instead.",
        ),
        (b'{"model": null, "messages": []}', "model", "invalid_type", "but got null instead"),
        (
            b'{"model": "m", "messages": {}}',
            "messages",
            "invalid_type",
            "expected an array, but got an object instead",
        ),
        (
            b'{"model": "m", "messages": ["hi"]}',
            "messages[0]",
            "invalid_type",
            "Invalid type for 'messages[0]': expected an object, but got a string instead.",
        ),
        (
            b'{"model": "m", "messages": [{"content": "x"}]}',
            "messages[0].role",
            "missing_required_parameter",
            "Missing required parameter: 'messages[0].role'.",
        ),
        (
            b'{"model": "m", "messages": [{"role": "robot"}]}',
            "messages[0].role",
            "invalid_value",
            "Invalid value: 'robot'. Supported values are: 'system', 'developer', 'user', "
            "'assistant', 'tool', and 'function'.",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": 3}]}',
            "messages[0].content",
            "invalid_type",
            "Invalid type for 'messages[0].content': expected one of a string, an array or null, "
            "but got an integer instead.",
        ),
        (
            b'{"model": "m", "messages": [USER, {"role": "user", "content": [{"type": "video"}]}]}'.replace(
                b"USER", json.dumps(USER).encode()
            ),
            "messages[1].content[0].type",
            "invalid_value",
            "Invalid value: 'video'.",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}',
            "messages[0].content[0].text",
            "missing_required_parameter",
            "Missing required parameter: 'messages[0].content[0].text'.",
        ),
        (
            body(stream="yes"),
            "stream",
            "invalid_type",
            "Invalid type for 'stream': expected a boolean, but got a string instead.",
        ),
        (body(temperature="hot"), "temperature", "invalid_type", "expected one of a number"),
        (body(stop=[1]), "stop[0]", "invalid_type", "Invalid type for 'stop[0]'"),
        (
            body(tools=[{"type": "web", "function": {"name": "f"}}]),
            "tools[0].type",
            "invalid_value",
            "Supported values are: 'function'.",
        ),
        (
            body(tools=[{"type": "function"}]),
            "tools[0].function",
            "missing_required_parameter",
            "Missing required parameter: 'tools[0].function'.",
        ),
        (
            body(stream_options={"include_usage": True}),
            "stream_options",
            "invalid_value",
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
        ),
        (
            body(stream=False, stream_options={"include_usage": True}),
            "stream_options",
            "invalid_value",
            "only allowed when 'stream' is enabled",
        ),
        (body(n=2), "n", "unsupported_value", "only one choice per request is supported"),
        (body(n=0), "n", "integer_below_min_value", "Expected a value >= 1, but got 0"),
        (
            body(tool_choice="sometimes", tools=[TOOL]),
            "tool_choice",
            "invalid_value",
            "Invalid value for 'tool_choice': 'sometimes'.",
        ),
        (body(tool_choice=7), "tool_choice", "invalid_type", "Invalid type for 'tool_choice'"),
        (
            body(tool_choice="required"),
            "tool_choice",
            "invalid_value",
            "'tool_choice' is only allowed when 'tools' are specified.",
        ),
        (
            body(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
            "tool_choice",
            "invalid_value",
            "only allowed when 'tools' are specified",
        ),
        (
            body(tool_choice={"type": "function", "function": {"name": "get_time"}}, tools=[TOOL]),
            "tool_choice",
            "invalid_value",
            "function 'get_time' is not one of the functions in 'tools'.",
        ),
    ],
)
def test_errors(raw: bytes, param: str | None, code: str, message: str) -> None:
    err = reject(raw)
    assert err.param == param
    assert err.code == code
    assert message in err.message


def test_minimal_request() -> None:
    req = parse_chat_request(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}')
    assert req.model == "m"
    assert req.messages[0].text() == "hi"
    assert req.extra_body is None  # nothing unknown: no dict built
    assert not req.stream


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_auto_and_none_tool_choice_need_no_tools(choice: str) -> None:
    assert parse_chat_request(body(tool_choice=choice)).tool_choice == choice


def test_stream_options_null_without_stream_is_fine() -> None:
    assert parse_chat_request(body(stream_options=None)).stream_options is None


def test_n_one_is_fine() -> None:
    assert parse_chat_request(body(n=1)).n == 1


def test_unknown_keys_land_in_extra_body() -> None:
    req = parse_chat_request(
        body(
            top_k=20,
            chat_template_kwargs={"enable_thinking": False},
            repetition_penalty=1.1,
            min_p=None,
        )
    )
    assert req.extra_body == {
        "top_k": 20,
        "chat_template_kwargs": {"enable_thinking": False},
        "repetition_penalty": 1.1,
        "min_p": None,
    }


def test_unknown_keys_merge_over_a_literal_extra_body() -> None:
    req = parse_chat_request(body(extra_body={"top_k": 1, "a": 1}, top_k=2))
    assert req.extra_body == {"top_k": 2, "a": 1}
    assert parse_chat_request(body(extra_body={"a": 1})).extra_body == {"a": 1}


def test_realistic_openai_sdk_request_parses() -> None:
    """The exact bytes the official SDK sends for a full agent-style request."""
    seen: list[bytes] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request.read())
        return httpx2.Response(
            200, headers={"content-type": "text/event-stream"}, content=b"data: [DONE]\n\n"
        )

    with httpx2.Client(transport=httpx2.MockTransport(handler)) as http:
        client = openai.OpenAI(
            api_key="k", base_url="http://edge.test/v1", http_client=http, max_retries=0
        )
        stream = client.chat.completions.create(
            model="qwen3-8b",
            messages=[
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Weather here?"},
                        {
                            "type": "image_url",
                            "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"},
                        },
                    ],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
                {"role": "assistant", "content": [{"type": "text", "text": "21 degrees."}]},
                {"role": "user", "content": "And tomorrow?", "name": "ana"},
            ],
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "Current weather",
                        "parameters": {
                            "type": "object",
                            "properties": {"city": {"type": "string"}},
                            "required": ["city"],
                        },
                        "strict": True,
                    },
                }
            ],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0.2,
            top_p=0.9,
            max_completion_tokens=256,
            stop=["\n\n"],
            seed=7,
            presence_penalty=0.1,
            frequency_penalty=0.2,
            logit_bias={"50256": -100},
            user="u-1",
            reasoning_effort="low",
            response_format={"type": "text"},
            extra_body={"top_k": 20, "chat_template_kwargs": {"enable_thinking": False}},
        )
        assert list(stream) == []
    [raw] = seen
    req = parse_chat_request(raw)
    assert isinstance(req, ChatRequest)
    assert req.model == "qwen3-8b"
    assert [m.role for m in req.messages] == [
        "developer",
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
    ]
    parts = req.messages[1].content
    assert isinstance(parts, list)
    assert isinstance(parts[0], TextPart)
    assert isinstance(parts[1], ImagePart)
    assert parts[1].image_url.detail == "low"
    calls = req.messages[2].tool_calls
    assert calls is not None
    assert [(c.id, c.type, c.function.name, c.function.arguments) for c in calls] == [
        ("call_1", "function", "get_weather", '{"city":"Paris"}')
    ]
    assert req.messages[3].tool_call_id == "call_1"
    assert req.messages[4].text() == "21 degrees."
    assert req.messages[5].name == "ana"
    assert req.tool_names() == ["get_weather"]
    assert isinstance(req.tool_choice, NamedToolChoice)
    assert req.stream
    assert req.stream_options == StreamOptions(include_usage=True)
    assert (req.temperature, req.top_p, req.max_completion_tokens, req.seed) == (0.2, 0.9, 256, 7)
    assert req.stop == ["\n\n"]
    assert req.parallel_tool_calls is False
    assert req.logit_bias == {"50256": -100}
    assert req.reasoning_effort == "low"
    assert req.extra_body == {"top_k": 20, "chat_template_kwargs": {"enable_thinking": False}}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=10,
)
field_values = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.text(max_size=5), json_values),
        "messages": st.one_of(
            st.lists(
                st.fixed_dictionaries(
                    {"role": st.sampled_from(["user", "assistant", "tool", "x"])},
                    optional={"content": json_values, "tool_calls": json_values},
                ),
                max_size=2,
            ),
            json_values,
        ),
        "stream": json_values,
        "stream_options": json_values,
        "tools": json_values,
        "tool_choice": json_values,
        "n": json_values,
        "top_k": json_values,
    },
)


def outcome(raw: bytes) -> ChatRequest | RequestError:
    try:
        return parse_chat_request(raw)
    except RequestError as err:
        return err


@settings(max_examples=300, deadline=None)
@given(obj=st.one_of(field_values, json_values))
def test_property_any_json_is_a_request_or_a_400(obj: Any) -> None:
    result = outcome(json.dumps(obj).encode())
    if isinstance(result, RequestError):
        assert result.status == 400
        assert result.message
        assert result.param is None or isinstance(result.param, str)
    else:
        assert result.model.strip()
        assert result.messages


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=40))
def test_property_any_bytes_is_a_request_or_a_400(raw: bytes) -> None:
    result = outcome(raw)
    assert isinstance(result, ChatRequest) or result.status == 400


# --- hostile input: depth, encoding, integers the link cannot carry, ranges ----------------

DEEP = 200  # far above the default limit, far below Python's recursion limit
TOO_DEEP_BODIES = {
    "known key": b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
    b'"response_format": ' + b"[" * DEEP + b"]" * DEEP + b"}",
    "unknown key": b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
    b'"zz": ' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}",
    "content": b'{"model": "m", "messages": [{"role": "user", "content": '
    + b"[" * DEEP
    + b"]" * DEEP
    + b"}]}",
    "messages": b'{"model": "m", "messages": ' + b"[" * DEEP + b"]" * DEEP + b"}",
    # Beyond what msgspec's own recursion limit allows: its RecursionError is ours to map.
    "recursion limit": b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
    b'"zz": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "unclosed": b'{"model": "m", "zz": ' + b"[" * 100_000,
}


@pytest.mark.parametrize("where", sorted(TOO_DEEP_BODIES))
def test_json_nested_too_deeply_is_a_400(where: str) -> None:
    err = reject(TOO_DEEP_BODIES[where])
    if where != "unclosed":  # truncated: "invalid JSON" is as true
        assert err.code == "json_too_deep"
        assert "nested too deeply" in err.message


def test_nesting_up_to_the_limit_is_fine() -> None:
    limit = 10
    # The body object is level 1, "zz" 2: 8 more levels reach the limit exactly.
    fits = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "zz": '
    ok = parse_chat_request(fits + b"[" * 9 + b"]" * 9 + b"}", max_depth=limit)
    assert ok.extra_body is not None
    err = reject_with(fits + b"[" * 10 + b"]" * 10 + b"}", max_depth=limit)
    assert err.code == "json_too_deep"
    assert "10" in err.message


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    text = '[{"\\"[[[' * 500
    req = parse_chat_request(body(messages=[{"role": "user", "content": text}]), max_depth=8)
    assert req.messages[0].content == text


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "messages": [{"role": "user", "content": "h\xff\xfei"}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "zz": "\xc3("}',
        b'{"model": "m\xed\xa0\x80", "messages": [{"role": "user", "content": "hi"}]}',
    ],
)
def test_invalid_utf8_inside_a_string_is_a_400(raw: bytes) -> None:
    assert reject(raw).code == "invalid_json"


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"seed": -(2**63) - 1}, "seed", "integer_below_min_value"),
        ({"seed": 2**63}, "seed", "integer_above_max_value"),
        ({"max_tokens": 2**90}, "max_tokens", "integer_above_max_value"),
        ({"max_completion_tokens": 2**64}, "max_completion_tokens", "integer_above_max_value"),
        ({"top_k": -(2**70)}, "top_k", "integer_below_min_value"),
        ({"zz": {"a": [1, {"b": 2**64}]}}, "zz.a[1].b", "integer_above_max_value"),
        ({"extra_body": {"top_k": 2**64}}, "extra_body.top_k", "integer_above_max_value"),
        (
            {"tools": [{**TOOL, "function": {"name": "f", "parameters": {"maximum": 2**80}}}]},
            "tools[0].function.parameters.maximum",
            "integer_above_max_value",
        ),
        ({"options": {"num_ctx": 2**65}}, "options.num_ctx", "integer_above_max_value"),
        ({"zz": [0] * 1000 + [2**64]}, "zz[1000]", "integer_above_max_value"),
    ],
)
def test_integers_the_link_cannot_carry_are_a_400_naming_the_field(
    fields: dict[str, Any], param: str, code: str
) -> None:
    err = reject(body(**fields))
    assert (err.param, err.code) == (param, code)
    assert f"'{param}'" in err.message


def test_integers_at_the_links_bounds_are_carried() -> None:
    req = parse_chat_request(body(seed=-(2**63), zz=2**64 - 1, max_tokens=2**63 - 1))
    assert req.seed == -(2**63)
    assert req.extra_body == {"zz": 2**64 - 1}


@pytest.mark.parametrize(
    ("fields", "param", "code", "message"),
    [
        (
            {"temperature": 99},
            "temperature",
            "decimal_above_max_value",
            "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, "
            "but got 99 instead.",
        ),
        ({"temperature": -0.5}, "temperature", "decimal_below_min_value", "but got -0.5 instead"),
        ({"top_p": 5}, "top_p", "decimal_above_max_value", "Expected a value <= 1"),
        ({"top_p": -1}, "top_p", "decimal_below_min_value", "Expected a value >= 0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "decimal_above_max_value", "<= 2"),
        ({"presence_penalty": -3}, "presence_penalty", "decimal_below_min_value", ">= -2"),
        ({"frequency_penalty": 7}, "frequency_penalty", "decimal_above_max_value", "<= 2"),
        ({"frequency_penalty": -2.01}, "frequency_penalty", "decimal_below_min_value", ">= -2"),
        ({"top_logprobs": 21}, "top_logprobs", "integer_above_max_value", "<= 20"),
        ({"top_logprobs": -1}, "top_logprobs", "integer_below_min_value", ">= 0"),
        ({"n": 0}, "n", "integer_below_min_value", ">= 1"),
        ({"n": 129}, "n", "integer_above_max_value", "<= 128"),
        ({"max_tokens": 0}, "max_tokens", "integer_below_min_value", ">= 1"),
        ({"max_completion_tokens": -5}, "max_completion_tokens", "integer_below_min_value", ">= 1"),
        ({"logit_bias": {"50256": 101}}, "logit_bias.50256", "decimal_above_max_value", "<= 100"),
        ({"logit_bias": {"1": -100.5}}, "logit_bias.1", "decimal_below_min_value", ">= -100"),
        ({"temperature": 1e308}, "temperature", "decimal_above_max_value", "<= 2"),
    ],
)
def test_out_of_range_values_are_a_400_worded_like_openai(
    fields: dict[str, Any], param: str, code: str, message: str
) -> None:
    err = reject(body(**fields))
    assert (err.param, err.code) == (param, code)
    assert message in err.message


def test_a_number_beyond_a_double_is_a_400() -> None:
    err = reject(body().replace(b'"model"', b'"temperature": 1e400, "model"'))
    assert err.code == "invalid_value"
    assert "out of range" in err.message


def test_values_at_the_range_bounds_are_fine() -> None:
    req = parse_chat_request(
        body(
            temperature=2,
            top_p=0,
            presence_penalty=-2,
            frequency_penalty=2,
            top_logprobs=20,
            logprobs=True,
            logit_bias={"1": -100, "2": 100},
            max_tokens=1,
            max_completion_tokens=1,
            n=1,
        )
    )
    assert (req.temperature, req.top_p, req.top_logprobs) == (2, 0, 20)


def test_unknown_top_level_parameters_keep_passing_through() -> None:
    # Range checks are for what OpenAI documents; extensions are the backend's to judge.
    req = parse_chat_request(body(top_k=-1, min_p=7.5, repetition_penalty=99))
    assert req.extra_body == {"top_k": -1, "min_p": 7.5, "repetition_penalty": 99}


def reject_with(raw: bytes, **kw: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_chat_request(raw, **kw)
    assert info.value.status == 400
    return info.value
