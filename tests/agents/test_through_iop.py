"""Codex CLI and Claude Code, unchanged, through IOP: a plain turn and a tool round trip.

The real agents (``tests/agents/_agents.py``: the pinned binaries, a
throwaway ``HOME``, no network but loopback) are pointed at real IOP
processes exactly as docs/clients.md tells a user to: Codex with a custom
model provider (``wire_api = "responses"``, ``base_url`` at the edge's
``/v1``, the key as ``Authorization: Bearer``), Claude Code with
``ANTHROPIC_BASE_URL`` at the edge and the key as ``x-api-key``. The edge has
``api_keys`` set, so both authenticate as a user's would.

The model is the sim. ``iop up --backend sim`` reads it from
``[embedded.sim]``; the agents send no ``iop_sim`` key, so the config alone
decides what the model does:

* ``plain``: ``tool_mode = "none"`` (both agents always offer tools): the sim
  answers with its deterministic text, words of its fixed vocabulary.
* ``tools``: the scripted tool mode with both shell tools as candidates
  (Codex's ``exec_command`` takes ``cmd``, Claude's ``Bash`` takes
  ``command``, tests/data/agents/README.md). On the first turn the model
  calls the shell with ``echo iop-tool-ok``; the agent runs it and sends the
  output back; the model answers ``The tool said: <output>``. The final
  answer quoting what only the command's *output* contains (Codex wraps it
  in ``Process exited with code 0 ... Output:``; Claude's answer has the
  marker without the ``echo``) proves the model saw it.

Codex's own tool kinds go through too (``up_codex_tools``): with a model
catalog entry for ``iop-sim`` (``run_codex(freeform_apply_patch=True)``,
docs/clients.md) Codex offers ``apply_patch`` as a ``custom`` tool, the
model calls it with a patch adding a file, and the file is on disk
afterwards; without one, the model calls ``wait_agent`` of the
``multi_agent_v1`` namespace and Codex runs it (an unknown agent id is its
answer, not "unsupported call").

The tool round trip runs again with reasoning before the call (``reasoning``
items, ``thinking`` blocks, which the agents pass back) and through a
separate ``iop edge`` + ``iop node`` + ``iop sim`` (the node's ``vllm``
adapter over HTTP, tool-call deltas parsed from vLLM's wire format). A
first token slower than the agent's idle timeout is waited out on the
edge's keep-alives, a wrong key is refused on both surfaces, and Claude
Code's ``ANTHROPIC_AUTH_TOKEN`` (Bearer) gets in. After every run the edge's
log must hold one line per run with the expected finish, and no process a
warning or an error.

A whole Claude Code session goes through too (``up_session``): the sim's
scripted tool sequence (``tool_call_sequence``) makes the model write a
file with ``Write``, read it back with ``Read`` and ``ls``/``cat`` it with
``Bash``, one call per request, then quote the last output; a second turn
(``claude -p --resume <session id>``) plays the sequence again on top of
the first turn's conversation. A recording relay between Claude Code and
the edge (``tests/agents/_relay.py``) shows what each request carried: the
``X-Claude-Code-Session-Id`` header, the same on every request of both
turns and equal to the session id Claude reports.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import pytest

from iop.sim._script import _VOCABULARY
from tests.agents._agents import (
    API_KEY,
    CLAUDE_ALLOWED_TOOLS,
    PATCH_PROMPT,
    PLAIN_PROMPT,
    TOOL_PROMPT,
    AgentResult,
    run_claude,
    run_codex,
)
from tests.agents._relay import Relay
from tests.e2e._platform import LOG_LINE, Proc, poll, start_edge, start_node, start_sim

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL: Final = "iop-sim"
# The shell tool of each agent and the arguments the scripted model calls it with.
SHELL_ARGUMENTS: Final = {
    "exec_command": {"cmd": "echo iop-tool-ok"},
    "Bash": {"command": "echo iop-tool-ok"},
}
TOOL_MARKER: Final = "iop-tool-ok"
# Codex's custom apply_patch tool, offered as a function of one string
# argument (docs/api.md, "Tools"), called with a patch that adds a file; and
# a namespaced sub-agent tool, called for an agent that does not exist.
PATCH_FILE: Final = "iop-patch.txt"
PATCH_TEXT: Final = "patched through IOP"
CODEX_TOOL_ARGUMENTS: Final = {
    "apply_patch": {
        "input": f"*** Begin Patch\n*** Add File: {PATCH_FILE}\n+{PATCH_TEXT}\n*** End Patch\n"
    },
    "multi_agent_v1__wait_agent": {"targets": ["iop-no-such-agent"], "timeout_ms": 1000},
}
# Claude Code's session: the file its Write creates (in the test's directory)
# and what the last step's Bash prints (ls, then cat: the file's line).
SESSION_FILE: Final = "notes.txt"
SESSION_TEXT: Final = "iop-session-ok"
SESSION_SHELL: Final = f"ls && cat {SESSION_FILE}"
SESSION_ANSWER: Final = f"The tool said: {SESSION_FILE}\n{SESSION_TEXT}"
# The session's tools, allowed up front as the shell command is.
SESSION_TOOLS: Final = (*CLAUDE_ALLOWED_TOOLS, "Write", "Read", "Bash(ls:*)", "Bash(cat:*)")
# One request per step (each answered with a tool call), then the answer.
SESSION_RUNS: Final = ["tool_calls", "tool_calls", "tool_calls", "stop"]
SESSION_HEADER: Final = "X-Claude-Code-Session-Id"
# Words in a plain answer: short enough for one line, long enough not to be luck.
PLAIN_TOKENS: Final = 24
# Where the tool round trips run: iop up (without and with reasoning before
# the call) and the separate edge + node + sim.
TOOL_PLATFORMS: Final = ["up_tools", "up_reasoning", "split"]
# A first token this late (a queue, a long prefill), keep-alives this often,
# and a Codex that gives up after this long without an SSE event.
SLOW_TTFT_S: Final = 4.0
KEEPALIVE_S: Final = 0.25
CODEX_IDLE_MS: Final = 1500
# iop up starting the edge, the node and the sim on a loaded 2-core machine.
READY_TIMEOUT_S: Final = 60.0
# The edge logs a run's line as the run ends, around the time the agent exits.
LOG_TIMEOUT_S: Final = 10.0
_RUN_LINE: Final = re.compile(r"iop\.edge\.run: run \w+ (complete finish=(\w+)|cancelled|error)")
_PROBLEM: Final = re.compile(r"^\S+ (WARNING|ERROR|CRITICAL) ", re.MULTILINE)


@dataclass
class Platform:
    """IOP processes an agent talks to: ``url`` is the edge, ``edge`` logs the runs."""

    url: str
    edge: Proc
    procs: list[Proc]
    # Bytes of each process's stderr already checked.
    _seen: dict[str, int] = field(default_factory=dict)

    def logs(self) -> str:
        return "\n".join(p.logs(tail=60) for p in self.procs)

    def _new(self, proc: Proc) -> str:
        text = proc.stderr()
        return text[self._seen.get(proc.name, 0) :]

    def mark(self) -> None:
        for proc in self.procs:
            self._seen[proc.name] = len(proc.stderr())

    def runs_since_mark(self, expected: int) -> list[str]:
        """The outcomes (``finish`` or ``cancelled``/``error``) of the edge's runs
        since ``mark()``, once there are ``expected`` of them; no process may have
        logged a warning or error meanwhile."""

        def outcomes() -> list[str] | None:
            found = [m.group(2) or m.group(1) for m in _RUN_LINE.finditer(self._new(self.edge))]
            return found if len(found) >= expected else None

        try:
            found = poll(outcomes, timeout=LOG_TIMEOUT_S, what=f"{expected} run line(s)")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.logs()}") from None
        for proc in self.procs:
            new = self._new(proc)
            assert not _PROBLEM.search(new), f"{proc.name} logged a problem:\n{new}"
            assert all(LOG_LINE.match(line) for line in new.splitlines()), new
        return found


def _start_up(
    log_dir: Path,
    name: str,
    sim: dict[str, object],
    server: dict[str, object] | None = None,
    sequence: Sequence[tuple[str, dict[str, object]]] = (),
) -> Iterator[Platform]:
    """``iop up --backend sim`` with ``[embedded.sim]`` = ``sim`` (and the
    scripted tool ``sequence``), one API key and ``[edge.server]`` keys ``server``."""
    lines = [
        "[edge.server]",
        f"api_keys = [{json.dumps(API_KEY)}]",
        *(f"{key} = {json.dumps(value)}" for key, value in (server or {}).items()),
        "",
        "[embedded]",
        'kind = "sim"',
        "",
        "[embedded.sim]",
        *(
            f"{key} = {json.dumps(value)}"
            for key, value in ({"ttft_s": 0.0} | sim).items()
            if key != "by_tool"
        ),
    ]
    by_tool = sim.get("by_tool")
    if isinstance(by_tool, dict):
        lines += ["", "[embedded.sim.tool_call_arguments_by_tool]"]
        lines += [f"{tool} = {json.dumps(json.dumps(args))}" for tool, args in by_tool.items()]
    for tool, args in sequence:
        lines += ["", "[[embedded.sim.tool_call_sequence]]", f"name = {json.dumps(tool)}"]
        lines += [f"arguments = {json.dumps(json.dumps(args))}"]
    log_dir.mkdir(parents=True, exist_ok=True)
    config = log_dir / f"{name}.toml"
    config.write_text("\n".join(lines) + "\n")
    proc = Proc(name, ["up", "--port", "0", "--backend", "sim", "--config", str(config)], log_dir)
    try:
        proc.wait_stdout(rf"iop up: ready; models: '{MODEL}'", timeout=READY_TIMEOUT_S)
        found = re.search(r"OpenAI API on (http://\S+)/v1", proc.stdout())
        assert found is not None, proc.logs()
        yield Platform(found.group(1), proc, [proc])
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def up_plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """``iop up --backend sim`` whose model answers with text, tools or not."""
    yield from _start_up(
        tmp_path_factory.mktemp("up-plain"),
        "iop-up-plain",
        {"tool_mode": "none", "output_tokens": PLAIN_TOKENS},
    )


@pytest.fixture(scope="module")
def up_tools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """``iop up --backend sim`` whose model calls the agent's shell tool, then quotes it."""
    yield from _start_up(
        tmp_path_factory.mktemp("up-tools"),
        "iop-up-tools",
        {"tool_call_names": list(SHELL_ARGUMENTS), "by_tool": SHELL_ARGUMENTS},
    )


