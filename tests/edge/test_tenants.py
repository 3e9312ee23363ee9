"""Client keys as tenants (iop.edge.tenancy._tenants): the rules without a clock, then
the edge's HTTP answers with the official SDKs as clients."""

from __future__ import annotations

import hashlib
import math
import re
import tomllib

import anthropic
import msgspec
import openai
import pytest
import trio

from iop.config import EdgeConfig, EdgeServer, TenancySettings, TenantSettings, decode_config
from iop.edge.tenancy._charges import charged_usage, estimate_prompt_tokens, estimate_tokens
from iop.edge.tenancy._limits import Bucket, RateLimited, headers_anthropic, headers_openai
from iop.edge.tenancy._tenants import ANONYMOUS, DEFAULT, Tenants
from iop.errors import ConfigError
from iop.events import Cancelled, CancelReason, Complete, Delta, Error, Start, Usage
from iop.spec import ChatRequest, CompletionRequest, EmbeddingRequest, Message, TokenizeRequest
from tests.edge.test_app import CHAT, answer, config, edge
from tests.edge.test_core import FakeNode

KEY_A = "iop-tenant-a-key"
KEY_B = "iop-tenant-b-key"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def tenant(name: str = "a", key: str = KEY_A, **limits: object) -> TenantSettings:
    return TenantSettings(name=name, key_sha256=[sha(key)], **limits)  # type: ignore[arg-type]


def tenants(*ts: TenantSettings, api_keys: tuple[str, ...] = ()) -> Tenants:
    return Tenants(list(ts), list(api_keys), TenancySettings())


# --- who is asking -----------------------------------------------------------


def test_a_key_finds_its_tenant_by_digest_and_a_wrong_key_finds_none() -> None:
    t = tenants(tenant("a", KEY_A), tenant("b", KEY_B), api_keys=("plain",))
    found_a, found_b, found_default = t.identify(KEY_A), t.identify(KEY_B), t.identify("plain")
    assert found_a is not None
    assert found_a.name == "a"
    assert found_b is not None
    assert found_b.name == "b"
    assert found_default is not None
    assert found_default.name == DEFAULT
    assert t.identify("wrong") is None
    assert t.identify("") is None
    # The digest itself is not a key.
    assert t.identify(sha(KEY_A)) is None


def test_with_no_keys_at_all_every_request_is_the_anonymous_tenant() -> None:
    t = tenants()
    found = t.identify("")
    assert found is not None
    assert found.name == ANONYMOUS
    assert t.identify("anything") is found


# --- limits ----------------------------------------------------------------------


def test_a_bucket_starts_full_refills_at_a_sixtieth_a_second_and_never_overflows() -> None:
    b = Bucket(60)
    assert b.level(100.0) == 60
    b.take(60, 100.0)
    assert b.level(100.0) == 0
    assert b.level(110.0) == pytest.approx(10)
    assert b.wait_for(20, 110.0) == pytest.approx(10)
    assert b.level(1000.0) == 60
    assert b.wait_for(61, 1000.0) == math.inf
    b.give(1000, 1000.0)
    assert b.level(1000.0) == 60


def test_requests_per_minute_refuse_the_next_request_with_when_to_retry() -> None:
    t = tenants(tenant(requests_per_minute=2))
    a = t.identify(KEY_A)
    assert a is not None
    t.admit(a, 10, 0.0)
    t.admit(a, 10, 0.0)
    with pytest.raises(RateLimited) as err:
        t.admit(a, 10, 0.0)
    assert err.value.status == 429
    assert err.value.limit == "requests"
    assert err.value.retry_after_s == pytest.approx(30)  # one request per 30 s
    assert err.value.retry_after_header == "30"
    assert "requests per minute" in err.value.message
    assert a.refused == 1
    assert a.admitted == 2
    t.admit(a, 10, 30.0)  # refilled


def test_tokens_are_reserved_at_admission_and_settled_to_the_real_usage() -> None:
    t = tenants(tenant(tokens_per_minute=1000))
    a = t.identify(KEY_A)
    assert a is not None
    assert a.tokens is not None
    ticket = t.admit(a, 800, 0.0)
    assert a.tokens.level(0.0) == 200
    with pytest.raises(RateLimited) as err:
        t.admit(a, 300, 0.0)
    assert err.value.limit == "tokens"
    t.finish(ticket, Usage(input_tokens=50, output_tokens=50), 0.0)
    assert a.tokens.level(0.0) == 900  # 700 of the 800 given back
    assert (a.tokens_in, a.tokens_out, a.running) == (50, 50, 0)
    t.finish(ticket, Usage(input_tokens=50, output_tokens=50), 0.0)  # settled once only
    assert a.tokens.level(0.0) == 900
    assert a.running == 0


