"""Tool calls printed as text: parse_tool_calls, ToolTextFilter, unstreamed_cleaned_text."""

from __future__ import annotations

import itertools
import json
import string
from importlib.resources import files
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iop.spec import FunctionDef, Tool
from iop.wire._tooltext import (
    TOOL_CALL_OPENERS,
    ParsedToolText,
    ToolTextFilter,
    parse_tool_calls,
    unstreamed_cleaned_text,
)

WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string"},
        "days": {"type": "integer"},
        "ratio": {"type": "number"},
        "hot": {"type": "boolean"},
        "opts": {"anyOf": [{"type": "object"}, {"type": "null"}]},
        "tags": {"type": ["array", "null"]},
        "label": {"type": ["string", "integer"]},
    },
}
TOOLS = [
    Tool(function=FunctionDef(name="get_weather", parameters=WEATHER_SCHEMA)),
    Tool(function=FunctionDef(name="get_time")),
]
TOOL_NAMES = ("get_weather", "get_time")


def _strict_loads(s: str) -> Any:
    def reject(name: str) -> Any:
        raise ValueError(name)

    return json.loads(s, parse_constant=reject)


def summary(parsed: ParsedToolText) -> list[tuple[str, Any]]:
    """(name, decoded arguments) of each call, checking ids and indexes."""
    for i, call in enumerate(parsed.calls):
        assert call.index == i
        assert call.id == f"call_{i}"
    return [(c.name, _strict_loads(c.arguments)) for c in parsed.calls]


PARIS = {"city": "Paris"}

# name -> (text, expected calls). Each is one complete call in its own format.
FORMATS: dict[str, tuple[str, list[tuple[str, Any]]]] = {
    "hermes": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        [("get_weather", PARIS)],
    ),
    "hermes_parameters": (
        '<tool_call>{"name": "get_weather", "parameters": {"city": "Paris"}}</tool_call>',
        [("get_weather", PARIS)],
    ),
    "hermes_string_arguments": (
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
        [("get_weather", PARIS)],
    ),
    "hermes_list": (
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}},'
        ' {"name": "get_time", "arguments": {}}]</tool_call>',
        [("get_weather", PARIS), ("get_time", {})],
    ),
    "mustache": (
        '{{tool_call}}{"name": "get_weather", "arguments": {"city": "Paris"}}{{/tool_call}}',
        [("get_weather", PARIS)],
    ),
    "qwen3_xml": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>",
        [("get_weather", PARIS)],
    ),
    "qwen3_bare_function": (
        "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>",
        [("get_weather", PARIS)],
    ),
    "bare_json": (
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        [("get_weather", PARIS)],
    ),
    "bare_json_list": (
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]',
        [("get_weather", PARIS), ("get_time", {})],
    ),
}
# The formats that begin with one of TOOL_CALL_OPENERS (the filter can hide them).
OPENER_FORMATS = ["hermes", "hermes_parameters", "hermes_list", "mustache", "qwen3_xml"]
OPENER_FORMATS += ["hermes_string_arguments", "qwen3_bare_function"]


# --- parse_tool_calls: each format ------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no_tools"])
def test_each_format_whole(fmt: str, tools: list[Tool] | None) -> None:
    text, expected = FORMATS[fmt]
    parsed = parse_tool_calls(text, tools)
    assert summary(parsed) == expected
    assert parsed.content == ""


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_with_prose_around(fmt: str) -> None:
    text, expected = FORMATS[fmt]
    parsed = parse_tool_calls(f"Let me check.\n{text}\nDone.", TOOLS)
    assert summary(parsed) == expected
    assert parsed.content == "Let me check.\n\nDone."


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_twice_with_prose_between(fmt: str) -> None:
    text, expected = FORMATS[fmt]
    parsed = parse_tool_calls(f"A {text} B {text} C", TOOLS)
    assert summary(parsed) == expected + expected
    assert parsed.content == "A  B  C"


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_with_trailing_garbage(fmt: str) -> None:
    text, expected = FORMATS[fmt]
    parsed = parse_tool_calls(text + "}]>\x00 trailing", TOOLS)
    assert summary(parsed) == expected
    assert parsed.content == "}]>\x00 trailing"


