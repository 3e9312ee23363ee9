"""What each adapter tells its backend of a run's prefix-cache namespace
(``ExecutionSpec.cache_salt``; docs/operations.md, "Tenants and limits",
"Prefix caches"), read byte for byte off a ``FakeBackend`` on a loopback
socket.

vLLM (``cache_salt`` in chat and completion requests) and SGLang get the
salt, in place of any a client sent itself (the edge folded that into it);
an OpenAI-compatible server of another engine gets none, since one that
refuses unknown fields would fail every run; a run without a salt (a
tenant that shares its cache) sends none, and a client's own key then
passes through as before.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any, Final

import pytest

from iop.adapters.openai_compat import OpenAICompatAdapter
from iop.adapters.vllm import VllmAdapter
from iop.config import Deadlines, OpenAICompatInstance, VllmInstance
from iop.events import Complete
from iop.runtime import collect_run
from iop.spec import ChatRequest, CompletionRequest, ExecutionSpec, Message, OperationRequest
from iop.testing import CHAT_COMPLETIONS_PATH, FakeBackend, Reply, open_fake_backend

DEADLINES = Deadlines(first_token_timeout_s=10.0, idle_timeout_s=10.0, request_timeout_s=30.0)
# What the edge makes: 32 bytes, URL-safe base64 without padding.
SALT: Final = base64.urlsafe_b64encode(bytes(range(32))).rstrip(b"=").decode()
COMPLETIONS_PATH: Final = "/v1/completions"
CHAT_SSE: Final = (
    b'data: {"object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"content":"ok"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
)
TEXT_SSE: Final = (
    b'data: {"object":"text_completion","choices":[{"index":0,"text":"ok",'
    b'"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
)


@pytest.fixture
async def fb() -> AsyncIterator[FakeBackend]:
    async with open_fake_backend() as backend:
        backend.route(CHAT_COMPLETIONS_PATH, Reply.sse(CHAT_SSE))
        backend.route(COMPLETIONS_PATH, Reply.sse(TEXT_SSE))
        yield backend


def vllm(url: str) -> VllmAdapter:
    return VllmAdapter(VllmInstance(name="v", endpoint=url))


def compat(url: str, engine: str = "none") -> OpenAICompatAdapter:
    return OpenAICompatAdapter(
        OpenAICompatInstance(name="c", endpoint=url, engine=engine)  # type: ignore[arg-type]
    )


def chat(**extra: Any) -> ChatRequest:
    return ChatRequest(
        model="m", messages=[Message(role="user", content="hi")], extra_body=extra or None
    )


def completion(**extra: Any) -> CompletionRequest:
    return CompletionRequest(model="m", prompt="Once upon", extra_body=extra or None)


async def sent(
    adapter: VllmAdapter | OpenAICompatAdapter,
    fb: FakeBackend,
    request: OperationRequest,
    salt: str,
) -> bytes:
    """The raw body ``adapter`` sent for a run of ``request`` with ``salt``."""
    spec = ExecutionSpec(run_id="r1", request=request, cache_salt=salt)
    try:
        events = await collect_run(adapter, spec, DEADLINES)
    finally:
        await adapter.aclose()
    assert isinstance(events[-1], Complete), events
    return fb.requests[-1].body


@pytest.mark.parametrize("request_", [chat(), completion()], ids=["chat", "completion"])
async def test_vllm_gets_the_runs_salt(fb: FakeBackend, request_: OperationRequest) -> None:
    body = await sent(vllm(fb.url), fb, request_, SALT)
    assert f'"cache_salt":"{SALT}"'.encode() in body
    assert body.count(b'"cache_salt"') == 1


@pytest.mark.parametrize(
    "request_", [chat(cache_salt="mine"), completion(cache_salt="mine")], ids=["chat", "completion"]
)
async def test_the_runs_salt_wins_over_the_clients(
    fb: FakeBackend, request_: OperationRequest
) -> None:
    body = await sent(vllm(fb.url), fb, request_, SALT)
    assert json.loads(body)["cache_salt"] == SALT
    assert b'"mine"' not in body


async def test_sglang_gets_the_runs_salt(fb: FakeBackend) -> None:
    body = await sent(compat(fb.url, engine="sglang"), fb, chat(), SALT)
    assert f'"cache_salt":"{SALT}"'.encode() in body


@pytest.mark.parametrize("engine", ["none", "llamacpp"])
@pytest.mark.parametrize("request_", [chat(), completion()], ids=["chat", "completion"])
async def test_an_openai_compatible_server_gets_no_salt(
    fb: FakeBackend, engine: str, request_: OperationRequest
) -> None:
    body = await sent(compat(fb.url, engine=engine), fb, request_, SALT)
    assert b"cache_salt" not in body
    assert SALT.encode() not in body


@pytest.mark.parametrize("request_", [chat(), completion()], ids=["chat", "completion"])
async def test_a_run_without_a_salt_sends_none(fb: FakeBackend, request_: OperationRequest) -> None:
    body = await sent(vllm(fb.url), fb, request_, "")
    assert b"cache_salt" not in body


async def test_without_a_salt_a_clients_own_key_passes_through(fb: FakeBackend) -> None:
    body = await sent(vllm(fb.url), fb, chat(cache_salt="mine"), "")
    assert json.loads(body)["cache_salt"] == "mine"
