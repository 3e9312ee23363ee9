"""The simulated model's script: deterministic, capped, tool-aware (sans-IO)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

import iop.sim
from iop.config import SimConfig
from iop.errors import RequestError
from iop.events import FinishReason
from iop.sim import (
    AUTO_TOOL_CHOICE_ERROR,
    ContentToken,
    ReasoningToken,
    SimScript,
    ToolArgs,
    ToolCallBegin,
    build_script,
    effective_config,
)
from iop.sim._script import _fragments
from iop.spec import (
    ChatRequest,
    FunctionDef,
    Message,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
    Tool,
)
from iop.spec import FunctionCall as MsgFunctionCall
from iop.wire._tool_prompt import fallback_messages

WEATHER = Tool(
    function=FunctionDef(
        name="get_weather",
        parameters={
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
                "threshold": {"type": "number"},
                "alerts": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
            },
            "required": ["city"],
        },
    )
)
CLOCK = Tool(function=FunctionDef(name="get_time", parameters={"type": "object", "properties": {}}))


def req(text: str = "hello there", **kw: Any) -> ChatRequest:
    return ChatRequest(model="iop-sim", messages=[Message(role="user", content=text)], **kw)


def test_same_request_and_config_give_identical_scripts() -> None:
    cfg = SimConfig(output_tokens=40, reasoning_tokens=5, seed=3)
    a = build_script(req(tools=[WEATHER]), cfg)
    b = build_script(req(tools=[WEATHER]), cfg)
    assert msgspec.json.encode(a) == msgspec.json.encode(b)
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", a.completion_id)


def test_determinism_holds_across_interpreters() -> None:
    # Python's hash() is salted per process; the script must not depend on it.
    code = (
        "from iop.sim import build_script; from iop.config import SimConfig;"
        "from iop.spec import ChatRequest, Message;"
        "r = ChatRequest(model='m', messages=[Message(role='user', content='x y z')]);"
        "s = build_script(r, SimConfig(output_tokens=20, seed=9));"
        "print(s.completion_id, s.content)"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1


def test_seed_and_messages_change_the_text() -> None:
    base = build_script(req(), SimConfig(seed=0))
    assert build_script(req(), SimConfig(seed=1)).content != base.content
    assert build_script(req("something else"), SimConfig(seed=0)).content != base.content


def test_plain_answer_has_output_tokens_and_stop() -> None:
    s = build_script(req(), SimConfig(output_tokens=25))
    assert all(isinstance(x, ContentToken) for x in s.steps)
    assert len(s.steps) == 25
    assert s.finish_reason is FinishReason.STOP
    assert s.completion_tokens == 26  # the end-of-sequence token counts, as in vLLM
    assert s.content[0].isupper()
    assert s.tool_call is None


def test_reasoning_comes_first() -> None:
    s = build_script(req(), SimConfig(output_tokens=4, reasoning_tokens=3))
    kinds = [type(x) for x in s.steps]
    assert kinds == [ReasoningToken] * 3 + [ContentToken] * 4
    assert s.reasoning_tokens == 3
    assert s.reasoning


def test_delays_follow_ttft_and_rate() -> None:
    s = build_script(req(), SimConfig(output_tokens=4, ttft_s=0.5, tokens_per_s=10))
    assert [x.delay_s for x in s.steps] == [0.5, 0.1, 0.1, 0.1]
    assert s.finish_delay_s == pytest.approx(0.1)
    assert s.total_delay_s == pytest.approx(0.9)
    empty = build_script(req(), SimConfig(output_tokens=0, ttft_s=0.5))
    assert empty.steps == ()
    assert empty.finish_delay_s == 0.5


def test_prompt_tokens_grow_with_the_prompt() -> None:
    short = build_script(req("a b"), SimConfig())
    long = build_script(req("a b c d e f g h"), SimConfig())
    assert long.prompt_tokens - short.prompt_tokens == 6
    assert (
        build_script(req("a b", tools=[WEATHER]), SimConfig()).prompt_tokens > short.prompt_tokens
    )


@pytest.mark.parametrize(
    ("kw", "cap"),
    [
        ({"max_tokens": 5}, 5),
        ({"max_completion_tokens": 3, "max_tokens": 50}, 3),
    ],
)
def test_token_cap_gives_length(kw: dict[str, Any], cap: int) -> None:
    s = build_script(req(**kw), SimConfig(output_tokens=20, reasoning_tokens=2))
    assert len(s.steps) == cap
    assert s.finish_reason is FinishReason.LENGTH
    assert s.completion_tokens == cap  # no end-of-sequence token when cut


def test_cap_above_the_answer_changes_nothing() -> None:
    s = build_script(req(max_tokens=100), SimConfig(output_tokens=10))
    assert s.finish_reason is FinishReason.STOP
    assert len(s.steps) == 10


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_cap_below_one_is_rejected(field: str) -> None:
    kw: dict[str, Any] = {field: 0}
    with pytest.raises(RequestError, match=f"{field} must be at least 1, got 0"):
        build_script(req(**kw), SimConfig())


def _args(s: SimScript) -> dict[str, Any]:
    call = s.tool_call
    assert call is not None
    parsed = json.loads(call.arguments)
    assert isinstance(parsed, dict)
    return parsed


def test_native_tool_call_from_schema() -> None:
    s = build_script(req(tools=[WEATHER, CLOCK]), SimConfig(output_tokens=10))
    assert isinstance(s.steps[0], ToolCallBegin)
    assert all(isinstance(x, ToolArgs) for x in s.steps[1:])
    assert s.finish_reason is FinishReason.TOOL_CALLS
    call = s.tool_call
    assert call is not None
    assert call.name == "get_weather"  # the first tool
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call.id)
    args = _args(s)
    assert list(args) == ["city", "unit", "days", "threshold", "alerts", "tags", "where"]
    assert isinstance(args["city"], str)
    assert args["unit"] in ("celsius", "fahrenheit")
    assert isinstance(args["days"], int)
    assert isinstance(args["threshold"], float)
    assert isinstance(args["alerts"], bool)
    assert isinstance(args["tags"], list)
    assert isinstance(args["tags"][0], str)
    assert isinstance(args["where"]["lat"], float)
    assert s.content == ""


def test_named_tool_choice_calls_that_tool_and_finishes_stop() -> None:
    choice = NamedToolChoice(function=NamedFunction(name="get_time"))
    s = build_script(req(tools=[WEATHER, CLOCK], tool_choice=choice), SimConfig())
    assert s.tool_call is not None
    assert s.tool_call.name == "get_time"
    assert _args(s) == {}
    # vLLM main: "stop" for a named choice, "tool_calls" for auto/required.
    assert s.finish_reason is FinishReason.STOP


def test_required_calls_the_first_tool() -> None:
    s = build_script(req(tools=[CLOCK, WEATHER], tool_choice="required"), SimConfig())
    assert s.tool_call is not None
    assert s.tool_call.name == "get_time"
    assert s.finish_reason is FinishReason.TOOL_CALLS


def test_tool_choice_none_and_tool_mode_none_answer_text() -> None:
    a = build_script(req(tools=[WEATHER], tool_choice="none"), SimConfig(output_tokens=5))
    b = build_script(req(tools=[WEATHER]), SimConfig(output_tokens=5, tool_mode="none"))
    for s in (a, b):
        assert s.tool_call is None
        assert len(s.steps) == 5
        assert s.finish_reason is FinishReason.STOP


def test_after_a_tool_result_auto_answers_text() -> None:
    messages = [
        Message(role="user", content="weather?"),
        Message(
            role="assistant",
            tool_calls=[
                MessageToolCall(
                    id="c1", function=MsgFunctionCall(name="get_weather", arguments="{}")
                )
            ],
        ),
        Message(role="tool", tool_call_id="c1", content="sunny"),
    ]
    r = ChatRequest(model="iop-sim", messages=messages, tools=[WEATHER])
    s = build_script(r, SimConfig(output_tokens=6))
    assert s.tool_call is None
    assert len(s.steps) == 6
    forced = build_script(msgspec.structs.replace(r, tool_choice="required"), SimConfig())
    assert forced.tool_call is not None


def test_text_mode_prints_a_hermes_call_in_content() -> None:
    s = build_script(req(tools=[WEATHER]), SimConfig(tool_mode="text"))
    assert s.tool_call is None
    assert s.finish_reason is FinishReason.STOP
    m = re.fullmatch(r"<tool_call>(.*)</tool_call>", s.content)
    assert m is not None
    call = json.loads(m.group(1))
    assert call["name"] == "get_weather"
    assert call["arguments"] == _args(build_script(req(tools=[WEATHER]), SimConfig()))


def test_tools_described_in_the_system_prompt_get_a_hermes_call() -> None:
    # What the vLLM adapter's text-tool fallback sends: no tools, a <tools> prompt.
    messages = fallback_messages(
        [Message(role="system", content="Be brief."), Message(role="user", content="weather?")],
        [WEATHER, CLOCK],
    )
    s = build_script(ChatRequest(model="iop-sim", messages=messages), SimConfig())
    m = re.fullmatch(r"<tool_call>(.*)</tool_call>", s.content)
    assert m is not None
    call = json.loads(m.group(1))
    assert call["name"] == "get_weather"
    assert isinstance(call["arguments"]["days"], int)


def test_qwen_style_tool_lines_are_understood() -> None:
    line = json.dumps({"type": "function", "function": {"name": "get_time", "parameters": {}}})
    system = f"# Tools\n<tools>\n{line}\nnot json\n</tools>"
    r = ChatRequest(
        model="iop-sim",
        messages=[Message(role="system", content=system), Message(role="user", content="time?")],
    )
    assert json.loads(build_script(r, SimConfig()).content[11:-12])["name"] == "get_time"


def test_overrides_from_extra_body() -> None:
    r = req(extra_body={"iop_sim": {"output_tokens": 3, "failure": "truncate", "ttft_s": 2}})
    s = build_script(r, SimConfig(output_tokens=50))
    assert len(s.steps) == 3
    assert s.config.failure == "truncate"
    assert s.config.ttft_s == 2.0
    assert effective_config(req(), SimConfig(seed=4)) == SimConfig(seed=4)


@pytest.mark.parametrize(
    "override",
    [{"output_tokenz": 3}, {"failure": "explode"}, {"ttft_s": "soon"}, "fast"],
)
def test_invalid_overrides_are_request_errors(override: Any) -> None:
    with pytest.raises(RequestError, match="iop_sim") as info:
        build_script(req(extra_body={"iop_sim": override}), SimConfig())
    assert info.value.status == 400
    assert info.value.param == "iop_sim"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"tools": [WEATHER]}, AUTO_TOOL_CHOICE_ERROR),
        ({"tools": [WEATHER], "tool_choice": "auto"}, AUTO_TOOL_CHOICE_ERROR),
        (
            {"tools": [WEATHER], "tool_choice": "required"},
            'tool_choice="required" requires --tool-call-parser to be set',
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": NamedToolChoice(function=NamedFunction(name="get_weather")),
            },
            "tool_choice=\"function=ChatCompletionNamedFunction(name='get_weather') "
            "type='function'\" requires --tool-call-parser to be set",
        ),
    ],
)
def test_without_auto_tool_choice_tools_get_vllms_400(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError) as info:
        build_script(req(**kw), SimConfig(auto_tool_choice=False))
    assert info.value.message == message
    assert info.value.status == 400


def test_without_auto_tool_choice_none_choice_and_no_tools_pass() -> None:
    cfg = SimConfig(auto_tool_choice=False, output_tokens=2)
    assert build_script(req(tools=[WEATHER], tool_choice="none"), cfg).tool_call is None
    assert len(build_script(req(), cfg).steps) == 2


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"tool_choice": "auto"}, "When using `tool_choice`, `tools` must be set."),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "Invalid value for `tool_choice`"),
        (
            {"tools": [WEATHER], "tool_choice": NamedToolChoice(function=NamedFunction(name="x"))},
            "does not match any of the specified `tools`",
        ),
    ],
)
def test_invalid_tool_usage(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError, match=re.escape(message)):
        build_script(req(**kw), SimConfig())


@given(st.text())
def test_fragments_always_join_back(text: str) -> None:
    assert "".join(_fragments(text)) == text


def test_sans_io_modules_import_no_io_library() -> None:
    code = (
        "import sys, iop.sim, iop.sim._script, iop.sim._vllm_wire, iop.sim._completions,"
        " iop.sim._embeddings, iop.sim._tokenizer, iop.sim._tokenize_api;"
        # The in-process adapter's future operations: usable with no IO library.
        "iop.sim.embedding_vector('x', dim=4); iop.sim.tokenize('x');"
        "iop.sim.build_completion_script("
        'iop.sim.parse_completion_request(b\'{"prompt": "x"}\'), iop.sim._script.SimConfig());'
        "print(','.join(m for m in ('trio','httpx','quart','quart_trio','hypercorn','anyio')"
        " if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == ""
    # And not even lazily, inside a function.
    for name in (
        "__init__.py",
        "_script.py",
        "_vllm_wire.py",
        "_completions.py",
        "_embeddings.py",
        "_tokenizer.py",
        "_tokenize_api.py",
    ):
        tree = ast.parse((Path(iop.sim.__file__).parent / name).read_text())
        imported = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {
            (node.module or "").split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
        }
        assert not imported & {"trio", "httpx", "quart", "quart_trio", "hypercorn", "anyio"}


def test_public_surface() -> None:
    for name in iop.sim.__all__:
        assert hasattr(iop.sim, name), name


def _content(script: SimScript) -> str:
    return "".join(s.text for s in script.steps if isinstance(s, ContentToken))


def test_a_json_schema_response_format_answers_json_of_the_schema() -> None:
    import jsonschema

    schema = WEATHER.function.parameters
    req = ChatRequest(
        model="iop-sim",
        messages=[Message(role="user", content="weather?")],
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
    )
    script = build_script(req, SimConfig())
    answer = json.loads(_content(script))
    jsonschema.validate(answer, schema)
    assert set(answer) == set(schema["properties"])  # type: ignore[index]
    assert script == build_script(req, SimConfig())  # deterministic


def test_a_json_object_response_format_answers_an_object_and_text_answers_words() -> None:
    def ask(fmt: dict[str, Any] | None) -> str:
        req = ChatRequest(
            model="iop-sim", messages=[Message(role="user", content="x")], response_format=fmt
        )
        return _content(build_script(req, SimConfig()))

    assert isinstance(json.loads(ask({"type": "json_object"})), dict)
    with pytest.raises(json.JSONDecodeError):
        json.loads(ask({"type": "text"}))
    with pytest.raises(json.JSONDecodeError):
        json.loads(ask(None))


def test_leading_system_only_refuses_a_late_system_message_like_a_strict_template() -> None:
    late = ChatRequest(
        model="iop-sim",
        messages=[
            Message(role="system", content="a"),
            Message(role="user", content="b"),
            Message(role="system", content="c"),
        ],
    )
    build_script(late, SimConfig())  # the default takes them anywhere
    with pytest.raises(RequestError, match="System message must be at the beginning"):
        build_script(late, SimConfig(leading_system_only=True))
    first = msgspec.structs.replace(late, messages=late.messages[:2])
    build_script(first, SimConfig(leading_system_only=True))
