"""Models on demand end to end: real ``iop edge`` and ``iop node`` processes on
loopback, the node's ``[[models]]`` sim models (each loads in 0.3 s, the node's
memory holds two of three), the official openai SDK as the client.

What a client sees (docs/operations.md, "Models on demand"): its first
request to a cold model streams once the model is loaded, with keep-alive
comments meanwhile; a third model evicts the least recently used; concurrent
requests (and two edges) make one load; a load that fails ends the request
with a clear error naming the model and the reason, 503 with Retry-After.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from typing import Any, Final

import httpx
import openai
import pytest
import trio

from iop.testing import NODE_READY
from tests.e2e._platform import (
    TOKEN,
    Edge,
    Node,
    Proc,
    Procs,
    poll,
    read_stream,
    require_real_backend,
    toml_dumps,
)

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
LOAD_S: Final = 0.3
# A load seen by the node: one line per started process (iop.node._models).
LOADING: Final = re.compile(r"model (\S+): loading \(")
EDGE_CONFIG: Final[dict[str, Any]] = {
    # Keep-alives well inside a load, so a client sees them while it waits.
    "server": {"keepalive_interval_s": 0.05},
    "scheduler": {"model_load_backoff_s": 30.0},
}


def sim_model(name: str, **kw: Any) -> dict[str, Any]:
    return {
        "engine": "sim",
        "name": name,
        "sim": {"load_time_s": LOAD_S, "memory_mib": 50},
        **kw,
    }


def start_model_node(
    procs: Procs,
    edges: list[Edge],
    models: list[dict[str, Any]],
    *,
    memory_mib: int = 100,
    node_id: str = "n1",
    groups: list[dict[str, Any]] | None = None,
) -> Node:
    """``iop node`` with only on-demand ``models`` (no instance), dialling ``edges``."""
    config: dict[str, Any] = {
        "node": {
            "id": node_id,
            "memory_mib": memory_mib,
            "reconnect_min_s": 0.1,
            "reconnect_max_s": 1.0,
            "model_retry_min_s": 1.0,
            "edges": [{"url": e.link_url, "token": TOKEN} for e in edges],
        },
        "models": models,
    }
    if groups:
        config["model_groups"] = groups
    path = procs.log_dir / f"{node_id}.toml"
    path.write_text(toml_dumps(config))
    proc = Proc(node_id, ["node", "--config", str(path)], procs.log_dir)
    procs.adopt(proc)
    proc.wait_stdout(NODE_READY)
    return Node(proc, node_id)


def loads(node: Node) -> list[str]:
    """The models the node started loading, in order."""
    return LOADING.findall(node.proc.stderr())


def run_timeline(edge: Edge) -> dict[str, Any]:
    """The last finished run's whole timeline."""
    runs = edge.admin_get("/admin/runs?limit=1").json()["recent"]
    resp = edge.admin_get(f"/admin/runs/{runs[0]['run_id']}")
    resp.raise_for_status()
    timeline: dict[str, Any] = resp.json()
    return timeline


def test_a_cold_model_streams_after_its_load_and_a_third_evicts_the_least_recent(
    procs: Procs,
) -> None:
    edge = procs.edge(EDGE_CONFIG)
    node = start_model_node(procs, [edge], [sim_model("a"), sim_model("b"), sim_model("c")])
    # Offered models are listed before any is loaded.
    poll(lambda: set(edge.models()) == {"a", "b", "c"}, timeout=20, what="the offered models")
    client = edge.openai()
    # The raw stream first: keep-alive comments while it loads, then the answer.
    with httpx.Client(base_url=edge.url, timeout=30.0) as http:
        body = {"model": "a", "messages": MESSAGES, "stream": True, "max_tokens": 4}
        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            raw = b"".join(resp.iter_bytes())
    # The role chunk opens the stream; keep-alive comments hold it open
    # until the first token, which comes after the load.
    first_token = re.search(rb'"content":"[^"]', raw)
    assert first_token is not None
    assert b"\n\n: keep-alive\n\n" in raw[: first_token.start()]
    assert raw.rstrip().endswith(b"data: [DONE]")
    timeline = run_timeline(edge)
    load = timeline["model_load"]
    assert load["node"] == "n1"
    assert load["model"] == "a"
    assert load["result"] == "ready"
    assert load["elapsed_ms"] >= LOAD_S * 1000 * 0.9
    listed = edge.admin_get("/admin/runs?limit=1").json()["recent"][0]
    assert listed["model_load_ms"] == load["elapsed_ms"]
    # Warm now: no load, the SDK streams at once.
    stream = client.chat.completions.create(model="a", messages=MESSAGES, stream=True, max_tokens=4)
    assert read_stream(stream).finish_reason is not None
    assert run_timeline(edge)["model_load"] is None
    # b fits beside a (asked on Anthropic's surface: its keep-alive is a
    # ping event); c does not: the least recently used (a) goes.
    with httpx.Client(base_url=edge.url, timeout=30.0) as http:
        body = {"model": "b", "messages": MESSAGES, "stream": True, "max_tokens": 4}
        headers = {"anthropic-version": "2023-06-01"}
        with http.stream("POST", "/v1/messages", json=body, headers=headers) as resp:
            assert resp.status_code == 200
            raw = b"".join(resp.iter_bytes())
    assert raw.index(b"event: ping") < raw.index(b"event: content_block_delta")
    stream = client.chat.completions.create(model="c", messages=MESSAGES, stream=True, max_tokens=4)
    assert read_stream(stream).content
    assert loads(node) == ["a", "b", "c"]
    node.proc.wait_stderr(r"model a: unloading: evicted for c", 10)
    # a again: b is now the least recent.
    answer = client.chat.completions.create(model="a", messages=MESSAGES, max_tokens=4)
    assert answer.choices[0].message.content
    node.proc.wait_stderr(r"model b: unloading: evicted for a", 10)
    assert loads(node) == ["a", "b", "c", "a"]


