"""`iop run` and `iop probe` as a user runs them (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from iop.testing import Proc

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "node-sim.toml")
ENV = {**os.environ, "IOP_NODE_TOKEN": "t"}


def iop(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "iop", "--log-level", "warning", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
        check=False,
    )


def test_run_streams_the_answer() -> None:
    out = iop("run", "--config", CONFIG, "--max-tokens", "5", "hello")
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.split()) == 5


def test_run_events_are_json_lines_ending_in_complete() -> None:
    out = iop("run", "--config", CONFIG, "--events", "--max-tokens", "3", "hello")
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert events[0]["type"] == "start"
    assert [e["type"] for e in events[1:-1]] == ["delta"] * 3
    assert events[-1]["type"] == "complete"
    assert events[-1]["finish_reason"] == "length"


def test_probe_prints_capabilities() -> None:
    out = iop("probe", "--config", CONFIG)
    assert out.returncode == 0, out.stderr
    caps = json.loads(out.stdout)
    assert caps["provider_status"] == "available"
    assert caps["targets"] == ["iop-sim"]


def test_unknown_instance_is_a_config_error() -> None:
    out = iop("run", "--config", CONFIG, "--instance", "nope", "hello")
    assert out.returncode == 2
    assert "no instance named 'nope' (have: sim)" in out.stderr


def test_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    out = iop("probe", "--config", str(tmp_path / "missing.toml"))
    assert out.returncode == 2
    assert "cannot read config" in out.stderr


def test_help_for_every_command() -> None:
    for cmd in ("up", "edge", "node", "sim", "run", "probe"):
        out = iop(cmd, "--help")
        assert out.returncode == 0, cmd
        assert "usage: iop" in out.stdout


def test_run_masks_a_credential_the_backend_echoes(tmp_path: Path) -> None:
    from tests.e2e._platform import start_sim, toml_dumps

    key = "sk-cli-run-marker-0b9a8c"
    sim = start_sim(tmp_path, "sim", "--failure", "http_401")
    try:
        cfg = tmp_path / "node.toml"
        instance = {
            "adapter": "vllm",
            "name": "v",
            "endpoint": sim.url,
            "headers": {"Authorization": f"Bearer {key}", "X-Tiny": "short"},
        }
        cfg.write_text(toml_dumps({"instances": [instance]}))
        argv = ["--log-level", "debug", "run", "--events", "--config", str(cfg), "hello"]
        out = subprocess.run(
            [sys.executable, "-m", "iop", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        sim.close()
        sim.proc.stop()
    assert out.returncode == 1, out.stderr
    error = json.loads(out.stdout.splitlines()[-1])
    assert error["type"] == "error"
    assert error["message"].endswith("Incorrect API key provided: Bearer ***")
    assert key not in out.stdout + out.stderr
    # A value too short to mask is named (never shown) at start-up.
    assert "the secret at instances[v].headers.X-Tiny is shorter than 8 characters" in out.stderr


def test_probe_of_a_llamacpp_instance_that_cannot_start_says_why(tmp_path: Path) -> None:
    """The node would start this server itself: ``iop probe`` starts it once, and
    reports the instance unavailable with the reason when it cannot start."""
    config = tmp_path / "node.toml"
    config.write_text(
        '[[instances]]\nadapter = "llamacpp"\nname = "llama"\nmodel = "/nonexistent/m.gguf"\n'
    )
    out = iop("probe", "--config", str(config))
    assert out.returncode == 1, out.stderr
    caps = json.loads(out.stdout)
    assert (caps["adapter"], caps["instance"]) == ("llamacpp", "llama")
    assert caps["provider_status"] == "unavailable"
    assert "/nonexistent/m.gguf does not exist" in caps["provider_detail"]
    assert caps["targets"] == ["SmolLM2-135M-Instruct"]
    assert "restarting" not in out.stderr  # a one-off check is never restarted


def test_a_failed_probe_names_the_url_it_tried(tmp_path: Path) -> None:
    # A real HTTP server with no /api/v1/models: Lemonade's endpoint pointed
    # at the wrong server answers 404 like this.
    server = Proc(
        "http-server",
        [],
        tmp_path,
        argv=[sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "0"],
    )
    try:
        port = server.wait_stdout(r"Serving HTTP on 127\.0\.0\.1 port (\d+)").group(1)
        config = tmp_path / "node.toml"
        config.write_text(
            '[node]\nid = "n"\n[[instances]]\nadapter = "openai_compat"\nname = "lemonade"\n'
            f'provider = "lemonade"\nendpoint = "http://127.0.0.1:{port}/api"\n'
        )
        out = iop("probe", "--config", str(config))
    finally:
        server.stop()
    assert out.returncode == 1, out.stderr
    assert json.loads(out.stdout)["provider_status"] == "unavailable"
    assert (
        f"iop probe: lemonade: GET http://127.0.0.1:{port}/api/v1/models: status code 404"
        in out.stderr
    ), out.stderr
