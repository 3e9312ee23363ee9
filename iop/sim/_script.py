"""What the simulated model "says" for a request (sans-IO).

Theory of operation
-------------------
``build_script(request, config)`` is a pure function: the same request and
the same ``SimConfig`` always give the same ``SimScript``, byte for byte. The
randomness comes from a SplitMix64 generator seeded with ``config.seed`` and
a SHA-256 of the request's messages (never Python's salted ``hash()``), and
the text from a fixed vocabulary.

A script is a list of *steps*, one per generated token:

* ``ReasoningToken``: reasoning text, streamed before anything else;
* ``ContentToken``: answer text (a Hermes ``<tool_call>`` block printed in the
  content, in ``text`` tool mode, is content tokens too);
* ``ToolCallBegin`` then ``ToolArgs``: a native tool call, its name first,
  then its JSON arguments in fragments, as vLLM's tool parsers stream them.

Each step carries the delay before it: ``ttft_s`` for the first one,
``1 / tokens_per_s`` for the others (0 when ``tokens_per_s`` is 0). A finish
step (the end-of-sequence token vLLM streams as ``{"content": ""}``) follows
unless generation was cut by the token cap, whose last token then carries
``finish_reason: "length"``, as in vLLM.

What the model answers:

1. ``reasoning_tokens`` reasoning tokens;
2. then, if the request has tools, ``tool_mode`` is not ``none`` and
   ``tool_choice`` is not ``"none"``: a call of the named tool, else of the
   first tool, with arguments generated from the tool's JSON-schema
   ``properties`` (natively, or as Hermes text in ``text`` mode). After a
   tool result (the last message has role ``tool``) an ``auto`` choice
   answers in text instead, so that agent loops end;
3. if the request has no tools but a system prompt lists tools between
   ``<tools>`` and ``</tools>`` (the text-tool fallback's prompt), a Hermes
   ``<tool_call>`` in the content;
4. otherwise ``output_tokens`` words of text.

Scripted tool mode (``tool_call_names`` set), for driving real agents
(Codex CLI, Claude Code) through a tool round trip: when the request
declares (natively, or between ``<tools>`` tags) a tool named by
``tool_call_names`` (the first candidate it declares wins, so one config
fits agents whose shell tools have different names), the first turn calls
that tool with exactly ``tool_call_arguments_by_tool[name]`` if set, else
``tool_call_arguments`` (the JSON text as given), and
the turn after a tool result answers ``The tool said: <result>`` with the
result's first ``TOOL_RESULT_QUOTE_CHARS`` characters, so that an end-to-end
test can prove the model saw the tool's output. Everything else (tool
choice, caps, timing) works as above.

Scripted tool sequence (``tool_call_sequence`` set; it wins over
``tool_call_names``), for driving a real agent through several round trips
in one user turn: the request's *turn* is the messages after the last
assistant message that called no tool (a final answer), so the next user
turn of the same conversation plays the sequence again. A turn with N tool
calls so far (assistant messages with native calls, or with a Hermes
``<tool_call>`` in their text) calls step N's tool with exactly its
arguments, natively or as Hermes text as above; once every step has been
called, the answer quotes the last tool result as the scripted mode does. A
step whose tool the request does not declare is answered in text saying so
(an agent's run then ends, visibly). A named or ``none`` tool choice is
honoured as above.

``max_completion_tokens`` (or ``max_tokens``) caps the whole completion,
reasoning included, as vLLM does, and makes the finish reason ``length``.

Per-request overrides: ``request.extra_body["iop_sim"]`` (a mapping) replaces
fields of the ``SimConfig`` for that request, so one sim server can be driven
differently by each test or benchmark request. Invalid overrides, invalid
tool usage and tool choices refused by a server without a tool parser
(``auto_tool_choice=False``) raise ``RequestError`` with vLLM's message.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Final

import msgspec

from iop.config import SimConfig, ToolCallStep
from iop.errors import RequestError
from iop.events import FinishReason
from iop.spec import ChatRequest, Message, NamedToolChoice

__all__ = [
    "AUTO_TOOL_CHOICE_ERROR",
    "SIM_OVERRIDE_KEY",
    "TOOL_RESULT_QUOTE_CHARS",
    "ContentToken",
    "ReasoningToken",
    "ScriptToolCall",
    "SimFile",
    "SimScript",
    "Step",
    "ToolArgs",
    "ToolCallBegin",
    "apply_overrides",
    "build_script",
    "effective_config",
    "estimate_prompt_tokens",
]

SIM_OVERRIDE_KEY: Final = "iop_sim"
# The engine model's shape (iop/sim/_engine.py) and where its cache's events
# go (iop/sim/_kv_publisher.py): one per server, so no request may change
# them for itself.
SERVER_KEYS: Final = frozenset(
    {
        "kv_cache_blocks",
        "kv_block_tokens",
        "max_num_seqs",
        "scheduling_policy",
        "kv_events_endpoint",
        "kv_events_replay_endpoint",
        "kv_events_topic",
    }
)

# How much of a tool result the scripted answer quotes: enough for any
# marker a test prints, short enough to keep the answer one line.
TOOL_RESULT_QUOTE_CHARS: Final = 200

# vLLM's exact text (docs/architecture.md, "Facts about the backends: vLLM"; the
# transcript iop/testing/transcripts/vllm_400_auto_tool_choice_body.json).
AUTO_TOOL_CHOICE_ERROR: Final = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)

# Recursion bound of the argument generator: JSON schemas from a request are
# trees, but an absurdly deep one must not cost more than a few frames.
_MAX_SCHEMA_DEPTH: Final = 8

# Chat templates add a few tokens per message (role markers, separators).
_TOKENS_PER_MESSAGE: Final = 4

_VOCABULARY: Final = (
    "the", "model", "answers", "with", "a", "short", "and", "deterministic", "sentence",
    "about", "streams", "tokens", "over", "time", "every", "request", "gets", "its", "own",
    "text", "from", "fixed", "list", "of", "words", "so", "tests", "can", "compare", "bytes",
    "simulated", "backend", "runs", "quickly", "while", "clients", "read", "slowly", "queue",
    "fills", "then", "drains", "again", "node", "edge", "link", "carries", "events", "in",
    "order", "one", "terminal", "event", "ends", "each", "run", "cleanly", "under", "load",
    "latency", "stays", "low", "here",
)  # fmt: skip

# A fragment per "token": a word, a run of punctuation, or trailing blanks,
# each with its leading whitespace (like ``{"`` ``city`` ``":`` `` "`` ``Paris``).
_FRAGMENT: Final = re.compile(r"\s*(?:\w+|[^\w\s]+)|\s+")
_TOOLS_BLOCK: Final = re.compile(r"<tools>(.*?)</tools>", re.DOTALL)
_JSON_TOKEN: Final = re.compile(r"\w+|[^\w\s]")
_TOOL_RESPONSE: Final = re.compile(r"<tool_response>(.*?)</tool_response>", re.DOTALL)


class SimFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A ``iop sim --config`` file: a single ``[sim]`` table."""

    sim: SimConfig = SimConfig()


