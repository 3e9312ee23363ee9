"""RuntimeEvents -> shaped events for the Responses surface: the interim shaper.

TO BE REPLACED by ``iop.api._output.OutputShaper`` (issue 8 plan), which
applies the whole output policy once for every surface: ``<think>``
stripping, tool-text hold-back and tool calls found in text, XML completion
wrapping, buffered streams. When it lands, :func:`make_shaper` becomes::

    return OutputShaper(request, policy, run_id)

and this module's class goes. Until then this minimal mapping lets the
Responses encoder and collector be driven by a run's events and tested:

* ``Delta`` -> ``ShapedText``; ``ReasoningDelta`` -> ``ShapedReasoning``
  (none under ``strict``); ``Start`` -> nothing;
* ``Complete`` -> ``ShapedDone``: native tool calls re-indexed 0..n-1, a
  missing or repeated id made ``call_<run id>_<i>``, blank arguments
  ``"{}"``; ``finish_reason`` ``tool_calls`` exactly when there are calls
  (a backend's ``tool_calls`` without calls is ``stop``);
* ``Error`` / ``Cancelled`` -> ``ShapedFailed`` with the chat surface's
  statuses (``_errors.cancel_status``).

It does not look for tool calls in text, strip ``<think>`` or wrap XML.
"""

from __future__ import annotations

from typing import Protocol

from iop.api._shaped import Shaped, ShapedDone, ShapedFailed, ShapedReasoning, ShapedText
from iop.api.responses._errors import cancel_message, cancel_status, clamp_status
from iop.config import OutputPolicy
from iop.events import (
    Cancelled,
    Complete,
    Delta,
    Error,
    FinishReason,
    ReasoningDelta,
    RuntimeEvent,
    Start,
    ToolCall,
)
from iop.spec import ChatRequest

__all__ = ["Shaper", "make_shaper"]


class Shaper(Protocol):
    """What the encoder needs of ``OutputShaper``."""

    def feed(self, event: RuntimeEvent) -> list[Shaped]: ...


class _InterimShaper:
    __slots__ = ("_content", "_policy", "_reasoning", "_run_id")

    def __init__(self, policy: OutputPolicy, run_id: str) -> None:
        self._policy = policy
        self._run_id = run_id
        self._content: list[str] = []
        self._reasoning: list[str] = []

    def feed(self, event: RuntimeEvent) -> list[Shaped]:
        if isinstance(event, Delta):
            if not event.text:
                return []
            self._content.append(event.text)
            return [ShapedText(event.text)]
        if isinstance(event, ReasoningDelta):
            if not event.text or self._policy.strict:
                return []
            self._reasoning.append(event.text)
            return [ShapedReasoning(event.text)]
        if isinstance(event, Complete):
            calls = self._calls(event.tool_calls)
            finish = event.finish_reason
            if calls:
                finish = FinishReason.TOOL_CALLS
            elif finish is FinishReason.TOOL_CALLS:
                finish = FinishReason.STOP
            done = ShapedDone(
                finish_reason=finish,
                calls=calls,
                usage=event.usage,
                content="".join(self._content),
                reasoning="".join(self._reasoning),
            )
            return [done]
        if isinstance(event, Error):
            status = clamp_status(event.status)
            return [
                ShapedFailed(status=status, code=event.code, message=event.message or "run failed")
            ]
        if isinstance(event, Cancelled):
            return [
                ShapedFailed(
                    status=cancel_status(event.reason),
                    code=event.reason.value,
                    message=cancel_message(event),
                    reason=event.reason,
                    usage=event.usage,
                )
            ]
        assert isinstance(event, Start)
        return []

    def _calls(self, calls: tuple[ToolCall, ...]) -> tuple[ToolCall, ...]:
        seen: set[str] = set()
        out: list[ToolCall] = []
        for i, call in enumerate(calls):
            call_id = call.id.strip()
            if not call_id or call_id in seen:
                call_id = f"call_{self._run_id}_{i}"
            seen.add(call_id)
            arguments = call.arguments if call.arguments.strip() else "{}"
            out.append(ToolCall(id=call_id, name=call.name, arguments=arguments, index=i))
        return tuple(out)


def make_shaper(request: ChatRequest, policy: OutputPolicy, run_id: str) -> Shaper:
    """The shaper of one run's output (the one line to change: module docstring)."""
    del request  # OutputShaper needs it (tools); the interim shaper does not
    return _InterimShaper(policy, run_id)