def test_concurrent_requests_for_a_cold_model_make_one_load(procs: Procs) -> None:
    edge = procs.edge(EDGE_CONFIG)
    node = start_model_node(procs, [edge], [sim_model("a"), sim_model("b")])
    edge.wait_ready("a")
    client = edge.openai()
    answers: list[str] = []

    async def ask() -> None:
        answer = await trio.to_thread.run_sync(
            lambda: client.chat.completions.create(model="a", messages=MESSAGES, max_tokens=4)
        )
        answers.append(answer.choices[0].message.content or "")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(ask)

    trio.run(main)
    assert len(answers) == 4
    assert all(answers)
    assert loads(node) == ["a"]


def test_two_edges_asking_one_node_make_one_load(procs: Procs) -> None:
    one = procs.edge(EDGE_CONFIG, name="edge1")
    two = procs.edge(EDGE_CONFIG, name="edge2")
    node = start_model_node(procs, [one, two], [sim_model("a")])
    one.wait_ready("a")
    two.wait_ready("a")
    answers: list[str] = []

    async def ask(edge: Edge) -> None:
        client = edge.openai()
        answer = await trio.to_thread.run_sync(
            lambda: client.chat.completions.create(model="a", messages=MESSAGES, max_tokens=4)
        )
        answers.append(answer.choices[0].message.content or "")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, one)
            nursery.start_soon(ask, two)

    trio.run(main)
    assert len(answers) == 2
    assert all(answers)
    assert loads(node) == ["a"]
    # Each edge asked, the node answered each once the one load was done.
    assert len(re.findall(r"asked for model a: ready", node.proc.stderr())) == 2


def test_a_load_that_fails_ends_the_request_with_the_model_and_the_reason(
    procs: Procs,
) -> None:
    broken = {
        "engine": "vllm",
        "name": "broken",
        "memory_mib": 50,
        # The engine's process dies while loading, saying why.
        "command": ["sh", "-c", "echo 'CUDA out of memory' >&2; exit 3", "{port}"],
    }
    # One that fails later than the stream's first keep-alive: its client
    # has the stream's head already, and gets the error as a stream event.
    late = {
        **broken,
        "name": "late",
        "command": ["sh", "-c", "sleep 0.5; echo 'health never passed' >&2; exit 1", "{port}"],
    }
    edge = procs.edge(EDGE_CONFIG)
    start_model_node(procs, [edge], [broken, late, sim_model("a")], memory_mib=150)
    edge.wait_ready("broken")
    client = edge.openai()
    stream = client.chat.completions.create(
        model="late", messages=MESSAGES, max_tokens=4, stream=True
    )
    with pytest.raises(openai.APIError) as in_stream:
        read_stream(stream)
    assert "'late'" in in_stream.value.message
    assert "exited with 1 while loading" in in_stream.value.message
    with pytest.raises(openai.APIStatusError) as failed:
        client.chat.completions.create(model="broken", messages=MESSAGES, max_tokens=4)
    err = failed.value
    assert err.status_code == 503
    assert err.response.headers["retry-after"] == "30"
    body = err.response.json()["error"]
    assert body["code"] == "model_load_failed"
    assert "'broken'" in body["message"]
    assert "exited with 3 while loading" in body["message"]
    # Streamed, and on Anthropic's surface: the same error in each one's shape.
    with pytest.raises(openai.APIStatusError) as streamed:
        client.chat.completions.create(model="broken", messages=MESSAGES, max_tokens=4, stream=True)
    assert streamed.value.status_code == 503
    assert streamed.value.response.json()["error"]["code"] == "model_load_failed"
    with httpx.Client(base_url=edge.url, timeout=30.0) as http:
        resp = http.post(
            "/v1/messages",
            headers={"anthropic-version": "2023-06-01"},
            json={"model": "broken", "max_tokens": 4, "messages": MESSAGES},
        )
    # Anthropic's shape of a 503: 529 overloaded_error.
    assert resp.status_code == 529, resp.text
    assert resp.headers["retry-after"] == "30"
    anthropic_error = resp.json()
    assert anthropic_error["type"] == "error"
    assert anthropic_error["error"]["type"] == "overloaded_error"
    assert "exited with 3 while loading" in anthropic_error["error"]["message"]
    # The other model still loads and serves.
    answer = client.chat.completions.create(model="a", messages=MESSAGES, max_tokens=4)
    assert answer.choices[0].message.content


