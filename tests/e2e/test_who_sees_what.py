"""Who sees what on an edge with client keys: real ``iop edge`` processes, httpx.

A client key (a tenant's, or one of ``server.api_keys``) opens the API and
nothing of the operator's: the admin views (``/admin*``, which list every
tenant's runs, their timelines and run ids, and the Drain buttons) need a key
of ``server.admin_keys``, and without one they are off, saying how to turn
them on; ``/metrics`` (every tenant's name and usage) needs a key of
``server.metrics_keys`` or an admin key. An edge with no key at all keeps
both open (the local ``iop up`` default). No metric label takes a value a
client chose. docs/operations.md, "Tenants and limits" ("Who sees what").
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import pytest

from tests.e2e._platform import MODEL, Cluster, Edge, start_edge

KEY_A: Final = "iop-who-team-a"
KEY_B: Final = "iop-who-team-b"
KEY_C: Final = "iop-who-team-c"
API_KEY: Final = "iop-who-api-key"
ADMIN_KEY: Final = "iop-who-admin"
METRICS_KEY: Final = "iop-who-metrics"
# A run id no edge ever made: the admin route answers before it looks.
RUN_ID: Final = "0123456789abcdef0123456789abcdef"

ADMIN_GETS: Final = ("/admin", "/admin/nodes", "/admin/runs", f"/admin/runs/{RUN_ID}")
ADMIN_POSTS: Final = ("/admin/nodes/n1/drain", "/admin/nodes/n1/undrain")

pytestmark = pytest.mark.timeout(120)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


TENANTS: Final[list[dict[str, Any]]] = [
    {"name": "team-a", "key_sha256": [_digest(KEY_A)]},
    # May use a model no node serves: MODEL is one it may not.
    {"name": "team-b", "key_sha256": [_digest(KEY_B)], "models": ["not-served"]},
    {"name": "team-c", "key_sha256": [_digest(KEY_C)], "requests_per_minute": 1},
]

EDGE_CONFIG: dict[str, Any] = {
    "server": {
        "keepalive_interval_s": 0.5,
        # The fixtures' own key (the tenant "default"): /v1/models while they wait.
        "api_keys": [API_KEY],
        "admin_keys": [ADMIN_KEY],
        "metrics_keys": [METRICS_KEY],
        # The tests present dozens of wrong admin keys on purpose: no brake.
        "admin_login_failures_per_minute": 1000,
    },
    "tenants": TENANTS,
}


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.fixture
def http(edge: Edge) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=edge.url, timeout=30, trust_env=False) as c:
        yield c


def _refused_json(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, (r.request.url, r.text)
    error = r.json()["error"]
    assert error["code"] == code, (r.request.url, error)
    message: str = error["message"]
    return message


# A refusal sent before the request's body was read ends its connection:
# such requests go on a connection of their own, never one reused after.
ONE_SHOT: Final = {"Connection": "close"}


def _every_admin_request(c: httpx.Client, key: str | None) -> list[httpx.Response]:
    """Every admin JSON route as a script asks it: GETs and JSON POSTs, with ``key``."""
    out = [c.get(path, headers=bearer(key)) for path in ADMIN_GETS[1:]]
    out += [
        c.post(path, headers={**bearer(key), **ONE_SHOT}, json={"reason": "x"})
        for path in ADMIN_POSTS
    ]
    return out


# --- no admin key, client keys: the admin views are off ---------------------------------


@pytest.mark.parametrize(
    ("server", "client_key"),
    [({}, KEY_A), ({"api_keys": [API_KEY]}, API_KEY)],
    ids=["tenants", "api-keys"],
)
def test_client_keys_without_admin_keys_turn_the_admin_views_off(
    tmp_path: Path, server: dict[str, Any], client_key: str
) -> None:
    config: dict[str, Any] = {"server": server}
    if not server:
        config["tenants"] = TENANTS
    edge = start_edge(tmp_path, config)
    try:
        with httpx.Client(base_url=edge.url, timeout=30, trust_env=False) as c:
            for key in (None, client_key, "iop-a-guess"):
                for r in _every_admin_request(c, key):
                    message = _refused_json(r, 403, "admin_disabled")
                    assert "server.admin_keys" in message
            # A browser gets a page that says the same, not a login form.
            for key in (None, client_key):
                page = c.get("/admin", headers={**bearer(key), "Accept": "text/html"})
                assert page.status_code == 403
                assert "server.admin_keys" in page.text
                assert "name='key'" not in page.text
            run_page = c.get(f"/admin/runs/{RUN_ID}", headers={"Accept": "text/html"})
            assert run_page.status_code == 403
            assert "server.admin_keys" in run_page.text
            login = c.post("/admin/login", data={"key": client_key})
            assert login.status_code == 403
            assert "iop_admin" not in login.headers.get("set-cookie", "")
            form = c.post(ADMIN_POSTS[0], data={"reason": "x"}, headers=ONE_SHOT)
            assert form.status_code == 403
            # The same for /metrics, which names every tenant.
            for key in (None, client_key):
                message = _refused_json(
                    c.get("/metrics", headers=bearer(key)), 403, "metrics_disabled"
                )
                assert "server.metrics_keys" in message
        # Said once at start-up, with the key that turns them on.
        edge.proc.wait_stderr(r"admin views are off.*server\.admin_keys", 5)
        edge.proc.wait_stderr(r"/metrics is off.*server\.metrics_keys", 5)
    finally:
        edge.close()
        edge.proc.stop()


def test_an_edge_without_any_key_keeps_its_admin_and_metrics_open(tmp_path: Path) -> None:
    """The local default (``iop up``, an edge on loopback): nothing to log in to."""
    edge = start_edge(tmp_path, {"server": {}})
    try:
        with httpx.Client(base_url=edge.url, timeout=30, trust_env=False) as c:
            assert c.get("/admin/nodes").status_code == 200
            assert c.get("/admin", headers={"Accept": "text/html"}).status_code == 200
            assert c.get("/metrics").status_code == 200
    finally:
        edge.close()
        edge.proc.stop()
    assert "admin views are off" not in edge.proc.stderr()


# --- admin and metrics keys set ---------------------------------------------------------


def test_a_tenants_key_never_opens_the_admin_views(http: httpx.Client) -> None:
    for key in (KEY_A, KEY_B, API_KEY, METRICS_KEY, None):
        for r in _every_admin_request(http, key):
            _refused_json(r, 401, "invalid_api_key")
        page = http.get("/admin", headers=bearer(key))
        assert page.status_code == 401
        assert "name='key'" in page.text  # the login form, nothing of the edge
        login = http.post("/admin/login", data={"key": key or "x"})
        assert login.status_code == 401
        assert "Wrong key." in login.text
        assert "iop_admin" not in login.headers.get("set-cookie", "")
    # The operator's key does.
    assert http.get("/admin/nodes", headers=bearer(ADMIN_KEY)).status_code == 200
    assert http.get("/admin/runs", headers=bearer(ADMIN_KEY)).status_code == 200


def test_metrics_need_a_metrics_or_admin_key(http: httpx.Client) -> None:
    for key in (None, KEY_A, API_KEY, "iop-a-guess"):
        _refused_json(http.get("/metrics", headers=bearer(key)), 401, "invalid_api_key")
    for key in (METRICS_KEY, ADMIN_KEY):
        r = http.get("/metrics", headers=bearer(key))
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain")
        assert "iop_runs_in_flight" in r.text


def _labels(text: str, name: str) -> set[str]:
    return set(re.findall(rf'\b{name}="((?:[^"\\]|\\.)*)"', text))


def test_no_metric_label_takes_a_value_a_client_chose(cluster: Cluster) -> None:
    """Unknown models, a model the tenant may not use, a wrong key, user
    fields: none of it becomes a label value; tenants are the config's."""
    marker = "client-chose-this"
    with httpx.Client(base_url=cluster.edge.url, timeout=30, trust_env=False) as c:

        def chat(key: str, model: str, **extra: Any) -> httpx.Response:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
            return c.post("/v1/chat/completions", json=body, headers=bearer(key))

        assert chat(KEY_A, f"{marker}-model").status_code == 404
        assert chat(KEY_A, f'{marker}"}} 1\nfake_metric{{a="').status_code == 404
        assert chat(KEY_B, MODEL).status_code == 404  # a model team-b may not use
        assert chat(f"{marker}-key", MODEL).status_code == 401
        done = chat(KEY_A, MODEL, user=f"{marker}-user", metadata={"who": f"{marker}-meta"})
        assert done.status_code == 200, done.text
        count = c.post(
            "/v1/messages/count_tokens",
            json={"model": f"{marker}-model", "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-api-key": KEY_A, "anthropic-version": "2023-06-01"},
        )
        assert count.status_code == 404
        cluster.edge.wait_no_runs()
        text = c.get("/metrics", headers=bearer(METRICS_KEY)).text
    assert marker not in text
    assert "fake_metric" not in text
    assert _labels(text, "tenant") == {"team-a"}
    assert _labels(text, "model") == {MODEL}


