"""``iop sim`` as a real process: start-up line, a request, clean exit on SIGINT."""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from iop.cli import build_parser
from iop.cli._sim import sim_config_from_args
from iop.config import SimConfig
from iop.errors import ConfigError

# Generous: interpreter start-up on a loaded machine can take seconds.
STARTUP_S = 60.0
STARTUP_LINE = re.compile(
    r"iop sim: serving model '(?P<model>[^']+)' \(vLLM wire format\) on (?P<url>http://\S+)/v1\n"
)


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["sim", *argv])


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "sim.toml"
    path.write_text('[sim]\nmodel = "from-file"\noutput_tokens = 5\nseed = 1\n')
    cfg = sim_config_from_args(
        parse("--config", str(path), "--seed", "7", "--no-auto-tool-choice", "--ttft", "0.5")
    )
    assert cfg == SimConfig(
        model="from-file", output_tokens=5, seed=7, auto_tool_choice=False, ttft_s=0.5
    )
    assert sim_config_from_args(parse()) == SimConfig()


def test_unknown_config_keys_are_named(tmp_path: Path) -> None:
    path = tmp_path / "sim.toml"
    path.write_text("[sim]\noutput_tokenz = 5\n")
    with pytest.raises(ConfigError, match="output_tokenz"):
        sim_config_from_args(parse("--config", str(path)))


def test_help_lists_the_simulation_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse("--help")
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--port", "--tokens-per-s", "--no-auto-tool-choice", "--failure", "iop_sim"):
        assert flag in out


async def read_line(stream: trio.abc.ReceiveStream) -> str:
    buf = b""
    while not buf.endswith(b"\n"):
        piece = await stream.receive_some(1)
        if not piece:
            break
        buf += piece
    return buf.decode()


async def test_iop_sim_process_serves_and_exits_cleanly_on_sigint(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "iop",
        "--log-level",
        "warning",
        "sim",
        "--port",
        "0",
        "--model",
        "cli-sim",
        "--ttft",
        "0",
        "--output-tokens",
        "4",
        "--embedding-dim",
        "8",
    ]
    with (tmp_path / "stderr.txt").open("wb") as stderr:
        proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE, stderr=stderr)
        assert proc.stdout is not None
        try:
            with trio.fail_after(STARTUP_S):
                line = await read_line(proc.stdout)
            m = STARTUP_LINE.fullmatch(line)
            assert m is not None, (line, (tmp_path / "stderr.txt").read_text())
            assert m["model"] == "cli-sim"
            assert not m["url"].endswith(":0")
            async with httpx.AsyncClient(base_url=m["url"]) as client:
                resp = await client.post(
                    "/v1/chat/completions",
                    json={"model": "cli-sim", "messages": [{"role": "user", "content": "hi"}]},
                )
                vectors = await client.post("/v1/embeddings", json={"input": ["a", "b"]})
                text = await client.post("/v1/completions", json={"prompt": "hi"})
                tokens = await client.post("/tokenize", json={"prompt": "hi there"})
            assert resp.status_code == 200
            assert resp.json()["usage"]["completion_tokens"] == 5
            assert [len(d["embedding"]) for d in vectors.json()["data"]] == [8, 8]
            assert text.json()["object"] == "text_completion"
            assert tokens.json()["count"] == 2
            proc.send_signal(signal.SIGINT)
            with trio.fail_after(STARTUP_S):
                code = await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await proc.stdout.aclose()
    assert code == 0, (tmp_path / "stderr.txt").read_text()


def test_embedding_and_input_flags(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = sim_config_from_args(parse("--embedding-dim", "64", "--max-inputs", "10"))
    assert (cfg.embedding_dim, cfg.max_inputs) == (64, 10)
    with pytest.raises(ConfigError, match="embedding_dim must be at least 1"):
        sim_config_from_args(parse("--embedding-dim", "0"))
    with pytest.raises(SystemExit):
        parse("--help")
    out = capsys.readouterr().out
    for flag in ("--tool-call-name", "--tool-call-arguments", "--embedding-dim", "/v1/embeddings"):
        assert flag in out
