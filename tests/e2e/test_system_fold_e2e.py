"""System messages inside the conversation, end to end: a template that wants one system
message first gets one (the node folds them, ``system_messages = "fold"``, the default), and an
instance that says its template takes them anywhere (``keep``) gets them as sent.

Against the sim's template check (``--leading-system-only``) and the real llama.cpp server with
a template that raises on a late system message, as strict open-model templates do.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import anthropic
import openai
import pytest

from iop.testing import Proc
from tests.e2e._platform import (
    Edge,
    Sim,
    poll,
    require_real_backend,
    start_edge,
    start_node,
    start_sim,
)

# What Claude Code sends: its system prompt, then a system message after a user turn.
CONVERSATION: Final = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "List the files."},
    {"role": "assistant", "content": "There are two."},
    {"role": "system", "content": "The user changed directory."},
    {"role": "user", "content": "And now?"},
]

# A ChatML template that raises on a system message anywhere but first (the check strict
# open-model templates make, with llama.cpp's Jinja `raise_exception`).
STRICT_TEMPLATE: Final = """\
{%- for message in messages -%}
{%- if message['role'] == 'system' and not loop.first -%}
{{- raise_exception('System message must be at the beginning.') -}}
{%- endif -%}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""


def _client(edge: Edge) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{edge.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Edge, list[Any]]]:
    logs = tmp_path_factory.mktemp("fold-sim")
    procs: list[Proc] = []
    edge: Edge | None = None
    try:
        fold = start_sim(logs, "sim-fold", "--model", "strict-fold", "--leading-system-only")
        keep = start_sim(logs, "sim-keep", "--model", "strict-keep", "--leading-system-only")
        procs += [fold.proc, keep.proc]
        edge = start_edge(logs, {})
        procs.append(edge.proc)
        node = start_node(
            logs,
            [edge.link_url],
            fold.url,
            instance={"name": "fold"},
            more_instances=[
                {"adapter": "vllm", "name": "keep", "endpoint": keep.url, "system_messages": "keep"}
            ],
        )
        procs.append(node.proc)
        yield edge, [fold, keep]
    finally:
        if edge is not None:
            edge.close()
        for p in reversed(procs):
            p.stop()


def _wait_models(edge: Edge, *models: str) -> None:
    poll(lambda: set(models) <= set(edge.models()), timeout=60, what=f"models {models}")


def test_the_sim_refuses_a_late_system_message_that_reaches_it(
    sims: tuple[Edge, list[Sim]],
) -> None:
    edge, _ = sims
    _wait_models(edge, "strict-fold", "strict-keep")
    with _client(edge) as client, pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="strict-keep", messages=CONVERSATION)
    assert "System message must be at the beginning" in str(refused.value)


@pytest.mark.parametrize("stream", [False, True])
def test_the_default_folds_so_a_strict_template_answers(
    sims: tuple[Edge, list[Sim]], stream: bool
) -> None:
    edge, _ = sims
    _wait_models(edge, "strict-fold")
    with _client(edge) as client:
        _ask(client, stream=stream)


def _ask(client: openai.OpenAI, *, stream: bool) -> None:
    if stream:
        chunks = list(
            client.chat.completions.create(model="strict-fold", messages=CONVERSATION, stream=True)
        )
        assert chunks[-1].choices[0].finish_reason == "stop"
    else:
        answer = client.chat.completions.create(model="strict-fold", messages=CONVERSATION)
        assert answer.choices[0].message.content


def test_claude_codes_system_message_through_messages_reaches_a_strict_template(
    sims: tuple[Edge, list[Sim]],
) -> None:
    edge, _ = sims
    _wait_models(edge, "strict-fold", "strict-keep")
    with anthropic.Anthropic(base_url=edge.url, api_key="unused", max_retries=0) as client:
        _claude_code_turn(client)


def _claude_code_turn(client: anthropic.Anthropic) -> None:
    messages: Any = [
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "There are two."},
        # Not in Anthropic's schema: Claude Code sends it (docs/api.md).
        {"role": "system", "content": "The user changed directory."},
        {"role": "user", "content": "And now?"},
    ]
    answer = client.messages.create(
        model="strict-fold", max_tokens=16, system="You are a coding agent.", messages=messages
    )
    assert answer.stop_reason in ("end_turn", "max_tokens")
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(
            model="strict-keep", max_tokens=16, system="You are a coding agent.", messages=messages
        )


def test_the_real_llamacpp_template_refuses_kept_and_answers_folded(tmp_path: Path) -> None:
    require_real_backend()
    template = tmp_path / "strict.jinja"
    template.write_text(STRICT_TEMPLATE)
    procs: list[Proc] = []
    edge: Edge | None = None
    try:
        edge = start_edge(tmp_path, {})
        procs.append(edge.proc)
        common = {
            "adapter": "llamacpp",
            "ctx": 1024,
            "parallel": 1,
            "chat_template_file": str(template),
        }
        node = start_node(
            tmp_path,
            [edge.link_url],
            "http://127.0.0.1:9",  # the default vllm instance: unused, not served
            instance={"operations": ["embedding"], "targets": ["unused"]},
            more_instances=[
                {**common, "name": "fold", "alias": "smol-fold"},
                {**common, "name": "keep", "alias": "smol-keep", "system_messages": "keep"},
            ],
        )
        procs.append(node.proc)
        _wait_models(edge, "smol-fold", "smol-keep")
        with _client(edge) as client:
            answer = client.chat.completions.create(
                model="smol-fold", messages=CONVERSATION, max_tokens=4
            )
            assert answer.choices[0].finish_reason in ("stop", "length")
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(
                    model="smol-keep", messages=CONVERSATION, max_tokens=4
                )
        assert "System message must be at the beginning" in str(refused.value)
    finally:
        if edge is not None:
            edge.close()
        for p in reversed(procs):
            p.stop()