def test_multiple_formats_in_order() -> None:
    text = "".join(FORMATS[f][0] + f" ({f})\n" for f in FORMATS)
    parsed = parse_tool_calls(text, TOOLS)
    assert summary(parsed) == [call for f in FORMATS for call in FORMATS[f][1]]
    assert parsed.content == "\n".join(f" ({f})" for f in FORMATS).strip()


def test_missing_opener() -> None:
    text = 'Sure.\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\nok'
    parsed = parse_tool_calls(text, TOOLS)
    assert summary(parsed) == [("get_weather", PARIS)]
    assert parsed.content == "Sure.\n\nok"


def test_missing_mustache_opener() -> None:
    text = '{"name": "get_time", "arguments": {}}{{/tool_call}}'
    parsed = parse_tool_calls(text, TOOLS)
    assert summary(parsed) == [("get_time", {})]
    assert parsed.content == ""


def test_missing_opener_for_bare_function() -> None:
    text = "<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>"
    parsed = parse_tool_calls(text, TOOLS)
    assert summary(parsed) == [("get_weather", PARIS)]
    assert parsed.content == ""


def test_missing_closer_at_end_of_text() -> None:
    text = 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    parsed = parse_tool_calls(text, TOOLS)
    assert summary(parsed) == [("get_weather", PARIS)]
    assert parsed.content == "Hi"


def test_missing_closer_then_prose() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": {}} and then some prose'
    parsed = parse_tool_calls(text, TOOLS)
    assert summary(parsed) == [("get_time", {})]
    assert parsed.content == "and then some prose"


def test_missing_closer_before_next_opener() -> None:
    text = (
        '<tool_call>{"name": "get_time", "arguments": {}}\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    )
    parsed = parse_tool_calls(text, TOOLS)
    assert summary(parsed) == [("get_time", {}), ("get_weather", PARIS)]
    assert parsed.content == ""


def test_missing_closers_for_qwen3_xml() -> None:
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=unit>\nC\n"
    parsed = parse_tool_calls(text, TOOLS)
    assert summary(parsed) == [("get_weather", {"city": "Paris", "unit": "C"})]


def test_mustache_missing_closer() -> None:
    parsed = parse_tool_calls('x {{tool_call}}{"name": "get_time", "arguments": {}}', TOOLS)
    assert summary(parsed) == [("get_time", {})]
    assert parsed.content == "x"


def test_xml_tags_are_ascii_case_insensitive() -> None:
    text = '<TOOL_CALL>{"name": "get_time", "arguments": {}}</Tool_Call>'
    assert summary(parse_tool_calls(text, TOOLS)) == [("get_time", {})]
    text = "<FUNCTION=get_time></Function>"
    assert summary(parse_tool_calls(text, TOOLS)) == [("get_time", {})]
    # A non-ASCII look-alike (dotless i) is not a tag.
    text = "<funct\u0131on=get_time></function>"
    assert parse_tool_calls(text, TOOLS).calls == ()


def test_mustache_is_case_sensitive() -> None:
    text = '{{TOOL_CALL}}{"name": "get_time"}{{/TOOL_CALL}}'
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.calls == ()
    assert parsed.content == text


def test_id_prefix() -> None:
    parsed = parse_tool_calls(FORMATS["hermes_list"][0], TOOLS, id_prefix="call_run7_")
    assert [c.id for c in parsed.calls] == ["call_run7_0", "call_run7_1"]


# --- names ----------------------------------------------------------------------


UNKNOWN = {
    "hermes": '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
    "mustache": '{{tool_call}}{"name": "rm_rf", "arguments": {}}{{/tool_call}}',
    "qwen3_xml": "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>",
    "bare_function": "<function=rm_rf></function>",
    "bare_json": '{"name": "rm_rf", "arguments": {}}',
    "missing_opener": '{"name": "rm_rf", "arguments": {}}</tool_call>',
}


@pytest.mark.parametrize("fmt", UNKNOWN)
def test_unknown_tool_name_stays_content(fmt: str) -> None:
    text = UNKNOWN[fmt]
    parsed = parse_tool_calls(f"before {text} after", TOOLS)
    assert parsed.calls == ()
    assert parsed.content == f"before {text} after"
    # Without tools any name is accepted.
    assert [c.name for c in parse_tool_calls(text).calls] == ["rm_rf"]


def test_empty_tools_accept_any_name() -> None:
    assert [c.name for c in parse_tool_calls(UNKNOWN["hermes"], []).calls] == ["rm_rf"]


def test_list_with_one_unknown_name_is_all_or_nothing() -> None:
    text = (
        '<tool_call>[{"name": "get_time", "arguments": {}},'
        ' {"name": "rm_rf", "arguments": {}}]</tool_call>'
    )
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.calls == ()
    assert parsed.content == text


def test_unknown_then_known_block() -> None:
    text = UNKNOWN["hermes"] + "\n" + FORMATS["hermes"][0]
    parsed = parse_tool_calls(text, TOOLS)
    assert summary(parsed) == [("get_weather", PARIS)]
    assert parsed.content == UNKNOWN["hermes"]


# --- malformed ------------------------------------------------------------------

MALFORMED = [
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}} </tool_call>',
    '<tool_call>{"name": "get_time", "arguments": {}} junk</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>["get_time"]</tool_call>',
    "<tool_call>[]</tool_call>",
    "<tool_call></tool_call>",
    "<tool_call>   </tool_call>",
    "<tool_call>get_time()</tool_call>",
    '<tool_call>{"name": "get_weather", "arguments": {"x": NaN}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"x": Infinity}}</tool_call>',
    '{{tool_call}}{"name": "get_time", "arguments": {}{{/tool_call}}',
    "<tool_call><function=get_time>junk<parameter=x>1</parameter></function></tool_call>",
    "<tool_call><function=get_time> </function> junk</tool_call>",
    "<tool_call><function=>\n</function></tool_call>",
    "<tool_call><function=get time></function></tool_call>",
    "<tool_call><function=get_time</tool_call>",
    "<tool_call><function=get_weather><parameter=>1</parameter></function></tool_call>",
]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_block_stays_content(text: str) -> None:
    parsed = parse_tool_calls(f"a {text} b", TOOLS)
    assert parsed.calls == ()
    assert parsed.content == f"a {text} b"


