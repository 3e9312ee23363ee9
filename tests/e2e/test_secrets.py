"""Secrets never leave a process: the node token, client API keys, admin and
metrics keys and instance header values appear in no log line (at debug level), no response body, and
neither in ``/admin``, ``/admin/nodes`` nor ``/metrics``.

Real processes: two ``iop sim`` backends whose ``http_401`` failure echoes the
``Authorization`` header they got (as OpenAI-compatible servers do with a key
they refuse), an ``iop edge`` with client API keys, and an ``iop node`` whose
instances send a Bearer and a Basic credential, both at ``--log-level debug``.
Every secret is a unique marker; the test greps for it and its base64 forms.
"""

from __future__ import annotations

import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from tests.e2e._platform import MODEL, Proc, Procs, toml_dumps

pytestmark = pytest.mark.timeout(180)

NODE_TOKEN = "e2e-node-token-marker-5d0c1f"
API_KEY = "sk-e2e-client-key-marker-a9b8"
OTHER_API_KEY = "sk-e2e-second-client-key-7f6e"
ADMIN_KEY = "sk-e2e-admin-key-marker-40d2"
METRICS_KEY = "sk-e2e-metrics-key-marker-9a15"
BEARER_KEY = "sk-e2e-backend-bearer-marker-3e7f"
BASIC_USER = "e2e-user"
BASIC_PASS = "basic-pass-marker-2c4d"
BASIC_CRED = base64.b64encode(f"{BASIC_USER}:{BASIC_PASS}".encode()).decode()
EXTRA_HEADER = "x-org-credential-marker-81d9"
BASIC_MODEL = "iop-sim-basic"


def _forms(secret: str) -> set[str]:
    raw = secret.encode()
    b64 = {base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode()}
    return {secret, *b64, *(f.rstrip("=") for f in b64)}


SECRETS: dict[str, set[str]] = {
    "node token": _forms(NODE_TOKEN),
    "client API key": _forms(API_KEY),
    "second client API key": _forms(OTHER_API_KEY),
    "admin key": _forms(ADMIN_KEY),
    "metrics key": _forms(METRICS_KEY),
    "instance Bearer key": _forms(BEARER_KEY),
    "instance Basic credential": _forms(BASIC_CRED) | _forms(f"{BASIC_USER}:{BASIC_PASS}"),
    "instance Basic password": _forms(BASIC_PASS),
    "instance extra header": _forms(EXTRA_HEADER),
}


def assert_no_secret(where: str, text: str) -> None:
    for name, forms in SECRETS.items():
        for form in forms:
            assert form not in text, f"the {name} ({form!r}) leaked into {where}"


def test_no_secret_reaches_a_log_a_client_or_an_admin_view(procs: Procs) -> None:
    bearer_sim = procs.sim("sim-bearer")
    basic_sim = procs.sim("sim-basic", "--model", BASIC_MODEL)
    edge = procs.edge(
        {
            "server": {
                "api_keys": [API_KEY, OTHER_API_KEY],
                "admin_keys": [ADMIN_KEY],
                "metrics_keys": [METRICS_KEY],
                "keepalive_interval_s": 0.5,
            }
        },
        token=NODE_TOKEN,
        log_level="debug",
    )
    node = procs.node(
        [edge],
        bearer_sim,
        token=NODE_TOKEN,
        log_level="debug",
        instance={
            "headers": {"Authorization": f"Bearer {BEARER_KEY}", "X-Org-Credential": EXTRA_HEADER}
        },
        more_instances=[
            {
                "adapter": "vllm",
                "name": "vllm-basic",
                "endpoint": basic_sim.url,
                "headers": {"Authorization": f"Basic {BASIC_CRED}"},
            }
        ],
    )
    edge.wait_ready(MODEL, node_id=node.node_id)
    edge.wait_ready(BASIC_MODEL, node_id=node.node_id)

    bodies: dict[str, str] = {}
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=edge.url, timeout=30.0, trust_env=False, headers=auth) as http:
        for model in (MODEL, BASIC_MODEL):
            for stream in (False, True):
                base: dict[str, Any] = {
                    "model": model,
                    "stream": stream,
                    "messages": [{"role": "user", "content": "hello"}],
                    "max_tokens": 4,
                }
                ok = http.post("/v1/chat/completions", json=base)
                assert ok.status_code == 200, ok.text
                refused = http.post(
                    "/v1/chat/completions", json={**base, "iop_sim": {"failure": "http_401"}}
                )
                # The backend's own status and message, the credential masked.
                assert refused.status_code == 401, refused.text
                message = refused.json()["error"]["message"]
                scheme = "Bearer" if model == MODEL else "Basic"
                assert message.endswith(f"Incorrect API key provided: {scheme} ***"), message
                bodies[f"{model} stream={stream} ok"] = ok.text
                bodies[f"{model} stream={stream} refused"] = refused.text
        # A client with a wrong key is refused without an echo.
        wrong = http.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}-wrong"})
        assert wrong.status_code == 401
        bodies["wrong key"] = wrong.text
        for path, key in (
            ("/admin", ADMIN_KEY),
            ("/admin/nodes", ADMIN_KEY),
            ("/metrics", METRICS_KEY),
        ):
            resp = http.get(path, headers={"Authorization": f"Bearer {key}"})
            assert resp.status_code == 200, path
            bodies[path] = resp.text
    admin = json.loads(bodies["/admin/nodes"])
    assert {i["instance"] for n in admin["nodes"] for i in n["instances"]} == {
        "vllm-sim",
        "vllm-basic",
    }
    assert 'outcome="error",reason=' in bodies["/metrics"]  # the 401s were counted

    # Stop first: every line is written and nothing is left in a buffer.
    for proc in (node.proc, edge.proc):
        assert proc.stop() == 0
    logs = {
        f"{p.name} {stream}": text
        for p in (edge.proc, node.proc)
        for stream, text in (("stderr", p.stderr()), ("stdout", p.stdout()))
    }
    # Not vacuous: debug logging was on and the refusals were logged, masked.
    assert " DEBUG " in logs["edge stderr"]
    assert " DEBUG " in logs["node stderr"]
    assert "Incorrect API key provided: Bearer ***" in logs["node stderr"]
    assert "Incorrect API key provided: Basic ***" in logs["edge stderr"]
    # The sims (the backends) did see the credentials: they echoed them.
    assert bearer_sim.stats()["statuses"]["401"] == 2
    assert basic_sim.stats()["statuses"]["401"] == 2

    for where, text in {**bodies, **logs}.items():
        assert_no_secret(where, text)


