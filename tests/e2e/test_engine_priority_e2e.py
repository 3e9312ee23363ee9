"""Engine priority on real processes (docs/operations.md, "Engine priority"): ``iop
edge`` with ``priority_overflow_slots``, ``iop node`` with a vllm instance of 2 slots
and ``engine_priority``, ``iop sim`` with a batch of 2 (``--max-num-seqs``) and vLLM's
priority scheduling policy. Both slots hold streamed batch runs that are answering; an
interactive stream takes an overflow seat, the engine preempts the newer batch run for
it, and the interactive stream has its first token while both batch streams are still
open; each batch client still gets its whole answer, no error. Through the openai SDK.

No timing is asserted: only the order of events, the edge's timelines and the
engine's preemption count.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Final

import httpx
import openai
import pytest

from tests.e2e._platform import MODEL, Procs, poll

ADMIN_KEY: Final = "iop-e2e-engine-priority-admin"
EDGE_CONFIG: dict[str, Any] = {
    "server": {
        "keepalive_interval_s": 0.5,
        "api_keys": ["iop-e2e-engine-priority-key"],
        "admin_keys": [ADMIN_KEY],
    },
    # No preemption by the edge: the batch runs are answering anyway.
    "scheduler": {"max_queue": 64, "max_preemptions": 0, "priority_overflow_slots": 2},
    "objectives": [
        {"name": "interactive", "priority": 10},
        {"name": "batch", "priority": 0, "sheddable": True},
    ],
}
# 120 tokens at 40/s: a batch answer streams for about 3 s.
BATCH_TOKENS: Final = 120
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]

pytestmark = pytest.mark.timeout(120)


class _Stream:
    """One streamed answer read in a thread: its content, its end, when each came."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.finishes: list[str | None] = []
        self.ids: set[str] = set()
        self.first = threading.Event()
        self.first_at = 0.0
        self.done_at = 0.0
        self.error: BaseException | None = None

    def read(self, client: openai.OpenAI, objective: str, tokens: int) -> None:
        try:
            stream = client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                stream=True,
                extra_body={"iop_sim": {"output_tokens": tokens}},
                extra_headers={"x-iop-objective": objective},
            )
            for chunk in stream:
                self.ids.add(chunk.id.removeprefix("chatcmpl-"))
                for choice in chunk.choices:
                    if choice.delta.content:
                        self.texts.append(choice.delta.content)
                        if not self.first.is_set():
                            self.first_at = time.monotonic()
                            self.first.set()
                    if choice.finish_reason is not None:
                        self.finishes.append(choice.finish_reason)
            self.done_at = time.monotonic()
        except BaseException as exc:  # reported by the test
            self.error = exc


def _preemptions(sim_url: str) -> float:
    page = httpx.get(f"{sim_url}/metrics", timeout=10.0).text
    for line in page.splitlines():
        if line.startswith("vllm:num_preemptions_total"):
            return float(line.split()[-1])
    raise AssertionError(f"no vllm:num_preemptions_total in the sim's /metrics:\n{page}")


def test_an_interactive_stream_overflows_and_the_engine_pauses_a_batch_stream(
    procs: Procs, tmp_path: Path
) -> None:
    del tmp_path
    sim = procs.sim(
        "sim",
        "--ttft", "0.05",
        "--tokens-per-s", "40",
        "--max-num-seqs", "2",
        "--scheduling-policy", "priority",
    )  # fmt: skip
    edge = procs.edge(EDGE_CONFIG)
    edge.admin_key = ADMIN_KEY
    node = procs.node([edge], sim, instance={"max_concurrency": 2, "engine_priority": True})
    edge.wait_ready(node_id=node.node_id)
    batch = [_Stream(), _Stream()]
    calm = _Stream()
    with edge.openai(timeout=60) as client:
        threads = []
        for s in batch:
            t = threading.Thread(target=s.read, args=(client, "batch", BATCH_TOKENS))
            t.start()
            threads.append(t)
            # One after the other: the engine preempts the newer one.
            poll(s.first.is_set, timeout=30, what="a batch stream's first token")
        calm.read(client, "interactive", 4)
        for t in threads:
            t.join(timeout=60)
    assert calm.error is None
    assert batch[0].error is None
    assert batch[1].error is None
    # The interactive stream had its first token (and its end) while both
    # slots held batch streams that were still answering.
    assert calm.finishes == ["stop"]
    assert calm.first_at < min(s.done_at for s in batch)
    # Each batch client got its whole answer, one stop, no error: the
    # preempted one paused, then went on where it stopped.
    for s in batch:
        assert s.finishes == ["stop"]
        assert len(s.texts) == BATCH_TOKENS
    assert "".join(batch[0].texts) == "".join(batch[1].texts)
    assert _preemptions(sim.url) == 1.0
    # The edge placed it on an overflow seat, at once, and says so.
    (calm_id,) = calm.ids
    timeline = edge.admin_get(f"/admin/runs/{calm_id}").json()
    assert timeline["queued_ms"] is None
    (placed,) = timeline["placements"]
    assert placed["why"].startswith("overflow")
    assert placed["result"] == "ran"
    metrics = edge.admin_get("/metrics").text
    assert "iop_priority_overflows_total 1.0" in metrics
