"""Several edges on real processes: two ``iop edge`` sharing one real Valkey
(``[cluster]``), three ``iop node`` each dialling both, the sim as backend.

* a tenant's requests-per-minute holds across both edges, within one request
  (plus what the bucket refilled while the test ran);
* Valkey killed and restarted: no 5xx, each edge fails open to its share
  (limit / 2 live edges: the gauge and a log line say so), then counts in
  Valkey again;
* one edge killed under load: its clients get errors, the other edge's
  clients all succeed, and the three nodes keep serving it.

No timing is asserted; the refill allowance is computed from the elapsed time.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import httpx
import pytest
import trio

from iop.testing import poll
from tests._valkey import Valkey
from tests.e2e._platform import MODEL, Edge, Node, Sim, start_edge, start_node

KEY_LIMITED: Final = "iop-e2e-cluster-limited"
KEY_OUTAGE: Final = "iop-e2e-cluster-outage"
KEY_LOAD: Final = "iop-e2e-cluster-load"
OPERATOR: Final = "iop-e2e-cluster-operator"
ADMIN: Final = "iop-e2e-cluster-admin"  # /admin and /metrics
RPM: Final = 20
OUTAGE_RPM: Final = 40

pytestmark = pytest.mark.timeout(120)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _config(valkey: Valkey, edge_id: str) -> dict[str, Any]:
    return {
        "server": {"keepalive_interval_s": 0.5, "api_keys": [OPERATOR], "admin_keys": [ADMIN]},
        "scheduler": {"max_queue": 256, "queue_timeout_s": 60},
        "cluster": {
            "valkey_url": valkey.url,
            "edge_id": edge_id,
            "key_prefix": "e2e:",
            "retry_interval_s": 0.2,
            "membership_ttl_s": 3.0,
        },
        "tenants": [
            {"name": "limited", "key_sha256": [_digest(KEY_LIMITED)], "requests_per_minute": RPM},
            {
                "name": "outage",
                "key_sha256": [_digest(KEY_OUTAGE)],
                "requests_per_minute": OUTAGE_RPM,
            },
            {"name": "load", "key_sha256": [_digest(KEY_LOAD)]},
        ],
    }


@dataclass
class Stack:
    valkey: Valkey
    edges: list[Edge]
    nodes: list[Node]


@pytest.fixture(scope="module")
def stack(sim: Sim, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    valkey = Valkey(tmp_path_factory.mktemp("valkey"))
    valkey.start()
    edges: list[Edge] = []
    nodes: list[Node] = []
    try:
        for name in ("edge-a", "edge-b"):
            edges.append(
                start_edge(tmp_path_factory.mktemp(name), _config(valkey, name), name=name)
            )
        for i in range(3):
            nodes.append(
                start_node(
                    tmp_path_factory.mktemp(f"node{i}"),
                    [e.link_url for e in edges],
                    sim.url,
                    name=f"node{i}",
                    node_id=f"n{i}",
                    instance={"max_concurrency": 4},
                )
            )
        for e in edges:
            for n in nodes:
                e.wait_ready(node_id=n.node_id)
            poll(lambda e=e: _gauge(e, "iop_cluster_edges") == 2, timeout=15, what="2 edges")
        yield Stack(valkey, edges, nodes)
    finally:
        for n in nodes:
            n.proc.stop()
        for e in edges:
            e.close()
            e.proc.stop()
        valkey.kill()


def _gauge(edge: Edge, name: str) -> float:
    text = edge.admin_get("/metrics").text
    m = re.search(rf"^{name}(?:_total)? (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else math.nan


async def _chat(
    url: str, key: str, statuses: list[int], body: dict[str, Any] | None = None
) -> None:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **(body or {})}
    async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as client:
        try:
            r = await client.post(
                "/v1/chat/completions",
                json=payload,
                headers={"Authorization": f"Bearer {key}"},
            )
        except httpx.TransportError:
            statuses.append(-1)  # refused, or cut off mid-answer
        else:
            complete = not payload.get("stream") or "data: [DONE]" in r.text
            statuses.append(r.status_code if complete else -2)


async def _pairs(stack: Stack, key: str, pairs: int) -> list[list[int]]:
    """``pairs`` times one request to each edge at once; each edge's statuses."""
    out: list[list[int]] = [[] for _ in stack.edges]
    for _ in range(pairs):
        async with trio.open_nursery() as n:
            for e, statuses in zip(stack.edges, out, strict=True):
                n.start_soon(_chat, e.url, key, statuses)
    return out