@pytest.fixture(scope="module")
def up_reasoning(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """``up_tools`` whose model reasons first: Responses ``reasoning`` items and
    Anthropic ``thinking`` blocks in the answer, which the agents pass back
    on the next turn (as they do the stub's: tests/data/agents/README.md)."""
    yield from _start_up(
        tmp_path_factory.mktemp("up-reasoning"),
        "iop-up-reasoning",
        {
            "reasoning_tokens": 6,
            "tool_call_names": list(SHELL_ARGUMENTS),
            "by_tool": SHELL_ARGUMENTS,
        },
    )


@pytest.fixture(scope="module")
def up_codex_tools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """``iop up --backend sim`` whose model calls Codex's ``apply_patch`` when it
    is offered, else ``multi_agent_v1``'s ``wait_agent`` (the first of
    ``tool_call_names`` a request declares), then quotes the tool's output."""
    yield from _start_up(
        tmp_path_factory.mktemp("up-codex-tools"),
        "iop-up-codex-tools",
        {"tool_call_names": list(CODEX_TOOL_ARGUMENTS), "by_tool": CODEX_TOOL_ARGUMENTS},
    )


@pytest.fixture(scope="module")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where Claude Code's session works: its scripted Write names a file here."""
    return tmp_path_factory.mktemp("claude-session")


@pytest.fixture(scope="module")
def up_session(tmp_path_factory: pytest.TempPathFactory, session_dir: Path) -> Iterator[Platform]:
    """``iop up --backend sim`` whose model, in each user turn, writes
    ``SESSION_FILE`` in ``session_dir``, reads it, lists and prints it with
    the shell (one tool call per request), then quotes the shell's output."""
    path = str(session_dir / SESSION_FILE)
    yield from _start_up(
        tmp_path_factory.mktemp("up-session"),
        "iop-up-session",
        {},
        sequence=[
            ("Write", {"file_path": path, "content": SESSION_TEXT + "\n"}),
            ("Read", {"file_path": path}),
            ("Bash", {"command": SESSION_SHELL}),
        ],
    )


@pytest.fixture(scope="module")
def up_slow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """``iop up --backend sim`` whose model takes ``SLOW_TTFT_S`` to its first token
    (a queue or a long prefill), with keep-alives every ``KEEPALIVE_S``."""
    yield from _start_up(
        tmp_path_factory.mktemp("up-slow"),
        "iop-up-slow",
        {"tool_mode": "none", "output_tokens": PLAIN_TOKENS, "ttft_s": SLOW_TTFT_S},
        {"keepalive_interval_s": KEEPALIVE_S},
    )


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """``iop sim`` (scripted tool mode, vLLM's wire format) + ``iop edge`` + ``iop node``."""
    log_dir = tmp_path_factory.mktemp("split")
    flags = ["--ttft", "0"]
    for tool, args in SHELL_ARGUMENTS.items():
        flags += [
            "--tool-call-name",
            tool,
            "--tool-call-arguments-for",
            f"{tool}={json.dumps(args)}",
        ]
    sim = start_sim(log_dir, "sim", *flags)
    try:
        edge = start_edge(log_dir, {"server": {"api_keys": [API_KEY]}})
        try:
            node = start_node(log_dir, [edge.link_url], sim.url)
            try:
                edge.wait_ready(MODEL, node.node_id)
                yield Platform(edge.url, edge.proc, [edge.proc, node.proc, sim.proc])
            finally:
                node.proc.stop()
        finally:
            edge.close()
            edge.proc.stop()
    finally:
        sim.close()
        sim.proc.stop()


def _explain(result: AgentResult, platform: Platform) -> str:
    return (
        f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}\n"
        + platform.logs()
    )


