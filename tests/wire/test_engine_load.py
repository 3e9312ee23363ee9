"""Engines' published load, parsed: Prometheus text and llama.cpp's /slots,
fed whole, line by line, with garbage, and with hypothesis."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop.config import SimConfig
from iop.sim._engine import Engine
from iop.wire import (
    EngineDialect,
    EngineFigures,
    figures_from_metrics,
    metric_names,
    parse_cache_config,
    parse_llamacpp_slots,
    parse_metrics,
)
from iop.wire._engine_load import MAX_METRICS_LINE_BYTES

VLLM_PAGE = b"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:prompt_tokens_total{model_name="m"} 12345.0
"""


def vllm(page: bytes) -> EngineFigures:
    return figures_from_metrics(
        EngineDialect.VLLM, parse_metrics(page, metric_names(EngineDialect.VLLM))
    )


def test_vllm_counts_add_up_across_engines_and_kv_is_the_fullest() -> None:
    assert vllm(VLLM_PAGE) == EngineFigures(running=5.0, waiting=7.0, kv_usage=0.5)


def test_the_old_vllm_kv_name_is_read_when_the_new_one_is_absent() -> None:
    page = b'vllm:gpu_cache_usage_perc{model_name="m"} 0.75\nvllm:num_requests_running 1\n'
    assert vllm(page) == EngineFigures(running=1.0, kv_usage=0.75)


def test_the_sims_page_parses_as_vllm() -> None:
    engine = Engine(SimConfig(kv_cache_blocks=100))
    figures = vllm(engine.metrics('a "quoted" \\ model'))
    assert figures == EngineFigures(running=0.0, waiting=0.0, kv_usage=0.0)


def test_sglang_and_llamacpp_names() -> None:
    sglang = b'sglang:num_running_reqs{model_name="m"} 4\nsglang:num_queue_reqs 9\nsglang:token_usage 0.9\n'
    got = figures_from_metrics(
        EngineDialect.SGLANG, parse_metrics(sglang, metric_names(EngineDialect.SGLANG))
    )
    assert got == EngineFigures(running=4.0, waiting=9.0, kv_usage=0.9)
    llama = b"# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\nllamacpp:requests_deferred 5\n"
    got = figures_from_metrics(
        EngineDialect.LLAMACPP, parse_metrics(llama, metric_names(EngineDialect.LLAMACPP))
    )
    assert got == EngineFigures(running=2.0, waiting=5.0)


def test_labels_with_escaped_quotes_and_braces_and_timestamps() -> None:
    page = b'vllm:num_requests_waiting{model_name="a\\"}b{c",x="\\\\"} 4 1700000000000\n'
    assert vllm(page).waiting == 4.0


@pytest.mark.parametrize("value", [b"NaN", b"+Inf", b"-Inf", b"1e999", b"-1e999", b"nan", b"inf"])
def test_nan_and_infinite_figures_are_unknown_not_full(value: bytes) -> None:
    page = b"vllm:num_requests_waiting " + value + b"\nvllm:kv_cache_usage_perc " + value + b"\n"
    got = vllm(page)
    assert got.waiting is None
    assert got.kv_usage is None


def test_out_of_range_figures_are_clamped() -> None:
    page = b"vllm:num_requests_running -5\nvllm:num_requests_waiting 1e300\nvllm:kv_cache_usage_perc 7\n"
    got = vllm(page)
    assert got.running == 0.0
    assert got.waiting == 1e300  # finite: the edge clamps counts to its own cap
    assert got.kv_usage == 1.0


@pytest.mark.parametrize(
    "garbage",
    [
        b"",
        b"\x00\xff\xfe garbage \x80",
        b"vllm:num_requests_running",
        b'vllm:num_requests_running{unclosed="x 3',
        b"vllm:num_requests_running{} ",
        b"vllm:num_requests_running three",
        b"<html><body>502 Bad Gateway</body></html>",
        b"{" * 10_000,
    ],
)
def test_garbage_is_skipped_and_the_good_lines_still_read(garbage: bytes) -> None:
    page = garbage + b"\nvllm:num_requests_waiting 2\n" + garbage
    assert vllm(page).waiting == 2.0


def test_an_overlong_line_is_skipped_unread() -> None:
    long = b'vllm:num_requests_waiting{x="' + b"a" * MAX_METRICS_LINE_BYTES + b'"} 9\n'
    assert vllm(long + b"vllm:num_requests_running 1\n") == EngineFigures(running=1.0)


def test_byte_by_byte_prefixes_never_raise() -> None:
    for i in range(len(VLLM_PAGE) + 1):
        vllm(VLLM_PAGE[:i])


