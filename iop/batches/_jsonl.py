"""A batch file's lines, read and checked whole before anything runs (sans-IO).

OpenAI's Batch API takes a JSONL file: one request per line,
``{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions",
"body": {...}}`` (https://platform.openai.com/docs/guides/batch, "Prepare
your batch file"). Every line of one file goes to one endpoint and one
model, and each ``custom_id`` names one line: it is how a client finds its
answer in the output, which is in no particular order.

``read_batch_file`` checks all of it at upload, so that a batch never fails
half-way on a line it could have refused: the first bad line is a 400 that
names its number (1-based, as an editor shows it) and what is wrong with
it. Blank lines are skipped (a trailing newline is usual). Each body is
also handed to ``check_body``, the endpoint's own parser on the edge, so a
body the endpoint would refuse is refused here with the line's number.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import msgspec

from iop.api._json_guard import json_nesting_depth
from iop.errors import ErrorCode, RequestError

__all__ = [
    "ENDPOINTS",
    "BatchLine",
    "answer_line",
    "check_line",
    "error_line",
    "read_batch_file",
]

ENDPOINTS: Final = ("/v1/chat/completions", "/v1/responses", "/v1/completions", "/v1/embeddings")
"""The endpoints a batch may go to (``POST /v1/batches`` ``endpoint``)."""


class BatchLine(msgspec.Struct, frozen=True, kw_only=True):
    """One request of a batch file.

    Attributes:
        number: Its line in the file (1-based; blank lines count).
        custom_id: The client's name for it.
        url: The endpoint (every line's is the same).
        model: ``body.model`` (every line's is the same).
        body: The request body, JSON.
    """

    number: int
    custom_id: str
    url: str
    model: str
    body: bytes


def _bad(number: int, message: str, code: ErrorCode, param: str) -> RequestError:
    return RequestError(f"Line {number}: {message}", status=400, code=code, param=param)


def read_batch_file(
    data: bytes,
    *,
    max_lines: int,
    check_body: Callable[[str, bytes], None] | None = None,
) -> list[BatchLine]:
    """The request lines of a batch file, each checked.

    Args:
        data: The file.
        max_lines: Most request lines it may hold (``batches.max_lines``).
        check_body: Called with each line's url and body; raises the
            ``RequestError`` the endpoint would answer the body with.

    Raises:
        RequestError: 400 naming the first bad line.
    """
    lines: list[BatchLine] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if len(lines) == max_lines:
            raise _bad(
                number,
                f"a batch file holds at most {max_lines} requests (batches.max_lines)",
                ErrorCode.INVALID_VALUE,
                "file",
            )
        line = _read_line(number, raw, lines[0] if lines else None)
        first = seen.setdefault(line.custom_id, number)
        if first != number:
            raise _bad(
                number,
                f"custom_id {line.custom_id!r} is also line {first}'s; "
                "each request of a batch needs its own",
                ErrorCode.DUPLICATE_CUSTOM_ID,
                "custom_id",
            )
        if check_body is not None:
            check_line(line, check_body)
        lines.append(line)
    if not lines:
        raise RequestError(
            "The batch file has no requests: one JSON object a line is expected.",
            status=400,
            code=ErrorCode.INVALID_VALUE,
            param="file",
        )
    return lines


def check_line(line: BatchLine, check_body: Callable[[str, bytes], None]) -> None:
    """``check_body`` of ``line``, its refusal naming the line.

    Raises:
        RequestError: 400 ``Line N: ...``, ``param`` under ``body.``.
    """
    try:
        check_body(line.url, line.body)
    except RequestError as exc:
        param = f"body.{exc.param}" if exc.param else "body"
        raise _bad(line.number, exc.message, exc.code, param) from exc


# A line's body sits one level below the line; the body's own limit
# (server.max_json_depth, at most 256) is applied when its surface parses it.
MAX_LINE_DEPTH: Final = 257


def _read_line(number: int, raw: bytes, first: BatchLine | None) -> BatchLine:
    # Measured on the bytes first: msgspec recurses on the C stack, and a
    # deep enough line would raise RecursionError (iop.api._json_guard).
    too_deep = f"nests deeper than {MAX_LINE_DEPTH} levels"
    if json_nesting_depth(raw) > MAX_LINE_DEPTH:
        raise _bad(number, too_deep, ErrorCode.JSON_TOO_DEEP, "line")
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise _bad(number, f"not valid JSON ({exc})", ErrorCode.INVALID_JSON, "line") from exc
    except RecursionError:  # what the byte scan cannot judge (unbalanced)
        raise _bad(number, too_deep, ErrorCode.JSON_TOO_DEEP, "line") from None
    if not isinstance(obj, dict):
        raise _bad(number, "a request is a JSON object", ErrorCode.INVALID_TYPE, "line")
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise _bad(
            number, f"unknown field {unknown[0]!r}", ErrorCode.UNSUPPORTED_PARAMETER, unknown[0]
        )
    for name in ("custom_id", "method", "url", "body"):
        if name not in obj:
            raise _bad(number, f"{name!r} is missing", ErrorCode.MISSING_REQUIRED_PARAMETER, name)
    custom_id, method, url, body = obj["custom_id"], obj["method"], obj["url"], obj["body"]
    if not isinstance(custom_id, str) or not custom_id:
        raise _bad(
            number, "custom_id must be a non-empty string", ErrorCode.INVALID_TYPE, "custom_id"
        )
    if method != "POST":
        raise _bad(
            number, f"method must be 'POST', not {method!r}", ErrorCode.INVALID_VALUE, "method"
        )
    if url not in ENDPOINTS:
        known = ", ".join(ENDPOINTS)
        raise _bad(
            number,
            f"url {url!r} is not a batch endpoint ({known})",
            ErrorCode.UNSUPPORTED_VALUE,
            "url",
        )
    if first is not None and url != first.url:
        raise _bad(
            number,
            f"url {url!r} differs from line {first.number}'s {first.url!r}: "
            "every request of a batch goes to one endpoint",
            ErrorCode.INVALID_VALUE,
            "url",
        )
    if not isinstance(body, dict):
        raise _bad(number, "body must be a JSON object", ErrorCode.INVALID_TYPE, "body")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad(
            number, "body.model is missing", ErrorCode.MISSING_REQUIRED_PARAMETER, "body.model"
        )
    if first is not None and model != first.model:
        raise _bad(
            number,
            f"model {model!r} differs from line {first.number}'s {first.model!r}: "
            "every request of a batch uses one model",
            ErrorCode.INVALID_VALUE,
            "body.model",
        )
    if body.get("stream"):
        raise _bad(
            number, "a batch request cannot stream", ErrorCode.UNSUPPORTED_VALUE, "body.stream"
        )
    return BatchLine(
        number=number, custom_id=custom_id, url=url, model=model, body=msgspec.json.encode(body)
    )


# --- the output and error files' lines ------------------------------------------------
# One JSON object a line, as OpenAI writes them (https://platform.openai.com/docs/guides/batch,
# "Retrieve the results"): ``response`` for a request that was answered (the
# error file holds those whose status is not 2xx), ``error`` for one that
# never ran (its batch expired or was cancelled).


def answer_line(
    line_id: str, custom_id: str, request_id: str, status_code: int, body: bytes
) -> bytes:
    """The line of a request the endpoint answered, ``body`` its JSON answer."""
    return b"".join(
        (
            b'{"id":',
            msgspec.json.encode(line_id),
            b',"custom_id":',
            msgspec.json.encode(custom_id),
            b',"response":{"status_code":',
            str(status_code).encode(),
            b',"request_id":',
            msgspec.json.encode(request_id),
            b',"body":',
            body.strip() or b"null",
            b'},"error":null}',
        )
    )


def error_line(line_id: str, custom_id: str, code: str, message: str) -> bytes:
    """The line of a request that never ran."""
    return msgspec.json.encode(
        {
            "id": line_id,
            "custom_id": custom_id,
            "response": None,
            "error": {"code": code, "message": message},
        }
    )
