"""Claude Code (the real binary) against the recording stub: what it sends and needs.

A plain turn and a Bash tool round trip, then the stream departures that
tell what an Anthropic Messages server must send (tests/data/agents/README.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.agents._agents import PLAIN_PROMPT, TOOL_PROMPT, AgentResult, run_claude
from tests.agents._stub import (
    AFTER_TOOL_TEXT,
    PLAIN_TEXT,
    REASONING_BLOB,
    REASONING_TEXT,
    TOOL_COMMAND,
    TOOL_MARKER,
    Recorded,
    Scenario,
    Stub,
    Variant,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _run(
    claude_bin: Path,
    workdir: Path,
    scenario: Scenario,
    variant: Variant | None = None,
    *,
    quiet: bool = True,
) -> tuple[AgentResult, list[Recorded]]:
    prompt = PLAIN_PROMPT if scenario == "plain" else TOOL_PROMPT
    with Stub(scenario=scenario, variant=variant or Variant()) as stub:
        # Proxy at the stub: any connection beyond loopback is recorded.
        result = run_claude(
            stub.base_url, prompt, workdir, binary=claude_bin, proxy=stub.base_url, quiet=quiet
        )
    return result, stub.requests


def _explain(result: AgentResult) -> str:
    return f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def _blocks(body: dict[str, Any], role: str, kind: str) -> list[dict[str, Any]]:
    return [
        block
        for message in body["messages"]
        if message["role"] == role and isinstance(message["content"], list)
        for block in message["content"]
        if block.get("type") == kind
    ]


def test_plain_turn_posts_only_messages(claude_bin: Path, workdir: Path) -> None:
    result, requests = _run(claude_bin, workdir, "plain")
    assert result.returncode == 0, _explain(result)
    assert PLAIN_TEXT in result.stdout
    # One streamed POST /v1/messages?beta=true, nothing else: no
    # count_tokens, no model listing, no CONNECT.
    assert [(r.method, r.path, r.query) for r in requests] == [
        ("POST", "/v1/messages", "beta=true")
    ]
    (request,) = requests
    assert request.key_header == "x-api-key"
    assert request.header("authorization") is None
    assert request.header("anthropic-version") == "2023-06-01"
    beta = request.header("anthropic-beta")
    assert beta is not None
    assert "claude-code-20250219" in beta.split(",")
    body = request.json()
    assert body["model"] == "iop-model"
    assert body["stream"] is True
    assert isinstance(body["max_tokens"], int)
    assert body["thinking"] == {"type": "adaptive"}
    assert isinstance(body["system"], list)
    assert all(block["type"] == "text" for block in body["system"])
    # A system-role message inside ``messages`` (Anthropic's API has none).
    assert "system" in [message["role"] for message in body["messages"]]
    assert PLAIN_PROMPT in [block["text"] for block in _blocks(body, "user", "text")]
    (bash,) = [tool for tool in body["tools"] if tool["name"] == "Bash"]
    assert bash["input_schema"]["properties"]["command"]["type"] == "string"


def test_tool_round_trip(claude_bin: Path, workdir: Path) -> None:
    result, requests = _run(claude_bin, workdir, "tool")
    assert result.returncode == 0, _explain(result)
    assert AFTER_TOOL_TEXT in result.stdout
    assert [(r.method, r.path, r.query) for r in requests] == [
        ("POST", "/v1/messages", "beta=true")
    ] * 2
    follow_up = requests[1].json()
    (use,) = _blocks(follow_up, "assistant", "tool_use")
    assert use["id"] == "toolu_stub0001"
    assert use["name"] == "Bash"
    assert use["input"]["command"] == TOOL_COMMAND
    (tool_result,) = _blocks(follow_up, "user", "tool_result")
    assert tool_result["tool_use_id"] == "toolu_stub0001"
    assert TOOL_MARKER in str(tool_result["content"])
    assert tool_result.get("is_error") is not True


@pytest.mark.parametrize("scenario", ["plain", "tool"])
def test_without_event_lines_it_falls_back_to_non_streaming(
    claude_bin: Path, workdir: Path, scenario: Scenario
) -> None:
    """``data:`` lines alone are not a stream it can read: each streamed
    request is repeated without ``stream`` and the JSON answer is used."""
    result, requests = _run(claude_bin, workdir, scenario, Variant(omit_event_lines=True))
    assert result.returncode == 0, _explain(result)
    assert (PLAIN_TEXT if scenario == "plain" else AFTER_TOOL_TEXT) in result.stdout
    turns = 1 if scenario == "plain" else 2
    bodies = [r.json() for r in requests]
    assert [b.get("stream") for b in bodies] == [True, None] * turns
    streamed, fallback = bodies[0], bodies[1]
    assert {k: v for k, v in streamed.items() if k != "stream"} == fallback


@pytest.mark.parametrize(
    "variant",
    [Variant(comment_keepalives=True), Variant(ping_events=True)],
    ids=["comment-keepalives", "ping-events"],
)
@pytest.mark.parametrize("scenario", ["plain", "tool"])
def test_keepalives_are_accepted(
    claude_bin: Path, workdir: Path, scenario: Scenario, variant: Variant
) -> None:
    result, requests = _run(claude_bin, workdir, scenario, variant)
    assert result.returncode == 0, _explain(result)
    assert (PLAIN_TEXT if scenario == "plain" else AFTER_TOOL_TEXT) in result.stdout
    assert all(r.json().get("stream") is True for r in requests)
    assert len(requests) == (1 if scenario == "plain" else 2)


def test_without_the_quiet_env_it_reaches_out(claude_bin: Path, workdir: Path) -> None:
    """Why ``CLAUDE_QUIET_ENV`` exists: without it Claude Code tries
    api.anthropic.com (through the proxy) and asks the model for a title."""
    result, requests = _run(claude_bin, workdir, "plain", quiet=False)
    assert result.returncode == 0, _explain(result)
    # How many of these are sent before it exits races the turn; where to is fixed.
    connects = {r.path for r in requests if r.method == "CONNECT"}
    assert connects <= {"api.anthropic.com:443"}
    posts = [r.json() for r in requests if r.method == "POST"]
    assert len(posts) == 2
    titled = [b for b in posts if "format" in b.get("output_config", {})]
    assert len(titled) == 1
    assert titled[0]["output_config"]["format"]["type"] == "json_schema"


def test_http_529_fails_the_turn_with_its_message(claude_bin: Path, workdir: Path) -> None:
    result, requests = _run(claude_bin, workdir, "plain", Variant(http_status=529))
    assert len(requests) == 1  # CLAUDE_CODE_MAX_RETRIES=0
    assert result.returncode == 1, _explain(result)
    # -p prints the API error on stdout.
    assert "529 stub: overloaded" in result.stdout


def test_error_event_mid_stream_retries_then_falls_back(claude_bin: Path, workdir: Path) -> None:
    """An ``error`` event after ``message_start`` is retried as a stream,
    then asked again without streaming (the stub's JSON answer succeeds)."""
    result, requests = _run(claude_bin, workdir, "plain", Variant(error_event=True))
    assert result.returncode == 0, _explain(result)
    assert PLAIN_TEXT in result.stdout
    streams = [r.json().get("stream") for r in requests]
    assert streams[-1] is None
    assert streams[:-1] == [True] * (len(streams) - 1)
    assert len(streams) >= 2


def test_thinking_block_is_passed_back(claude_bin: Path, workdir: Path) -> None:
    """A thinking block (with its signature) comes back unchanged in the
    assistant message, before the tool_use."""
    result, requests = _run(claude_bin, workdir, "tool", Variant(reasoning=True))
    assert result.returncode == 0, _explain(result)
    assert AFTER_TOOL_TEXT in result.stdout
    follow_up = requests[1].json()
    (assistant,) = [m for m in follow_up["messages"] if m["role"] == "assistant"]
    assert assistant["content"][0] == {
        "type": "thinking",
        "thinking": REASONING_TEXT,
        "signature": REASONING_BLOB,
    }
    assert assistant["content"][1]["type"] == "tool_use"


def test_max_tokens_is_continued_three_times_then_fails(claude_bin: Path, workdir: Path) -> None:
    """``stop_reason: "max_tokens"`` makes it ask the model to resume (the
    cut answer, then a user message), three times, then give up."""
    result, requests = _run(claude_bin, workdir, "plain", Variant(truncated=True))
    assert result.returncode == 1, _explain(result)
    assert "exceeded the 32000 output token maximum" in result.stdout
    bodies = [r.json() for r in requests]
    assert len(bodies) == 4
    first = len(bodies[0]["messages"])
    for turn, body in enumerate(bodies):
        assert len(body["messages"]) == first + 2 * turn
        assert body["max_tokens"] == bodies[0]["max_tokens"]
    resumed = bodies[-1]["messages"][first:]
    assert [m["role"] for m in resumed] == ["assistant", "user"] * 3
    assert all(m["content"][0]["text"] == PLAIN_TEXT for m in resumed[::2])
    assert "Output token limit hit" in str(resumed[1]["content"])
