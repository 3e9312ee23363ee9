"""vLLM's wire format as the sim writes it, checked against real vLLM transcripts."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from importlib.resources import files
from typing import Any

import msgspec
import pytest

from iop.config import SimConfig
from iop.errors import BackendStreamError, RequestError
from iop.events import Delta, FinishReason, ReasoningDelta
from iop.sim import (
    Ending,
    StreamPlan,
    build_script,
    completion_body,
    detokenize_body,
    error_body,
    models_body,
    parse_chat_request,
    parse_completion_request,
    parse_embedding_request,
    stream_plan,
    tokenize_body,
)
from iop.sim._vllm_wire import MALFORMED_CHUNK, injected_http_error, model_not_found
from iop.spec import ChatRequest, FunctionDef, Message, Tool
from iop.wire._openai_stream import ChatStreamParser

CREATED = 1755600000
WEATHER = Tool(
    function=FunctionDef(
        name="get_weather",
        parameters={"type": "object", "properties": {"city": {"type": "string"}}},
    )
)


def transcript(name: str) -> bytes:
    return (files("iop.testing") / "transcripts" / name).read_bytes()


def req(**kw: Any) -> ChatRequest:
    return ChatRequest(
        model="Qwen/Qwen2.5-7B-Instruct", messages=[Message(role="user", content="hi")], **kw
    )


def plan_for(cfg: SimConfig, *, include_usage: bool = True, **kw: Any) -> StreamPlan:
    return stream_plan(build_script(req(**kw), cfg), created=CREATED, include_usage=include_usage)


def events(body: bytes) -> list[str]:
    """The data of each SSE event, checking vLLM's exact framing on the way."""
    assert body.endswith(b"\n\n")
    parts = body.split(b"\n\n")[:-1]
    out = []
    for part in parts:
        assert part.startswith(b"data: ")
        assert b"\n" not in part
        out.append(part[len(b"data: ") :].decode())
    return out


