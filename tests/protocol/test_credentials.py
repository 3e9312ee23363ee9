"""Node credentials (``iop.protocol._credentials``) and the edge session's use of them."""

from __future__ import annotations

import hashlib

import pytest

from iop.errors import LinkAuthError
from iop.protocol import PROTOCOL_VERSION, EdgeSession, Hello, NodeCredentials, encode


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


CREDS = NodeCredentials(
    shared=["shared-token-0123456789"],
    nodes=[("gpu-a", sha("token-a-0123456789"), ["n1", "n2"]), ("any", sha("token-b-01234"), [])],
)


def test_each_token_is_its_named_credential() -> None:
    assert CREDS.check("shared-token-0123456789", "x").name == "node_tokens[0]"
    assert CREDS.check("token-a-0123456789", "n2").name == "gpu-a"
    assert CREDS.check("token-b-01234", "whatever").name == "any"


def test_a_bad_token_and_an_id_outside_the_binding_are_refused() -> None:
    with pytest.raises(LinkAuthError, match="'n9' presented a bad token"):
        CREDS.check("token-a-0123456789-not", "n9")
    with pytest.raises(LinkAuthError, match="credential 'gpu-a', which may claim only n1, n2"):
        CREDS.check("token-a-0123456789", "n3")


def test_a_revoked_credential_is_gone_from_the_next_set_alone() -> None:
    revoked = NodeCredentials(
        shared=["shared-token-0123456789"], nodes=[("any", sha("token-b-01234"), [])]
    )
    with pytest.raises(LinkAuthError, match="bad token"):
        revoked.check("token-a-0123456789", "n1")
    assert revoked.check("token-b-01234", "n1").name == "any"
    assert len(revoked) == 2


def test_the_session_records_the_credential_of_the_accepted_hello() -> None:
    session = EdgeSession(tokens=CREDS, heartbeat_interval_s=1.0, heartbeat_timeout_s=2.0, now=0.0)
    hello = Hello(protocol_version=PROTOCOL_VERSION, node_id="n1", token="token-a-0123456789")
    session.receive(encode(hello), 0.0)
    assert session.credential is not None
    assert session.credential.name == "gpu-a"
    other = EdgeSession(tokens=CREDS, heartbeat_interval_s=1.0, heartbeat_timeout_s=2.0, now=0.0)
    with pytest.raises(LinkAuthError, match="may claim only"):
        other.receive(
            encode(
                Hello(protocol_version=PROTOCOL_VERSION, node_id="n7", token="token-a-0123456789")
            ),
            0.0,
        )


def test_a_reload_keeps_a_link_whose_token_is_still_accepted_under_another_name() -> None:
    before = NodeCredentials(shared=["shared-token-one-0123", "shared-token-two-0123"])
    held = before.check("shared-token-two-0123", "n2")
    assert held.name == "node_tokens[1]"
    # The first token removed: the second is node_tokens[0] now, the same token.
    after = NodeCredentials(shared=["shared-token-two-0123"])
    assert after.admits(held, "n2")
    assert not after.admits(before.check("shared-token-one-0123", "n1"), "n1")
    # A per-node credential now bound to other ids no longer admits the link.
    bound = NodeCredentials(nodes=[("gpu-a", sha("token-a-0123456789"), ["n1"])])
    link = bound.check("token-a-0123456789", "n1")
    assert NodeCredentials(nodes=[("gpu-a", sha("token-a-0123456789"), [])]).admits(link, "n1")
    assert not NodeCredentials(nodes=[("gpu-a", sha("token-a-0123456789"), ["n2"])]).admits(
        link, "n1"
    )
