"""Property, for the Responses, Messages, completions and embeddings surfaces (chat's is
``test_request_fuzz``): every body the API describes, and every hostile
mutation of one (deep nesting, huge integers, wrong types, invalid UTF-8,
truncation, unknown keys), is served or refused with a 4xx in the surface's
own error shape; never a 5xx, never an exception.

Two levels, as for chat: the sans-IO parser with many examples (a request it
accepts must fit the node link's msgpack), and fewer through the real edge
(hypercorn on a socket, quart, the core, a hand-played node that answers
every run). Responses errors validate against OpenAI's ``ErrorResponse``,
Anthropic errors with the ``anthropic`` SDK's own error types, and a 200's
body against the API's response type."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec
import pytest
import trio
from hypothesis import HealthCheck, example, given, settings

from iop.api import CompletionsSurface, EmbeddingsSurface, MessagesSurface, ResponsesSurface
from iop.config import ResponsesSettings
from iop.errors import RequestError
from iop.spec import ExecutionSpec, OperationRequest
from tests.api.messages._sdk import validate_error as validate_anthropic_error
from tests.api.messages._sdk import validate_message
from tests.api.responses._schema import validate_error as validate_openai_error
from tests.api.responses._schema import validate_response
from tests.edge._schema_bodies import (
    completions_bodies,
    embeddings_bodies,
    messages_bodies,
    responses_bodies,
)
from tests.edge.test_app import edge
from tests.edge.test_request_fuzz import _answer_every_run

pytestmark = pytest.mark.timeout(180)

RESPONSES = ResponsesSurface.from_settings(ResponsesSettings())
MESSAGES = MessagesSurface()
COMPLETIONS = CompletionsSurface()
EMBEDDINGS = EmbeddingsSurface()

_RESPONSES_OK = {"model": "m", "input": "hi"}
_MESSAGES_OK = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}

_SANS_IO = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _fits_link(request: OperationRequest) -> None:
    msgspec.msgpack.encode(ExecutionSpec(run_id="r", request=request))


def _openai_refusal(exc: RequestError) -> None:
    assert 400 <= exc.status < 500, exc
    status, body = RESPONSES.error_body(exc.status, exc.message, code=exc.code, param=exc.param)
    assert status == exc.status
    validate_openai_error(json.loads(body))


def _anthropic_refusal(exc: RequestError) -> None:
    assert 400 <= exc.status < 500, exc
    status, body = MESSAGES.error_body(exc.status, exc.message, code=exc.code, param=exc.param)
    assert status == exc.status
    validate_anthropic_error(json.loads(body))


@_SANS_IO
@given(raw=responses_bodies())
@example(raw=b"{}")  # the schema requires nothing: a body without one string
@example(raw=b"\xff{}")
def test_property_responses_parses_or_gives_an_openai_4xx(raw: bytes) -> None:
    try:
        call = RESPONSES.parse(raw, {})
    except RequestError as exc:
        _openai_refusal(exc)
    else:
        _fits_link(call.request)


@_SANS_IO
@given(raw=messages_bodies())
def test_property_messages_parses_or_gives_an_anthropic_4xx(raw: bytes) -> None:
    try:
        call = MESSAGES.parse(raw, {"anthropic-version": "2023-06-01"})
    except RequestError as exc:
        _anthropic_refusal(exc)
    else:
        _fits_link(call.request)


@_SANS_IO
@given(raw=completions_bodies())
def test_property_completions_parses_or_gives_an_openai_4xx(raw: bytes) -> None:
    try:
        call = COMPLETIONS.parse(raw, {})
    except RequestError as exc:
        _openai_refusal(exc)
    else:
        _fits_link(call.request)


@_SANS_IO
@given(raw=embeddings_bodies())
def test_property_embeddings_parses_or_gives_an_openai_4xx(raw: bytes) -> None:
    try:
        call = EMBEDDINGS.parse(raw, {})
    except RequestError as exc:
        _openai_refusal(exc)
    else:
        _fits_link(call.request)


@_SANS_IO
@given(raw=messages_bodies())
def test_property_count_tokens_counts_or_gives_an_anthropic_4xx(raw: bytes) -> None:
    try:
        request = MESSAGES.parse_count_tokens(raw)
    except RequestError as exc:
        _anthropic_refusal(exc)
    else:
        status, body, headers = MESSAGES.count_tokens(request)
        assert status == 200
        assert headers == {"x-iop-token-count": "estimated"}
        assert json.loads(body)["input_tokens"] >= 0


def _validate_200(path: str, body: bytes) -> None:
    obj = json.loads(body)
    if path == "/v1/responses":
        validate_response(obj)
    elif path == "/v1/messages":
        validate_message(obj)
    elif path == "/v1/messages/count_tokens":
        assert isinstance(obj["input_tokens"], int)
    else:
        assert obj["object"] in ("text_completion", "list")


def _validate_refusal(path: str, body: bytes) -> None:
    if not path.startswith("/v1/messages"):
        validate_openai_error(json.loads(body))
    else:
        validate_anthropic_error(json.loads(body))


_EDGE_CASES: list[tuple[str, Callable[[], Any], dict[str, Any]]] = [
    ("/v1/responses", responses_bodies, _RESPONSES_OK),
    ("/v1/messages", messages_bodies, _MESSAGES_OK),
    ("/v1/messages/count_tokens", messages_bodies, _MESSAGES_OK),
]


# Ids by path alone: a function's repr holds its address, which differs
# between pytest-xdist's workers, and they must collect the same ids.
@pytest.mark.parametrize(
    ("path", "bodies", "valid"), _EDGE_CASES, ids=[path for path, _, _ in _EDGE_CASES]
)
async def test_property_the_edge_answers_200_or_4xx_never_5xx(
    path: str, bodies: Callable[[], Any], valid: dict[str, Any]
) -> None:
    async with edge() as (_, node, client), trio.open_nursery() as nursery:
        assert node is not None
        nursery.start_soon(_answer_every_run, node)
        statuses: list[int] = []
        headers = {"content-type": "application/json", "anthropic-version": "2023-06-01"}

        async def post(raw: bytes) -> tuple[int, bytes, str]:
            resp = await client.post(path, content=raw, headers=headers)
            return resp.status_code, resp.content, resp.headers.get("content-type", "")

        # Hypothesis drives the examples from a worker thread, so one edge
        # (and its sockets) serves them all.
        @settings(
            max_examples=30,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        @given(raw=bodies())
        @example(raw=json.dumps(valid).encode())  # at least one real run, every time
        def check(raw: bytes) -> None:
            status, body, content_type = trio.from_thread.run(partial(post, raw))
            statuses.append(status)
            assert status < 500, body
            if status >= 400:
                _validate_refusal(path, body)
            else:
                assert status == 200
                if content_type.startswith("application/json"):
                    _validate_200(path, body)
                else:
                    assert content_type.startswith("text/event-stream")

        await trio.to_thread.run_sync(check)
        nursery.cancel_scope.cancel()
    assert 200 in statuses
