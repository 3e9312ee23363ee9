"""Accumulate streamed ``delta.tool_calls`` fragments into complete tool calls.

Theory of operation (docs/architecture.md, "Facts about the backends:
Streamed tool calls"): backends stream a tool
call as a first delta carrying ``id``, ``type``, ``index`` and
``function.name``, then deltas carrying only ``index`` and an
``function.arguments`` fragment. Backends disagree on the details, so the
accumulator keys calls on ``(index, id)`` rather than on ``index`` alone:

* a delta whose ``id`` differs from the last id seen at its index starts a new
  call: some Ollama-compatible servers reuse ``index: 0`` for every parallel
  call and tell them apart only by id;
* a delta without ``id`` continues the latest call at its index; a missing
  ``index`` means 0;
* ``id`` may be an integer (poolside): it becomes a ``str``; an empty-string
  id counts as missing;
* ``name`` is *assigned*, never appended, and an empty-string name never
  overwrites one (LM Studio <= 0.3.15 repeated ``name: ""`` in later deltas);
* ``arguments`` fragments are appended in order; ``None`` and ``""`` are
  ignored; a whole call in one delta (Ollama, vLLM's Mistral parser) is just
  the one-fragment case.

Memory is bounded by ``max_bytes``: ids, names and argument fragments (UTF-8
bytes) plus a fixed cost per call, summed over every call of the answer.
Crossing it raises ``BackendProtocolError`` (``code="tool_calls_too_large"``):
arguments are kept whole until the end, so without a bound a backend that
never stops streaming them would grow the run's memory without end.

Arguments are kept exactly as the model produced them (``ToolCall.arguments``
is "JSON text, exactly as the model produced them"): no validation or
normalisation happens here, that is the response layer's job.

The module is sans-IO: it imports nothing but the standard library and IOP's
own typed structs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from iop.errors import BackendProtocolError, ErrorCode
from iop.events import ToolCall
from iop.wire._chunks import ChunkToolCall

__all__ = ["ToolCallAccumulator"]

# What one call costs beyond its strings, counted so that a backend opening
# endless empty calls (a new index or id per delta) reaches the limit too.
SLOT_COST_BYTES: Final = 64


class _Slot:
    """One tool call being accumulated."""

    __slots__ = ("arguments", "id", "name", "ordinal")

    def __init__(self, ordinal: int, call_id: str | None) -> None:
        # Position among all slots ever opened: used for synthesised ids so
        # that they do not change between two calls() made mid-stream.
        self.ordinal = ordinal
        self.id = call_id
        self.name = ""
        self.arguments: list[str] = []

    def is_empty(self) -> bool:
        return not self.name and not self.arguments


class ToolCallAccumulator:
    """Builds complete ``ToolCall``s out of streamed tool-call deltas.

    Decisions, beyond the rules in the module docstring:

    * A call that never received an id gets ``f"{id_prefix}{n}"``, where ``n``
      is the position of its slot among all slots opened by this accumulator
      (0, 1, ...). It is deterministic (no randomness, no clock), so the same
      stream always yields the same ids, and it does not change between two
      ``calls()`` made at different points of the stream. In the unlikely
      case it collides with an id the backend sent, ``_<k>`` is appended.
    * If a slot opened without an id later receives one, the slot adopts it
      (the id is taken as late, not as the start of a new call).
    * Slots with neither a name nor any argument fragment are dropped; a slot
      with arguments but no name is kept with ``name=""`` so the caller can
      decide (and so no model output is silently lost).
    * ``calls()`` lists calls in first-seen order with ``index`` renumbered
      0..n-1, whatever indexes the backend used.

    Args:
        id_prefix: Prefix of synthesised ids.
        max_bytes: Largest total size of the calls (see the module
            docstring); None for no limit.
    """

    def __init__(self, id_prefix: str = "call_", *, max_bytes: int | None = None) -> None:
        self._id_prefix = id_prefix
        self._max_bytes = max_bytes
        self.size_bytes = 0
        self._slots: list[_Slot] = []
        self._latest: dict[int, _Slot] = {}

    def _grow(self, n: int) -> None:
        self.size_bytes += n
        if self._max_bytes is not None and self.size_bytes > self._max_bytes:
            raise BackendProtocolError(
                f"tool calls exceed {self._max_bytes} bytes ({len(self._slots)} call(s) so far)",
                code=ErrorCode.TOOL_CALLS_TOO_LARGE,
            )

    def add(self, deltas: Sequence[ChunkToolCall]) -> None:
        """Fold one chunk's ``delta.tool_calls`` into the calls so far."""
        for delta in deltas:
            index = delta.index if delta.index is not None else 0
            call_id = str(delta.id) if delta.id is not None else None
            if call_id == "":
                call_id = None
            slot = self._latest.get(index)
            if slot is None or (call_id is not None and slot.id is not None and call_id != slot.id):
                self._grow(SLOT_COST_BYTES + _utf8_len(call_id))
                slot = _Slot(len(self._slots), call_id)
                self._slots.append(slot)
                self._latest[index] = slot
            elif call_id is not None and slot.id is None:
                self._grow(_utf8_len(call_id))
                slot.id = call_id
            function = delta.function
            if function is None:
                continue
            if function.name:
                self._grow(_utf8_len(function.name) - _utf8_len(slot.name))
                slot.name = function.name
            if function.arguments:
                self._grow(_utf8_len(function.arguments))
                slot.arguments.append(function.arguments)

    def calls(self) -> tuple[ToolCall, ...]:
        """The calls accumulated so far, in first-seen order, indexed 0..n-1."""
        slots = [s for s in self._slots if not s.is_empty()]
        taken = {s.id for s in slots if s.id is not None}
        out: list[ToolCall] = []
        for index, slot in enumerate(slots):
            call_id = slot.id
            if call_id is None:
                call_id = f"{self._id_prefix}{slot.ordinal}"
                k = 0
                while call_id in taken:
                    k += 1
                    call_id = f"{self._id_prefix}{slot.ordinal}_{k}"
                taken.add(call_id)
            out.append(
                ToolCall(
                    id=call_id,
                    name=slot.name,
                    arguments="".join(slot.arguments),
                    index=index,
                )
            )
        return tuple(out)

    def __len__(self) -> int:
        """How many calls ``calls()`` would return now."""
        return sum(1 for s in self._slots if not s.is_empty())


def _utf8_len(s: str | None) -> int:
    if not s:
        return 0
    if s.isascii():
        return len(s)
    return len(s.encode("utf-8", "surrogatepass"))