def test_count_tokens_is_a_request_of_its_tenant(cluster: Cluster) -> None:
    """A token count is a run on a node: it takes a request of its tenant's
    limit and a place of its tenant's in the queue, never a free one beside
    them; the tokens it counts are not charged."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count me"}]}
    headers = {"x-api-key": KEY_C, "anthropic-version": "2023-06-01"}
    with httpx.Client(base_url=cluster.edge.url, timeout=30, trust_env=False) as c:
        first = c.post("/v1/messages/count_tokens", json=body, headers=headers)
        assert first.status_code == 200, first.text
        assert first.json()["input_tokens"] > 0
        assert first.headers["anthropic-ratelimit-requests-limit"] == "1"
        second = c.post("/v1/messages/count_tokens", json=body, headers=headers)
        assert second.status_code == 429, second.text
        assert second.json()["error"]["type"] == "rate_limit_error"
        assert int(second.headers["retry-after"]) >= 1
        cluster.edge.wait_no_runs()
        admin = bearer(ADMIN_KEY)
        runs = c.get("/admin/runs", headers=admin).json()["recent"]
        (counted,) = [r for r in runs if r["tenant"] == "team-c"]
        timeline = c.get(f"/admin/runs/{counted['run_id']}", headers=admin).json()
        assert timeline["operation"] == "tokenize"
    tenants = {t["name"]: t for t in cluster.edge.admin()["tenants"]}
    assert tenants["team-c"]["admitted"] == 1
    assert tenants["team-c"]["refused"] == 1
    assert tenants["team-c"]["running"] == 0
    assert tenants["team-c"]["tokens_in"] == 0