def test_a_run_that_used_more_than_it_reserved_is_charged_below_zero() -> None:
    t = tenants(tenant(tokens_per_minute=600))
    a = t.identify(KEY_A)
    assert a is not None
    assert a.tokens is not None
    ticket = t.admit(a, 100, 0.0)
    t.finish(ticket, Usage(input_tokens=100, output_tokens=900), 0.0)
    assert a.tokens.level(0.0) == -400
    with pytest.raises(RateLimited) as err:
        t.admit(a, 10, 0.0)
    # 410 tokens short at 10 a second.
    assert err.value.retry_after_s == pytest.approx(41)


def test_a_request_larger_than_the_minute_can_never_be_admitted() -> None:
    t = tenants(tenant(tokens_per_minute=100))
    a = t.identify(KEY_A)
    assert a is not None
    with pytest.raises(RateLimited) as err:
        t.admit(a, 101, 0.0)
    assert err.value.retry_after_s == math.inf
    assert err.value.retry_after_header == "60"
    assert "Request too large" in err.value.message
    assert "max_tokens" in err.value.message


def test_concurrent_runs_are_counted_until_each_is_settled() -> None:
    t = tenants(tenant(max_concurrent_runs=1))
    a = t.identify(KEY_A)
    assert a is not None
    first = t.admit(a, 0, 0.0)
    with pytest.raises(RateLimited) as err:
        t.admit(a, 0, 0.0)
    assert err.value.limit == "concurrency"
    t.finish(first, None, 0.0)
    t.admit(a, 0, 0.0)


def test_a_refused_request_takes_nothing() -> None:
    t = tenants(tenant(requests_per_minute=10, tokens_per_minute=100, max_concurrent_runs=5))
    a = t.identify(KEY_A)
    assert a is not None
    assert a.requests is not None
    assert a.tokens is not None
    with pytest.raises(RateLimited):
        t.admit(a, 1000, 0.0)
    assert (a.requests.level(0.0), a.tokens.level(0.0), a.running) == (10, 100, 0)


def test_what_a_run_is_charged_by_its_outcome() -> None:
    used = Usage(input_tokens=3, output_tokens=4)
    cancelled = Cancelled(reason=CancelReason.CLIENT_DISCONNECT, usage=used)
    assert charged_usage(Complete(usage=used), "chat") == used
    assert charged_usage(cancelled, "chat") == used
    assert charged_usage(Error(code="backend_error", message="x"), "chat") == Usage()
    assert charged_usage(None, "chat") is None
    # A token count generates nothing: its count is no use of the model.
    assert charged_usage(Complete(usage=Usage(input_tokens=2404)), "tokenize") == Usage()
    assert charged_usage(cancelled, "tokenize") == Usage()


def test_what_a_request_reserves() -> None:
    chat = ChatRequest(model="m", messages=[Message(role="user", content="x" * 400)], max_tokens=50)
    # 100 tokens of text, 4 for the message, 50 of output.
    assert estimate_tokens(chat, 1024) == 154
    no_max = ChatRequest(model="m", messages=[Message(role="user", content="hi")])
    assert estimate_tokens(no_max, 1024) == 1 + 4 + 1024
    assert estimate_tokens(CompletionRequest(model="m", prompt=[1, 2, 3], max_tokens=5), 9) == 8
    assert estimate_tokens(CompletionRequest(model="m", prompt="abcdefgh"), 9) == 11
    assert estimate_tokens(EmbeddingRequest(model="m", inputs=["abcd" * 10, [1, 2]]), 9) == 12
    # A token count reserves nothing.
    assert estimate_tokens(TokenizeRequest(model="m", messages=chat.messages), 9) == 0