def test_malformed_block_does_not_hide_a_later_call() -> None:
    text = MALFORMED[0] + " then " + FORMATS["hermes"][0]
    parsed = parse_tool_calls(text, TOOLS)
    assert summary(parsed) == [("get_weather", PARIS)]
    assert parsed.content == MALFORMED[0] + " then"


def test_closer_inside_a_json_string() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "</tool_call>"}}</tool_call>!'
    parsed = parse_tool_calls(text, TOOLS)
    assert summary(parsed) == [("get_weather", {"city": "</tool_call>"})]
    assert parsed.content == "!"


# --- bare JSON ------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "Bob", "age": 3}',
        '{"name": "get_weather"}',  # a bare object needs arguments/parameters
        '[{"name": "get_time", "arguments": {}}, 3]',
        '{"tool_calls": [{"name": "get_time", "arguments": {}}]}',  # never extracted from inside
        '{"result": {"name": "get_time", "arguments": {}}}',
        '[{"a": 1}, {"name": "get_time", "arguments": {}}]',
    ],
)
@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no_tools"])
def test_ordinary_json_is_not_a_call(text: str, tools: list[Tool] | None) -> None:
    parsed = parse_tool_calls(f"Here: {text}.", tools)
    assert parsed.calls == ()
    assert parsed.content == f"Here: {text}."


def test_bare_json_without_tools_accepts_any_name() -> None:
    parsed = parse_tool_calls('Answer: {"name": "anything", "parameters": {"q": 1}}')
    assert summary(parsed) == [("anything", {"q": 1})]
    assert parsed.content == "Answer:"


def test_hermes_block_without_arguments_means_no_arguments() -> None:
    parsed = parse_tool_calls('<tool_call>{"name": "get_time"}</tool_call>', TOOLS)
    assert parsed.calls[0].arguments == "{}"


