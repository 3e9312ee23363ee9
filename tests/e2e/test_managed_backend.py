"""A llama.cpp server that IOP started dies, hangs or cannot start: IOP lives on.

Real processes end to end: ``iop up`` (edge, node and the embedded llama.cpp
server in one process), and ``iop edge`` with an ``iop node`` whose
``llamacpp`` instance the node starts. The fault is done to the real server
process (its pid is in the log line ``... is ready at URL ... pid N``):
``kill -9`` mid-stream, ``SIGSTOP`` mid-stream (the liveness probe must find
it hung and kill it), and a model file that makes it exit at start (a crash
loop, which only an operator's SIGUSR1 ends). Each scenario checks the
bytes the client got, that the IOP process still runs, and that a request
after the restart succeeds (docs/operations.md, "When a managed backend
dies").

The server costs a model load per start on a shared machine, so the
scenarios share processes: one ``iop up`` for the kill and the hang, one
edge and node for the crash loop and a kill under a node.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx
import openai
import pytest

from iop.managed._llamacpp_server import default_model_path
from tests.e2e._platform import Edge, Proc, Procs, poll, require_real_backend, toml_dumps
from tests.edge._openai_schema import validate_error

pytestmark = [pytest.mark.real_backend, pytest.mark.slow]

ALIAS: Final = "SmolLM2-135M-Instruct"
READY_TIMEOUT_S: Final = 120.0
# From a fault to the server serving again: the exit (or the liveness
# probe's verdict), the backoff, and a model load on a busy machine.
RESTART_TIMEOUT_S: Final = 90.0
# Long enough to be mid-stream at the fault whatever the machine's speed.
LONG_TOKENS: Final = 1500
STORY: Final = "Write a long story about a dragon who learns to read."
# The supervision of the tests: quick restarts; a liveness probe that finds a
# frozen server within a few seconds but does not mistake a busy one for it.
SUPERVISE: Final[dict[str, Any]] = {
    "restart_min_s": 0.2,
    "restart_max_s": 1.0,
    "liveness_interval_s": 0.5,
    "liveness_timeout_s": 2.0,
    "liveness_failures": 3,
}
# "... is ready at http://127.0.0.1:PORT in 1.23s (model load 0.45s, pid 1234)"
SERVER_READY: Final = re.compile(
    r"embedded llama\.cpp server is ready at (http://\S+) in \S+ \(model load \S+, pid (\d+)\)"
)


# --- the servers a test signalled, never left frozen or running ----------------------


class Servers:
    """The llama.cpp servers of one IOP process, by their start lines in its log."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc
        self.signalled: list[int] = []

    def pids(self) -> list[int]:
        return [int(m.group(2)) for m in SERVER_READY.finditer(self.proc.stderr())]

    def wait_start(self, number: int, timeout: float = RESTART_TIMEOUT_S) -> int:
        """Wait for the ``number``-th server start (1-based); its pid."""
        pids = poll(
            lambda: len(p := self.pids()) >= number and p,
            timeout=timeout,
            what=f"server start number {number} in {self.proc.name}'s log",
        )
        return pids[number - 1]

    def signal(self, pid: int, sig: signal.Signals) -> None:
        self.signalled.append(pid)
        os.kill(pid, sig)

    def cleanup(self) -> None:
        """A server left frozen or running by a failed test is killed."""
        for pid in self.signalled + self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)


# --- raw streams: the client's own bytes --------------------------------------------------


@dataclass
class RawStream:
    """One streaming request read as bytes, the way a client's socket gets them."""

    status: int = 0
    body: bytes = b""
    error: str = ""  # what cut the connection, if it was cut

    def events(self) -> list[tuple[str, str]]:
        """``(event name, data)`` of each SSE event (name "" when there is none)."""
        out = []
        for block in self.body.decode().split("\n\n"):
            name, data = "", []
            for line in block.splitlines():
                if line.startswith("event: "):
                    name = line[len("event: ") :]
                elif line.startswith("data: "):
                    data.append(line[len("data: ") :])
            if data:
                out.append((name, "\n".join(data)))
        return out


