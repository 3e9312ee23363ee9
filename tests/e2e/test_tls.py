"""TLS on every hop and per-node credentials, end to end (real processes).

docs/operations.md, "TLS and node credentials". One CA made by ``trustme``
signs every certificate: the sim serves HTTPS (the node's backend), the
edge serves HTTPS to clients and ``wss://`` on the link's own port, where
it asks nodes for a certificate of that CA (mutual TLS); the node trusts the
CA for both hops and presents its own certificate; the official openai SDK
trusts the CA. Then each way a TLS link fails (an expired edge
certificate, a wrong host, a node without a certificate, plain ``ws://`` to
a TLS edge) must give a one-line refusal in both logs and no traceback.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import ssl
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

from tests.e2e._platform import MODEL, TOKEN, Edge, Node, Procs, Sim, read_stream, start_node

pytestmark = pytest.mark.slow

MESSAGES: list[Any] = [{"role": "user", "content": "Tell me a story."}]
ORIGIN = "https://app.example.com"


class Certs:
    """The CA and the PEM files the processes read."""

    def __init__(self, where: Path) -> None:
        self.ca = trustme.CA()
        self.dir = where
        self.ca_pem = self._write("ca.pem", self.ca.cert_pem.bytes())
        server = self.ca.issue_cert("127.0.0.1")
        self.server_cert, self.server_key = self._leaf("server", server)
        node = self.ca.issue_cert("node-gpu-a")
        self.node_cert, self.node_key = self._leaf("node", node)
        past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=2)
        expired = self.ca.issue_cert(
            "127.0.0.1", not_before=past, not_after=past + datetime.timedelta(days=1)
        )
        self.expired_cert, self.expired_key = self._leaf("expired", expired)
        self.client = ssl.create_default_context(cafile=self.ca_pem)

    def _write(self, name: str, data: bytes) -> str:
        path = self.dir / name
        path.write_bytes(data)
        return str(path)

    def _leaf(self, name: str, cert: trustme.LeafCert) -> tuple[str, str]:
        chain = b"".join(blob.bytes() for blob in cert.cert_chain_pems)
        return (
            self._write(f"{name}.pem", chain),
            self._write(f"{name}.key", cert.private_key_pem.bytes()),
        )


def _node_credential(name: str, node_id: str) -> tuple[str, dict[str, Any]]:
    """``iop keys node``: the token (its stderr's last line) and the table."""
    done = subprocess.run(
        [sys.executable, "-m", "iop", "keys", "node", name, "--node-id", node_id],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
        env={**os.environ},
    )
    token = done.stderr.strip().splitlines()[-1]
    (table,) = tomllib.loads(done.stdout)["link"]["nodes"]
    return token, table


class TLSCluster:
    def __init__(
        self, certs: Certs, procs: Procs, sim: Sim, edge: Edge, node: Node, token: str
    ) -> None:
        self.token = token
        self.certs = certs
        self.procs = procs
        self.sim = sim
        self.edge = edge
        self.node = node


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSCluster]:
    certs = Certs(tmp_path_factory.mktemp("certs"))
    token, credential = _node_credential("gpu-a", "n1")
    procs = Procs(tmp_path_factory.mktemp("tls"))
    try:
        sim = procs.sim(
            "sim-tls",
            "--tls-certfile",
            certs.server_cert,
            "--tls-keyfile",
            certs.server_key,
            verify=certs.client,
        )
        edge = procs.edge(
            {
                "server": {
                    "keepalive_interval_s": 0.5,
                    "tls_certfile": certs.server_cert,
                    "tls_keyfile": certs.server_key,
                    "cors_origins": [ORIGIN],
                },
                "link": {
                    "port": 0,
                    "client_ca": certs.ca_pem,
                    "nodes": [credential],
                },
            },
            name="edge-tls",
            verify=certs.client,
        )
        node = procs.node(
            [edge],
            sim,
            node_id="n1",
            token=token,
            edge_settings={
                "tls_ca_file": certs.ca_pem,
                "tls_certfile": certs.node_cert,
                "tls_keyfile": certs.node_key,
            },
            instance={"tls_ca_file": certs.ca_pem},
        )
        edge.wait_ready(node_id="n1")
        yield TLSCluster(certs, procs, sim, edge, node, token)
    finally:
        procs.stop_all()


def _no_traceback(*procs: Any) -> None:
    for proc in procs:
        assert "Traceback" not in proc.stderr(), proc.logs()


