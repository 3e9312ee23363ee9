"""What a tenant is charged, on real processes: cancels and token counts.

docs/operations.md, "Tenants and limits" ("What a cancel costs"): a prompt
the backend has read (the run had its first output) is charged whatever
happens after, so a client that closes its stream after the first chunk
pays for its prompt as one that reads to the end; a run cancelled before
its first output is charged nothing. ``count_tokens`` is a request like any
other for ``requests_per_minute`` and ``max_concurrent_runs``, and charges
no tokens.

Each test has a tenant of its own (its buckets start full). The token
limit is 3,000 a minute: one prompt of 2,404 tokens (the admission
estimate) plus its output reservation fits once, and after it is charged
the bucket takes about 45 s to hold another; each test sends the second
request as soon as the first is settled. No timing is asserted.
"""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Iterator
from typing import Any, Final
from urllib.parse import urlsplit

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e._platform import MODEL, Cluster, Edge, Sim, poll, start_sim

pytestmark = pytest.mark.timeout(120)

OPERATOR: Final = "iop-e2e-charges-operator"
ADMIN: Final = "iop-e2e-charges-admin"
TPM: Final = 3000
# 9,600 characters in one user message: ceil(9600 / 4) + 4 (the message's
# role and template) = 2,404 tokens, the estimate admission reserves
# (docs/api.md, "count_tokens"); 2,400 for a bare completions prompt.
PROMPT: Final = "word " * 1920
CHAT_PROMPT_TOKENS: Final = 2404
COMPLETION_PROMPT_TOKENS: Final = 2400
# 2,904 reserved of 3,000, and 25 s of output at the sim's 20 tokens a
# second: every run is still going when its client hangs up.
MAX_TOKENS: Final = 500
TENANTS: Final = ("chat", "messages", "responses", "completions", "prefill", "counter", "single")


def _key(tenant: str) -> str:
    return f"iop-e2e-charges-{tenant}"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _tenant(name: str) -> dict[str, Any]:
    limits: dict[str, Any] = {"tokens_per_minute": TPM}
    if name == "counter":
        limits = {"requests_per_minute": 2, "tokens_per_minute": 100}
    elif name == "single":
        limits = {"max_concurrent_runs": 1}
    return {"name": name, "key_sha256": [_digest(_key(name))], **limits}


EDGE_CONFIG: dict[str, Any] = {
    # The operator's client key (the tenant "default", no limits) sends the
    # large count; its admin key reads /admin and /metrics. max_body_bytes
    # stays the default, 8 MiB.
    "server": {
        "keepalive_interval_s": 0.5,
        "api_keys": [OPERATOR],
        "admin_keys": [ADMIN],
    },
    "tenants": [_tenant(name) for name in TENANTS],
}


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    """Long, slow answers (2,000 tokens at 20 a second): every stream is still
    going when its client hangs up, on every surface (Messages passes no
    per-request ``iop_sim``)."""
    s = start_sim(
        tmp_path_factory.mktemp("sim"), "sim", "--tokens-per-s", "20", "--output-tokens", "2000"
    )
    try:
        yield s
    finally:
        s.close()
        s.proc.stop()


def _tenants(edge: Edge) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in edge.admin()["tenants"]}


def _settled(edge: Edge, tenant: str) -> dict[str, Any]:
    """The tenant once its runs have ended (and been settled)."""
    edge.wait_no_runs()
    return poll(
        lambda: (t := _tenants(edge)[tenant])["running"] == 0 and t,
        timeout=10,
        what=f"tenant {tenant} to have no run",
    )


def _tenant_tokens(edge: Edge, tenant: str, kind: str) -> float:
    """``iop_tenant_tokens_total{tenant, kind}`` (0 when absent)."""
    for family in text_string_to_metric_families(edge.admin_get("/metrics").text):
        if family.name != "iop_tenant_tokens":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels == {
                "tenant": tenant,
                "kind": kind,
            }:
                return sample.value
    return 0.0


