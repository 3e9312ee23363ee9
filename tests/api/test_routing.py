"""A request's session key and objective (iop.api._routing), through each surface's parse."""

from __future__ import annotations

import json

import pytest

from iop.api import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    MESSAGES,
    SESSION_HEADERS,
    ResponsesSurface,
    routing_of,
)
from iop.api._routing import MAX_SESSION_CHARS
from iop.api.responses import ResponseStore
from iop.errors import RequestError
from iop.spec import Routing

CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
ALL_HEADERS = {name: f"from-{name}" for name in SESSION_HEADERS}


def chat(headers: dict[str, str], **body: object) -> Routing | None:
    call = CHAT.parse(json.dumps({**CHAT_BODY, **body}).encode(), headers, tenant="t")
    return call.chat.routing


def test_each_session_source_wins_over_the_ones_after_it() -> None:
    body = {"prompt_cache_key": "pck", "user": "u"}
    # Headers in order: drop the winner each time and the next one wins.
    for i, name in enumerate(SESSION_HEADERS):
        headers = {n: v for n, v in ALL_HEADERS.items() if n not in SESSION_HEADERS[:i]}
        assert chat(headers, **body) == Routing(session=f"from-{name}", session_from=name)
    assert chat({}, **body) == Routing(session="pck", session_from="prompt_cache_key")
    assert chat({}, user="u") == Routing(session="u", session_from="user")
    assert chat({}) is None


def test_the_documented_header_order() -> None:
    assert SESSION_HEADERS == (
        "x-iop-session-id",
        "x-llm-d-inference-fairness-id",
        "x-claude-code-session-id",
        "session_id",
        "session-id",
    )


def test_an_empty_header_is_no_session() -> None:
    assert chat({"x-iop-session-id": "  "}, user="u") == Routing(session="u", session_from="user")


def test_messages_metadata_user_id_is_the_session_after_the_headers() -> None:
    body = {
        "model": "m",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"user_id": "user_abc_session_42"},
    }
    raw = json.dumps(body).encode()
    call = MESSAGES.parse(raw, {}, tenant="t")
    assert call.chat.routing == Routing(
        session="user_abc_session_42", session_from="metadata.user_id"
    )
    call = MESSAGES.parse(raw, {"x-claude-code-session-id": "cc-1"}, tenant="t")
    assert call.chat.routing == Routing(session="cc-1", session_from="x-claude-code-session-id")


def test_responses_prompt_cache_key_then_user() -> None:
    surface = ResponsesSurface(ResponseStore(max_entries=4, max_bytes=1 << 20, ttl_s=60))
    body = {"model": "m", "input": "hi", "prompt_cache_key": "pck", "user": "u"}
    call = surface.parse(json.dumps(body).encode(), {}, tenant="t")
    assert call.chat.routing == Routing(session="pck", session_from="prompt_cache_key")
    del body["prompt_cache_key"]
    call = surface.parse(json.dumps(body).encode(), {"session_id": "codex-1"}, tenant="t")
    assert call.chat.routing == Routing(session="codex-1", session_from="session_id")


def test_completions_and_embeddings_read_the_headers_too() -> None:
    headers = {"x-iop-session-id": "s", "x-iop-objective": "batch"}
    want = Routing(session="s", session_from="x-iop-session-id", objective="batch")
    raw = json.dumps({"model": "m", "prompt": "p"}).encode()
    assert COMPLETIONS.parse(raw, headers, tenant="t").request.routing == want  # type: ignore[union-attr]
    raw = json.dumps({"model": "m", "input": "p"}).encode()
    assert EMBEDDINGS.parse(raw, headers, tenant="t").request.routing == want  # type: ignore[union-attr]


def test_a_routing_object_in_the_body_is_never_the_clients_to_set() -> None:
    smuggled = {"session": "other", "objective": "interactive", "ttft_deadline_s": 0.1}
    assert chat({}, routing=smuggled) is None
    assert chat({"x-iop-session-id": "mine"}, routing=smuggled) == Routing(
        session="mine", session_from="x-iop-session-id"
    )


def test_objective_headers_and_the_llm_d_aliases() -> None:
    assert routing_of({"x-llm-d-inference-objective": "batch"}) == Routing(
        objective="batch", objective_from="x-llm-d-inference-objective"
    )
    both = {"x-iop-objective": "interactive", "x-llm-d-inference-objective": "batch"}
    assert routing_of(both) == Routing(objective="interactive")
    assert routing_of({"x-llm-d-slo-ttft-ms": "250"}) == Routing(ttft_deadline_s=0.25)
    assert routing_of({"x-llm-d-slo-ttft-ms": " 12.5 "}) == Routing(ttft_deadline_s=0.0125)


# Python's float() also takes "1_000", "1e3" and "٣" (Arabic-Indic digits):
# a header is a plain decimal number (RFC 9110 section 5.5 field values).
@pytest.mark.parametrize(
    "raw",
    ["abc", "0", "-5", "nan", "inf", "86400001", "1_000", "1e3", "\u0663\u0660", "+5", "0x10"],
)
def test_a_bad_ttft_header_is_a_400_naming_it(raw: str) -> None:
    with pytest.raises(RequestError) as info:
        chat({"x-llm-d-slo-ttft-ms": raw})
    assert info.value.status == 400
    assert info.value.param == "x-llm-d-slo-ttft-ms"
    assert "x-llm-d-slo-ttft-ms" in info.value.message


def test_a_session_key_past_the_bound_is_kept_as_its_digest() -> None:
    at = "s" * MAX_SESSION_CHARS
    assert routing_of({"x-iop-session-id": at}) == Routing(
        session=at, session_from="x-iop-session-id"
    )
    long = routing_of({"x-iop-session-id": at + "x"})
    other = routing_of({"x-iop-session-id": at + "y"})
    assert long is not None
    assert other is not None
    assert long.session.startswith("blake2b:")
    assert len(long.session) < MAX_SESSION_CHARS
    assert long.session != other.session
