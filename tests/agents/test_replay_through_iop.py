"""The requests Codex CLI really sent, replayed through IOP: every tool reaches the backend.

The bodies of ``tests/data/agents/codex-apply-patch`` (Codex 0.163.0 with a
model catalog entry, so it offers all of its tool kinds: functions, the
``custom`` ``apply_patch``, the ``multi_agent_v1`` namespace and
``web_search``; then its follow-up with the ``custom_tool_call`` and its
``custom_tool_call_output``) are posted byte for byte, bar the model name,
to a real ``iop edge`` + ``iop node`` over the scriptable fake backend
(``iop.testing``), which records the chat request the node sent. Every tool
but ``web_search`` must be in it as a function (docs/api.md, "Tools"), and
the follow-up's custom call and output must be the assistant's call and its
tool result. No agent is needed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import pytest

from iop.testing import LoopbackPlatform, loopback_platform

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CAPTURE: Final = Path(__file__).resolve().parent.parent / "data" / "agents" / "codex-apply-patch"


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackPlatform]:
    with loopback_platform(tmp_path_factory.mktemp("replay")) as platform:
        yield platform


def _replay(platform: LoopbackPlatform, number: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Post capture request ``number``; return it and the chat request the backend got."""
    sent: dict[str, Any] = json.loads((CAPTURE / f"{number:02d}-request.json").read_bytes())
    body = {**sent, "model": platform.model}
    mark = platform.mark()
    with httpx.stream(
        "POST", f"{platform.base_url}/responses", json=body, timeout=30.0, trust_env=False
    ) as resp:
        assert resp.status_code == 200, resp.read()
        events = [line for line in resp.iter_lines() if line.startswith("event: ")]
    assert events[-1] == "event: response.completed", events
    (request,) = platform.backend_requests(mark)
    backend: dict[str, Any] = json.loads(request.body)
    return sent, backend


def _function_names(tools: list[dict[str, Any]]) -> list[str]:
    """What each tool Codex sent should be offered to the model as."""
    names: list[str] = []
    for tool in tools:
        if tool["type"] in ("function", "custom"):
            names.append(tool["name"])
        elif tool["type"] == "namespace":
            names += [f"{tool['name']}__{inner['name']}" for inner in tool["tools"]]
    return names


def test_every_tool_of_codexs_first_request_reaches_the_backend(platform: LoopbackPlatform) -> None:
    sent, backend = _replay(platform, 1)
    assert sorted({t["type"] for t in sent["tools"]}) == [
        "custom",
        "function",
        "namespace",
        "web_search",
    ]
    offered = [t["function"]["name"] for t in backend["tools"]]
    assert offered == _function_names(sent["tools"])
    assert {"apply_patch", "exec_command", "multi_agent_v1__spawn_agent"} <= set(offered)
    patch = next(t["function"] for t in backend["tools"] if t["function"]["name"] == "apply_patch")
    assert patch["parameters"]["required"] == ["input"]
    grammar = next(t for t in sent["tools"] if t["type"] == "custom")["format"]["definition"]
    assert grammar in patch["description"]


def test_codexs_follow_up_replays_the_custom_call_and_its_output(
    platform: LoopbackPlatform,
) -> None:
    sent, backend = _replay(platform, 2)
    call_item, output_item = sent["input"][-2:]
    assert (call_item["type"], output_item["type"]) == (
        "custom_tool_call",
        "custom_tool_call_output",
    )
    assistant, tool = backend["messages"][-2:]
    (call,) = assistant["tool_calls"]
    assert call["id"] == call_item["call_id"]
    assert call["function"]["name"] == "apply_patch"
    assert json.loads(call["function"]["arguments"]) == {"input": call_item["input"]}
    assert tool == {
        "role": "tool",
        "tool_call_id": call_item["call_id"],
        "content": output_item["output"],
    }
