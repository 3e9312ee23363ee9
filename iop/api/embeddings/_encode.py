"""``/v1/embeddings`` responses (sans-IO): one ``CreateEmbeddingResponse`` body.

The run's ``EmbeddingData`` events, in index order, become the ``data``
array, each vector as floats or base64 (``encoding_format``); ``Complete``
ends the body with its usage. A vector out of order or malformed, or a count
that does not match the inputs, is a 502 decided at the terminal event.
"""

from __future__ import annotations

import base64
from typing import Final, Literal

import msgspec

from iop.api._collect import BaseCollector
from iop.api.completions._errors import error_response, event_error
from iop.errors import ErrorCode
from iop.events import Cancelled, Complete, EmbeddingData, Error, RuntimeEvent

__all__ = ["EmbeddingsCollector"]

_encode: Final = msgspec.json.encode


class EmbeddingsCollector(BaseCollector):
    """One ``/v1/embeddings`` response: ``CreateEmbeddingResponse`` or an error.

    The ending is ``iop.api._collect``'s.
    """

    def __init__(self, *, model: str, inputs: int, encoding: Literal["float", "base64"]) -> None:
        super().__init__()
        self._model = model
        self._inputs = inputs
        self._encoding = encoding
        self._parts: list[bytes] = []
        # A malformed vector fails the response, decided at the terminal event.
        self._broken: tuple[int, bytes] | None = None

    def feed(self, event: RuntimeEvent) -> None:
        """Take one event.

        Raises:
            InvariantError: An event after the terminal one.
        """
        self._check_open(event)
        if isinstance(event, EmbeddingData):
            if self._broken is None:
                self._add(event)
        elif isinstance(event, Complete):
            self._complete(event)
        elif isinstance(event, Error | Cancelled):
            self._end(event_error(event))
        if self.finished:
            self._parts = []

    def _add(self, event: EmbeddingData) -> None:
        if event.index != len(self._parts) or len(event.vector) % 4:
            self._broken = error_response(
                502,
                f"the backend sent embedding {event.index} out of order or malformed",
                code=ErrorCode.BACKEND_PROTOCOL_ERROR,
            )
            return
        vector: bytes
        if self._encoding == "base64":
            vector = _encode(base64.b64encode(event.vector).decode())
        else:
            vector = _encode(event.floats())
        self._parts.append(
            b'{"object":"embedding","index":'
            + str(event.index).encode()
            + b',"embedding":'
            + vector
            + b"}"
        )

    def _complete(self, event: Complete) -> None:
        if self._broken is not None:
            self._end(self._broken)
            return
        if len(self._parts) != self._inputs:
            self._end(
                error_response(
                    502,
                    f"the backend sent {len(self._parts)} embeddings for {self._inputs} inputs",
                    code=ErrorCode.BACKEND_PROTOCOL_ERROR,
                )
            )
            return
        tokens = event.usage.input_tokens
        self._end(
            (
                200,
                b'{"object":"list","data":['
                + b",".join(self._parts)
                + b'],"model":'
                + _encode(self._model)
                + b',"usage":'
                + _encode({"prompt_tokens": tokens, "total_tokens": tokens})
                + b"}",
            )
        )
