"""``iop up`` end to end with the real model: edge + node + llama.cpp's server (SmolLM2-135M).

One ``iop up --port 0`` process serves the module; the official OpenAI SDK
talks to it. The tests assert protocol behaviour only, never the model's
words. When the real backend cannot run here the tests skip, unless
``IOP_REQUIRE_REAL_BACKEND=1`` (CI), where they fail.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import openai
import pytest

from tests.api.messages._sdk import validate_message
from tests.api.responses._schema import validate_response
from tests.e2e._platform import (
    LOG_LINE,
    Proc,
    poll,
    read_stream,
    require_real_backend,
    validated_completion,
)

pytestmark = pytest.mark.real_backend

ALIAS: Final = "SmolLM2-135M-Instruct"
MESSAGES: list[Any] = [{"role": "user", "content": "Say hello."}]
READY_TIMEOUT_S: Final = 120.0


@dataclass
class Up:
    proc: Proc
    url: str
    ready_line: str

    def openai(self, timeout: float = 60.0) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=timeout)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    require_real_backend()
    proc = Proc("iop-up", ["up", "--port", "0"], tmp_path_factory.mktemp("up"))
    try:
        ready = proc.wait_stdout(r"iop up: ready; models: .*", timeout=READY_TIMEOUT_S)
        url = re.search(r"OpenAI API on (http://\S+)/v1", proc.stdout())
        assert url is not None, proc.logs()
        assert not url.group(1).endswith(":0"), "the URL line must show the bound port"
        yield Up(proc, url.group(1), ready.group(0))
    finally:
        proc.stop()


def test_up_serves_the_real_model(up: Up) -> None:
    assert repr(ALIAS) in up.ready_line
    with up.openai() as client:
        assert [m.id for m in client.models.list()] == [ALIAS]


def test_streaming_through_the_whole_platform(up: Up) -> None:
    with (
        up.openai() as client,
        client.chat.completions.create(
            model=ALIAS,
            messages=MESSAGES,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        ) as stream,
    ):
        r = read_stream(stream)
    assert r.chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert r.content_deltas
    assert r.content.strip()
    assert r.finish_reason in ("length", "stop")
    assert r.usage is not None
    assert 0 < r.usage["completion_tokens"] <= 8
    assert r.usage["prompt_tokens"] > 0
    assert {c["model"] for c in r.chunks} == {ALIAS}


def test_non_streaming_through_the_whole_platform(up: Up) -> None:
    with up.openai() as client:
        completion = client.chat.completions.create(model=ALIAS, messages=MESSAGES, max_tokens=8)
    obj = validated_completion(completion)
    (choice,) = obj["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"].strip()
    assert choice["finish_reason"] in ("length", "stop")
    assert 0 < obj["usage"]["completion_tokens"] <= 8


# --- the README's examples, as written (only the port differs) -------------------------

README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), re.DOTALL)


def _on(up: Up, text: str) -> str:
    assert "http://127.0.0.1:8080" in text
    return text.replace("http://127.0.0.1:8080", up.url)


def test_readme_installs_what_its_sdk_example_imports() -> None:
    """The set-up command does not install `openai`: the README must, before using it."""
    text = README.read_text()
    sdk = text.index("from openai import OpenAI")
    assert ".venv/bin/pip install -c constraints.txt openai" in text[:sdk]


def test_readme_curl_example(up: Up) -> None:
    (curl,) = [b for b in _readme_blocks("bash") if b.startswith("curl ") and "/chat/" in b]
    out = subprocess.run(
        ["bash", "-c", _on(up, curl)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().endswith("data: [DONE]"), out.stdout


def test_readme_responses_and_messages_curl_lines(up: Up) -> None:
    """README "Try it": one curl line each for Responses and Messages, run as written."""
    (block,) = [b for b in _readme_blocks("bash") if "/v1/responses" in b]
    responses, messages = block.strip().splitlines()
    for line, path in ((responses, "/v1/responses"), (messages, "/v1/messages")):
        assert line.startswith(f"curl http://127.0.0.1:8080{path} ")
        out = subprocess.run(
            ["bash", "-c", _on(up, line)], capture_output=True, text=True, timeout=120, check=False
        )
        assert out.returncode == 0, out.stderr
        body = json.loads(out.stdout)
        if path == "/v1/responses":
            validate_response(body)
            assert body["status"] in ("completed", "incomplete")
        else:
            validate_message(body)
            assert body["stop_reason"] in ("end_turn", "max_tokens")
        assert body["model"] == ALIAS


def test_readme_sdk_example(up: Up) -> None:
    (code,) = _readme_blocks("python")
    out = subprocess.run(
        [sys.executable, "-c", _on(up, code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip(), "the example prints the streamed answer"


def test_up_advertises_only_the_surfaces_its_model_serves(up: Up) -> None:
    # The default [embedded] has embeddings off: the start-up line must not offer them.
    (edge_line,) = [line for line in up.proc.stdout().splitlines() if "OpenAI API on" in line]
    assert "chat/completions" in edge_line
    assert "embeddings" not in edge_line, edge_line
    assert "[embedded] embeddings = true" in up.proc.stderr()
    with up.openai() as client, pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=ALIAS, input="hi")


def test_llamacpps_per_request_warnings_stay_out_of_the_info_log(up: Up) -> None:
    with up.openai() as client:
        for _ in range(2):  # the second reuses the first's prompt cache: llama.cpp warns
            with client.chat.completions.create(
                model=ALIAS, messages=MESSAGES, max_tokens=3, stream=True
            ) as s:
                read_stream(s)
    runs = poll(
        lambda: up.proc.stderr().count(" iop.edge.run: run ") >= 2 or None,
        timeout=10,
        what="the runs' log lines",
    )
    assert runs
    slot_lines = [line for line in up.proc.stderr().splitlines() if " W slot " in line]
    assert slot_lines == []


def test_up_sigterm_stops_everything(up: Up) -> None:
    """Last in the module: SIGTERM drains edge, node and llama.cpp; exit 0, no orphan."""
    server = re.search(r"llama.cpp server is ready at \S+ .*pid (\d+)\)", up.proc.stderr())
    assert server is not None, up.proc.logs()
    server_pid = int(server.group(1))
    t0 = time.monotonic()
    assert up.proc.stop() == 0
    print(f"\niop up: SIGTERM -> exit 0 in {time.monotonic() - t0:.2f}s")
    assert "iop.up: stopped" in up.proc.stderr()
    # One log format for everything on stderr, llama.cpp's own lines included.
    strays = [line for line in up.proc.stderr().splitlines() if not LOG_LINE.match(line)]
    assert strays == [], "\n".join(strays[:20])

    def gone() -> bool:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            return True
        return False

    poll(gone, timeout=10, what=f"llama.cpp's server (pid {server_pid}) to be gone")
