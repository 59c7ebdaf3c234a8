import pytest

from raylora.data.formats import RowError, detect_format, fill, to_conversation, to_messages


def msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def test_alpaca_with_system_input_and_history():
    row = {
        "system": "Be brief.",
        "instruction": "And 3+3?",
        "input": "quick",
        "output": "6",
        "history": [["1+1?", "2"]],
    }
    assert to_messages(row, "alpaca", {}, {}) == msgs(
        ("system", "Be brief."), ("user", "1+1?"), ("assistant", "2"), ("user", "And 3+3?\n\nquick"), ("assistant", "6")
    )


def test_alpaca_column_mapping():
    row = {"prompt": "Hi", "response": "Hello"}
    assert to_messages(row, "alpaca", {"instruction": "prompt", "output": "response"}, {}) == msgs(
        ("user", "Hi"), ("assistant", "Hello")
    )


def test_sharegpt_with_system_tool_call_and_result():
    row = {
        "system": "You can call tools.",
        "conversations": [
            {"from": "human", "value": "Weather in Paris?"},
            {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Paris"}}'},
            {"from": "observation", "value": '{"temp": 21}'},
            {"from": "gpt", "value": "It is 21 °C."},
        ],
    }
    assert [m["role"] for m in to_messages(row, "sharegpt", {}, {})] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]


def test_sharegpt_custom_role_tags():
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    columns = {
        "messages": "messages",
        "role_tag": "role",
        "content_tag": "content",
        "user_tag": "user",
        "assistant_tag": "assistant",
    }
    assert to_messages(row, "sharegpt", columns, {}) == msgs(("user", "a"), ("assistant", "b"))


def test_openai_messages_with_text_parts():
    row = {
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "llo"}]},
            {"role": "assistant", "content": "hi"},
        ]
    }
    assert to_messages(row, "openai", {}, {}) == msgs(("system", "s"), ("user", "hello"), ("assistant", "hi"))


def test_openai_fine_tuning_weight_marks_assistant_turns_not_learned():
    """Found by use: OpenAI's per-message ``weight: 0`` was dropped, and the excluded answer was trained."""
    turns = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "bad", "weight": 0},
             {"role": "user", "content": "q2"}, {"role": "assistant", "content": "good", "weight": 1}]  # fmt: skip
    got = to_messages({"messages": turns}, "openai", {}, {})
    assert [m.get("loss_weight") for m in got] == [None, 0.0, None, 1.0]
    slimorca = {
        "conversations": [{"from": "human", "value": "q", "weight": 0.0}, {"from": "gpt", "value": "a", "weight": 1.0}]
    }
    assert [m.get("loss_weight") for m in to_messages(slimorca, "sharegpt", {}, {})] == [0.0, 1.0]  # rejected by review
    developer = to_messages({"messages": [{"role": "developer", "content": "be brief"}, *turns]}, "openai", {}, {})
    assert developer[0] == {"role": "system", "content": "be brief"}  # OpenAI's newer name for the system prompt


def test_a_chosen_answer_mapped_as_the_output_is_not_a_preference_row():
    row = {"prompt": "q", "chosen": "good", "rejected": "bad"}
    got = to_messages(row, "alpaca", {"instruction": "prompt", "output": "chosen"}, {})
    assert got == msgs(("user", "q"), ("assistant", "good"))
    assert to_messages({"instruction": "q", "output": "a", "chosen": True}, "alpaca", {}, {})  # a flag, not a pair


def test_text_rows():
    assert to_messages({"text": "Once upon a time"}, "text", {}, {}) == msgs(("text", "Once upon a time"))


