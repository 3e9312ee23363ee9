"""The sim's toy tokenizer and its /tokenize, /detokenize bodies (sans-IO)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop.config import SimConfig
from iop.errors import RequestError
from iop.sim import (
    MAX_TOKEN_ID,
    detokenize,
    detokenize_body,
    render_chat,
    token_strs,
    tokenize,
    tokenize_body,
)
from iop.spec import FunctionCall, Message, MessageToolCall


def test_ids_are_the_fragments_bytes() -> None:
    # "Hello" / "," / " world": a word or punctuation with its leading space.
    assert tokenize("Hello, world") == [
        int.from_bytes(b"Hello", "big"),
        ord(","),
        int.from_bytes(b" world", "big"),
    ]
    assert token_strs(tokenize("Hello, world")) == ["Hello", ",", " world"]
    # Longer fragments are cut into 6-byte pieces.
    assert token_strs(tokenize(" deterministic")) == [" deter", "minist", "ic"]


@given(st.text())
def test_detokenize_inverts_tokenize(text: str) -> None:
    ids = tokenize(text)
    assert all(0 <= i <= MAX_TOKEN_ID for i in ids)
    assert detokenize(ids) == text


def test_nul_bytes_survive() -> None:
    assert detokenize(tokenize("a\x00\x00b")) == "a\x00\x00b"


def test_any_id_in_range_decodes_and_others_are_refused() -> None:
    assert detokenize([0xFF]) == "\ufffd"  # not UTF-8 on its own, as real tokenizers decode it
    for bad in (-1, MAX_TOKEN_ID + 1):
        with pytest.raises(RequestError, match="out of vocabulary"):
            detokenize([bad])


def test_counts_look_like_a_tokenizers() -> None:
    assert len(tokenize("The quick brown fox jumps over the lazy dog.")) == 10


def test_tokenize_prompt_body_is_vllms_shape() -> None:
    body = json.loads(tokenize_body(b'{"model": "iop-sim", "prompt": "Hello, world"}', SimConfig()))
    assert list(body) == ["count", "max_model_len", "tokens", "token_strs"]
    assert body == {
        "count": 3,
        "max_model_len": 32768,
        "tokens": tokenize("Hello, world"),
        "token_strs": None,
    }
    with_strs = json.loads(
        tokenize_body(b'{"prompt": "a b", "return_token_strs": true}', SimConfig())
    )
    assert with_strs["token_strs"] == ["a", " b"]


def test_tokenize_messages_renders_the_toy_template() -> None:
    raw = json.dumps(
        {
            "model": "iop-sim",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ],
        }
    ).encode()
    body = json.loads(tokenize_body(raw, SimConfig()))
    rendered = "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert (
        render_chat(
            [Message(role="system", content="Be brief."), Message(role="user", content="Hi")]
        )
        == rendered
    )
    assert body["tokens"] == tokenize(rendered)
    assert body["count"] == len(body["tokens"])
    no_prompt = json.loads(raw)
    no_prompt["add_generation_prompt"] = False
    shorter = json.loads(tokenize_body(json.dumps(no_prompt).encode(), SimConfig()))
    assert shorter["count"] < body["count"]
    with_tools = json.loads(raw)
    with_tools["tools"] = [{"type": "function", "function": {"name": "Bash"}}]
    longer = json.loads(tokenize_body(json.dumps(with_tools).encode(), SimConfig()))
    assert longer["count"] > body["count"]


def test_detokenize_body() -> None:
    raw = json.dumps({"model": "iop-sim", "tokens": tokenize("Hello, world")}).encode()
    assert detokenize_body(raw, SimConfig()) == b'{"prompt":"Hello, world"}'


@pytest.mark.parametrize(
    ("raw", "status", "message"),
    [
        (b"{nope", 400, "invalid JSON"),
        (b"{}", 400, "exactly one of"),
        (b'{"prompt": "a", "messages": []}', 400, "exactly one of"),
        (b'{"prompt": 5}', 400, "Expected `str | null`"),
        (b'{"model": "gpt-9", "prompt": "a"}', 404, "The model `gpt-9` does not exist."),
    ],
)
def test_bad_tokenize_requests(raw: bytes, status: int, message: str) -> None:
    with pytest.raises(RequestError, match=message) as info:
        tokenize_body(raw, SimConfig())
    assert info.value.status == status


def test_bad_detokenize_requests() -> None:
    with pytest.raises(RequestError, match="out of vocabulary"):
        detokenize_body(b'{"tokens": [-5]}', SimConfig())
    with pytest.raises(RequestError, match="tokens"):
        detokenize_body(b'{"model": "iop-sim"}', SimConfig())


def test_the_template_renders_tool_calls() -> None:
    call = MessageToolCall(id="c1", function=FunctionCall(name="Bash", arguments="{}"))
    rendered = render_chat([Message(role="assistant", content="ok", tool_calls=[call])])
    assert rendered.startswith("<|assistant|>\nok[{")
    assert '"name":"Bash"' in rendered
