"""Completions, embeddings and token counts through every adapter.

The HTTP adapters run against the real sim server (``iop sim``'s app on a
loopback socket: vLLM's wire format) and against a scripted ``FakeBackend``
for what the sim does not do (llama.cpp's ``/tokenize`` dialect, oversize
bodies, stalls); the in-process sim adapter through the real runtime.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import msgspec
import pytest
import trio

from iop.adapters.openai_compat import OpenAICompatAdapter
from iop.adapters.sim import SimAdapter
from iop.adapters.vllm import VllmAdapter
from iop.config import Deadlines, OpenAICompatInstance, SimConfig, SimInstance, VllmInstance
from iop.events import (
    Cancelled,
    CancelReason,
    Complete,
    Delta,
    EmbeddingData,
    Error,
    FinishReason,
    RuntimeEvent,
    Start,
    TokenCount,
    Usage,
)
from iop.runtime import collect_run, open_run_supervisor
from iop.sim import (
    CompletionRequest as SimCompletionRequest,
)
from iop.sim import (
    build_completion_script,
    embedding_vector,
    serve_sim,
    tokenize,
    tokenize_chat,
)
from iop.spec import (
    CompletionRequest,
    EmbeddingRequest,
    ExecutionSpec,
    FunctionDef,
    Message,
    OperationRequest,
    TokenizeRequest,
    Tool,
)
from iop.testing import Reply, Split, open_fake_backend

SIM = SimConfig(ttft_s=0.0, output_tokens=8, embedding_dim=16)
MODEL = SIM.model
DEADLINES = Deadlines(first_token_timeout_s=10.0, idle_timeout_s=10.0, request_timeout_s=30.0)
MESSAGES = [
    Message(role="system", content="Be brief."),
    Message(role="user", content="How many tokens is this?"),
]

HTTPAdapter = VllmAdapter | OpenAICompatAdapter


@asynccontextmanager
async def sim_server(cfg: SimConfig = SIM) -> AsyncIterator[str]:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        url: str = await nursery.start(
            partial(serve_sim, cfg, "127.0.0.1", 0, shutdown_trigger=stop.wait)
        )
        try:
            yield url
        finally:
            stop.set()


def vllm(url: str, **options: object) -> VllmAdapter:
    return VllmAdapter(VllmInstance(name="v", endpoint=url, **options))  # type: ignore[arg-type]


def compat(url: str, **options: object) -> OpenAICompatAdapter:
    cfg = OpenAICompatInstance(name="c", endpoint=url, provider="llamacpp", **options)  # type: ignore[arg-type]
    return OpenAICompatAdapter(cfg)


async def run(adapter: HTTPAdapter | SimAdapter, request: OperationRequest) -> list[RuntimeEvent]:
    try:
        return await collect_run(adapter, ExecutionSpec(run_id="r1", request=request), DEADLINES)
    finally:
        await adapter.aclose()


def text(events: list[RuntimeEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


def expected_completion(prompt: str, max_tokens: int, cfg: SimConfig = SIM) -> str:
    script = build_completion_script(
        SimCompletionRequest(model=MODEL, prompt=prompt, max_tokens=max_tokens), cfg
    )
    return script.choices[0].text


# --- completions --------------------------------------------------------------------


@pytest.mark.parametrize("make", [vllm, compat])
async def test_completion_streams_the_text_of_v1_completions(make: object) -> None:
    async with sim_server() as url:
        adapter = make(url)  # type: ignore[operator]
        events = await run(
            adapter, CompletionRequest(model=MODEL, prompt="Once upon", max_tokens=5)
        )
    assert events[0] == Start(target=MODEL)
    assert text(events) == expected_completion("Once upon", 5)
    end = events[-1]
    assert isinstance(end, Complete)
    assert end.finish_reason is FinishReason.LENGTH
    assert end.usage == Usage(input_tokens=len(tokenize("Once upon")), output_tokens=5)
    assert all(isinstance(e, Delta) for e in events[1:-1])


async def test_completion_error_is_mapped_like_chat() -> None:
    async with sim_server() as url:
        events = await run(
            vllm(url), CompletionRequest(model="no-such-model", prompt="x", max_tokens=2)
        )
    end = events[-1]
    assert isinstance(end, Error)
    assert end.status == 404
    assert end.code == "model_not_found"
    assert end.message == "vllm returned 404: The model `no-such-model` does not exist."


async def test_completion_sends_the_request_fields_and_extra_body() -> None:
    async with open_fake_backend() as fb:
        body = (
            b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"ok",'
            b'"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
        )
        fb.script("/v1/completions", Reply.sse(body))
        request = CompletionRequest(
            model="m",
            prompt=[1, 2, 3],
            max_tokens=7,
            stop=["\n"],
            echo=True,
            extra_body={"top_k": 3},
        )
        events = await run(vllm(fb.url), request)
        (sent,) = await fb.wait_requests(1, 5.0)
    assert text(events) == "ok"
    assert isinstance(events[-1], Complete)
    assert sent.json == {
        "top_k": 3,
        "max_tokens": 7,
        "stop": ["\n"],
        "echo": True,
        "model": "m",
        "prompt": [1, 2, 3],
        "stream": True,
        "stream_options": {"include_usage": True},
    }


# --- embeddings ---------------------------------------------------------------------


@pytest.mark.parametrize("make", [vllm, compat])
async def test_embeddings_one_event_per_input_with_the_backends_vectors(make: object) -> None:
    inputs: list[str | list[int]] = ["alpha", "beta", tokenize("alpha")]
    async with sim_server() as url:
        events = await run(make(url), EmbeddingRequest(model=MODEL, inputs=inputs))  # type: ignore[operator]
    data = [e for e in events if isinstance(e, EmbeddingData)]
    assert [d.index for d in data] == [0, 1, 2]
    assert data[0].floats() == embedding_vector("alpha", dim=16, seed=SIM.seed)
    assert data[1].floats() == embedding_vector("beta", dim=16, seed=SIM.seed)
    assert data[2].vector == data[0].vector  # the ids of a text embed as the text
    end = events[-1]
    assert isinstance(end, Complete)
    assert end.usage.input_tokens == 2 * len(tokenize("alpha")) + len(tokenize("beta"))


async def test_embeddings_dimensions_are_passed_on() -> None:
    async with sim_server() as url:
        events = await run(vllm(url), EmbeddingRequest(model=MODEL, inputs=["a"], dimensions=4))
    (data,) = [e for e in events if isinstance(e, EmbeddingData)]
    assert data.floats() == embedding_vector("a", dim=16, seed=SIM.seed, dimensions=4)


async def test_embeddings_body_past_the_limit_fails_and_closes_the_connection() -> None:
    limit = 1024
    payload = {"data": [{"index": 0, "embedding": [0.125] * 1000}], "usage": {"prompt_tokens": 1}}
    async with open_fake_backend() as fb:
        fb.script("/v1/embeddings", Reply.json(payload, chunked=True, split=Split.every(256)))
        events = await run(
            vllm(fb.url, max_embedding_body_bytes=limit), EmbeddingRequest(model="m", inputs=["x"])
        )
        await fb.wait_client_closed(5.0)
    assert events[-1] == Error(
        message=f"vllm response body exceeds max_embedding_body_bytes={limit} bytes",
        status=502,
        code="backend_protocol_error",
    )


async def test_embeddings_base64_from_the_backend_is_taken_as_float32() -> None:
    raw = struct.pack("<3f", 0.5, -0.25, 1.0)
    payload = {"data": [{"index": 0, "embedding": base64.b64encode(raw).decode()}]}
    async with open_fake_backend() as fb:
        fb.script("/v1/embeddings", Reply.json(payload))
        events = await run(compat(fb.url), EmbeddingRequest(model="m", inputs=["x"]))
        (sent,) = await fb.wait_requests(1, 5.0)
    assert sent.json["encoding_format"] == "float"
    assert events[1] == EmbeddingData(index=0, vector=raw)
    assert events[-1] == Complete(usage=Usage(estimated=True))


async def test_embeddings_count_mismatch_is_a_protocol_error() -> None:
    payload = {"data": [{"index": 0, "embedding": [0.5]}], "usage": {"prompt_tokens": 2}}
    async with open_fake_backend() as fb:
        fb.script("/v1/embeddings", Reply.json(payload))
        events = await run(vllm(fb.url), EmbeddingRequest(model="m", inputs=["x", "y"]))
    end = events[-1]
    assert isinstance(end, Error)
    assert end.code == "backend_protocol_error"
    assert "1 embeddings for 2 inputs" in end.message


_STALLED_PATHS = {
    "embedding": ("/v1/embeddings", Reply.json({"data": []}, stall_before_headers=True)),
    "tokenize": ("/tokenize", Reply.json({"tokens": []}, stall_before_headers=True)),
    # Text streams, then the server stalls mid-stream.
    "completion": (
        "/v1/completions",
        Reply.sse(
            b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n' * 3,
            stall_after_bytes=60,
        ),
    ),
}
_REQUESTS: dict[str, OperationRequest] = {
    "embedding": EmbeddingRequest(model="m", inputs=["x"]),
    "tokenize": TokenizeRequest(model="m", prompt="x"),
    "completion": CompletionRequest(model="m", prompt="x", max_tokens=50),
}


@pytest.mark.parametrize("make", [vllm, compat])
@pytest.mark.parametrize("operation", sorted(_REQUESTS))
async def test_cancelled_run_closes_the_backend_socket(make: object, operation: str) -> None:
    path, reply = _STALLED_PATHS[operation]
    async with open_fake_backend() as fb:
        fb.script(path, reply)
        adapter = make(fb.url)  # type: ignore[operator]
        spec = ExecutionSpec(run_id="r1", request=_REQUESTS[operation])
        events: list[RuntimeEvent] = []
        async with open_run_supervisor() as sup:
            handle = sup.start_run(adapter, spec, DEADLINES)
            await fb.wait_requests(1, 5.0)
            handle.cancel(CancelReason.CLIENT_DISCONNECT)
            async for ev in handle.events:
                events.append(ev)
        conn = await fb.wait_client_closed(5.0)
        await adapter.aclose()
    assert conn.closed_by_client
    assert isinstance(events[-1], Cancelled)
    assert events[-1].reason is CancelReason.CLIENT_DISCONNECT


async def test_embeddings_stalled_backend_ends_with_the_first_token_deadline() -> None:
    async with open_fake_backend() as fb:
        fb.script("/v1/embeddings", Reply.json({"data": []}, stall_before_headers=True))
        adapter = vllm(fb.url)
        spec = ExecutionSpec(run_id="r1", request=EmbeddingRequest(model="m", inputs=["x"]))
        deadlines = Deadlines(first_token_timeout_s=0.3, idle_timeout_s=None, request_timeout_s=30)
        events = await collect_run(adapter, spec, deadlines)
        await fb.wait_client_closed(5.0)
        await adapter.aclose()
    assert isinstance(events[-1], Cancelled)
    assert events[-1].reason is CancelReason.FIRST_TOKEN_TIMEOUT


# --- tokenize -----------------------------------------------------------------------


async def test_vllm_tokenize_prompt_and_messages() -> None:
    async with sim_server() as url:
        by_prompt = await run(vllm(url), TokenizeRequest(model=MODEL, prompt="Hello, world"))
        by_messages = await run(vllm(url), TokenizeRequest(model=MODEL, messages=MESSAGES))
    assert by_prompt[1] == TokenCount(count=len(tokenize("Hello, world")))
    assert by_messages[1] == TokenCount(count=len(tokenize_chat(MESSAGES)))
    assert by_messages[-1] == Complete(usage=Usage(input_tokens=len(tokenize_chat(MESSAGES))))


async def test_openai_compat_tokenize_llamacpp_dialect() -> None:
    async with open_fake_backend() as fb:
        fb.script("/apply-template", Reply.json({"prompt": "<|user|>hi<|assistant|>"}))
        fb.script("/tokenize", Reply.json({"tokens": [1, 2, 3, 4, 5]}))
        tools = [Tool(function=FunctionDef(name="f", parameters={"type": "object"}))]
        request = TokenizeRequest(model="m", messages=MESSAGES, tools=tools)
        events = await run(compat(fb.url), request)
        template, tok = await fb.wait_requests(2, 5.0)
    assert template.path == "/apply-template"
    assert template.json["messages"] == msgspec.to_builtins(MESSAGES)
    assert template.json["tools"] == msgspec.to_builtins(tools)
    assert tok.path == "/tokenize"
    assert tok.json["content"] == "<|user|>hi<|assistant|>"
    assert events[1] == TokenCount(count=5)


async def test_openai_compat_without_tokenizer_endpoints_estimates() -> None:
    async with open_fake_backend() as fb:  # every path is a 404
        events = await run(compat(fb.url), TokenizeRequest(model="m", prompt="x" * 40))
    assert events[1] == TokenCount(count=10, estimated=True)
    assert events[-1] == Complete(usage=Usage(input_tokens=10, estimated=True))


async def test_openai_compat_tokenize_against_a_vllm_style_server() -> None:
    async with sim_server() as url:
        events = await run(compat(url), TokenizeRequest(model=MODEL, prompt="Hello, world"))
    assert events[1] == TokenCount(count=len(tokenize("Hello, world")))


async def test_tokenize_server_error_is_mapped() -> None:
    async with open_fake_backend() as fb:
        fb.script("/tokenize", Reply.json({"error": {"message": "boom"}}, status=500))
        events = await run(vllm(fb.url), TokenizeRequest(model="m", prompt="x"))
    end = events[-1]
    assert isinstance(end, Error)
    assert end.status == 500
    assert "boom" in end.message


async def test_a_tokenize_answer_past_the_limit_is_counted_by_the_estimate() -> None:
    """A long prompt's ids outgrow max_tokenize_body_bytes (the sim's, as
    vLLM's answer: ``{"count", "max_model_len", "tokens", "token_strs"}``):
    the count is IOP's estimate, said so, never a 502 (docs/api.md,
    "count_tokens")."""
    prompt = "word " * 1000  # 1,000 ids of a dozen digits each: ~13 KB of answer
    async with sim_server() as url:
        exact = await run(vllm(url), TokenizeRequest(model=MODEL, prompt=prompt))
        over = await run(
            vllm(url, max_tokenize_body_bytes=4096), TokenizeRequest(model=MODEL, prompt=prompt)
        )
    assert exact[1] == TokenCount(count=len(tokenize(prompt)))
    assert over[1] == TokenCount(count=(len(prompt) + 3) // 4, estimated=True)
    assert over[-1] == Complete(usage=Usage(input_tokens=1250, estimated=True))


async def test_an_apply_template_answer_past_the_limit_is_counted_by_the_estimate() -> None:
    async with open_fake_backend() as fb:
        fb.script("/apply-template", Reply.json({"prompt": "x" * 1000}))
        request = TokenizeRequest(model="m", messages=[Message(role="user", content="x" * 40)])
        events = await run(compat(fb.url, max_tokenize_body_bytes=100), request)
        (template,) = await fb.wait_requests(1, 5.0)
        # The rest of the answer is left unread: its connection is closed.
        await fb.wait_client_closed(5.0)
    assert template.path == "/apply-template"
    # 44 characters (text and role) and 4 tokens of template.
    assert events[1] == TokenCount(count=11 + 4, estimated=True)


# --- capabilities -------------------------------------------------------------------


async def test_http_instances_advertise_their_operations() -> None:
    async with sim_server() as url:
        default = vllm(url)
        configured = vllm(url, operations=["embedding", "tokenize"])
        try:
            assert (await default.capabilities()).operations == ("chat", "completion", "tokenize")
            assert (await configured.capabilities()).operations == ("embedding", "tokenize")
        finally:
            await default.aclose()
            await configured.aclose()


def test_unknown_operation_in_config_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown operations"):
        VllmInstance(name="v", endpoint="http://h", operations=["chat", "rerank"])


# --- the in-process sim -------------------------------------------------------------


def sim_adapter(**sim: object) -> SimAdapter:
    return SimAdapter(SimInstance(name="s", sim=msgspec.structs.replace(SIM, **sim)))


async def test_sim_adapter_serves_every_operation() -> None:
    a = sim_adapter()
    assert (await a.capabilities()).operations == ("chat", "completion", "embedding", "tokenize")
    done = await run(a, CompletionRequest(model=MODEL, prompt="Once upon", max_tokens=5))
    assert text(done) == expected_completion("Once upon", 5)
    assert done[-1] == Complete(
        finish_reason=FinishReason.LENGTH,
        usage=Usage(input_tokens=len(tokenize("Once upon")), output_tokens=5),
    )
    emb = await run(a, EmbeddingRequest(model=MODEL, inputs=["a", "b"], dimensions=8))
    assert [e.floats() for e in emb if isinstance(e, EmbeddingData)] == [
        embedding_vector(t, dim=16, seed=SIM.seed, dimensions=8) for t in ("a", "b")
    ]
    tok = await run(a, TokenizeRequest(model=MODEL, messages=MESSAGES))
    assert tok[1] == TokenCount(count=len(tokenize_chat(MESSAGES)))


async def test_sim_adapter_completion_injected_failure() -> None:
    events = await run(
        sim_adapter(failure="http_500"), CompletionRequest(model=MODEL, prompt="x", max_tokens=3)
    )
    end = events[-1]
    assert isinstance(end, Error)
    assert end.status == 500


async def test_sim_adapter_embedding_refuses_too_many_dimensions() -> None:
    events = await run(sim_adapter(), EmbeddingRequest(model=MODEL, inputs=["a"], dimensions=99))
    end = events[-1]
    assert isinstance(end, Error)
    assert end.status == 400
    assert "dimensions 99 is more than" in end.message
