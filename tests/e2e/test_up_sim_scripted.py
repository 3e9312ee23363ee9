"""``iop up --backend sim`` with the sim's scripted tool mode, through the whole platform.

The path the real-agent tests take (Codex CLI, Claude Code): agents send no
``iop_sim`` key, so the mode comes from ``[embedded.sim]``; the official SDK
plays the agent's two turns here over chat completions.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Final

import openai

from tests.e2e._platform import Proc

READY_TIMEOUT_S: Final = 60.0
COMMAND: Final = '{"command": "echo iop-tool-ok"}'
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "Bash",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


def test_a_tool_round_trip_through_iop_up(tmp_path: Path) -> None:
    config = tmp_path / "up.toml"
    config.write_text(
        '[embedded]\nkind = "sim"\n\n[embedded.sim]\nttft_s = 0.0\n'
        'tool_call_names = ["shell", "Bash"]\n'
        f"tool_call_arguments = '{COMMAND}'\n"
    )
    proc = Proc("iop-up", ["up", "--port", "0", "--config", str(config)], tmp_path)
    try:
        proc.wait_stdout(r"iop up: ready; models: .*", timeout=READY_TIMEOUT_S)
        url = re.search(r"OpenAI API on (http://\S+)/v1", proc.stdout())
        assert url is not None, proc.logs()
        messages: list[Any] = [{"role": "user", "content": "run it"}]
        with openai.OpenAI(
            base_url=f"{url.group(1)}/v1", api_key="x", max_retries=0, timeout=30.0
        ) as client:
            first = client.chat.completions.create(model="iop-sim", messages=messages, tools=TOOLS)
            (call,) = first.choices[0].message.tool_calls or []
            assert first.choices[0].finish_reason == "tool_calls"
            assert call.type == "function"
            assert call.function.name == "Bash"
            assert json.loads(call.function.arguments) == json.loads(COMMAND)
            messages.append(first.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "iop-tool-ok\n"})
            with client.chat.completions.create(
                model="iop-sim", messages=messages, tools=TOOLS, stream=True
            ) as stream:
                text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == "The tool said: iop-tool-ok"
    finally:
        proc.stop()