def shape(value: Any) -> Any:
    """The key order of a JSON value, recursively (lists: the shape of each item)."""
    if isinstance(value, dict):
        return [(k, shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


def chunks(body: bytes) -> list[dict[str, Any]]:
    return [json.loads(e) for e in events(body) if e != "[DONE]"]


def test_text_stream_has_vllms_exact_shapes() -> None:
    real = chunks(transcript("vllm_text_stream_with_usage.txt"))
    ours = chunks(plan_for(SimConfig(output_tokens=9)).body)
    # Role chunk, token chunk, finish chunk and usage chunk: same keys, same order.
    for i in (0, 1, -2, -1):
        assert shape(ours[i]) == shape(real[i]), i
    assert ours[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert ours[-2]["choices"][0]["delta"] == {"content": ""}
    assert ours[-2]["choices"][0]["finish_reason"] == "stop"
    assert ours[-1]["choices"] == []
    assert list(ours[-1]["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens"]
    assert len(ours) == 1 + 9 + 1 + 1
    ids = {c["id"] for c in ours}
    assert len(ids) == 1
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", ids.pop())
    assert {c["created"] for c in ours} == {CREATED}
    assert {c["model"] for c in ours} == {"Qwen/Qwen2.5-7B-Instruct"}


def test_stream_is_compact_json_and_ends_with_done() -> None:
    body = plan_for(SimConfig(output_tokens=3)).body
    assert body.endswith(b"data: [DONE]\n\n")
    for e in events(body)[:-1]:
        assert e == json.dumps(json.loads(e), separators=(",", ":"), ensure_ascii=False)


def test_usage_chunk_only_with_include_usage() -> None:
    without = chunks(plan_for(SimConfig(output_tokens=3), include_usage=False).body)
    assert all(c["choices"] for c in without)
    assert all("usage" not in c for c in without)
    with_usage = chunks(plan_for(SimConfig(output_tokens=3)).body)
    assert with_usage[-1]["usage"]["completion_tokens"] == 4


def test_reasoning_stream_matches_vllm_016() -> None:
    real = chunks(transcript("vllm_reasoning_stream_ge_v0.16.txt"))
    ours = chunks(plan_for(SimConfig(output_tokens=3, reasoning_tokens=2)).body)
    assert shape(ours[1]) == shape(real[1])
    assert list(ours[1]["choices"][0]["delta"]) == ["reasoning"]
    assert ours[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}


def test_tool_call_stream_matches_vllm_hermes() -> None:
    real = chunks(transcript("vllm_tool_call_stream_hermes.txt"))
    ours = chunks(plan_for(SimConfig(), tools=[WEATHER]).body)
    for i in (1, 2, -2):
        assert shape(ours[i]) == shape(real[i]), i
    first = ours[1]["choices"][0]["delta"]["tool_calls"][0]
    assert first["function"] == {"name": "get_weather"}
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", first["id"])
    assert ours[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_token_cap_puts_length_on_the_last_token() -> None:
    ours = chunks(plan_for(SimConfig(output_tokens=10), max_tokens=4).body)
    last = ours[-2]["choices"][0]
    assert last["finish_reason"] == "length"
    assert last["delta"]["content"]
    assert len(ours) == 1 + 4 + 1
    assert ours[-1]["usage"]["completion_tokens"] == 4


def parse(body: bytes) -> tuple[list[Delta | ReasoningDelta], ChatStreamParser]:
    parser = ChatStreamParser(label="vllm")
    out = parser.feed(body)
    if not parser.done:
        parser.feed_eof()
    return out, parser


def test_the_projects_own_parser_reads_the_stream_back() -> None:
    cfg = SimConfig(output_tokens=12, reasoning_tokens=3)
    script = build_script(req(), cfg)
    out, parser = parse(stream_plan(script, created=CREATED, include_usage=True).body)
    assert "".join(e.text for e in out if isinstance(e, Delta)) == script.content
    assert "".join(e.text for e in out if isinstance(e, ReasoningDelta)) == script.reasoning
    done = parser.complete()
    assert done.usage.input_tokens == script.prompt_tokens
    assert done.usage.output_tokens == script.completion_tokens
    assert done.usage.reasoning_tokens == 3
    tool_script = build_script(req(tools=[WEATHER]), cfg)
    _, tool_parser = parse(stream_plan(tool_script, created=CREATED, include_usage=True).body)
    calls = tool_parser.complete().tool_calls
    assert tool_script.tool_call is not None
    assert [(c.id, c.name, c.arguments) for c in calls] == [
        (tool_script.tool_call.id, "get_weather", tool_script.tool_call.arguments)
    ]


def test_timing_of_frames() -> None:
    plan = plan_for(SimConfig(output_tokens=3, ttft_s=1.0, tokens_per_s=4))
    # role chunk after the TTFT, with the first token; then one token per 0.25 s,
    # the end-of-sequence token too; usage and [DONE] right after.
    assert [f.delay_s for f in plan.frames] == [1.0, 0.0, 0.25, 0.25, 0.25, 0.0, 0.0]
    assert plan.ending is Ending.DONE


def tokens_in(body: bytes) -> int:
    return sum(1 for c in chunks(body) if c["choices"] and "content" in c["choices"][0]["delta"])


def test_midstream_error_then_done() -> None:
    plan = plan_for(SimConfig(output_tokens=10, failure="midstream_error", fail_after_tokens=4))
    evs = events(plan.body)
    assert evs[-1] == "[DONE]"
    assert evs[-2].startswith('{"error": {"message": ')  # json.dumps spacing, as vLLM
    err = json.loads(evs[-2])["error"]
    assert list(err) == ["message", "type", "param", "code"]
    assert err["code"] == 500
    assert tokens_in(b"".join(f.data for f in plan.frames[:-2])) == 4 + 1  # role chunk has content
    with pytest.raises(BackendStreamError, match="injected mid-stream error"):
        parse(plan.body)


def test_truncate_ends_without_done() -> None:
    plan = plan_for(SimConfig(output_tokens=10, failure="truncate", fail_after_tokens=3))
    assert plan.ending is Ending.TRUNCATE
    assert b"[DONE]" not in plan.body
    assert len(chunks(plan.body)) == 1 + 3
    with pytest.raises(BackendStreamError, match="without \\[DONE\\]"):
        parse(plan.body)


def test_stalls() -> None:
    before = plan_for(SimConfig(failure="stall_before_first_byte"))
    assert before.frames == ()
    assert before.ending is Ending.STALL
    mid = plan_for(SimConfig(output_tokens=10, failure="stall_mid_stream", fail_after_tokens=2))
    assert mid.ending is Ending.STALL
    assert len(chunks(mid.body)) == 1 + 2


def test_malformed_chunk_then_normal_stream() -> None:
    plan = plan_for(SimConfig(output_tokens=6, failure="malformed_chunk", fail_after_tokens=2))
    assert plan.body.count(MALFORMED_CHUNK) == 1
    assert plan.ending is Ending.DONE
    _, parser = parse(plan.body)
    assert parser.complete().malformed_chunks == 1


def test_failure_after_the_whole_answer_strikes_before_the_finish_chunk() -> None:
    plan = plan_for(SimConfig(output_tokens=2, failure="truncate", fail_after_tokens=99))
    assert [c["choices"][0]["finish_reason"] for c in chunks(plan.body)] == [None, None, None]


def test_auto_tool_choice_400_body_is_byte_exact() -> None:
    script_error = None
    try:
        build_script(req(tools=[WEATHER]), SimConfig(auto_tool_choice=False))
    except RequestError as exc:
        script_error = exc
    assert script_error is not None
    body = error_body(script_error.message, status=script_error.status, param=script_error.param)
    assert body == transcript("vllm_400_auto_tool_choice_body.json").strip()


def test_injected_http_errors() -> None:
    assert injected_http_error(SimConfig()) is None
    for failure, status in (("http_500", 500), ("http_429", 429)):
        injected = injected_http_error(SimConfig(failure=failure))  # type: ignore[arg-type]
        assert injected is not None
        assert injected[0] == status
        assert json.loads(injected[1])["error"]["code"] == status


def test_model_not_found_is_vllms_404() -> None:
    exc = model_not_found("gpt-9")
    body = json.loads(error_body(exc.message, status=exc.status, param=exc.param))
    assert body == {
        "error": {
            "message": "The model `gpt-9` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


def test_completion_body() -> None:
    script = build_script(req(), SimConfig(output_tokens=5, reasoning_tokens=2))
    body = json.loads(completion_body(script, created=CREATED))
    assert list(body)[:5] == ["id", "object", "created", "model", "choices"]
    assert body["object"] == "chat.completion"
    assert body["id"] == script.completion_id
    choice = body["choices"][0]
    assert list(choice) == [
        "index",
        "message",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
    ]
    assert choice["message"]["content"] == script.content
    assert choice["message"]["reasoning"] == script.reasoning
    assert choice["message"]["tool_calls"] == []
    assert list(body["usage"]) == [
        "prompt_tokens",
        "total_tokens",
        "completion_tokens",
        "prompt_tokens_details",
        "completion_tokens_details",
    ]
    tool = json.loads(completion_body(build_script(req(tools=[WEATHER]), SimConfig()), created=1))
    message = tool["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert tool["choices"][0]["finish_reason"] == "tool_calls"


def test_models_body() -> None:
    body = json.loads(models_body("iop-sim", created=CREATED))
    assert body["object"] == "list"
    card = body["data"][0]
    assert list(card)[:7] == [
        "id",
        "object",
        "created",
        "owned_by",
        "root",
        "parent",
        "max_model_len",
    ]
    assert card["id"] == "iop-sim"
    assert card["owned_by"] == "vllm"
    assert card["permission"][0]["object"] == "model_permission"


def test_parse_chat_request_keeps_unknown_keys() -> None:
    raw = msgspec.json.encode(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "top_k": 5,
            "iop_sim": {"output_tokens": 2},
        }
    )
    r = parse_chat_request(raw)
    assert r.model == "m"
    assert r.extra_body == {"top_k": 5, "iop_sim": {"output_tokens": 2}}
    assert len(build_script(r, SimConfig()).steps) == 2


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"{not json", "invalid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"messages": []}', "model"),
        (b'{"model": "m"}', "messages"),
        (b'{"model": "m", "messages": "hi"}', "messages"),
        (
            b'{"model": "m", "messages": [], "stream_options": {"include_usage": true}}',
            "Stream options can only be defined when `stream=True`.",
        ),
    ],
)
def test_parse_chat_request_rejects(raw: bytes, match: str) -> None:
    with pytest.raises(RequestError, match=re.escape(match)):
        parse_chat_request(raw)


def test_plan_is_deterministic() -> None:
    cfg = SimConfig(output_tokens=20, reasoning_tokens=4)
    assert plan_for(cfg).body == plan_for(cfg).body
    assert FinishReason.STOP.value == "stop"


# --- request bodies ---------------------------------------------------------------------

# Every endpoint's smallest valid body, and its parser.
_BODIES: dict[str, tuple[Callable[[bytes], Any], dict[str, Any]]] = {
    "chat": (parse_chat_request, {"model": "m", "messages": [{"role": "user", "content": "x"}]}),
    "completions": (parse_completion_request, {"prompt": "x"}),
    "embeddings": (parse_embedding_request, {"input": "x"}),
    "tokenize": (lambda raw: tokenize_body(raw, SimConfig()), {"prompt": "x"}),
    "detokenize": (lambda raw: detokenize_body(raw, SimConfig()), {"tokens": [1]}),
}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{nope", r"^invalid JSON body: "),
        (b"[1]", r"^the request body must be a JSON object$"),
        (b'"x"', r"^the request body must be a JSON object$"),
        (b'{"model": 1}', r"^Expected `str( \| null)?`, got `int` - at `\$\.model`$"),
    ],
)
@pytest.mark.parametrize("endpoint", sorted(_BODIES))
def test_every_endpoint_refuses_a_bad_body_alike(endpoint: str, raw: bytes, message: str) -> None:
    parse, _ = _BODIES[endpoint]
    with pytest.raises(RequestError, match=message) as info:
        parse(raw)
    assert info.value.status == 400


@pytest.mark.parametrize("endpoint", ["chat", "completions", "embeddings"])
def test_unknown_keys_reach_extra_body_as_vllm_passes_them(endpoint: str) -> None:
    parse, body = _BODIES[endpoint]
    assert parse(json.dumps(body).encode()).extra_body is None
    extra = {"top_k": 5, "iop_sim": {"seed": 3}}
    assert parse(json.dumps({**body, **extra}).encode()).extra_body == extra


@pytest.mark.parametrize("endpoint", ["tokenize", "detokenize"])
def test_unknown_keys_are_ignored_by_the_tokenizer_endpoints(endpoint: str) -> None:
    parse, body = _BODIES[endpoint]
    assert parse(json.dumps({**body, "top_k": 5}).encode()) == parse(json.dumps(body).encode())