# --- steps ----------------------------------------------------------------------


class ReasoningToken(msgspec.Struct, frozen=True, tag="reasoning"):
    """One reasoning token, streamed after ``delay_s``."""

    text: str
    delay_s: float = 0.0


class ContentToken(msgspec.Struct, frozen=True, tag="content"):
    """One content token, streamed after ``delay_s``."""

    text: str
    delay_s: float = 0.0


class ToolCallBegin(msgspec.Struct, frozen=True, tag="tool_call"):
    """The start of a native tool call: its id and name."""

    id: str
    name: str
    delay_s: float = 0.0


class ToolArgs(msgspec.Struct, frozen=True, tag="tool_args"):
    """A fragment of the native tool call's JSON arguments."""

    text: str
    delay_s: float = 0.0


Step = ReasoningToken | ContentToken | ToolCallBegin | ToolArgs


class ScriptToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """The native tool call of a script, as a client reassembles it."""

    id: str
    name: str
    arguments: str


class SimScript(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the simulated model produces for one request.

    Attributes:
        completion_id: ``chatcmpl-<32 hex>``, deterministic per request.
        model: The model name echoed in responses (the request's).
        config: The effective config (with the request's overrides).
        steps: One per generated token, in order.
        finish_reason: Why generation stopped.
        finish_delay_s: Delay before the end-of-sequence step; unused when
            the token cap ended generation (the last step carries the
            finish reason then).
        prompt_tokens: Estimated prompt tokens (the engine model's count
            when it is on).
        cached_tokens: Prompt tokens the engine model found in its prefix
            cache; None when it is off (usage then has no details).
    """

    completion_id: str
    model: str
    config: SimConfig
    steps: tuple[Step, ...]
    finish_reason: FinishReason
    finish_delay_s: float
    prompt_tokens: int
    cached_tokens: int | None = None

    @property
    def capped(self) -> bool:
        """True when the token cap ended generation (no separate EOS step)."""
        return self.finish_reason is FinishReason.LENGTH and bool(self.steps)

    @property
    def completion_tokens(self) -> int:
        """Generated tokens; the end-of-sequence token counts, as in vLLM."""
        return len(self.steps) + (0 if self.capped else 1)

    @property
    def reasoning_tokens(self) -> int:
        return sum(1 for s in self.steps if isinstance(s, ReasoningToken))

    @property
    def content(self) -> str:
        return "".join(s.text for s in self.steps if isinstance(s, ContentToken))

    @property
    def reasoning(self) -> str:
        return "".join(s.text for s in self.steps if isinstance(s, ReasoningToken))

    @property
    def tool_call(self) -> ScriptToolCall | None:
        """The native tool call, with the arguments streamed before any cut."""
        begin = next((s for s in self.steps if isinstance(s, ToolCallBegin)), None)
        if begin is None:
            return None
        args = "".join(s.text for s in self.steps if isinstance(s, ToolArgs))
        return ScriptToolCall(id=begin.id, name=begin.name, arguments=args)

    @property
    def total_delay_s(self) -> float:
        """Time from request to the last byte (the non-streaming answer's latency)."""
        total = sum(s.delay_s for s in self.steps)
        return total if self.capped else total + self.finish_delay_s


# --- the generator ------------------------------------------------------------------


class _Rng:
    """SplitMix64: tiny, fast, and stable across Python versions (unlike ``random``)."""

    _MASK: Final = (1 << 64) - 1

    def __init__(self, seed: int) -> None:
        self._state = seed & self._MASK

    def next(self) -> int:
        self._state = (self._state + 0x9E3779B97F4A7C15) & self._MASK
        z = self._state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self._MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self._MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n

    def word(self) -> str:
        return _VOCABULARY[self.below(len(_VOCABULARY))]


def effective_config(request: ChatRequest, base: SimConfig) -> SimConfig:
    """``base`` with the request's ``extra_body["iop_sim"]`` overrides applied.

    Raises:
        RequestError: The overrides are not a mapping or do not validate.
    """
    return apply_overrides(request.extra_body, base)


def apply_overrides(extra_body: dict[str, Any] | None, base: SimConfig) -> SimConfig:
    """``base`` with ``extra_body["iop_sim"]`` applied (any endpoint's request).

    Raises:
        RequestError: The overrides are not a mapping or do not validate.
    """
    overrides = (extra_body or {}).get(SIM_OVERRIDE_KEY)
    if overrides is None:
        return base
    if not isinstance(overrides, dict):
        raise RequestError(f"`{SIM_OVERRIDE_KEY}` must be an object", param=SIM_OVERRIDE_KEY)
    fixed = sorted(SERVER_KEYS & overrides.keys())
    if fixed:
        raise RequestError(
            f"`{SIM_OVERRIDE_KEY}`: {', '.join(fixed)} belong to the server's engine "
            "(set them in [sim] or on the command line)",
            param=SIM_OVERRIDE_KEY,
        )
    try:
        return msgspec.convert({**msgspec.structs.asdict(base), **overrides}, SimConfig)
    except msgspec.ValidationError as exc:
        raise RequestError(f"invalid `{SIM_OVERRIDE_KEY}`: {exc}", param=SIM_OVERRIDE_KEY) from exc


def estimate_prompt_tokens(request: ChatRequest) -> int:
    """Prompt tokens, estimated as whitespace-separated words plus template overhead."""
    total = 0
    for m in request.messages:
        total += _TOKENS_PER_MESSAGE + len(m.text().split())
        for call in m.tool_calls or ():
            total += 1 + len(call.function.arguments.split())
    if request.tools:
        # Templates render tool schemas as JSON: count its words and symbols.
        total += len(_JSON_TOKEN.findall(msgspec.json.encode(request.tools).decode()))
    return total


def _digest(request: ChatRequest, seed: int) -> bytes:
    h = hashlib.sha256()
    h.update(str(seed).encode())
    h.update(b"\0")
    h.update(msgspec.json.encode(request.messages))
    return h.digest()


def _words(rng: _Rng, n: int) -> list[str]:
    """``n`` tokens of sentence-shaped text: words and a ``.`` every 6-12 tokens."""
    out: list[str] = []
    sentence_left = 6 + rng.below(7)
    start = True
    while len(out) < n:
        if sentence_left == 0 and not start:
            out.append(".")
            sentence_left = 6 + rng.below(7)
            start = True
            continue
        word = rng.word()
        if start:
            word = word.capitalize()
        out.append(word if not out else " " + word)
        sentence_left -= 1
        start = False
    return out


def _fragments(text: str) -> list[str]:
    parts = _FRAGMENT.findall(text)
    return parts if "".join(parts) == text else [text]


def _value_for(schema: Any, rng: _Rng, depth: int = 0) -> Any:
    """A deterministic value that fits a (simple) JSON schema."""
    if not isinstance(schema, dict) or depth > _MAX_SCHEMA_DEPTH:
        return rng.word()
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[rng.below(len(enum))]
    if "const" in schema:
        return schema["const"]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "integer":
        return rng.below(100)
    if kind == "number":
        return rng.below(10_000) / 100
    if kind == "boolean":
        return bool(rng.below(2))
    if kind == "null":
        return None
    if kind == "array":
        return [_value_for(schema.get("items"), rng, depth + 1)]
    if kind == "object" or isinstance(schema.get("properties"), dict):
        return _arguments_for(schema, rng, depth + 1)
    return rng.word()


def _arguments_for(parameters: Any, rng: _Rng, depth: int = 0) -> dict[str, Any]:
    if not isinstance(parameters, dict):
        return {}
    props = parameters.get("properties")
    if not isinstance(props, dict):
        return {}
    return {str(k): _value_for(v, rng, depth) for k, v in props.items()}


def _check_tool_usage(request: ChatRequest) -> None:
    """vLLM's ``check_tool_usage`` validations.

    docs/architecture.md, "Facts about the backends: vLLM".
    """
    choice = request.tool_choice
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise RequestError(
                f"Invalid value for `tool_choice`: {choice}! Only named tools, "
                '"none", "auto" or "required" are supported.',
                param="tool_choice",
            )
        if choice == "none":
            return
    if not request.tools:
        raise RequestError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in request.tool_names():
        raise RequestError(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            param="tool_choice",
        )


def _check_tool_gate(request: ChatRequest, cfg: SimConfig) -> None:
    """vLLM without ``--enable-auto-tool-choice --tool-call-parser``.

    docs/architecture.md, "Facts about the backends: vLLM".
    """
    if cfg.auto_tool_choice or not request.tools:
        return
    # Sending tools without tool_choice is tool_choice "auto" to vLLM.
    choice = request.tool_choice if request.tool_choice is not None else "auto"
    if choice == "none":
        return
    if choice == "auto":
        raise RequestError(AUTO_TOOL_CHOICE_ERROR)
    if isinstance(choice, NamedToolChoice):
        # How pydantic renders the named choice in vLLM's f-string.
        shown = (
            f"function=ChatCompletionNamedFunction(name='{choice.function.name}') type='function'"
        )
    else:
        shown = choice
    raise RequestError(f'tool_choice="{shown}" requires --tool-call-parser to be set')


def _prompt_tools(messages: list[Message]) -> list[tuple[str, Any]]:
    """Tools described between ``<tools>`` and ``</tools>`` in system prompts.

    One JSON object per line, either ``{"name", "parameters", ...}`` (IOP's
    text-tool fallback, Hermes) or ``{"type": "function", "function": {...}}``
    (Qwen's template). Lines that are not such objects are skipped.
    """
    found: list[tuple[str, Any]] = []
    for m in messages:
        if m.role not in ("system", "developer"):
            continue
        for block in _TOOLS_BLOCK.findall(m.text()):
            for line in block.splitlines():
                try:
                    spec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(spec, dict) and isinstance(spec.get("function"), dict):
                    spec = spec["function"]
                if isinstance(spec, dict) and isinstance(spec.get("name"), str) and spec["name"]:
                    found.append((spec["name"], spec.get("parameters")))
    return found


def _tool_result_text(messages: list[Message]) -> str:
    """The text of the last message, a tool result (inside the text-tool
    fallback's ``<tool_response>`` tags when it is a user turn)."""
    text = messages[-1].text() if messages else ""
    found = _TOOL_RESPONSE.search(text)
    return (found.group(1) if found else text).strip()


def _scripted_answer(messages: list[Message]) -> list[str]:
    """The scripted mode's answer to a tool result, as tokens."""
    quoted = _tool_result_text(messages)[:TOOL_RESULT_QUOTE_CHARS]
    return _fragments("The tool said: " + quoted)


def _scripted_tool(cfg: SimConfig, declared: list[str]) -> str | None:
    """The first of ``tool_call_names`` among the declared tools, if any."""
    return next((name for name in cfg.tool_call_names if name in declared), None)


def _scripted_arguments(cfg: SimConfig, name: str) -> str:
    return cfg.tool_call_arguments_by_tool.get(name, cfg.tool_call_arguments)


def _calls_a_tool(message: Message) -> bool:
    """An assistant message calling a tool, natively or as Hermes text."""
    return message.role == "assistant" and (
        bool(message.tool_calls) or "<tool_call>" in message.text()
    )


def _calls_this_turn(messages: list[Message]) -> int:
    """Assistant messages calling a tool since the last one that called none."""
    calls = 0
    for m in reversed(messages):
        if m.role != "assistant":
            continue
        if not _calls_a_tool(m):
            break
        calls += 1
    return calls


def _last_tool_result(messages: list[Message]) -> list[Message]:
    """``messages`` up to their last tool result (a text message after it, such
    as an agent's reminder, is left out), for ``_scripted_answer``."""
    for i in range(len(messages), 0, -1):
        if _after_tool_result(messages[:i]):
            return messages[:i]
    return messages


def _sequence_step(
    cfg: SimConfig, messages: list[Message], declared: list[str]
) -> ToolCallStep | list[str]:
    """The step the scripted sequence calls now, or the text it answers (tokens)."""
    calls = _calls_this_turn(messages)
    if calls >= len(cfg.tool_call_sequence):
        return _scripted_answer(_last_tool_result(messages))
    step = cfg.tool_call_sequence[calls]
    if step.name not in declared:
        return _fragments(f"The scripted tool {step.name} is not among the request's tools.")
    return step


def _after_tool_result(messages: list[Message]) -> bool:
    if not messages:
        return False
    last = messages[-1]
    if last.role in ("tool", "function"):
        return True
    # The text-tool fallback sends tool results as user turns.
    return last.role == "user" and "<tool_response>" in last.text()


def _token_cap(request: ChatRequest) -> int | None:
    cap = (
        request.max_completion_tokens
        if request.max_completion_tokens is not None
        else request.max_tokens
    )
    if cap is not None and cap < 1:
        name = (
            "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        )
        raise RequestError(f"{name} must be at least 1, got {cap}.", param=name)
    return cap


# llama.cpp's answer when the chat template raises (its 400 starts so), and
# the message templates raise (tests/e2e/test_system_fold_e2e.py).
SYSTEM_NOT_FIRST_ERROR: Final = (
    "Unable to generate parser for this template. Automatic parser generation failed: "
    "System message must be at the beginning."
)


def _check_system_first(messages: list[Message]) -> None:
    """Refuse a system message that is not the first message (``leading_system_only``)."""
    if any(m.role == "system" for m in messages[1:]):
        raise RequestError(SYSTEM_NOT_FIRST_ERROR, param="messages")


def build_script(request: ChatRequest, config: SimConfig) -> SimScript:
    """Decide, deterministically, what the simulated model answers.

    Args:
        request: The chat request.
        config: The sim's configuration; the request's ``iop_sim`` overrides
            are applied on top of it.

    Raises:
        RequestError: Invalid overrides, ``max_tokens`` below 1, invalid
            tool usage, or a tool choice the simulated server refuses
            (``auto_tool_choice=False``), with vLLM's message.
    """
    cfg = effective_config(request, config)
    cap = _token_cap(request)
    _check_tool_usage(request)
    _check_tool_gate(request, cfg)
    if cfg.leading_system_only:
        _check_system_first(request.messages)

    digest = _digest(request, cfg.seed)
    rng = _Rng(int.from_bytes(digest[:8], "big"))
    completion_id = "chatcmpl-" + digest[8:24].hex()

    steps: list[Step] = [ReasoningToken(w) for w in _words(rng, max(cfg.reasoning_tokens, 0))]
    finish = FinishReason.STOP
    tools = request.tools or []
    choice = request.tool_choice
    if (
        tools
        and cfg.tool_mode != "none"
        and choice != "none"
        and cfg.tool_call_sequence
        and not isinstance(choice, NamedToolChoice)
    ):
        step = _sequence_step(cfg, request.messages, request.tool_names())
        if isinstance(step, list):
            steps.extend(ContentToken(t) for t in step)
        else:
            native = cfg.tool_mode == "native"
            steps += _call_steps(step.name, step.arguments, digest, native=native)
            if native:
                finish = FinishReason.TOOL_CALLS
    elif tools and cfg.tool_mode != "none" and choice != "none":
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
        else:
            name = _scripted_tool(cfg, request.tool_names()) or tools[0].function.name
        tool = next(t for t in tools if t.function.name == name)
        scripted = name in cfg.tool_call_names
        forced = choice is not None and choice != "auto"
        if forced or not _after_tool_result(request.messages):
            if scripted:
                args_text = _scripted_arguments(cfg, name)
            else:
                args_text = json.dumps(
                    _arguments_for(tool.function.parameters, rng), ensure_ascii=False
                )
            native = cfg.tool_mode == "native"
            steps += _call_steps(name, args_text, digest, native=native)
            # vLLM main: "tool_calls" for auto/required, "stop" for a named
            # choice (OpenAI's behaviour; docs/architecture.md, "Facts about
            # the backends: vLLM").
            if native and not isinstance(choice, NamedToolChoice):
                finish = FinishReason.TOOL_CALLS
        elif scripted:
            steps.extend(ContentToken(t) for t in _scripted_answer(request.messages))
        else:
            steps.extend(ContentToken(w) for w in _words(rng, max(cfg.output_tokens, 0)))
    elif not tools and cfg.tool_mode != "none" and (listed := _prompt_tools(request.messages)):
        listed_names = [n for n, _ in listed]
        scripted_name = _scripted_tool(cfg, listed_names)
        if cfg.tool_call_sequence:
            step = _sequence_step(cfg, request.messages, listed_names)
            if isinstance(step, list):
                steps.extend(ContentToken(t) for t in step)
            else:
                steps += _call_steps(step.name, step.arguments, digest, native=False)
        elif _after_tool_result(request.messages):
            if scripted_name is not None:
                steps.extend(ContentToken(t) for t in _scripted_answer(request.messages))
            else:
                steps.extend(ContentToken(w) for w in _words(rng, max(cfg.output_tokens, 0)))
        elif scripted_name is not None:
            arguments = _scripted_arguments(cfg, scripted_name)
            steps += _call_steps(scripted_name, arguments, digest, native=False)
        else:
            name, parameters = listed[0]
            args = _arguments_for(parameters, rng)
            steps.extend(ContentToken(t) for t in _hermes_tokens(name, args))
    elif (structured := _structured_output(request.response_format, rng)) is not None:
        steps.extend(ContentToken(t) for t in _fragments(structured))
    else:
        steps.extend(ContentToken(w) for w in _words(rng, max(cfg.output_tokens, 0)))

    if cap is not None and len(steps) > cap:
        steps = steps[:cap]
        finish = FinishReason.LENGTH

    inter_token_s = 1.0 / cfg.tokens_per_s if cfg.tokens_per_s > 0 else 0.0
    timed: list[Step] = [
        msgspec.structs.replace(s, delay_s=cfg.ttft_s if i == 0 else inter_token_s)
        for i, s in enumerate(steps)
    ]
    return SimScript(
        completion_id=completion_id,
        model=request.model,
        config=cfg,
        steps=tuple(timed),
        finish_reason=finish,
        finish_delay_s=inter_token_s if timed else cfg.ttft_s,
        prompt_tokens=estimate_prompt_tokens(request),
    )


def _structured_output(response_format: dict[str, Any] | None, rng: _Rng) -> str | None:
    """The answer to a ``response_format`` that asks for JSON, as guided decoding
    would constrain it: an object of the schema's properties (``json_schema``),
    or an object (``json_object``); None for text."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        return json.dumps(_arguments_for(schema, rng), ensure_ascii=False)
    if kind == "json_object":
        return json.dumps({"answer": " ".join(_words(rng, 3))}, ensure_ascii=False)
    return None


def _call_steps(name: str, arguments: str, digest: bytes, *, native: bool) -> list[Step]:
    """One call of ``name`` with exactly ``arguments`` (a JSON object): vLLM's
    native tool-call deltas, or Hermes ``<tool_call>`` text."""
    if not native:
        return [ContentToken(t) for t in _hermes_tokens(name, json.loads(arguments))]
    call_id = "chatcmpl-tool-" + hashlib.sha256(digest + b"tool").hexdigest()[:32]
    return [ToolCallBegin(call_id, name), *(ToolArgs(f) for f in _fragments(arguments))]


def _hermes_tokens(name: str, args: dict[str, Any]) -> list[str]:
    """A Hermes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` as tokens."""
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return ["<tool_call>", *_fragments(body), "</tool_call>"]
