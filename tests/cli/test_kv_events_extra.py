"""A config that needs the ``kvevents`` extra (pyzmq) where it is missing:
one line naming the install command, exit 2, before anything starts
(``iop._extras``). The interpreter is made to lack ``zmq`` (a ``None`` in
``sys.modules`` is a module that cannot be found)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

WITHOUT_ZMQ = (
    "import sys; sys.modules['zmq'] = None; "
    "from iop.cli._main import main; sys.exit(main(sys.argv[1:]))"
)
NODE = """\
[node]
id = "n"
[[node.edges]]
url = "ws://127.0.0.1:9/v1/link"
token = "t"
[[instances]]
adapter = "vllm"
name = "qwen"
endpoint = "http://127.0.0.1:8000"
kv_events_endpoint = "tcp://127.0.0.1:5557"
"""


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["node", "--config", "node.toml"], "instance 'qwen': kv_events_endpoint"),
        (["up", "--port", "0", "--config", "up.toml"], "instance 'qwen': kv_events_endpoint"),
        (["sim", "--port", "0", "--kv-events-endpoint", "tcp://127.0.0.1:*"], "kv_events_endpoint"),
    ],
    ids=["node", "up", "sim"],
)
def test_a_missing_kvevents_extra_is_one_line(tmp_path: Path, argv: list[str], key: str) -> None:
    (tmp_path / "node.toml").write_text(NODE)
    (tmp_path / "up.toml").write_text(NODE[NODE.index("[[instances]]") :])
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_ZMQ, *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line == (
        f"iop: config error: {key} needs the kvevents extra, which is not installed: "
        "pip install 'iop-platform[kvevents]'"
    )