def test_what_a_prompt_counts_when_its_run_is_cancelled_after_output() -> None:
    chat = ChatRequest(model="m", messages=[Message(role="user", content="x" * 400)], max_tokens=50)
    assert estimate_prompt_tokens(chat) == 104
    assert estimate_prompt_tokens(CompletionRequest(model="m", prompt="abcdefgh")) == 2
    assert estimate_prompt_tokens(CompletionRequest(model="m", prompt=[1, 2, 3])) == 3
    assert estimate_prompt_tokens(EmbeddingRequest(model="m", inputs=["abcd", [1, 2]])) == 3
    assert estimate_prompt_tokens(TokenizeRequest(model="m", prompt="x" * 400)) == 0


# --- the headers --------------------------------------------------------------------


def test_openai_headers_say_limit_remaining_and_reset_as_openai_does() -> None:
    t = tenants(tenant(requests_per_minute=60, tokens_per_minute=6000))
    a = t.identify(KEY_A)
    assert a is not None
    ticket = t.admit(a, 2400, 0.0)
    assert headers_openai(ticket.limits) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "3600",
        "x-ratelimit-reset-tokens": "24s",
    }
    ticket = t.admit(a, 3599, 0.0)
    assert headers_openai(ticket.limits)["x-ratelimit-reset-tokens"] == "1m0s"


def test_anthropic_headers_give_each_reset_as_an_rfc3339_time() -> None:
    t = tenants(tenant(requests_per_minute=60))
    a = t.identify(KEY_A)
    assert a is not None
    ticket = t.admit(a, 0, 0.0)
    assert headers_anthropic(ticket.limits, wall=1_700_000_000.0) == {
        "anthropic-ratelimit-requests-limit": "60",
        "anthropic-ratelimit-requests-remaining": "59",
        "anthropic-ratelimit-requests-reset": "2023-11-14T22:13:21Z",
    }


# --- config -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "says"),
    [
        ('[[tenants]]\nname = "a"\nkey_sha256 = ["abc"]\n', "64 lower-case hex"),
        ('[[tenants]]\nname = "a b"\nkey_sha256 = ["' + "0" * 64 + '"]\n', "metrics label"),
        ('[[tenants]]\nname = "a"\nkey_sha256 = []\n', "no key_sha256"),
        (
            '[[tenants]]\nname = "a"\nkey_sha256 = ["'
            + "0" * 64
            + '"]\nrequests_per_minute = -1\n',
            ">= 0",
        ),
        (
            '[[tenants]]\nname = "a"\nkey_sha256 = ["' + "0" * 64 + '"]\n'
            '[[tenants]]\nname = "a"\nkey_sha256 = ["' + "1" * 64 + '"]\n',
            "used twice",
        ),
        (
            '[[tenants]]\nname = "a"\nkey_sha256 = ["' + "0" * 64 + '"]\n'
            '[[tenants]]\nname = "b"\nkey_sha256 = ["' + "0" * 64 + '"]\n',
            "also tenant 'a'",
        ),
        ('[[tenants]]\nname = "a"\nkey_sha256 = ["' + "0" * 64 + '"]\nrpm = 3\n', "rpm"),
        ("[tenancy]\ndefault_max_tokens = 0\n", "default_max_tokens"),
        (
            '[server]\napi_keys = ["k"]\n'
            '[[tenants]]\nname = "default"\nkey_sha256 = ["' + "0" * 64 + '"]\n',
            "'default' is the tenant of server.api_keys",
        ),
        (
            "[responses]\nstore_max_entries = 2\n"
            '[server]\napi_keys = ["k"]\n'
            '[[tenants]]\nname = "a"\nkey_sha256 = ["' + "0" * 64 + '"]\n'
            '[[tenants]]\nname = "b"\nkey_sha256 = ["' + "1" * 64 + '"]\n',
            "responses.store_max_entries (2) is less than the 3 tenants",
        ),
        (
            '[[tenants]]\nname = "a"\nkey_sha256 = ["' + "0" * 64 + '"]\n'
            'share_prefix_cache = "yes"\n',
            "share_prefix_cache",
        ),
        (
            '[[tenants]]\nname = "a"\nkey_sha256 = ["' + "0" * 64 + '"]\n'
            "share_prefix_caches = true\n",
            "share_prefix_caches",
        ),
        ('[tenancy]\ncache_salt_key = "fifteen-chars!!"\n', "at least 16 characters"),
        ('[tenancy]\ncache_salt = "a-salt-key-long-enough"\n', "cache_salt"),
    ],
)
def test_a_wrong_tenant_config_is_refused_saying_why(toml: str, says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        decode_config(tomllib.loads(toml), EdgeConfig, source="edge.toml")


def test_a_key_both_in_api_keys_and_a_tenant_is_refused() -> None:
    with pytest.raises(ValueError, match="also a tenant's key"):
        EdgeConfig(server=EdgeServer(api_keys=[KEY_A]), tenants=[tenant()])


# --- on the edge's HTTP side --------------------------------------------------------


# The operator's: with tenants, /admin and /metrics need an admin key.
ADMIN_KEY = "sk-tenants-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def tenant_config(*ts: TenantSettings) -> EdgeConfig:
    return msgspec.structs.replace(config(admin_keys=[ADMIN_KEY]), tenants=list(ts))


def openai_client(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


async def test_a_tenant_over_its_requests_gets_openais_429_with_its_headers() -> None:
    cfg = tenant_config(tenant("a", KEY_A, requests_per_minute=1), tenant("b", KEY_B))
    async with edge(cfg) as (handle, node, _), trio.open_nursery() as n:
        assert node is not None
        n.start_soon(
            answer,
            node,
            Start(),
            Delta("hi"),
            Complete(usage=Usage(input_tokens=1, output_tokens=1)),
        )
        client = openai_client(handle.url, KEY_A)
        other_client = openai_client(handle.url, KEY_B)
        async with client, other_client:
            await over_requests(handle.url, node, n, client, other_client)


async def over_requests(
    url: str,
    node: FakeNode,
    n: trio.Nursery,
    client: openai.AsyncOpenAI,
    other_client: openai.AsyncOpenAI,
) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}]
    )
    assert raw.headers["x-ratelimit-limit-requests"] == "1"
    assert raw.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(openai.RateLimitError) as err:
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
    resp = err.value.response
    assert resp.headers["retry-after"] == "60"
    assert resp.headers["x-ratelimit-remaining-requests"] == "0"
    assert err.value.code == "rate_limit_exceeded"
    assert "requests per minute" in err.value.message
    # Another tenant is not held back by a's limit.
    n.start_soon(
        answer,
        node,
        Start(),
        Delta("hi"),
        Complete(usage=Usage(input_tokens=1, output_tokens=1)),
    )
    other = await other_client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}]
    )
    assert other.choices[0].message.content == "hi"
    metrics = (await handle_get(url, "/metrics")).decode()
    assert 'iop_tenant_rate_limited_total{limit="requests",tenant="a"} 1.0' in metrics
    assert 'iop_tenant_runs_total{outcome="complete",tenant="a"} 1.0' in metrics
    assert 'iop_tenant_tokens_total{kind="output",tenant="b"} 1.0' in metrics


