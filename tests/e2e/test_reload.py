"""Reloading a running edge and node (docs/operations.md, "Reloading").

One set of real processes for the module: ``iop sim``, an ``iop edge`` whose
config file the tests rewrite, and an ``iop node`` (64 slots) whose file they
rewrite too. The edge reloads by ``POST /admin/reload`` (its reply is the
plan) or SIGHUP; the node by SIGHUP (``iop reload --pid``), and says what it
applied in its log.

What is checked: streams in flight are never touched by a reload (20 of them
while 32 streams run, each stream ending with its normal terminal); a revoked
key is refused after one reload while its running stream finishes; a file that
fails validation changes nothing and says why, in the reply and the log; a key
that needs a restart is named, not applied; an instance added to the node's
file serves after the node's reload; a node token taken out of the edge's file
refuses that node's next dial while its live link goes on.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx
import pytest
import trio

from iop.testing import UP_READY, toml_dumps
from tests.e2e._platform import (
    MODEL,
    TOKEN,
    Edge,
    Node,
    Proc,
    Procs,
    Sim,
    poll,
    start_edge,
    start_node,
)

pytestmark = pytest.mark.timeout(150)

OPERATOR: Final = "iop-e2e-reload-operator"
ADMIN: Final = "iop-e2e-reload-admin-key"
KEY_ALICE: Final = "iop-e2e-reload-alice-key"
KEY_ALICE_2: Final = "iop-e2e-reload-alice-key-2"
KEY_BOB: Final = "iop-e2e-reload-bob-key"
ADMIN_HEADERS: Final = {"Authorization": f"Bearer {ADMIN}"}
# A node token of the edge's file (the module's node uses TOKEN, given as a flag).
FILE_TOKEN: Final = "iop-e2e-reload-file-token"

STREAMS: Final = 32
RELOADS: Final = 20
# 200 tokens at 10 a second: each stream generates for 20 s, longer than the
# reloads take; the test checks that every stream was still live after them.
LONG: Final = {"iop_sim": {"output_tokens": 200, "tokens_per_s": 10.0}}
# Until a stream's client says otherwise: a stream held open for one check.
HELD: Final = {"iop_sim": {"output_tokens": 40, "tokens_per_s": 20.0}}


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


BASE: Final[dict[str, Any]] = {
    "server": {
        "keepalive_interval_s": 0.5,
        "max_body_bytes": 256 * 1024,
        "api_keys": [OPERATOR],
        "admin_keys": [ADMIN],
    },
    "link": {"node_tokens": [FILE_TOKEN]},
    "scheduler": {"max_queue": 128, "load_weight": 1.0},
    "tenants": [
        {"name": "alice", "key_sha256": [_digest(KEY_ALICE)], "requests_per_minute": 1000},
        {"name": "bob", "key_sha256": [_digest(KEY_BOB)]},
    ],
}


def _node_config(sim_url: str, link_url: str, **instance: Any) -> dict[str, Any]:
    return {
        "node": {
            "id": "n1",
            "reconnect_min_s": 0.1,
            "reconnect_max_s": 1.0,
            "edges": [{"url": link_url, "token": TOKEN}],
        },
        "instances": [
            {
                "adapter": "vllm",
                "name": "vllm-sim",
                "endpoint": sim_url,
                "max_concurrency": 64,
                **instance,
            }
        ],
    }


@dataclass
class Setup:
    sim: Sim
    edge: Edge
    edge_file: Path
    node: Node
    node_file: Path
    node_base: dict[str, Any]

    def write_edge(self, config: dict[str, Any]) -> None:
        self.edge_file.write_text(toml_dumps(config))

    def write_node(self, config: dict[str, Any]) -> None:
        self.node_file.write_text(toml_dumps(config))


@pytest.fixture(scope="module")
def setup(sim: Sim, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    edge_dir = tmp_path_factory.mktemp("edge")
    edge = start_edge(edge_dir, BASE)
    node_dir = tmp_path_factory.mktemp("node")
    try:
        node = start_node(node_dir, [edge.link_url], sim.url, instance={"max_concurrency": 64})
        try:
            edge.wait_ready(node_id=node.node_id)
            yield Setup(
                sim,
                edge,
                edge_dir / "edge.toml",
                node,
                node_dir / "node.toml",
                _node_config(sim.url, edge.link_url),
            )
        finally:
            node.proc.stop()
    finally:
        edge.close()
        edge.proc.stop()


@pytest.fixture
def s(setup: Setup) -> Iterator[Setup]:
    """The module's processes, each test starting from the base files (and
    leaving them so)."""
    for proc in (setup.sim.proc, setup.edge.proc, setup.node.proc):
        assert proc.alive, f"{proc.name} died\n{proc.logs()}"
    setup.sim.wait_idle()
    yield setup
    setup.write_edge(BASE)
    setup.write_node(setup.node_base)
    reply = reload_edge(setup.edge)
    assert reply.status_code == 200, reply.text
    setup.node.proc.send(signal.SIGHUP)
    setup.edge.wait_ready(node_id="n1")


def reload_edge(edge: Edge) -> httpx.Response:
    return edge.post("/admin/reload", headers=ADMIN_HEADERS)


def admin(edge: Edge) -> dict[str, Any]:
    r = httpx.get(f"{edge.url}/admin/nodes", headers=ADMIN_HEADERS, trust_env=False)
    r.raise_for_status()
    data: dict[str, Any] = r.json()
    return data


def _body(model: str = MODEL, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
        **extra,
    }


def node_reloads(node: Node) -> int:
    return len(re.findall(r"reload \(SIGHUP\): ", node.proc.stderr()))


@dataclass
class Streamed:
    """What one SSE stream delivered: its chunks' content and how it ended."""

    chunks: int = 0
    content: str = ""
    finish_reason: str | None = None
    done: bool = False  # data: [DONE] arrived
    error: str | None = None


