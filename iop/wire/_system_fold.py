"""System messages inside a conversation, folded into the one leading system prompt.

Claude Code sends ``system``-role messages inside ``messages``, also after a
user turn (``iop/api/messages/_request.py`` keeps them in place, in order).
Many open models' chat templates accept a system message only first, and
refuse the rest: llama.cpp's server answers such a request 400 "Unable to
generate parser for this template" when its template calls
``raise_exception`` (measured with the SmolLM2 GGUF and a template that
refuses a late system message: ``tests/e2e/test_system_fold_e2e.py``);
others render a late one where it breaks tool calling. Cited in
docs/api.md, "System messages inside the conversation".

``fold_system_messages`` rewrites a conversation for such a template: one
system message first, holding the leading system messages' text and then
each later one, in order, marked with where it stood, so the model can tell
a later instruction from the original prompt::

    [system A] [user 1] [assistant 2] [system B] [user 3]
      -> [system "A\\n\\n[System message added later, after message 2 of the conversation]\\nB"]
         [user 1] [assistant 2] [user 3]

It returns None when there is nothing to fold (no system message after the
first non-system one, and at most one leading), so the common request pays
one scan and no copy. ``developer`` messages are left alone: templates that
know the role (gpt-oss's) tell it from ``system``.

The node applies it per instance (``system_messages`` in the instance's
config, default ``fold``; ``keep`` sends the conversation as it came:
``iop/node/_instances.py``, ``RunExecutor``).
"""

from __future__ import annotations

import itertools
from typing import Final

from iop.spec import Message

__all__ = ["LATER_MARK", "fold_system_messages"]

LATER_MARK: Final = "[System message added later, after message {n} of the conversation]"
"""What precedes a later system message's text in the folded prompt; ``n``
counts the conversation's non-system messages before it."""


def fold_system_messages(messages: list[Message]) -> list[Message] | None:
    """``messages`` with one leading system message, or None when they have
    at most one system message and it is first."""
    lead = 0
    while lead < len(messages) and messages[lead].role == "system":
        lead += 1
    later = any(m.role == "system" for m in itertools.islice(messages, lead, None))
    if lead <= 1 and not later:
        return None
    parts = [m.text() for m in messages[:lead]]
    rest: list[Message] = []
    for m in messages[lead:]:
        if m.role == "system":
            parts.append(f"{LATER_MARK.format(n=len(rest))}\n{m.text()}")
        else:
            rest.append(m)
    system = Message(role="system", content="\n\n".join(p for p in parts if p))
    return [system, *rest]
