"""The sim's legacy /v1/completions: the chat script as vLLM's text_completion bytes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iop.config import SimConfig
from iop.errors import RequestError
from iop.sim import (
    DEFAULT_MAX_TOKENS,
    CompletionScript,
    Ending,
    build_completion_script,
    build_script,
    completion_stream_plan,
    completion_text_body,
    parse_completion_request,
    parse_embedding_request,
    tokenize,
)
from iop.spec import ChatRequest, Message
from tests.sim._schemas import validate_completion, validate_completion_chunk

FAST = SimConfig(ttft_s=0.0, output_tokens=8)


def script(request: dict[str, Any], cfg: SimConfig = FAST) -> CompletionScript:
    return build_completion_script(parse_completion_request(json.dumps(request).encode()), cfg)


def events(raw: bytes) -> list[Any]:
    out: list[Any] = []
    for block in raw.split(b"\n\n"):
        if block:
            assert block.startswith(b"data: ")
            data = block[len(b"data: ") :]
            out.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return out


def chat_text(prompt: str, cfg: SimConfig = FAST, max_tokens: int = DEFAULT_MAX_TOKENS) -> str:
    request = ChatRequest(
        model="iop-sim", messages=[Message(role="user", content=prompt)], max_tokens=max_tokens
    )
    return build_script(request, cfg).content


def test_streamed_chunks_are_vllms_bytes() -> None:
    s = script({"model": "iop-sim", "prompt": "Say hi", "stream": True})
    plan = completion_stream_plan(s, created=5, include_usage=False)
    assert plan.ending is Ending.DONE
    first = plan.frames[0].data
    assert first == (
        b'data: {"id":"' + s.completion_id.encode() + b'","object":"text_completion",'
        b'"created":5,"model":"iop-sim","choices":[{"index":0,"text":'
        + json.dumps(s.choices[0].pieces[0].text).encode()
        + b',"logprobs":null,"finish_reason":null,"stop_reason":null,'
        b'"prompt_token_ids":null,"token_ids":null}]}\n\n'
    )
    chunks = events(plan.body)
    assert chunks[-1] == "[DONE]"
    for chunk in chunks[:-1]:
        validate_completion_chunk(chunk)
    # 8 tokens, then the end-of-sequence token: no text, the finish reason.
    assert len(chunks) == 8 + 1 + 1
    assert chunks[-2]["choices"][0]["text"] == ""
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == chat_text("Say hi")
    assert s.completion_id.startswith("cmpl-")


def test_usage_chunk_only_when_asked() -> None:
    s = script({"prompt": "Say hi", "stream": True, "stream_options": {"include_usage": True}})
    chunks = events(completion_stream_plan(s, created=5, include_usage=True).body)
    usage = chunks[-2]
    assert usage["choices"] == []
    assert list(usage["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens"]
    assert usage["usage"] == {"prompt_tokens": 2, "total_tokens": 11, "completion_tokens": 9}
    validate_completion_chunk(usage)


def test_non_streamed_body() -> None:
    s = script({"model": "iop-sim", "prompt": "Say hi"})
    out = json.loads(completion_text_body(s, created=5))
    validate_completion(out)
    assert list(out) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "kv_transfer_params",
    ]
    assert list(out["choices"][0]) == [
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
        "prompt_logprobs",
        "prompt_token_ids",
    ]
    assert out["choices"][0]["text"] == chat_text("Say hi")
    assert out["usage"] == {
        "prompt_tokens": len(tokenize("Say hi")),
        "total_tokens": 2 + 9,
        "completion_tokens": 9,
        "prompt_tokens_details": None,
    }


def test_max_tokens_defaults_to_16_and_caps_with_length() -> None:
    cfg = SimConfig(ttft_s=0.0, output_tokens=100)
    for request in ({"prompt": "x"}, {"prompt": "x", "max_tokens": None}):
        s = script(request, cfg)
        assert s.choices[0].finish_reason == "length"
        assert s.choices[0].completion_tokens == 16
        assert s.choices[0].text == chat_text("x", cfg, 16)
    s = script({"prompt": "x", "max_tokens": 3, "stream": True}, cfg)
    chunks = events(completion_stream_plan(s, created=1, include_usage=False).body)
    # The capped last token carries the finish reason itself.
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "length"]


def test_stop_strings_end_the_text_before_them() -> None:
    cfg = SimConfig(ttft_s=0.0, output_tokens=40)
    full = chat_text("x", cfg, 40)
    words = full.split()
    stop = words[5]
    s = script({"prompt": "x", "max_tokens": 40, "stop": ["zzz-never", stop]}, cfg)
    choice = s.choices[0]
    assert choice.text == full[: full.index(stop)]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", stop)
    assert choice.completion_tokens < 40
    chunks = events(completion_stream_plan(s, created=1, include_usage=False).body)
    last = chunks[-2]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == choice.text
    out = json.loads(completion_text_body(s, created=1))
    validate_completion(out)
    assert out["choices"][0]["stop_reason"] == stop


def test_echo_puts_the_prompt_first() -> None:
    s = script({"prompt": "Echo me:", "echo": True, "stream": True})
    chunks = events(completion_stream_plan(s, created=1, include_usage=False).body)
    assert chunks[0]["choices"][0]["text"].startswith("Echo me:")
    assert s.choices[0].text == "Echo me:" + chat_text("Echo me:")


def test_several_prompts_are_choices_generated_side_by_side() -> None:
    s = script({"prompt": ["one", "two"], "stream": True, "max_tokens": 2})
    chunks = events(completion_stream_plan(s, created=1, include_usage=False).body)
    assert [c["choices"][0]["index"] for c in chunks[:-1]] == [0, 1, 0, 1]
    assert [c.text for c in s.choices] == [
        chat_text("one", max_tokens=2),
        chat_text("two", max_tokens=2),
    ]
    out = json.loads(completion_text_body(s, created=1))
    validate_completion(out)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"]["completion_tokens"] == 4


def test_token_id_prompts_read_back_to_text() -> None:
    by_ids = script({"prompt": tokenize("Say hi")})
    nested = script({"prompt": [tokenize("Say hi")]})
    assert by_ids.choices[0].text == nested.choices[0].text == chat_text("Say hi")
    # Ids are counted as given, even ones no text of ours tokenizes to.
    assert script({"prompt": [0xFF, 0xFE, 0xFD]}).prompt_tokens == 3


def test_overrides_and_timing() -> None:
    s = script({"prompt": "x", "iop_sim": {"output_tokens": 2, "ttft_s": 0.5, "tokens_per_s": 10}})
    assert [p.delay_s for p in s.choices[0].pieces] == [0.5, 0.1, 0.1]
    # A completions model has no reasoning parser: no reasoning tokens.
    assert script({"prompt": "x", "iop_sim": {"reasoning_tokens": 4}}).choices[0].text == chat_text(
        "x"
    )


@pytest.mark.parametrize(
    ("failure", "ending", "tail"),
    [
        ("midstream_error", Ending.DONE, b"data: [DONE]\n\n"),
        ("truncate", Ending.TRUNCATE, b"}\n\n"),
        ("stall_mid_stream", Ending.STALL, b"}\n\n"),
    ],
)
def test_injected_stream_failures(failure: str, ending: Ending, tail: bytes) -> None:
    s = script(
        {"prompt": "x", "stream": True, "iop_sim": {"failure": failure, "fail_after_tokens": 3}}
    )
    plan = completion_stream_plan(s, created=1, include_usage=False)
    assert plan.ending is ending
    assert plan.body.endswith(tail)
    texts = [e for e in events(plan.body) if isinstance(e, dict) and "choices" in e]
    assert len(texts) == 3
    if failure == "midstream_error":
        assert b'"error": {"message": "sim: injected mid-stream error"' in plan.body


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        ({}, "Either prompt or prompt_embeds must be provided and non-empty."),
        ({"prompt": ""}, "Either prompt or prompt_embeds"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "Stream options"),
        ({"prompt": "x", "n": 2}, "only n=1"),
        ({"prompt": [1.5]}, "must be a string"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens must be at least 1"),
        ({"prompt": "x", "iop_sim": {"failure": "nope"}}, "invalid `iop_sim`"),
    ],
)
def test_bad_requests_are_400s(request_: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError, match=message) as info:
        script(request_)
    assert info.value.status == 400


def test_max_inputs_is_enforced() -> None:
    with pytest.raises(
        RequestError, match="prompt list length 3 exceeds the maximum allowed count of 2"
    ):
        script({"prompt": ["a", "b", "c"]}, SimConfig(max_inputs=2))


@settings(max_examples=60, deadline=None)
@given(
    stops=st.lists(st.text(alphabet="abcdefghilmnorstu .", min_size=1, max_size=6), max_size=3),
    max_tokens=st.integers(1, 30),
    echo=st.booleans(),
)
def test_the_stream_joins_to_the_whole_answer(
    stops: list[str], max_tokens: int, echo: bool
) -> None:
    request = {"prompt": "p", "stop": stops, "max_tokens": max_tokens, "echo": echo}
    s = script(request, SimConfig(ttft_s=0.0, output_tokens=20))
    whole = json.loads(completion_text_body(s, created=1))["choices"][0]
    chunks = events(completion_stream_plan(s, created=1, include_usage=False).body)[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    generated = whole["text"][len("p") :] if echo else whole["text"]
    assert not any(stop in generated for stop in stops)
    if whole["stop_reason"] is not None:
        assert whole["stop_reason"] in stops
    assert s.choices[0].completion_tokens <= max_tokens + 1


@pytest.mark.parametrize(("raw", "message"), [(b"{nope", "invalid JSON"), (b"[1]", "JSON object")])
def test_undecodable_bodies(raw: bytes, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        parse_completion_request(raw)
    with pytest.raises(RequestError, match=message):
        parse_embedding_request(raw)


def test_a_stall_before_the_first_byte_sends_nothing() -> None:
    s = script({"prompt": "x", "stream": True, "iop_sim": {"failure": "stall_before_first_byte"}})
    plan = completion_stream_plan(s, created=1, include_usage=True)
    assert (plan.frames, plan.ending) == ((), Ending.STALL)


def test_a_stop_string_at_the_very_start_leaves_no_text() -> None:
    first = chat_text("x")[:2]
    s = script({"prompt": "x", "stop": first, "stream": True})
    choice = s.choices[0]
    assert (choice.text, choice.stop_reason, choice.completion_tokens) == ("", first, 1)
    chunks = events(completion_stream_plan(s, created=1, include_usage=False).body)
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == [""]