def test_nothing_wanted_reads_nothing() -> None:
    assert parse_metrics(VLLM_PAGE, metric_names(EngineDialect.NONE)) == {}
    assert figures_from_metrics(EngineDialect.NONE, {"x": [1.0]}) == EngineFigures()


@given(st.binary(max_size=2048))
def test_any_bytes_parse_without_raising(body: bytes) -> None:
    got = vllm(body)
    for v in (got.running, got.waiting, got.kv_usage):
        assert v is None or (math.isfinite(v) and v >= 0)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(sorted(metric_names(EngineDialect.VLLM))),
            st.dictionaries(
                st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
                st.text(max_size=12),
                max_size=3,
            ),
            st.floats(allow_nan=True, allow_infinity=True),
        ),
        max_size=12,
    )
)
def test_rendered_samples_read_back(samples: list[tuple[str, dict[str, str], float]]) -> None:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    lines = []
    for name, labels, value in samples:
        label_text = ",".join(f'{k}="{esc(v)}"' for k, v in labels.items())
        lines.append(f"{name}{{{label_text}}} {value!r}")
    page = ("\n".join(lines) + "\n").encode()
    got = parse_metrics(page, metric_names(EngineDialect.VLLM))
    want: dict[str, list[float]] = {}
    for name, _, value in samples:
        want.setdefault(name, []).append(value)
    assert got.keys() == want.keys()
    for name, values in want.items():
        assert [repr(v) for v in got[name]] == [repr(v) for v in values]


def test_llamacpp_slots_current_and_old_shapes() -> None:
    assert parse_llamacpp_slots(
        b'[{"id":0,"is_processing":true},{"id":1,"is_processing":false},{"id":2,"is_processing":true}]'
    ) == EngineFigures(running=2.0)
    assert parse_llamacpp_slots(b'[{"id":0,"state":1},{"id":1,"state":0}]') == EngineFigures(
        running=1.0
    )


@pytest.mark.parametrize(
    "body", [b"", b"{}", b"[1,2]", b'{"error":"slots disabled"}', b"[" * 100_000, b"\xff"]
)
def test_llamacpp_slots_garbage_is_none(body: bytes) -> None:
    assert parse_llamacpp_slots(body) is None


def test_the_cache_size_is_read_from_vllms_cache_config_info() -> None:
    page = (
        b"# TYPE vllm:cache_config_info gauge\n"
        b'vllm:cache_config_info{block_size="16",cache_dtype="auto",'
        b'enable_prefix_caching="True",gpu_memory_utilization="0.9",num_gpu_blocks="2048"} 1.0\n'
        b"vllm:num_requests_running 1\n"
    )
    assert parse_cache_config(page) == 2048 * 16
    # Data parallel: one line per engine, added up.
    two = page + b'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="10"} 1.0\n'
    assert parse_cache_config(two) == 2058 * 16
    assert parse_cache_config(b"vllm:num_requests_running 1\n") is None
    assert (
        parse_cache_config(b'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1\n')
        is None
    )
    assert (
        parse_cache_config(b'vllm:cache_config_info{block_size="0",num_gpu_blocks="5"} 1\n') is None
    )
    huge = b'vllm:cache_config_info{block_size="1048576",num_gpu_blocks="1099511627776"} 1\n'
    assert parse_cache_config(huge) is None


_INFO_LINE = b'vllm:cache_config_info{block_size="16",num_gpu_blocks="%d"} 1.0'


def _cache_config_by_lines(page: bytes) -> int | None:
    """``parse_cache_config`` as a reader would write it first: split, test each line."""
    sizes = [
        parse_cache_config(raw)
        for raw in page.split(b"\n")
        if raw.startswith(b"vllm:cache_config_info{") and len(raw) <= MAX_METRICS_LINE_BYTES
    ]
    found = [s for s in sizes if s is not None]
    total = sum(found)
    return total if found and total <= 1 << 40 else None


@given(
    st.lists(
        st.one_of(
            st.integers(-2, 10**6).map(lambda n: _INFO_LINE % n),
            st.integers(1, 99).map(lambda n: b"x " + _INFO_LINE % n),  # not at a line's start
            st.just(b"vllm:cache_config_info{"),
            st.binary(max_size=40),
        ),
        max_size=8,
    )
)
def test_cache_config_finds_exactly_the_lines_that_start_with_it(lines: list[bytes]) -> None:
    page = b"\n".join(lines)
    assert parse_cache_config(page) == _cache_config_by_lines(page)
