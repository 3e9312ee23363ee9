"""``iop up --backend sim`` as an operator sees it: its output, its signals, tool calls.

Real ``iop up`` processes (the simulated backend, so no model is needed):
every line it prints on stderr is a log record in the format of
docs/operations.md; a second SIGTERM cuts a drain short with exit 143; and
the sim backend is the one to demo tool calls with (the tiny llama.cpp model
cannot: README "Try it").
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any, Final

import httpx
import openai
import pytest

from iop.testing import UP_READY
from tests.e2e._platform import (
    LOG_LINE,
    MODEL,
    TOKEN,
    Proc,
    StreamResult,
    read_more,
    read_stream,
    start_node,
    start_sim,
    toml_dumps,
)

pytestmark = pytest.mark.slow

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
# Generous bound on an exit that should be prompt (a hang guard, not a timing claim).
EXIT_BOUND_S: Final = 5.0


def start_up(log_dir: Path, *flags: str, config: dict[str, Any] | None = None) -> tuple[Proc, str]:
    args = ["up", "--backend", "sim", "--port", "0", *flags]
    if config is not None:
        path = log_dir / "up.toml"
        log_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(toml_dumps(config))
        args += ["--config", str(path)]
    proc = Proc("iop-up", args, log_dir)
    try:
        m = proc.wait_stdout(UP_READY)
    except BaseException:
        proc.stop()
        raise
    assert m.group(2) == repr(MODEL), proc.logs()
    return proc, m.group(1)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)


def test_everything_on_stderr_is_a_log_record(tmp_path: Path) -> None:
    proc, url = start_up(tmp_path)
    try:
        with (
            client(url) as c,
            c.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True) as s,
        ):
            assert read_stream(s).finish_reason in ("stop", "length")
    finally:
        rc = proc.stop()
    assert rc == 0, proc.logs()
    lines = proc.stderr().splitlines()
    assert lines, "iop up logs its start and stop"
    strays = [line for line in lines if not LOG_LINE.match(line)]
    assert strays == [], "\n".join(strays)
    # hypercorn's start-up line once, in our format, not its own.
    assert sum("Running on http://" in line for line in lines) == 1
    assert any(" iop.up: SIGTERM received: draining" in line for line in lines)
    assert lines[-1].endswith(" iop.up: stopped")
    # stdout is the two start-up lines of docs/operations.md, nothing else.
    out = proc.stdout().splitlines()
    assert [line.split(":")[0] for line in out] == ["iop edge", "iop up"], out


def test_log_level_after_the_subcommand(tmp_path: Path) -> None:
    quiet, _ = start_up(tmp_path, "--log-level", "warning")
    assert quiet.stop() == 0, quiet.logs()
    assert " INFO " not in quiet.stderr(), quiet.stderr()
    # The same flag after the subcommand also turns verbosity up.
    chatty, _ = start_up(tmp_path, "--log-level", "debug")
    assert chatty.stop() == 0, chatty.logs()
    assert " DEBUG " in chatty.stderr(), chatty.stderr()


def test_second_sigterm_stops_a_drain_at_once(tmp_path: Path) -> None:
    """First SIGTERM: drain (30 s here, with a stream running); second: exit 143 at once."""
    proc, url = start_up(
        tmp_path,
        config={
            "edge": {"server": {"drain_timeout_s": 30.0, "keepalive_interval_s": 0.5}},
            "node": {"id": "local", "drain_timeout_s": 30.0},
        },
    )
    try:
        with (
            client(url) as c,
            c.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                stream=True,
                extra_body={"iop_sim": {"output_tokens": 1000, "tokens_per_s": 20.0}},
            ) as s,
        ):
            it = iter(s)
            r = StreamResult([], "", [], "", {}, None, None)
            read_more(it, r, 3)
            proc.send(signal.SIGTERM)
            proc.wait_stderr(r"draining node local: 1 runs? in flight", timeout=10)
            assert proc.alive, "the drain waits for the stream"
            proc.send(signal.SIGTERM)
            rc = proc.wait(EXIT_BOUND_S)
            with pytest.raises((openai.APIError, openai.APIConnectionError)):
                read_more(it, r)
    finally:
        proc.stop()
    assert rc == 128 + signal.SIGTERM, proc.logs()
    assert "iop.up: SIGTERM again: stopping now" in proc.stderr()
    assert r.finish_reason is None


def test_the_sim_backend_demos_tool_calls(tmp_path: Path) -> None:
    """README "Try it" points tool-call demos at `iop up --backend sim`: it must deliver."""
    proc, url = start_up(tmp_path)
    tools: Any = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    try:
        with client(url) as c:
            completion = c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Weather in Paris?"}],
                tools=tools,
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
            )
    finally:
        assert proc.stop() == 0, proc.logs()
    (choice,) = completion.choices
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls
    assert calls[0].function.name == "get_weather"
    json.loads(calls[0].function.arguments)


def test_the_root_url_points_to_the_api_the_admin_view_and_the_docs(tmp_path: Path) -> None:
    proc, url = start_up(tmp_path)
    try:
        for path in ("/", "/v1"):
            resp = httpx.get(f"{url}{path}", timeout=30)
            assert resp.status_code == 404
            message = resp.json()["error"]["message"]
            for pointer in ("GET /v1/models", "/admin", "docs/api.md"):
                assert pointer in message, message
        # Any other unknown URL stays a plain 404.
        other = httpx.get(f"{url}/nope", timeout=30).json()["error"]["message"]
        assert other == "Unknown request URL: GET /nope."
    finally:
        proc.stop()


def own_tcp_links(proc: Proc, url: str) -> list[Any]:
    """The TCP connections ``proc`` holds to its own API port (a node of its
    own dialling it would hold one)."""
    import psutil

    port = int(url.rsplit(":", 1)[1])
    return [
        c
        for c in psutil.Process(proc.pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port
    ]


def test_its_own_node_joins_in_process_and_other_nodes_over_the_network(tmp_path: Path) -> None:
    """``iop up``'s node joins its edge over an in-process link: it streams
    with no connection of the process to its own port, and /admin/nodes
    shows the node's peer as ``in-process`` (docs/operations.md, "iop up's own
    node").
    A node in another process still joins the same edge over the network."""
    config = {"edge": {"link": {"node_tokens": [TOKEN]}}}
    proc, url = start_up(tmp_path / "up", config=config)
    sim = start_sim(tmp_path / "sim")
    try:
        with client(url) as c:
            result = read_stream(
                c.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
            )
        assert result.content, proc.logs()
        assert own_tcp_links(proc, url) == [], proc.logs()
        nodes = httpx.get(f"{url}/admin/nodes", timeout=30).json()["nodes"]
        assert [n["peer"] for n in nodes] == ["in-process"], nodes
        link_url = "ws" + url[len("http") :] + "/v1/link"
        other = start_node(tmp_path / "node", [link_url], sim.url, node_id="remote")
        try:
            with httpx.Client(base_url=url, timeout=30) as http:
                peers = {n["id"]: n["peer"] for n in http.get("/admin/nodes").json()["nodes"]}
            assert peers["remote"].startswith("127.0.0.1:"), peers
            assert list(peers.values()).count("in-process") == 1, peers
        finally:
            other.proc.stop()
    finally:
        sim.proc.stop()
        rc = proc.stop()
    assert rc == 0, proc.logs()


def test_with_tls_its_own_node_joins_in_process_and_clients_get_https(tmp_path: Path) -> None:
    """``server.tls_*`` on ``iop up``: its own node needs no certificate (its
    link is in-process, not a loopback ``wss://``: nothing to encrypt in one
    process), while clients verify the edge's (here: a leaf of an
    intermediate CA, for another host name, served as a chain file)
    against the CA as usual."""
    import ssl

    import trustme

    root = trustme.CA()
    leaf = root.create_child_ca().issue_cert("api.example.com", "127.0.0.1")
    chain = tmp_path / "chain.pem"
    chain.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    key = tmp_path / "key.pem"
    key.write_bytes(leaf.private_key_pem.bytes())
    ca = tmp_path / "ca.pem"
    ca.write_bytes(root.cert_pem.bytes())
    config = {"edge": {"server": {"tls_certfile": str(chain), "tls_keyfile": str(key)}}}
    proc, url = start_up(tmp_path / "up", config=config)  # its node joined: MODEL is listed
    try:
        assert url.startswith("https://"), url
        verify = ssl.create_default_context(cafile=str(ca))
        with openai.OpenAI(
            base_url=f"{url}/v1",
            api_key="x",
            max_retries=0,
            timeout=30,
            http_client=httpx.Client(verify=verify),
        ) as c:
            answer = c.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert answer.choices[0].message.content
        assert own_tcp_links(proc, url) == [], proc.logs()
    finally:
        rc = proc.stop()
    assert rc == 0, proc.logs()
    assert "certificate verification failed" not in proc.stderr(), proc.logs()
    assert "connected from in-process" in proc.stderr(), proc.logs()
