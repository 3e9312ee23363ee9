"""Property: every chat body OpenAI's request schema describes, and every hostile
mutation of one (deep nesting, huge integers, wrong types, invalid UTF-8,
truncation, unknown keys), is served or refused with a 4xx in OpenAI's error
body; never a 5xx, never an exception.

Two levels: the sans-IO parser with many examples (a request it accepts must
also fit the node link's msgpack), and a smaller number through the real edge
(hypercorn on a socket, quart, the core, a hand-played node that answers every
run), so the HTTP layer and the run's start are covered too."""

from __future__ import annotations

import json
from functools import partial

import msgspec
import pytest
import trio
from hypothesis import HealthCheck, example, given, settings

from iop.api._openai_errors import error_body, openai_error_type
from iop.api.chat._request import parse_chat_request
from iop.errors import RequestError
from iop.events import Complete, Delta, Start, Usage
from iop.spec import ChatRequest, ExecutionSpec
from tests.edge._openai_schema import validate_error
from tests.edge._schema_bodies import chat_bodies
from tests.edge.test_app import CHAT, edge
from tests.edge.test_core import FakeNode

pytestmark = pytest.mark.timeout(120)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=chat_bodies())
def test_property_the_parser_accepts_or_gives_an_openai_400(raw: bytes) -> None:
    try:
        req: ChatRequest | RequestError = parse_chat_request(raw)
    except RequestError as exc:
        req = exc
    if isinstance(req, RequestError):
        assert req.status == 400
        body = error_body(
            req.message, type=openai_error_type(req.status), code=req.code, param=req.param
        )
        validate_error(json.loads(body))
    else:
        # What the edge accepts, the link can carry (the Assign is msgpack).
        msgspec.msgpack.encode(ExecutionSpec(run_id="r", request=req))


async def _answer_every_run(node: FakeNode) -> None:
    while True:
        assign = await node.assigns.receive()
        await node.send(
            assign.assign.run_id,
            Start(),
            Delta("ok"),
            Complete(usage=Usage(input_tokens=1, output_tokens=1)),
        )


async def test_property_the_edge_answers_200_or_4xx_never_5xx() -> None:
    async with edge() as (_, node, client), trio.open_nursery() as nursery:
        assert node is not None
        nursery.start_soon(_answer_every_run, node)
        statuses: list[int] = []

        async def post(raw: bytes) -> tuple[int, bytes, str]:
            resp = await client.post(
                "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
            )
            return resp.status_code, resp.content, resp.headers.get("content-type", "")

        # Hypothesis drives the examples from a worker thread, so one edge
        # (and its sockets) serves them all.
        @settings(
            max_examples=40,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        @given(raw=chat_bodies())
        @example(raw=json.dumps(CHAT).encode())  # at least one real run, every time
        def check(raw: bytes) -> None:
            status, body, content_type = trio.from_thread.run(partial(post, raw))
            statuses.append(status)
            assert status < 500, body
            if status >= 400:
                validate_error(json.loads(body))
            else:
                assert status == 200
                assert content_type.startswith(("application/json", "text/event-stream"))

        await trio.to_thread.run_sync(check)
        nursery.cancel_scope.cancel()
    assert 200 in statuses
