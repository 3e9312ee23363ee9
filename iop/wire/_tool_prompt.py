"""The text-tool fallback: tools described in the prompt instead of the API.

When a backend refuses ``tools`` (vLLM without a tool parser), the request is
retried without them: a system message describes the tools and asks for
Hermes-style ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
output, which ``iop.wire`` parses back into tool calls at the edge. The
conversation's earlier tool traffic is rewritten as text in the same format,
because templates without tool support may reject ``tool`` roles.
"""

from __future__ import annotations

import json
from typing import Any, Final

from iop.spec import Message, Tool

__all__ = [
    "TOOL_SUPPORT_ERROR_MARKERS",
    "fallback_messages",
    "forced_tool_choice",
    "is_auto_tool_choice_error",
    "is_tool_support_error",
    "tool_prompt",
]

# vLLM's exact message: '"auto" tool choice requires --enable-auto-tool-choice
# and --tool-call-parser to be set' (docs/architecture.md, "Facts about the
# backends: vLLM").
_AUTO_TOOL_MARKERS: Final = ('"auto" tool choice requires', "--enable-auto-tool-choice")

# Messages that mean "this server cannot do tools the API way": vLLM's
# required/named-choice 400 (PR #30613), old llama.cpp without --jinja,
# Ollama's "<model> does not support tools" (docs/architecture.md, "Facts about
# the backends: Streamed tool calls").
TOOL_SUPPORT_ERROR_MARKERS: Final = (
    *_AUTO_TOOL_MARKERS,
    "requires --tool-call-parser",
    "tool_choice",
    "tool choice",
    "does not support tools",
    "tools param requires",
    "cannot use tools",
)


def is_auto_tool_choice_error(message: str) -> bool:
    """vLLM's "auto tool choice needs --enable-auto-tool-choice" 400."""
    low = message.lower()
    return any(m.lower() in low for m in _AUTO_TOOL_MARKERS)


def is_tool_support_error(message: str) -> bool:
    """Any error that says the server cannot take tools through the API."""
    low = message.lower()
    return any(m in low for m in TOOL_SUPPORT_ERROR_MARKERS)


def forced_tool_choice(tools: list[Tool] | None) -> dict[str, Any] | None:
    """The named tool choice forcing the only tool, if there is exactly one."""
    if not tools or len(tools) != 1:
        return None
    name = tools[0].function.name
    if not name:
        return None
    return {"type": "function", "function": {"name": name}}


def tool_prompt(tools: list[Tool], tool_choice: object = None) -> str:
    """The system text that describes ``tools`` and the call format."""
    specs = [
        {
            "name": t.function.name,
            "description": t.function.description or "",
            "parameters": t.function.parameters or {"type": "object", "properties": {}},
        }
        for t in tools
    ]
    lines = [
        "You can call functions. Their signatures, as JSON Schema, are inside <tools></tools>:",
        "<tools>",
        *(json.dumps(s, ensure_ascii=False) for s in specs),
        "</tools>",
        "To call a function, answer with one block per call, exactly like this:",
        '<tool_call>{"name": "<function-name>", "arguments": {<arguments as JSON>}}</tool_call>',
        "Results come back inside <tool_response></tool_response>.",
    ]
    if tool_choice == "required":
        lines.append("You must call at least one function.")
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        lines.append(f"You must call the function {tool_choice['function'].get('name')!s}.")
    elif tool_choice == "none":
        lines.append("Do not call any function in this answer.")
    return "\n".join(lines)


def fallback_messages(
    messages: list[Message], tools: list[Tool], tool_choice: object = None
) -> list[Message]:
    """The conversation rewritten for a backend that has no tool API.

    The tool description is merged into the first system message (or added
    as one), assistant tool calls become ``<tool_call>`` text and tool results
    become user turns wrapped in ``<tool_response>``.
    """
    prompt = tool_prompt(tools, tool_choice)
    out: list[Message] = []
    merged = False
    for m in messages:
        if m.role in ("system", "developer") and not merged:
            out.append(Message(role=m.role, content=f"{m.text()}\n\n{prompt}".strip()))
            merged = True
        elif m.role == "assistant" and m.tool_calls:
            calls = "\n".join(
                "<tool_call>"
                + json.dumps(
                    {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)},
                    ensure_ascii=False,
                )
                + "</tool_call>"
                for c in m.tool_calls
            )
            out.append(Message(role="assistant", content=f"{m.text()}\n{calls}".strip()))
        elif m.role in ("tool", "function"):
            out.append(
                Message(role="user", content=f"<tool_response>\n{m.text()}\n</tool_response>")
            )
        else:
            out.append(m)
    if not merged:
        out.insert(0, Message(role="system", content=prompt))
    return out


def _json_or_text(arguments: str) -> object:
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        return arguments