async def _stream(
    client: httpx.AsyncClient,
    key: str,
    body: dict[str, Any],
    out: Streamed,
    opened: trio.Semaphore | None,
    go_on: trio.Event,
) -> None:
    """Read one chunk, say so, wait for ``go_on``, then read the stream to its end."""
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        said = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                out.done = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                out.error = json.dumps(chunk["error"])
                continue
            out.chunks += 1
            for choice in chunk["choices"]:
                out.content += (choice.get("delta") or {}).get("content") or ""
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
            if not said:
                said = True
                if opened is not None:
                    opened.release()
                await go_on.wait()


def _client(edge: Edge) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=edge.url, timeout=60, trust_env=False)


def _variant(i: int) -> dict[str, Any]:
    """The base edge file with the i-th set of live changes: alice's limits,
    a scheduler weight, and every other time a tenant more."""
    cfg = copy.deepcopy(BASE)
    cfg["tenants"][0]["requests_per_minute"] = 1000 + i
    cfg["tenants"][0]["tokens_per_minute"] = 0 if i % 3 else 10_000_000
    cfg["scheduler"]["load_weight"] = 1.0 + i / 10
    if i % 2:
        cfg["tenants"].append(
            {"name": f"extra-{i}", "key_sha256": [_digest(f"iop-e2e-extra-key-{i}")]}
        )
    return cfg


async def test_twenty_reloads_while_32_streams_run_drop_none(s: Setup) -> None:
    """Edge reloads (tenants, limits, weights) and node reloads (the streams'
    own instance replaced) while 32 streams run: each ends as it would have."""
    results = [Streamed() for _ in range(STREAMS)]
    opened = trio.Semaphore(0)
    go_on = trio.Event()
    node_before = node_reloads(s.node)
    async with _client(s.edge) as client, trio.open_nursery() as nursery:
        for out in results:
            nursery.start_soon(_stream, client, KEY_ALICE, _body(**LONG), out, opened, go_on)
        with trio.fail_after(60):
            for _ in range(STREAMS):
                await opened.acquire()
        node_sent = 0
        for i in range(RELOADS):
            s.write_edge(_variant(i + 1))
            r = await client.post("/admin/reload", headers=ADMIN_HEADERS)
            assert r.status_code == 200, r.text
            reply = r.json()
            assert reply["status"] == "applied", reply
            assert reply["restart_required"] == [], reply
            assert "tenants[alice].requests_per_minute" in reply["applied"], reply
            if i % 5 == 4:
                # The node's instance of all 32 streams gets a new adapter: the
                # old one serves them to their end.
                s.write_node(_node_config(s.sim.url, s.edge.link_url, max_queue=100 + i))
                s.node.proc.send(signal.SIGHUP)
                node_sent += 1
                with trio.fail_after(30):
                    while node_reloads(s.node) < node_before + node_sent:
                        await trio.sleep(0.05)
        # Every stream was still running when the last reload was done.
        live = (await client.get("/admin/nodes", headers=ADMIN_HEADERS)).json()["runs"]
        assert len(live) == STREAMS, live
        go_on.set()
    for out in results:
        assert out.error is None, out
        assert out.finish_reason == "stop", out
        assert out.done, out
    assert len({len(out.content) for out in results}) == 1  # all whole, none cut short
    tenants = {t["name"]: t for t in admin(s.edge)["tenants"]}
    assert tenants["alice"]["running"] == 0
    assert tenants["alice"]["limits"]["requests"]["limit"] == 1000 + RELOADS
    assert "applied" in s.node.proc.stderr()
    assert "crashed" not in s.edge.proc.stderr() + s.node.proc.stderr()


