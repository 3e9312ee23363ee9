"""Codex CLI (the real binary) against the recording stub: what it sends and needs.

A plain turn and a shell tool round trip, then the stream departures that
tell what a Responses server must send (tests/data/agents/README.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.agents._agents import PLAIN_PROMPT, TOOL_PROMPT, AgentResult, run_codex
from tests.agents._stub import (
    AFTER_TOOL_TEXT,
    PLAIN_TEXT,
    REASONING_BLOB,
    REASONING_TEXT,
    SHELL_TOOL,
    TOOL_MARKER,
    Recorded,
    Scenario,
    Stub,
    Variant,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _run(
    codex_bin: Path, workdir: Path, scenario: Scenario, variant: Variant | None = None
) -> tuple[AgentResult, list[Recorded]]:
    prompt = PLAIN_PROMPT if scenario == "plain" else TOOL_PROMPT
    with Stub(scenario=scenario, variant=variant or Variant()) as stub:
        # Proxy at the stub: any connection beyond loopback is recorded.
        result = run_codex(stub.base_url, prompt, workdir, binary=codex_bin, proxy=stub.base_url)
    return result, stub.requests


def _explain(result: AgentResult) -> str:
    return f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def _user_texts(body: dict[str, Any]) -> list[str]:
    return [
        part["text"]
        for item in body["input"]
        if item.get("type") == "message" and item.get("role") == "user"
        for part in item["content"]
        if part.get("type") == "input_text"
    ]


def test_plain_turn_posts_only_responses(codex_bin: Path, workdir: Path) -> None:
    result, requests = _run(codex_bin, workdir, "plain")
    assert result.returncode == 0, _explain(result)
    assert PLAIN_TEXT in result.stdout
    # Nothing but one POST /v1/responses: no CONNECT (update check, plugin
    # sync, analytics), no model listing.
    assert [(r.method, r.path, r.query) for r in requests] == [("POST", "/v1/responses", "")]
    (request,) = requests
    assert request.key_header == "authorization"
    assert request.header("accept") == "text/event-stream"
    body = request.json()
    assert body["model"] == "iop-model"
    assert body["stream"] is True
    assert body["store"] is False
    assert "instructions" not in body
    roles = [item.get("role") for item in body["input"] if item.get("type") == "message"]
    assert roles[0] == "developer"  # its system prompt
    assert PLAIN_PROMPT in _user_texts(body)
    kinds = {tool["type"] for tool in body["tools"]}
    assert {"function", "namespace", "web_search"} <= kinds
    (shell,) = [tool for tool in body["tools"] if tool.get("name") == SHELL_TOOL]
    assert shell["type"] == "function"
    assert shell["parameters"]["properties"]["cmd"]["type"] == "string"
    assert "cmd" in shell["parameters"]["required"]


def test_tool_round_trip(codex_bin: Path, workdir: Path) -> None:
    result, requests = _run(codex_bin, workdir, "tool")
    assert result.returncode == 0, _explain(result)
    assert AFTER_TOOL_TEXT in result.stdout
    assert [(r.method, r.path) for r in requests] == [("POST", "/v1/responses")] * 2
    first, follow_up = (r.json() for r in requests)
    # The follow-up resends the whole conversation: the first input, then the
    # model's function_call and the command's output under the same call_id.
    assert follow_up["input"][: len(first["input"])] == first["input"]
    call, output = follow_up["input"][len(first["input"]) :]
    assert call["type"] == "function_call"
    assert call["name"] == SHELL_TOOL
    assert json.loads(call["arguments"]) == {"cmd": "echo iop-tool-ok"}
    assert output["type"] == "function_call_output"
    assert output["call_id"] == call["call_id"] == "call_stub0001"
    assert isinstance(output["output"], str)
    assert TOOL_MARKER in output["output"]
    assert follow_up["prompt_cache_key"] == first["prompt_cache_key"]


def test_without_output_item_done_it_exits_0_with_no_answer(codex_bin: Path, workdir: Path) -> None:
    """The text deltas alone are not the answer: Codex takes each item from
    ``response.output_item.done``; without it the turn "succeeds" empty."""
    result, requests = _run(codex_bin, workdir, "plain", Variant(omit_output_item_done=True))
    assert len(requests) == 1
    assert result.returncode == 0, _explain(result)
    assert PLAIN_TEXT not in result.stdout
    assert result.stdout.strip() == ""


def test_without_output_item_done_the_tool_is_not_run(codex_bin: Path, workdir: Path) -> None:
    result, requests = _run(codex_bin, workdir, "tool", Variant(omit_output_item_done=True))
    assert result.returncode == 0, _explain(result)
    assert len(requests) == 1  # no follow-up: the function_call was never seen


def test_without_completed_the_turn_fails(codex_bin: Path, workdir: Path) -> None:
    result, requests = _run(codex_bin, workdir, "plain", Variant(omit_completed=True))
    assert len(requests) == 1  # stream_max_retries = 0: no retry
    assert result.returncode == 1, _explain(result)
    assert "stream closed before response.completed" in result.stderr


@pytest.mark.parametrize("scenario", ["plain", "tool"])
def test_sse_comment_keepalives_are_accepted(
    codex_bin: Path, workdir: Path, scenario: Scenario
) -> None:
    result, requests = _run(codex_bin, workdir, scenario, Variant(comment_keepalives=True))
    assert result.returncode == 0, _explain(result)
    assert (PLAIN_TEXT if scenario == "plain" else AFTER_TOOL_TEXT) in result.stdout
    assert len(requests) == (1 if scenario == "plain" else 2)


def test_event_lines_are_not_needed(codex_bin: Path, workdir: Path) -> None:
    """It dispatches on the JSON ``type``; ``event:`` lines are optional."""
    result, _ = _run(codex_bin, workdir, "tool", Variant(omit_event_lines=True))
    assert result.returncode == 0, _explain(result)
    assert AFTER_TOOL_TEXT in result.stdout


def test_response_failed_fails_the_turn_with_its_message(codex_bin: Path, workdir: Path) -> None:
    result, requests = _run(codex_bin, workdir, "plain", Variant(error_event=True))
    assert len(requests) == 1
    assert result.returncode == 1, _explain(result)
    assert "stub: the backend failed" in result.stderr


def test_http_500_fails_the_turn(codex_bin: Path, workdir: Path) -> None:
    result, requests = _run(codex_bin, workdir, "plain", Variant(http_status=500))
    assert len(requests) == 1  # request_max_retries = 0
    assert result.returncode == 1, _explain(result)
    # Codex shows its own words for a 5xx, not the body's message.
    assert "stub: overloaded" not in result.stderr


def test_reasoning_item_is_passed_back(codex_bin: Path, workdir: Path) -> None:
    """A reasoning item in the answer comes back, as received (plus
    ``content: null``), before the function_call on the next request."""
    result, requests = _run(codex_bin, workdir, "tool", Variant(reasoning=True))
    assert result.returncode == 0, _explain(result)
    assert AFTER_TOOL_TEXT in result.stdout
    first, follow_up = (r.json() for r in requests)
    reasoning, call, output = follow_up["input"][len(first["input"]) :]
    assert reasoning["type"] == "reasoning"
    assert reasoning["id"] == "rs_stub0001"
    assert reasoning["encrypted_content"] == REASONING_BLOB
    assert reasoning["summary"] == [{"type": "summary_text", "text": REASONING_TEXT}]
    assert (call["type"], output["type"]) == ("function_call", "function_call_output")


def test_response_incomplete_fails_the_turn(codex_bin: Path, workdir: Path) -> None:
    """``response.incomplete`` (the token limit) is a failed turn, not a short answer."""
    result, requests = _run(codex_bin, workdir, "plain", Variant(truncated=True))
    assert len(requests) == 1
    assert result.returncode == 1, _explain(result)
    assert "Incomplete response returned, reason: max_output_tokens" in result.stderr
