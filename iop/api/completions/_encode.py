"""``/v1/completions`` responses (sans-IO): the ``text_completion`` stream and body.

A completion run is ``Start Delta* Terminal`` (``iop.events``). The text is
sent as the backend produced it: the output policy of chat (strict mode,
``<think>`` stripping, tool calls found in text) is about chat messages and
does not apply to a raw text completion.

Stream (what OpenAI sends; no role chunk, unlike chat)::

    data: {"id":"cmpl-<run>","object":"text_completion","created":..,"model":..,
           "choices":[{"index":0,"text":"Hel","logprobs":null,"finish_reason":null}]}
    ...
    data: {..."choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"stop"}]}
    data: {..."choices":[],"usage":{...}}        (only with stream_options.include_usage)
    data: [DONE]

A run that fails after its first bytes ends the stream with
``data: {"error": {...}}`` then ``data: [DONE]``, as chat streams do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import msgspec

from iop.api._collect import BaseCollector
from iop.api.completions._errors import event_error
from iop.errors import InvariantError
from iop.events import Cancelled, Complete, Delta, Error, FinishReason, RuntimeEvent, Usage
from iop.wire import DONE

__all__ = ["KEEPALIVE", "CompletionCollector", "CompletionStream", "completion_id"]

KEEPALIVE: Final = b": keep-alive\n\n"

_encode: Final = msgspec.json.encode


def completion_id(run_id: str) -> str:
    return f"cmpl-{run_id}"


def _finish(reason: FinishReason) -> str:
    # The legacy endpoint's vocabulary has no tool calls.
    if reason in (FinishReason.LENGTH, FinishReason.CONTENT_FILTER):
        return reason.value
    return "stop"


class _Choice(msgspec.Struct, frozen=True, gc=False):
    index: int
    text: str
    logprobs: None
    finish_reason: str | None


class _PromptTokensDetails(msgspec.Struct, frozen=True, gc=False):
    cached_tokens: int


class _Usage(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # OpenAI's CompletionUsage.prompt_tokens_details, as chat has it: the
    # ledger charges cached tokens at their own price (docs/operations.md,
    # "Usage and budgets"), so the client is told them; left out with none.
    prompt_tokens_details: _PromptTokensDetails | None = None


def _usage(usage: Usage) -> _Usage:
    cached = usage.cached_input_tokens
    details = _PromptTokensDetails(cached) if cached else None
    return _Usage(usage.input_tokens, usage.output_tokens, usage.total_tokens, details)


class _Chunk(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[_Choice]
    usage: _Usage | None = None


def _text(text: str) -> str:
    # Lone surrogates (a broken backend) cannot be UTF-8: ``?``, as chat does.
    return text.encode("utf-8", "replace").decode("utf-8")


class CompletionStream:
    """One streamed ``/v1/completions`` response (the surface's ``StreamEncoder``)."""

    def __init__(self, *, run_id: str, created: int, model: str, include_usage: bool) -> None:
        self._id = completion_id(run_id)
        self._created = created
        self._model = model
        self._include_usage = include_usage
        self._finished = False

    @property
    def finished(self) -> bool:
        return self._finished

    def start(self) -> bytes:
        return b""

    def keepalive(self) -> bytes:
        return b"" if self._finished else KEEPALIVE

    def _chunk(self, choices: list[_Choice], usage: _Usage | None = None) -> bytes:
        chunk = _Chunk(self._id, "text_completion", self._created, self._model, choices, usage)
        return b"data: " + _encode(chunk) + b"\n\n"

    def feed(self, event: RuntimeEvent) -> bytes:
        """The bytes for one event.

        Raises:
            InvariantError: An event after the stream finished.
        """
        if self._finished:
            raise InvariantError(f"feed({type(event).__name__}) after the stream finished")
        if isinstance(event, Delta):
            if not event.text:
                return b""
            return self._chunk([_Choice(0, _text(event.text), None, None)])
        if isinstance(event, Complete):
            self._finished = True
            out = self._chunk([_Choice(0, "", None, _finish(event.finish_reason))])
            if self._include_usage:
                out += self._chunk([], _usage(event.usage))
            return out + DONE
        if isinstance(event, Error | Cancelled):
            self._finished = True
            _, body = event_error(event)
            return b"data: " + body + b"\n\n" + DONE
        return b""  # Start; no other output belongs to a completion run

    def feed_many(self, events: Iterable[RuntimeEvent]) -> bytes:
        return b"".join(self.feed(e) for e in events)


class _Body(msgspec.Struct, frozen=True, gc=False):
    id: str
    object: str
    created: int
    model: str
    choices: list[_Choice]
    usage: _Usage


class CompletionCollector(BaseCollector):
    """One non-streamed ``/v1/completions`` response (the surface's ``Collector``).

    The ending is ``iop.api._collect``'s.
    """

    def __init__(self, *, run_id: str, created: int, model: str) -> None:
        super().__init__()
        self._id = completion_id(run_id)
        self._created = created
        self._model = model
        self._text: list[str] = []

    def feed(self, event: RuntimeEvent) -> None:
        """Take one event.

        Raises:
            InvariantError: An event after the terminal one.
        """
        self._check_open(event)
        if isinstance(event, Delta):
            self._text.append(event.text)
        elif isinstance(event, Complete):
            choice = _Choice(0, _text("".join(self._text)), None, _finish(event.finish_reason))
            body = _Body(
                self._id,
                "text_completion",
                self._created,
                self._model,
                [choice],
                _usage(event.usage),
            )
            self._end((200, _encode(body)))
        elif isinstance(event, Error | Cancelled):
            self._end(event_error(event))
