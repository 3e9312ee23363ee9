"""The sim's scripted tool mode: an exact tool call, then an answer quoting its result."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from iop.adapters.sim import SimAdapter
from iop.cli import build_parser
from iop.cli._sim import sim_config_from_args
from iop.cli._up import embedded_instances, up_config_from_args
from iop.config import SimConfig, SimInstance
from iop.errors import ConfigError, RequestError
from iop.events import Complete, Delta, FinishReason
from iop.runtime import collect_run
from iop.sim import TOOL_RESULT_QUOTE_CHARS, build_script, parse_chat_request
from iop.spec import (
    ChatRequest,
    ExecutionSpec,
    FunctionDef,
    Message,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
    Tool,
)
from iop.spec import FunctionCall as MsgFunctionCall
from iop.wire._tool_prompt import fallback_messages

COMMAND = '{"command": "echo iop-tool-ok"}'
AGENTS = SimConfig(ttft_s=0.0, tool_call_names=("shell", "Bash"), tool_call_arguments=COMMAND)


def tool(name: str) -> Tool:
    schema = {"type": "object", "properties": {"command": {"type": "string"}}}
    return Tool(function=FunctionDef(name=name, parameters=schema))


def first_turn(*tools: Tool, **kw: Any) -> ChatRequest:
    return ChatRequest(
        model="iop-sim",
        messages=[Message(role="user", content="run it")],
        tools=list(tools),
        **kw,
    )


def after_result(result: str, *tools: Tool) -> ChatRequest:
    call = MessageToolCall(
        id="call-1", function=MsgFunctionCall(name=tools[0].function.name, arguments=COMMAND)
    )
    return ChatRequest(
        model="iop-sim",
        messages=[
            Message(role="user", content="run it"),
            Message(role="assistant", tool_calls=[call]),
            Message(role="tool", tool_call_id="call-1", content=result),
        ],
        tools=list(tools),
    )


@pytest.mark.parametrize("declared", ["Bash", "shell"])
def test_first_turn_calls_the_declared_candidate_with_the_exact_arguments(declared: str) -> None:
    # Claude Code declares Bash, Codex its shell tool: one config fits both.
    script = build_script(first_turn(tool("Read"), tool(declared)), AGENTS)
    call = script.tool_call
    assert call is not None
    assert (call.name, call.arguments) == (declared, COMMAND)
    assert script.finish_reason is FinishReason.TOOL_CALLS
    assert script.content == ""


def test_the_first_candidate_wins_when_both_are_declared() -> None:
    script = build_script(first_turn(tool("Bash"), tool("shell")), AGENTS)
    assert script.tool_call is not None
    assert script.tool_call.name == "shell"


def test_arguments_are_streamed_verbatim_in_fragments() -> None:
    odd = '{"command":"ls  -la",  "timeout": 5}'
    cfg = msgspec.structs.replace(AGENTS, tool_call_arguments=odd)
    script = build_script(first_turn(tool("Bash")), cfg)
    assert script.tool_call is not None
    assert script.tool_call.arguments == odd
    assert sum(1 for s in script.steps if type(s).__name__ == "ToolArgs") > 1


def test_after_the_tool_result_the_answer_quotes_it() -> None:
    script = build_script(after_result("iop-tool-ok\n", tool("Bash")), AGENTS)
    assert script.tool_call is None
    assert script.content == "The tool said: iop-tool-ok"
    assert script.finish_reason is FinishReason.STOP


def test_the_quote_is_cut_to_its_limit() -> None:
    long = "x" * (TOOL_RESULT_QUOTE_CHARS + 50)
    script = build_script(after_result(long, tool("Bash")), AGENTS)
    assert script.content == "The tool said: " + "x" * TOOL_RESULT_QUOTE_CHARS


def test_max_tokens_still_caps_the_quote() -> None:
    request = msgspec.structs.replace(after_result("a b c d e f", tool("Bash")), max_tokens=3)
    script = build_script(request, AGENTS)
    assert script.content == "The tool said"
    assert script.finish_reason is FinishReason.LENGTH


def test_requests_without_a_candidate_tool_are_answered_as_before() -> None:
    request = first_turn(tool("get_weather"))
    plain = msgspec.structs.replace(AGENTS, tool_call_names=(), tool_call_arguments="{}")
    ours, theirs = build_script(request, AGENTS), build_script(request, plain)
    assert (ours.steps, ours.finish_reason) == (theirs.steps, theirs.finish_reason)


def test_a_named_choice_of_another_tool_is_honoured() -> None:
    choice = NamedToolChoice(function=NamedFunction(name="Read"))
    script = build_script(first_turn(tool("Bash"), tool("Read"), tool_choice=choice), AGENTS)
    assert script.tool_call is not None
    assert script.tool_call.name == "Read"
    assert json.loads(script.tool_call.arguments).keys() == {"command"}
    assert script.tool_call.arguments != COMMAND


def test_text_tool_mode_prints_the_exact_call_as_hermes_text() -> None:
    cfg = msgspec.structs.replace(AGENTS, tool_mode="text")
    script = build_script(first_turn(tool("Bash")), cfg)
    assert script.content == (
        '<tool_call>{"name": "Bash", "arguments": {"command": "echo iop-tool-ok"}}</tool_call>'
    )


def test_the_text_tool_fallback_prompt_is_scripted_too() -> None:
    # A backend without a tool API gets the tools in its system prompt and
    # the result back as a <tool_response> user turn (IOP's fallback).
    messages = fallback_messages([Message(role="user", content="run it")], [tool("Bash")])
    first = build_script(ChatRequest(model="iop-sim", messages=messages), AGENTS)
    assert first.content == (
        '<tool_call>{"name": "Bash", "arguments": {"command": "echo iop-tool-ok"}}</tool_call>'
    )
    reply = Message(role="user", content="<tool_response>\niop-tool-ok\n</tool_response>")
    second = build_script(ChatRequest(model="iop-sim", messages=[*messages, reply]), AGENTS)
    assert second.content == "The tool said: iop-tool-ok"


def test_the_mode_can_be_switched_on_per_request() -> None:
    body = {
        "model": "iop-sim",
        "messages": [{"role": "user", "content": "run it"}],
        "tools": [msgspec.to_builtins(tool("Bash"))],
        "iop_sim": {"tool_call_names": ["Bash"], "tool_call_arguments": COMMAND},
    }
    script = build_script(parse_chat_request(json.dumps(body).encode()), SimConfig())
    assert script.tool_call is not None
    assert (script.tool_call.name, script.tool_call.arguments) == ("Bash", COMMAND)


@pytest.mark.parametrize("arguments", ["not json", "[1, 2]", '"echo"'])
def test_arguments_that_are_not_a_json_object_are_refused(arguments: str) -> None:
    with pytest.raises(msgspec.ValidationError, match="tool_call_arguments"):
        msgspec.convert({"tool_call_arguments": arguments}, SimConfig)
    body = {
        "model": "iop-sim",
        "messages": [{"role": "user", "content": "hi"}],
        "iop_sim": {"tool_call_arguments": arguments},
    }
    with pytest.raises(RequestError, match="tool_call_arguments"):
        build_script(parse_chat_request(json.dumps(body).encode()), SimConfig())


def test_cli_flags_and_config_file(tmp_path: Any) -> None:
    args = build_parser().parse_args(
        [
            "sim",
            "--tool-call-name",
            "shell",
            "--tool-call-name",
            "Bash",
            "--tool-call-arguments",
            COMMAND,
        ]
    )
    cfg = sim_config_from_args(args)
    assert (cfg.tool_call_names, cfg.tool_call_arguments) == (("shell", "Bash"), COMMAND)
    path = tmp_path / "sim.toml"
    path.write_text(
        '[sim]\ntool_call_names = ["Bash"]\n'
        'tool_call_arguments = \'{"command": "echo iop-tool-ok"}\'\n'
    )
    cfg = sim_config_from_args(build_parser().parse_args(["sim", "--config", str(path)]))
    assert (cfg.tool_call_names, cfg.tool_call_arguments) == (("Bash",), COMMAND)
    bad = build_parser().parse_args(["sim", "--tool-call-arguments", "[]"])
    with pytest.raises(ConfigError, match="tool_call_arguments"):
        sim_config_from_args(bad)


def test_arguments_can_differ_per_candidate() -> None:
    codex = '{"command": ["bash", "-lc", "echo iop-tool-ok"]}'
    cfg = msgspec.structs.replace(AGENTS, tool_call_arguments_by_tool={"shell": codex})
    shell = build_script(first_turn(tool("shell")), cfg).tool_call
    bash = build_script(first_turn(tool("Bash")), cfg).tool_call
    assert shell is not None
    assert bash is not None
    assert (shell.arguments, bash.arguments) == (codex, COMMAND)
    with pytest.raises(msgspec.ValidationError, match=r"tool_call_arguments_by_tool\['shell'\]"):
        msgspec.convert({"tool_call_arguments_by_tool": {"shell": "[]"}}, SimConfig)
    args = build_parser().parse_args(
        ["sim", "--tool-call-name", "shell", "--tool-call-arguments-for", f"shell={codex}"]
    )
    assert sim_config_from_args(args).tool_call_arguments_by_tool == {"shell": codex}
    with pytest.raises(ConfigError, match="NAME=JSON"):
        sim_config_from_args(build_parser().parse_args(["sim", "--tool-call-arguments-for", "x"]))


async def test_the_in_process_adapter_plays_the_scripted_call() -> None:
    adapter = SimAdapter(SimInstance(name="s", sim=AGENTS))
    events = await collect_run(
        adapter, ExecutionSpec(run_id="r1", request=first_turn(tool("Bash")))
    )
    done = events[-1]
    assert isinstance(done, Complete)
    assert [(c.name, c.arguments) for c in done.tool_calls] == [("Bash", COMMAND)]
    quoted = await collect_run(
        adapter, ExecutionSpec(run_id="r2", request=after_result("iop-tool-ok", tool("Bash")))
    )
    assert "".join(e.text for e in quoted if isinstance(e, Delta)) == "The tool said: iop-tool-ok"


def test_iop_up_backend_sim_takes_the_scripted_mode_from_its_config(tmp_path: Any) -> None:
    # Agents send no iop_sim key: `iop up --backend sim` must be configurable.
    path = tmp_path / "up.toml"
    path.write_text(
        "[embedded.sim]\nttft_s = 0.0\n"
        'tool_call_names = ["shell", "Bash"]\n'
        'tool_call_arguments = \'{"command": "echo iop-tool-ok"}\'\n'
    )
    args = build_parser().parse_args(["up", "--config", str(path), "--backend", "sim"])
    cfg = up_config_from_args(args)
    (instance,) = embedded_instances(cfg)
    assert isinstance(instance, SimInstance)
    assert instance.sim == SimConfig(
        ttft_s=0.0, tool_call_names=("shell", "Bash"), tool_call_arguments=COMMAND
    )
    default = up_config_from_args(build_parser().parse_args(["up", "--backend", "sim"]))
    assert default.embedded.sim == SimConfig(tokens_per_s=50.0, ttft_s=0.05)


def test_the_text_tool_fallback_without_a_candidate_answers_as_before() -> None:
    messages = fallback_messages([Message(role="user", content="run it")], [tool("Read")])
    reply = Message(role="user", content="<tool_response>\nfile\n</tool_response>")
    script = build_script(ChatRequest(model="iop-sim", messages=[*messages, reply]), AGENTS)
    assert not script.content.startswith("The tool said")
    assert script.content
