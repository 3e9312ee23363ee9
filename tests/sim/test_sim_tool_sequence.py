"""The sim's scripted tool sequence: one call per tool-result turn, then a text answer.

``tool_call_sequence`` (docs/configuration.md, "`iop sim` config") drives a
real agent through several tool round trips in one user turn: the first
request of the turn calls the first step's tool with exactly its arguments,
the request after that result calls the second step's, and so on; the
request after the last step's result answers ``The tool said: <result>``.
A turn begins after the last assistant message that called no tool, so the
next user turn of the same conversation plays the sequence again.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from iop.adapters.sim import SimAdapter
from iop.cli import build_parser
from iop.cli._sim import sim_config_from_args
from iop.cli._up import embedded_instances, up_config_from_args
from iop.config import SimConfig, SimInstance, ToolCallStep
from iop.errors import ConfigError, RequestError
from iop.events import Complete, Delta, FinishReason
from iop.runtime import collect_run
from iop.sim import build_script, parse_chat_request
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

WRITE = '{"file_path": "/w/notes.txt", "content": "iop-seq-ok"}'
READ = '{"file_path": "/w/notes.txt"}'
CAT = '{"command": "cat /w/notes.txt"}'
STEPS = (
    ToolCallStep(name="Write", arguments=WRITE),
    ToolCallStep(name="Read", arguments=READ),
    ToolCallStep(name="Bash", arguments=CAT),
)
SEQ = SimConfig(ttft_s=0.0, tool_call_sequence=STEPS)


def tool(name: str) -> Tool:
    schema = {"type": "object", "properties": {"x": {"type": "string"}}}
    return Tool(function=FunctionDef(name=name, parameters=schema))


TOOLS = [tool("Bash"), tool("Read"), tool("Write")]


def call_round(index: int, name: str, arguments: str, result: str) -> list[Message]:
    """The assistant's call and the tool's result, as a chat conversation has them."""
    call = MessageToolCall(
        id=f"call-{index}", function=MsgFunctionCall(name=name, arguments=arguments)
    )
    return [
        Message(role="assistant", tool_calls=[call]),
        Message(role="tool", tool_call_id=f"call-{index}", content=result),
    ]


def conversation(*rounds: tuple[str, str, str], head: list[Message] | None = None) -> ChatRequest:
    messages = list(head or [Message(role="user", content="do it")])
    for i, (name, arguments, result) in enumerate(rounds):
        messages += call_round(i, name, arguments, result)
    return ChatRequest(model="iop-sim", messages=messages, tools=TOOLS)


def played(request: ChatRequest, cfg: SimConfig = SEQ) -> tuple[str, str] | str:
    """The script's call as (name, arguments), or its text."""
    script = build_script(request, cfg)
    if script.tool_call is not None:
        assert script.finish_reason is FinishReason.TOOL_CALLS
        assert script.content == ""
        return (script.tool_call.name, script.tool_call.arguments)
    assert script.finish_reason is FinishReason.STOP
    return script.content


def test_each_tool_result_turn_gets_the_next_step_then_the_answer_quotes_the_last() -> None:
    done = [("Write", WRITE, "File created"), ("Read", READ, "1\tiop-seq-ok"), ("Bash", CAT, "")]
    assert played(conversation()) == ("Write", WRITE)
    assert played(conversation(*done[:1])) == ("Read", READ)
    assert played(conversation(*done[:2])) == ("Bash", CAT)
    last = ("Bash", CAT, "iop-seq-ok\n")
    assert played(conversation(*done[:2], last)) == "The tool said: iop-seq-ok"


def test_the_next_user_turn_plays_the_sequence_again() -> None:
    rounds = [("Write", WRITE, "ok"), ("Read", READ, "ok"), ("Bash", CAT, "iop-seq-ok")]
    first_turn = conversation(*rounds).messages
    answer = Message(role="assistant", content="The tool said: iop-seq-ok")
    head = [*first_turn, answer, Message(role="user", content="again")]
    assert played(conversation(head=head)) == ("Write", WRITE)
    assert played(conversation(("Write", WRITE, "ok"), head=head)) == ("Read", READ)


def test_text_in_a_tool_result_turn_does_not_restart_the_sequence() -> None:
    # Claude Code may send a reminder as text beside a tool_result: a user
    # text message after the tool message, still the same turn.
    request = conversation(("Write", WRITE, "ok"))
    reminder = Message(role="user", content="<system-reminder>noted</system-reminder>")
    request = msgspec.structs.replace(request, messages=[*request.messages, reminder])
    assert played(request) == ("Read", READ)


def test_a_step_whose_tool_is_not_declared_is_answered_in_text() -> None:
    request = ChatRequest(
        model="iop-sim", messages=[Message(role="user", content="do it")], tools=[tool("Bash")]
    )
    assert played(request) == "The scripted tool Write is not among the request's tools."


def test_the_sequence_wins_over_the_single_scripted_call() -> None:
    cfg = msgspec.structs.replace(SEQ, tool_call_names=("Bash",), tool_call_arguments=CAT)
    assert played(conversation(), cfg) == ("Write", WRITE)


