"""A server's collector settings once it is up (``iop/runtime/_heap.py``), in
processes of their own: what ``settle_heap`` freezes stays frozen, so it
never runs in the test process."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from iop.runtime import YOUNG_THRESHOLD
from iop.testing import EDGE_READY, Proc, toml_dumps

pytestmark = pytest.mark.timeout(60)

_PROBE = """
import gc
from iop.runtime import settle_heap
kept = [{"start-up": i} for i in range(5_000)]  # what a server builds and keeps
frozen = settle_heap()
print(frozen, gc.get_freeze_count(), len(gc.get_objects(2)), *gc.get_threshold())
"""


def test_settle_heap_freezes_what_start_up_built_and_collects_the_young_less_often() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=30
    ).stdout.split()
    frozen, count, oldest, young, middle, old = map(int, out)
    assert frozen == count >= 5_000  # out of the collector's sight...
    assert oldest < 100  # ...so a full collection walks nearly nothing
    assert (young, middle, old) == (YOUNG_THRESHOLD, 10, 10)  # CPython's 700, 10, 10


def test_iop_edge_settles_its_heap_once_it_is_up(tmp_path: Path) -> None:
    edge = Proc("edge", ["edge", "--port", "0", "--node-token", "t" * 32], tmp_path)
    try:
        edge.wait_stdout(EDGE_READY, 30)
        edge.wait_stderr(r"garbage collector: \d+ start-up objects frozen", 10)
    finally:
        edge.stop()


def test_iop_node_settles_its_heap_once_it_is_up(tmp_path: Path) -> None:
    token = "t" * 32
    edge = Proc("edge", ["edge", "--port", "0", "--node-token", token], tmp_path)
    try:
        link = edge.wait_stdout(EDGE_READY, 30)[2]
        config = tmp_path / "node.toml"
        config.write_text(
            toml_dumps(
                {
                    "node": {"id": "n1", "edges": [{"url": link, "token": token}]},
                    # Nothing listens there: the node is up all the same.
                    "instances": [{"adapter": "vllm", "name": "i0", "endpoint": _closed_url()}],
                }
            )
        )
        node = Proc("node", ["node", "--config", str(config)], tmp_path)
        try:
            node.wait_stderr(r"garbage collector: \d+ start-up objects frozen", 30)
        finally:
            node.stop()
    finally:
        edge.stop()


def _closed_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"
