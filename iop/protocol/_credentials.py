"""Which credential a node's hello token is: the edge's node credentials.

Two kinds, both accepted at once (``docs/operations.md``, "TLS and node
credentials"):

* **shared tokens** (``link.node_tokens``): every node may present any of
  them; a leaked one is revoked by changing it on every node;
* **per-node credentials** (``[[link.nodes]]``): each node its own token,
  stored on the edge as its SHA-256 digest only, named (the edge's log says
  which credential a node used), revoked alone by removing its table, and
  optionally bound to the node ids it may claim.

``NodeCredentials`` is immutable: the edge builds one from its config and
every link handshake reads the current one, so a config reload swaps the
whole set at once (``EdgeCore.set_node_credentials``) and a revoked
credential admits no new link from that moment.

``check`` compares the presented token against every shared token and every
digest, always all of them, in constant time (``hmac.compare_digest``), so
the time it takes reveals neither which entry matched nor how much of a
token was right. Sans-IO: no trio, no config file reading.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field

from iop.errors import LinkAuthError

__all__ = ["NodeCredential", "NodeCredentials"]


@dataclass(frozen=True, slots=True)
class NodeCredential:
    """One accepted credential.

    Attributes:
        name: What the log calls it (``node_tokens[0]`` for a shared token).
        node_ids: The ids it may claim; empty: any.
        digest: SHA-256 of its token (two credentials of one name but
            different tokens are different credentials).
    """

    name: str
    node_ids: frozenset[str] = frozenset()
    digest: bytes = field(default=b"", repr=False)


class NodeCredentials:
    """The set of credentials an edge accepts (immutable).

    Args:
        shared: Shared tokens (``link.node_tokens``), in clear.
        nodes: Per-node credentials as ``(name, token_sha256 hex, node_ids)``.
    """

    __slots__ = ("_entries",)

    def __init__(
        self,
        shared: Iterable[str] = (),
        nodes: Iterable[tuple[str, str, Iterable[str]]] = (),
    ) -> None:
        entries = [
            NodeCredential(f"node_tokens[{i}]", digest=_digest(t)) for i, t in enumerate(shared)
        ]
        entries += [
            NodeCredential(name, frozenset(ids), bytes.fromhex(hex_digest))
            for name, hex_digest, ids in nodes
        ]
        self._entries: tuple[NodeCredential, ...] = tuple(entries)

    def __len__(self) -> int:
        return len(self._entries)

    def check(self, token: str, node_id: str) -> NodeCredential:
        """The credential ``token`` is, if it may claim ``node_id``.

        Raises:
            LinkAuthError: No credential has this token (a bad token), or the
                one that has it is bound to other node ids.
        """
        presented = _digest(token)
        found: NodeCredential | None = None
        # Every entry, always: the time taken says nothing about which matched.
        for entry in self._entries:
            if hmac.compare_digest(presented, entry.digest):
                found = entry
        if found is None:
            raise LinkAuthError(f"node {node_id!r} presented a bad token")
        if found.node_ids and node_id not in found.node_ids:
            raise LinkAuthError(
                f"node {node_id!r} presented credential {found.name!r}, which may claim "
                f"only {', '.join(sorted(found.node_ids))}"
            )
        return found

    def admits(self, credential: NodeCredential, node_id: str) -> bool:
        """Whether a link admitted by ``credential`` (of an earlier set) as
        ``node_id`` would still be admitted by this one: its token is here
        and may still claim that id, whatever the entry is now called (a
        shared token keeps its link when another token before it in the
        list was removed). A reload keeps such links."""
        return any(
            hmac.compare_digest(e.digest, credential.digest)
            and (not e.node_ids or node_id in e.node_ids)
            for e in self._entries
        )


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()
