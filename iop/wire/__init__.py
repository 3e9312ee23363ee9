"""Sans-IO wire code: bytes in, typed events out.

Nothing in this package does I/O or imports trio, httpx or quart
(``tests/test_layers.py`` checks it). It is where SSE is framed, where OpenAI
chat streams become RuntimeEvents, where backend error bodies are normalised,
where tool calls are accumulated from deltas or parsed out of text, and where
streamed text is held back until it is known not to be a tag (``<think>``, a
tool-call opener), and where an engine's published load is read.
"""

from iop.wire._chunked import CHUNK_LINE_MAX_BYTES, ChunkedDecoder, ChunkedError
from iop.wire._chunks import ChatChunk, ChunkToolCall
from iop.wire._engine_load import (
    EngineDialect,
    EngineFigures,
    figures_from_metrics,
    metric_names,
    parse_cache_config,
    parse_llamacpp_slots,
    parse_metrics,
)
from iop.wire._errors import ERROR_EXCERPT_BYTES, BackendErrorInfo, parse_error_body
from iop.wire._holdback import HoldBack, Tags
from iop.wire._openai_stream import ChatStreamParser, map_finish_reason
from iop.wire._sse import (
    DEFAULT_MAX_LINE_BYTES,
    DONE,
    SSEDecoder,
    SSEEvent,
    encode_comment,
    encode_event,
)
from iop.wire._toolcalls import ToolCallAccumulator
from iop.wire._tooltext import (
    TOOL_CALL_OPENERS,
    ParsedToolText,
    ToolTextFilter,
    parse_tool_calls,
    unstreamed_cleaned_text,
)

__all__ = [
    "CHUNK_LINE_MAX_BYTES",
    "DEFAULT_MAX_LINE_BYTES",
    "DONE",
    "ERROR_EXCERPT_BYTES",
    "TOOL_CALL_OPENERS",
    "BackendErrorInfo",
    "ChatChunk",
    "ChatStreamParser",
    "ChunkToolCall",
    "ChunkedDecoder",
    "ChunkedError",
    "EngineDialect",
    "EngineFigures",
    "HoldBack",
    "ParsedToolText",
    "SSEDecoder",
    "SSEEvent",
    "Tags",
    "ToolCallAccumulator",
    "ToolTextFilter",
    "encode_comment",
    "encode_event",
    "figures_from_metrics",
    "map_finish_reason",
    "metric_names",
    "parse_cache_config",
    "parse_error_body",
    "parse_llamacpp_slots",
    "parse_metrics",
    "parse_tool_calls",
    "unstreamed_cleaned_text",
]
