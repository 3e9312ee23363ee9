"""The ending every surface's collector shares (sans-IO).

A collector (``iop.api.Collector``) takes one run's events and answers with
one ``(status, body)``: 200 and the surface's answer when the run completed,
the surface's error status and body when it failed or was cancelled. What
the answer and the error look like is each surface's own
(``<surface>/_encode.py``); how a collector ends is the same for all of them
and lives here, once:

* the first terminal event sets the result; ``finished`` is true from then;
* an event fed after it is a bug in the caller: ``InvariantError``
  ``"feed(<event>) after the run finished"``;
* ``result()`` before it is one too: ``"result() before the run finished"``.

:class:`BaseCollector` is that ending. :class:`ShapedCollector` adds what the
surfaces that apply the output policy share (chat, Responses, Messages): the
run's events go through a buffered ``OutputShaper`` (``iop.api._output``),
whose ``ShapedDone`` becomes ``(200, _body(done))`` and whose ``ShapedFailed``
becomes ``_failure(failed)``. :func:`openai_failure` is that failure for the
OpenAI-shaped ones. The legacy completions and embeddings collectors read
the run's events themselves (no output policy applies to them) and end
through :class:`BaseCollector` directly.
"""

from __future__ import annotations

import abc

from iop.api._openai_errors import error_body, openai_error_type
from iop.api._output import OutputShaper
from iop.api._shaped import Shaped, ShapedDone, ShapedFailed
from iop.errors import InvariantError
from iop.events import RuntimeEvent

__all__ = ["BaseCollector", "ShapedCollector", "openai_failure"]


def openai_failure(failed: ShapedFailed) -> tuple[int, bytes]:
    """A failed run's status and OpenAI error body (``iop.api._openai_errors``)."""
    body = error_body(
        failed.message, type=openai_error_type(failed.status), code=failed.code, param=failed.param
    )
    return failed.status, body


class BaseCollector(abc.ABC):
    """One non-streamed answer: events in, one ``(status, body)`` set once.

    Subclasses implement ``feed``: call :meth:`_check_open` first, and
    :meth:`_end` at the terminal event.
    """

    def __init__(self) -> None:
        self._result: tuple[int, bytes] | None = None

    @property
    def finished(self) -> bool:
        """True once a terminal event was fed."""
        return self._result is not None

    @abc.abstractmethod
    def feed(self, event: RuntimeEvent) -> None:
        """Take one run event.

        Raises:
            InvariantError: If a terminal event was already fed.
        """

    def _check_open(self, event: object) -> None:
        """Refuse ``event`` if the run already ended.

        Raises:
            InvariantError: If a terminal event was already fed.
        """
        if self._result is not None:
            raise InvariantError(f"feed({type(event).__name__}) after the run finished")

    def _end(self, result: tuple[int, bytes]) -> None:
        self._result = result

    def result(self) -> tuple[int, bytes]:
        """``(status, body)`` of the response.

        Raises:
            InvariantError: If no terminal event was fed yet.
        """
        if self._result is None:
            raise InvariantError("result() before the run finished")
        return self._result


class ShapedCollector(BaseCollector):
    """A collector fed through the output policy: only the terminal shaped event matters.

    Args:
        shaper: A buffered ``OutputShaper`` (a collector wants the whole
            policy applied at the end, XML completion wrapping included).
    """

    def __init__(self, shaper: OutputShaper) -> None:
        super().__init__()
        self._shaper = shaper

    def feed(self, event: RuntimeEvent) -> None:
        """Take one run event (through the shaper).

        Raises:
            InvariantError: If a terminal event was already fed.
        """
        self._check_open(event)
        for shaped in self._shaper.feed(event):
            self._take(shaped)

    def _take(self, event: Shaped) -> None:
        """Take one shaped event; the terminal one holds the whole answer.

        Raises:
            InvariantError: If a terminal event was already fed.
        """
        self._check_open(event)
        if isinstance(event, ShapedDone):
            self._end((200, self._body(event)))
        elif isinstance(event, ShapedFailed):
            self._end(self._failure(event))

    @abc.abstractmethod
    def _body(self, done: ShapedDone) -> bytes:
        """The surface's answer to a completed run."""

    @abc.abstractmethod
    def _failure(self, failed: ShapedFailed) -> tuple[int, bytes]:
        """The surface's status and error body for a failed or cancelled run."""
