"""A real ``iop edge`` whose Valkey answers wrong: it keeps serving.

One ``iop edge`` with ``[cluster]`` pointed at ``tests/_resp_proxy.py`` in
front of a real ``valkey-server``, one ``iop node``, the sim. For each
reply the proxy gives the heartbeat and the admission script instead of
Valkey's (another shape, an error, a nil, a huge integer, garbage that is
not RESP, a reply that never ends...), the edge process keeps running
(no CRITICAL line, still alive), a limited tenant's requests get their
normal answers (200, or 429 past the local share; never 5xx), the gauge
and the counter say the edge fails open, one log line says why, and it
counts in Valkey again once the proxy answers well.

Waits poll with a deadline; no duration is asserted.
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

from iop.edge.tenancy._cluster_scripts import HEARTBEAT, RESERVE
from iop.testing import poll
from tests._resp_proxy import FAULTS, RespProxy, scripts_rule
from tests._valkey import Valkey
from tests.e2e._platform import MODEL, Edge, Node, Sim, start_edge, start_node

KEY: Final = "iop-e2e-cluster-faults"
OPERATOR: Final = "iop-e2e-cluster-faults-operator"
ADMIN: Final = "iop-e2e-cluster-faults-admin"  # reads /metrics
# High enough that the few requests of each case are all admitted, by
# Valkey or by the local share (the limit / 1 live edge).
RPM: Final = 6000

pytestmark = pytest.mark.timeout(120)


@dataclass
class Stack:
    valkey: Valkey
    proxy: RespProxy
    edge: Edge
    node: Node


@pytest.fixture(scope="module")
def stack(sim: Sim, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    valkey = Valkey(tmp_path_factory.mktemp("valkey"))
    valkey.start()
    proxy = RespProxy(valkey.port)
    proxy.start()
    config: dict[str, Any] = {
        "server": {"api_keys": [OPERATOR], "admin_keys": [ADMIN]},
        "cluster": {
            "valkey_url": proxy.url,
            "edge_id": "edge-faults",
            "key_prefix": "faults:",
            "retry_interval_s": 0.1,
            "command_timeout_s": 0.5,
            "membership_ttl_s": 1.5,  # a heartbeat every 0.5 s
        },
        "tenants": [
            {
                "name": "limited",
                "key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
                "requests_per_minute": RPM,
            }
        ],
    }
    edge: Edge | None = None
    node: Node | None = None
    try:
        edge = start_edge(tmp_path_factory.mktemp("edge"), config, name="edge-faults")
        node = start_node(tmp_path_factory.mktemp("node"), [edge.link_url], sim.url)
        edge.wait_ready()
        poll(lambda: _metric(edge, "iop_cluster_valkey_up") == 1, timeout=15, what="valkey up")
        yield Stack(valkey, proxy, edge, node)
    finally:
        if node is not None:
            node.proc.stop()
        if edge is not None:
            edge.close()
            edge.proc.stop()
        proxy.stop()
        valkey.kill()


def _metric(edge: Edge, name: str) -> float:
    text = edge.admin_get("/metrics").text
    m = re.search(rf"^{name}(?:_total)? (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else math.nan


def _chat(edge: Edge) -> int:
    r = httpx.post(
        f"{edge.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
        trust_env=False,
    )
    return r.status_code


def _lines(edge: Edge, text: str) -> list[str]:
    return [line for line in edge.proc.stderr().splitlines() if text in line]


@pytest.mark.parametrize("fault", FAULTS.values(), ids=FAULTS.keys())
def test_valkey_answering_wrong_fails_open_and_back(stack: Stack, fault: bytes) -> None:
    edge = stack.edge
    failed_before = len(_lines(edge, "fail open"))
    back_before = len(_lines(edge, "Valkey reachable"))
    counted = _metric(edge, "iop_cluster_fail_open")

    stack.proxy.answer(scripts_rule([HEARTBEAT, RESERVE], fault))
    statuses = [_chat(edge) for _ in range(3)]
    assert statuses == [200] * 3
    poll(lambda: _metric(edge, "iop_cluster_valkey_up") == 0, timeout=15, what="the local share")
    # Every request was decided by the local share: the admission script
    # answered wrong, and the heartbeat keeps the edge off Valkey.
    assert _metric(edge, "iop_cluster_fail_open") == counted + 3
    (line,) = _lines(edge, "fail open")[failed_before:]
    assert "Valkey failed" in line

    stack.proxy.answer(None)
    poll(lambda: _metric(edge, "iop_cluster_valkey_up") == 1, timeout=15, what="back in Valkey")
    assert len(_lines(edge, "Valkey reachable")) == back_before + 1
    counted = _metric(edge, "iop_cluster_fail_open")
    assert _chat(edge) == 200
    assert _metric(edge, "iop_cluster_fail_open") == counted  # counted in Valkey
    assert edge.proc.alive
    assert not _lines(edge, "CRITICAL")
    assert not _lines(edge, " ERROR ")
