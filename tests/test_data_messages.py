"""The one check of a chat message (data/messages.py): accepted roles, text a tokenizer can encode."""
import pytest

from specheads.data.messages import OPENAI_ROLES, FieldError, check_message, lone_surrogate


@pytest.mark.parametrize("text, at", [
    ("plain ascii", -1), ("caf\u00e9 \U0001F600", -1), ("a\ud800b", 1), ("\udfff", 0),
    ("\ude00\ud83d", 0),  # both halves, in the wrong order: neither is part of a pair
])
def test_lone_surrogate_position(text, at):
    assert lone_surrogate(text) == at


def test_check_message_names_the_field_and_the_character():
    with pytest.raises(FieldError) as err:
        check_message({"role": "user", "content": [{"type": "text", "text": "ok"},
                                                   {"type": "text", "text": "x\ud800"}]}, "messages[3]")
    assert err.value.field == "messages[3].content[1].text"
    assert err.value.problem.startswith("lone surrogate U+D800 at position 1 (counting from 0)")


@pytest.mark.parametrize("role", ["wizard", "User", None, 3])
def test_check_message_refuses_a_role_outside_openais(role):
    with pytest.raises(FieldError) as err:
        check_message({"role": role, "content": "hi"}, "messages[0]")
    assert err.value.field == "messages[0].role"
    assert err.value.problem == f"unknown role {role!r}; expected one of system, developer, user, assistant, tool"


@pytest.mark.parametrize("role", OPENAI_ROLES)
def test_check_message_accepts_openais_roles(role):
    check_message({"role": role, "content": "smile \U0001F600", "name": "f", "tool_calls": None}, "messages[0]")


def test_deep_nesting_is_walked_without_recursion():
    deep = "\ud800"
    for _ in range(2000):
        deep = [deep]
    with pytest.raises(FieldError) as err:
        check_message({"role": "user", "content": "hi", "extra": deep}, "messages[0]")
    assert err.value.field == "messages[0].extra" + "[0]" * 2000