# --- arguments ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ('{"city": "Paris", "n": [1, 2.5]}', '{"city":"Paris","n":[1,2.5]}'),  # object: compact
        ('{"city": "Zürich"}', '{"city":"Zürich"}'),  # ensure_ascii=False
        ('"{\\"city\\": \\"Paris\\"}"', '{"city": "Paris"}'),  # JSON in a string: as is
        ('" [1,2] "', " [1,2] "),  # any JSON text in a string is kept as is
        ('"Paris"', '"Paris"'),  # a non-JSON string becomes a JSON string
        ('"not {json"', '"not {json"'),
        ("null", "{}"),
        ('""', "{}"),
        ('"  "', "{}"),
        ("[1, 2]", "[1,2]"),
        ('"\\ud800"', '"\\ud800"'),  # a lone surrogate stays escaped
        ('{"x": "\\ud800"}', '{"x":"\\ud800"}'),
    ],
)
def test_arguments_encoding(arguments: str, expected: str) -> None:
    text = f'<tool_call>{{"name": "get_weather", "arguments": {arguments}}}</tool_call>'
    (call,) = parse_tool_calls(text, TOOLS).calls
    assert call.arguments == expected
    _strict_loads(call.arguments)
    call.arguments.encode("utf-8")


def test_arguments_preferred_over_parameters() -> None:
    text = (
        '<tool_call>{"name": "get_time", "arguments": {"a": 1}, "parameters": {"b": 2}}</tool_call>'
    )
    assert summary(parse_tool_calls(text, TOOLS)) == [("get_time", {"a": 1})]


# --- Qwen3-Coder parameter typing ---------------------------------------------------


