"""``/v1/embeddings`` for the sim (sans-IO): requests, vectors, vLLM's response bytes.

Theory of operation
-------------------
A vector is a pure function of the input's *text*, the sim's ``seed`` and
the requested size: SHA-256 of the seed and the UTF-8 text seeds the
script's SplitMix64 generator, which draws ``embedding_dim`` components
uniform in [-1, 1); the vector is scaled to unit length, then cut to
``dimensions`` (if asked) and scaled to unit length again, as a Matryoshka
embedding model's pooler does. Components are float32 values (the dtype
vLLM returns), so ``encoding_format: "base64"`` (little-endian float32
bytes, base64, as OpenAI and vLLM send them) decodes to exactly the floats
of ``"float"``.

Token-id inputs are read back to text with the toy tokenizer
(``iop.sim._tokenizer``), so the ids ``/tokenize`` gave for a text embed
to the same vector as the text itself. Same text, same vector: equal texts
have cosine similarity 1, different texts about 0.

The body is vLLM's ``EmbeddingResponse`` (``model_dump`` order: ``id,
object, created, model, data, usage``; usage as in chat completions, with
``completion_tokens`` 0 and ``prompt_tokens_details`` null).
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
from typing import Any, Final, Literal

import msgspec

from iop.config import SimConfig
from iop.errors import RequestError
from iop.sim._script import _Rng
from iop.sim._tokenizer import is_token_ids, texts_with_counts
from iop.sim._vllm_wire import decode_request

__all__ = [
    "EmbeddingRequest",
    "check_embedding_request",
    "embedding_body",
    "embedding_inputs",
    "embedding_vector",
    "parse_embedding_request",
]

_encode = msgspec.json.encode
_FLOAT32: Final = struct.Struct("<f")


class EmbeddingRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A ``/v1/embeddings`` body; unknown keys land in ``extra_body``."""

    model: str | None = None
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    extra_body: dict[str, Any] | None = None


def parse_embedding_request(raw: bytes) -> EmbeddingRequest:
    """Decode a ``/v1/embeddings`` body.

    Raises:
        RequestError: Not a JSON object, or fields of the wrong type.
    """
    return decode_request(raw, EmbeddingRequest)


def embedding_inputs(request: EmbeddingRequest, cfg: SimConfig) -> list[tuple[str, int]]:
    """Each input's text and prompt-token count, in order.

    ``input`` is a string, a list of strings, a list of token ids or a list
    of lists of token ids, as in OpenAI's API.

    Raises:
        RequestError: Another shape, an empty input, more than
            ``cfg.max_inputs`` inputs, or a token id out of the toy vocabulary.
    """
    value = request.input
    items: list[Any] = (
        [value] if isinstance(value, str) or (value and is_token_ids(value)) else value
    )
    if not items:
        raise RequestError("`input` must not be empty", param="input")
    if len(items) > cfg.max_inputs:
        raise RequestError(
            f"`input` has {len(items)} items, more than the {cfg.max_inputs} allowed",
            param="input",
        )
    return texts_with_counts(items, "input")


def _unit(values: list[float]) -> list[float]:
    norm = math.sqrt(math.fsum(v * v for v in values)) or 1.0
    # Round to float32, the dtype a real embedding model returns.
    return [_FLOAT32.unpack(_FLOAT32.pack(v / norm))[0] for v in values]


def embedding_vector(
    text: str, *, dim: int, seed: int = 0, dimensions: int | None = None
) -> list[float]:
    """The deterministic unit vector of ``text`` (``dimensions`` cuts it, Matryoshka-style)."""
    digest = hashlib.sha256(f"{seed}\0".encode() + text.encode()).digest()
    rng = _Rng(int.from_bytes(digest[:8], "big"))
    full = _unit([(rng.next() >> 11) / (1 << 52) - 1.0 for _ in range(dim)])
    if dimensions is None or dimensions >= dim:
        return full
    return _unit(full[:dimensions])


def _base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def check_embedding_request(request: EmbeddingRequest, cfg: SimConfig) -> list[tuple[str, int]]:
    """Validate ``request`` (cheap, no vectors); return ``embedding_inputs``.

    Raises:
        RequestError: Invalid ``input`` (see ``embedding_inputs``) or
            ``dimensions`` (below 1 with vLLM's message, or above
            ``embedding_dim``).
    """
    dims = request.dimensions
    if dims is not None and dims < 1:
        raise RequestError("Dimensions must be greater than 0", param="dimensions")
    if dims is not None and dims > cfg.embedding_dim:
        raise RequestError(
            f"dimensions {dims} is more than the model's {cfg.embedding_dim}",
            param="dimensions",
        )
    return embedding_inputs(request, cfg)


def embedding_body(request: EmbeddingRequest, cfg: SimConfig, *, model: str, created: int) -> bytes:
    """vLLM's ``/v1/embeddings`` response body for ``request``.

    ``cfg`` is the effective config (``apply_overrides`` of the request's
    ``extra_body``); ``model`` is the name to echo.

    Raises:
        RequestError: See ``check_embedding_request``.
    """
    inputs = check_embedding_request(request, cfg)
    dims = request.dimensions
    data: list[dict[str, Any]] = []
    for index, (text, _) in enumerate(inputs):
        vector = embedding_vector(text, dim=cfg.embedding_dim, seed=cfg.seed, dimensions=dims)
        encoded: list[float] | str = (
            _base64(vector) if request.encoding_format == "base64" else vector
        )
        data.append({"index": index, "object": "embedding", "embedding": encoded})
    prompt = sum(n for _, n in inputs)
    digest = hashlib.sha256(_encode([cfg.seed, model, [t for t, _ in inputs]])).hexdigest()
    body = {
        "id": "embd-" + digest[:32],
        "object": "list",
        "created": created,
        "model": model,
        "data": data,
        "usage": {
            "prompt_tokens": prompt,
            "total_tokens": prompt,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        },
    }
    return _encode(body)
