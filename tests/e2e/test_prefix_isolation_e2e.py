"""The prefix cache is no side channel between tenants, on real processes.

An ``iop sim`` with its KV prefix cache on (``iop/sim/_engine.py``: it
answers ``usage.prompt_tokens_details.cached_tokens`` as vLLM does, and
keeps requests of different ``cache_salt`` apart as vLLM does) behind a
node's ``vllm`` instance, behind an edge with two tenants. Tenant A sends
a prompt with a secret system prompt; tenant B then tries to learn it: it
sends an exact guess and a wrong guess of the same length, and compares
the cached tokens each was answered with (docs/operations.md, "Tenants and
limits", "Prefix caches").

By default the exact guess gets no more than the wrong one; with both
tenants configured to share (``share_prefix_cache``) it gets A's whole
cached prompt, so the test can fail. In both, A's own repeat is answered
from the cache: the cache is on, and a tenant keeps its own hits.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Final

import openai
import pytest

from tests.e2e._platform import MODEL, Edge, Procs

KEY_A: Final = "iop-e2e-prefix-tenant-a"
KEY_B: Final = "iop-e2e-prefix-tenant-b"
OPERATOR: Final = "iop-e2e-prefix-operator"
# Words of 2 to 5 letters: one token each of the sim's toy tokenizer
# (iop/sim/_tokenizer.py). 96 of them fill 6 blocks of 16 tokens.
SYSTEM_WORDS: Final = 96

pytestmark = pytest.mark.timeout(120)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _edge_config(share: bool) -> dict[str, Any]:
    return {
        "server": {"api_keys": [OPERATOR]},
        "tenants": [
            {"name": "alice", "key_sha256": [_digest(KEY_A)], "share_prefix_cache": share},
            {"name": "bob", "key_sha256": [_digest(KEY_B)], "share_prefix_cache": share},
        ],
    }


def _system(rng: random.Random) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = (
        "".join(rng.choice(letters) for _ in range(rng.randint(2, 5))) for _ in range(SYSTEM_WORDS)
    )
    return " ".join(words)


def _cached(edge: Edge, key: str, system: str) -> int:
    """The cached prompt tokens of one chat of the tenant of ``key``."""
    with openai.OpenAI(base_url=f"{edge.url}/v1", api_key=key, max_retries=0, timeout=30) as client:
        answer = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
        )
    usage = answer.usage
    assert usage is not None, answer
    assert usage.prompt_tokens_details is not None, answer
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return cached


@pytest.mark.parametrize("share", [False, True], ids=["isolated", "shared"])
def test_another_tenants_exact_guess_scores_no_better_than_a_wrong_one(
    procs: Procs, share: bool
) -> None:
    sim = procs.sim("sim", "--kv-cache-blocks", "4096")
    edge = procs.edge(_edge_config(share))
    procs.node([edge], sim)
    edge.wait_ready()
    rng = random.Random(11)
    secret, warm, wrong = _system(rng), _system(rng), _system(rng)

    assert _cached(edge, KEY_A, secret) == 0  # a cold cache
    # A's repeat: the cache is on, and a tenant keeps its own hits.
    full = _cached(edge, KEY_A, secret)
    assert full >= SYSTEM_WORDS

    # B's own first request: what every later one of B's shares with it
    # (the chat template's head) is in the cache for both probes alike.
    _cached(edge, KEY_B, warm)
    exact = _cached(edge, KEY_B, secret)
    wrong_guess = _cached(edge, KEY_B, wrong)
    if share:
        assert exact >= full > wrong_guess
    else:
        assert exact <= wrong_guess < full