async def handle_get(url: str, path: str) -> bytes:
    import httpx

    async with httpx.AsyncClient(base_url=url) as c:
        r = await c.get(path, headers=ADMIN)
        r.raise_for_status()
        return r.content


async def test_a_tenant_over_its_tokens_gets_anthropics_429_on_messages() -> None:
    cfg = tenant_config(tenant("a", KEY_A, tokens_per_minute=100))
    async with edge(cfg) as (handle, _, _):
        client = anthropic.AsyncAnthropic(base_url=handle.url, api_key=KEY_A, max_retries=0)
        async with client:
            await over_tokens(client)


async def over_tokens(client: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(anthropic.RateLimitError) as err:
        await client.messages.create(
            model="m", max_tokens=500, messages=[{"role": "user", "content": "hi"}]
        )
    resp = err.value.response
    assert resp.headers["anthropic-ratelimit-tokens-limit"] == "100"
    assert resp.headers["anthropic-ratelimit-tokens-remaining"] == "100"
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", resp.headers["anthropic-ratelimit-tokens-reset"]
    )
    assert resp.headers["retry-after"] == "60"
    body = resp.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "rate_limit_error"
    assert "Request too large" in body["error"]["message"]


async def test_a_tenant_sees_and_uses_only_its_models() -> None:
    cfg = tenant_config(tenant("a", KEY_A, models=["other"]), tenant("b", KEY_B, models=["m"]))
    async with (
        edge(cfg) as (handle, _, _),
        openai_client(handle.url, KEY_A) as a,
        openai_client(handle.url, KEY_B) as b,
        openai_client(handle.url, "nobody") as nobody,
    ):
        await only_its_models(a, b, nobody)


