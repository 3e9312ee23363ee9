"""What inference engines publish about their load, parsed (sans-IO).

Engines that publish their load do it in one of two ways, and this module
reads both, from bytes, without I/O:

* **Prometheus text** (``GET /metrics``; the exposition format,
  https://prometheus.io/docs/instrumenting/exposition_formats/#text-based-format):
  one sample per line, ``name{label="value",...} value [timestamp]``;
  ``#`` lines are comments (``HELP``, ``TYPE``). ``parse_metrics`` reads the
  subset a load figure needs: the samples of the names asked for, their
  labels skipped (quoted values with ``\\"`` escapes included), the value
  as a float (``NaN``, ``+Inf`` and ``-Inf`` are valid there). A line that
  does not parse is skipped, never an error: an engine's page also carries
  metrics nobody here reads, and a new engine version may write some
  differently.
* **llama.cpp's ``GET /slots``**: a JSON array with one object per slot;
  a slot is busy when ``is_processing`` is true (current builds) or its
  ``state`` is not 0 (older ones).

Which names mean what, per engine (``EngineDialect``; docs/operations.md,
"Engine load", lists the sources):

=========  ==============================  ==============================  ==============================================
engine     running                         waiting                         KV-cache usage (0..1)
=========  ==============================  ==============================  ==============================================
vllm       ``vllm:num_requests_running``   ``vllm:num_requests_waiting``   ``vllm:kv_cache_usage_perc``
                                                                           (older versions: ``vllm:gpu_cache_usage_perc``)
sglang     ``sglang:num_running_reqs``     ``sglang:num_queue_reqs``       ``sglang:token_usage``
llamacpp   ``llamacpp:requests_processing``  ``llamacpp:requests_deferred``  ``llamacpp:kv_cache_usage_ratio`` (if published)
=========  ==============================  ==============================  ==============================================

Several samples of one name (one per model, or per engine of a data-parallel
vLLM) are added up for the counts, and the largest is kept for the KV usage
(the fullest cache is the one a new request may not fit in). A figure that
is missing, NaN or infinite is unknown (None), never a number: a consumer
that cannot tell "unknown" from "full" blocks placement on garbage.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterator
from typing import Final

import msgspec

__all__ = [
    "MAX_METRICS_LINE_BYTES",
    "EngineDialect",
    "EngineFigures",
    "figures_from_metrics",
    "metric_names",
    "parse_cache_config",
    "parse_llamacpp_slots",
    "parse_metrics",
]

# A metrics line longer than this is skipped unread: the load gauges are
# ~100 bytes with their labels, and histograms' bucket lines a few hundred;
# the bound keeps one absurd line from costing a scan of megabytes per name.
MAX_METRICS_LINE_BYTES: Final = 64 * 1024


class EngineDialect(enum.StrEnum):
    """Which engine's names an instance's load is read with."""

    NONE = "none"
    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"


class EngineFigures(msgspec.Struct, frozen=True, kw_only=True):
    """An engine's load as it published it (None: it did not say)."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    # The KV cache's size in tokens (vLLM: ``num_gpu_blocks`` times
    # ``block_size`` of ``vllm:cache_config_info``): what prefix placement
    # bounds its picture of the cache with (``iop.edge.scheduler._prefix``).
    cache_tokens: int | None = None
    # The tokens its prefix cache holds now, from the engine's KV events
    # (``iop.wire._kv_events``; None: it publishes none we read).
    cached_tokens: int | None = None


# dialect -> (running names, waiting names, KV usage names); the first name
# of a list that has samples wins.
_NAMES: Final[dict[EngineDialect, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]]] = {
    EngineDialect.VLLM: (
        ("vllm:num_requests_running",),
        ("vllm:num_requests_waiting",),
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    ),
    EngineDialect.SGLANG: (
        ("sglang:num_running_reqs",),
        ("sglang:num_queue_reqs",),
        ("sglang:token_usage",),
    ),
    EngineDialect.LLAMACPP: (
        ("llamacpp:requests_processing",),
        ("llamacpp:requests_deferred",),
        ("llamacpp:kv_cache_usage_ratio",),
    ),
}


def metric_names(dialect: EngineDialect) -> frozenset[str]:
    """The metric names ``dialect``'s figures are read from."""
    if dialect is EngineDialect.NONE:
        return frozenset()
    running, waiting, kv = _NAMES[dialect]
    return frozenset((*running, *waiting, *kv))


def _value(token: str) -> float | None:
    try:
        return float(token)  # "NaN", "+Inf", "-Inf", exponents: the format's own
    except ValueError:
        return None


def _after_labels(line: str, start: int) -> int:
    """The index just past the label set that opens at ``line[start] == "{"``
    (-1: it never closes). Label values are quoted, with backslash escapes."""
    i = start + 1
    n = len(line)
    quoted = False
    while i < n:
        c = line[i]
        if quoted:
            if c == "\\":
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c == "}":
            return i + 1
        i += 1
    return -1