def _assert_sim_text(answer: str, result: AgentResult, platform: Platform) -> None:
    """``answer`` is the sim's plain text: sentences of words of its vocabulary."""
    words = re.findall(r"[A-Za-z]+", answer)
    assert len(words) >= PLAIN_TOKENS // 2, _explain(result, platform)
    assert {w.lower() for w in words} <= set(_VOCABULARY), _explain(result, platform)
    assert re.fullmatch(r"[A-Za-z .]+", answer), _explain(result, platform)


# --------------------------------------------------------------------- Codex CLI


def _codex(platform: Platform, prompt: str, workdir: Path, codex_bin: Path) -> AgentResult:
    platform.mark()
    return run_codex(platform.url, prompt, workdir, binary=codex_bin, model=MODEL)


def _assert_codex_tool_round_trip(result: AgentResult, platform: Platform) -> None:
    assert result.returncode == 0, _explain(result, platform)
    # Codex ran the command the model asked for (its log of the turn is stderr) ...
    assert "echo iop-tool-ok" in result.stderr, _explain(result, platform)
    # ... and the model's final answer quotes the exec_command output Codex sent back.
    answer = result.stdout.strip()
    assert answer.startswith("The tool said: "), _explain(result, platform)
    assert re.search(r"Process exited with code 0\n.*Output:\niop-tool-ok$", answer, re.DOTALL), (
        _explain(result, platform)
    )
    assert platform.runs_since_mark(2) == ["tool_calls", "stop"], _explain(result, platform)


