"""vLLM's ``/tokenize`` and ``/detokenize`` for the sim (sans-IO), with the toy tokenizer.

``POST /tokenize`` takes ``{"model", "prompt"}`` (vLLM's
``TokenizeCompletionRequest``) or ``{"model", "messages"}``
(``TokenizeChatRequest``: the messages rendered by the toy chat template,
``add_generation_prompt`` true by default, ``tools`` rendered first) and
answers vLLM's ``TokenizeResponse``: ``{"count", "max_model_len", "tokens",
"token_strs"}`` (``token_strs`` only with ``return_token_strs``, else null).
``POST /detokenize`` takes ``{"model", "tokens"}`` and answers
``{"prompt"}``. ``model`` may be omitted (the served model), as in vLLM;
another model is vLLM's 404. The ids are the toy tokenizer's
(``iop.sim._tokenizer``): stable and reversible, but no real model's.
"""

from __future__ import annotations

from typing import Any

import msgspec

from iop.config import SimConfig
from iop.errors import RequestError
from iop.sim._tokenizer import detokenize, token_strs, tokenize, tokenize_chat
from iop.sim._vllm_wire import MAX_MODEL_LEN, decode_request, model_not_found
from iop.spec import Message

__all__ = ["detokenize_body", "tokenize_body"]

_encode = msgspec.json.encode


class _TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[Any] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False


class _DetokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str | None = None
    tokens: list[int]


def _check_model(model: str | None, cfg: SimConfig) -> None:
    if model is not None and model != cfg.model:
        raise model_not_found(model)


def tokenize_body(raw: bytes, cfg: SimConfig) -> bytes:
    """The ``/tokenize`` response for request body ``raw``.

    Raises:
        RequestError: Invalid body, neither or both of ``prompt`` and
            ``messages``, or another model (404).
    """
    request = decode_request(raw, _TokenizeRequest)
    _check_model(request.model, cfg)
    if (request.prompt is None) == (request.messages is None):
        raise RequestError("exactly one of `prompt` and `messages` must be given")
    if request.messages is not None:
        ids = tokenize_chat(
            request.messages,
            tools=request.tools or (),
            add_generation_prompt=request.add_generation_prompt,
        )
    else:
        ids = tokenize(request.prompt or "")
    body = {
        "count": len(ids),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": ids,
        "token_strs": token_strs(ids) if request.return_token_strs else None,
    }
    return _encode(body)


def detokenize_body(raw: bytes, cfg: SimConfig) -> bytes:
    """The ``/detokenize`` response for request body ``raw``.

    Raises:
        RequestError: Invalid body, an id outside the toy vocabulary, or
            another model (404).
    """
    request = decode_request(raw, _DetokenizeRequest)
    _check_model(request.model, cfg)
    return _encode({"prompt": detokenize(request.tokens)})
