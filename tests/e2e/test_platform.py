"""The platform end to end: the official OpenAI SDK → ``iop edge`` → ``iop node`` → ``iop sim``.

Three real processes on loopback (``conftest.py``): the client's request
crosses the edge's HTTP API, the WebSocket link, the node's ``vllm`` adapter
and HTTP to the simulated vLLM server, and back. Every chunk and body the SDK
returns is validated against OpenAI's own schemas. The sim is driven per
request with ``extra_body={"iop_sim": {...}}``, which only works because the
edge passes unknown keys through to the backend (asserted below).
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest

from tests.e2e._platform import (
    MODEL,
    Cluster,
    Proc,
    StreamResult,
    poll,
    read_more,
    read_stream,
    validated_completion,
)
from tests.edge._openai_schema import validate_chunk, validate_error

MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]

WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

# A client going away must reach the backend (another process) this fast.
DISCONNECT_BOUND_S = 10.0


def sim_opts(**overrides: Any) -> dict[str, Any]:
    return {"iop_sim": overrides}


def empty_result() -> StreamResult:
    return StreamResult([], "", [], "", {}, None, None)


def error_body(exc: openai.APIStatusError) -> dict[str, Any]:
    body: dict[str, Any] = exc.response.json()
    validate_error(body)
    return body


# --- 1. text ---------------------------------------------------------------------------


def test_streaming_text(cluster: Cluster, client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, extra_body=sim_opts(output_tokens=12)
    )
    with stream:
        r = read_stream(stream)
    # The SDK stopped at [DONE] and released the connection.
    assert stream.response.is_closed
    first = r.chunks[0]
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert not first["choices"][0]["delta"].get("content")
    # ``output_tokens`` reached the sim: the unknown key ``iop_sim`` crossed
    # the edge, the link and the adapter (the sim's default is 64 tokens).
    assert len(r.content_deltas) == 12
    assert r.content.strip()
    assert r.finish_reason == "stop"
    last = r.chunks[-1]
    assert last["choices"][0]["finish_reason"] == "stop"
    assert last["choices"][0]["delta"] == {}
    assert len({c["id"] for c in r.chunks}) == 1
    assert r.chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["model"] == MODEL for c in r.chunks)
    assert all(c["object"] == "chat.completion.chunk" for c in r.chunks)
    assert r.usage is None  # not asked for


def test_non_streaming_text_is_the_same_answer(cluster: Cluster, client: openai.OpenAI) -> None:
    opts = sim_opts(output_tokens=12)
    completion = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=opts)
    obj = validated_completion(completion)
    assert obj["object"] == "chat.completion"
    assert obj["id"].startswith("chatcmpl-")
    assert obj["model"] == MODEL
    (choice,) = obj["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "stop"
    usage = obj["usage"]
    assert usage["prompt_tokens"] > 0
    assert usage["completion_tokens"] >= 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # The sim is deterministic: the streamed answer to the same request is the same text.
    with client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, extra_body=opts
    ) as stream:
        streamed = read_stream(stream)
    assert choice["message"]["content"] == streamed.content
    # And a different seed gives a different answer: the override is real.
    other = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, extra_body=sim_opts(output_tokens=12, seed=7)
    )
    assert other.choices[0].message.content != choice["message"]["content"]


def test_max_tokens_gives_finish_reason_length(cluster: Cluster, client: openai.OpenAI) -> None:
    with client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, max_tokens=3
    ) as stream:
        r = read_stream(stream)
    assert len(r.content_deltas) == 3
    assert r.finish_reason == "length"
    completion = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    obj = validated_completion(completion)
    assert obj["choices"][0]["finish_reason"] == "length"
    assert obj["usage"]["completion_tokens"] == 3
    completion = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=2
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 2


def test_stream_options_include_usage(cluster: Cluster, client: openai.OpenAI) -> None:
    with client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=sim_opts(output_tokens=5),
    ) as stream:
        r = read_stream(stream)
    assert r.finish_reason == "stop"
    last = r.chunks[-1]
    assert last["choices"] == []  # OpenAI's usage chunk
    usage = last["usage"]
    assert usage["completion_tokens"] >= 5
    assert usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # Every other chunk says ``"usage": null``.
    assert all(c.get("usage", "missing") is None for c in r.chunks[:-1])


def test_unicode_and_long_prompt_round_trip(cluster: Cluster, client: openai.OpenAI) -> None:
    long_text = "Ünïcödé ✓ 汉字 🙂 " * 2000  # ~40 KB of multi-byte text through every hop
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": long_text},
        ],
        extra_body=sim_opts(output_tokens=4),
    )
    obj = validated_completion(completion)
    assert obj["choices"][0]["finish_reason"] == "stop"
    assert obj["usage"]["prompt_tokens"] > 1000


# --- 2. reasoning ------------------------------------------------------------------------


def test_reasoning_reaches_the_client(cluster: Cluster, client: openai.OpenAI) -> None:
    opts = sim_opts(reasoning_tokens=6, output_tokens=4)
    with client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=opts,
    ) as stream:
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
    r = empty_result()
    for chunk in chunks:
        read_more(iter([chunk]), r)
    # Through the SDK's objects, as a user reads them.
    reasoning = [
        getattr(c.choices[0].delta, "reasoning_content", None)
        for c in chunks
        if c.choices and c.choices[0].delta.model_extra
    ]
    assert [x for x in reasoning if x]
    assert r.reasoning.strip()
    assert len(r.content_deltas) == 4
    # Reasoning comes first, then the answer.
    kinds = []
    for c in r.chunks:
        delta = c["choices"][0]["delta"] if c["choices"] else {}
        if delta.get("reasoning_content"):
            kinds.append("r")
        elif delta.get("content"):
            kinds.append("c")
    assert kinds == ["r"] * kinds.count("r") + ["c"] * 4
    assert r.usage is not None
    assert r.usage["completion_tokens_details"]["reasoning_tokens"] == 6

    completion = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=opts)
    obj = validated_completion(completion)
    message = completion.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content") == r.reasoning
    assert message.content == r.content
    assert obj["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6


# --- 3. tool calls -------------------------------------------------------------------------


def _assert_weather_call(call: dict[str, Any]) -> None:
    assert call["id"]
    assert call["name"] == "get_weather"
    args = json.loads(call["arguments"])
    assert isinstance(args, dict)
    assert isinstance(args["city"], str)


def test_native_tool_calls_streamed(cluster: Cluster, client: openai.OpenAI) -> None:
    with client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER_TOOL],
        stream=True,
        extra_body=sim_opts(tool_mode="native"),
    ) as stream:
        r = read_stream(stream)
    assert r.finish_reason == "tool_calls"
    assert list(r.tool_calls) == [0]
    _assert_weather_call(r.tool_calls[0])
    assert "<tool_call" not in r.content

    completion = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER_TOOL], extra_body=sim_opts()
    )
    obj = validated_completion(completion)
    (choice,) = obj["choices"]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function"
    _assert_weather_call({"id": call["id"], **call["function"]})


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_tool_calls_synthesised_from_text(
    cluster: Cluster, client: openai.OpenAI, stream: bool
) -> None:
    """vLLM without --enable-auto-tool-choice: the adapter's fallback chain ends in
    the text-tool fallback, the model prints ``<tool_call>``, the edge turns it
    into tool calls, and no raw tool-call text reaches the client."""
    refused = cluster.sim.stats()["statuses"].get("400", 0)
    opts = sim_opts(auto_tool_choice=False)
    if stream:
        with client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[WEATHER_TOOL], stream=True, extra_body=opts
        ) as s:
            r = read_stream(s)
        finish, calls, content = r.finish_reason, r.tool_calls, r.content
        assert list(calls) == [0]
        call = calls[0]
    else:
        completion = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[WEATHER_TOOL], extra_body=opts
        )
        obj = validated_completion(completion)
        (choice,) = obj["choices"]
        finish, content = choice["finish_reason"], choice["message"]["content"] or ""
        (tc,) = choice["message"]["tool_calls"]
        call = {"id": tc["id"], **tc["function"]}
    assert finish == "tool_calls"
    _assert_weather_call(call)
    assert "<tool_call" not in content
    assert "</tool_call" not in content
    # The backend really refused twice (auto tool choice, then the forced
    # tool) before the text fallback went through.
    assert cluster.sim.stats()["statuses"].get("400", 0) == refused + 2


@pytest.mark.parametrize("fallback", [False, True], ids=["native", "text-fallback"])
def test_agent_loop(cluster: Cluster, client: openai.OpenAI, fallback: bool) -> None:
    """A whole tool round trip: the assistant's tool call and the tool's result go
    back in full OpenAI shape (through the text-tool prompt in the fallback), and
    the model answers in text."""
    opts = sim_opts(auto_tool_choice=not fallback)
    messages: list[Any] = [*MESSAGES]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], extra_body=opts
    )
    validated_completion(first)
    assert first.choices[0].finish_reason == "tool_calls"
    message = first.choices[0].message
    assert message.tool_calls
    messages.append(message.to_dict())
    messages.append(
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": '{"celsius": 21}'}
    )
    for stream in (False, True):
        if stream:
            with client.chat.completions.create(
                model=MODEL, messages=messages, tools=[WEATHER_TOOL], stream=True, extra_body=opts
            ) as s:
                r = read_stream(s)
            finish, content, calls = r.finish_reason, r.content, r.tool_calls
        else:
            second = client.chat.completions.create(
                model=MODEL, messages=messages, tools=[WEATHER_TOOL], extra_body=opts
            )
            validated_completion(second)
            choice = second.choices[0]
            finish, content, calls = choice.finish_reason, choice.message.content or "", {}
            assert choice.message.tool_calls is None
        assert finish == "stop"
        assert content.strip()
        assert "tool_call" not in content
        assert calls == {}


# --- 4. errors ----------------------------------------------------------------------------


def test_bad_request_is_400(cluster: Cluster, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "wizard", "content": "hi"}],  # type: ignore[misc,list-item]
        )
    body = error_body(info.value)
    assert body["error"]["param"] == "messages[0].role"
    assert info.value.code == body["error"]["code"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, stream=True)
    assert error_body(info.value)["error"]["param"] == "n"
    # Not JSON at all (the SDK cannot send that): the same OpenAI error shape.
    resp = cluster.edge.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400
    validate_error(resp.json())


def test_unknown_model_is_404(cluster: Cluster, client: openai.OpenAI) -> None:
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(model="no-such-model", messages=MESSAGES, stream=stream)
        body = error_body(info.value)
        assert body["error"]["code"] == "model_not_found"
        assert "no-such-model" in body["error"]["message"]


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
@pytest.mark.parametrize(
    ("failure", "exc_type", "status", "text"),
    [
        ("http_429", openai.RateLimitError, 429, "too many requests"),
        ("http_500", openai.InternalServerError, 500, "injected failure (http_500)"),
    ],
)
def test_backend_http_errors_pass_through_before_output(
    cluster: Cluster,
    client: openai.OpenAI,
    stream: bool,
    failure: str,
    exc_type: type[openai.APIStatusError],
    status: int,
    text: str,
) -> None:
    with pytest.raises(exc_type) as info:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=stream, extra_body=sim_opts(failure=failure)
        )
    assert info.value.status_code == status
    body = error_body(info.value)
    assert text in body["error"]["message"]  # the backend's own words
    if status == 429:
        assert info.value.response.headers["retry-after"] == "1"
        assert body["error"]["type"] == "rate_limit_error"


def test_mid_stream_backend_error(cluster: Cluster, client: openai.OpenAI) -> None:
    opts = sim_opts(failure="midstream_error", fail_after_tokens=3)
    r = empty_result()
    with (
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, extra_body=opts
        ) as stream,
        pytest.raises(openai.APIError) as info,
    ):
        read_more(iter(stream), r)
    assert not isinstance(info.value, openai.APIStatusError)  # an SSE error, after a 200
    assert len(r.content_deltas) == 3
    assert r.finish_reason is None
    assert "sim: injected mid-stream error" in info.value.message
    assert isinstance(info.value.body, dict)
    validate_error({"error": info.value.body})

    # Not streamed: a 5xx with the backend's message.
    with pytest.raises(openai.InternalServerError) as status_info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=opts)
    assert "sim: injected mid-stream error" in error_body(status_info.value)["error"]["message"]


def test_mid_stream_error_on_the_wire(cluster: Cluster) -> None:
    """What the SDK turns into APIError: a 200, chunks, one OpenAI error object, ``[DONE]``."""
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "stream": True,
        **sim_opts(failure="midstream_error", fail_after_tokens=2),
    }
    resp = cluster.edge.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    frames = [f.removeprefix("data: ") for f in resp.text.split("\n\n") if f.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])
    validate_error(error)
    assert "sim: injected mid-stream error" in error["error"]["message"]
    chunks = [json.loads(f) for f in frames[:-2]]
    for chunk in chunks:
        validate_chunk(chunk)
    assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content")) == 2


def test_truncated_backend_stream_is_an_error(cluster: Cluster, client: openai.OpenAI) -> None:
    r = empty_result()
    with (
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            stream=True,
            extra_body=sim_opts(failure="truncate", fail_after_tokens=3),
        ) as stream,
        pytest.raises(openai.APIError) as info,
    ):
        read_more(iter(stream), r)
    assert len(r.content_deltas) == 3
    assert "[DONE]" in info.value.message


def test_malformed_backend_chunks_are_tolerated(cluster: Cluster, client: openai.OpenAI) -> None:
    """One undecodable chunk from the backend is counted and skipped, not fatal."""
    with client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        stream=True,
        extra_body=sim_opts(failure="malformed_chunk", fail_after_tokens=3, output_tokens=8),
    ) as stream:
        r = read_stream(stream)
    assert r.finish_reason == "stop"
    assert len(r.content_deltas) == 8


def test_oversized_body_is_413(cluster: Cluster, client: openai.OpenAI) -> None:
    big = "x" * (300 * 1024)  # over the edge's max_body_bytes (256 KiB)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": big}])
    assert info.value.status_code == 413
    error_body(info.value)
    assert cluster.sim.stats()["open_streams"] == 0


# --- 5. client disconnects ---------------------------------------------------------------------


def _after_disconnect(cluster: Cluster, disconnects: int, cancelled: int, what: str) -> float:
    """The sim (another process) saw its client go away; the edge forgot the run."""
    latency = cluster.sim.wait_disconnects(disconnects, timeout=DISCONNECT_BOUND_S)
    admin = cluster.edge.wait_no_runs()
    assert admin["outcomes"].get("cancelled:client_disconnect", 0) == cancelled + 1
    assert cluster.sim.wait_idle()["client_disconnects"] == disconnects + 1
    print(f"\n{what}: client gone -> backend socket closed in {latency * 1000:.0f} ms")
    return latency


def _counters(cluster: Cluster) -> tuple[int, int]:
    return (
        cluster.sim.stats()["client_disconnects"],
        cluster.edge.outcome("cancelled:client_disconnect"),
    )


def test_disconnect_streaming_before_first_token(cluster: Cluster, client: openai.OpenAI) -> None:
    disconnects, cancelled = _counters(cluster)
    # The backend never answers; the edge commits the headers (and the role
    # chunk) after keepalive_interval_s, so the SDK hands us the stream.
    with client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        stream=True,
        extra_body=sim_opts(failure="stall_before_first_byte"),
    ) as stream:
        r = read_stream(stream, limit=1)
        assert r.chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert r.content_deltas == []
        cluster.sim.wait_open()
    _after_disconnect(cluster, disconnects, cancelled, "streaming, before the first token")


def _hang_up_once_generating(cluster: Cluster, request: dict[str, Any]) -> None:
    """Send ``request`` on a raw socket, wait until the backend is generating
    it, then close the socket without having read a byte."""
    body = json.dumps(request).encode()
    url = urlsplit(cluster.edge.url)
    assert url.hostname is not None
    assert url.port is not None
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        cluster.sim.wait_open()


def test_disconnect_streaming_before_the_headers(cluster: Cluster) -> None:
    """The client hangs up before the edge committed the headers (keep-alive 0.5 s)."""
    disconnects, cancelled = _counters(cluster)
    request = {
        "model": MODEL,
        "messages": MESSAGES,
        "stream": True,
        **sim_opts(failure="stall_before_first_byte"),
    }
    _hang_up_once_generating(cluster, request)
    _after_disconnect(cluster, disconnects, cancelled, "streaming, before the headers")


def test_disconnect_streaming_mid_stream(cluster: Cluster, client: openai.OpenAI) -> None:
    disconnects, cancelled = _counters(cluster)
    with client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        stream=True,
        extra_body=sim_opts(output_tokens=2000, tokens_per_s=50),
    ) as stream:
        r = read_stream(stream, limit=4)
        assert len(r.content_deltas) == 3
    _after_disconnect(cluster, disconnects, cancelled, "streaming, mid-stream")


@pytest.mark.parametrize(
    "opts",
    [
        sim_opts(failure="stall_before_first_byte"),
        sim_opts(output_tokens=2000, tokens_per_s=50),
    ],
    ids=["before-first-token", "mid-generation"],
)
def test_disconnect_non_streaming(cluster: Cluster, opts: dict[str, Any]) -> None:
    disconnects, cancelled = _counters(cluster)
    # Hang up once the backend is generating (a raw socket, so the test does
    # not race the machine's load with a client timeout).
    _hang_up_once_generating(cluster, {"model": MODEL, "messages": MESSAGES, **opts})
    _after_disconnect(cluster, disconnects, cancelled, f"non-streaming, {opts}")


_RAW_CLIENT = textwrap.dedent(
    """
    import json, sys, time
    import httpx
    body = json.loads(sys.argv[2])
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", sys.argv[1] + "/v1/chat/completions", json=body) as resp:
            for line in resp.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    print("got a token", flush=True)
                    time.sleep(3600)
    """
)


def test_disconnect_killed_raw_client(cluster: Cluster, tmp_path: Path) -> None:
    """A client process that dies mid-stream (SIGKILL: the kernel closes its socket)."""
    disconnects, cancelled = _counters(cluster)
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "stream": True,
        **sim_opts(output_tokens=2000, tokens_per_s=50),
    }
    client = Proc(
        "raw-client",
        [],
        tmp_path,
        argv=[sys.executable, "-c", _RAW_CLIENT, cluster.edge.url, json.dumps(body)],
    )
    try:
        client.wait_stdout("got a token")
        client.kill()
        assert client.returncode == -signal.SIGKILL
    finally:
        client.stop()
    _after_disconnect(cluster, disconnects, cancelled, "raw httpx client killed")


# --- 9. a slow client next to a fast one ----------------------------------------------------------

# Enough chunks that the buffers between the sim and a client that does not
# read cannot hold them all: mostly the kernel's socket buffers (measured with
# ``ss`` on loopback: ~1.3 MB queued to the paused client, ~150 kB between sim
# and node, i.e. ~7000 chunks), then the credit window and the run channels.
LONG_ANSWER = 20000
SAMPLE = 50  # validate one chunk in SAMPLE of these long streams (and all the others)


@pytest.mark.slow
def test_slow_client_does_not_block_a_fast_one(cluster: Cluster, client: openai.OpenAI) -> None:
    sim = cluster.sim
    # Counted from a sim with no generation open: an earlier test's stream
    # whose client has it all can still be closing there (a busy machine).
    before = sim.wait_idle()
    slow_opts = sim_opts(output_tokens=LONG_ANSWER)
    slow = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=slow_opts,
    )
    with slow:
        slow_iter = iter(slow)
        r = read_more(slow_iter, empty_result(), 2)  # the role chunk and one token, then pause
        assert len(r.content_deltas) == 1

        # Same node, same size of answer, started later: it completes while the
        # slow client is not reading.
        with client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "another question"}],
            stream=True,
            extra_body=slow_opts,
        ) as fast_stream:
            fast = read_stream(fast_stream, validate_every=SAMPLE)
        assert fast.finish_reason == "stop"
        assert len(fast.content_deltas) == LONG_ANSWER
        stats = sim.stats()
        assert stats["streams_finished"] == before["streams_finished"] + 1
        # Backpressure reached the backend: the slow answer, which the sim
        # writes as fast as its socket takes it and which started first, is
        # still being generated after an identical one went all the way through.
        assert stats["open_streams"] == 1
        assert slow.response.is_closed is False

        # The slow client resumes: everything arrives, in order, nothing lost.
        read_more(slow_iter, r, validate_every=SAMPLE)
    assert r.finish_reason == "stop"
    assert len(r.content_deltas) == LONG_ANSWER
    assert r.usage is not None
    same = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=slow_opts)
    assert same.choices[0].message.content == r.content
    assert sim.wait_idle()["client_disconnects"] == before["client_disconnects"]


@pytest.mark.slow
def test_a_starved_slow_client_that_leaves_releases_the_backend(
    cluster: Cluster, client: openai.OpenAI
) -> None:
    """Cancellation while the run has no credit: the edge, the node and the
    backend still let go (the terminal event needs no credit)."""
    # Counted from a sim with no generation open: the test above's last
    # stream, whose client has it all, can still be closing there and end
    # inside this one's count (CI, beside a CPU-heavy job: 31 == 29 + 1).
    finished = cluster.sim.wait_idle()["streams_finished"]
    disconnects, cancelled = _counters(cluster)
    opts = sim_opts(output_tokens=LONG_ANSWER)
    with client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, extra_body=opts
    ) as slow:
        read_stream(slow, limit=2)
        # An identical answer going all the way through proves the slow one is
        # held by backpressure (see the test above) when its client leaves.
        with client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "other"}],
            stream=True,
            extra_body=opts,
        ) as fast_stream:
            assert read_stream(fast_stream, validate_every=SAMPLE).finish_reason == "stop"
        # The fast answer's end reaches the sim's counters a moment after the
        # client has it: wait for that (its own count: a stream of an earlier
        # test that is still closing on a busy machine is no business of this
        # one's; the slow one is still open).
        stats = poll(
            lambda: (s := cluster.sim.stats())["streams_finished"] > finished and s,
            timeout=30,
            what="the sim to count the fast stream finished",
        )
        assert stats["streams_finished"] == finished + 1
        assert stats["open_streams"] >= 1
    _after_disconnect(cluster, disconnects, cancelled, "slow client left while starved of credit")


def test_concurrent_clients(cluster: Cluster) -> None:
    """More concurrent streams than the node's slots (8): the edge queues the rest;
    every client gets its own, complete, deterministic answer."""
    n = 20

    def one(i: int) -> tuple[str, str]:
        messages = [{"role": "user", "content": f"question {i}"}]
        opts = sim_opts(output_tokens=30, tokens_per_s=200)
        with cluster.edge.openai() as c:
            with c.chat.completions.create(
                model=MODEL, messages=messages, stream=True, extra_body=opts
            ) as stream:
                r = read_stream(stream)
            assert r.finish_reason == "stop"
            assert len(r.content_deltas) == 30
            full = c.chat.completions.create(model=MODEL, messages=messages, extra_body=opts)
        return r.content, full.choices[0].message.content or ""

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    for streamed, full in results:
        assert streamed == full
    assert len({streamed for streamed, _ in results}) == n  # nobody got another's answer
    assert cluster.edge.wait_no_runs()["queued"] == 0


def test_admin_and_health_endpoints(cluster: Cluster) -> None:
    edge = cluster.edge
    assert edge.get("/healthz").status_code == 200
    ready = edge.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["nodes"] == 1
    models = edge.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    admin = edge.admin()
    (node,) = admin["nodes"]
    assert node["id"] == cluster.node.node_id
    (inst,) = node["instances"]
    assert inst["adapter"] == "vllm"
    assert inst["targets"] == [MODEL]
    assert inst["provider_status"] == "available"
    # The SDK's view of /v1/models.
    with edge.openai() as c:
        assert [m.id for m in c.models.list()] == [MODEL]


def test_nothing_left_running(cluster: Cluster) -> None:
    """After everything above (disconnects, errors, tools...): no run left anywhere."""
    admin = cluster.edge.wait_no_runs()
    assert admin["queued"] == 0
    assert all(i["in_flight"] == 0 for n in admin["nodes"] for i in n["instances"])
    stats = cluster.sim.wait_idle()
    assert stats["open_streams"] == 0
    assert stats["open_completions"] == 0
