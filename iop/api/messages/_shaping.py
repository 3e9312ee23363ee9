"""STAND-IN for ``iop.api._output.OutputShaper`` until it lands on this branch.

The Messages encoder and collector consume *shaped* events
(``iop.api._shaped``); the output policy (strict mode, ``<think>`` stripping,
tool-text hold-back and synthesis, XML completion wrapping, buffered
streams) is ``OutputShaper``'s job, applied once for every surface. Until it
is merged, this minimal mapping keeps the surface usable and testable: it
applies only the parts of the policy that need no hold-back (``strict`` drops
reasoning) and normalises native tool calls the way ``_shaped`` promises
(``index`` 0..n-1, unique ids, blank arguments as ``{}``). No text tool-call
synthesis, no ``<think>`` stripping, no XML wrapping.

To plug the real shaper in, replace :func:`new_shaper`'s body with
``return OutputShaper(request, policy, run_id)`` and delete this module.
"""

from __future__ import annotations

from typing import Final, Protocol

from iop.api._shaped import Shaped, ShapedDone, ShapedFailed, ShapedReasoning, ShapedText
from iop.config import OutputPolicy
from iop.events import (
    Cancelled,
    CancelReason,
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

__all__ = ["Shaper", "new_shaper"]


class Shaper(Protocol):
    """What the encoder needs of ``OutputShaper``: one event in, shaped events out."""

    def feed(self, event: RuntimeEvent) -> list[Shaped]: ...


_TIMEOUTS: Final = frozenset(
    {
        CancelReason.FIRST_TOKEN_TIMEOUT,
        CancelReason.IDLE_TIMEOUT,
        CancelReason.TOTAL_TIMEOUT,
        CancelReason.QUEUE_TIMEOUT,
    }
)


def _cancel_status(reason: CancelReason) -> int:
    # The same statuses as the chat surface's ``cancel_status``.
    if reason is CancelReason.NODE_LOST:
        return 503
    return 504 if reason in _TIMEOUTS else 500


class _LocalShaper:
    def __init__(self, policy: OutputPolicy, run_id: str) -> None:
        self._strict = policy.strict
        self._run_id = run_id
        self._content: list[str] = []
        self._reasoning: list[str] = []

    def _calls(self, calls: tuple[ToolCall, ...]) -> tuple[ToolCall, ...]:
        seen: set[str] = set()
        out: list[ToolCall] = []
        for i, call in enumerate(calls):
            cid = call.id if call.id and call.id not in seen else f"call_{self._run_id}_{i}"
            seen.add(cid)
            out.append(ToolCall(id=cid, name=call.name, arguments=call.arguments or "{}", index=i))
        return tuple(out)

    def feed(self, event: RuntimeEvent) -> list[Shaped]:
        if isinstance(event, Delta):
            if not event.text:
                return []
            self._content.append(event.text)
            return [ShapedText(event.text)]
        if isinstance(event, ReasoningDelta):
            if not event.text or self._strict:
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
            return [
                ShapedDone(
                    finish_reason=finish,
                    calls=calls,
                    usage=event.usage,
                    content="".join(self._content),
                    reasoning="".join(self._reasoning),
                )
            ]
        if isinstance(event, Error):
            status = event.status if 400 <= event.status <= 599 else 500
            return [
                ShapedFailed(status=status, code=event.code, message=event.message or "run failed")
            ]
        if isinstance(event, Cancelled):
            return [
                ShapedFailed(
                    status=_cancel_status(event.reason),
                    code=event.reason.value,
                    message=event.message or f"run cancelled: {event.reason.value}",
                    reason=event.reason,
                    usage=event.usage,
                )
            ]
        assert isinstance(event, Start)
        return []


def new_shaper(request: ChatRequest, policy: OutputPolicy, run_id: str) -> Shaper:
    """The shaper of one run (see the module docstring: the one line to change)."""
    del request  # OutputShaper needs it (tools); the stand-in does not
    return _LocalShaper(policy, run_id)