def test_openai_sdk_through_tls_and_mtls_to_an_https_backend(tls: TLSCluster) -> None:
    edge = tls.edge
    assert edge.url.startswith("https://")
    assert edge.link_url.startswith("wss://")
    assert tls.sim.url.startswith("https://")
    with (
        edge.openai() as client,
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            stream=True,
            extra_body={"iop_sim": {"output_tokens": 12}},
        ) as stream,
    ):
        r = read_stream(stream)
    assert r.finish_reason == "stop"
    assert len(r.content_deltas) == 12
    # The edge says which credential the node used; the node is on it.
    edge.proc.wait_stderr(r"node n1 connected from \S+ with credential gpu-a", timeout=5)
    # A client that does not trust the CA is refused by its own TLS.
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{edge.url}/v1/models", trust_env=False)
    edge.proc.wait_stderr(r"TLS handshake from \S+ refused: unknown ca", timeout=5)
    _no_traceback(edge.proc, tls.node.proc, tls.sim.proc)


def test_cors_preflight_and_response_for_a_listed_origin_only(tls: TLSCluster) -> None:
    edge = tls.edge
    with httpx.Client(base_url=edge.url, verify=tls.certs.client, trust_env=False) as http:
        pre = http.options(
            "/v1/chat/completions",
            headers={
                "Origin": ORIGIN,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert pre.status_code == 204
        assert pre.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert pre.headers["access-control-allow-headers"] == "authorization, content-type"
        models = http.get("/v1/models", headers={"Origin": ORIGIN})
        assert models.status_code == 200
        assert models.headers["access-control-allow-origin"] == ORIGIN
        other = http.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        other_pre = http.options(
            "/v1/chat/completions",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert "access-control-allow-origin" not in other_pre.headers


def _failing_node(
    tls: TLSCluster, name: str, url: str, *, token: str | None = None, **edge: Any
) -> Node:
    node = start_node(
        tls.procs.log_dir,
        [url],
        tls.sim.url,
        name=name,
        node_id=name,
        token=token or tls.token,
        edge_settings=edge,
        instance={"tls_ca_file": tls.certs.ca_pem},
    )
    tls.procs.adopt(node.proc)
    return node


def test_a_node_without_a_client_certificate_is_refused(tls: TLSCluster) -> None:
    node = _failing_node(tls, "no-cert", tls.edge.link_url, tls_ca_file=tls.certs.ca_pem)
    node.proc.wait_stderr(r"TLS with 127\.0\.0\.1 failed: certificate required", timeout=10)
    tls.edge.proc.wait_stderr(r"TLS handshake from \S+ refused: peer did not return", timeout=5)
    node.proc.stop()
    _no_traceback(node.proc, tls.edge.proc)


def test_a_wrong_host_is_refused(tls: TLSCluster) -> None:
    # The certificate names 127.0.0.1 only.
    url = tls.edge.link_url.replace("127.0.0.1", "localhost")
    node = _failing_node(
        tls,
        "wrong-host",
        url,
        tls_ca_file=tls.certs.ca_pem,
        tls_certfile=tls.certs.node_cert,
        tls_keyfile=tls.certs.node_key,
    )
    node.proc.wait_stderr(
        r"TLS with localhost failed: certificate verification failed: Hostname mismatch",
        timeout=10,
    )
    tls.edge.proc.wait_stderr(r"TLS handshake from \S+ refused: bad certificate", timeout=5)
    node.proc.stop()
    _no_traceback(node.proc, tls.edge.proc)


def test_plain_ws_to_a_tls_edge_is_refused(tls: TLSCluster) -> None:
    url = "ws://" + tls.edge.link_url.removeprefix("wss://")
    node = _failing_node(tls, "plain-ws", url)
    node.proc.wait_stderr(
        r"refused the link upgrade: HTTP 400: This port serves TLS: use https:// \(or wss://",
        timeout=10,
    )
    tls.edge.proc.wait_stderr(r"TLS handshake from \S+ refused: http request", timeout=5)
    node.proc.stop()
    _no_traceback(node.proc, tls.edge.proc)


def test_a_node_credential_claims_only_its_node_ids(tls: TLSCluster) -> None:
    node = _failing_node(
        tls,
        "n2",
        tls.edge.link_url,
        tls_ca_file=tls.certs.ca_pem,
        tls_certfile=tls.certs.node_cert,
        tls_keyfile=tls.certs.node_key,
    )
    # (named "n2" but claiming n2 with gpu-a's token, bound to n1)
    tls.edge.proc.wait_stderr(r"credential 'gpu-a', which may claim only n1", timeout=10)
    node.proc.wait_stderr(r"edge \S+ refused node n2", timeout=5)
    node.proc.stop()
    _no_traceback(node.proc, tls.edge.proc)


def test_an_expired_edge_certificate_is_refused_and_an_open_edge_warned(
    tls: TLSCluster,
) -> None:
    certs = tls.certs
    edge = tls.procs.edge(
        {
            "server": {
                "host": "0.0.0.0",
                "tls_certfile": certs.expired_cert,
                "tls_keyfile": certs.expired_key,
            }
        },
        name="edge-expired",
        verify=certs.client,
    )
    # No client key on a listener beyond loopback: a warning naming it.
    edge.proc.wait_stderr(r"WARNING .*listening on https://0\.0\.0\.0:\d+ .*no client key", 5)
    url = f"wss://127.0.0.1:{edge.port}/v1/link"
    node = _failing_node(tls, "expired", url, token=TOKEN, tls_ca_file=certs.ca_pem)
    node.proc.wait_stderr(
        r"TLS with 127\.0\.0\.1 failed: certificate verification failed: certificate has expired",
        timeout=10,
    )
    edge.proc.wait_stderr(r"TLS handshake from \S+ refused: certificate expired", timeout=5)
    node.proc.stop()
    _no_traceback(node.proc, edge.proc)


def test_an_https_backend_is_verified_unless_the_instance_opts_out(tls: TLSCluster) -> None:
    certs = tls.certs
    node = start_node(
        tls.procs.log_dir,
        [tls.edge.link_url],
        tls.sim.url,
        name="backends",
        node_id="backends",
        token=TOKEN,  # the shared node_tokens still work beside [[link.nodes]]
        edge_settings={
            "tls_ca_file": certs.ca_pem,
            "tls_certfile": certs.node_cert,
            "tls_keyfile": certs.node_key,
        },
        instance={"name": "unverified", "tls_verify": False, "targets": ["unverified"]},
        more_instances=[{"adapter": "vllm", "name": "system-roots", "endpoint": tls.sim.url}],
    )
    tls.procs.adopt(node.proc)
    node.proc.wait_stderr(r"WARNING .*instance unverified: tls_verify = false", timeout=5)
    tls.edge.proc.wait_stderr(
        r"node backends connected from \S+ with credential node_tokens\[0\]", 10
    )
    node.proc.wait_stderr(r"system-roots.*CERTIFICATE_VERIFY_FAILED", timeout=10)
    (entry,) = [n for n in tls.edge.admin()["nodes"] if n["id"] == "backends"]
    status = {i["instance"]: i["provider_status"] for i in entry["instances"]}
    assert status == {"unverified": "available", "system-roots": "unavailable"}
    node.proc.stop()
    _no_traceback(node.proc)


def _served_certificate(port: int, context: ssl.SSLContext) -> bytes:
    """The DER certificate the edge presents on ``port`` now."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls_sock,
    ):
        der = tls_sock.getpeercert(binary_form=True)
    assert der is not None
    return der


def test_a_certificate_renewed_in_place_is_served_after_a_sighup(tls: TLSCluster) -> None:
    """Renewing is writing the new files over the old ones and reloading: no
    key of the config changes, and the next handshakes get the new one."""
    certs, edge = tls.certs, tls.edge
    before = _served_certificate(edge.port, certs.client)
    renewed = certs.ca.issue_cert("127.0.0.1")
    Path(certs.server_cert).write_bytes(b"".join(b.bytes() for b in renewed.cert_chain_pems))
    Path(certs.server_key).write_bytes(renewed.private_key_pem.bytes())
    edge.proc.send(signal.SIGHUP)
    edge.proc.wait_stderr(r"TLS: certificate reloaded from", timeout=10)
    after = _served_certificate(edge.port, certs.client)
    assert after != before
    assert after == ssl.PEM_cert_to_DER_cert(renewed.cert_chain_pems[0].bytes().decode())
    # The node's link, made before, goes on; clients are served.
    with httpx.Client(verify=certs.client, timeout=30) as c:
        assert c.get(f"{edge.url}/readyz").status_code == 200
    _no_traceback(edge.proc)
