"""Tool calling, reasoning, content parts, loss weights and mask_history on the tiny byte-level tokenizer."""

import json
from pathlib import Path

import pytest

from raylora.data.encode import IGNORE_INDEX, Encoder, tokenizer_spec
from raylora.data.formats import Conversation, RowError, to_conversation
from raylora.model_files import tiny_tokenizer
from raylora.templates import hermes_tool_call, hermes_tools

DATA = Path(__file__).resolve().parents[2] / "data"
# A Qwen2.5-style template that renders tools, tool calls, tool turns and reasoning_content itself.
TOOLS_TEMPLATE = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- '# Tools\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}
        {{- message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for call in message.tool_calls %}
            {{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
            {{- call.function.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>tool\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
WEATHER = {"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object"}}
GLAIVE = {
    "system": "Be brief.",
    "conversations": [
        {"from": "human", "value": "Weather in Paris and Oslo?"},
        {
            "from": "function_call",
            "value": json.dumps([{"name": "get_weather", "arguments": {"city": c}} for c in ("Paris", "Oslo")]),
        },
        {"from": "observation", "value": '{"temp": 21}'},
        {"from": "observation", "value": '{"temp": -3}'},
        {"from": "gpt", "value": "Paris 21, Oslo -3."},
    ],
    "tools": json.dumps([WEATHER]),
}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def native():
    tok = tiny_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def encoder(tok, train_on_prompt=False, cutoff=4096):
    return Encoder(tokenizer_spec(tok, "auto"), cutoff, "tail", train_on_prompt)


def split(tok, conversation, enc=None):
    """(whole text, learned text, ignored text) of one encoded conversation."""
    (e,) = (enc or encoder(tok)).encode_many([conversation])
    assert not isinstance(e, RowError), e
    keep = [lab != IGNORE_INDEX for lab in e.labels]
    learned = tok.decode([i for i, k in zip(e.input_ids, keep, strict=True) if k])
    ignored = tok.decode([i for i, k in zip(e.input_ids, keep, strict=True) if not k])
    return tok.decode(e.input_ids), learned, ignored


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# formats


def test_glaive_tools_and_function_calls_become_tool_calls_and_tool_turns():
    c = to_conversation(GLAIVE, "sharegpt", {}, {})
    assert c.tools == [{"type": "function", "function": WEATHER}]
    assert c.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", city="Paris"), call("get_weather", city="Oslo")]},
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": '{"temp": -3}'},
        {"role": "assistant", "content": "Paris 21, Oslo -3."},
    ]  # fmt: skip


def test_openai_tool_calls_with_json_string_arguments_and_openai_schemas():
    row = {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"a": 1}'}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."},
        ],
        "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}],
    }
    c = to_conversation(row, "openai", {}, {})
    assert c.messages[1] == {"role": "assistant", "content": "", "tool_calls": [call("w", a=1)]}
    assert c.tools == [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]


def test_v1_parts_with_value_text_reasoning_tool_call_and_loss_weight():
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "value": "He"}, {"type": "text", "text": "llo"}], "loss_weight": 0.0},
            {"role": "assistant", "content": [
                {"type": "reasoning", "value": "think"}, {"type": "text", "value": "Hi"},
                {"type": "tool_call", "value": '{"name": "t", "arguments": {}}'}], "loss_weight": 1},
            {"role": "tool", "content": [{"type": "text", "value": "done"}]},
            {"role": "assistant", "reasoning_content": "why", "content": "Bye", "loss_weight": 0},
        ]
    }  # fmt: skip
    assert to_conversation(row, "openai", {}, {}).messages == [
        {"role": "user", "content": "Hello", "loss_weight": 0.0},
        {"role": "assistant", "content": "Hi", "reasoning": "think", "tool_calls": [call("t")], "loss_weight": 1.0},
        {"role": "tool", "content": "done"},
        {"role": "assistant", "content": "Bye", "reasoning": "why", "loss_weight": 0.0},
    ]
    dropped = to_conversation(row, "openai", {}, {}, drop_reasoning=True).messages
    assert not any("reasoning" in m for m in dropped)


def test_mask_history_from_the_config_and_from_the_row():
    row = {"conversations": [{"from": f, "value": v} for f, v in
           (("human", "a"), ("gpt", "b"), ("human", "c"), ("gpt", "d"))]}  # fmt: skip
    assert [m.get("loss_weight") for m in to_conversation(row, "sharegpt", {}, {}).messages] == [None] * 4
    masked = to_conversation(row, "sharegpt", {}, {}, mask_history=True).messages
    assert [m.get("loss_weight") for m in masked] == [None, 0.0, None, None]
    assert to_conversation({**row, "mask_history": True}, "sharegpt", {}, {}).messages == masked
    assert to_conversation({**row, "mask_history": False}, "sharegpt", {}, {}, mask_history=True).messages[1] == {
        "role": "assistant",
        "content": "b",
    }