async def test_a_tenants_limit_holds_across_both_edges(stack: Stack) -> None:
    started = trio.current_time()
    per_edge = await _pairs(stack, KEY_LIMITED, RPM)  # twice the limit in all
    elapsed = trio.current_time() - started
    flat = [s for side in per_edge for s in side]
    assert set(flat) <= {200, 429}, flat
    admitted = flat.count(200)
    # Each edge alone would admit RPM: together, the limit, within one
    # request and what refilled (RPM / 60 per second) while the burst ran.
    assert RPM <= admitted <= RPM + 1 + math.floor(elapsed * RPM / 60), (admitted, elapsed)
    # Both edges took their turns: each admitted about half.
    assert all(side.count(200) >= RPM // 2 - 1 for side in per_edge), per_edge
    # Each edge's admin view shows the shared bucket (nearly empty), not its own.
    for e in stack.edges:
        view = e.admin()
        assert view["cluster"]["valkey_up"] is True
        (row,) = [t for t in view["tenants"] if t["name"] == "limited"]
        assert row["limits"]["requests"]["remaining"] <= 1 + math.floor(elapsed * RPM / 60)


async def test_valkey_killed_and_back_no_5xx(stack: Stack) -> None:
    edge = stack.edges[0]
    stack.valkey.kill()
    statuses: list[int] = []
    async with trio.open_nursery() as n:
        for _ in range(OUTAGE_RPM):
            n.start_soon(_chat, edge.url, KEY_OUTAGE, statuses)
    assert set(statuses) <= {200, 429}, statuses
    # The edge's share: the limit over the 2 live edges it last saw.
    assert statuses.count(200) <= OUTAGE_RPM // 2 + 1
    assert statuses.count(200) >= OUTAGE_RPM // 2
    assert _gauge(edge, "iop_cluster_valkey_up") == 0
    fail_open = _gauge(edge, "iop_cluster_fail_open")
    assert fail_open >= OUTAGE_RPM - 1
    poll(lambda: "fail open" in edge.proc.stderr(), timeout=5, what="the fail-open log line")

    stack.valkey.start()  # empty: every bucket full again
    for e in stack.edges:
        poll(lambda e=e: _gauge(e, "iop_cluster_valkey_up") == 1, timeout=15, what="valkey up")
    poll(lambda: "Valkey reachable" in edge.proc.stderr(), timeout=5, what="the back log line")
    statuses = []
    async with trio.open_nursery() as n:
        for _ in range(5):
            n.start_soon(_chat, edge.url, KEY_OUTAGE, statuses)
    assert statuses == [200] * 5
    assert _gauge(edge, "iop_cluster_fail_open") == fail_open  # counted in Valkey again


async def test_one_edge_killed_under_load(stack: Stack) -> None:
    survivor, victim = stack.edges
    # Each run streams 40 tokens at 40/s: ~1 s on a node's slot.
    slow = {"stream": True, "iop_sim": {"output_tokens": 40, "tokens_per_s": 40.0}}
    kept: list[int] = []
    lost: list[int] = []
    async with trio.open_nursery() as n:
        for _ in range(6):
            n.start_soon(_chat, survivor.url, KEY_LOAD, kept, slow)
            n.start_soon(_chat, victim.url, KEY_LOAD, lost, slow)
        with trio.fail_after(30):
            while len(victim.admin()["runs"]) < 6:
                await trio.sleep(0.02)
        victim.proc.kill()
    assert kept == [200] * 6
    # The victim's clients: cut off mid-stream.
    assert set(lost) <= {-1, -2}, lost
    # The survivor still has the three nodes and serves a new request.
    assert {n["id"] for n in survivor.admin()["nodes"]} == {"n0", "n1", "n2"}
    after: list[int] = []
    await _chat(survivor.url, KEY_LOAD, after)
    assert after == [200]
    assert all(n.proc.alive for n in stack.nodes)
