"""Failover before the first content, on every surface, through the official SDKs.

A backend that fails before its first token is no reason to fail a run while
another instance of the model stands by, whatever the surface has already
told the client: a streamed Responses answer has sent ``response.created``
and a Messages answer ``message_start`` (with the headers, once
``keepalive_interval_s`` passed without output, then keep-alives), and
those openings say nothing about the instance (docs/architecture.md,
"The edge"; the field's counter-example: a gateway that stops falling
back once ``response.created`` is out, https://github.com/maximhq/bifrost/issues/5395).

Real processes: ``iop edge``; ``iop node`` with two instances of the model,
the first (which an idle tie puts the run on) a sim whose every answer
fails before its first token (``midstream_error``, ``fail_after_tokens =
0``: a 500 for a whole body, an error event after the role chunk for a
stream), the second a sim that answers. Four rigs (``BAD``): one whose bad
backend fails at once (before the edge sent anything), one whose bad
backend fails only after ``SLOW_FAIL_S``, when the headers, the surface's
opening event and keep-alives are long out, one that answers 500 and one
that answers 429.
Each run must end with one complete answer from the good instance, one
opening event, and a timeline with both attempts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import anthropic
import httpx
import openai
import pytest

from iop.wire import SSEDecoder
from tests.e2e._platform import MODEL, Edge, Procs, Sim

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TOKENS: Final = 6
# The slow bad backend's time to its failure: many keep-alive intervals.
KEEPALIVE_S: Final = 0.1
SLOW_FAIL_S: Final = 1.0
HI: Any = [{"role": "user", "content": "hi"}]


@dataclass
class Rig:
    edge: Edge
    slow: bool  # the bad backend fails after the opening and keep-alives went out

    def openai(self) -> openai.OpenAI:
        return self.edge.openai()

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.edge.url, api_key="x", max_retries=0, timeout=30)

    def raw(self, path: str, body: dict[str, Any]) -> list[tuple[str, str]]:
        """A streamed POST read raw: ``(event, data)`` of each SSE event."""
        headers = {"anthropic-version": "2023-06-01"}
        with (
            httpx.Client(base_url=self.edge.url, timeout=30) as http,
            http.stream("POST", path, json={**body, "stream": True}, headers=headers) as resp,
        ):
            assert resp.status_code == 200, resp.read()
            raw = b"".join(resp.iter_bytes())
        return [(ev.event, ev.data) for ev in SSEDecoder().feed(raw)]

    def last_run(self, seen: set[str]) -> dict[str, Any]:
        """The timeline of the one run that ended since ``seen`` was taken."""
        self.edge.wait_no_runs()
        recent = self.runs()
        new = [r for r in recent if r not in seen]
        assert len(new) == 1, (new, seen)
        resp = self.edge.admin_get(f"/admin/runs/{new[0]}")
        resp.raise_for_status()
        timeline: dict[str, Any] = resp.json()
        return timeline

    def runs(self) -> set[str]:
        resp = self.edge.admin_get("/admin/runs?limit=1000")
        resp.raise_for_status()
        return {r["run_id"] for r in resp.json()["recent"]}

    def check_failed_over(self, seen: set[str]) -> None:
        """The run's timeline: the bad instance failed it, the good one ran it."""
        t = self.last_run(seen)
        placements = [(p["instance"], p["result"]) for p in t["placements"]]
        assert [p[0] for p in placements] == ["bad", "good"], placements
        assert placements[0][1].startswith("retry: "), placements
        assert placements[1][1] == "ran", placements
        assert t["outcome"] == "complete:stop", t


def _rig(procs: Procs, good: Sim, bad: Sim) -> Edge:
    edge = procs.edge(
        {
            "server": {"keepalive_interval_s": KEEPALIVE_S},
            # Each run's first pick is the idle tie's first, the bad instance.
            "scheduler": {"affinity": False},
        }
    )
    # No load reports or engine scrapes: a report that still counts the last
    # run on an instance would break the idle tie.
    quiet = {"load_scrape_interval_s": 0}
    procs.node(
        [edge],
        bad,
        node={"load_reports_per_s": 0},
        instance={"name": "bad", **quiet},
        more_instances=[{"adapter": "vllm", "name": "good", "endpoint": good.url, **quiet}],
    )
    edge.wait_ready(node_id="n1")
    return edge


# How the bad backend fails: an error before its first token, at once or
# after SLOW_FAIL_S; or a 500 answer instead of a stream.
BAD: Final = {
    "fast": ("--failure", "midstream_error", "--fail-after-tokens", "0", "--ttft", "0"),
    "slow": (
        "--failure",
        "midstream_error",
        "--fail-after-tokens",
        "0",
        "--ttft",
        str(SLOW_FAIL_S),
    ),
    "http_500": ("--failure", "http_500"),
    # A backend out of capacity (vLLM behind a rate limiter, a hosted
    # OpenAI-compatible server): another instance may have room.
    "http_429": ("--failure", "http_429"),
}


