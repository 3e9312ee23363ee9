"""Shaped output: a run's answer after the output policy, for every surface.

The output policy of a model (``iop.config.OutputPolicy``: strict mode,
``<think>`` stripping, tool calls found in text, XML completion wrapping,
buffered streams) is the same whatever API the client speaks. So it is
applied once, by ``iop.api._output.OutputShaper``, which turns a run's
``RuntimeEvent`` s into these *shaped* events; each surface's encoder and
collector then only formats them in its own wire format::

    RuntimeEvents --OutputShaper(policy, request)--> Shaped events --encoder--> bytes

A run shapes to::

    (ShapedText | ShapedReasoning)*  (ShapedDone | ShapedFailed)

* ``ShapedText`` / ``ShapedReasoning`` may be sent at once: text that could
  still turn out to be a ``<think>`` tag or a tool call has been held back.
  A buffered stream (``strict`` + ``stream_buffer``) gets all its text in
  one ``ShapedText`` right before ``ShapedDone``.
* ``ShapedDone`` ends a completed run: the tool calls (native, or found in
  the text, normalised: ``index`` 0..n-1, unique ids, declared names), the
  finish reason (``tool_calls`` when there are calls), the usage, and the
  whole content and reasoning as sent, for collectors and logs.
* ``ShapedFailed`` ends a run that failed (``Error``) or was cancelled
  (``Cancelled``): the HTTP status IOP maps it to, the code, a message safe
  for clients, and the cancel reason when it was a cancellation.
"""

from __future__ import annotations

import msgspec

from iop.events import CancelReason, FinishReason, ToolCall, Usage

__all__ = ["Shaped", "ShapedDone", "ShapedFailed", "ShapedReasoning", "ShapedText"]


class ShapedText(msgspec.Struct, frozen=True, gc=False):
    """Answer text that may be sent now."""

    text: str


class ShapedReasoning(msgspec.Struct, frozen=True, gc=False):
    """Reasoning text that may be sent now (never under ``strict``)."""

    text: str


class ShapedDone(msgspec.Struct, frozen=True, kw_only=True):
    """The run completed.

    Attributes:
        finish_reason: Why generation stopped (``tool_calls`` when ``calls``).
        calls: The tool calls to send, normalised.
        usage: Token counts.
        content: The whole answer text as shaped (what the text events said).
            Empty when the shaper was told not to keep the text
            (``OutputShaper(keep_text=False)``, for streams that never
            repeat it) and was not buffered.
        reasoning: The whole reasoning as shaped (same rule).
    """

    finish_reason: FinishReason
    calls: tuple[ToolCall, ...] = ()
    usage: Usage = Usage()
    content: str = ""
    reasoning: str = ""


class ShapedFailed(msgspec.Struct, frozen=True, kw_only=True):
    """The run failed or was cancelled.

    Attributes:
        status: The HTTP status IOP maps the failure to (400-599).
        code: The stable code (an ``Error``'s code, or the cancel reason).
        message: Safe to show a client.
        reason: The cancel reason, when the run was cancelled.
        usage: What the run had produced (estimated when cancelled).
        param: The request parameter at fault, when the backend named one
            (a context overflow is ``messages``).
    """

    status: int
    code: str
    message: str
    reason: CancelReason | None = None
    usage: Usage = Usage()
    param: str | None = None


Shaped = ShapedText | ShapedReasoning | ShapedDone | ShapedFailed
