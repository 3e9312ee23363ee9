"""Structured output on every surface, end to end: a JSON schema asked for on chat
(``response_format``), Responses (``text.format``) and Messages (``output_config.format``)
reaches the backend as ``response_format``, which the sim answers as guided decoding would and
the real llama.cpp server turns into a grammar. docs/api.md, "Structured output".
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import anthropic
import jsonschema
import openai
import pytest

from iop.testing import Proc
from tests.e2e._platform import (
    Edge,
    poll,
    require_real_backend,
    start_edge,
    start_node,
    start_sim,
)

SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "days", "sunny"],
    "additionalProperties": False,
}
ASK: Final = "The weather in Paris for the next days?"


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    logs = tmp_path_factory.mktemp("structured")
    procs: list[Proc] = []
    the_edge: Edge | None = None
    try:
        sim = start_sim(logs, "sim", "--model", "json-sim")
        procs.append(sim.proc)
        the_edge = start_edge(logs, {})
        procs.append(the_edge.proc)
        procs.append(start_node(logs, [the_edge.link_url], sim.url).proc)
        poll(lambda: "json-sim" in the_edge.models(), timeout=60, what="the sim's model")  # type: ignore[union-attr]
        yield the_edge
    finally:
        if the_edge is not None:
            the_edge.close()
        for p in reversed(procs):
            p.stop()


def _openai(edge: Edge) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{edge.url}/v1", api_key="unused", max_retries=0)


def _valid(text: str) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


@pytest.mark.parametrize("stream", [False, True])
def test_chat_response_format(edge: Edge, stream: bool) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    messages: Any = [{"role": "user", "content": ASK}]
    with _openai(edge) as client:
        text = _chat(client, messages, fmt, stream=stream)
    _valid(text)


def _chat(client: openai.OpenAI, messages: Any, fmt: Any, *, stream: bool) -> str:
    if stream:
        chunks = client.chat.completions.create(
            model="json-sim", messages=messages, response_format=fmt, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        answer = client.chat.completions.create(
            model="json-sim", messages=messages, response_format=fmt
        )
        text = answer.choices[0].message.content or ""
    return text


def test_responses_text_format(edge: Edge) -> None:
    with _openai(edge) as client:
        response = client.responses.create(
            model="json-sim",
            input=ASK,
            text={"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA}},
        )
    _valid(response.output_text)


def test_messages_output_config_format(edge: Edge) -> None:
    with anthropic.Anthropic(base_url=edge.url, api_key="unused", max_retries=0) as client:
        message = client.messages.create(
            model="json-sim",
            max_tokens=256,
            messages=[{"role": "user", "content": ASK}],
            output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
        )
    block = message.content[0]
    assert block.type == "text"
    _valid(block.text)


def test_without_a_format_the_answer_is_text(edge: Edge) -> None:
    with _openai(edge) as client:
        answer = client.chat.completions.create(
            model="json-sim", messages=[{"role": "user", "content": ASK}]
        )
    with pytest.raises(json.JSONDecodeError):
        json.loads(answer.choices[0].message.content or "")


def test_the_real_llamacpp_server_answers_the_schema(tmp_path: Path) -> None:
    require_real_backend()
    procs: list[Proc] = []
    the_edge: Edge | None = None
    try:
        the_edge = start_edge(tmp_path, {})
        procs.append(the_edge.proc)
        node = start_node(
            tmp_path,
            [the_edge.link_url],
            "http://127.0.0.1:9",  # the default vllm instance: unused, not served
            instance={"operations": ["embedding"], "targets": ["unused"]},
            more_instances=[
                {"adapter": "llamacpp", "name": "smol", "alias": "smol", "ctx": 1024, "parallel": 1}
            ],
        )
        procs.append(node.proc)
        edge = the_edge
        poll(lambda: "smol" in edge.models(), timeout=60, what="llama.cpp's model")
        with _openai(edge) as client:
            answer = client.chat.completions.create(
                model="smol",
                messages=[{"role": "user", "content": ASK}],
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "weather", "schema": SCHEMA},
                },
                max_tokens=96,
                temperature=0,
            )
        assert answer.choices[0].finish_reason == "stop"
        _valid(answer.choices[0].message.content or "")
    finally:
        if the_edge is not None:
            the_edge.close()
        for p in reversed(procs):
            p.stop()