def test_codex_plain_turn(up_plain: Platform, codex_bin: Path, workdir: Path) -> None:
    result = _codex(up_plain, PLAIN_PROMPT, workdir, codex_bin)
    assert result.returncode == 0, _explain(result, up_plain)
    _assert_sim_text(result.stdout.strip(), result, up_plain)
    assert up_plain.runs_since_mark(1) == ["stop"], _explain(result, up_plain)


@pytest.mark.parametrize("where", TOOL_PLATFORMS)
def test_codex_tool_round_trip(
    where: str, request: pytest.FixtureRequest, codex_bin: Path, workdir: Path
) -> None:
    platform: Platform = request.getfixturevalue(where)
    result = _codex(platform, TOOL_PROMPT, workdir, codex_bin)
    _assert_codex_tool_round_trip(result, platform)


def test_codex_edits_a_file_with_apply_patch(
    up_codex_tools: Platform, codex_bin: Path, workdir: Path
) -> None:
    up_codex_tools.mark()
    result = run_codex(
        up_codex_tools.url,
        PATCH_PROMPT,
        workdir,
        binary=codex_bin,
        model=MODEL,
        freeform_apply_patch=True,
    )
    assert result.returncode == 0, _explain(result, up_codex_tools)
    # The model's custom tool call reached Codex as a custom_tool_call and
    # Codex applied the patch ...
    assert (workdir / PATCH_FILE).read_text() == PATCH_TEXT + "\n", _explain(result, up_codex_tools)
    # ... and its custom_tool_call_output reached the model as the tool's result.
    answer = result.stdout.strip()
    assert answer.startswith("The tool said: Exit code: 0"), _explain(result, up_codex_tools)
    assert f"Success. Updated the following files:\nA {PATCH_FILE}" in answer, _explain(
        result, up_codex_tools
    )
    assert up_codex_tools.runs_since_mark(2) == ["tool_calls", "stop"], _explain(
        result, up_codex_tools
    )


