"""The Responses, Messages, completions and embeddings surfaces through the official SDKs, against real
processes: ``iop sim`` (in its scripted tool mode: a request offering
``Bash`` is answered by a call of it, then by ``The tool said: <result>``
once the result comes back), ``iop edge`` with an API key, ``iop node``; and
a second ``iop edge`` no node ever joins, for "no capacity".

Every streamed Responses event and every Response is validated against
OpenAI's schemas (``tests/data/openai-schemas.json``), every error against
its ``ErrorResponse``; Anthropic's events, messages and errors are parsed
strictly with the ``anthropic`` SDK's own types (``tests/api/messages/_sdk``).
The streams are read twice over: raw off the socket (what is validated) and
through the SDK's stream helpers (what clients use)."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from typing import Any, Final

import anthropic
import httpx
import openai
import pytest

from iop.wire import SSEDecoder
from tests.api.messages._sdk import validate_error as validate_anthropic_error
from tests.api.messages._sdk import validate_event as validate_anthropic_event
from tests.api.messages._sdk import validate_message
from tests.api.responses._schema import validate_error, validate_event, validate_response
from tests.e2e._platform import MODEL, Edge, Sim, start_edge, start_node, start_sim

pytestmark = pytest.mark.timeout(120)

KEY: Final = "sk-surfaces"
COMMAND: Final = {"command": "echo iop-tool-ok"}
TOOL_OUTPUT: Final = "iop-tool-ok\n"
ANSWER: Final = "The tool said: iop-tool-ok"
PARAMETERS: Final = {"type": "object", "properties": {"command": {"type": "string"}}}
RESPONSES_TOOLS: Any = [{"type": "function", "name": "Bash", "parameters": PARAMETERS}]
ANTHROPIC_TOOLS: Any = [{"name": "Bash", "input_schema": PARAMETERS}]
HI: Any = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    s = start_sim(
        tmp_path_factory.mktemp("sim"),
        "sim",
        "--output-tokens",
        "8",
        "--tool-call-name",
        "Bash",
        "--tool-call-arguments",
        json.dumps(COMMAND),
    )
    try:
        yield s
    finally:
        s.close()
        s.proc.stop()


@pytest.fixture(scope="module")
def edge(sim: Sim, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    config = {"server": {"api_keys": [KEY], "keepalive_interval_s": 0.5}}
    e = start_edge(tmp_path_factory.mktemp("edge"), config)
    # The sim serves every operation; a vllm instance advertises embeddings
    # only when told (docs/configuration.md, `operations`).
    operations = ["chat", "completion", "embedding", "tokenize"]
    node = start_node(
        tmp_path_factory.mktemp("node"),
        [e.link_url],
        sim.url,
        instance={"operations": operations},
    )
    try:
        e.wait_ready(node_id=node.node_id)
        yield e
    finally:
        node.proc.stop()
        e.close()
        e.proc.stop()


@pytest.fixture(scope="module")
def empty_edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    """An edge no node joins: every run finds no capacity."""
    e = start_edge(tmp_path_factory.mktemp("empty-edge"), {}, name="empty-edge")
    try:
        yield e
    finally:
        e.close()
        e.proc.stop()


@pytest.fixture
def oai(edge: Edge) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{edge.url}/v1", api_key=KEY, max_retries=0, timeout=30) as client:
        yield client


@pytest.fixture
def claude(edge: Edge) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=edge.url, api_key=KEY, max_retries=0, timeout=30) as client:
        yield client


def _raw_stream(edge: Edge, path: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``(event name, data)`` of each SSE event of a streamed POST, read raw."""
    headers = {"Authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01"}
    with (
        httpx.Client(base_url=edge.url, timeout=30) as http,
        http.stream("POST", path, json={**body, "stream": True}, headers=headers) as resp,
    ):
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(resp.iter_bytes())
    return [(ev.event, json.loads(ev.data)) for ev in SSEDecoder().feed(raw) if ev.data]


# --- OpenAI Responses ------------------------------------------------------------------


def _validated(response: openai.types.responses.Response) -> dict[str, Any]:
    obj: dict[str, Any] = response.to_dict()
    validate_response(obj)
    return obj


def test_responses_create_plain_and_with_instructions(oai: openai.OpenAI) -> None:
    plain = oai.responses.create(model=MODEL, input="hi")
    _validated(plain)
    assert plain.status == "completed"
    assert plain.output_text
    assert plain.usage is not None
    assert plain.usage.output_tokens > 0
    told = oai.responses.create(model=MODEL, instructions="Answer briefly.", input=HI)
    _validated(told)
    assert told.instructions == "Answer briefly."
    assert told.output_text
    assert told.id != plain.id


def _function_call(response: openai.types.responses.Response) -> Any:
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1, response.output
    return calls[0]