async def test_a_revoked_key_is_refused_after_one_reload_while_its_stream_finishes(
    s: Setup,
) -> None:
    held = Streamed()
    opened = trio.Semaphore(0)
    go_on = trio.Event()
    async with _client(s.edge) as client, trio.open_nursery() as nursery:
        nursery.start_soon(_stream, client, KEY_BOB, _body(**HELD), held, opened, go_on)
        with trio.fail_after(30):
            await opened.acquire()
        cfg = copy.deepcopy(BASE)
        del cfg["tenants"][1]  # bob
        cfg["tenants"][0]["key_sha256"].append(_digest(KEY_ALICE_2))
        s.write_edge(cfg)
        r = await client.post("/admin/reload", headers=ADMIN_HEADERS)
        assert r.status_code == 200, r.text
        reply = r.json()
        assert reply["status"] == "applied"
        assert "tenants[bob] (removed)" in reply["applied"]
        assert "tenants[alice].key_sha256" in reply["applied"]
        # bob's next request: 401; alice's new key works at once.
        again = await client.post(
            "/v1/chat/completions",
            json=_body(stream=False),
            headers={"Authorization": f"Bearer {KEY_BOB}"},
        )
        assert again.status_code == 401, again.text
        assert again.json()["error"]["code"] == "invalid_api_key"
        new = await client.post(
            "/v1/chat/completions",
            json=_body(stream=False),
            headers={"Authorization": f"Bearer {KEY_ALICE_2}"},
        )
        assert new.status_code == 200, new.text
        go_on.set()
    assert held.error is None, held
    assert held.finish_reason == "stop", held
    assert held.done, held


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[server\napi_keys = 1\n", r"not valid TOML"),
        (
            '[server]\napi_keys = ["iop-e2e-reload-operator"]\nbogus = 1\n',
            r"unknown key 'server\.bogus'",
        ),
        ("[scheduler]\nmax_queue = -1\n", r"max_queue must be >= 0"),
    ],
    ids=["syntax", "unknown-key", "invalid-value"],
)
def test_a_bad_file_changes_nothing_and_says_why(s: Setup, text: str, reason: str) -> None:
    before = admin(s.edge)["routing"]
    s.edge_file.write_text(text)
    r = reload_edge(s.edge)
    assert r.status_code == 422, r.text
    reply = r.json()
    assert reply["status"] == "refused"
    assert re.search(reason, reply["error"]), reply
    assert reply["applied"] == []
    assert reply["restart_required"] == []
    s.edge.proc.wait_stderr(r"reload \(POST /admin/reload[^)]*\): refused: .*" + reason, 10)
    # SIGHUP: the same file, the same refusal in the log, and the edge lives on.
    s.edge.proc.send(signal.SIGHUP)
    s.edge.proc.wait_stderr(r"reload \(SIGHUP\): refused: .*" + reason, timeout=10)
    # The old config serves: the keys and the scheduler's settings as they were.
    assert admin(s.edge)["routing"] == before
    with httpx.Client(base_url=s.edge.url, timeout=30, trust_env=False) as c:
        for key in (KEY_ALICE, KEY_BOB):
            ok = c.post(
                "/v1/chat/completions",
                json=_body(stream=False),
                headers={"Authorization": f"Bearer {key}"},
            )
            assert ok.status_code == 200, ok.text


