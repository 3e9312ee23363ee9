"""Edge configuration end to end: client API keys and the per-model output policy.

The module's edge requires an API key and applies, to every model (``"*"``),
the strictest output policy of seed 001: ``strict`` (no reasoning reaches the
client), ``stream_buffer`` (the whole answer is buffered and sent at once,
with keep-alive comments meanwhile) and ``text_tool_calls = "always"`` (tool
calls printed as text are turned into tool calls even when the node did not
use the text-tool fallback).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Final

import httpx
import openai
import pytest

from tests.e2e._platform import MODEL, Cluster, Edge, read_stream, validated_completion
from tests.edge._openai_schema import validate_chunk, validate_error

KEY: Final = "sk-e2e-secret"
EDGE_CONFIG: dict[str, Any] = {
    "server": {"keepalive_interval_s": 0.2, "api_keys": [KEY]},
    "models": {"*": {"strict": True, "stream_buffer": True, "text_tool_calls": "always"}},
}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture
def client(cluster: Cluster) -> Iterator[openai.OpenAI]:
    with cluster.edge.openai() as c:
        yield c


def test_api_keys(edge: Edge, client: openai.OpenAI) -> None:
    with openai.OpenAI(
        base_url=f"{edge.url}/v1", api_key="sk-wrong", max_retries=0, timeout=30
    ) as wrong:
        with pytest.raises(openai.AuthenticationError) as info:
            wrong.models.list()
        validate_error(info.value.response.json())
        with pytest.raises(openai.AuthenticationError) as info:
            wrong.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
        assert info.value.code == "invalid_api_key"
    # Health and readiness stay open (load balancers carry no key).
    assert edge.get("/healthz").status_code == 200
    assert edge.get("/readyz").status_code == 200
    assert [m.id for m in client.models.list()] == [MODEL]


def test_strict_buffered_stream(edge: Edge, client: openai.OpenAI) -> None:
    opts = {"iop_sim": {"reasoning_tokens": 5, "output_tokens": 10, "tokens_per_s": 10.0}}
    with client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, extra_body=opts
    ) as stream:
        r = read_stream(stream)
    # The role chunk, the whole answer in one chunk, the finish chunk.
    assert len(r.chunks) == 3
    assert r.chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len(r.content_deltas) == 1
    assert len(r.content.split()) == 10
    assert r.reasoning == ""
    assert all("reasoning_content" not in c["choices"][0]["delta"] for c in r.chunks)
    assert r.finish_reason == "stop"

    completion = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=opts)
    validated_completion(completion)
    assert completion.choices[0].message.content == r.content
    assert "reasoning_content" not in (completion.choices[0].message.model_extra or {})


def test_buffered_stream_sends_keepalives_while_it_buffers(
    edge: Edge, client: openai.OpenAI
) -> None:
    """A raw client sees the SSE comments the SDK hides: traffic while the answer buffers."""
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "stream": True,
        "iop_sim": {"output_tokens": 10, "tokens_per_s": 10.0},
    }
    with httpx.Client(trust_env=False, timeout=30) as h:
        resp = h.post(
            f"{edge.url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
        )
    assert resp.status_code == 200
    frames = [f for f in resp.text.split("\n\n") if f]
    assert ": keep-alive" in frames
    data = [f.removeprefix("data: ") for f in frames if f.startswith("data: ")]
    assert data[-1] == "[DONE]"
    for d in data[:-1]:
        validate_chunk(json.loads(d))
    # The keep-alives came between the role chunk and the buffered answer.
    first_data = frames.index(next(f for f in frames if f.startswith("data: ")))
    assert frames.index(": keep-alive") > first_data


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_text_tool_calls_always(client: openai.OpenAI, stream: bool) -> None:
    """The model prints a Hermes ``<tool_call>`` although its server took the tools
    natively (no fallback): policy ``always`` still makes it a tool call."""
    opts = {"iop_sim": {"tool_mode": "text"}}
    if stream:
        with client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[WEATHER_TOOL], stream=True, extra_body=opts
        ) as s:
            r = read_stream(s)
        finish, content, call = r.finish_reason, r.content, r.tool_calls[0]
    else:
        completion = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[WEATHER_TOOL], extra_body=opts
        )
        obj = validated_completion(completion)
        choice = obj["choices"][0]
        finish, content = choice["finish_reason"], choice["message"]["content"] or ""
        (tc,) = choice["message"]["tool_calls"]
        call = {"id": tc["id"], **tc["function"]}
    assert finish == "tool_calls"
    assert call["name"] == "get_weather"
    assert call["id"]
    assert "city" in json.loads(call["arguments"])
    assert "tool_call" not in content