def _xml(**params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function=get_weather>\n{body}</function>\n</tool_call>"


def test_xml_parameters_typed_by_schema() -> None:
    text = _xml(
        city="Paris",
        days="3",
        ratio="0.5",
        hot="True",
        opts='{"a": [1]}',
        tags="null",
        label="42",
        extra="7",
    )
    (call,) = parse_tool_calls(text, TOOLS).calls
    assert call.arguments == (
        '{"city":"Paris","days":3,"ratio":0.5,"hot":true,"opts":{"a":[1]},'
        '"tags":null,"label":"42","extra":"7"}'
    )


def test_xml_parameters_without_tools_are_strings() -> None:
    (call,) = parse_tool_calls(_xml(days="3", hot="true", opts="{}")).calls
    assert _strict_loads(call.arguments) == {"days": "3", "hot": "true", "opts": "{}"}


def test_xml_parameter_that_does_not_decode_stays_a_string() -> None:
    (call,) = parse_tool_calls(_xml(days="three", hot="yes", opts="{bad", ratio="NaN"), TOOLS).calls
    assert _strict_loads(call.arguments) == {
        "days": "three",
        "hot": "yes",
        "opts": "{bad",
        "ratio": "NaN",
    }


def test_xml_string_value_keeps_inner_whitespace() -> None:
    text = "<function=get_weather><parameter=city>\n\n  Paris \n\n</parameter></function>"
    (call,) = parse_tool_calls(text, TOOLS).calls
    # vLLM's rule: one newline is removed on each side, nothing else.
    assert _strict_loads(call.arguments) == {"city": "\n  Paris \n"}


def test_xml_function_without_parameters() -> None:
    parsed = parse_tool_calls("<tool_call><function=get_time>\n</function></tool_call>", TOOLS)
    assert summary(parsed) == [("get_time", {})]


def test_xml_several_functions_in_one_block() -> None:
    text = (
        "<tool_call>\n<function=get_time>\n</function>\n"
        "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    )
    assert summary(parse_tool_calls(text, TOOLS)) == [("get_time", {}), ("get_weather", PARIS)]


def test_xml_function_missing_closer_before_next_function() -> None:
    text = "<function=get_time>\n<function=get_weather><parameter=city>Paris</parameter></function>"
    assert summary(parse_tool_calls(text, TOOLS)) == [("get_time", {}), ("get_weather", PARIS)]


# --- the real transcript ------------------------------------------------------------


def _transcript_contents(name: str) -> list[str]:
    raw = (files("iop.testing") / "transcripts" / name).read_text("utf-8")
    out: list[str] = []
    for line in raw.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[len("data: ") :])["choices"]:
            content = choice["delta"].get("content")
            if content:
                out.append(content)
    return out


def test_hermes_text_in_content_transcript() -> None:
    deltas = _transcript_contents("hermes_text_tool_call_in_content_vllm.txt")
    parsed = parse_tool_calls("".join(deltas), TOOLS)
    assert summary(parsed) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert parsed.content == ""


def test_hermes_text_in_content_transcript_through_filter() -> None:
    deltas = _transcript_contents("hermes_text_tool_call_in_content_vllm.txt")
    f = ToolTextFilter()
    released = "".join(f.append(d) for d in deltas)
    assert released == ""
    assert f.holding_call
    assert f.flush() == "".join(deltas)


# --- ToolTextFilter -----------------------------------------------------------------


_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def _hay(s: str, opener: str) -> str:
    # The filter's case rules: XML-like openers ASCII case-insensitive, mustache exact.
    return s if opener.startswith("{") else s.translate(_ASCII_LOWER)


def starts_with_opener(s: str) -> bool:
    return any(_hay(s[:12], o).startswith(o) for o in TOOL_CALL_OPENERS)


def is_proper_opener_prefix(s: str) -> bool:
    return s != "" and any(len(s) < len(o) and o.startswith(_hay(s, o)) for o in TOOL_CALL_OPENERS)


def could_start_opener(s: str) -> bool:
    """``s`` starts with an opener, or is a proper prefix of one."""
    return starts_with_opener(s) or is_proper_opener_prefix(s)


def feed(deltas: list[str]) -> tuple[list[str], str]:
    f = ToolTextFilter()
    return [f.append(d) for d in deltas], f.flush()


@pytest.mark.parametrize("fmt", OPENER_FORMATS)
@pytest.mark.parametrize("before", ["", "Let me check. ", "Let me check.\n\n"])
def test_filter_byte_by_byte_hides_each_format(fmt: str, before: str) -> None:
    call_text = FORMATS[fmt][0]
    text = before + call_text + "\nafter"
    f = ToolTextFilter()
    released = ""
    for ch in text:
        released += f.append(ch)
        # Nothing released could be (part of) an opener, given the whole text.
        assert not any(could_start_opener(text[i:]) for i in range(len(released)))
    assert released == before.rstrip()
    assert f.holding_call
    held = f.flush()
    assert released + held == text
    assert summary(parse_tool_calls(released + held, TOOLS)) == FORMATS[fmt][1]


@pytest.mark.parametrize("fmt", FORMATS)
def test_filter_byte_by_byte_concatenation(fmt: str) -> None:
    text = "Hi " + FORMATS[fmt][0] + " bye "
    outs, flushed = feed(list(text))
    assert "".join(outs) + flushed == text


def test_filter_lets_bare_json_through() -> None:
    # Known limit: no opener to watch. parse_tool_calls still finds the call.
    text = FORMATS["bare_json"][0]
    outs, flushed = feed(list(text))
    assert "".join(outs) == text
    assert flushed == ""


@pytest.mark.parametrize("tail", ["<", "<t", "<tool", "<TOOL_CAL", "{", "{{", "{{tool_cal", "<fun"])
def test_filter_holds_possible_opener_prefix(tail: str) -> None:
    f = ToolTextFilter()
    assert f.append("Hello " + tail) == "Hello"
    assert f.held == " " + tail
    assert not f.holding_call


@pytest.mark.parametrize("tail", ["<b", "<tool_x", "<TOOL_CALx", "{x", "{{x", "<function_"])
def test_filter_releases_once_disambiguated(tail: str) -> None:
    f = ToolTextFilter()
    assert f.append("Hello ") == "Hello"
    assert f.append(tail[:-1]) == ""
    assert f.append(tail[-1:]) == " " + tail
    assert f.held == ""


def test_filter_mustache_opener_is_case_sensitive() -> None:
    f = ToolTextFilter()
    assert f.append("a {{TOOL_CALL}}") == "a {{TOOL_CALL}}"
    assert not f.holding_call


def test_filter_earlier_prefix_wins() -> None:
    # "<<" : the first "<" cannot start an opener any more, the second still can.
    f = ToolTextFilter()
    assert f.append("a<<") == "a<"
    assert f.held == "<"


def test_filter_holds_trailing_whitespace_and_releases_it_later() -> None:
    f = ToolTextFilter()
    assert f.append("Hello\n\n") == "Hello"
    assert f.held == "\n\n"
    assert f.append("World") == "\n\nWorld"
    assert f.flush() == ""


def test_filter_whitespace_before_opener_is_held_not_lost() -> None:
    # The seed dropped it; it stays held, for flush() when no call follows.
    f = ToolTextFilter()
    assert f.append("Sure.  \n<tool_call>") == "Sure."
    assert f.append("not a call after all") == ""
    assert f.flush() == "  \n<tool_call>not a call after all"


def test_filter_opener_split_across_deltas() -> None:
    f = ToolTextFilter()
    assert f.append("ok <to") == "ok"
    assert f.append("ol_c") == ""
    assert f.append("all>{") == ""
    assert f.holding_call
    assert f.held == " <tool_call>{"


def test_filter_is_case_insensitive_for_xml_openers() -> None:
    f = ToolTextFilter()
    assert f.append("x <FuNcTiOn=get_time>") == "x"
    assert f.holding_call


def test_filter_flush_resets() -> None:
    f = ToolTextFilter()
    f.append("a <tool_call>")
    assert f.flush() == " <tool_call>"
    assert not f.holding_call
    assert f.append("plain") == "plain"
    assert f.flush() == ""


def test_filter_empty_deltas() -> None:
    f = ToolTextFilter()
    assert f.append("") == ""
    assert f.append("<tool_call>") == ""
    assert f.append("") == ""
    assert f.flush() == "<tool_call>"


# --- unstreamed_cleaned_text: one test per branch of the Go function ------------------


def test_unstreamed_empty_cleaned() -> None:
    assert unstreamed_cleaned_text("", "anything") == ""


def test_unstreamed_nothing_emitted() -> None:
    assert unstreamed_cleaned_text("  Hello ", "") == "  Hello "


def test_unstreamed_emitted_is_prefix() -> None:
    assert unstreamed_cleaned_text("Let me check.\nDone.", "Let me check.") == "\nDone."


def test_unstreamed_cleaned_blank_after_trim() -> None:
    assert unstreamed_cleaned_text("  \n ", "x") == ""


def test_unstreamed_equal_after_trim() -> None:
    assert unstreamed_cleaned_text("Hello", "Hello\n") == ""


def test_unstreamed_trimmed_emitted_is_prefix() -> None:
    assert unstreamed_cleaned_text("  Hello  world ", "\nHello") == "world"


def test_unstreamed_diverged() -> None:
    assert unstreamed_cleaned_text("Sure:", 'Sure: {"name": "get_time"') == ""


def test_unstreamed_blank_emitted_deviation() -> None:
    # The seed returned "" here; nothing but whitespace was sent, so send it all.
    assert unstreamed_cleaned_text(" Hello ", "\n") == "Hello"


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000,
        '[{"a":' * 20_000,
        '{"a":' * 20_000 + "}" * 20_000,
        "<tool_call>" + "[" * 100_000,
        "<tool_call>" * 20_000,
        "{{tool_call}}" * 20_000,
        "<function=a" * 20_000,
        "<function=f>" + "<parameter=x>" * 20_000,
        '<tool_call>{"name": "f", "arguments": {"a": ' + "1" * 5000 + "}}</tool_call>",
        '<function=f><parameter=x>{"a": ' + "[" * 5000 + "</parameter></function>",
    ],
    ids=lambda t: repr(t[:16]),
)
def test_degenerate_text_never_raises(text: str) -> None:
    parsed = parse_tool_calls(text, None)
    for call in parsed.calls:
        _strict_loads(call.arguments)


