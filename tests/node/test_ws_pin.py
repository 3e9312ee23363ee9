"""``node.edges`` ``tls_pin_certfile``: the node trusts exactly the edge's
certificate (the file's first), not the CA chain in the same file.

Real TLS handshakes (trio's SSLStream over a memory stream pair) between the
node's client context (``iop.node._ws.client_tls_context``) and a server
presenting a certificate.
"""

from __future__ import annotations

import contextlib
import ssl
from pathlib import Path

import pytest
import trio
import trio.testing
import trustme

from iop.config import NodeEdge
from iop.errors import ConfigError
from iop.node._ws import client_tls_context

URL = "wss://127.0.0.1:1/v1/link"


def _server(cert: trustme.LeafCert) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(ctx)
    return ctx


async def _handshake(client: ssl.SSLContext, server: ssl.SSLContext, host: str) -> bool:
    """Whether the client accepts the server's certificate."""
    left, right = trio.testing.memory_stream_pair()
    c = trio.SSLStream(left, client, server_hostname=host)
    s = trio.SSLStream(right, server, server_side=True)
    ok = True

    async def serve() -> None:
        with contextlib.suppress(trio.BrokenResourceError):
            await s.do_handshake()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            try:
                await c.do_handshake()
            except trio.BrokenResourceError:
                ok = False
                await c.aclose()
    return ok


@pytest.fixture
def chain(tmp_path: Path) -> tuple[trustme.CA, trustme.LeafCert, Path]:
    """An intermediate CA and the edge's leaf of it, written as a chain file."""
    intermediate = trustme.CA().create_child_ca()
    leaf = intermediate.issue_cert("edge.example.com")
    path = tmp_path / "chain.pem"
    path.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    return intermediate, leaf, path


async def test_the_pinned_certificate_is_trusted_under_any_host_name(
    chain: tuple[trustme.CA, trustme.LeafCert, Path],
) -> None:
    _, leaf, path = chain
    ctx = client_tls_context(NodeEdge(url=URL, token="t", tls_pin_certfile=str(path)))
    assert ctx is not None
    assert await _handshake(ctx, _server(leaf), "127.0.0.1")


async def test_another_certificate_of_the_same_intermediate_is_refused(
    chain: tuple[trustme.CA, trustme.LeafCert, Path],
) -> None:
    intermediate, _, path = chain
    other = intermediate.issue_cert("edge.example.com")
    ctx = client_tls_context(NodeEdge(url=URL, token="t", tls_pin_certfile=str(path)))
    assert ctx is not None
    assert not await _handshake(ctx, _server(other), "edge.example.com")


def test_a_pin_file_without_a_certificate_names_the_key_and_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.pem"
    path.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"tls_pin_certfile .*empty\.pem.*no PEM certificate"):
        client_tls_context(NodeEdge(url=URL, token="t", tls_pin_certfile=str(path)))


def test_pin_and_ca_file_are_one_or_the_other() -> None:
    with pytest.raises(ValueError, match="choose one"):
        NodeEdge(url=URL, token="t", tls_pin_certfile="a.pem", tls_ca_file="b.pem")
    with pytest.raises(ValueError, match="wss://"):
        NodeEdge(url="ws://h:1/v1/link", token="t", tls_pin_certfile="a.pem")


async def test_a_certificate_renewed_in_place_is_pinned_at_the_next_dial(
    chain: tuple[trustme.CA, trustme.LeafCert, Path],
) -> None:
    """``iop up`` reloads a renewed edge certificate (SIGHUP); its node, should
    its link drop, must dial trusting the new one, not the one of its start."""
    from iop.config import NodeConfig, NodeSection
    from iop.node import open_node_agent

    intermediate, old, path = chain
    edge = NodeEdge(url=URL, token="t" * 16, tls_pin_certfile=str(path))
    cfg = NodeConfig(node=NodeSection(id="n1", edges=[edge]), instances=[])
    async with open_node_agent(cfg) as agent:
        renewed = intermediate.issue_cert("edge.example.com")
        path.write_bytes(b"".join(blob.bytes() for blob in renewed.cert_chain_pems))
        ctx = agent._dial_tls(edge)
        assert ctx is not None
        assert await _handshake(ctx, _server(renewed), "127.0.0.1")
        assert not await _handshake(ctx, _server(old), "127.0.0.1")
        path.write_text("gone\n")  # unreadable now: the last good pin stays
        assert agent._dial_tls(edge) is ctx