def _live_output(edge: Edge, tenant: str) -> bool:
    """Whether a live run of ``tenant`` has had its first output."""
    resp = edge.admin_get("/admin/runs")
    resp.raise_for_status()
    return any(
        r["tenant"] == tenant and r["first_output_ms"] is not None for r in resp.json()["live"]
    )


def _openai(edge: Edge, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{edge.url}/v1", api_key=_key(tenant), max_retries=0)


def _anthropic(edge: Edge, tenant: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=edge.url, api_key=_key(tenant), max_retries=0)


def _charged_prompt(edge: Edge, tenant: str, prompt_tokens: int) -> None:
    """The tenant paid for the prompt its cancelled run had sent."""
    t = _settled(edge, tenant)
    assert t["tokens_in"] == prompt_tokens
    assert t["tokens_out"] >= 1  # the streamed chunk(s)
    assert _tenant_tokens(edge, tenant, "input") == prompt_tokens
    # What is left of the minute no longer holds the same request again.
    assert t["limits"]["tokens"]["remaining"] < prompt_tokens + MAX_TOKENS


# --- item: a cancel after the first output pays for its prompt ----------------------------


def test_chat_stream_closed_after_its_first_chunk_pays_its_prompt(cluster: Cluster) -> None:
    edge = cluster.edge
    messages: Any = [{"role": "user", "content": PROMPT}]
    with _openai(edge, "chat") as client:
        with client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, stream=True
        ) as stream:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    break  # the backend's first token: it has read the prompt
        _charged_prompt(edge, "chat", CHAT_PROMPT_TOKENS)
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=MAX_TOKENS, stream=True
            )
    assert refused.value.response.headers["x-ratelimit-limit-tokens"] == str(TPM)
    assert "tokens per minute" in refused.value.message


def test_messages_stream_closed_after_its_first_delta_pays_its_prompt(cluster: Cluster) -> None:
    edge = cluster.edge
    messages: Any = [{"role": "user", "content": PROMPT}]
    with _anthropic(edge, "messages") as client:
        with client.messages.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, stream=True
        ) as stream:
            for event in stream:
                if event.type == "content_block_delta":
                    break
        _charged_prompt(edge, "messages", CHAT_PROMPT_TOKENS)
        with pytest.raises(anthropic.RateLimitError) as refused:
            client.messages.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS)
    assert refused.value.response.headers["anthropic-ratelimit-tokens-limit"] == str(TPM)


def test_responses_stream_closed_after_its_first_delta_pays_its_prompt(cluster: Cluster) -> None:
    edge = cluster.edge
    with _openai(edge, "responses") as client:
        with client.responses.create(
            model=MODEL, input=PROMPT, max_output_tokens=MAX_TOKENS, stream=True
        ) as stream:
            for event in stream:
                if event.type == "response.output_text.delta":
                    break
        _charged_prompt(edge, "responses", CHAT_PROMPT_TOKENS)
        with pytest.raises(openai.RateLimitError):
            client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=MAX_TOKENS)


def test_non_streamed_completion_hung_up_after_output_pays_its_prompt(cluster: Cluster) -> None:
    edge = cluster.edge
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS}).encode()
    url = urlsplit(edge.url)
    assert url.hostname is not None
    assert url.port is not None
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: edge\r\n"
            b"Content-Type: application/json\r\n"
            + f"Authorization: Bearer {_key('completions')}\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        # Hang up once the edge has the backend's first output (the client
        # of a non-streamed request sees nothing before the end).
        poll(
            lambda: _live_output(edge, "completions"),
            timeout=15,
            what="the completion to have its first output",
        )
    _charged_prompt(edge, "completions", COMPLETION_PROMPT_TOKENS)
    with _openai(edge, "completions") as client, pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS)