def test_codex_runs_a_namespaced_sub_agent_tool(
    up_codex_tools: Platform, codex_bin: Path, workdir: Path
) -> None:
    # No catalog entry: no apply_patch offered, so the model calls wait_agent.
    result = _codex(up_codex_tools, "Wait for the sub-agent.", workdir, codex_bin)
    assert result.returncode == 0, _explain(result, up_codex_tools)
    answer = result.stdout.strip()
    # Codex dispatched it to its multi-agent handler, which refused the id;
    # a call it did not recognise would say "unsupported call".
    assert answer.startswith("The tool said: invalid agent id iop-no-such-agent"), _explain(
        result, up_codex_tools
    )
    assert up_codex_tools.runs_since_mark(2) == ["tool_calls", "stop"], _explain(
        result, up_codex_tools
    )


def test_codex_waits_out_a_first_token_slower_than_its_idle_timeout(
    up_slow: Platform, codex_bin: Path, workdir: Path
) -> None:
    # Codex gives a turn up after stream_idle_timeout_ms without an SSE
    # event (default 300 s; comments do not count: "idle timeout waiting
    # for SSE"). The edge's keep-alives must be events it reads and ignores.
    up_slow.mark()
    result = run_codex(
        up_slow.url,
        PLAIN_PROMPT,
        workdir,
        binary=codex_bin,
        model=MODEL,
        stream_idle_timeout_ms=CODEX_IDLE_MS,
    )
    assert result.returncode == 0, _explain(result, up_slow)
    _assert_sim_text(result.stdout.strip(), result, up_slow)
    assert up_slow.runs_since_mark(1) == ["stop"], _explain(result, up_slow)


def test_codex_with_a_wrong_key_gets_the_edges_401(
    up_plain: Platform, codex_bin: Path, workdir: Path
) -> None:
    up_plain.mark()
    result = run_codex(
        up_plain.url, PLAIN_PROMPT, workdir, binary=codex_bin, model=MODEL, api_key="sk-wrong-key"
    )
    assert result.returncode == 1, _explain(result, up_plain)
    assert "401 Unauthorized: Incorrect API key provided." in result.stderr, _explain(
        result, up_plain
    )
    assert up_plain.runs_since_mark(0) == [], _explain(result, up_plain)


