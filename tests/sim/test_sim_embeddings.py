"""The sim's /v1/embeddings: deterministic unit vectors in vLLM's body (sans-IO)."""

from __future__ import annotations

import base64
import json
import math
import struct
from typing import Any

import pytest

from iop.config import SimConfig
from iop.errors import RequestError
from iop.sim import (
    apply_overrides,
    embedding_body,
    embedding_vector,
    parse_embedding_request,
    tokenize,
)
from tests.sim._schemas import validate_embeddings

CFG = SimConfig(embedding_dim=16)


def body(request: dict[str, Any], cfg: SimConfig = CFG) -> dict[str, Any]:
    parsed = parse_embedding_request(json.dumps(request).encode())
    effective = apply_overrides(parsed.extra_body, cfg)
    raw = embedding_body(parsed, effective, model=parsed.model or cfg.model, created=7)
    out: dict[str, Any] = json.loads(raw)
    return out


def dot(a: list[float], b: list[float]) -> float:
    return math.fsum(x * y for x, y in zip(a, b, strict=True))


def test_same_text_same_unit_vector() -> None:
    a = embedding_vector("hello world", dim=384)
    assert a == embedding_vector("hello world", dim=384)
    assert len(a) == 384
    assert dot(a, a) == pytest.approx(1.0, abs=1e-6)
    b = embedding_vector("hello there", dim=384)
    assert abs(dot(a, b)) < 0.3  # unrelated texts are about orthogonal
    assert embedding_vector("hello world", dim=384, seed=1) != a
    # float32 values, as a real model returns them
    assert all(struct.unpack("<f", struct.pack("<f", x))[0] == x for x in a)


def test_dimensions_cut_the_vector_and_renormalise_it() -> None:
    full = embedding_vector("x", dim=16)
    cut = embedding_vector("x", dim=16, dimensions=4)
    assert len(cut) == 4
    assert dot(cut, cut) == pytest.approx(1.0, abs=1e-6)
    scale = math.sqrt(math.fsum(v * v for v in full[:4]))
    assert cut == pytest.approx([v / scale for v in full[:4]], abs=1e-6)


def test_body_is_vllms_shape_and_openais_schema() -> None:
    out = body({"model": "iop-sim", "input": ["a b", "c"]})
    validate_embeddings(out)
    assert list(out) == ["id", "object", "created", "model", "data", "usage"]
    assert out["id"].startswith("embd-")
    assert (out["object"], out["created"], out["model"]) == ("list", 7, "iop-sim")
    assert [list(d) for d in out["data"]] == [["index", "object", "embedding"]] * 2
    assert [d["index"] for d in out["data"]] == [0, 1]
    assert out["data"][1]["embedding"] == embedding_vector("c", dim=16)
    assert out["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 3,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


def test_token_ids_embed_like_their_text() -> None:
    text = body({"input": "Hello, world"})["data"][0]["embedding"]
    ids = body({"input": tokenize("Hello, world")})
    nested = body({"input": [tokenize("Hello, world"), tokenize("x")]})
    assert ids["data"][0]["embedding"] == text
    assert nested["data"][0]["embedding"] == text
    assert ids["usage"]["prompt_tokens"] == 3
    validate_embeddings(nested)


def test_base64_is_little_endian_float32() -> None:
    floats = body({"input": "q"})["data"][0]["embedding"]
    encoded = body({"input": "q", "encoding_format": "base64"})
    raw = base64.b64decode(encoded["data"][0]["embedding"])
    decoded = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert decoded == floats
    # OpenAI's schema types `embedding` as an array only, though its API
    # sends a string for base64 too: validate the decoded body.
    encoded["data"][0]["embedding"] = decoded
    validate_embeddings(encoded)


def test_dimensions_and_overrides() -> None:
    assert len(body({"input": "q", "dimensions": 5})["data"][0]["embedding"]) == 5
    assert len(body({"input": "q", "iop_sim": {"embedding_dim": 3}})["data"][0]["embedding"]) == 3
    seeded = body({"input": "q", "iop_sim": {"seed": 9}})["data"][0]["embedding"]
    assert seeded == embedding_vector("q", dim=16, seed=9)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        ({"input": "q", "dimensions": 0}, "Dimensions must be greater than 0"),
        ({"input": "q", "dimensions": 17}, "dimensions 17 is more than the model's 16"),
        ({"input": []}, "must not be empty"),
        ({"input": [[]]}, "must be a string"),
        ({"input": [1.5]}, "must be a string"),
        ({"input": ["a", 3]}, "must be a string"),
        ({"input": 3}, "Expected `str | array`"),
        ({"input": "q", "encoding_format": "int8"}, "encoding_format"),
        ({"input": [[-1]]}, "out of vocabulary"),
        ({}, "missing required field `input`"),
    ],
)
def test_bad_requests_are_400s(request_: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError, match=message) as info:
        body(request_)
    assert info.value.status == 400


def test_max_inputs_is_enforced() -> None:
    cfg = SimConfig(embedding_dim=2, max_inputs=3)
    assert len(body({"input": ["a"] * 3}, cfg)["data"]) == 3
    with pytest.raises(RequestError, match="4 items, more than the 3 allowed"):
        body({"input": ["a"] * 4}, cfg)


def test_body_bytes() -> None:
    parsed = parse_embedding_request(b'{"model": "iop-sim", "input": "hi"}')
    raw = embedding_body(parsed, SimConfig(embedding_dim=2), model="iop-sim", created=7)
    vector = embedding_vector("hi", dim=2)
    digest = json.loads(raw)["id"]
    assert raw == (
        b'{"id":"' + digest.encode() + b'","object":"list","created":7,"model":"iop-sim",'
        b'"data":[{"index":0,"object":"embedding","embedding":['
        + b",".join(repr(v).encode() for v in vector)
        + b']}],"usage":{"prompt_tokens":1,"total_tokens":1,"completion_tokens":0,'
        b'"prompt_tokens_details":null}}'
    )
    assert (
        digest
        == json.loads(
            embedding_body(parsed, SimConfig(embedding_dim=2), model="iop-sim", created=8)
        )["id"]
    )