# --- properties ---------------------------------------------------------------------

PIECES = [
    "<tool_call>",
    "</tool_call>",
    "<tool",
    "<TOOL_CALL",
    "<",
    "{{",
    "{{tool_call}}",
    "{{/tool_call}}",
    "{",
    "}",
    "[",
    "]",
    '"',
    "<function=",
    "<Function=get_time>",
    "</function>",
    "<parameter=city>",
    "</parameter>",
    '{"name": "get_weather", "arguments": ',
    '{"name": "get_time", "parameters": {}}',
    '"arguments": "x"',
    "NaN",
    "\\ud800",
    " ",
    "\n",
    "\t",
    "abc",
    "é",
]
texts = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=4)), max_size=25).map("".join)


@st.composite
def split_text(draw: st.DrawFn) -> list[str]:
    text = draw(texts)
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@given(split_text())
@settings(deadline=None)
def test_property_filter_concatenation(deltas: list[str]) -> None:
    outs, flushed = feed(deltas)
    assert "".join(outs) + flushed == "".join(deltas)


class ReferenceFilter:
    """The seed's algorithm on one pending string, minus its whitespace loss."""

    def __init__(self) -> None:
        self.pending = ""
        self.holding = False

    def append(self, delta: str) -> str:
        self.pending += delta
        if self.holding:
            return ""
        idx = min(
            (i for i in range(len(self.pending)) if starts_with_opener(self.pending[i:])),
            default=-1,
        )
        if idx >= 0:
            self.holding = True
            cut = idx
        else:
            cut = next(
                (i for i in range(len(self.pending)) if could_start_opener(self.pending[i:])),
                len(self.pending),
            )
        out = self.pending[:cut].rstrip()
        self.pending = self.pending[len(out) :]
        return out