# --------------------------------------------------------------------- Claude Code


def _claude(platform: Platform, prompt: str, workdir: Path, claude_bin: Path) -> AgentResult:
    platform.mark()
    return run_claude(platform.url, prompt, workdir, binary=claude_bin, model=MODEL)


def _assert_claude_tool_round_trip(result: AgentResult, platform: Platform) -> None:
    assert result.returncode == 0, _explain(result, platform)
    # The tool_result Claude sent back is the command's output alone: the
    # answer has the marker without the "echo" of the arguments.
    assert result.stdout.strip() == f"The tool said: {TOOL_MARKER}", _explain(result, platform)
    # Two streamed requests (a failed stream would have been repeated without
    # streaming: more runs), the first ending in the tool call.
    assert platform.runs_since_mark(2) == ["tool_calls", "stop"], _explain(result, platform)


def test_claude_plain_turn(up_plain: Platform, claude_bin: Path, workdir: Path) -> None:
    result = _claude(up_plain, PLAIN_PROMPT, workdir, claude_bin)
    assert result.returncode == 0, _explain(result, up_plain)
    _assert_sim_text(result.stdout.strip(), result, up_plain)
    assert up_plain.runs_since_mark(1) == ["stop"], _explain(result, up_plain)


@pytest.mark.parametrize("where", TOOL_PLATFORMS)
def test_claude_tool_round_trip(
    where: str, request: pytest.FixtureRequest, claude_bin: Path, workdir: Path
) -> None:
    platform: Platform = request.getfixturevalue(where)
    result = _claude(platform, TOOL_PROMPT, workdir, claude_bin)
    _assert_claude_tool_round_trip(result, platform)


def test_claude_waits_out_a_slow_first_token(
    up_slow: Platform, claude_bin: Path, workdir: Path
) -> None:
    # The Messages surface's keep-alives are Anthropic's ping events.
    result = _claude(up_slow, PLAIN_PROMPT, workdir, claude_bin)
    assert result.returncode == 0, _explain(result, up_slow)
    _assert_sim_text(result.stdout.strip(), result, up_slow)
    # One streamed request: the stream was read, not abandoned for the
    # non-streaming fallback.
    assert up_slow.runs_since_mark(1) == ["stop"], _explain(result, up_slow)


def test_claude_with_a_wrong_key_gets_the_edges_401(
    up_plain: Platform, claude_bin: Path, workdir: Path
) -> None:
    up_plain.mark()
    result = run_claude(
        up_plain.url, PLAIN_PROMPT, workdir, binary=claude_bin, model=MODEL, api_key="sk-wrong-key"
    )
    assert result.returncode == 1, _explain(result, up_plain)
    # Claude Code's words for Anthropic's 401 authentication_error, on stdout.
    assert "Invalid API key" in result.stdout, _explain(result, up_plain)
    assert up_plain.runs_since_mark(0) == [], _explain(result, up_plain)


def test_claude_with_an_auth_token_sends_bearer_and_is_let_in(
    up_plain: Platform, claude_bin: Path, workdir: Path
) -> None:
    up_plain.mark()
    result = run_claude(
        up_plain.url,
        PLAIN_PROMPT,
        workdir,
        binary=claude_bin,
        model=MODEL,
        key_variable="ANTHROPIC_AUTH_TOKEN",
    )
    assert result.returncode == 0, _explain(result, up_plain)
    _assert_sim_text(result.stdout.strip(), result, up_plain)
    assert up_plain.runs_since_mark(1) == ["stop"], _explain(result, up_plain)


def _session_turn(
    relay: Relay, prompt: str, workdir: Path, claude_bin: Path, home: Path, *options: str
) -> tuple[AgentResult, dict[str, object]]:
    """One ``claude -p`` turn of the session through ``relay``: its result and
    the ``--output-format json`` summary Claude prints."""
    result = run_claude(
        relay.url,
        prompt,
        workdir,
        binary=claude_bin,
        model=MODEL,
        allowed_tools=SESSION_TOOLS,
        options=["--output-format", "json", *options],
        home=home,
    )
    summary = json.loads(result.stdout) if result.returncode == 0 else {}
    return result, summary