def test_alpaca_rows_take_a_tools_column_too():
    row = {"instruction": "Weather?", "output": "Sunny.", "functions": [WEATHER]}
    assert to_conversation(row, "alpaca", {"tools": "functions"}, {}).tools == [
        {"type": "function", "function": WEATHER}
    ]


def turns(*turns, **extra):
    return {"messages": [{"role": "user", "content": "q"}, *turns], **extra}


@pytest.mark.parametrize(
    "row,fmt,reason",
    [
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "{'name': 'w'}"}]},
         "sharegpt", "the function_call turn 1 is not valid JSON"),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": '{"arguments": {}}'}]},
         "sharegpt", "is not a tool call: expected {name, arguments}"),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": '{"name": "w", "arguments": "{x"}'}]},
         "sharegpt", "the arguments of w are not valid JSON"),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": '{"name": "w", "arguments": [1]}'}]},
         "sharegpt", "the arguments of w must be an object, got list"),
        (turns({"role": "assistant", "content": "a"}, tools="[{"), "openai", "field 'tools' is not valid JSON"),
        (turns({"role": "assistant", "content": "a"}, tools={"name": "w"}), "openai",
         "field 'tools' is a dict, expected a list of function schemas"),
        (turns({"role": "assistant", "content": "a"}, tools=[{"description": "no name"}]), "openai",
         "tools\\[0\\] is not a function schema"),
        (turns({"role": "assistant", "content": [{"type": "image_url", "value": "x.png"}]}), "openai",
         "content part type 'image_url' is not supported"),
        (turns({"role": "assistant", "content": [{"type": "audio", "value": "x.wav"}]}), "openai",
         "content part type 'audio' is not supported"),
        (turns({"role": "assistant", "content": [{"type": "text"}]}), "openai", "a text part has no string"),
        ({"messages": [{"role": "user", "content": [{"type": "reasoning", "value": "r"}]}, {"role": "assistant", "content": "a"}]},
         "openai", "a user turn has a reasoning part"),
        (turns({"role": "assistant", "content": "a", "loss_weight": 1.5}), "openai", "loss_weight must be a number in \\[0, 1\\], got 1.5"),
        (turns({"role": "assistant", "content": "a", "loss_weight": -1}), "openai", "got -1"),
        (turns({"role": "assistant", "content": "a", "loss_weight": "1"}), "openai", "got '1'"),
        (turns({"role": "assistant", "content": "a", "loss_weight": 0.5}), "openai",
         "loss_weight 0.5 is between 0 and 1; only 0 \\(not learned\\) and 1 \\(learned\\)"),
        (turns({"role": "assistant", "content": "a"}, mask_history="yes"), "openai", "field 'mask_history' is str"),
        (turns({"role": "assistant", "content": None}), "openai", "empty response"),
    ],
)  # fmt: skip
def test_bad_tool_reasoning_and_weight_rows_say_why(row, fmt, reason):
    with pytest.raises(RowError, match=reason):
        to_conversation(row, fmt, {}, {})


# rendering and masks: the fallback (a template that knows no tools) ...


def test_fallback_puts_schemas_in_the_system_prompt_and_learns_exactly_the_calls_and_answers(tok):
    c = to_conversation(GLAIVE, "sharegpt", {}, {})
    enc = encoder(tok)
    assert not enc.native_tools and enc.reasoning_field is None
    calls = "\n".join(hermes_tool_call(x) for x in c.messages[2]["tool_calls"])
    expected = [
        {"role": "system", "content": "Be brief.\n\n" + hermes_tools(c.tools)},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": calls},
        {"role": "user", "content": '<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\n{"temp": -3}\n</tool_response>'},
        {"role": "assistant", "content": "Paris 21, Oslo -3."},
    ]  # fmt: skip
    whole, learned, ignored = split(tok, c)
    assert whole == tok.apply_chat_template(expected, tokenize=False)
    assert learned == calls + "<|im_end|>\nParis 21, Oslo -3.<|im_end|>\n"
    assert json.dumps(c.tools[0]) in ignored and '{"temp": 21}' in ignored
    assert calls == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )


def test_fallback_adds_a_system_turn_when_the_row_has_none_and_keeps_text_before_calls(tok):
    row = turns(
        {"role": "assistant", "content": "Checking.", "tool_calls": [{"name": "get_weather", "arguments": {}}]},
        {"role": "tool", "content": "ok"},
        {"role": "assistant", "content": "Done."},
        tools=[WEATHER],
    )
    whole, learned, _ = split(tok, to_conversation(row, "openai", {}, {}))
    assert whole.startswith("<|im_start|>system\n# Tools\n")
    assert learned == (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call><|im_end|>\nDone.<|im_end|>\n'
    )


