"""``Capabilities.provider_detail`` on the wire: defaulted, so old and new peers interoperate."""

from __future__ import annotations

import msgspec

from iop.capabilities import (
    PROVIDER_DETAIL_MAX_CHARS,
    Capabilities,
    ProviderStatus,
    provider_detail,
)
from iop.protocol import CapabilitiesUpdate


class _CapabilitiesBeforeDetail(msgspec.Struct, frozen=True, kw_only=True):
    """``Capabilities`` as released before ``provider_detail`` existed."""

    adapter: str
    instance: str
    provider: str = ""
    targets: tuple[str, ...] = ()
    max_concurrency: int = 8
    max_queue: int = 0
    queue_timeout_s: float = 0.0
    request_timeout_s: float = 0.0
    provider_status: ProviderStatus = ProviderStatus.UNKNOWN


DOWN = Capabilities(
    adapter="vllm",
    instance="qwen",
    provider_status=ProviderStatus.UNAVAILABLE,
    provider_detail="request failed: connection refused by 127.0.0.1:8000",
)


def test_an_old_peer_decodes_a_new_node_s_capabilities() -> None:
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(DOWN), type=_CapabilitiesBeforeDetail)
    assert old.provider_status is ProviderStatus.UNAVAILABLE
    assert old.instance == "qwen"


def test_a_new_edge_decodes_an_old_node_s_capabilities() -> None:
    old = _CapabilitiesBeforeDetail(
        adapter="vllm", instance="qwen", provider_status=ProviderStatus.UNAVAILABLE
    )
    frame = msgspec.msgpack.encode({"t": "caps", "instances": [old]})
    msg = msgspec.msgpack.decode(frame, type=CapabilitiesUpdate)
    assert msg.instances[0].provider_detail == ""
    assert msg.instances[0].provider_status is ProviderStatus.UNAVAILABLE


def test_provider_detail_is_one_short_line() -> None:
    assert provider_detail("status code 503\n  from  the proxy") == "status code 503 from the proxy"
    long = provider_detail("x" * 10_000)
    assert len(long) == PROVIDER_DETAIL_MAX_CHARS
    assert long.endswith("…")
