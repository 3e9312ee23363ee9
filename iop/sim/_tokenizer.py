"""The sim's toy tokenizer (sans-IO): deterministic, reversible, not a real one.

It serves ``/tokenize`` and ``/detokenize`` and counts the prompt tokens of
``/v1/completions`` and ``/v1/embeddings``. It is a *toy*: its ids mean
nothing to any real model, and its counts only resemble a real BPE
tokenizer's (about one token per short English word).

How it cuts and numbers text:

* the text is cut into fragments: a word or a run of punctuation, each with
  its leading whitespace (``"Hello, world"`` -> ``"Hello"`` ``","``
  ``" world"``), as GPT-style tokenizers attach the space to the next word;
* each fragment's UTF-8 bytes are cut into pieces of at most
  ``_PIECE_BYTES`` bytes, and a piece's id is its bytes read as a big-endian
  integer (a NUL byte is always a piece of its own, so that every id reads
  back to exactly one piece).

So the ids are stable across processes and versions (no hash, no
vocabulary), every id below ``MAX_TOKEN_ID`` decodes to some bytes, and
``detokenize(tokenize(text)) == text`` for every string. There are no
special tokens (no BOS): ``add_special_tokens`` changes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any, Final

import msgspec

from iop.errors import RequestError
from iop.spec import Message

__all__ = [
    "MAX_TOKEN_ID",
    "detokenize",
    "is_token_ids",
    "render_chat",
    "texts_with_counts",
    "token_strs",
    "tokenize",
    "tokenize_chat",
]

# 6 bytes keep every id below 2**48, well inside the 2**53 that JSON
# clients in JavaScript read exactly.
_PIECE_BYTES: Final = 6
MAX_TOKEN_ID: Final = (1 << (8 * _PIECE_BYTES)) - 1

_FRAGMENT: Final = re.compile(r"\s*(?:\w+|[^\w\s]+)|\s+")


def _pieces(fragment: bytes) -> Iterable[bytes]:
    start = 0
    while start < len(fragment):
        if fragment[start] == 0:
            yield fragment[start : start + 1]
            start += 1
            continue
        end = start + 1
        while end < len(fragment) and end - start < _PIECE_BYTES and fragment[end] != 0:
            end += 1
        yield fragment[start:end]
        start = end


def tokenize(text: str) -> list[int]:
    """The toy token ids of ``text``."""
    ids: list[int] = []
    for fragment in _FRAGMENT.findall(text):
        ids.extend(int.from_bytes(p, "big") for p in _pieces(fragment.encode()))
    return ids


def is_token_ids(value: Any) -> bool:
    """True for a list of ints (token ids, as APIs accept them for text)."""
    return isinstance(value, list) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    )


def texts_with_counts(items: Iterable[Any], param: str) -> list[tuple[str, int]]:
    """Each of a request's prompts or inputs as ``(text, tokens)``: a string is
    tokenized, a list of token ids read back to text (vLLM's ``prompt`` and
    ``input`` forms).

    Raises:
        RequestError: An item is neither (``param`` names the field).
    """
    out: list[tuple[str, int]] = []
    for item in items:
        if isinstance(item, str):
            out.append((item, len(tokenize(item))))
        elif is_token_ids(item) and item:
            out.append((detokenize(item), len(item)))
        else:
            raise RequestError(
                f"`{param}` must be a string, a list of strings, a list of token ids "
                "or a list of lists of token ids",
                param=param,
            )
    return out


def _piece(token_id: int) -> bytes:
    if not 0 <= token_id <= MAX_TOKEN_ID:
        raise RequestError(
            f"token id {token_id} is out of vocabulary (0 to {MAX_TOKEN_ID})", param="tokens"
        )
    return token_id.to_bytes(max(1, (token_id.bit_length() + 7) // 8), "big")


def detokenize(ids: Sequence[int]) -> str:
    """The text of ``ids`` (invalid UTF-8 becomes U+FFFD, as real tokenizers decode it).

    Raises:
        RequestError: An id is negative or above ``MAX_TOKEN_ID``.
    """
    return b"".join(_piece(i) for i in ids).decode("utf-8", errors="replace")


def token_strs(ids: Sequence[int]) -> list[str]:
    """Each id's own text (vLLM's ``token_strs``)."""
    return [_piece(i).decode("utf-8", errors="replace") for i in ids]


def render_chat(
    messages: Sequence[Message],
    *,
    tools: Sequence[Any] = (),
    add_generation_prompt: bool = True,
) -> str:
    """A toy chat template: ``<|role|>`` then the text, one message per line pair.

    Tools (their JSON) come first, under ``<|tools|>``; an assistant's tool
    calls follow its text as JSON; the generation prompt is ``<|assistant|>``.
    """
    parts = [f"<|tools|>\n{msgspec.json.encode(list(tools)).decode()}\n"] if tools else []
    for m in messages:
        text = m.text()
        if m.tool_calls:
            text += msgspec.json.encode(m.tool_calls).decode()
        parts.append(f"<|{m.role}|>\n{text}\n")
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


def tokenize_chat(
    messages: Sequence[Message],
    *,
    tools: Sequence[Any] = (),
    add_generation_prompt: bool = True,
) -> list[int]:
    """The toy token ids of ``messages`` rendered by ``render_chat``."""
    return tokenize(render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt))