def test_reasoning_goes_before_the_answer_in_think_tags_or_is_dropped(tok):
    row = turns(
        {"role": "assistant", "content": [{"type": "reasoning", "value": "7*13"}, {"type": "text", "value": "No."}]}
    )
    _, learned, _ = split(tok, to_conversation(row, "openai", {}, {}))
    assert learned == "<think>\n7*13\n</think>\n\nNo.<|im_end|>\n"
    _, learned, _ = split(tok, to_conversation(row, "openai", {}, {}, drop_reasoning=True))
    assert learned == "No.<|im_end|>\n"


# ... and a template that renders tools and reasoning itself


def test_a_template_with_tools_gets_them_as_tools_tool_calls_and_tool_turns(native):
    c = to_conversation(GLAIVE, "sharegpt", {}, {})
    enc = encoder(native)
    assert enc.native_tools and enc.reasoning_field == "reasoning_content"
    whole, learned, ignored = split(native, c, enc)
    assert whole == native.apply_chat_template(c.messages, tools=c.tools, tokenize=False)
    assert learned == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
        "Paris 21, Oslo -3.<|im_end|>\n"
    )
    assert json.dumps(c.tools[0]) in ignored and '<|im_start|>tool\n{"temp": -3}<|im_end|>' in ignored


def test_a_template_with_a_reasoning_field_gets_the_reasoning_there(native):
    row = turns({"role": "assistant", "content": [{"type": "reasoning", "value": "r"}, {"type": "text", "value": "a"}]})
    c = to_conversation(row, "openai", {}, {})
    whole, learned, _ = split(native, c)
    view = [c.messages[0], {"role": "assistant", "content": "a", "reasoning_content": "r"}]
    assert whole == native.apply_chat_template(view, tokenize=False)
    assert learned == "<think>\nr\n</think>\n\na<|im_end|>\n"


# loss weights


def test_loss_weights_choose_the_learned_turns(tok):
    row = {
        "messages": [
            {"role": "user", "content": "q1", "loss_weight": 1},
            {"role": "assistant", "content": "a1", "loss_weight": 0},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2"},
        ]
    }
    whole, learned, _ = split(tok, to_conversation(row, "openai", {}, {}))
    assert whole == tok.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in row["messages"]], tokenize=False
    )
    assert learned == "<|im_start|>user\nq1<|im_end|>\na2<|im_end|>\n"
    _, learned, _ = split(tok, to_conversation(row, "openai", {}, {}, mask_history=True))
    assert learned == "a2<|im_end|>\n"


def test_a_row_with_nothing_to_learn_is_rejected(tok):
    row = turns({"role": "assistant", "content": "a", "loss_weight": 0})
    (e,) = encoder(tok).encode_many([to_conversation(row, "openai", {}, {})])
    assert isinstance(e, RowError) and str(e) == "nothing to learn: every turn has loss_weight 0"
    openai_style = turns({"role": "assistant", "content": "a", "weight": 0})  # OpenAI fine-tuning's name for it
    (e,) = encoder(tok).encode_many([to_conversation(openai_style, "openai", {}, {})])
    assert isinstance(e, RowError) and str(e) == "nothing to learn: every turn has loss_weight 0"
    (e,) = encoder(tok, train_on_prompt=True).encode_many([to_conversation(row, "openai", {}, {})])
    assert not isinstance(e, RowError)


def test_a_template_that_refuses_a_conversation_rejects_the_row_not_the_batch(tok):
    strict = tiny_tokenizer()
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool turns') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    enc = encoder(strict)
    enc.native_tools = True  # as if the template claimed tools, to reach its refusal
    ok = Conversation([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
    bad = Conversation([*ok.messages, {"role": "tool", "content": "r"}, {"role": "assistant", "content": "b"}])
    results = enc.encode_many([ok, bad])
    assert not isinstance(results[0], RowError)
    assert str(results[1]) == "the tokenizer chat template refuses this conversation: no tool turns"


# the shipped samples


@pytest.mark.parametrize(
    "name", ["glaive_toolcall_demo.json", "openai_tools_demo.jsonl", "v1_parts_demo.jsonl", "reasoning_demo.jsonl",
             "mask_history_demo.jsonl"],
)  # fmt: skip
def test_every_shipped_sample_row_encodes_with_both_templates(tok, native, name):
    from raylora.data.formats import detect_format
    from raylora.data.read import iter_raw

    path = DATA / name
    with path.open("rb") as f:
        rows = [json.loads(raw) for _, raw, _ in iter_raw(f, str(path))]
    assert len(rows) >= 2
    conversations = [to_conversation(r, detect_format(r), {}, {}) for r in rows]
    for t in (tok, native):
        for c in conversations:
            whole, learned, _ = split(t, c)
            answer = [m for m in c.messages if m["role"] == "assistant"][-1]["content"] + "<|im_end|>\n"
            assert learned.endswith(answer) and whole.endswith(answer)
