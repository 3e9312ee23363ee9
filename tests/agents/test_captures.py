"""The captures in tests/data/agents replay byte for byte, and hold no secret.

Each captured request body is posted again, exactly as the agent sent it
(same path, query and headers, bar the masked ones), to a fresh stub in the
capture's scenario and variant; the answer must be the captured response,
byte for byte. That keeps the files and the stub honest with each other, so
tests of the real surfaces can replay the same bytes. No agent is needed.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any, Final

import pytest

from tests.agents._agents import API_KEY, CLAUDE_VERSION, CODEX_VERSION
from tests.agents._stub import MASK, Stub, Variant

DATA: Final = Path(__file__).resolve().parent.parent / "data" / "agents"
CAPTURES: Final = sorted(p.parent for p in DATA.glob("*/meta.json"))
EXPECTED: Final = {
    "codex-plain",
    "codex-tool",
    "codex-default-config",
    "claude-plain",
    "claude-tool",
    "claude-fallback",
    "claude-default-env",
    "codex-reasoning",
    "codex-apply-patch",
    "claude-thinking",
    "claude-max-tokens",
}
# Hop-by-hop and per-connection headers the replaying client sets itself.
NOT_REPLAYED: Final = {"host", "content-length", "connection", "accept-encoding"}


def _meta(capture: Path) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((capture / "meta.json").read_text())
    return meta


def test_every_capture_is_there() -> None:
    assert {p.name for p in CAPTURES} == EXPECTED
    for capture in CAPTURES:
        meta = _meta(capture)
        assert meta["exit_code"] == (1 if capture.name == "claude-max-tokens" else 0), capture.name
        want = CODEX_VERSION if meta["agent"] == "codex" else CLAUDE_VERSION
        assert meta["version"] == want, capture.name


@pytest.mark.parametrize("capture", CAPTURES, ids=lambda p: p.name)
def test_no_secret_in_a_capture(capture: Path) -> None:
    for path in capture.iterdir():
        assert API_KEY not in path.read_text(), path
    for request in _meta(capture)["requests"]:
        for name, value in request["headers"]:
            if name.lower() in {"authorization", "x-api-key"}:
                assert value == MASK


@pytest.mark.parametrize("capture", CAPTURES, ids=lambda p: p.name)
def test_capture_replays_byte_for_byte(capture: Path) -> None:
    meta = _meta(capture)
    posts = [r for r in meta["requests"] if r["method"] == "POST"]
    assert posts, capture.name
    with Stub(scenario=meta["scenario"], variant=Variant(**meta["variant"])) as stub:
        host, port = stub.base_url.removeprefix("http://").split(":")
        for request in posts:
            body = (capture / request["body_file"]).read_bytes()
            headers = {
                name: value
                for name, value in request["headers"]
                if name.lower() not in NOT_REPLAYED and value != MASK
            }
            target = request["path"] + ("?" + request["query"] if request["query"] else "")
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            try:
                conn.request("POST", target, body=body, headers=headers)
                response = conn.getresponse()
                got = response.read()
            finally:
                conn.close()
            assert response.status == request["status"]
            assert got == (capture / request["response_file"]).read_bytes(), request["body_file"]
    assert [r.body for r in stub.requests] == [
        (capture / r["body_file"]).read_bytes() for r in posts
    ]
