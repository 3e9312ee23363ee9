"""The Chat Completions surface (``POST /v1/chat/completions``): ``CHAT``.

Parsing is ``_request.parse_chat_request`` (the body *is* a ``ChatRequest``,
so the run executes it as sent); output is ``_encode``'s stream and
collector; errors are OpenAI's body (``iop.api._openai_errors``). Headers
play no part.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from iop.api._openai_errors import openai_error
from iop.api._routing import with_routing
from iop.api._surface import Call, RunContext
from iop.api.chat._encode import ChatCompletionCollector, ChatCompletionStream
from iop.api.chat._request import DEFAULT_MAX_JSON_DEPTH, parse_chat_request

__all__ = ["CHAT", "ChatSurface", "completion_id"]


def completion_id(run_id: str) -> str:
    """The ``chatcmpl-`` id of a run's completion."""
    return f"chatcmpl-{run_id}"


class ChatSurface:
    """OpenAI Chat Completions, implementing ``iop.api.Surface``.

    Args:
        max_depth: Deepest JSON nesting a body may have (``server.max_json_depth``).
    """

    def __init__(self, *, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> None:
        self._max_depth = max_depth

    @property
    def name(self) -> str:
        return "chat"

    def parse(self, body: bytes, headers: Mapping[str, str], *, tenant: str = "") -> Call:
        """``parse_chat_request``; raises its ``RequestError`` (400)."""
        request = with_routing(parse_chat_request(body, max_depth=self._max_depth), headers)
        return Call(request=request, stream=request.stream, model=request.model)

    def error_body(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> tuple[int, bytes]:
        return openai_error(status, message, code=code, param=param)

    def stream(self, call: Call, ctx: RunContext) -> ChatCompletionStream:
        return ChatCompletionStream(
            completion_id(ctx.run_id), ctx.created, call.model, call.chat, ctx.policy
        )

    def collector(self, call: Call, ctx: RunContext) -> ChatCompletionCollector:
        return ChatCompletionCollector(
            completion_id(ctx.run_id), ctx.created, call.model, call.chat, ctx.policy
        )


CHAT: Final = ChatSurface()
"""The chat-completions surface (stateless: one instance serves every request)."""
