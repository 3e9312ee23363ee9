"""``fold_system_messages``: one leading system prompt, later ones marked, order kept."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from iop.spec import Message, TextPart
from iop.wire._system_fold import LATER_MARK, fold_system_messages


def sys_(text: str) -> Message:
    return Message(role="system", content=text)


def user(text: str) -> Message:
    return Message(role="user", content=text)


def assistant(text: str) -> Message:
    return Message(role="assistant", content=text)


def test_a_conversation_with_one_leading_system_message_is_left_as_it_is() -> None:
    assert fold_system_messages([sys_("A"), user("1"), assistant("2")]) is None
    assert fold_system_messages([user("1"), assistant("2")]) is None
    assert fold_system_messages([]) is None


def test_claude_codes_later_system_message_joins_the_leading_one_marked() -> None:
    folded = fold_system_messages([sys_("A"), user("1"), assistant("2"), sys_("B"), user("3")])
    assert folded == [
        sys_("A\n\n" + LATER_MARK.format(n=2) + "\nB"),
        user("1"),
        assistant("2"),
        user("3"),
    ]
    assert "after message 2 of the conversation" in LATER_MARK.format(n=2)


def test_two_leading_system_messages_become_one() -> None:
    assert fold_system_messages([sys_("A"), sys_("B"), user("1")]) == [
        sys_("A\n\nB"),
        user("1"),
    ]


def test_a_later_system_message_without_a_leading_one_becomes_the_first() -> None:
    assert fold_system_messages([user("1"), sys_("B")]) == [
        sys_(LATER_MARK.format(n=1) + "\nB"),
        user("1"),
    ]


def test_text_parts_are_folded_as_their_text_and_developer_stays_in_place() -> None:
    parts = Message(role="system", content=[TextPart(text="x"), TextPart(text="y")])
    dev = Message(role="developer", content="D")
    assert fold_system_messages([sys_("A"), dev, user("1"), parts]) == [
        sys_("A\n\n" + LATER_MARK.format(n=2) + "\nxy"),
        dev,
        user("1"),
    ]


ROLES = st.sampled_from(["system", "user", "assistant", "developer", "tool"])
CONVERSATIONS = st.lists(
    st.builds(lambda r, t: Message(role=r, content=t), ROLES, st.text(max_size=8)),
    max_size=12,
)


@given(CONVERSATIONS)
def test_folding_keeps_every_other_message_in_order_and_every_system_text(
    messages: list[Message],
) -> None:
    folded = fold_system_messages(messages)
    systems = [m for m in messages if m.role == "system"]
    others = [m for m in messages if m.role != "system"]
    if folded is None:
        # Nothing to fold: at most one system message, and it is first.
        assert len(systems) <= 1
        assert not systems or messages[0].role == "system"
        return
    assert folded[0].role == "system"
    assert folded[1:] == others
    prompt = folded[0].text()
    at = 0
    for m in systems:
        found = prompt.find(m.text(), at)
        assert found >= 0
        at = found + len(m.text())
    # Folding what was folded changes nothing.
    assert fold_system_messages(folded) is None
