"""The operator's controls of on-demand models, end to end (docs/operations.md,
"Operator controls"): ``iop edge`` with admin and client keys, ``iop node``
with sim models, the admin API and ``iop models`` through real processes,
and what ``/metrics`` counts of it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import httpx
import pytest

from tests.e2e._platform import Edge, Node, Procs, Sim, poll

pytestmark = pytest.mark.slow

API_KEY = "sk-client-0123456789"
ADMIN_KEY = "sk-admin-0123456789"
EDGE_CONFIG: dict[str, Any] = {
    "server": {"keepalive_interval_s": 0.5, "api_keys": [API_KEY], "admin_keys": [ADMIN_KEY]},
}
# Three sim models of 100 MiB, room for two: the third evicts one.
MODELS = [
    {"name": name, "engine": "sim", "sim": {"load_time_s": 0.2, "memory_mib": 100}}
    for name in ("m-a", "m-b", "m-c")
]
# Loads for longer than any test waits: what "loading" looks like.
SLOW = {"name": "m-slow", "engine": "sim", "sim": {"load_time_s": 600.0, "memory_mib": 50}}
# A command that exits at once: its load fails, with a reason and a retry time.
BROKEN = {
    "name": "m-broken",
    "engine": "vllm",
    "memory_mib": 10,
    "command": [sys.executable, "-c", "raise SystemExit(3)", "{port}"],
    "ready_timeout_s": 30.0,
}
NODE = {"memory_mib": 200, "model_retry_min_s": 300.0, "model_retry_max_s": 600.0}


def start(procs: Procs, sim: Sim, *more: dict[str, Any]) -> tuple[Edge, Node]:
    edge = procs.edge(EDGE_CONFIG)
    node = procs.node([edge], sim, node_id="n1", node=NODE, models=[*MODELS, BROKEN, *more])
    wait_joined(edge)
    return edge, node


def wait_joined(edge: Edge, node_id: str = "n1") -> None:
    poll(
        lambda: any(n["id"] == node_id and n["models"] for n in edge.admin()["nodes"]),
        timeout=20.0,
        what=f"node {node_id} to join with its models",
    )


def admin_post(edge: Edge, path: str, key: str | None = ADMIN_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=edge.url, trust_env=False, timeout=30.0) as client:
        return client.post(path, headers=headers)


def node_view(edge: Edge, node_id: str = "n1") -> dict[str, Any]:
    return next(n for n in edge.admin()["nodes"] if n["id"] == node_id)


def model_view(edge: Edge, model: str, node_id: str = "n1") -> dict[str, Any]:
    return next(m for m in node_view(edge, node_id)["models"] if m["model"] == model)


def wait_state(edge: Edge, model: str, state: str, node_id: str = "n1") -> dict[str, Any]:
    return poll(
        lambda: (m := model_view(edge, model, node_id))["state"] == state and m,
        timeout=20.0,
        what=f"model {model} on {node_id} to be {state}",
    )


def metrics(edge: Edge) -> str:
    return edge.admin_get("/metrics").text


def sample(text: str, name: str, model: str) -> float:
    m = re.search(rf'^{name}\{{model="{re.escape(model)}"\}} (\S+)$', text, re.M)
    assert m is not None, f"no {name} for {model}"
    return float(m.group(1))


def test_admin_loads_evicts_pins_and_unloads_models(procs: Procs, sim: Sim) -> None:
    edge, _ = start(procs, sim)
    view = node_view(edge)
    assert view["controls"] is True
    assert view["memory_mib"] == {"used": 0, "budget": 200}
    assert {m["model"]: m["state"] for m in view["models"]} == {
        "m-a": "cold",
        "m-b": "cold",
        "m-c": "cold",
        "m-broken": "cold",
    }

    # Only an admin key opens it: none, or a client's, is a 401.
    assert admin_post(edge, "/admin/nodes/n1/models/m-a/load", key=None).status_code == 401
    assert admin_post(edge, "/admin/nodes/n1/models/m-a/load", key=API_KEY).status_code == 401
    assert model_view(edge, "m-a")["state"] == "cold"

    resp = admin_post(edge, "/admin/nodes/n1/models/m-a/load")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert (body["node"], body["model"], body["action"]) == ("n1", "m-a", "load")
    assert body["state"]["state"] in ("loading", "ready")
    wait_state(edge, "m-a", "ready")
    assert admin_post(edge, "/admin/nodes/n1/models/m-b/load").status_code == 200
    wait_state(edge, "m-b", "ready")
    assert node_view(edge)["memory_mib"] == {"used": 200, "budget": 200}

    # A third evicts the least recently used (m-a).
    assert admin_post(edge, "/admin/nodes/n1/models/m-c/load").status_code == 200
    wait_state(edge, "m-c", "ready")
    wait_state(edge, "m-a", "cold")

    # Pinned, m-b and m-c stay: a load of m-a is refused, naming them.
    for model in ("m-b", "m-c"):
        resp = admin_post(edge, f"/admin/nodes/n1/models/{model}/pin")
        assert resp.status_code == 200, resp.text
        assert resp.json()["state"]["pinned"] is True
    resp = admin_post(edge, "/admin/nodes/n1/models/m-a/load")
    assert resp.status_code == 409
    error = resp.json()["error"]
    assert error["code"] == "model_load_refused"
    assert "m-b (pinned)" in error["message"]
    assert "m-c (pinned)" in error["message"]
    # A pinned model is not unloaded: unpin it first.
    resp = admin_post(edge, "/admin/nodes/n1/models/m-b/unload")
    assert resp.status_code == 409
    assert resp.json()["error"]["code"] == "model_pinned"
    assert admin_post(edge, "/admin/nodes/n1/models/m-b/unpin").json()["state"]["pinned"] is False
    resp = admin_post(edge, "/admin/nodes/n1/models/m-b/unload")
    assert resp.status_code == 200, resp.text
    assert wait_state(edge, "m-b", "cold")["pinned"] is False
    assert node_view(edge)["memory_mib"]["used"] == 100

    # Who and what does not exist.
    resp = admin_post(edge, "/admin/nodes/n1/models/nope/load")
    assert (resp.status_code, resp.json()["error"]["code"]) == (404, "model_not_found")
    resp = admin_post(edge, "/admin/nodes/n9/models/m-a/load")
    assert (resp.status_code, resp.json()["error"]["code"]) == (404, "node_not_found")

    # The page's buttons post forms: answered with the page; refused from another site.
    with httpx.Client(base_url=edge.url, trust_env=False, timeout=30.0) as client:
        form = {"Authorization": f"Bearer {ADMIN_KEY}"}
        resp = client.post(
            "/admin/nodes/n1/models/m-c/unpin",
            headers={**form, "Origin": "https://evil.example"},
            data={},
        )
        assert (resp.status_code, resp.json()["error"]["code"]) == (403, "cross_origin")
        assert model_view(edge, "m-c")["pinned"] is True
        resp = client.post(
            "/admin/nodes/n1/models/m-c/unpin", headers={**form, "Origin": edge.url}, data={"x": ""}
        )
        assert (resp.status_code, resp.headers["Location"]) == (303, "/admin")
        assert model_view(edge, "m-c")["pinned"] is False
        assert client.post("/admin/nodes/n1/models/m-c/pin", headers=form).status_code == 200

    # The page shows them, with their buttons.
    page = httpx.get(
        f"{edge.url}/admin",
        headers={"Authorization": f"Bearer {ADMIN_KEY}", "Accept": "text/html"},
        trust_env=False,
    ).text
    assert "On-demand models" in page
    assert "/admin/nodes/n1/models/m-c/unpin" in page
    assert "/admin/nodes/n1/models/m-a/load" in page
    assert "100 / 200 MiB" in page

    # The metrics count the loads and the eviction, per configured model.
    text = metrics(edge)
    assert sample(text, "iop_model_loads_total", "m-a") == 1
    assert sample(text, "iop_model_loads_total", "m-c") == 1
    assert sample(text, "iop_model_evictions_total", "m-a") == 1
    assert sample(text, "iop_model_load_seconds_count", "m-b") == 1


def test_loading_and_failed_models_say_how_long_and_why(procs: Procs, sim: Sim) -> None:
    edge = procs.edge(EDGE_CONFIG)
    procs.node([edge], sim, node_id="n1", node=NODE, models=[SLOW, BROKEN])
    wait_joined(edge)
    assert admin_post(edge, "/admin/nodes/n1/models/m-slow/load").status_code == 200
    first = wait_state(edge, "m-slow", "loading")["loading_for_s"]
    poll(
        lambda: model_view(edge, "m-slow")["loading_for_s"] > first,
        timeout=10.0,
        what="the loading time to grow",
    )
    assert node_view(edge)["memory_mib"] == {"used": 50, "budget": 200}

    assert admin_post(edge, "/admin/nodes/n1/models/m-broken/load").status_code == 200
    failed = wait_state(edge, "m-broken", "failed")
    assert failed["detail"]
    assert 0 < failed["retry_in_s"] <= 300
    # Within its backoff a load is refused with the failure's reason.
    resp = admin_post(edge, "/admin/nodes/n1/models/m-broken/load")
    assert resp.status_code == 409
    assert resp.json()["error"]["code"] == "model_load_failed"
    assert sample(metrics(edge), "iop_model_load_failures_total", "m-broken") == 1


# Loads long enough for a run to come while it loads.
LAZY = {"name": "m-lazy", "engine": "sim", "sim": {"load_time_s": 8.0, "memory_mib": 10}}


def test_metrics_name_only_the_configured_models(procs: Procs, sim: Sim) -> None:
    edge, _ = start(procs, sim, LAZY)
    assert admin_post(edge, "/admin/nodes/n1/models/m-lazy/load").status_code == 200
    # Loading, its instance takes runs (they wait on the node for the load).
    edge.wait_ready(model="m-lazy", node_id="n1")
    assert model_view(edge, "m-lazy")["state"] == "loading"
    with edge.openai() as client:
        # A run that finds it loading is a cold start: it waits for the load.
        reply = client.chat.completions.create(
            model="m-lazy", messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.choices[0].message.content
        # A name no node offers is refused and names no series.
        with pytest.raises(Exception, match="model"):
            client.chat.completions.create(
                model="client-made-up", messages=[{"role": "user", "content": "hi"}]
            )
    text = poll(
        lambda: (
            (t := metrics(edge)) and 'iop_model_cold_starts_total{model="m-lazy"} 1.0' in t and t
        ),
        timeout=10.0,
        what="the cold start to be counted",
    )
    for family in ("loads", "load_failures", "evictions", "cold_starts"):
        names = re.findall(rf'^iop_model_{family}_total\{{model="([^"]*)"\}}', text, re.M)
        assert sorted(names) == ["m-a", "m-b", "m-broken", "m-c", "m-lazy"], family
    assert "client-made-up" not in text
    assert re.search(r'^iop_model_nodes\{model="m-lazy",state="ready"\} 1\.0$', text, re.M)


# --- `iop models`, through a real subprocess ---------------------------------------------


def iop(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "iop", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_iop_models_lists_loads_pins_and_unloads(procs: Procs, sim: Sim) -> None:
    edge, _ = start(procs, sim)
    where = ["--url", edge.url, "--key", ADMIN_KEY]
    out = iop("models", "list", *where)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^n1\s+m-a\s+cold\s+100 MiB", out.stdout, re.M), out.stdout
    assert "memory 0 / 200 MiB" in out.stdout

    out = iop("models", "load", "n1", "m-a", "--wait", *where)
    assert out.returncode == 0, out.stderr
    assert "m-a on n1: ready" in out.stdout
    assert model_view(edge, "m-a")["state"] == "ready"

    out = iop("models", "pin", "n1", "m-a", *where)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["state"]["pinned"] is True
    out = iop("models", "unload", "n1", "m-a", *where)
    assert out.returncode == 1
    assert "model_pinned" in out.stderr
    assert iop("models", "unpin", "n1", "m-a", *where).returncode == 0
    assert iop("models", "unload", "n1", "m-a", *where).returncode == 0
    wait_state(edge, "m-a", "cold")

    out = iop("models", "list", "--format", "json", *where)
    assert out.returncode == 0, out.stderr
    [node] = json.loads(out.stdout)
    assert node["id"] == "n1"
    assert {m["model"] for m in node["models"]} == {"m-a", "m-b", "m-c", "m-broken"}

    # A wrong key is refused and said so; the key itself is never printed.
    out = iop("models", "load", "n1", "m-a", "--url", edge.url, "--key", "sk-wrong-key-xyz")
    assert out.returncode == 1
    assert "401" in out.stderr
    assert "sk-wrong-key-xyz" not in out.stderr + out.stdout
