"""``GET /v1/models`` and ``GET /v1/models/{id}`` through the official SDKs, on a
real socket: OpenAI's shapes for an OpenAI client (``models.retrieve``, its
404 ``model_not_found``), Anthropic's for an Anthropic client (which sends
``anthropic-version`` and ``x-api-key``), ids holding ``/``, and the key
check with either key header."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import anthropic
import httpx
import openai
import pytest
import trio

from iop.capabilities import Capabilities
from iop.config import EdgeConfig
from iop.edge import EdgeHandle, serve_edge
from iop.testing import memory_link_pair
from tests.api.messages._sdk import validate_error as validate_anthropic_error
from tests.edge._openai_schema import validate_error
from tests.edge.test_app import config
from tests.edge.test_core import FakeNode

pytestmark = pytest.mark.timeout(60)

MODELS = ("m", "Qwen/Qwen3-8B")


@asynccontextmanager
async def edge_with(
    cfg: EdgeConfig, targets: tuple[str, ...] = MODELS
) -> AsyncIterator[EdgeHandle]:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        handle: EdgeHandle = await nursery.start(partial(serve_edge, cfg, shutdown=stop))
        edge_end, node_end = memory_link_pair()
        nursery.start_soon(handle.core.handle_link, edge_end, "test")
        node = FakeNode(node_end)
        caps = Capabilities(adapter="sim", instance="i0", targets=targets, max_concurrency=1)
        await node.hello([caps])
        nursery.start_soon(node.serve)
        yield handle
        stop.set()
        nursery.cancel_scope.cancel()


def _openai(url: str, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=10)


def _anthropic(url: str, key: str = "x") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=10)


async def test_openai_sdk_retrieves_a_model_and_gets_model_not_found() -> None:
    async with edge_with(config()) as handle:

        def check() -> None:
            with _openai(handle.url) as client:
                got = client.models.retrieve("m")
                assert (got.id, got.object, got.owned_by) == ("m", "model", "iop")
                listed = {m.id: m for m in client.models.list()}
                assert listed["m"].model_dump() == got.model_dump()
                # path_template percent-encodes the "/" (%2F): still found.
                assert client.models.retrieve("Qwen/Qwen3-8B").id == "Qwen/Qwen3-8B"
                with pytest.raises(openai.NotFoundError) as info:
                    client.models.retrieve("nope")
                body = info.value.response.json()
                validate_error(body)
                assert body["error"]["code"] == "model_not_found"
                assert body["error"]["param"] == "model"
                assert body["error"]["message"] == "The model 'nope' does not exist"

        await trio.to_thread.run_sync(check)


@pytest.mark.parametrize("path", ["/v1/models/Qwen/Qwen3-8B", "/v1/models/Qwen%2FQwen3-8B"])
async def test_a_model_id_with_a_slash_is_one_id(path: str) -> None:
    async with edge_with(config()) as handle, httpx.AsyncClient(base_url=handle.url) as http:
        resp = await http.get(path)
        assert resp.status_code == 200
        assert resp.json()["id"] == "Qwen/Qwen3-8B"
        assert resp.json()["nodes"] == ["n1"]
        resp = await http.get("/v1/models/Qwen/nope")
        assert resp.status_code == 404
        validate_error(resp.json())


async def test_anthropic_sdk_lists_and_retrieves_models_in_its_shapes() -> None:
    async with edge_with(config(api_keys=["sk-1"])) as handle:

        def check() -> None:
            with _anthropic(handle.url, "sk-1") as client:
                page = client.models.list()
                assert [m.id for m in page.data] == sorted(MODELS)
                assert page.has_more is False
                got = client.models.retrieve("m")
                assert (got.type, got.id, got.display_name) == ("model", "m", "m")
                assert got.created_at.tzinfo is not None
                with pytest.raises(anthropic.NotFoundError) as info:
                    client.models.retrieve("nope")
                validate_anthropic_error(info.value.response.json())
            with (
                _anthropic(handle.url, "wrong") as client,
                pytest.raises(anthropic.AuthenticationError) as denied,
            ):
                client.models.list()
            validate_anthropic_error(denied.value.response.json())
            assert denied.value.response.json()["error"]["type"] == "authentication_error"

        await trio.to_thread.run_sync(check)


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/m"])
async def test_model_routes_take_either_key_header(path: str) -> None:
    async with (
        edge_with(config(api_keys=["sk-1"])) as handle,
        httpx.AsyncClient(base_url=handle.url) as http,
    ):
        for headers in ({}, {"Authorization": "Bearer no"}, {"x-api-key": "no"}):
            resp = await http.get(path, headers=headers)
            assert resp.status_code == 401
            validate_error(resp.json())
            assert resp.json()["error"]["code"] == "invalid_api_key"
        for headers in ({"Authorization": "Bearer sk-1"}, {"x-api-key": "sk-1"}):
            resp = await http.get(path, headers=headers)
            assert resp.status_code == 200, resp.text
            assert "object" in resp.json()  # OpenAI's shape without anthropic-version


async def test_no_cross_origin_page_may_send_a_key_header() -> None:
    """Why accepting ``x-api-key`` on the model routes is safe: a browser asks
    first (a CORS preflight) and the edge never allows either key header."""
    async with (
        edge_with(config(api_keys=["sk-1"])) as handle,
        httpx.AsyncClient(base_url=handle.url) as http,
    ):
        for header in ("x-api-key", "authorization"):
            resp = await http.options(
                "/v1/models",
                headers={
                    "Origin": "https://elsewhere.example",
                    "Access-Control-Request-Method": "GET",
                    "Access-Control-Request-Headers": header,
                },
            )
            assert not [h for h in resp.headers if h.startswith("access-control-allow-")]