def test_a_loading_process_killed_ends_the_waiting_request_saying_so(procs: Procs) -> None:
    """The engine's process is killed while it loads (the kernel's OOM killer,
    an operator): the request waiting for it ends 503 ``model_load_failed``
    naming the model and the signal, and the node goes on serving."""
    # A server that never becomes healthy: its load waits until killed.
    # (sleep adds its arguments: the port makes it longer, and the odd
    # first one finds this process and no other.)
    stuck = {
        "engine": "vllm",
        "name": "stuck",
        "memory_mib": 50,
        "command": ["sleep", "7311.5", "{port}"],
    }
    edge = procs.edge(EDGE_CONFIG)
    start_model_node(procs, [edge], [stuck, sim_model("a")], memory_mib=150)
    edge.wait_ready("stuck")
    with edge.openai() as client:
        _kill_the_load_under(client)


def _kill_the_load_under(client: openai.OpenAI) -> None:
    """Ask ``client`` for the stuck model, kill its loading process, read the answer."""
    failed: list[BaseException] = []

    def ask() -> None:
        try:
            client.chat.completions.create(model="stuck", messages=MESSAGES, max_tokens=4)
        except BaseException as exc:
            failed.append(exc)

    asker = threading.Thread(target=ask)
    asker.start()
    pids: list[int] = []

    def started() -> bool:
        pids[:] = []
        for entry in os.scandir("/proc"):
            try:
                with open(f"{entry.path}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue  # not a process, or gone
            if argv[:2] == [b"sleep", b"7311.5"]:
                pids.append(int(entry.name))
        return bool(pids)

    poll(started, timeout=30.0, what="the stuck model's process to start")
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    asker.join(timeout=60.0)
    assert not asker.is_alive()
    [err] = failed
    assert isinstance(err, openai.APIStatusError), err
    assert err.status_code == 503
    body = err.response.json()["error"]
    assert body["code"] == "model_load_failed"
    assert "'stuck'" in body["message"]
    assert "killed by SIGKILL while loading" in body["message"], body["message"]
    answer = client.chat.completions.create(model="a", messages=MESSAGES, max_tokens=4)
    assert answer.choices[0].message.content


def test_a_load_goes_to_the_node_with_free_memory_not_to_one_that_must_evict(
    procs: Procs,
) -> None:
    edge = procs.edge(EDGE_CONFIG)
    # n1 has a loaded and no room for x beside it; n2 has room for x.
    n1 = start_model_node(procs, [edge], [sim_model("a"), sim_model("x", memory_mib=60)])
    n2 = start_model_node(procs, [edge], [sim_model("x", memory_mib=60)], node_id="n2")
    edge.wait_ready("x", "n2")
    client = edge.openai()
    assert client.chat.completions.create(model="a", messages=MESSAGES, max_tokens=4).choices
    assert loads(n1) == ["a"]
    assert client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=4).choices
    load = run_timeline(edge)["model_load"]
    assert load["node"] == "n2"
    assert "free" in run_timeline(edge)["why_queued"]
    assert loads(n2) == ["x"]
    assert loads(n1) == ["a"]  # a was not evicted for x


def test_a_swap_inside_min_residency_is_refused_and_the_request_waits_then_times_out(
    procs: Procs,
) -> None:
    # Room for one model; a stays resident 600 s after its last use. A request
    # for b must not evict it: the node refuses, the edge waits (never asking
    # again within its backoff) and ends the request 503 with the refusal.
    edge = procs.edge({**EDGE_CONFIG, "scheduler": {"model_load_wait_s": 2.0}})
    node = start_model_node(
        procs, [edge], [sim_model("a", min_residency_s=600.0), sim_model("b")], memory_mib=50
    )
    edge.wait_ready("b")
    client = edge.openai()
    assert client.chat.completions.create(model="a", messages=MESSAGES, max_tokens=4).choices
    with pytest.raises(openai.APIStatusError) as waited:
        client.chat.completions.create(model="b", messages=MESSAGES, max_tokens=4)
    assert waited.value.status_code == 503
    body = waited.value.response.json()["error"]
    assert body["code"] == "model_load_timeout"
    assert "min_residency_s" in body["message"]
    assert loads(node) == ["a"]  # b never loaded, a never unloaded
    assert "model a: unloading" not in node.proc.stderr()
    # a still serves.
    assert client.chat.completions.create(model="a", messages=MESSAGES, max_tokens=4).choices


