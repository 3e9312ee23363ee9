"""The sim's HTTP server beyond chat: embeddings, completions, tokenize, scripted tools.

Real sockets and real clients: the official ``openai`` SDK (run in a worker
thread, since it is synchronous and the server shares the test's trio loop)
and httpx for the bytes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, TypeVar

import httpx
import msgspec
import openai
import pytest
import trio

from iop.config import SimConfig
from iop.sim import (
    SimApp,
    build_completion_script,
    completion_stream_plan,
    create_sim_app,
    embedding_vector,
    models_body,
    parse_completion_request,
    serve_sim,
    tokenize,
)
from tests.sim._schemas import validate_completion, validate_completion_chunk, validate_embeddings

FAST = SimConfig(ttft_s=0.0, output_tokens=8, embedding_dim=32)
WAIT_S = 20.0  # generous: a shared, sometimes very busy machine
T = TypeVar("T")


@asynccontextmanager
async def running_sim(cfg: SimConfig = FAST) -> AsyncIterator[tuple[SimApp, str]]:
    app = create_sim_app(cfg)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        url: str = await nursery.start(
            partial(serve_sim, cfg, "127.0.0.1", 0, app=app, shutdown_trigger=stop.wait)
        )
        try:
            yield app, url
        finally:
            stop.set()


async def in_thread(fn: Callable[[], T]) -> T:
    with trio.fail_after(WAIT_S):
        return await trio.to_thread.run_sync(fn)


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, timeout=WAIT_S)


async def wait_until(predicate: Callable[[], bool]) -> None:
    with trio.fail_after(WAIT_S):
        while not predicate():
            await trio.sleep(0.01)


# --- embeddings ---------------------------------------------------------------------


async def test_openai_sdk_embeddings_get_the_deterministic_vectors() -> None:
    async with running_sim() as (app, url):
        client = sdk(url)
        try:
            # The SDK asks for base64 by default and decodes it itself.
            result = await in_thread(
                lambda: client.embeddings.create(model="iop-sim", input=["alpha", "beta"])
            )
            cut = await in_thread(
                lambda: client.embeddings.create(model="iop-sim", input="alpha", dimensions=8)
            )
        finally:
            client.close()
        assert app.sim_stats.embeddings_requests == 2
    assert [d.embedding for d in result.data] == [
        embedding_vector("alpha", dim=32),
        embedding_vector("beta", dim=32),
    ]
    assert result.usage.prompt_tokens == 2
    assert cut.data[0].embedding == embedding_vector("alpha", dim=32, dimensions=8)


async def test_embeddings_float_body_validates() -> None:
    body = {"model": "iop-sim", "input": [tokenize("x y"), tokenize("z")]}
    async with running_sim() as (_, url), httpx.AsyncClient(base_url=url) as client:
        resp = await client.post("/v1/embeddings", json=body)
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/json"
    validate_embeddings(resp.json())
    assert resp.json()["data"][0]["embedding"] == embedding_vector("x y", dim=32)


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"model": "gpt-9", "input": "x"}, 404, "The model `gpt-9` does not exist."),
        ({"model": "iop-sim", "input": "x", "dimensions": 0}, 400, "Dimensions must be"),
        ({"model": "iop-sim", "input": []}, 400, "must not be empty"),
        ({"model": "iop-sim", "input": "x", "iop_sim": {"failure": "http_429"}}, 429, "http_429"),
        ({"input": ["a"] * 3, "iop_sim": {"max_inputs": 2}}, 400, "more than the 2 allowed"),
    ],
)
async def test_embeddings_errors_are_vllm_bodies(
    body: dict[str, Any], status: int, message: str
) -> None:
    async with running_sim() as (_, url), httpx.AsyncClient(base_url=url) as client:
        resp = await client.post("/v1/embeddings", json=body)
    assert resp.status_code == status
    err = resp.json()["error"]
    assert list(err) == ["message", "type", "param", "code"]
    assert err["code"] == status
    assert message in err["message"]


@pytest.mark.parametrize("override", [{"ttft_s": 3600.0}, {"failure": "stall_before_first_byte"}])
async def test_a_client_that_leaves_an_embeddings_request_is_seen(
    override: dict[str, Any],
) -> None:
    body = {"model": "iop-sim", "input": "x", "iop_sim": override}
    async with running_sim() as (app, url), httpx.AsyncClient(base_url=url) as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(client.post, "/v1/embeddings", json=body))
            await wait_until(lambda: app.sim_stats.open_completions == 1)
            nursery.cancel_scope.cancel()
        await wait_until(lambda: app.sim_stats.client_disconnects == 1)
        assert app.sim_stats.open_completions == 0
        stats = (await client.get("/sim/stats")).json()
    assert stats["client_disconnects"] == 1
    assert stats["embeddings_requests"] == 1


async def test_embeddings_truncate_and_midstream_failures() -> None:
    async with running_sim() as (_, url), httpx.AsyncClient(base_url=url) as client:
        cut = await client.post(
            "/v1/embeddings", json={"input": "x", "iop_sim": {"failure": "truncate"}}
        )
        failed = await client.post(
            "/v1/embeddings", json={"input": "x", "iop_sim": {"failure": "midstream_error"}}
        )
    assert cut.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.content)
    assert failed.status_code == 500


# --- completions ----------------------------------------------------------------------


async def test_openai_sdk_completions_streamed_and_not() -> None:
    async with running_sim() as (app, url):
        client = sdk(url)
        try:
            whole = await in_thread(
                lambda: client.completions.create(model="iop-sim", prompt="Say hi", max_tokens=5)
            )

            def stream() -> list[Any]:
                return list(
                    client.completions.create(
                        model="iop-sim",
                        prompt="Say hi",
                        max_tokens=5,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                )

            chunks = await in_thread(stream)
        finally:
            client.close()
        assert app.sim_stats.completions_requests == 2
    assert whole.object == "text_completion"
    assert whole.choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5


async def test_streamed_completion_is_byte_exact() -> None:
    body = {"model": "iop-sim", "prompt": "Say hi", "stream": True}
    async with (
        running_sim() as (app, url),
        httpx.AsyncClient(base_url=url) as client,
        client.stream("POST", "/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
        raw = await resp.aread()
    assert app.sim_stats.streams_opened == 1
    first = json.loads(raw.split(b"\n\n")[0][len(b"data: ") :])
    script = build_completion_script(parse_completion_request(msgspec.json.encode(body)), FAST)
    plan = completion_stream_plan(script, created=first["created"], include_usage=False)
    assert raw == plan.body
    for block in raw.split(b"\n\n")[:-2]:
        validate_completion_chunk(json.loads(block[len(b"data: ") :]))


async def test_non_streamed_completion_validates() -> None:
    async with running_sim() as (_, url), httpx.AsyncClient(base_url=url) as client:
        resp = await client.post(
            "/v1/completions", json={"prompt": ["a", "b"], "stop": "zzz", "echo": True}
        )
        missing = await client.post("/v1/completions", json={"model": "iop-sim"})
    assert resp.status_code == 200
    validate_completion(resp.json())
    assert [c["text"][:1] for c in resp.json()["choices"]] == ["a", "b"]
    assert missing.status_code == 400
    assert missing.json()["error"]["param"] == "prompt"


async def test_completions_injected_failures_over_http() -> None:
    async with running_sim() as (_, url), httpx.AsyncClient(base_url=url) as client:
        limited = await client.post(
            "/v1/completions", json={"prompt": "x", "iop_sim": {"failure": "http_500"}}
        )
        bad_ids = await client.post("/detokenize", json={"tokens": [-1]})
    assert limited.status_code == 500
    assert limited.json()["error"]["type"] == "InternalServerError"
    assert bad_ids.status_code == 400
    assert "out of vocabulary" in bad_ids.json()["error"]["message"]


async def test_a_client_that_leaves_a_completions_stream_is_seen() -> None:
    # Far longer than WAIT_S at this pace; no longer: the sim builds the whole
    # answer before its headers (100,000 tokens outlasted httpx's 5 s under load).
    cfg = SimConfig(ttft_s=0.0, tokens_per_s=200, output_tokens=10_000)
    body = {"prompt": "x", "stream": True, "max_tokens": 10_000}
    async with running_sim(cfg) as (app, url), httpx.AsyncClient(base_url=url) as client:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            lines = 0
            async for line in resp.aiter_lines():
                lines += bool(line)
                if lines == 5:
                    break
            assert app.sim_stats.open_streams == 1
        await wait_until(lambda: app.sim_stats.client_disconnects == 1)
        assert app.sim_stats.streams_finished == 0


# --- tokenize -------------------------------------------------------------------------


async def test_tokenize_detokenize_and_the_unchanged_model_card() -> None:
    async with running_sim() as (app, url), httpx.AsyncClient(base_url=url) as client:
        tok = await client.post("/tokenize", json={"model": "iop-sim", "prompt": "Hello, world"})
        chat = await client.post(
            "/tokenize", json={"messages": [{"role": "user", "content": "Hello"}]}
        )
        detok = await client.post("/detokenize", json={"tokens": tok.json()["tokens"]})
        wrong = await client.post("/tokenize", json={"model": "gpt-9", "prompt": "x"})
        models = await client.get("/v1/models")
        assert app.sim_stats.tokenize_requests == 4
    assert tok.status_code == 200
    assert tok.json() == {
        "count": 3,
        "max_model_len": 32768,
        "tokens": tokenize("Hello, world"),
        "token_strs": None,
    }
    assert chat.json()["count"] == len(tokenize("<|user|>\nHello\n<|assistant|>\n"))
    assert detok.json() == {"prompt": "Hello, world"}
    assert wrong.status_code == 404
    assert wrong.json()["error"]["message"] == "The model `gpt-9` does not exist."
    # vLLM's model card says nothing about the endpoints: neither does the sim's.
    assert models.content == models_body("iop-sim", created=app.started_at)


# --- scripted tool mode over HTTP -------------------------------------------------------


async def test_scripted_tool_round_trip_through_the_openai_sdk() -> None:
    cfg = SimConfig(
        ttft_s=0.0,
        tool_call_names=("shell", "Bash"),
        tool_call_arguments='{"command": "echo iop-tool-ok"}',
    )
    tools: Any = [
        {
            "type": "function",
            "function": {
                "name": "Bash",
                "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
            },
        }
    ]
    messages: list[Any] = [{"role": "user", "content": "run it"}]
    async with running_sim(cfg) as (_, url):
        client = sdk(url)
        try:
            first = await in_thread(
                lambda: client.chat.completions.create(
                    model="iop-sim", messages=messages, tools=tools
                )
            )
            call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
            messages.append(first.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "iop-tool-ok\n"})
            second = await in_thread(
                lambda: client.chat.completions.create(
                    model="iop-sim", messages=messages, tools=tools
                )
            )
        finally:
            client.close()
    assert first.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "Bash"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"command": "echo iop-tool-ok"}  # type: ignore[union-attr]
    assert second.choices[0].message.content == "The tool said: iop-tool-ok"
