"""Benchmark the hot paths: backend bytes in -> RuntimeEvents out (node),
RuntimeEvents in -> client bytes out (edge).

Measures, in CPU time per chunk:

1. ``sse``      the WHATWG SSE decoder alone, one vLLM chunk per feed;
2. ``parser``   ChatStreamParser (SSE + typed msgspec decode + events);
3. ``runtime``  a full run through the runtime: an adapter replaying the
                parser's output pushes events through the run's bounded
                channel to a consumer (task switches included, no sockets);
4. ``edge``     the edge's chat-completions stream encoder, content deltas
                fed in batches of 16 as the HTTP layer coalesces them, with
                the default output policy; ``edge_tools`` the same for a
                request with tools (the tool-text hold-back on), and
                ``edge_strict`` under ``strict`` (``<think>`` stripping on).

Run:  python scripts/bench_hotpath.py [--chunks 20000] [--repeat 5]
Prints one JSON object per line; docs/benchmarks.md quotes the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib.resources import files

import trio

from iop.api.chat._encode import ChatCompletionStream
from iop.config import Deadlines, OutputPolicy
from iop.events import Complete, Delta, RuntimeEvent, Start
from iop.runtime import EventSender, open_run_supervisor
from iop.spec import ChatRequest, ExecutionSpec, FunctionDef, Message, Tool
from iop.wire import ChatStreamParser, SSEDecoder


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
        run_id="b", request=ChatRequest(model="m", messages=[Message(role="user", content="x")])
    )

    async def main() -> float:
        t0 = time.process_time()
        got = 0
        async with open_run_supervisor() as sup:
            run = sup.start_run(Replay(), spec, Deadlines())
            async with run.events:
                async for ev in run.events:
                    got += isinstance(ev, Delta)
        assert got == n, got
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
    assert stream.finished
    return elapsed / n


def bench_edge(n: int) -> float:
    return _bench_edge(n, ChatRequest(model="m", messages=_MESSAGES), OutputPolicy())


def bench_edge_tools(n: int) -> float:
    tools = [Tool(function=FunctionDef(name="get_time"))]
    return _bench_edge(n, ChatRequest(model="m", messages=_MESSAGES, tools=tools), OutputPolicy())


def bench_edge_strict(n: int) -> float:
    return _bench_edge(n, ChatRequest(model="m", messages=_MESSAGES), OutputPolicy(strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--chunks", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    benches = (
        ("sse", bench_sse),
        ("parser", bench_parser),
        ("runtime", bench_runtime),
        ("edge", bench_edge),
        ("edge_tools", bench_edge_tools),
        ("edge_strict", bench_edge_strict),
    )
    for name, fn in benches:
        samples = [fn(args.chunks) * 1e6 for _ in range(args.repeat)]
        print(
            json.dumps(
                {
                    "bench": name,
                    "chunks": args.chunks,
                    "us_per_chunk_median": round(statistics.median(samples), 3),
                    "us_per_chunk_min": round(min(samples), 3),
                }
            )
        )


if __name__ == "__main__":
    main()
