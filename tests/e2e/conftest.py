"""Fixtures of the end-to-end tests: real ``iop`` processes on loopback.

* ``sim`` (session): ``iop sim --port 0``, the backend every node's ``vllm``
  instance talks to. Tests drive it per request with ``iop_sim`` in the body.
* ``edge``/``node`` (module): ``iop edge`` with the test module's
  ``EDGE_CONFIG`` (or ``DEFAULT_EDGE_CONFIG``) and ``iop node`` dialling it,
  with one ``vllm`` instance on ``sim``. ``cluster`` gives all three once the
  edge is ready, the model is listed, and the sim has nothing left open.
* ``procs`` (function): starts processes a test may kill, restart or freeze;
  each is stopped at the test's end.

Every process is stopped by PID (SIGTERM, then SIGKILL). Its stdout and
stderr are files under pytest's tmp dirs; when a test fails, the tail of every
process that was alive during it is added to the report.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e._platform import (
    Cluster,
    Edge,
    Node,
    Proc,
    Procs,
    Sim,
    start_edge,
    start_node,
    start_sim,
)

DEFAULT_EDGE_CONFIG: dict[str, Any] = {
    # Headers go out (with the role chunk) after 0.5 s without output, so a
    # streaming client holds an open stream while the backend is in "prefill".
    # A client that pauses (test_platform.py's slow clients) holds its
    # stream unread while another reads 20,000 chunks through the SDK: on a
    # loaded machine that outlasted the default 30 s write-stall deadline,
    # which cut the paused client off. The deadline itself is tested with
    # its own edge (test_slow_client.py).
    "server": {
        "keepalive_interval_s": 0.5,
        "max_body_bytes": 256 * 1024,
        "write_stall_timeout_s": 300.0,
    },
    # Runs queue rather than being refused on an estimate of their wait: on
    # a loaded machine the queue drains slower and test_platform.py's 20
    # clients on 8 slots got 429 "would wait about 6.7s" (the estimate's
    # refusal is tested with edges of its own: tests/edge, the overload bench).
    "scheduler": {"max_queue_delay_s": 0},
}

_STARTED = pytest.StashKey[float]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_STARTED] = time.time()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """On failure, add the log tail of every process alive during the test."""
    report = yield
    if report.failed:
        since = item.stash.get(_STARTED, 0.0)
        for proc in Proc.ALL:
            if proc.stopped_at is None or proc.stopped_at >= since:
                report.sections.append((f"iop process {proc.name} (pid {proc.pid})", proc.logs()))
    return report


@pytest.fixture(scope="session")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    s = start_sim(tmp_path_factory.mktemp("sim"))
    try:
        yield s
    finally:
        s.close()
        s.proc.stop()


@pytest.fixture(scope="module")
def edge(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Edge]:
    config = getattr(request.module, "EDGE_CONFIG", DEFAULT_EDGE_CONFIG)
    e = start_edge(tmp_path_factory.mktemp("edge"), config)
    try:
        yield e
    finally:
        e.close()
        e.proc.stop()


@pytest.fixture(scope="module")
def node(edge: Edge, sim: Sim, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = start_node(tmp_path_factory.mktemp("node"), [edge.link_url], sim.url)
    try:
        edge.wait_ready(node_id=n.node_id)
        yield n
    finally:
        n.proc.stop()


@pytest.fixture
def cluster(sim: Sim, edge: Edge, node: Node) -> Cluster:
    for proc in (sim.proc, edge.proc, node.proc):
        assert proc.alive, f"{proc.name} died\n{proc.logs()}"
    edge.wait_ready(node_id=node.node_id)
    sim.wait_idle()  # nothing left over from an earlier test skews the counters
    return Cluster(sim, edge, node)


@pytest.fixture
def client(cluster: Cluster) -> Iterator[openai.OpenAI]:
    with cluster.edge.openai() as c:
        yield c


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()
