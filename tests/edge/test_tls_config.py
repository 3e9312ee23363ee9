"""TLS and node-credential settings: what the config refuses, and the edge's
TLS contexts reloaded from their files (``iop.edge.server._tls``)."""

from __future__ import annotations

import ssl
from pathlib import Path

import msgspec
import pytest
import trustme

from iop.config import EdgeConfig, load_config
from iop.edge.server._tls import EdgeTLS
from iop.errors import ConfigError

SHA = "ab" * 32


def _load(tmp_path: Path, text: str) -> EdgeConfig:
    p = tmp_path / "edge.toml"
    p.write_text(text)
    return load_config(p, EdgeConfig)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('[server]\ntls_certfile = "c.pem"\n', "tls_certfile and tls_keyfile go together"),
        ('[server]\ncors_origins = ["app.example.com"]\n', "is not an origin"),
        ('[link]\nclient_ca = "ca.pem"\n', "client_ca needs port"),
        ('[link]\nport = 0\nclient_ca = "ca.pem"\n', "link.client_ca needs server.tls_certfile"),
        ('[[link.nodes]]\nname = "a"\ntoken_sha256 = "abc"\n', "64 lower-case hex digits"),
        (
            f'[[link.nodes]]\nname = "a"\ntoken_sha256 = "{SHA}"\n'
            f'[[link.nodes]]\nname = "a"\ntoken_sha256 = "{"cd" * 32}"\n',
            "name 'a' is used twice",
        ),
        (
            f'[[link.nodes]]\nname = "a"\ntoken_sha256 = "{SHA}"\n'
            f'[[link.nodes]]\nname = "b"\ntoken_sha256 = "{SHA}"\n',
            "another entry's token_sha256",
        ),
        (f'[[link.nodes]]\nname = "a"\ntoken_sha256 = "{SHA}"\ntoken = "x"\n', "unknown key"),
    ],
)
def test_bad_tls_and_credential_settings_are_named(tmp_path: Path, text: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        _load(tmp_path, text)


def _files(tmp_path: Path, ca: trustme.CA, name: str) -> tuple[str, str]:
    leaf = ca.issue_cert("127.0.0.1")
    cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    return str(cert), str(key)


def test_reload_swaps_the_contexts_and_a_bad_file_keeps_the_old(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert, key = _files(tmp_path, ca, "one")
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    first = msgspec.convert(
        {
            "server": {"tls_certfile": cert, "tls_keyfile": key},
            "link": {"port": 0, "client_ca": str(ca_file)},
        },
        EdgeConfig,
    )
    tls = EdgeTLS(first)
    api, link = tls.api, tls.link
    assert link.verify_mode == ssl.CERT_REQUIRED
    assert api.verify_mode == ssl.CERT_NONE
    # A reload reads the files again: new contexts for new handshakes.
    cert2, key2 = _files(tmp_path, ca, "two")
    second = msgspec.convert({"server": {"tls_certfile": cert2, "tls_keyfile": key2}}, EdgeConfig)
    tls.reload(second)
    assert tls.api is not api
    assert tls.link is tls.api  # no client_ca any more: the link is plain TLS
    # A missing file: ConfigError naming it, and the contexts stay.
    current = tls.api
    gone = msgspec.convert(
        {"server": {"tls_certfile": str(tmp_path / "nope.pem"), "tls_keyfile": key2}}, EdgeConfig
    )
    with pytest.raises(ConfigError, match=r"nope\.pem"):
        tls.reload(gone)
    assert tls.api is current