class StreamReader:
    """Reads one stream in a thread; ``first_text`` is set once ``text_marker`` matched."""

    def __init__(self, url: str, path: str, body: dict[str, Any], text_marker: bytes) -> None:
        self.result = RawStream()
        self.first_text = threading.Event()
        self._args = (url, path, body, re.compile(text_marker))
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        url, path, body, marker = self._args
        timeout = httpx.Timeout(120.0, connect=10.0)
        try:
            with (
                httpx.Client(base_url=url, timeout=timeout, trust_env=False) as http,
                http.stream("POST", path, json=body, headers={"x-api-key": "x"}) as resp,
            ):
                self.result.status = resp.status_code
                for chunk in resp.iter_raw():
                    self.result.body += chunk
                    if marker.search(self.result.body):
                        self.first_text.set()
        except httpx.HTTPError as exc:
            self.result.error = repr(exc)
        finally:
            self.first_text.set()  # never leave the test waiting

    def wait_text(self, timeout: float = 60.0) -> None:
        assert self.first_text.wait(timeout), "no output within the deadline"
        assert not self.result.error, self.result.error

    def join(self, timeout: float = RESTART_TIMEOUT_S) -> RawStream:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream did not end"
        return self.result


def chat_stream(url: str) -> StreamReader:
    body = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": STORY}],
        "max_tokens": LONG_TOKENS,
        "stream": True,
        "ignore_eos": True,  # llama.cpp's own: generate until max_tokens
    }
    # Not the role chunk's empty content, which may go out before any output.
    return StreamReader(url, "/v1/chat/completions", body, rb'"content":"[^"]')


def responses_stream(url: str) -> StreamReader:
    body = {
        "model": ALIAS,
        "input": STORY,
        "max_output_tokens": LONG_TOKENS,
        "stream": True,
        "ignore_eos": True,
    }
    return StreamReader(url, "/v1/responses", body, b"response.output_text.delta")


def messages_stream(url: str) -> StreamReader:
    body = {
        "model": ALIAS,
        "max_tokens": LONG_TOKENS,
        "messages": [{"role": "user", "content": STORY}],
        "stream": True,
    }
    return StreamReader(url, "/v1/messages", body, b'"text_delta"')


def assert_chat_ended_backend_lost(raw: RawStream) -> dict[str, Any]:
    """Output, then one OpenAI error object with code ``backend_lost``, then ``[DONE]``."""
    assert raw.status == 200, raw
    assert not raw.error, f"the connection was cut: {raw.error}\n{raw.body[-500:]!r}"
    events = raw.events()
    assert events[-1] == ("", "[DONE]"), raw.body[-500:]
    error = json.loads(events[-2][1])
    validate_error(error)
    assert error["error"]["code"] == "backend_lost", error
    content = [json.loads(d) for _, d in events[:-2]]
    assert any(c["choices"] and c["choices"][0]["delta"].get("content") for c in content)
    assert not any(c["choices"] and c["choices"][0].get("finish_reason") for c in content)
    return error


def assert_responses_failed_backend_lost(raw: RawStream) -> None:
    """Output, then ``response.failed`` whose error names ``backend_lost``, and the end."""
    assert raw.status == 200, raw
    assert not raw.error, f"the connection was cut: {raw.error}"
    events = raw.events()
    names = [name for name, _ in events]
    assert "response.output_text.delta" in names
    assert names[-1] == "response.failed", names[-5:]
    assert "response.completed" not in names
    failed = json.loads(events[-1][1])
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"
    assert "(backend_lost)" in failed["response"]["error"]["message"]


