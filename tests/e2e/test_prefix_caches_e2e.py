"""Prefix placement learns what the engines' caches hold, on real processes.

Two ``iop sim`` engines with small prefix caches (``iop/sim/_engine.py``),
each behind its own ``iop node`` (a ``vllm`` instance that reads the sim's
``/metrics`` and its KV cache events), behind one edge with ``placement =
"prefix"`` (docs/operations.md, "What the caches hold").

* The edge sends a prompt back to the engine that cached it; once that
  engine has evicted it (its small cache filled with other prompts, sent
  while the other node is drained), the index no longer claims it there
  and placement no longer prefers that engine for it.
* When an engine's cache is reset (``POST /reset_prefix_cache``, behind the
  edge's back), its ``AllBlocksCleared`` event reaches the edge through
  the node's load report and the index forgets that engine's blocks, the
  events read over HTTP or over ZeroMQ as vLLM publishes them.
"""

from __future__ import annotations

import random
from typing import Any, Final

import httpx
import pytest

from tests.e2e._platform import MODEL, Edge, Procs, Sim, free_port, poll

pytestmark = pytest.mark.timeout(120)

ADMIN_KEY: Final = "sk-e2e-prefix-admin"
# 32 blocks of 16 tokens: 512 tokens, about four of the prompts below.
SIM_FLAGS: Final = ("--kv-cache-blocks", "32", "--kv-block-tokens", "16", "--output-tokens", "2")
# Words of 2 to 5 letters, one toy token each (iop/sim/_tokenizer.py):
# ~120 tokens, ~7 of the sim's blocks, ~2 of the index's 256-character ones.
WORDS: Final = 120


def _system(rng: random.Random) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join(
        "".join(rng.choice(letters) for _ in range(rng.randint(2, 5))) for _ in range(WORDS)
    )


def _admin(edge: Edge, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    resp = edge._client.request(
        method, path, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, **kwargs
    )
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def _chat(edge: Edge, system: str) -> tuple[str, dict[str, float], int]:
    """One chat: the node it ran on, the placement's scores, its cached tokens."""
    with edge.openai() as client:
        answer = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
        )
    assert answer.usage is not None
    assert answer.usage.prompt_tokens_details is not None
    run = _admin(edge, "GET", f"/admin/runs/{answer.id.removeprefix('chatcmpl-')}")
    placed = run["placements"][-1]
    return (
        placed["node"],
        placed.get("scores") or {},
        answer.usage.prompt_tokens_details.cached_tokens or 0,
    )


def _held(edge: Edge) -> dict[str, dict[str, Any]]:
    held: dict[str, dict[str, Any]] = _admin(edge, "GET", "/admin/nodes")["routing"]["prefix_held"]
    return held


def _events(transport: str) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The sim's flags and the node's instance keys for its KV events: over
    HTTP (the sim's page), or over ZeroMQ as vLLM publishes them."""
    if transport == "http":
        return (), {"kv_events_path": "/kv_events"}
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    flags = ("--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay)
    keys = {"kv_events_endpoint": pub, "kv_events_replay_endpoint": replay}
    return (*flags, "--kv-events-topic", "kv-events"), {**keys, "kv_events_topic": "kv-events"}


def _cluster(procs: Procs, transport: str = "http") -> tuple[Edge, dict[str, Sim]]:
    events = {n: _events(transport) for n in ("n1", "n2")}
    sims = {n: procs.sim(f"sim-{n}", *SIM_FLAGS, *events[n][0]) for n in ("n1", "n2")}
    edge = procs.edge(
        {
            "server": {"admin_keys": [ADMIN_KEY]},
            # No affinity: the prefix index alone draws a prompt back.
            "scheduler": {"placement": "prefix", "affinity": False},
        }
    )
    for n, sim in sims.items():
        procs.node(
            [edge],
            sim,
            node_id=n,
            name=n,
            instance={**events[n][1], "load_scrape_interval_s": 0.2},
        )
    edge.wait_ready()
    # Both caches' sizes have reached the edge: every instance is bounded.
    poll(
        lambda: (
            {k: v["bound"] for k, v in _held(edge).items()} == {"n1/vllm-sim": 8, "n2/vllm-sim": 8}
        ),
        timeout=20.0,
        what="both caches' sizes at the edge",
    )
    return edge, sims


def test_placement_stops_preferring_an_engine_that_evicted_the_prefix(procs: Procs) -> None:
    edge, _ = _cluster(procs)
    rng = random.Random(7)
    prompt = _system(rng)
    first, _, cached = _chat(edge, prompt)
    assert cached == 0
    other = "n2" if first == "n1" else "n1"
    again, scores, cached = _chat(edge, prompt)
    assert again == first
    assert cached > 0
    assert scores[f"{first}/vllm-sim"] > scores[f"{other}/vllm-sim"]

    # Fill the first engine's cache with other prompts: the other node is
    # drained, so they all go there, and its LRU evicts the prompt.
    _admin(edge, "POST", f"/admin/nodes/{other}/drain", json={"reason": "e2e"})
    for _ in range(6):
        where, _, _ = _chat(edge, _system(rng))
        assert where == first
    _admin(edge, "POST", f"/admin/nodes/{other}/undrain")

    _, scores, cached = _chat(edge, prompt)
    assert cached == 0  # the engine had evicted it indeed
    assert scores[f"{first}/vllm-sim"] <= scores[f"{other}/vllm-sim"]


@pytest.mark.parametrize("transport", ["http", "zmq"])
def test_a_reset_cache_is_forgotten_through_its_kv_events(procs: Procs, transport: str) -> None:
    """Over the sim's HTTP page, or over ZeroMQ in vLLM's frames and bytes
    (``kv_events_endpoint``): the node's cache report follows either."""
    edge, sims = _cluster(procs, transport)
    rng = random.Random(8)
    prompt = _system(rng)
    first, _, _ = _chat(edge, prompt)
    assert _held(edge)[f"{first}/vllm-sim"]["blocks"] > 0
    # Behind the edge's back: only the engine's events can tell it.
    resp = httpx.post(f"{sims[first].url}/reset_prefix_cache", timeout=10.0)
    assert resp.status_code == 200
    poll(
        lambda: _held(edge)[f"{first}/vllm-sim"]["blocks"] == 0,
        timeout=20.0,
        what="the edge to forget the reset cache",
    )
    other = "n2" if first == "n1" else "n1"
    _, scores, cached = _chat(edge, prompt)
    assert cached == 0
    assert scores[f"{first}/vllm-sim"] <= scores[f"{other}/vllm-sim"]
