"""A batch file read whole: every bad line is a 400 that names it (iop.batches._jsonl)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop.batches import answer_line, error_line, read_batch_file
from iop.errors import ErrorCode, RequestError

URL = "/v1/chat/completions"


def _line(custom_id: Any = "a", **over: Any) -> dict[str, Any]:
    line: dict[str, Any] = {
        "custom_id": custom_id,
        "method": "POST",
        "url": URL,
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }
    line.update(over)
    return line


def _file(*lines: dict[str, Any] | str) -> bytes:
    return "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines).encode() + b"\n"


def _refused(data: bytes, **kw: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        read_batch_file(data, max_lines=kw.pop("max_lines", 100), **kw)
    assert info.value.status == 400
    return info.value


def test_a_good_file_reads_whole_blank_lines_skipped() -> None:
    lines = read_batch_file(_file(_line("a"), "", _line("b")), max_lines=10)
    assert [(x.number, x.custom_id, x.model, x.url) for x in lines] == [
        (1, "a", "m", URL),
        (3, "b", "m", URL),
    ]
    assert json.loads(lines[0].body)["messages"][0]["content"] == "hi"


@pytest.mark.parametrize(
    ("bad", "code", "param", "words"),
    [
        ("{not json", ErrorCode.INVALID_JSON, "line", "not valid JSON"),
        ("[1, 2]", ErrorCode.INVALID_TYPE, "line", "JSON object"),
        (_line(custom_id=None), ErrorCode.INVALID_TYPE, "custom_id", "custom_id"),
        (_line(custom_id=""), ErrorCode.INVALID_TYPE, "custom_id", "custom_id"),
        (_line(method="GET"), ErrorCode.INVALID_VALUE, "method", "'POST'"),
        (_line(url="/v1/models"), ErrorCode.UNSUPPORTED_VALUE, "url", "/v1/models"),
        (_line(url="/v1/embeddings"), ErrorCode.INVALID_VALUE, "url", "one endpoint"),
        (_line(body=[]), ErrorCode.INVALID_TYPE, "body", "JSON object"),
        (_line(body={"messages": []}), ErrorCode.MISSING_REQUIRED_PARAMETER, "body.model", "model"),
        (_line(body={"model": "other"}), ErrorCode.INVALID_VALUE, "body.model", "one model"),
        (
            _line(body={"model": "m", "stream": True}),
            ErrorCode.UNSUPPORTED_VALUE,
            "body.stream",
            "stream",
        ),
        (_line(extra=1), ErrorCode.UNSUPPORTED_PARAMETER, "extra", "extra"),
        ('{"custom_id": "z"}', ErrorCode.MISSING_REQUIRED_PARAMETER, "method", "method"),
    ],
)
def test_a_bad_line_is_named(
    bad: dict[str, Any] | str, code: ErrorCode, param: str, words: str
) -> None:
    # Line 3 is the bad one: two good lines (one blank) before it.
    exc = _refused(_file(_line("first"), "", bad))
    assert exc.message.startswith("Line 3: "), exc.message
    assert words in exc.message
    assert exc.code is code
    assert exc.param == param


def test_a_missing_custom_id_is_named() -> None:
    line = _line()
    del line["custom_id"]
    exc = _refused(_file(line))
    assert exc.message.startswith("Line 1: ")
    assert exc.code is ErrorCode.MISSING_REQUIRED_PARAMETER
    assert exc.param == "custom_id"


def test_a_duplicate_custom_id_names_both_lines() -> None:
    exc = _refused(_file(_line("a"), _line("b"), _line("a")))
    assert exc.message.startswith("Line 3: ")
    assert "line 1" in exc.message
    assert exc.code is ErrorCode.DUPLICATE_CUSTOM_ID


def test_max_lines_is_crossed_at_the_line_past_it() -> None:
    data = _file(*(_line(str(i)) for i in range(4)))
    assert len(read_batch_file(data, max_lines=4)) == 4
    exc = _refused(data, max_lines=3)
    assert exc.message.startswith("Line 4: ")
    assert "batches.max_lines" in exc.message


def test_an_empty_file_is_refused() -> None:
    exc = _refused(b"\n\n")
    assert exc.code is ErrorCode.INVALID_VALUE
    assert "no requests" in exc.message


def test_the_endpoints_own_check_names_the_line() -> None:
    def check(url: str, body: bytes) -> None:
        if b'"bad"' in body:
            raise RequestError("no", status=400, code=ErrorCode.INVALID_VALUE, param="messages")

    data = _file(_line("a"), _line("b", body={"model": "m", "messages": "bad"}))
    exc = _refused(data, check_body=check)
    assert exc.message == "Line 2: no"
    assert exc.param == "body.messages"


def _status(data: bytes) -> int:
    """200 when ``data`` reads, else the status of its refusal."""
    try:
        read_batch_file(data, max_lines=10)
    except RequestError as exc:
        return exc.status
    return 200


def test_fed_byte_by_byte_truncations_never_crash() -> None:
    data = _file(_line("a"), _line("b"))
    statuses = {cut: _status(data[:cut]) for cut in range(len(data) + 1)}
    assert set(statuses.values()) == {200, 400}
    # Whole lines read; a line cut anywhere is refused.
    first_end = data.index(b"\n")
    assert statuses[first_end] == 200
    assert statuses[first_end - 1] == 400


@given(st.binary(max_size=200))
def test_any_bytes_are_read_or_refused_with_a_400(data: bytes) -> None:
    assert _status(data) in (200, 400)


def test_output_lines_are_openais_shape() -> None:
    ok = json.loads(answer_line("batch_req_1", "a", "run-1", 200, b'{"x": 1}'))
    assert ok == {
        "id": "batch_req_1",
        "custom_id": "a",
        "response": {"status_code": 200, "request_id": "run-1", "body": {"x": 1}},
        "error": None,
    }
    err = json.loads(error_line("batch_req_2", "b", "batch_expired", "late"))
    assert err == {
        "id": "batch_req_2",
        "custom_id": "b",
        "response": None,
        "error": {"code": "batch_expired", "message": "late"},
    }


@pytest.mark.parametrize("depth", [300, 100_000])
def test_a_line_nested_past_any_body_limit_is_a_400_not_a_crash(depth: int) -> None:
    # msgspec recurses on the C stack: 100,000 levels raised RecursionError,
    # which reached the client as a 500 (found by a hostile upload).
    deep = '{"custom_id":"d","method":"POST","url":"/v1/chat/completions","body":'
    deep += "[" * depth + "]" * depth + "}"
    exc = _refused(_file(_line("first"), deep))
    assert exc.message.startswith("Line 2: "), exc.message
    assert exc.code is ErrorCode.JSON_TOO_DEEP
    assert exc.param == "line"