def test_iop_up_masks_the_secrets_of_its_edge_node_and_instances(procs: Procs) -> None:
    sim = procs.sim("sim-up")
    config = {
        "edge": {
            "server": {"api_keys": [API_KEY], "admin_keys": [ADMIN_KEY]},
            "link": {"node_tokens": [NODE_TOKEN]},
        },
        "instances": [
            {
                "adapter": "vllm",
                "name": "vllm-sim",
                "endpoint": sim.url,
                "headers": {"Authorization": f"Bearer {BEARER_KEY}"},
            }
        ],
    }
    cfg = procs.log_dir / "up.toml"
    procs.log_dir.mkdir(parents=True, exist_ok=True)
    cfg.write_text(toml_dumps(config))
    up = Proc(
        "iop-up",
        ["--log-level", "debug", "up", "--port", "0", "--config", str(cfg)],
        procs.log_dir,
    )
    procs.adopt(up)
    up.wait_stdout(r"iop up: ready; models: 'iop-sim'")
    m = re.search(r"OpenAI API on (http://\S+)/v1", up.stdout())
    assert m is not None, up.logs()
    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "iop_sim": {"failure": "http_401"},
    }
    with httpx.Client(base_url=m.group(1), timeout=30.0, trust_env=False, headers=auth) as http:
        refused = http.post("/v1/chat/completions", json=body)
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        pages = {p: http.get(p, headers=admin).text for p in ("/admin", "/admin/nodes", "/metrics")}
        assert all("name='key'" not in text for text in pages.values())  # not a login form
    assert refused.status_code == 401, refused.text
    assert refused.json()["error"]["message"].endswith("Incorrect API key provided: Bearer ***")
    assert up.stop() == 0
    assert "Incorrect API key provided: Bearer ***" in up.stderr()
    outputs = {"response": refused.text, "stdout": up.stdout(), "stderr": up.stderr(), **pages}
    for where, text in outputs.items():
        assert_no_secret(f"iop up {where}", text)


MIXED_CASE_KEY = "sk-E2e-Backend-MixedCase-Marker-7Qx"


class _CaseFoldingEcho(BaseHTTPRequestHandler):
    """A backend that refuses every chat with the ``Authorization`` it got,
    case-folded as the path says (``/v1/models`` lists ``echo-m``)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send(200, {"object": "list", "data": [{"id": "echo-m", "object": "model"}]})

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        fold = request["messages"][-1]["content"]
        auth = self.headers.get("authorization", "")
        echoed = auth.lower() if fold == "lower" else auth.upper()
        self._send(401, {"error": {"message": f"invalid key: {echoed}"}})


@pytest.mark.parametrize("fold", ["lower", "upper"])
def test_a_case_folded_echo_of_a_backend_credential_is_masked(procs: Procs, fold: str) -> None:
    """A backend that echoes the instance's key lower- or upper-cased still
    gives it away (all but its letters' case): it is masked like the key."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _CaseFoldingEcho)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        edge = procs.edge({"server": {"keepalive_interval_s": 0.5}})
        procs.node(
            [edge],
            procs.sim(),
            node_id="n-echo",
            more_instances=[
                {
                    "adapter": "vllm",
                    "name": "echo",
                    "endpoint": f"http://127.0.0.1:{server.server_address[1]}",
                    "headers": {"Authorization": f"Bearer {MIXED_CASE_KEY}"},
                }
            ],
        )
        edge.wait_ready("echo-m", node_id="n-echo")
        for stream in (False, True):
            r = edge.post(
                "/v1/chat/completions",
                json={
                    "model": "echo-m",
                    "messages": [{"role": "user", "content": fold}],
                    "stream": stream,
                },
            )
            assert r.status_code == 401, r.text
            assert "invalid key" in r.text
            assert MIXED_CASE_KEY.lower() not in r.text.lower(), r.text
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