def assert_messages_error_event(raw: RawStream) -> None:
    """Output, then Anthropic's ``error`` event (overloaded: retry later), no ``message_stop``."""
    assert raw.status == 200, raw
    assert not raw.error, f"the connection was cut: {raw.error}"
    events = raw.events()
    names = [name for name, _ in events]
    assert "content_block_delta" in names
    assert names[-1] == "error", names[-5:]
    assert "message_stop" not in names
    error = json.loads(events[-1][1])
    assert error["type"] == "error"
    assert error["error"]["type"] == "overloaded_error"


def assert_a_request_succeeds(url: str) -> None:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60.0) as client:
        completion = client.chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4
        )
    assert completion.choices[0].finish_reason in ("length", "stop")
    assert completion.usage is not None
    assert completion.usage.completion_tokens > 0


def wait_serving(url: str, timeout: float = RESTART_TIMEOUT_S) -> None:
    """``/readyz`` 200 and the model listed: the restarted server is routed to again."""

    def serving() -> bool:
        try:
            with httpx.Client(base_url=url, timeout=5.0, trust_env=False) as http:
                if http.get("/readyz").status_code != 200:
                    return False
                return ALIAS in [m["id"] for m in http.get("/v1/models").json()["data"]]
        except httpx.TransportError:
            return False

    poll(serving, timeout=timeout, what="the model to be served again")


# --- iop up -------------------------------------------------------------------------------


@dataclass
class Up:
    proc: Proc
    url: str
    servers: Servers


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    require_real_backend()
    log_dir = tmp_path_factory.mktemp("up")
    config = log_dir / "up.toml"
    # Three slots: the three surfaces stream at once.
    config.write_text(
        toml_dumps({"embedded": {"parallel": 3, "ctx": 6144, "supervise": SUPERVISE}})
    )
    proc = Proc("iop-up", ["up", "--port", "0", "--config", str(config)], log_dir)
    servers = Servers(proc)
    try:
        proc.wait_stdout(r"iop up: ready; models: .*", timeout=READY_TIMEOUT_S)
        m = re.search(r"OpenAI API on (http://\S+)/v1", proc.stdout())
        assert m is not None, proc.logs()
        yield Up(proc, m.group(1), servers)
    finally:
        proc.stop()
        servers.cleanup()


def test_kill_9_mid_stream_under_iop_up(up: Up) -> None:
    """Every surface's stream ends in its own protocol; ``iop up`` lives and restarts it."""
    pid = up.servers.wait_start(1)
    readers = [chat_stream(up.url), responses_stream(up.url), messages_stream(up.url)]
    for reader in readers:
        reader.wait_text()

    up.servers.signal(pid, signal.SIGKILL)
    chat, responses, messages = (r.join() for r in readers)

    error = assert_chat_ended_backend_lost(chat)
    assert "killed by SIGKILL" in error["error"]["message"]
    assert_responses_failed_backend_lost(responses)
    assert_messages_error_event(messages)
    assert up.proc.alive, up.proc.logs()
    up.proc.wait_stderr(
        r"ERROR +iop\.managed\.supervise: instance llamacpp: .*killed by SIGKILL", 10
    )
    assert up.servers.wait_start(2) != pid
    wait_serving(up.url)
    assert_a_request_succeeds(up.url)
    assert "CRITICAL" not in up.proc.stderr()


def test_a_frozen_server_is_found_killed_and_restarted_under_iop_up(up: Up) -> None:
    """SIGSTOP: the liveness probe gets no answer, kills the server; the stream ends
    ``backend_lost`` long before the run's idle deadline, and a new server serves."""
    starts = len(up.servers.pids())
    pid = up.servers.wait_start(starts)
    wait_serving(up.url)
    reader = chat_stream(up.url)
    reader.wait_text()

    up.servers.signal(pid, signal.SIGSTOP)
    raw = reader.join()

    error = assert_chat_ended_backend_lost(raw)
    assert "stopped answering /health" in error["error"]["message"]
    assert up.proc.alive, up.proc.logs()
    up.servers.wait_start(starts + 1)
    wait_serving(up.url)
    assert_a_request_succeeds(up.url)
    assert "CRITICAL" not in up.proc.stderr()


