"""Every surface's collector ends the same way (``iop/api/_collect.py``).

One run's events in, one ``(status, body)`` out: the first terminal event
sets it, an event after it and ``result()`` before it are bugs
(``InvariantError``), and ``finished`` says which side of it the collector
is. Each surface formats its own answer and error; these tests hold the
ending every surface shares, over the real surfaces, so one that drifts
fails here by name.
"""

from __future__ import annotations

import pytest

from iop.api import CHAT, COMPLETIONS, EMBEDDINGS, MESSAGES, Collector, ResponsesSurface, Surface
from iop.api._surface import RunContext
from iop.api.responses import ResponseStore
from iop.config import OutputPolicy
from iop.errors import InvariantError
from iop.events import Cancelled, CancelReason, Complete, Delta, EmbeddingData, Error, RuntimeEvent

CTX = RunContext(run_id="r1", created=1_700_000_000, policy=OutputPolicy())

_CHAT_BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'

# Each surface with a body it accepts and the output event of its operation.
_SURFACES: dict[str, tuple[Surface, bytes, RuntimeEvent]] = {
    "chat": (CHAT, _CHAT_BODY, Delta("hello")),
    "completions": (COMPLETIONS, b'{"model": "m", "prompt": "hi"}', Delta("hello")),
    "embeddings": (EMBEDDINGS, b'{"model": "m", "input": "hi"}', EmbeddingData.of(0, [0.5])),
    "messages": (
        MESSAGES,
        b'{"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}',
        Delta("hello"),
    ),
    "responses": (
        ResponsesSurface(ResponseStore(max_entries=4, max_bytes=1 << 20, ttl_s=60)),
        b'{"model": "m", "input": "hi"}',
        Delta("hello"),
    ),
}

_ENDINGS: dict[str, tuple[RuntimeEvent, int]] = {
    "complete": (Complete(), 200),
    "error": (Error(message="backend failed", status=502), 502),
    "cancelled": (Cancelled(reason=CancelReason.NODE_LOST), 503),
}


def _collector(name: str) -> tuple[Collector, RuntimeEvent]:
    surface, body, output = _SURFACES[name]
    call = surface.parse(body, {}, tenant="")
    return surface.collector(call, CTX), output


@pytest.mark.parametrize("ending", sorted(_ENDINGS))
@pytest.mark.parametrize("name", sorted(_SURFACES))
def test_the_terminal_event_sets_the_result_once(name: str, ending: str) -> None:
    collector, output = _collector(name)
    terminal, status = _ENDINGS[ending]
    if (name, status) == ("messages", 503):
        status = 529  # Anthropic's "overloaded" (iop/api/messages/_errors.py)
    collector.feed(output)
    assert not collector.finished
    with pytest.raises(InvariantError, match=r"^result\(\) before the run finished$"):
        collector.result()
    collector.feed(terminal)
    assert collector.finished
    got, body = collector.result()
    assert (got, collector.result()) == (status, (got, body))
    assert body
    for late in (output, Complete()):
        with pytest.raises(
            InvariantError, match=rf"^feed\({type(late).__name__}\) after the run finished$"
        ):
            collector.feed(late)
    assert collector.result() == (got, body)