@pytest.mark.parametrize(
    "row,fmt,reason",
    [
        ({"instruction": "hi"}, "alpaca", "field 'output' is missing, expected a string"),
        ({"instruction": 3, "output": "x"}, "alpaca", "field 'instruction' is int, expected a string"),
        ({"instruction": "hi", "output": "   "}, "alpaca", "empty response"),
        ({"instruction": "hi", "output": "x", "input": ["a"]}, "alpaca", "field 'input' is list, expected a string"),
        (
            {"instruction": "hi", "output": "x", "history": [["only one"]]},
            "alpaca",
            "list of \\[prompt, response\\] string pairs",
        ),
        (["not", "an", "object"], "alpaca", "row is a list, not an object"),
        ({"instruction": "hi", "output": "I am {{name}}"}, "alpaca", "placeholder \\{\\{name\\}\\} has no value"),
        (
            {"conversations": [{"from": "human", "value": "a"}, {"from": "robot", "value": "b"}]},
            "sharegpt",
            "unknown role 'robot'",
        ),
        ({"conversations": [{"from": "human", "value": "a"}]}, "sharegpt", "no assistant turn"),
        ({"conversations": []}, "sharegpt", "not a non-empty list"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]},
            "openai",
            "unknown role 'bot'",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 5}]},
            "openai",
            "content of a assistant turn is int",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "b"}]},
            "openai",
            "content part type 'image' is not supported",
        ),
        ({"text": ""}, "text", "empty text"),
        (  # LLaMA-Factory's ranking sharegpt row: its prompt alone was trained as SFT before
            {
                "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
                "chosen": {"from": "gpt", "value": "good"},
                "rejected": {"from": "gpt", "value": "bad"},
            },
            "sharegpt",
            "a preference row",
        ),  # fmt: skip
    ],
)
def test_bad_rows_say_why(row, fmt, reason):
    with pytest.raises(RowError, match=reason):
        to_messages(row, fmt, {}, {})


def test_placeholders_are_filled():
    assert fill("I am {{name}} by {{ author }}.", {"name": "Ray", "author": "us"}) == "I am Ray by us."
    row = {"instruction": "Who?", "output": "{{name}}"}
    assert to_messages(row, "alpaca", {}, {"name": "Ray"})[-1]["content"] == "Ray"
    # found by use: left literal inside tool calls and tool schemas, and so learned as "{{name}}"
    call = {
        "role": "assistant",
        "tool_calls": [{"type": "function", "function": {"name": "sign", "arguments": {"by": "{{name}}"}}}],
    }
    tools = [{"type": "function", "function": {"name": "sign", "description": "signs for {{name}}", "parameters": {}}}]
    conversation = to_conversation(
        {"messages": [{"role": "user", "content": "sign"}, call], "tools": tools}, "openai", {}, {"name": "Ray"}
    )
    assert conversation.messages[-1]["tool_calls"][0]["function"]["arguments"] == {"by": "Ray"}
    assert conversation.tools[0]["function"]["description"] == "signs for Ray"
    with pytest.raises(RowError, match="placeholder"):
        to_conversation({"messages": [{"role": "user", "content": "sign"}, call]}, "openai", {}, {})


@pytest.mark.parametrize(
    "row,fmt",
    [({"instruction": "a", "output": "b"}, "alpaca"), ({"conversations": []}, "sharegpt"), ({"messages": []}, "openai"),
     ({"text": "x"}, "text"), ({"foo": 1}, None), ([1], None)],
)  # fmt: skip
def test_format_detection(row, fmt):
    assert detect_format(row) == fmt


def test_sharegpt_system_turn_wins_over_the_system_column():
    """Found by use: both were rendered, two system messages in one conversation."""
    turns = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]
    same = {"system": "Be brief.", "conversations": turns}
    assert to_messages(same, "sharegpt", {}, {}) == msgs(("system", "Be brief."), ("user", "a"), ("assistant", "b"))
    other = {**same, "system": "Be long."}  # the turn wins, as LLaMA-Factory reads it
    assert to_messages(other, "sharegpt", {}, {}) == msgs(("system", "Be brief."), ("user", "a"), ("assistant", "b"))