@given(split_text())
@settings(deadline=None)
def test_property_filter_matches_reference(deltas: list[str]) -> None:
    f, ref = ToolTextFilter(), ReferenceFilter()
    for d in deltas:
        assert f.append(d) == ref.append(d)
        assert f.held == ref.pending
        assert f.holding_call == ref.holding


@given(split_text())
@settings(deadline=None)
def test_property_filter_invariant(deltas: list[str]) -> None:
    """At every step: released + held == input so far; nothing that could start an
    opener was released; released text never ends in whitespace; held text without
    its leading whitespace is empty, a proper opener prefix, or starts with an opener."""
    f = ToolTextFilter()
    released = ""
    seen = ""
    for d in deltas:
        seen += d
        released += f.append(d)
        held = f.held
        assert released + held == seen
        assert released == released.rstrip()
        assert not any(could_start_opener(seen[i:]) for i in range(len(released)))
        core = held.lstrip()
        if f.holding_call:
            assert starts_with_opener(core)
        else:
            assert core == "" or is_proper_opener_prefix(core)
    outs_total = released + f.flush()
    assert outs_total == seen
    assert f.held == ""


@given(texts, st.booleans())
@settings(deadline=None)
def test_property_parse_never_raises_and_arguments_are_json(text: str, with_tools: bool) -> None:
    parsed = parse_tool_calls(text, TOOLS if with_tools else None)
    for i, call in enumerate(parsed.calls):
        assert call.index == i
        _strict_loads(call.arguments)
        call.arguments.encode("utf-8")
        if with_tools:
            assert call.name in TOOL_NAMES
    if not parsed.calls:
        assert parsed.content == text.strip()


@given(st.text())
@settings(deadline=None)
def test_property_parse_never_raises_on_any_text(text: str) -> None:
    parse_tool_calls(text, TOOLS)
    parse_tool_calls(text)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(), children, max_size=3)
    ),
    max_leaves=8,
)
prose = st.text(alphabet=string.ascii_letters + string.digits + " .,!?\n\t", max_size=20)


@given(
    st.lists(
        st.tuples(st.sampled_from(TOOL_NAMES), st.dictionaries(st.text(), json_values, max_size=4)),
        min_size=1,
        max_size=4,
    ),
    st.lists(prose, min_size=5, max_size=5),
    st.booleans(),
    st.data(),
)
@settings(deadline=None)
def test_property_hermes_round_trip(
    calls: list[tuple[str, dict[str, Any]]],
    proses: list[str],
    ensure_ascii: bool,
    data: st.DataObject,
) -> None:
    text = proses[0]
    for i, (name, arguments) in enumerate(calls):
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=ensure_ascii)
        text += f"<tool_call>\n{body}\n</tool_call>" + proses[(i + 1) % 5]
    parsed = parse_tool_calls(text, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    expected_content = proses[0] + "".join(proses[(i + 1) % 5] for i in range(len(calls)))
    assert parsed.content == expected_content.strip()
    # Streamed in random pieces, the filter shows exactly the prose before the first call.
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    outs, flushed = feed([text[a:b] for a, b in itertools.pairwise(bounds)])
    assert "".join(outs) == proses[0].rstrip()
    assert "".join(outs) + flushed == text