@pytest.fixture(scope="module", params=sorted(BAD))
def rig(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    slow = request.param == "slow"
    procs = Procs(tmp_path_factory.mktemp(f"failover-{request.param}"))
    try:
        good = procs.sim("good", "--output-tokens", str(TOKENS))
        bad = procs.sim("bad", *BAD[request.param])
        yield Rig(_rig(procs, good, bad), slow)
    finally:
        procs.stop_all()


def test_chat_fails_over_before_content(rig: Rig) -> None:
    seen = rig.runs()
    with rig.openai() as client:
        done = client.chat.completions.create(model=MODEL, messages=HI)
    assert done.choices[0].finish_reason == "stop"
    assert done.choices[0].message.content
    rig.check_failed_over(seen)

    seen = rig.runs()
    with rig.openai() as client:
        stream = client.chat.completions.create(model=MODEL, messages=HI, stream=True)
        chunks = list(stream)
    roles = [c for c in chunks if c.choices and c.choices[0].delta.role]
    assert len(roles) == 1, chunks
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == done.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    rig.check_failed_over(seen)


def test_completions_fail_over_before_content(rig: Rig) -> None:
    seen = rig.runs()
    with rig.openai() as client:
        done = client.completions.create(model=MODEL, prompt="hi")
    assert done.choices[0].finish_reason == "stop"
    assert done.choices[0].text
    rig.check_failed_over(seen)

    seen = rig.runs()
    with rig.openai() as client:
        chunks = list(client.completions.create(model=MODEL, prompt="hi", stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    rig.check_failed_over(seen)


def test_responses_fail_over_before_content(rig: Rig) -> None:
    seen = rig.runs()
    with rig.openai() as client:
        done = client.responses.create(model=MODEL, input="hi")
    assert done.status == "completed"
    assert done.output_text
    rig.check_failed_over(seen)

    seen = rig.runs()
    with rig.openai() as client:
        events = list(client.responses.create(model=MODEL, input="hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds.count("response.created") == 1, kinds
    assert kinds[0] == "response.created", kinds
    assert kinds[-1] == "response.completed", kinds
    assert "response.failed" not in kinds, kinds
    assert "error" not in kinds, kinds
    final = events[-1]
    assert final.type == "response.completed"
    assert final.response.output_text == done.output_text
    # The opening's response is the one that completed.
    assert events[0].type == "response.created"
    assert events[0].response.id == final.response.id
    rig.check_failed_over(seen)


def test_messages_fail_over_before_content(rig: Rig) -> None:
    seen = rig.runs()
    with rig.anthropic() as client:
        done = client.messages.create(model=MODEL, max_tokens=64, messages=HI)
    assert done.stop_reason == "end_turn"
    assert done.content[0].type == "text"
    assert done.content[0].text
    rig.check_failed_over(seen)

    seen = rig.runs()
    with rig.anthropic() as client:
        events = list(client.messages.create(model=MODEL, max_tokens=64, messages=HI, stream=True))
    kinds = [e.type for e in events]
    assert kinds.count("message_start") == 1, kinds
    assert kinds[0] == "message_start", kinds
    assert kinds[-1] == "message_stop", kinds
    text = "".join(
        e.delta.text
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "text_delta"
    )
    assert text == done.content[0].text
    stop = [e for e in events if e.type == "message_delta"]
    assert stop[-1].delta.stop_reason == "end_turn"
    rig.check_failed_over(seen)


@pytest.mark.parametrize(
    ("path", "body", "opening", "keepalive", "content"),
    [
        (
            "/v1/responses",
            {"model": MODEL, "input": "hi"},
            "response.created",
            "keepalive",
            "response.output_text.delta",
        ),
        (
            "/v1/messages",
            {"model": MODEL, "max_tokens": 64, "messages": HI},
            "message_start",
            "ping",
            "content_block_delta",
        ),
    ],
)
def test_the_opening_leaves_once_and_keepalives_precede_a_slow_failover(
    rig: Rig, path: str, body: dict[str, Any], opening: str, keepalive: str, content: str
) -> None:
    """Read raw: the opening event is sent once, whether the failure came
    before it (fast) or after it and keep-alives (slow), and no error
    event reaches the client."""
    seen = rig.runs()
    events = rig.raw(path, body)
    names = [name for name, _ in events]
    assert names.count(opening) == 1, names
    assert names[0] == opening, names
    assert "error" not in names, names
    assert "response.failed" not in names, names
    assert content in names, names
    if rig.slow:
        # The opening and keep-alives went out before the bad backend
        # failed: the failover happened behind a committed 200.
        assert keepalive in names[: names.index(content)], names
    for _, data in events:
        json.loads(data)
    rig.check_failed_over(seen)