def parse_metrics(body: bytes, names: frozenset[str]) -> dict[str, list[float]]:
    """The samples of ``names`` in a Prometheus text page, by name.

    Args:
        body: The page (its size is bounded by whoever read it).
        names: The metric names wanted; every other line is skipped.

    Returns:
        Each wanted name that has samples, with their values in page order
        (NaN and infinities included: ``figures_from_metrics`` drops them).
    """
    out: dict[str, list[float]] = {}
    if not names:
        return out
    text = body.decode("utf-8", errors="replace")
    for raw in text.split("\n"):  # the format's lines end in \n only (not splitlines' \x1e...)
        if len(raw) > MAX_METRICS_LINE_BYTES:
            continue
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        end = 0
        n = len(line)
        while end < n and line[end] not in "{ \t":
            end += 1
        name = line[:end]
        if name not in names:
            continue
        rest = end
        if rest < n and line[rest] == "{":
            rest = _after_labels(line, rest)
            if rest < 0:
                continue
        fields = line[rest:].split()
        if not fields:
            continue
        value = _value(fields[0])
        if value is not None:
            out.setdefault(name, []).append(value)
    return out


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _pick(samples: dict[str, list[float]], names: tuple[str, ...]) -> list[float] | None:
    for name in names:
        values = _finite(samples.get(name, []))
        if values:
            return values
    return None


def figures_from_metrics(dialect: EngineDialect, samples: dict[str, list[float]]) -> EngineFigures:
    """``dialect``'s load figures from ``parse_metrics``' samples (module table)."""
    if dialect is EngineDialect.NONE:
        return EngineFigures()
    running_names, waiting_names, kv_names = _NAMES[dialect]
    running = _pick(samples, running_names)
    waiting = _pick(samples, waiting_names)
    kv = _pick(samples, kv_names)
    return EngineFigures(
        running=None if running is None else max(0.0, sum(running)),
        waiting=None if waiting is None else max(0.0, sum(waiting)),
        kv_usage=None if kv is None else min(1.0, max(0.0, max(kv))),
    )


# One label of a sample: name="value" (values of cache_config_info are
# numbers, booleans and dtype names: no escapes to honour).
_LABEL: Final = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="([^"\\]*)"')
_CACHE_INFO: Final = b"vllm:cache_config_info{"
# Blocks times block size past this is read as no figure: a cache of more
# than 2**40 tokens is a broken page, not an engine.
MAX_CACHE_TOKENS: Final = 1 << 40
_NEWLINE: Final = ord("\n")


def _lines_starting(page: bytes, prefix: bytes) -> Iterator[bytes]:
    """The lines of ``page`` that start with ``prefix``, found with
    ``bytes.find``: a vLLM page is hundreds of KiB of histogram lines and
    holds one such line per engine, so the page is not split into lines."""
    at = page.find(prefix)
    while at >= 0:
        end = page.find(b"\n", at)
        end = len(page) if end < 0 else end
        if at == 0 or page[at - 1] == _NEWLINE:
            yield page[at:end]
        at = page.find(prefix, end)  # none before end starts a line


def parse_cache_config(page: bytes) -> int | None:
    """The KV cache's size in tokens from vLLM's ``vllm:cache_config_info``
    gauge (its labels ``num_gpu_blocks`` and ``block_size``); None: not
    published, not numbers, or absurd. Several engines (data parallel) add up.
    """
    total = 0
    found = False
    for raw in _lines_starting(page, _CACHE_INFO):
        if len(raw) > MAX_METRICS_LINE_BYTES:
            continue
        labels = dict(_LABEL.findall(raw.decode("utf-8", "replace")))
        try:
            blocks = int(labels["num_gpu_blocks"])
            size = int(labels["block_size"])
        except (KeyError, ValueError):
            continue
        if blocks <= 0 or size <= 0:
            continue
        total += blocks * size
        found = True
    if not found or total > MAX_CACHE_TOKENS:
        return None
    return total


class _Slot(msgspec.Struct, frozen=True):
    is_processing: bool | None = None
    state: int | None = None


_SLOTS_DECODER: Final = msgspec.json.Decoder(list[_Slot])


def parse_llamacpp_slots(body: bytes) -> EngineFigures | None:
    """The running requests in llama.cpp's ``GET /slots`` answer.

    Returns:
        Busy slots as ``running`` (``waiting`` and ``kv_usage``: None, the
        page does not say); None when the body is not a list of slots.
    """
    try:
        slots = _SLOTS_DECODER.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    busy = 0
    for slot in slots:
        if slot.is_processing if slot.is_processing is not None else bool(slot.state):
            busy += 1
    return EngineFigures(running=float(busy))
