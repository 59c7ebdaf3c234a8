import pytest

from raylora.data.alpaca import RowError, fill, to_messages
from raylora.data.encode import IGNORE_INDEX, encode_messages
from raylora.models import tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def learned_text(tok, encoded):
    return tok.decode(
        [i for i, lab in zip(encoded["input_ids"], encoded["labels"], strict=True) if lab != IGNORE_INDEX]
    )


def test_alpaca_row_becomes_messages_with_input_and_system():
    row = {"system": "Be brief.", "instruction": "Translate.", "input": "Bonjour", "output": "Hello"}
    assert to_messages(row, {}) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Translate.\n\nBonjour"},
        {"role": "assistant", "content": "Hello"},
    ]


def test_history_turns_come_first():
    row = {"instruction": "And 3+3?", "output": "6", "history": [["1+1?", "2"]]}
    roles = [m["role"] for m in to_messages(row, {})]
    assert roles == ["user", "assistant", "user", "assistant"]


@pytest.mark.parametrize(
    "row,reason",
    [
        ({"instruction": "hi"}, "'output' is missing"),
        ({"instruction": 3, "output": "x"}, "'instruction' is missing or not a string"),
        ({"instruction": "hi", "output": "   "}, "empty response"),
        ({"instruction": "hi", "output": "x", "input": ["a"]}, "'input' is not a string"),
        ({"instruction": "hi", "output": "x", "history": [["only one"]]}, "'history' must be"),
        (["not", "an", "object"], "row is a list"),
        ({"instruction": "hi", "output": "I am {{name}}"}, "placeholder {{name}} has no value"),
    ],
)
def test_bad_rows_say_why(row, reason):
    with pytest.raises(RowError, match=reason.replace("{", r"\{").replace("}", r"\}").replace("'", "'")):
        to_messages(row, {})


def test_placeholders_are_filled():
    assert fill("I am {{name}} by {{ author }}.", {"name": "Ray", "author": "us"}) == "I am Ray by us."


def test_only_assistant_turns_are_learned(tok):
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    encoded = encode_messages(tok, messages, cutoff_len=1024)
    full = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(encoded["input_ids"]) == full
    assert len(encoded["labels"]) == len(encoded["input_ids"])
    assert learned_text(tok, encoded) == "a1<|im_end|>\na2<|im_end|>\n"


def test_truncation_that_removes_every_answer_is_a_reject(tok):
    messages = [{"role": "user", "content": "x" * 50}, {"role": "assistant", "content": "y"}]
    with pytest.raises(RowError, match="cutoff_len=20"):
        encode_messages(tok, messages, cutoff_len=20)
    assert len(encode_messages(tok, messages, cutoff_len=70)["input_ids"]) == 70
