"""What an operator meets first, as real ``iop`` subprocesses: taken ports, help, flags."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from iop.errors import ConfigError

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "node-sim.toml")


def iop(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "iop", *args],
        capture_output=True,
        text=True,
        env=env if env is not None else dict(os.environ),
        timeout=60,
        check=False,
    )


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process (here: this one) listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize(
    "command",
    [["up", "--backend", "sim"], ["edge", "--node-token", "a-long-node-token"], ["sim"]],
    ids=["up", "edge", "sim"],
)
def test_a_taken_port_is_one_line_and_exit_2(command: list[str], taken_port: int) -> None:
    out = iop(*command, "--port", str(taken_port))
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    (line,) = lines
    assert line.startswith(f"iop: cannot listen on 127.0.0.1:{taken_port}: ")
    assert "already in use" in line
    assert "--port" in line


def test_a_taken_link_port_is_one_line_and_exit_2(taken_port: int) -> None:
    out = iop(
        "edge", "--node-token", "a-long-node-token", "--port", "0", "--link-port", str(taken_port)
    )
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"iop: cannot listen on 127.0.0.1:{taken_port}: ")
    assert "already in use" in line


def test_a_bad_link_port_is_a_config_error() -> None:
    out = iop("edge", "--node-token", "a-long-node-token", "--link-port", "-1")
    assert out.returncode == 2, out.stderr
    assert "--link-port: port must be between 0 and 65535" in out.stderr


def test_log_level_goes_before_or_after_the_subcommand() -> None:
    for args in (["--log-level", "debug", "probe"], ["probe", "--log-level", "debug"]):
        out = iop(*args, "--config", CONFIG, env={**os.environ, "IOP_NODE_TOKEN": "t"})
        assert out.returncode == 0, (args, out.stderr)
    out = iop("probe", "--config", CONFIG, "--log-level", "loud")
    assert out.returncode == 2
    assert "invalid choice: 'loud'" in out.stderr


def test_probe_does_not_need_the_edge_token() -> None:
    """``iop probe`` never dials an edge: an unset ``${IOP_NODE_TOKEN}`` is no error."""
    env = {k: v for k, v in os.environ.items() if k != "IOP_NODE_TOKEN"}
    out = iop("probe", "--config", CONFIG, env=env)
    assert out.returncode == 0, out.stderr
    assert '"provider_status":"available"' in out.stdout
    out = iop("run", "--config", CONFIG, "--max-tokens", "2", "hi", env=env)
    assert out.returncode == 0, out.stderr


def test_probe_still_needs_the_backends_variables(tmp_path: Path) -> None:
    cfg = tmp_path / "node.toml"
    cfg.write_text(
        '[[instances]]\nadapter = "openai_compat"\nname = "o"\n'
        'endpoint = "http://127.0.0.1:9"\nheaders = { Authorization = "Bearer ${IOP_T_KEY}" }\n'
    )
    out = iop("probe", "--config", str(cfg), env={})
    assert out.returncode == 2
    assert "IOP_T_KEY is not set" in out.stderr


def test_help_names_every_endpoint_and_flag_alike() -> None:
    edge = " ".join(iop("edge", "--help").stdout.split())
    surfaces = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
    for path in (*surfaces, "/v1/messages", "/v1/models", "/metrics", "/admin", "/readyz"):
        assert path in edge, path
    # Admin views: behind admin keys, off with client keys and none (never client keys).
    assert "behind server.admin_keys" in edge
    assert "admin_disabled" in edge
    for cmd in ("up", "edge", "node", "sim", "run", "probe"):
        text = iop(cmd, "--help").stdout
        assert "--config FILE" in text, cmd
        assert "--log-level" in text, cmd


def test_up_help_says_the_tiny_model_cannot_call_tools() -> None:
    text = " ".join(iop("up", "--help").stdout.split())
    assert "tool calls" in text
    assert "--backend sim" in text


def test_up_serves_embeddings_from_llamacpp_only_when_asked() -> None:
    from iop.cli._up import llamacpp_instance
    from iop.config import EmbeddedBackend, UpConfig, decode_config
    from iop.managed import llamacpp_settings

    plain = EmbeddedBackend()
    assert not llamacpp_settings(llamacpp_instance(plain)).embeddings
    assert llamacpp_instance(plain).operations == [
        "chat",
        "completion",
        "tokenize",
    ]
    cfg = decode_config({"embedded": {"embeddings": True}}, UpConfig, source="up.toml")
    assert llamacpp_settings(llamacpp_instance(cfg.embedded)).embeddings
    assert llamacpp_instance(cfg.embedded).operations == [
        "chat",
        "completion",
        "embedding",
        "tokenize",
    ]


def test_up_finds_its_port_taken_before_it_loads_a_model(taken_port: int) -> None:
    # The default backend: llama.cpp when installed (else the sim, with a warning).
    out = iop("up", "--port", str(taken_port))
    assert out.returncode == 2, out.stderr
    assert "llama.cpp" not in out.stderr.replace("embedded llama.cpp backend is unavailable", "")
    line = out.stderr.splitlines()[-1]
    assert line.startswith(f"iop: cannot listen on 127.0.0.1:{taken_port}: ")


def test_a_config_fault_found_once_running_is_one_line_too(tmp_path: Path) -> None:
    # The node finds duplicate instance names only when it starts, inside iop up.
    config = tmp_path / "up.toml"
    config.write_text('[[instances]]\nadapter = "sim"\nname = "a"\n' * 2)
    out = iop("up", "--port", "0", "--config", str(config))
    assert out.returncode == 2, out.stderr
    line = out.stderr.splitlines()[-1]
    assert line == "iop: config error: instance names must be unique, got ['a', 'a']"
    assert "Traceback" not in out.stderr


def test_a_node_with_only_on_demand_models_is_a_node(tmp_path: Path) -> None:
    """``[[models]]`` are backends too: a node with no ``[[instances]]`` serves them."""
    from iop.cli._node import _load

    cfg = tmp_path / "node.toml"
    edge = '[[node.edges]]\nurl = "ws://127.0.0.1:1/v1/link"\ntoken = "t"\n'
    cfg.write_text(f'[node]\nmemory_mib = 100\n{edge}[[models]]\nname = "a"\nengine = "sim"\n')
    assert [m.name for m in _load(str(cfg)).models] == ["a"]
    cfg.write_text(f"[node]\n{edge}")
    with pytest.raises(ConfigError, match=r"add an \[\[instances\]\] or a \[\[models\]\] table"):
        _load(str(cfg))