def _without_cache_control(value: object) -> object:
    if isinstance(value, dict):
        return {k: _without_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_without_cache_control(v) for v in value]
    return value


def _tool_results(body: object) -> list[str]:
    """The text of every ``tool_result`` block of a Messages request body."""
    assert isinstance(body, dict)
    found: list[str] = []
    for message in body["messages"]:
        content = message["content"]
        for block in content if isinstance(content, list) else []:
            if block.get("type") == "tool_result":
                inner = block["content"]
                parts = inner if isinstance(inner, list) else [{"text": inner}]
                found.append("".join(p.get("text", "") for p in parts))
    return found


def test_claude_session_with_tool_round_trips_and_a_resumed_turn(
    up_session: Platform, session_dir: Path, claude_bin: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"  # kept between the turns: Claude's sessions live there
    home.mkdir()
    with Relay(up_session.url) as relay:
        up_session.mark()
        first, summary = _session_turn(
            relay, "Write notes.txt, read it back, then list it.", session_dir, claude_bin, home
        )
        assert first.returncode == 0, _explain(first, up_session)
        # Three tool round trips and the answer: the Write left the file, the
        # Read's result carried its text, the Bash output reached the model.
        assert summary["result"] == SESSION_ANSWER, _explain(first, up_session)
        assert summary["num_turns"] == len(SESSION_RUNS), _explain(first, up_session)
        assert (session_dir / SESSION_FILE).read_text() == SESSION_TEXT + "\n"
        assert up_session.runs_since_mark(len(SESSION_RUNS)) == SESSION_RUNS, _explain(
            first, up_session
        )
        turn_one = relay.exchanges()
        # Every request of the turn went through the relay to IOP (as many as
        # the edge ran), each a streamed Messages request that succeeded.
        assert len(turn_one) == len(SESSION_RUNS), turn_one
        assert {(e.method, e.path, e.status) for e in turn_one} == {
            ("POST", "/v1/messages?beta=true", 200)
        }
        results = _tool_results(turn_one[-1].json())
        assert len(results) == 3, results
        assert SESSION_TEXT in results[1], results
        assert results[2] == f"{SESSION_FILE}\n{SESSION_TEXT}", results
        session_id = summary["session_id"]
        assert isinstance(session_id, str)
        assert session_id

        # The second turn resumes the session: the same id, the first turn's
        # conversation under the new prompt, the sequence played again.
        up_session.mark()
        second, summary = _session_turn(
            relay, "Do it again.", session_dir, claude_bin, home, "--resume", session_id
        )
        assert second.returncode == 0, _explain(second, up_session)
        assert summary["result"] == SESSION_ANSWER, _explain(second, up_session)
        assert summary["session_id"] == session_id, summary
        assert up_session.runs_since_mark(len(SESSION_RUNS)) == SESSION_RUNS, _explain(
            second, up_session
        )
        turn_two = relay.exchanges()[len(turn_one) :]
        assert len(turn_two) == len(SESSION_RUNS), turn_two
        # The resumed turn starts with the whole conversation the first turn
        # ended with (cache_control markers move to the newest message):
        # the prefix a backend's cache holds.
        before = _without_cache_control(turn_one[-1].json()["messages"])
        resumed = _without_cache_control(turn_two[0].json()["messages"])
        assert len(resumed) > len(before), resumed
        assert resumed[: len(before)] == before, resumed
        assert _tool_results(turn_two[0].json()) == results
        assert len(_tool_results(turn_two[-1].json())) == 2 * len(results)

    # One session id on every request of both turns: what the edge can key
    # a session's scheduling on.
    headers = {e.header(SESSION_HEADER) for e in turn_one + turn_two}
    assert headers == {session_id}, headers
