"""The edge: OpenAI-compatible HTTP API, node links, scheduling.

The OpenAI output (seed 001's streaming behaviour) is sans-IO in
``_openai_out``; request validation in ``_request``.
"""

from iop.edge._openai_out import ChatCompletionCollector, ChatCompletionStream, error_body
from iop.edge._request import parse_chat_request

__all__ = [
    "ChatCompletionCollector",
    "ChatCompletionStream",
    "error_body",
    "parse_chat_request",
]
