"""OpenAI Chat Completions (``POST /v1/chat/completions``), sans-IO.

``CHAT`` is the surface (``iop.api.Surface``): ``parse_chat_request`` turns a
body into a ``ChatRequest`` or OpenAI's 400; ``ChatCompletionStream`` and
``ChatCompletionCollector`` format the shaped output of a run
(``iop.api._output``) as ``chat.completion.chunk`` SSE or one
``chat.completion``.
"""

from iop.api.chat._encode import (
    KEEPALIVE,
    ChatCompletionCollector,
    ChatCompletionStream,
    StreamSummary,
)
from iop.api.chat._request import parse_chat_request
from iop.api.chat._surface import CHAT, ChatSurface

__all__ = [
    "CHAT",
    "KEEPALIVE",
    "ChatCompletionCollector",
    "ChatCompletionStream",
    "ChatSurface",
    "StreamSummary",
    "parse_chat_request",
]
