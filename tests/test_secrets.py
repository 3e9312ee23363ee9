"""``iop._secrets``: the masker of configured secret values and the secrets of each config."""

from __future__ import annotations

import base64
import logging

import pytest

from iop import _secrets
from iop._secrets import (
    MIN_SECRET_LENGTH,
    SecretMasker,
    edge_secrets,
    node_secrets,
    register_secrets,
    secret_forms,
    up_secrets,
)
from iop.config import (
    EdgeConfig,
    EdgeServer,
    LinkSettings,
    NodeConfig,
    NodeEdge,
    NodeSection,
    SimInstance,
    TenancySettings,
    UpConfig,
    VllmInstance,
)


def test_masks_every_occurrence_whatever_surrounds_it() -> None:
    m = SecretMasker(["sk-live-0123456789"])
    text = 'Incorrect API key provided: Bearer sk-live-0123456789 ("sk-live-0123456789")'
    assert m.mask(text) == 'Incorrect API key provided: Bearer *** ("***")'


def test_masks_the_credential_of_a_bearer_header_value_alone() -> None:
    m = SecretMasker(["Bearer tok-abcdef-123"])
    assert m.mask("key tok-abcdef-123 refused") == "key *** refused"
    assert m.mask("header 'Bearer tok-abcdef-123'") == "header 'Bearer ***'"
    b64 = base64.b64encode(b"Bearer tok-abcdef-123").decode()
    assert m.mask(f"as base64 {b64}") == "as base64 ***"


def test_a_credential_too_short_alone_is_masked_with_its_scheme() -> None:
    m = SecretMasker(["Bearer abc12"])
    assert m.mask("got 'Bearer abc12'") == "got '***'"
    assert m.mask("abc12 alone") == "abc12 alone"


def test_masks_basic_credentials_encoded_and_decoded() -> None:
    b64 = base64.b64encode(b"alice:wonderland-9").decode()
    m = SecretMasker([f"Basic {b64}"])
    assert m.mask(f"got {b64}") == "got ***"
    assert m.mask("user alice:wonderland-9 denied") == "user *** denied"
    assert m.mask("password wonderland-9 is wrong") == "password *** is wrong"


def test_masks_base64_url_encoded_and_json_escaped_forms() -> None:
    secret = 'p@ss/word "quoted"'
    m = SecretMasker([secret])
    for form in (
        base64.b64encode(secret.encode()).decode(),
        base64.b64encode(secret.encode()).decode().rstrip("="),
        base64.urlsafe_b64encode(secret.encode()).decode(),
        "p%40ss%2Fword%20%22quoted%22",
        'p@ss/word \\"quoted\\"',
    ):
        assert m.mask(f"<{form}>") == "<***>", form


def test_prefers_the_longest_overlapping_form() -> None:
    m = SecretMasker(["abcdefgh", "abcdefgh-longer"])
    assert m.mask("x abcdefgh-longer y") == "x *** y"


def test_ignores_values_shorter_than_the_minimum() -> None:
    short = "x" * (MIN_SECRET_LENGTH - 1)
    m = SecretMasker([short])
    assert not m
    assert m.mask(f"text {short} stays") == f"text {short} stays"
    assert all(len(f) >= MIN_SECRET_LENGTH for f in secret_forms("Basic " + "a" * 12))


def test_an_empty_masker_returns_text_unchanged() -> None:
    assert SecretMasker().mask("anything at all") == "anything at all"


def test_with_secrets_adds_without_changing_the_original() -> None:
    a = SecretMasker(["first-secret"])
    b = a.with_secrets(["second-secret"])
    assert a.mask("second-secret") == "second-secret"
    assert b.mask("first-secret second-secret") == "*** ***"


# --- secrets of a config -------------------------------------------------------------


def test_edge_secrets_are_client_admin_and_metrics_keys_node_tokens_and_the_salt_key() -> None:
    cfg = EdgeConfig(
        server=EdgeServer(
            api_keys=["client-key-1", "client-key-2"],
            admin_keys=["admin-key-1"],
            metrics_keys=["metrics-key-1"],
        ),
        link=LinkSettings(node_tokens=["node-token-1"]),
        tenancy=TenancySettings(cache_salt_key="salt-key-of-the-edges"),
    )
    assert edge_secrets(cfg) == [
        ("client-key-1", "edge.server.api_keys[0]"),
        ("client-key-2", "edge.server.api_keys[1]"),
        ("admin-key-1", "edge.server.admin_keys[0]"),
        ("metrics-key-1", "edge.server.metrics_keys[0]"),
        ("node-token-1", "edge.link.node_tokens[0]"),
        ("salt-key-of-the-edges", "edge.tenancy.cache_salt_key"),
    ]


def test_node_secrets_are_edge_tokens_and_instance_header_values() -> None:
    cfg = NodeConfig(
        node=NodeSection(edges=[NodeEdge(url="ws://e/v1/link", token="edge-token-1")]),
        instances=[
            VllmInstance(
                name="v",
                endpoint="http://b",
                headers={
                    "Authorization": "Bearer backend-key",
                    "X-Org": "org-credential",
                    "Content-Type": "application/json",
                },
            ),
            SimInstance(name="s"),
        ],
    )
    assert node_secrets(cfg) == [
        ("edge-token-1", "node.edges[0].token"),
        ("Bearer backend-key", "instances[v].headers.Authorization"),
        ("org-credential", "instances[v].headers.X-Org"),
    ]


def test_up_secrets_are_the_edges_and_the_instances() -> None:
    cfg = UpConfig(
        edge=EdgeConfig(link=LinkSettings(node_tokens=["up-node-token"])),
        instances=[VllmInstance(name="v", endpoint="http://b", headers={"x-api-key": "kkkkkkkk"})],
    )
    assert [v for v, _ in up_secrets(cfg)] == ["up-node-token", "kkkkkkkk"]


# --- the process-wide masker -----------------------------------------------------------


def test_register_secrets_extends_the_process_masker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_secrets, "_registered", SecretMasker())
    register_secrets([("registered-one", "a")])
    register_secrets([("registered-two", "b")])
    assert _secrets.mask("registered-one registered-two") == "*** ***"


def test_register_secrets_warns_about_short_ones_without_the_value(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_secrets, "_registered", SecretMasker())
    with caplog.at_level(logging.WARNING, "iop.secrets"):
        register_secrets([("tiny", "edge.server.api_keys[0]")])
    assert "edge.server.api_keys[0]" in caplog.text
    assert "shorter than 8 characters" in caplog.text
    assert "tiny" not in caplog.text
    assert _secrets.mask("tiny") == "tiny"


def test_register_secrets_warns_about_a_short_credential_behind_a_scheme(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_secrets, "_registered", SecretMasker())
    with caplog.at_level(logging.WARNING, "iop.secrets"):
        register_secrets([("Bearer abc12", "instances[v].headers.Authorization")])
    assert "instances[v].headers.Authorization is shorter than 8" in caplog.text
    assert "(but as a whole header value)" in caplog.text
    assert _secrets.mask("Bearer abc12") == "***"