# --- a node -------------------------------------------------------------------------------


def _iop_probe(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "iop", "probe", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_crash_loop_then_an_operator_then_a_kill_under_a_node(procs: Procs) -> None:
    """A server that exits at start (a corrupt model) is restarted until the crash-loop
    limit, then left down with the reason everywhere; SIGUSR1 after the fix starts it;
    a ``kill -9`` mid-stream then ends the stream ``backend_lost`` and it comes back."""
    require_real_backend()
    model = procs.log_dir / "model.gguf"
    model.write_bytes(b"not a gguf file\n")
    edge: Edge = procs.edge({"server": {"keepalive_interval_s": 0.5}})
    config = procs.log_dir / "node.toml"
    instance = {
        "adapter": "llamacpp",
        "name": "llama",
        "model": str(model),
        "alias": ALIAS,
        "ctx": 2048,
        "parallel": 1,
        "supervise": {**SUPERVISE, "crash_loop_exits": 2, "crash_loop_window_s": 600.0},
    }
    config.write_text(
        toml_dumps(
            {
                "node": {"id": "n1", "edges": [{"url": edge.link_url, "token": "e2e-node-token"}]},
                "instances": [instance],
            }
        )
    )
    node = Proc("node", ["node", "--config", str(config)], procs.log_dir)
    procs.adopt(node)
    servers = Servers(node)
    try:
        node.wait_stderr(r"ERROR +iop\.managed\.supervise: instance llama: crash loop", 60)
        cause = "llama.cpp failed to start (exit code 1)"

        def down_with_cause() -> bool:
            nodes = edge.admin()["nodes"]
            if not nodes:
                return False
            (inst,) = nodes[0]["instances"]
            detail = inst["provider_detail"]
            return inst["provider_status"] == "unavailable" and "crash loop" in detail

        poll(down_with_cause, timeout=20, what="the edge to show the crash loop")
        (inst,) = edge.admin()["nodes"][0]["instances"]
        assert cause in inst["provider_detail"]
        assert "SIGUSR1" in inst["provider_detail"]
        assert "crash loop" in edge.get("/admin").text
        ready = edge.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["status"] == "no node can serve a model right now"
        with edge.openai() as client, pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(
                model=ALIAS, messages=[{"role": "user", "content": "hi"}]
            )
        assert info.value.status_code == 503
        body = info.value.response.json()
        validate_error(body)
        assert body["error"]["code"] == "model_unavailable"
        assert "instance n1/llama" in body["error"]["message"]
        assert cause in body["error"]["message"]
        probe = _iop_probe(config)
        assert probe.returncode == 1, probe.stderr
        caps = json.loads(probe.stdout)
        assert caps["provider_status"] == "unavailable"
        assert cause in caps["provider_detail"]
        assert node.alive, node.logs()
        # Crash loop: no more starts until the operator acts.
        starts = node.stderr().count("starting the embedded llama.cpp server")
        assert starts == 2, node.logs()

        # The operator fixes the model and tells the node.
        good = default_model_path()
        assert good is not None
        shutil.copyfile(good, model)
        node.send(signal.SIGUSR1)
        pid = servers.wait_start(1)
        edge.wait_ready(model=ALIAS, node_id="n1", timeout=RESTART_TIMEOUT_S)
        assert_a_request_succeeds(edge.url)

        reader = chat_stream(edge.url)
        reader.wait_text()
        servers.signal(pid, signal.SIGKILL)
        error = assert_chat_ended_backend_lost(reader.join())
        assert "instance llama" in error["error"]["message"]
        assert node.alive, node.logs()
        servers.wait_start(2)
        edge.wait_ready(model=ALIAS, node_id="n1", timeout=RESTART_TIMEOUT_S)
        assert_a_request_succeeds(edge.url)
        assert "CRITICAL" not in node.stderr()
    finally:
        node.stop()
        servers.cleanup()
