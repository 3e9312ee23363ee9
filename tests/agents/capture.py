"""Capture what the real agents send: ``python -m tests.agents.capture`` (from the repo root).

Runs Codex CLI and Claude Code (installed by ``tests/agents/_agents.py``)
against the recording stub (``tests/agents/_stub.py``) and rewrites
``tests/data/agents/<capture>/``: ``meta.json`` (agent, version, scenario,
command, environment, exit code, output, and per request the method, path,
query, headers with secrets masked, status and file names) and, per request,
``NN-request.json`` (the body exactly as the agent sent it) and
``NN-response.sse``/``.json`` (exactly what the stub answered). Pass capture
names to rewrite only those. tests/data/agents/README.md describes each one.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from tests.agents import _agents
from tests.agents._stub import Scenario, Stub, Variant

DATA: Final = Path(__file__).resolve().parent.parent / "data" / "agents"
# A fixed working directory: the agents put it in their prompts, and a fixed
# path keeps a re-capture's diff to what really changed.
WORKDIR: Final = Path("/tmp/iop-agents-capture/work")
MODEL: Final = "iop-model"


@dataclass(frozen=True)
class Capture:
    name: str
    agent: str
    scenario: Scenario
    what: str
    variant: Variant = field(default_factory=Variant)
    quiet: bool = True
    # Codex: a model catalog entry that makes it offer apply_patch as a
    # custom tool (_agents.codex_model_catalog).
    freeform_apply_patch: bool = False


CAPTURES: Final = [
    Capture("codex-plain", "codex", "plain", "Codex CLI, one plain turn"),
    Capture("codex-tool", "codex", "tool", "Codex CLI, a shell tool round trip"),
    Capture(
        "codex-default-config",
        "codex",
        "plain",
        "Codex CLI, one plain turn without the settings that stop background traffic",
        quiet=False,
    ),
    Capture(
        "codex-reasoning",
        "codex",
        "tool",
        "Codex CLI, tool round trip where the model's answer starts with a reasoning item",
        Variant(reasoning=True),
    ),
    Capture(
        "codex-apply-patch",
        "codex",
        "patch",
        "Codex CLI, with a model catalog entry for its model: apply_patch offered as a custom "
        "tool beside the namespace and web_search tools; a custom tool round trip that adds a file",
        freeform_apply_patch=True,
    ),
    Capture("claude-plain", "claude", "plain", "Claude Code, one plain turn"),
    Capture("claude-tool", "claude", "tool", "Claude Code, a Bash tool round trip"),
    Capture(
        "claude-fallback",
        "claude",
        "tool",
        "Claude Code, tool round trip when the stream has no `event:` lines: "
        "each streamed request is followed by a non-streaming one",
        Variant(omit_event_lines=True),
    ),
    Capture(
        "claude-thinking",
        "claude",
        "tool",
        "Claude Code, tool round trip where the model's answer starts with a thinking block",
        Variant(reasoning=True),
    ),
    Capture(
        "claude-max-tokens",
        "claude",
        "plain",
        "Claude Code, plain turn whose every answer ends with stop_reason max_tokens",
        Variant(truncated=True),
    ),
    Capture(
        "claude-default-env",
        "claude",
        "plain",
        "Claude Code, one plain turn without the environment that stops non-essential traffic",
        quiet=False,
    ),
]


def _runner(agent: str) -> Callable[..., _agents.AgentResult]:
    return _agents.run_codex if agent == "codex" else _agents.run_claude


def capture(spec: Capture) -> dict[str, object]:
    shutil.rmtree(WORKDIR, ignore_errors=True)
    WORKDIR.mkdir(parents=True)
    prompt = {
        "plain": _agents.PLAIN_PROMPT,
        "tool": _agents.TOOL_PROMPT,
        "patch": _agents.PATCH_PROMPT,
    }[spec.scenario]
    extra = {"freeform_apply_patch": True} if spec.freeform_apply_patch else {}
    with Stub(scenario=spec.scenario, variant=spec.variant) as stub:
        result = _runner(spec.agent)(
            stub.base_url,
            prompt,
            WORKDIR,
            model=MODEL,
            proxy=stub.base_url,
            quiet=spec.quiet,
            **extra,
        )
    out = DATA / spec.name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    requests = []
    for number, rec in enumerate(stub.requests, start=1):
        entry: dict[str, object] = {
            "method": rec.method,
            "path": rec.path,
            "query": rec.query,
            "headers": rec.headers,
            "status": rec.status,
        }
        if rec.body:
            name = f"{number:02d}-request.json"
            (out / name).write_bytes(rec.body)
            entry["body_file"] = name
        if rec.response:
            is_sse = rec.response.startswith((b"event:", b"data:", b":"))
            name = f"{number:02d}-response.{'sse' if is_sse else 'json'}"
            (out / name).write_bytes(rec.response)
            entry["response_file"] = name
        requests.append(entry)
    version = _agents.CODEX_VERSION if spec.agent == "codex" else _agents.CLAUDE_VERSION
    meta: dict[str, object] = {
        "capture": spec.name,
        "what": spec.what,
        "agent": spec.agent,
        "version": version,
        "scenario": spec.scenario,
        "variant": {k: v for k, v in vars(spec.variant).items() if v},
        "quiet": spec.quiet,
        "freeform_apply_patch": spec.freeform_apply_patch,
        "prompt": prompt,
        "model": MODEL,
        "command": list(result.command),
        "env": dict(result.env),
        "codex_config": result.config or None,
        "exit_code": result.returncode,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "requests": requests,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    return meta


def main(names: list[str]) -> int:
    chosen = [c for c in CAPTURES if not names or c.name in names]
    for spec in chosen:
        meta = capture(spec)
        calls = ", ".join(
            f"{r['method']} {r['path']}{'?' + str(r['query']) if r['query'] else ''}"
            for r in meta["requests"]  # type: ignore[attr-defined]
        )
        print(f"{spec.name}: exit {meta['exit_code']}: {calls}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
