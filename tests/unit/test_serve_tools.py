import json

import pytest

from raylora.serve.tools import CallStream, split_calls
from raylora.templates import hermes_tool_call

NAMES = {"get_weather", "get_time"}


def _call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _plain(calls: list[dict]) -> list[tuple[str, dict]]:
    """``(name, arguments)`` of OpenAI-shaped calls, each with a fresh ``call_`` id."""
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_hermes_calls_as_the_fallback_template_teaches_them():
    one = hermes_tool_call(_call("get_weather", city="Oslo"))
    two = hermes_tool_call(_call("get_time", zone="Europe/Oslo"))
    assert _plain(split_calls(one, NAMES)[1]) == [("get_weather", {"city": "Oslo"})]
    content, calls = split_calls(f"Let me check.\n{one}\n{two}", NAMES)
    assert content == "Let me check.\n" and _plain(calls) == [("get_weather", {"city": "Oslo"}),
                                                               ("get_time", {"zone": "Europe/Oslo"})]  # fmt: skip
    assert split_calls(one, NAMES)[0] is None
    # a model stopped by its end token right after the JSON, before the closing tag
    assert _plain(split_calls('<tool_call>\n{"name": "get_time", "arguments": {}}', NAMES)[1]) == [("get_time", {})]
    assert _plain(
        split_calls('<tool_call>{"name": "get_time", "arguments": "{\\"a\\": 1}"}</tool_call>', NAMES)[1]
    ) == [("get_time", {"a": 1})]


def test_bare_json_calls_as_llama_templates_teach_them():
    assert _plain(split_calls('{"name": "get_weather", "parameters": {"city": "Rome"}}', NAMES)[1]) == [
        ("get_weather", {"city": "Rome"})
    ]
    both = json.dumps([{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "A"}}])
    assert [n for n, _ in _plain(split_calls(both, NAMES)[1])] == ["get_time", "get_weather"]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        '{"name": "Ada", "arguments": {"born": 1815}}',  # JSON for the user: not a function of the request
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
        "[]",
        "",
        # found by use: a call of a function the request does not declare came back as a call (few-shot history)
        '<tool_call>\n{"name": "get_forecast", "arguments": {"city": "Paris"}}\n</tool_call>',
    ],
)
def test_anything_else_stays_text(text):
    assert split_calls(text, NAMES) == (text, [])


def _stream(text: str, step: int) -> tuple[list[str], str, list[dict]]:
    stream = CallStream(NAMES)
    sent = [stream.feed(text[i : i + step]) for i in range(0, len(text), step)]
    rest, calls = stream.finish()
    return sent, rest, calls


@pytest.mark.parametrize("step", [1, 3, 50])
@pytest.mark.parametrize(
    "text",
    [
        "Plain answer, no call at all.",
        "Check <toolbox> and <tool_cal x.",  # tags that only begin like a call go out in full
        "Sure.\n" + hermes_tool_call(_call("get_weather", city="Oslo")),
        hermes_tool_call(_call("get_time")) + "\n" + hermes_tool_call(_call("get_weather", city="B")),
        '{"name": "get_weather", "parameters": {"city": "Rome"}}',
        '{"answer": 42}',
        "Hmm <tool_call>{broken",
        "  \n",
        "\n\n" + hermes_tool_call(_call("get_weather", city="Paris")),  # found by use: the blank went out as content
    ],
)
def test_a_streamed_answer_sends_exactly_what_the_whole_answer_gives(text, step):
    sent, rest, calls = _stream(text, step)
    content, expected = split_calls(text, NAMES)
    assert "".join(sent) + rest == (content or "")
    assert _plain(calls) == _plain(expected)
    if "<tool_call>" in text and expected:  # no piece of a call's markup reaches the client as text
        assert "<" not in "".join(sent) + rest


def test_text_before_a_call_goes_out_as_it_comes():
    sent, rest, calls = _stream("Let me look that up for you. " + hermes_tool_call(_call("get_time")), 5)
    assert sent[:2] == ["Let m", "e loo"] and "".join(sent) == "Let me look that up for you. "
    assert rest == "" and _plain(calls) == [("get_time", {})]
