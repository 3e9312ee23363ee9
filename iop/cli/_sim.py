"""``iop sim``: serve the deterministic simulated backend over HTTP.

The sim speaks vLLM's OpenAI-compatible wire format byte for byte, so any
client, the ``vllm`` adapter or a benchmark can be pointed at it. Settings
come from ``--config`` (a TOML file with a ``[sim]`` table), then the flags.
"""

from __future__ import annotations

import argparse
import logging
from functools import partial
from typing import Any

import msgspec
import trio

from iop._extras import Extra, require
from iop.cli._signals import open_stop_signals
from iop.config import SimConfig, load_config
from iop.errors import ConfigError

__all__ = ["add_parser"]

log = logging.getLogger("iop.sim")

_FAILURES = (
    "none",
    "http_500",
    "http_429",
    "http_401",
    "midstream_error",
    "truncate",
    "stall_before_first_byte",
    "stall_mid_stream",
    "malformed_chunk",
)

_D = SimConfig()  # defaults shown in --help

_EPILOG = """\
examples:
  iop sim                                    # iop-sim on http://127.0.0.1:8000/v1
  iop sim --port 0 --tokens-per-s 50         # a free port, 50 tokens/s
  iop sim --reasoning-tokens 16 --ttft 0.5   # reasoning first, 0.5 s to first token
  iop sim --no-auto-tool-choice              # vLLM without --enable-auto-tool-choice
  iop sim --failure midstream_error --fail-after-tokens 4
  iop sim --kv-cache-blocks 8192 --prefill-tokens-per-s 4000 --max-num-seqs 8
                                             # an engine with a prefix cache and a batch
  iop sim --kv-cache-blocks 8192 --kv-events-endpoint 'tcp://*:5557' --kv-events-topic kv-events
                                             # ... publishing its cache's events as vLLM does
  iop sim --config sim.toml --seed 7         # [sim] table from a file, seed overridden
  iop sim --tool-call-name shell --tool-call-name Bash \\
          --tool-call-arguments '{"command": "echo iop-tool-ok"}'
                                             # agents: call their shell tool, quote its output
  iop sim --tool-call-name shell --tool-call-arguments-for 'shell={"command": ["ls"]}'
                                             # ... with arguments for one tool only
  iop sim --tool-call-step 'Write={"file_path": "/tmp/a", "content": "hi"}' \\
          --tool-call-step 'Bash={"command": "cat /tmp/a"}'
                                             # agents: several tool round trips in one turn

per request: a request key "iop_sim" (an object of the same settings, e.g.
{"iop_sim": {"failure": "http_429"}}) overrides the server's settings for
that request only.
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "sim",
        help="serve the deterministic simulated backend (vLLM wire format)",
        description=(
            "Serve a deterministic simulated model over HTTP, speaking vLLM's "
            "OpenAI-compatible API (POST /v1/chat/completions, /v1/completions, "
            "/v1/embeddings, /tokenize, /detokenize; GET /v1/models, /health): "
            "same request, same bytes. Timing, reasoning, tool calls and failures "
            "are configurable. SIGINT/SIGTERM stop it cleanly (open streams get "
            "1 s) and exit 0; a second signal stops at once (exit 130/143)."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="interface to listen on (default: %(default)s)"
    )
    p.add_argument(
        "--port", type=int, default=8000, help="TCP port, 0 for a free one (default: %(default)s)"
    )
    p.add_argument("--config", metavar="FILE", help="TOML file with a [sim] table")
    p.add_argument(
        "--tls-certfile",
        metavar="PEM",
        help="serve HTTPS with this certificate (with --tls-keyfile)",
    )
    p.add_argument("--tls-keyfile", metavar="PEM", help="the private key of --tls-certfile")
    g = p.add_argument_group("simulation (override the config file)")
    g.add_argument("--model", help=f"model name served (default: {_D.model})")
    g.add_argument(
        "--ttft",
        type=float,
        dest="ttft_s",
        metavar="SECONDS",
        help=f"time to first token (default: {_D.ttft_s:g})",
    )
    g.add_argument(
        "--tokens-per-s",
        type=float,
        metavar="RATE",
        help=f"token rate; 0 = as fast as possible (default: {_D.tokens_per_s:g})",
    )
    g.add_argument(
        "--output-tokens",
        type=int,
        metavar="N",
        help=f"content tokens per answer (default: {_D.output_tokens})",
    )
    g.add_argument(
        "--reasoning-tokens",
        type=int,
        metavar="N",
        help=f"reasoning tokens before the content (default: {_D.reasoning_tokens})",
    )
    g.add_argument(
        "--tool-mode",
        choices=["native", "text", "none"],
        help="tool calls as OpenAI deltas (native, the default), as Hermes <tool_call> text, or never",
    )
    g.add_argument(
        "--no-auto-tool-choice",
        dest="auto_tool_choice",
        action="store_const",
        const=False,
        default=None,
        help="answer tool requests with vLLM's 400 (no --enable-auto-tool-choice)",
    )
    g.add_argument(
        "--leading-system-only",
        dest="leading_system_only",
        action="store_const",
        const=True,
        default=None,
        help="refuse a system message that is not first (400), as a chat template that "
        "raises on one does",
    )
    g.add_argument(
        "--failure", choices=_FAILURES, help="inject a failure into every answer (default: none)"
    )
    g.add_argument(
        "--fail-after-tokens",
        type=int,
        metavar="N",
        help=f"tokens sent before a mid-stream failure (default: {_D.fail_after_tokens})",
    )
    g.add_argument(
        "--seed", type=int, help=f"seed of the deterministic text and vectors (default: {_D.seed})"
    )
    g.add_argument(
        "--tool-call-name",
        dest="tool_call_names",
        action="append",
        metavar="NAME",
        help=(
            "scripted tool mode: call the first of these tools (repeat the flag "
            "for candidates) the request declares, then quote the tool's result"
        ),
    )
    g.add_argument(
        "--tool-call-arguments",
        metavar="JSON",
        help=f"the scripted call's arguments, a JSON object (default: {_D.tool_call_arguments})",
    )
    g.add_argument(
        "--tool-call-arguments-for",
        dest="tool_call_arguments_by_tool",
        action="append",
        metavar="NAME=JSON",
        help="arguments for one candidate tool (repeatable), instead of --tool-call-arguments",
    )
    g.add_argument(
        "--tool-call-step",
        dest="tool_call_sequence",
        action="append",
        metavar="NAME=JSON",
        help=(
            "scripted tool sequence (repeat the flag for each step, in order): the "
            "turn's Nth request calls the Nth tool with these arguments, then the "
            "answer quotes the last result"
        ),
    )
    g.add_argument(
        "--embedding-dim",
        type=int,
        metavar="N",
        help=f"size of the /v1/embeddings vectors (default: {_D.embedding_dim})",
    )
    g.add_argument(
        "--max-inputs",
        type=int,
        metavar="N",
        help=(
            "most embeddings inputs or completions prompts in one request "
            f"(default: {_D.max_inputs})"
        ),
    )
    e = p.add_argument_group(
        "engine model",
        "what makes a real engine's first token and token rate move; off unless set "
        '(docs/configuration.md, "`iop sim` config")',
    )
    e.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        metavar="R",
        help="the first token also waits for the uncached prompt tokens at this rate",
    )
    e.add_argument(
        "--kv-cache-blocks",
        type=int,
        metavar="N",
        help="a prefix cache of N blocks (LRU; 0, the default: none)",
    )
    e.add_argument(
        "--kv-block-tokens",
        type=int,
        metavar="N",
        help=f"tokens per cache block (default: {_D.kv_block_tokens})",
    )
    e.add_argument(
        "--max-num-seqs",
        type=int,
        metavar="N",
        help="requests running at once; the rest wait (0, the default: no limit)",
    )
    e.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        help="vLLM's --scheduling-policy: priority serves the body's priority (lower first) "
        "and preempts the worst running request for a better one (default: fcfs)",
    )
    e.add_argument(
        "--decode-slowdown",
        type=float,
        metavar="F",
        help="each other running request stretches a token's delay by F (default: 0)",
    )
    k = p.add_argument_group(
        "KV cache events",
        "the prefix cache's events over ZeroMQ, in vLLM's frames and bytes (the kvevents "
        'extra; docs/operations.md, "What the caches hold")',
    )
    k.add_argument(
        "--kv-events-endpoint",
        metavar="ENDPOINT",
        help="publish on this PUB endpoint, bound (vLLM's endpoint: tcp://*:5557)",
    )
    k.add_argument(
        "--kv-events-replay-endpoint",
        metavar="ENDPOINT",
        help="serve replays on this ROUTER endpoint (vLLM's replay_endpoint)",
    )
    k.add_argument("--kv-events-topic", metavar="TOPIC", help="the messages' topic (default: '')")
    p.set_defaults(func=_cmd_sim)


_OVERRIDES = (
    "model",
    "ttft_s",
    "tokens_per_s",
    "output_tokens",
    "reasoning_tokens",
    "tool_mode",
    "auto_tool_choice",
    "leading_system_only",
    "failure",
    "fail_after_tokens",
    "seed",
    "tool_call_names",
    "tool_call_arguments",
    "tool_call_arguments_by_tool",
    "tool_call_sequence",
    "embedding_dim",
    "max_inputs",
    "prefill_tokens_per_s",
    "kv_cache_blocks",
    "kv_block_tokens",
    "max_num_seqs",
    "scheduling_policy",
    "decode_slowdown",
    "kv_events_endpoint",
    "kv_events_replay_endpoint",
    "kv_events_topic",
)


def sim_config_from_args(args: argparse.Namespace) -> SimConfig:
    """The file's ``[sim]`` table (if any) with the flags given on top.

    Raises:
        ConfigError: The file or a flag's value is invalid.
    """
    # Imported when the command runs: building the parser (``iop --help``, the
    # clients) loads no server (tests/cli/test_main.py).
    from iop.sim import SimFile

    base = load_config(args.config, SimFile).sim if args.config else SimConfig()
    flags = {k: getattr(args, k) for k in _OVERRIDES if getattr(args, k) is not None}
    if "tool_call_arguments_by_tool" in flags:
        flags["tool_call_arguments_by_tool"] = dict(
            _name_values("--tool-call-arguments-for", flags["tool_call_arguments_by_tool"])
        )
    if "tool_call_sequence" in flags:
        flags["tool_call_sequence"] = [
            {"name": name, "arguments": arguments}
            for name, arguments in _name_values("--tool-call-step", flags["tool_call_sequence"])
        ]
    if not flags:
        return base
    try:
        return msgspec.convert({**msgspec.structs.asdict(base), **flags}, SimConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid sim setting: {exc}") from exc


def _name_values(flag: str, items: list[str]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"{flag} wants NAME=JSON, got {item!r}")
        out.append((name, value))
    return out


def _cmd_sim(args: argparse.Namespace) -> int:
    cfg = sim_config_from_args(args)
    if cfg.kv_events_endpoint:
        require(Extra.KVEVENTS, "kv_events_endpoint")
    if (args.tls_certfile is None) != (args.tls_keyfile is None):
        raise ConfigError("--tls-certfile and --tls-keyfile go together")
    tls = None if args.tls_certfile is None else (args.tls_certfile, args.tls_keyfile)
    return trio.run(_serve_until_signal, cfg, args.host, args.port, tls)


async def _serve_until_signal(
    cfg: SimConfig, host: str, port: int, tls: tuple[str, str] | None = None
) -> int:
    from iop.sim import serve_sim

    async with open_stop_signals(log) as stop, trio.open_nursery() as nursery:
        url = await nursery.start(
            partial(serve_sim, cfg, host, port, shutdown_trigger=stop.drain.wait, tls=tls)
        )
        print(f"iop sim: serving model {cfg.model!r} (vLLM wire format) on {url}/v1", flush=True)
        # serve_sim returns once hypercorn has shut down after the first signal.
    log.info("stopped")
    return stop.exit_code
