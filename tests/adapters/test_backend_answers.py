"""What backends answer, replayed byte for byte through a real ``FakeBackend``.

Mid-stream failures in non-standard shapes, backend errors mapped onto
OpenAI's codes, and the bounds on what a backend can make an adapter buffer
(tool-call arguments, the ``/v1/models`` probe body).
"""

from __future__ import annotations

import pytest

from iop.adapters.openai_compat import OpenAICompatAdapter
from iop.adapters.vllm import VllmAdapter
from iop.config import Deadlines, OpenAICompatInstance, VllmInstance
from iop.events import Delta, Error, RuntimeEvent, Start
from iop.runtime import collect_run
from iop.spec import ChatRequest, ExecutionSpec, Message
from iop.testing import (
    CHAT_COMPLETIONS_PATH,
    FakeBackend,
    Reply,
    Split,
    load_transcript,
    open_fake_backend,
)

DEADLINES = Deadlines(first_token_timeout_s=10.0, idle_timeout_s=10.0, request_timeout_s=30.0)
SPEC = ExecutionSpec(
    run_id="r1",
    request=ChatRequest(model="m", messages=[Message(role="user", content="hi")], stream=True),
)


def _compat(fb: FakeBackend, **options: object) -> OpenAICompatAdapter:
    cfg = OpenAICompatInstance(name="c", endpoint=fb.url, provider="llamacpp", **options)  # type: ignore[arg-type]
    return OpenAICompatAdapter(cfg)


def _vllm(fb: FakeBackend, **options: object) -> VllmAdapter:
    return VllmAdapter(VllmInstance(name="v", endpoint=fb.url, **options))  # type: ignore[arg-type]


async def _run(adapter: OpenAICompatAdapter | VllmAdapter) -> list[RuntimeEvent]:
    try:
        return await collect_run(adapter, SPEC, DEADLINES)
    finally:
        await adapter.aclose()


def _text(events: list[RuntimeEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


# --- llama.cpp before PR #16109: `error:` field line, then [DONE] ------------------


@pytest.mark.parametrize("split", [Split.whole(), Split.bytewise(), Split.random(7)])
async def test_llamacpp_pre16109_error_field_fails_the_run(split: Split) -> None:
    body = load_transcript("llamacpp_pre16109_midstream_error.txt")
    async with open_fake_backend() as fb:
        fb.script(CHAT_COMPLETIONS_PATH, Reply.sse(body, split=split))
        events = await _run(_compat(fb))
    assert events[0] == Start(target="m")
    assert events[-1] == Error(
        message="openai_compat stream error: Failed to decode the batch (synthetic message)",
        status=500,
        code="backend_stream_error",
    )
    # Whatever was streamed before the failure reached the client as it came.
    assert "Hello! How".startswith(_text(events))