def test_responses_tool_round_trip_by_previous_response_id(oai: openai.OpenAI) -> None:
    first = oai.responses.create(model=MODEL, input="run it", tools=RESPONSES_TOOLS)
    _validated(first)
    call = _function_call(first)
    assert call.name == "Bash"
    assert json.loads(call.arguments) == COMMAND
    assert call.status == "completed"
    second = oai.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": TOOL_OUTPUT}],
        tools=RESPONSES_TOOLS,
    )
    _validated(second)
    assert second.previous_response_id == first.id
    assert second.output_text == ANSWER


def test_responses_tool_round_trip_resending_the_items(oai: openai.OpenAI) -> None:
    """As Codex does (``store: false``): every item sent again on each turn."""
    items: list[Any] = [{"role": "user", "content": "run it"}]
    first = oai.responses.create(model=MODEL, input=items, tools=RESPONSES_TOOLS, store=False)
    call = _function_call(first)
    items += [
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_OUTPUT},
    ]  # fmt: skip
    second = oai.responses.create(model=MODEL, input=items, tools=RESPONSES_TOOLS, store=False)
    _validated(second)
    assert second.output_text == ANSWER


def test_responses_previous_response_id_continues_and_an_unknown_one_is_400(
    oai: openai.OpenAI,
) -> None:
    first = oai.responses.create(model=MODEL, input="hi")
    again = oai.responses.create(model=MODEL, input="more", previous_response_id=first.id)
    _validated(again)
    assert again.status == "completed"
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope")
    body = info.value.response.json()
    validate_error(body)
    assert body["error"]["code"] == "previous_response_not_found"
    assert body["error"]["param"] == "previous_response_id"
    assert info.value.code == "previous_response_not_found"


_TEXT_EVENTS: Final = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]
_TOOL_EVENTS: Final = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
    "response.completed",
]


def _collapsed(names: list[str]) -> list[str]:
    """``names`` with runs of one name collapsed (any number of deltas)."""
    return [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"input": "hi"}, _TEXT_EVENTS),
        ({"input": "run it", "tools": RESPONSES_TOOLS}, _TOOL_EVENTS),
    ],
    ids=["text", "function_call"],
)
def test_responses_stream_events_in_order_each_valid(
    edge: Edge, oai: openai.OpenAI, body: dict[str, Any], expected: list[str]
) -> None:
    events = _raw_stream(edge, "/v1/responses", {"model": MODEL, **body})
    for name, data in events:
        assert name == data["type"]
        validate_event(data)
    assert _collapsed([data["type"] for _, data in events]) == expected
    numbers = [data["sequence_number"] for _, data in events]
    assert numbers == sorted(set(numbers)), numbers
    final = events[-1][1]["response"]
    validate_response(final)
    assert final["status"] == "completed"
    # The same through the SDK's helper: its accumulated response is the last event's.
    with oai.responses.stream(model=MODEL, **body) as stream:
        seen = [event.type for event in stream]
        response = stream.get_final_response()
    assert _collapsed(seen) == expected
    assert response.status == "completed"
    if "tools" in body:
        assert json.loads(_function_call(response).arguments) == COMMAND
    else:
        assert response.output_text


def test_models_retrieve(oai: openai.OpenAI) -> None:
    model = oai.models.retrieve(MODEL)
    assert (model.id, model.object) == (MODEL, "model")
    with pytest.raises(openai.NotFoundError) as info:
        oai.models.retrieve("no-such-model")
    validate_error(info.value.response.json())
    assert info.value.code == "model_not_found"


# --- Anthropic Messages ----------------------------------------------------------------


def test_messages_create(claude: anthropic.Anthropic) -> None:
    raw = claude.messages.with_raw_response.create(model=MODEL, max_tokens=64, messages=HI)
    message = validate_message(raw.http_response.json())
    assert message.role == "assistant"
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.content
    assert message.content[0].type == "text"
    assert message.usage.output_tokens > 0
    assert raw.parse().id == message.id


def test_messages_stream_text(edge: Edge, claude: anthropic.Anthropic) -> None:
    events = _raw_stream(edge, "/v1/messages", {"model": MODEL, "max_tokens": 64, "messages": HI})
    for name, data in events:
        validate_anthropic_event(name, data)
    names = [name for name, _ in events if name != "ping"]
    assert names[0] == "message_start"
    assert names[-2:] == ["message_delta", "message_stop"]
    with claude.messages.stream(model=MODEL, max_tokens=64, messages=HI) as stream:
        text = stream.get_final_text()
        final = stream.get_final_message()
    assert text
    assert final.stop_reason in ("end_turn", "max_tokens")


def test_messages_stream_tool_use_round_trip(edge: Edge, claude: anthropic.Anthropic) -> None:
    body = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "run"}]}
    events = _raw_stream(edge, "/v1/messages", {**body, "tools": ANTHROPIC_TOOLS})
    for name, data in events:
        validate_anthropic_event(name, data)
    deltas = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert deltas
    assert set(deltas) == {"input_json_delta"}
    messages: list[Any] = [{"role": "user", "content": "run it"}]
    with claude.messages.stream(
        model=MODEL, max_tokens=64, messages=messages, tools=ANTHROPIC_TOOLS
    ) as stream:
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use"
    (use,) = [block for block in first.content if block.type == "tool_use"]
    assert (use.name, use.input) == ("Bash", COMMAND)
    messages += [
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": TOOL_OUTPUT}],
        },
    ]
    with claude.messages.stream(
        model=MODEL, max_tokens=64, messages=messages, tools=ANTHROPIC_TOOLS
    ) as stream:
        text = stream.get_final_text()
        second = stream.get_final_message()
    assert text == ANSWER
    assert second.stop_reason == "end_turn"