def test_a_load_only_an_unpin_would_allow_is_refused_at_once(procs: Procs) -> None:
    """Pinned a is in the way of b (their group swaps) and of c (a's memory
    leaves too little): each request ends at once, 503 ``model_load_refused``
    with Retry-After, naming the pinned model and the node, instead of
    waiting ``scheduler.model_load_wait_s`` for an unpin. b's refusal is the
    node's answer on the link; c's the edge's reading of the node's offers,
    so the node is not asked."""
    edge = procs.edge(
        {**EDGE_CONFIG, "scheduler": {"model_load_backoff_s": 30.0, "model_load_wait_s": 60.0}}
    )
    node = start_model_node(
        procs,
        [edge],
        [sim_model("a", pinned=True), sim_model("b"), sim_model("c", memory_mib=60)],
        groups=[{"name": "g", "members": ["a", "b"]}],
    )
    edge.wait_ready("c")
    client = edge.openai()
    for model in ("b", "c"):
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)
        err = refused.value
        assert err.status_code == 503
        assert err.response.headers["retry-after"] == "30"
        body = err.response.json()["error"]
        assert body["code"] == "model_load_refused", body
        assert f"model {model!r}" in body["message"]
        assert "node n1: pinned model a in the way" in body["message"]
    stderr = node.proc.stderr()
    assert "asked for model b: model_load_refused" in stderr
    assert "asked for model c" not in stderr
    assert loads(node) == ["a"]
    # a serves on.
    assert client.chat.completions.create(model="a", messages=MESSAGES, max_tokens=4).choices


def test_the_real_llamacpp_server_a_third_model_evicts_the_least_recent(procs: Procs) -> None:
    """The packaged SmolLM2-135M under three names, each its own llama.cpp
    server (different ``ctx``), on a node with room for two."""
    require_real_backend()

    def smol(name: str, ctx: int) -> dict[str, Any]:
        return {
            "engine": "llamacpp",
            "name": name,
            "memory_mib": 600,
            "ctx": ctx,
            "parallel": 1,
            "cache_ram_mib": 0,
            "supervise": {"liveness_interval_s": 0},
        }

    # And one whose file is no GGUF: llama.cpp cannot load it.
    bad_file = procs.log_dir / "not-a-model.gguf"
    bad_file.write_text("this is not a GGUF file\n")
    bad = {**smol("smol-bad", 512), "model": str(bad_file), "memory_mib": 10}
    edge = procs.edge({"scheduler": {"model_load_wait_s": 120.0}})
    node = start_model_node(
        procs,
        [edge],
        [smol("smol-a", 512), smol("smol-b", 768), smol("smol-c", 1024), bad],
        memory_mib=1210,
    )
    edge.wait_ready("smol-c")
    client = edge.openai(timeout=120.0)
    for name in ("smol-a", "smol-b"):
        answer = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=4)
        assert answer.choices[0].message.content is not None
    stream = client.chat.completions.create(
        model="smol-c", messages=MESSAGES, max_tokens=4, stream=True
    )
    assert read_stream(stream).finish_reason is not None
    node.proc.wait_stderr(r"model smol-a: unloading: evicted for smol-c", 30)
    assert loads(node) == ["smol-a", "smol-b", "smol-c"]
    load = run_timeline(edge)["model_load"]
    assert load["model"] == "smol-c"
    assert load["result"] == "ready"
    # b was used last of the two still loaded: it stays, and serves at once.
    answer = client.chat.completions.create(model="smol-b", messages=MESSAGES, max_tokens=4)
    assert answer.choices[0].message.content is not None
    assert run_timeline(edge)["model_load"] is None
    assert loads(node) == ["smol-a", "smol-b", "smol-c"]
    with pytest.raises(openai.APIStatusError) as failed:
        client.chat.completions.create(model="smol-bad", messages=MESSAGES, max_tokens=4)
    assert failed.value.status_code == 503
    error = failed.value.response.json()["error"]
    assert error["code"] == "model_load_failed"
    assert "'smol-bad'" in error["message"]
    assert "exited before it was ready" in error["message"]
    # The others are untouched: b still serves at once.
    answer = client.chat.completions.create(model="smol-b", messages=MESSAGES, max_tokens=4)
    assert answer.choices[0].message.content is not None
    assert run_timeline(edge)["model_load"] is None
