"""``scripts/bench_first_chunk.py``'s timeline: strace lines split into the parts
of a request's path to its first chunk (the measuring needs real processes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(
        "bench_first_chunk", SCRIPTS / "bench_first_chunk.py"
    )
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


EDGE = """\
10 100.000100 recvfrom(12, "POST /v1/chat/completions HTTP/1.1\\r\\n", 65536, 0, NULL, NULL) = 340
10 100.000200 recvfrom(12, 0x1, 65536, 0, NULL, NULL) = -1 EAGAIN (Resource temporarily unavailable)
10 100.001100 write(9, "\\202~\\1(\\221\\207\\241t\\246assign\\246run_id", 300) = 300
10 100.010000 recvfrom(9, "\\202\\342events", 65536, 0, NULL, NULL) = 104
10 100.010500 write(12, "HTTP/1.1 200 \\r\\ncontent-type: text/event-stream", 656) = 656
"""
NODE = """\
20 100.001300 recvfrom(10, "\\202~\\1(assign\\246run_id", 4096, 0, NULL, NULL) = 300
20 100.001900 write(2, "20:00:00 INFO  iop.adapters.vllm: vllm executing", 142) = 142
20 100.002000 sendto(9, "POST /v1/chat/completions HTTP/1.1\\r\\n", 369, 0, NULL, 0) = 369
20 100.009000 recvfrom(9, "HTTP/1.1 200 \\r\\ncontent-type: text/event-stream", 65536, 0, NULL, NULL) = 153
20 100.009300 recvfrom(9, "107\\r\\ndata: {\\"id\\"", 65536, 0, NULL, NULL) = 270
20 100.009800 sendto(10, "\\202\\342events", 104, 0, NULL, 0) = 104
"""
SIM = """\
30 100.002400 recvfrom(9, "POST /v1/chat/completions HTTP/1.1\\r\\n", 65536, 0, NULL, NULL) = 369
30 100.008900 sendto(9, "HTTP/1.1 200 \\r\\ncontent-type: text/event-stream", 153, 0, NULL, 0) = 153
30 100.009200 sendto(9, "107\\r\\ndata: {\\"id\\"", 270, 0, NULL, 0) = 270
30 100.030000 sendto(9, "f1\\r\\ndata: {\\"id\\"", 247, 0, NULL, 0) = 247
"""


def test_a_request_splits_into_the_parts_of_its_path(bench: ModuleType, tmp_path: Path) -> None:
    files = {}
    for name, text in (("edge", EDGE), ("node", NODE), ("sim", SIM)):
        files[name] = tmp_path / f"{name}.txt"
        files[name].write_text(text)
    [row] = bench.timeline(files, [100.0])
    got = {k: round(v, 3) for k, v in row.items()}
    assert got == {
        "edge: request -> Assign": 1.0,
        "hop: Assign -> node": 0.2,
        "node: Assign -> backend request": 0.7,
        "hop: node -> sim": 0.4,
        "sim: request -> first chunk": 6.8,
        "hop: sim -> node": 0.1,
        "node: chunk -> events frame": 0.5,
        "hop: frame -> edge": 0.2,
        "edge: frame -> client write": 0.5,
        "total: request -> client write": 10.4,
    }


def test_a_request_with_a_missing_step_is_left_out(bench: ModuleType, tmp_path: Path) -> None:
    files = {}
    for name, text in (
        ("edge", EDGE),
        ("node", NODE.replace("sendto(10", "sendto(11")),
        ("sim", SIM),
    ):
        files[name] = tmp_path / f"{name}.txt"
        files[name].write_text(text)
    assert bench.timeline(files, [100.0]) == []