async def only_its_models(
    a: openai.AsyncOpenAI, b: openai.AsyncOpenAI, nobody: openai.AsyncOpenAI
) -> None:
    assert [m.id async for m in a.models.list()] == []
    with pytest.raises(openai.NotFoundError) as err:
        await a.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert "does not exist or you do not have access to it" in err.value.message
    with pytest.raises(openai.NotFoundError):
        await a.models.retrieve("m")
    assert [m.id async for m in b.models.list()] == ["m"]
    with pytest.raises(openai.AuthenticationError):
        await nobody.models.list()


async def test_a_run_that_cannot_start_gives_its_reservation_back() -> None:
    cfg = tenant_config(tenant("a", KEY_A, max_concurrent_runs=1, tokens_per_minute=10_000))
    async with edge(cfg, with_node=False) as (handle, _, _):
        async with openai_client(handle.url, KEY_A) as client:
            await never_started(client)
        a = handle.core.tenants.all["a"]
        assert a.running == 0
        assert a.tokens is not None
        assert a.tokens.level(trio.current_time()) == 10_000


async def never_started(client: openai.AsyncOpenAI) -> None:
    for _ in range(3):  # no node: 503 each time, never 429
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=10
            )


async def test_a_cancelled_run_frees_its_tenants_slot_and_is_in_the_admin_view() -> None:
    cfg = tenant_config(tenant("a", KEY_A, max_concurrent_runs=1))
    async with edge(cfg) as (handle, node, client):
        assert node is not None
        headers = {"Authorization": f"Bearer {KEY_A}"}
        async with client.stream(
            "POST", "/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers
        ) as resp:
            assert resp.status_code == 200
            assigned = await node.assigns.receive()
            await node.send(assigned.assign.run_id, Start(), Delta("x"))
            async for _ in resp.aiter_bytes():
                break
            busy = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert busy.status_code == 429
            assert "concurrent runs" in busy.json()["error"]["message"]
        # The client left: the run ends cancelled, and its slot is free.
        a = handle.core.tenants.all["a"]
        with trio.fail_after(5):
            while a.running:
                await trio.sleep(0.01)
        summary = (await client.get("/admin/nodes", headers=ADMIN)).json()
        (row,) = summary["tenants"]
        assert row["name"] == "a"
        assert row["admitted"] == 1
        assert row["refused"] == 1
        runs = (await client.get("/admin/runs", headers=ADMIN)).json()
        assert runs["recent"][0]["tenant"] == "a"
        page = (await client.get("/admin", headers={**ADMIN, "Accept": "text/html"})).text
        assert "<h2>Tenants</h2>" in page
        assert "<td>a</td><td>normal / 1.0</td><td>all</td>" in page


async def test_a_run_the_node_cancels_after_output_is_charged_its_prompt() -> None:
    """The node's Cancelled (an idle timeout there) knows no prompt figure:
    the edge's run puts in the one admission reserved."""
    cfg = tenant_config(tenant("a", KEY_A, tokens_per_minute=10_000))
    body = {**CHAT, "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 50}
    async with edge(cfg) as (handle, node, client):
        assert node is not None
        headers = {"Authorization": f"Bearer {KEY_A}"}
        async with trio.open_nursery() as n:
            cancelled = Cancelled(
                reason=CancelReason.IDLE_TIMEOUT, usage=Usage(output_tokens=1, estimated=True)
            )
            n.start_soon(answer, node, Start(), Delta("x"), cancelled)
            resp = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert resp.status_code == 504
        a = handle.core.tenants.all["a"]
        with trio.fail_after(5):
            while a.running:
                await trio.sleep(0.01)
        # 100 tokens of text and 4 for the message; the output's one chunk.
        assert (a.tokens_in, a.tokens_out) == (104, 1)


async def test_count_tokens_of_a_model_the_tenant_may_not_use_is_a_404() -> None:
    cfg = tenant_config(tenant("a", KEY_A, models=["other"]))
    async with edge(cfg) as (_, _, client):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        r = await client.post("/v1/messages/count_tokens", json=body, headers={"x-api-key": KEY_A})
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "not_found_error"
        wrong = await client.post(
            "/v1/messages/count_tokens", json=body, headers={"x-api-key": "nobody"}
        )
        assert wrong.status_code == 401
