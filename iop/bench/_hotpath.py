"""The ``hotpath`` runner: CPU per chunk of IOP's hot paths, in process, no sockets.

Backend bytes in -> ``RuntimeEvent``s out (the node), ``RuntimeEvent``s in
-> client bytes out (the edge). Measured in CPU time (``time.process_time``)
per chunk, the median and the minimum of ``repeat`` runs of ``chunks``
chunks each:

1. ``sse``: the WHATWG SSE decoder alone, one vLLM chunk per feed;
2. ``parser``: ``ChatStreamParser`` (SSE + typed msgspec decode + events);
3. ``runtime``: a full run through the runtime: an adapter replaying the
   parser's output pushes events through the run's bounded channel to a
   consumer (task switches included, no sockets);
4. ``edge``: the edge's chat-completions stream encoder, content deltas fed
   in batches of 16 as the HTTP layer coalesces them, with the default
   output policy; ``edge_tools`` the same for a request with tools (the
   tool-text hold-back on), and ``edge_strict`` under ``strict``
   (``<think>`` stripping on).

docs/benchmarks.md ("Hot path micro-benchmark") quotes the medians; the
``floor`` runner (``iop/bench/_floor.py``) measures the libraries under these
paths alone. It starts no process. Until December 2026 this was
``scripts/bench_hotpath.py`` (``git show b50e66e^:scripts/bench_hotpath.py``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path
from typing import Any

import msgspec
import trio

from iop.api.chat._encode import ChatCompletionStream
from iop.bench._runner import RunContext, register, tables_report
from iop.config import Deadlines, OutputPolicy
from iop.events import Complete, Delta, RuntimeEvent, Start
from iop.runtime import EventSender, open_run_supervisor
from iop.spec import ChatRequest, ExecutionSpec, FunctionDef, Message, Tool
from iop.wire import ChatStreamParser, SSEDecoder

__all__ = ["STAGES", "Options", "plots", "run", "tables"]


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``[args]`` of a ``hotpath`` scenario.

    Attributes:
        chunks: Chunks (or content deltas) per run of a stage.
        repeat: Runs per stage; the median and the minimum are reported.
    """

    chunks: int = 20_000
    repeat: int = 5


def vllm_chunk(i: int) -> bytes:
    raw = (files("iop.testing") / "transcripts" / "vllm_text_stream_with_usage.txt").read_bytes()
    line = raw.split(b"\n\n")[2] + b"\n\n"  # a content chunk, ~235 bytes
    return line.replace(b'"Hello"', b'"tok%d"' % (i % 10))


def bench_sse(n: int) -> float:
    chunks = [vllm_chunk(i) for i in range(n)]
    dec = SSEDecoder()
    t0 = time.process_time()
    for c in chunks:
        dec.feed(c)
    return (time.process_time() - t0) / n


def bench_parser(n: int) -> float:
    chunks = [vllm_chunk(i) for i in range(n)]
    parser = ChatStreamParser()
    t0 = time.process_time()
    for c in chunks:
        parser.feed(c)
    return (time.process_time() - t0) / n


def bench_runtime(n: int) -> float:
    chunks = [vllm_chunk(i) for i in range(n)]

    class Replay:
        async def execute(self, spec: ExecutionSpec, send: EventSender) -> None:
            await send.send(Start())
            parser = ChatStreamParser()
            for c in chunks:
                for ev in parser.feed(c):
                    await send.send(ev)
            await send.send(Complete())

    spec = ExecutionSpec(
        run_id="hotpath-runtime",
        request=ChatRequest(model="m", messages=[Message(role="user", content="x")]),
    )

    async def main() -> float:
        t0 = time.process_time()
        got = 0
        async with open_run_supervisor() as sup:
            run = sup.start_run(Replay(), spec, Deadlines())
            async with run.events:
                async for ev in run.events:
                    got += isinstance(ev, Delta)
        if got != n:
            raise RuntimeError(f"the consumer got {got} deltas of {n}")
        return (time.process_time() - t0) / n

    return trio.run(main)


_EDGE_BATCH = 16
_MESSAGES = [Message(role="user", content="x")]


def _bench_edge(n: int, request: ChatRequest, policy: OutputPolicy) -> float:
    events: list[RuntimeEvent] = [Delta(f" tok{i % 10}") for i in range(n)]
    batches = [events[i : i + _EDGE_BATCH] for i in range(0, n, _EDGE_BATCH)]
    stream = ChatCompletionStream("chatcmpl-b", 1_700_000_000, "m", request, policy)
    t0 = time.process_time()
    stream.start()
    for batch in batches:
        stream.feed_many(batch)
    stream.feed(Complete())
    elapsed = time.process_time() - t0
    if not stream.finished:
        raise RuntimeError("the stream did not finish on Complete")
    return elapsed / n


def bench_edge(n: int) -> float:
    return _bench_edge(n, ChatRequest(model="m", messages=_MESSAGES), OutputPolicy())


def bench_edge_tools(n: int) -> float:
    tools = [Tool(function=FunctionDef(name="get_time"))]
    return _bench_edge(n, ChatRequest(model="m", messages=_MESSAGES, tools=tools), OutputPolicy())


def bench_edge_strict(n: int) -> float:
    return _bench_edge(n, ChatRequest(model="m", messages=_MESSAGES), OutputPolicy(strict=True))


STAGES: dict[str, Callable[[int], float]] = {
    "sse": bench_sse,
    "parser": bench_parser,
    "runtime": bench_runtime,
    "edge": bench_edge,
    "edge_tools": bench_edge_tools,
    "edge_strict": bench_edge_strict,
}


@register(
    "hotpath",
    Options,
    "CPU µs per chunk of the node's parse and runtime path and the edge's encoder (in process).",
    report=tables_report(__name__),
)
def run(opts: Options, ctx: RunContext) -> dict[str, Any]:
    if ctx.smoke:
        opts = msgspec.structs.replace(opts, chunks=min(opts.chunks, 200), repeat=1)
    stages: dict[str, dict[str, float]] = {}
    for name, fn in STAGES.items():
        samples = [fn(opts.chunks) * 1e6 for _ in range(opts.repeat)]
        stages[name] = {
            "us_per_chunk_median": round(statistics.median(samples), 3),
            "us_per_chunk_min": round(min(samples), 3),
        }
    return {"options": msgspec.to_builtins(opts), "stages": stages}


def tables(result: dict[str, Any]) -> str:
    """One row per stage: its median and minimum µs per chunk."""
    rows = [
        f"| `{name}` | {s['us_per_chunk_median']:.2f} | {s['us_per_chunk_min']:.2f} |"
        for name, s in result["stages"].items()
    ]
    head = ["| stage | µs per chunk (median) | (min) |", "| --- | ---: | ---: |"]
    return "\n".join([*head, *rows])


def plots(result: dict[str, Any], img_dir: Path) -> list[Path]:
    """None: the table is the figure."""
    return []