def test_a_cancel_before_the_first_output_is_charged_nothing(cluster: Cluster) -> None:
    edge = cluster.edge
    messages: Any = [{"role": "user", "content": PROMPT}]
    stall = {"iop_sim": {"failure": "stall_before_first_byte"}}
    with _openai(edge, "prefill") as client:
        with client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, stream=True, extra_body=stall
        ) as stream:
            # The edge's own opening chunk (after keepalive_interval_s without
            # output): the backend has answered nothing yet.
            first = next(iter(stream))
            assert first.choices[0].delta.role == "assistant"
            assert not first.choices[0].delta.content
            cluster.sim.wait_open()
        t = _settled(edge, "prefill")
        assert t["tokens_in"] == 0
        assert _tenant_tokens(edge, "prefill", "input") == 0
        # The whole reservation came back: the same request is admitted again.
        done = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=2,
            extra_body={"iop_sim": {"output_tokens": 2}},
        )
    assert done.choices[0].finish_reason is not None


# --- item: count_tokens is a request like any other ---------------------------------------


def test_count_tokens_counts_toward_requests_per_minute(cluster: Cluster) -> None:
    edge = cluster.edge
    messages: Any = [{"role": "user", "content": PROMPT}]
    with _anthropic(edge, "counter") as client:
        for left in (1, 0):
            raw = client.messages.with_raw_response.count_tokens(model=MODEL, messages=messages)
            assert raw.parse().input_tokens > 0
            headers = raw.http_response.headers
            assert headers["anthropic-ratelimit-requests-remaining"] == str(left)
            # A count generates nothing: it reserves and charges no tokens,
            # so a prompt over the whole token minute (100) is counted.
            assert headers["anthropic-ratelimit-tokens-remaining"] == "100"
        with pytest.raises(anthropic.RateLimitError) as refused:
            client.messages.count_tokens(model=MODEL, messages=messages)
    resp = refused.value.response
    assert resp.status_code == 429
    assert resp.json()["error"]["type"] == "rate_limit_error"
    assert "requests per minute" in resp.json()["error"]["message"]
    assert int(resp.headers["retry-after"]) >= 1
    assert resp.headers["anthropic-ratelimit-requests-limit"] == "2"
    assert resp.headers["anthropic-ratelimit-requests-remaining"] == "0"
    t = _settled(edge, "counter")
    assert (t["admitted"], t["refused"]) == (2, 1)
    assert t["tokens_in"] == 0
    assert _tenant_tokens(edge, "counter", "input") == 0


def test_count_tokens_counts_toward_concurrent_runs(cluster: Cluster) -> None:
    edge = cluster.edge
    hi: Any = [{"role": "user", "content": "hi"}]
    with _anthropic(edge, "single") as client:
        with client.messages.create(
            model=MODEL, messages=hi, max_tokens=MAX_TOKENS, stream=True
        ) as stream:
            next(iter(stream))  # the tenant's one run is going
            with pytest.raises(anthropic.RateLimitError) as refused:
                client.messages.count_tokens(model=MODEL, messages=hi)
        assert refused.value.response.json()["error"]["type"] == "rate_limit_error"
        assert "concurrent runs" in refused.value.message
        _settled(edge, "single")
        assert client.messages.count_tokens(model=MODEL, messages=hi).input_tokens > 0


# --- item: a large count_tokens is never a 5xx ------------------------------------------


def test_a_large_count_tokens_under_the_body_limit_is_answered(cluster: Cluster) -> None:
    """1.2 MB of prompt: the sim's /tokenize answer (its ids, ~16 bytes each)
    is over the node's max_tokenize_body_bytes (1 MiB); the answer is the
    estimate, said so, never a 502 that SDKs would retry."""
    text = "word " * 240_000
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    with httpx.Client(base_url=cluster.edge.url, timeout=60, trust_env=False) as http:
        resp = http.post(
            "/v1/messages/count_tokens",
            json=body,
            headers={"x-api-key": OPERATOR, "anthropic-version": "2023-06-01"},
        )
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-iop-token-count"] == "estimated"
    assert resp.json() == {"input_tokens": len(text) // 4 + 4}