def test_count_tokens_is_the_backends_tokenizer(claude: anthropic.Anthropic) -> None:
    # A tokenize run: the node asks the backend's POST /tokenize (the sim's).
    raw = claude.messages.with_raw_response.count_tokens(
        model=MODEL, messages=HI, system="Be brief.", tools=ANTHROPIC_TOOLS
    )
    counted = raw.parse()
    assert counted.input_tokens > 0
    assert raw.http_response.headers["x-iop-token-count"] == "exact"
    bare = claude.messages.count_tokens(model=MODEL, messages=HI)
    assert 0 < bare.input_tokens < counted.input_tokens


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_messages_auth_is_x_api_key_or_bearer(edge: Edge, path: str) -> None:
    body = {"model": MODEL, "max_tokens": 8, "messages": HI}
    with httpx.Client(base_url=edge.url, timeout=30) as http:
        for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
            resp = http.post(
                path, json=body, headers={"anthropic-version": "2023-06-01", **headers}
            )
            assert resp.status_code == 401
            validate_anthropic_error(resp.json())
            assert resp.json()["error"]["type"] == "authentication_error"
        for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
            assert http.post(path, json=body, headers=headers).status_code == 200
    with (
        anthropic.Anthropic(
            base_url=edge.url, api_key="wrong", max_retries=0, timeout=30
        ) as client,
        pytest.raises(anthropic.AuthenticationError),
    ):
        client.messages.create(model=MODEL, max_tokens=8, messages=HI)


def test_no_node_is_529_overloaded(empty_edge: Edge) -> None:
    """Anthropic's "no capacity, retry later" (``iop.api.messages._errors``); OpenAI
    surfaces keep 503."""
    with anthropic.Anthropic(
        base_url=empty_edge.url, api_key="x", max_retries=0, timeout=30
    ) as client:
        with pytest.raises(anthropic.OverloadedError) as info:
            client.messages.create(model=MODEL, max_tokens=8, messages=HI)
        assert info.value.status_code == 529
        validate_anthropic_error(info.value.response.json())
        assert info.value.response.json()["error"]["type"] == "overloaded_error"
        with (
            pytest.raises(anthropic.OverloadedError),
            client.messages.stream(model=MODEL, max_tokens=8, messages=HI) as stream,
        ):
            stream.get_final_message()
    with (
        openai.OpenAI(
            base_url=f"{empty_edge.url}/v1", api_key="x", max_retries=0, timeout=30
        ) as oai,
        pytest.raises(openai.InternalServerError) as failed,
    ):
        oai.responses.create(model=MODEL, input="hi")
    assert failed.value.status_code == 503
    validate_error(failed.value.response.json())


# --- OpenAI legacy completions and embeddings --------------------------------------------


def test_completions_create_streamed_and_not(oai: openai.OpenAI) -> None:
    whole = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6)
    assert whole.object == "text_completion"
    [choice] = whole.choices
    assert choice.text.strip()
    assert choice.finish_reason == "length"
    assert whole.usage is not None
    assert whole.usage.completion_tokens == 6
    chunks = list(
        oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, stream=True)
    )
    assert all(c.object == "text_completion" for c in chunks)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == choice.text  # the sim is deterministic: the same prompt, the same text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_embeddings_create_float_and_base64(oai: openai.OpenAI) -> None:
    floats = oai.embeddings.create(model=MODEL, input=["a cat", "a dog", "a cat"])
    assert [d.index for d in floats.data] == [0, 1, 2]
    cat, dog, cat_again = (d.embedding for d in floats.data)
    assert cat == cat_again != dog
    assert sum(x * x for x in cat) == pytest.approx(1.0, abs=1e-5)  # unit length
    assert floats.usage.prompt_tokens > 0
    # base64 of little-endian float32: the same numbers, as OpenAI sends them.
    b64 = oai.embeddings.create(model=MODEL, input="a cat", encoding_format="base64")
    raw = base64.b64decode(str(b64.data[0].embedding))
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(cat, abs=1e-6)


def test_embeddings_with_no_node_is_a_503_in_openais_body(empty_edge: Edge) -> None:
    with (
        openai.OpenAI(base_url=f"{empty_edge.url}/v1", api_key="x", max_retries=0) as client,
        pytest.raises(openai.APIStatusError) as caught,
    ):
        client.embeddings.create(model=MODEL, input="a cat")
    assert caught.value.status_code == 503
    validate_error(caught.value.response.json())
