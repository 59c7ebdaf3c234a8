import pickle

import pytest

from raylora.serve.protocol import ApiError, chunk, parse_body, parse_chat, parse_completion, response, usage

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_a_full_chat_request_parses():
    gen = parse_chat({**CHAT, "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                      "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "stop": "x", "seed": 3, "stream": True,
                      "stream_options": {"include_usage": True}, "n": 1, "frequency_penalty": 0, "user": "u"})  # fmt: skip
    assert gen.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert (gen.max_tokens, gen.temperature, gen.top_p, gen.stop, gen.seed) == (7, 0.0, 0.5, ("x",), 3)
    assert gen.stream and gen.include_usage


def test_openai_clients_developer_role_and_null_n_are_accepted():
    """Found by use: OpenAI's newer clients send the system prompt as role developer, and some send n: null."""
    gen = parse_chat({**CHAT, "n": None, "messages": [{"role": "developer", "content": "be brief"}, *CHAT["messages"]]})
    assert gen.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        (b'{"model": "m", "prompt": "a\\ud800b"}', "lone UTF-16 surrogate"),  # valid JSON, not text: 503 before
        (b'{"model": "m", "max_tokens": 1' + b"0" * 5000 + b"}", "Exceeds the limit"),  # Python's digit limit: 500
    ],
)
def test_bodies_json_allows_but_python_or_text_cannot_take_are_400(raw, said):
    with pytest.raises(ApiError) as e:
        parse_body(raw)
    assert e.value.status == 400 and e.value.code == "invalid_json" and said in e.value.message


def test_completion_prompt_may_be_a_list_of_one():
    assert parse_completion({"model": "m", "prompt": ["hello"]}).prompt == "hello"


@pytest.mark.parametrize(
    "change, param, code",
    [
        ({"model": 5}, "model", "invalid_type"),
        ({"messages": []}, "messages", None),
        ({"messages": [{"role": "user", "content": 1}]}, "messages[0].content", None),
        ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0]", "unrecognized_argument"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"max_tokens": True}, "max_tokens", "invalid_type"),
        ({"temperature": 2.5}, "temperature", "invalid_value"),
        ({"temperature": float("nan")}, "temperature", "invalid_type"),
        ({"top_p": 0}, "top_p", None),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", None),
        ({"stream": "yes"}, "stream", "invalid_type"),
        ({"n": 3}, "n", "unsupported_value"),
        ({"logprobs": True}, "logprobs", "unsupported_value"),
        ({"whatever": 1}, "whatever", "unrecognized_argument"),
    ],
)
def test_each_bad_field_is_named(change, param, code):
    with pytest.raises(ApiError) as e:
        parse_chat({**CHAT, **change})
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code)


def test_bodies_that_are_not_json_objects_are_400():
    for raw in (b"{", b"\xff\xfe", b"[1]", b"[" * 100000):
        with pytest.raises(ApiError) as e:
            parse_body(raw)
        assert e.value.status == 400 and e.value.code == "invalid_json"


def test_error_body_is_openais_shape_and_survives_pickling():
    e = pickle.loads(pickle.dumps(ApiError(404, "no such model", "model", "model_not_found")))
    assert e.body() == {"error": {"message": "no such model", "type": "not_found_error", "param": "model",
                                  "code": "model_not_found"}}  # fmt: skip
    assert ApiError(401, "x").body()["error"]["type"] == "authentication_error"
    assert ApiError(503, "x").body()["error"]["type"] == "server_error"


def test_response_and_chunk_shapes():
    r = response("id1", "m", True, "hi", "stop", usage(3, 1))
    assert r["object"] == "chat.completion" and r["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert r["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                          "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    first = chunk("id1", "m", True, "h", None, first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "h"}
    assert chunk("id1", "m", False, "x", "length")["choices"][0] == {
        "index": 0,
        "text": "x",
        "finish_reason": "length",
        "logprobs": None,
    }


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip


def test_tools_and_a_tool_loop_conversation_parse():
    """A tool loop as the openai client sends it: the assistant's call echoed back (with its empty refusal)
    and the tool's result."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    gen = parse_chat({**CHAT, "tools": [WEATHER], "parallel_tool_calls": False, "messages": [
        *CHAT["messages"],
        {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None, "annotations": []},
        {"role": "tool", "content": '{"temp": 3}', "tool_call_id": "call_1"},
    ]})  # fmt: skip
    assert gen.tools == [WEATHER] and gen.tool_choice == "auto" and not gen.parallel_tool_calls
    assert gen.messages[1:] == [
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": '{"temp": 3}'},
    ]  # fmt: skip
    assert parse_chat(CHAT).tool_choice == "none" and parse_chat(CHAT).tools is None
    assert parse_chat({**CHAT, "tools": [WEATHER], "tool_choice": "none"}).tool_choice == "none"
    assert parse_chat({**CHAT, "tools": [], "tool_choice": "none"}).tools is None
    forced = parse_chat(
        {**CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )
    assert (forced.tool_choice, forced.tool_name) == ("function", "get_weather")
    assert parse_chat({**CHAT, "tools": [WEATHER], "tool_choice": "required"}).tool_choice == "required"


@pytest.mark.parametrize(
    "change, param, code",
    [
        ({"tools": {"name": "f"}}, "tools", "invalid_type"),
        ({"tools": [{"name": "f"}]}, "tools", "invalid_type"),  # OpenAI's shape only, not glaive's
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", None),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "invalid_value"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
         "tool_choice", "invalid_value"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "invalid_value"),
        ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice", "invalid_value"),
        ({"tool_choice": "auto"}, "tool_choice", "invalid_value"),
        ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid_type"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"name": "f"}]}]}, "messages[0].tool_calls", None),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function":
          {"name": "f", "arguments": "{oops"}}]}]}, "messages[0].tool_calls", "invalid_value"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": {"type": "function", "function":
          {"name": "f", "arguments": "{}"}}}]}, "messages[0].tool_calls", "invalid_type"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"type": "code", "function":
          {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls", "invalid_type"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]}, "messages[0]", "invalid_value"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "x"}]}, "messages[1]",
         "invalid_value"),
        ({"messages": [{"role": "user", "content": "x", "reasoning_content": "r"}]}, "messages[0]", "invalid_value"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice",
         "invalid_value"),
        ({"messages": [{"role": "assistant", "content": "x", "refusal": "no"}]}, "messages[0]", "unrecognized_argument"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content", None),
    ],
)  # fmt: skip
def test_bad_tools_and_tool_messages_are_named(change, param, code):
    with pytest.raises(ApiError) as e:
        parse_chat({**CHAT, **change})
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code), e.value.message


def test_reasoning_echoed_back_is_read_as_training_reads_it():
    """Found by use: history from a reasoning model's server (reasoning_content) was refused, though training reads it."""
    gen = parse_chat({**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": "a",
                                                               "reasoning_content": "think"}, *CHAT["messages"]]})  # fmt: skip
    assert gen.messages[1] == {"role": "assistant", "content": "a", "reasoning": "think"}


def test_tool_calls_in_responses_and_chunks():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    r = response("id1", "m", True, None, "tool_calls", usage(3, 1), [call])
    assert r["choices"][0]["message"] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    delta = chunk("id1", "m", True, None, None, calls=[call, call])["choices"][0]["delta"]
    assert delta == {"tool_calls": [{"index": 0} | call, {"index": 1} | call]}