def test_a_key_that_needs_a_restart_is_named_and_not_applied(s: Setup) -> None:
    cfg = copy.deepcopy(BASE)
    cfg["server"]["max_body_bytes"] = 64 * 1024
    cfg["scheduler"]["load_weight"] = 2.5
    s.write_edge(cfg)
    # `iop reload` calls POST /admin/reload and prints the reply.
    done = subprocess.run(
        [sys.executable, "-m", "iop", "reload", "--url", s.edge.url, "--key", ADMIN],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    reply = json.loads(done.stdout)
    assert reply["status"] == "applied"
    assert reply["restart_required"] == ["server.max_body_bytes"]
    assert reply["applied"] == ["scheduler.load_weight"]
    assert admin(s.edge)["routing"]["load_weight"] == 2.5
    s.edge.proc.wait_stderr(r"restart: server\.max_body_bytes", timeout=10)
    # The running limit is still the old one (256 KiB): 100 KiB is taken.
    big = _body(stream=False, messages=[{"role": "user", "content": "x" * 100_000}])
    with httpx.Client(base_url=s.edge.url, timeout=30, trust_env=False) as c:
        r = c.post(
            "/v1/chat/completions", json=big, headers={"Authorization": f"Bearer {KEY_ALICE}"}
        )
        assert r.status_code == 200, r.text


def test_an_instance_added_to_the_nodes_file_serves_after_its_reload(s: Setup) -> None:
    cfg = copy.deepcopy(s.node_base)
    cfg["instances"].append(
        {"adapter": "sim", "name": "extra", "sim": {"model": "reload-extra", "output_tokens": 4}}
    )
    s.write_node(cfg)
    done = subprocess.run(
        [sys.executable, "-m", "iop", "reload", "--pid", str(s.node.proc.pid)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    s.node.proc.wait_stderr(r"reload \(SIGHUP\): applied .*instances\[extra\] \(added\)", 10)
    s.edge.wait_ready(model="reload-extra", node_id="n1")
    with httpx.Client(base_url=s.edge.url, timeout=30, trust_env=False) as c:
        r = c.post(
            "/v1/chat/completions",
            json=_body("reload-extra", stream=False),
            headers={"Authorization": f"Bearer {KEY_ALICE}"},
        )
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "reload-extra"
    # And taken out again, it is no longer listed.
    s.write_node(s.node_base)
    s.node.proc.send(signal.SIGHUP)
    poll(
        lambda: "reload-extra" not in [m["id"] for m in s.edge.get("/v1/models").json()["data"]],
        timeout=10,
        what="the removed instance's model to leave /v1/models",
    )


def test_a_revoked_node_token_refuses_that_nodes_next_dial(s: Setup, procs: Procs) -> None:
    n2 = procs.node([s.edge], s.sim, name="n2", node_id="n2", token=FILE_TOKEN)
    s.edge.wait_ready(node_id="n2")
    cfg = copy.deepcopy(BASE)
    cfg["link"]["node_tokens"] = []  # the flag's TOKEN stays
    s.write_edge(cfg)
    r = reload_edge(s.edge)
    assert r.status_code == 200, r.text
    assert r.json()["applied"] == ["link.node_tokens"]
    # Its live link is closed at once (a revoked token is cut off, not left
    # connected), and its next dial is refused.
    s.edge.proc.wait_stderr(r"node n2: credential \S+ revoked: closing its link", timeout=10)
    n2.proc.wait_stderr(r"refused node n2", timeout=20)
    s.edge.proc.wait_stderr(r"refusing node from .*token", timeout=10)
    assert "n2" not in [n["id"] for n in admin(s.edge)["nodes"]]
    # The nodes on the token that stays keep their links.
    assert "n1" in [n["id"] for n in admin(s.edge)["nodes"]]


def test_iop_up_reloads_its_edge_and_its_instances(tmp_path: Path) -> None:
    """One file, one reload: the edge's keys and the node's instances of ``iop up``."""
    config: dict[str, Any] = {
        "edge": {"server": {"api_keys": [KEY_ALICE], "admin_keys": [ADMIN]}},
        "instances": [{"adapter": "sim", "name": "one", "sim": {"output_tokens": 4}}],
    }
    path = tmp_path / "up.toml"
    path.write_text(toml_dumps(config))
    proc = Proc("iop-up", ["up", "--port", "0", "--config", str(path)], tmp_path)
    try:
        url = proc.wait_stdout(UP_READY).group(1)
        config["edge"]["server"]["api_keys"] = [KEY_BOB]
        config["instances"].append(
            {"adapter": "sim", "name": "two", "sim": {"model": "reload-two", "output_tokens": 4}}
        )
        path.write_text(toml_dumps(config))
        with httpx.Client(base_url=url, timeout=30, trust_env=False) as c:
            r = c.post("/admin/reload", headers=ADMIN_HEADERS)
            assert r.status_code == 200, r.text
            assert r.json()["applied"] == ["edge.server.api_keys", "instances[two] (added)"]
            bob = {"Authorization": f"Bearer {KEY_BOB}"}
            poll(
                lambda: (
                    "reload-two"
                    in [m["id"] for m in c.get("/v1/models", headers=bob).json()["data"]]
                ),
                timeout=10,
                what="the added instance's model to be listed",
            )
            ok = c.post("/v1/chat/completions", json=_body("reload-two", stream=False), headers=bob)
            assert ok.status_code == 200, ok.text
            gone = c.post(
                "/v1/chat/completions",
                json=_body(stream=False),
                headers={"Authorization": f"Bearer {KEY_ALICE}"},
            )
            assert gone.status_code == 401, gone.text
    finally:
        assert proc.stop() == 0, proc.logs()