def test_a_named_choice_and_no_tools_are_honoured() -> None:
    choice = NamedToolChoice(function=NamedFunction(name="Read"))
    named = msgspec.structs.replace(conversation(), tool_choice=choice)
    call = build_script(named, SEQ).tool_call
    assert call is not None
    assert call.name == "Read"
    assert call.arguments != READ
    none = msgspec.structs.replace(conversation(), tool_choice="none")
    assert build_script(none, SEQ).tool_call is None


def test_text_tool_mode_and_the_fallback_prompt_play_it_as_hermes_text() -> None:
    cfg = msgspec.structs.replace(SEQ, tool_mode="text")
    first = build_script(conversation(), cfg).content
    assert first == f'<tool_call>{{"name": "Write", "arguments": {WRITE}}}</tool_call>'
    # The text-tool fallback: tools in the system prompt, calls as assistant
    # text, results as <tool_response> user turns.
    messages = fallback_messages([Message(role="user", content="do it")], TOOLS)
    messages += [
        Message(role="assistant", content=first),
        Message(role="user", content="<tool_response>\nok\n</tool_response>"),
    ]
    second = build_script(ChatRequest(model="iop-sim", messages=messages), SEQ).content
    assert second == f'<tool_call>{{"name": "Read", "arguments": {READ}}}</tool_call>'


@pytest.mark.parametrize("arguments", ["not json", "[1]"])
def test_steps_whose_arguments_are_not_a_json_object_are_refused(arguments: str) -> None:
    steps = [{"name": "Write", "arguments": arguments}]
    with pytest.raises(msgspec.ValidationError, match=r"tool_call_sequence\[0\]"):
        msgspec.convert({"tool_call_sequence": steps}, SimConfig)
    with pytest.raises(msgspec.ValidationError, match="name"):
        msgspec.convert({"tool_call_sequence": [{"arguments": "{}"}]}, SimConfig)
    body = {
        "model": "iop-sim",
        "messages": [{"role": "user", "content": "hi"}],
        "iop_sim": {"tool_call_sequence": steps},
    }
    with pytest.raises(RequestError, match="tool_call_sequence"):
        build_script(parse_chat_request(json.dumps(body).encode()), SimConfig())


def test_the_sequence_can_be_set_per_request() -> None:
    body = {
        "model": "iop-sim",
        "messages": [{"role": "user", "content": "do it"}],
        "tools": [msgspec.to_builtins(t) for t in TOOLS],
        "iop_sim": {"tool_call_sequence": [{"name": "Read", "arguments": READ}]},
    }
    assert played(parse_chat_request(json.dumps(body).encode()), SimConfig()) == ("Read", READ)


def test_cli_flag_and_config_files(tmp_path: Any) -> None:
    flags = ["sim", "--tool-call-step", f"Write={WRITE}", "--tool-call-step", f"Read={READ}"]
    cfg = sim_config_from_args(build_parser().parse_args(flags))
    assert cfg.tool_call_sequence == STEPS[:2]
    with pytest.raises(ConfigError, match="NAME=JSON"):
        sim_config_from_args(build_parser().parse_args(["sim", "--tool-call-step", "Write"]))
    with pytest.raises(ConfigError, match="tool_call_sequence"):
        sim_config_from_args(build_parser().parse_args(["sim", "--tool-call-step", "Write=[]"]))
    table = "".join(
        f"[[{{}}.tool_call_sequence]]\nname = {json.dumps(s.name)}\n"
        f"arguments = {json.dumps(s.arguments)}\n"
        for s in STEPS
    )
    sim_toml = tmp_path / "sim.toml"
    sim_toml.write_text(table.replace("{}", "sim"))
    cfg = sim_config_from_args(build_parser().parse_args(["sim", "--config", str(sim_toml)]))
    assert cfg.tool_call_sequence == STEPS
    up_toml = tmp_path / "up.toml"
    up_toml.write_text(table.replace("{}", "embedded.sim"))
    up = up_config_from_args(
        build_parser().parse_args(["up", "--config", str(up_toml), "--backend", "sim"])
    )
    (instance,) = embedded_instances(up)
    assert isinstance(instance, SimInstance)
    assert instance.sim.tool_call_sequence == STEPS


async def test_the_in_process_adapter_plays_the_steps() -> None:
    adapter = SimAdapter(SimInstance(name="s", sim=SEQ))
    first = await collect_run(adapter, ExecutionSpec(run_id="r1", request=conversation()))
    done = first[-1]
    assert isinstance(done, Complete)
    assert [(c.name, c.arguments) for c in done.tool_calls] == [("Write", WRITE)]
    rounds = [("Write", WRITE, "ok"), ("Read", READ, "ok"), ("Bash", CAT, "iop-seq-ok")]
    last = await collect_run(adapter, ExecutionSpec(run_id="r2", request=conversation(*rounds)))
    assert "".join(e.text for e in last if isinstance(e, Delta)) == "The tool said: iop-seq-ok"
