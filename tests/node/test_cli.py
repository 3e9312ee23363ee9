"""``iop node``: help, config errors, and a real process dialling a loopback edge."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import trio
from trio_websocket import WebSocketRequest, serve_websocket

from iop.cli import build_parser
from iop.cli._node import _load as load_node_config
from iop.errors import ConfigError
from iop.events import Complete, RuntimeEvent, is_terminal
from iop.protocol import (
    CLOSE_GOING_AWAY,
    EdgeSession,
    NodeDraining,
    NodeJoined,
    RunEventsReceived,
)
from iop.spec import ChatRequest, ExecutionSpec, Message

# Until ``iop/cli/_main.py`` registers the subcommand, the tests build the
# ``iop`` parser with ``iop node`` added, in the child process.
_RUNNER = """\
import argparse, sys
from iop._log import configure_logging
from iop.cli import _node
parser = argparse.ArgumentParser(prog="iop")
sub = parser.add_subparsers(dest="command")
_node.add_parser(sub)
args = parser.parse_args(sys.argv[1:])
configure_logging("info")
sys.exit(args.func(args))
"""


def _node_registered() -> bool:
    parser = build_parser()
    return any(
        "node" in (getattr(action, "choices", None) or {})
        for action in parser._actions
        if action.dest == "command"
    )


def node_command(*args: str) -> list[str]:
    if _node_registered():
        return [sys.executable, "-m", "iop", "node", *args]
    return [sys.executable, "-c", _RUNNER, "node", *args]


def test_help_explains_the_command() -> None:
    out = subprocess.run(
        node_command("--help"), capture_output=True, text=True, timeout=60, check=True
    )
    assert "--config" in out.stdout
    assert "[[node.edges]]" in out.stdout
    assert "SIGTERM" in out.stdout


def test_iop_node_help_through_the_entry_point() -> None:
    if not _node_registered():
        pytest.skip("iop/cli/_main.py does not register `iop node` yet")
    out = subprocess.run(
        [sys.executable, "-m", "iop", "node", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "--config" in out.stdout


def test_a_config_without_edges_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "node.toml"
    cfg.write_text('[node]\nid = "n1"\n\n[[instances]]\nadapter = "sim"\nname = "sim"\n')
    out = subprocess.run(
        node_command("--config", str(cfg)), capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0
    assert "node.edges" in out.stderr


def test_a_config_with_nothing_to_serve_is_refused_models_alone_are_something(
    tmp_path: Path,
) -> None:
    cfg = tmp_path / "node.toml"
    edges = '[[node.edges]]\nurl = "ws://127.0.0.1:1/v1/link"\ntoken = "t"\n'
    cfg.write_text('[node]\nid = "n1"\nmemory_mib = 100\n' + edges)
    with pytest.raises(ConfigError, match=r"add an \[\[instances\]\] or a \[\[models\]\]"):
        load_node_config(str(cfg))
    models = '[[models]]\nname = "a"\nengine = "sim"\n'
    cfg.write_text('[node]\nid = "n1"\nmemory_mib = 100\n' + edges + models)
    assert [m.name for m in load_node_config(str(cfg)).models] == ["a"]


async def test_node_process_serves_then_drains_on_sigterm(tmp_path: Path) -> None:
    events: list[RuntimeEvent] = []
    saw: dict[str, object] = {"goodbye": False, "close": None}
    edge_done = trio.Event()

    async def edge(request: WebSocketRequest) -> None:
        ws = await request.accept()
        session = EdgeSession(
            tokens=["t0k"],
            heartbeat_interval_s=0.5,
            heartbeat_timeout_s=5.0,
            now=trio.current_time(),
        )
        try:
            (joined,) = session.receive(await ws.get_message(), trio.current_time())  # type: ignore[arg-type]
            assert isinstance(joined, NodeJoined)
            await ws.send_message(session.welcome())
            spec = ExecutionSpec(
                run_id="r1",
                request=ChatRequest(model="iop-sim", messages=[Message(role="user", content="hi")]),
            )
            session.assign("r1", "sim", spec, credit=64)
            for frame in session.data_to_send(trio.current_time()):
                await ws.send_message(frame)
            while True:
                frame = await ws.get_message()
                for event in session.receive(frame, trio.current_time()):  # type: ignore[arg-type]
                    if isinstance(event, RunEventsReceived):
                        events.extend(event.events)
                        if is_terminal(events[-1]):
                            run_done.set()
                    elif isinstance(event, NodeDraining):
                        saw["goodbye"] = True
        except Exception:
            saw["close"] = ws.closed.code if ws.closed else None
        edge_done.set()

    run_done = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(partial(serve_websocket, edge, "127.0.0.1", 0, None))
            cfg = tmp_path / "node.toml"
            cfg.write_text(
                '[node]\nid = "cli-node"\ndrain_timeout_s = 5.0\n\n'
                f'[[node.edges]]\nurl = "ws://127.0.0.1:{server.port}/v1/link"\n'
                'token = "${IOP_TEST_NODE_TOKEN}"\n\n'
                '[[instances]]\nadapter = "sim"\nname = "sim"\n'
                "[instances.sim]\nttft_s = 0.0\noutput_tokens = 4\n"
            )
            proc: trio.Process = await nursery.start(
                partial(
                    trio.run_process,
                    node_command("--config", str(cfg)),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    check=False,
                    env={**os.environ, "IOP_TEST_NODE_TOKEN": "t0k"},
                )
            )
            assert proc.stdout is not None
            assert proc.stderr is not None
            line = b""
            while not line.endswith(b"\n"):
                line += await proc.stdout.receive_some(4096)
            await run_done.wait()
            proc.send_signal(signal.SIGTERM)
            code = await proc.wait()
            stderr = b""
            while chunk := await proc.stderr.receive_some(65536):
                stderr += chunk
            await edge_done.wait()
            nursery.cancel_scope.cancel()
    assert code == 0, stderr.decode()
    text = line.decode()
    assert text.startswith("iop node: node 'cli-node' dialling ws://127.0.0.1:")
    assert "sim (sim in-process, available, targets: iop-sim)" in text
    assert "t0k" not in text + stderr.decode()
    assert isinstance(events[-1], Complete)
    assert saw == {"goodbye": True, "close": CLOSE_GOING_AWAY}
