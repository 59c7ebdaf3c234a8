"""Structured outputs on the engine: every constrained answer of a random tiny model parses and validates, free
requests batched beside constrained ones keep their solo answers, and schemas the server cannot enforce are 400."""

import json
import random
import threading

import jsonschema
import pytest
import torch

from raylora.generation import Engine, GenRequest, wait_for
from raylora.model_files import tiny_tokenizer
from raylora.models import tiny_model
from raylora.serve.protocol import ApiError, parse_chat, parse_completion
from raylora.serve.structured import NONE as NO_PARAMETERS
from raylora.serve.structured import Grammars, grammar
from raylora.serve.tools import split_calls

TOK = tiny_tokenizer()
IDS = TOK("weather?", add_special_tokens=False).input_ids
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
# Finite languages: a random model must close every structure long before max_tokens.
PLACE = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
         "required": ["city", "days"], "additionalProperties": False}  # fmt: skip
SCHEMA = {
    "type": "object",
    "properties": {
        "place": PLACE,
        "tags": {"type": "array", "items": {"enum": ["sun", "rain"]}, "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"},
        "unit": {"enum": ["C", "F", None]},
    },
    "required": ["place", "tags", "ok", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PLACE}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping"}},
]  # fmt: skip


@pytest.fixture(scope="module")
def engine():
    model = tiny_model("llama").eval()
    e = Engine(model, TOK, max_batch_size=8, batch_wait_s=0)
    e.grammars = Grammars(TOK, model.config.vocab_size, e.eos_ids)
    yield e
    e.stop()


def _answer(engine, text: str | None, temperature: float = 1.0, seed: int = 0, max_tokens: int = 400):
    constraint = engine.grammars.start(text) if text else None
    return wait_for(engine, GenRequest(IDS, None, max_tokens, temperature, 1.0, (), seed, constraint))


def test_every_json_schema_answer_parses_and_validates_and_closes_by_itself(engine):
    text = grammar({"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}, None, "none", None, True)
    answers = [_answer(engine, text, temperature=t, seed=s) for t in (0, 1.0, 1.5) for s in range(4)]
    for event in answers:
        assert event.finish_reason == "stop", event
        jsonschema.validate(json.loads(event.text), SCHEMA)
        assert event.text.startswith('{"place": {"city": ')  # JSON as templates write it, no free whitespace
    assert len({e.text for e in answers}) > 3  # sampling still picks among what the schema allows
    any_object = grammar({"type": "json_object"}, None, "none", None, True)
    event = _answer(engine, any_object, temperature=0, max_tokens=40)
    assert event.text.startswith("{") and event.finish_reason in ("stop", "length")


def test_forced_calls_name_declared_tools_with_valid_arguments(engine):
    names = {t["function"]["name"] for t in TOOLS}
    params = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}
    for seed in range(6):
        for parallel in (True, False):
            event = _answer(engine, grammar(None, TOOLS, "required", None, parallel), seed=seed)
            content, calls = split_calls(event.text, names)
            assert content is None and calls and event.finish_reason == "stop", event
            for call in calls:
                jsonschema.validate(json.loads(call["function"]["arguments"]), params[call["function"]["name"]])
            assert parallel or len(calls) == 1
        event = _answer(engine, grammar(None, TOOLS, "function", "get_time", True), seed=seed)
        [call] = split_calls(event.text, names)[1]
        assert call["function"]["name"] == "get_time" and json.loads(call["function"]["arguments"])["zone"] in (
            "UTC",
            "CET",
        )
    two = ('<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n'
           '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')  # fmt: skip
    for parallel in (True, False):  # several calls only when parallel calls are allowed
        constraint = engine.grammars.start(grammar(None, TOOLS, "required", None, parallel))
        for token in TOK(two, add_special_tokens=False).input_ids:
            constraint.accept(token)
        assert (constraint.error is None and constraint.matcher.is_accepting()) == parallel


def test_free_requests_batched_beside_constrained_ones_keep_their_solo_answers(engine):
    prompts = ["hello world", "x", "a longer prompt to pad the batch", "yy zz"]
    solo = [wait_for(engine, GenRequest(TOK(p, add_special_tokens=False).input_ids, None, 16, 0)).text for p in prompts]
    text = grammar({"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}, None, "none", None, True)
    results, threads = {}, []

    def ask(key, req):
        results[key] = wait_for(engine, req)

    for i, p in enumerate(prompts):
        ids = TOK(p, add_special_tokens=False).input_ids
        threads.append(threading.Thread(target=ask, args=(("free", i), GenRequest(ids, None, 16, 0))))
        constrained = GenRequest(ids, None, 400, 1.0, 1.0, (), i, engine.grammars.start(text))
        threads.append(threading.Thread(target=ask, args=(("json", i), constrained)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results["free", i].text for i in range(4)] == solo
    for i in range(4):
        jsonschema.validate(json.loads(results["json", i].text), SCHEMA)
    assert engine.max_running > 1


def test_a_mask_forbids_only_what_the_grammar_forbids_on_its_own_row(engine):
    constraint = engine.grammars.start(grammar(None, TOOLS, "function", "ping", True))
    logits = torch.randn(2, engine.grammars.vocab_size)
    free = logits[1].clone()
    constraint.mask(logits[0])
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed and all("<tool_call>\n".startswith(TOK.decode([t])) for t in allowed)
    assert torch.equal(logits[1], free)


def test_an_answer_cut_by_max_tokens_ends_length_and_holds_no_call(engine):
    event = _answer(engine, grammar(None, TOOLS, "required", None, True), max_tokens=6)
    assert event.finish_reason == "length" and split_calls(event.text, {"get_weather", "get_time", "ping"})[1] == []


@pytest.mark.parametrize(
    "response_format, code",
    [
        ({"type": "xml"}, "invalid_value"),
        ({"type": "json_schema"}, "invalid_value"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "invalid_value"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}, "invalid_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"minLength": -1}}}, "invalid_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": list(range(5000))}}},
         "schema_too_large"),
    ],
)  # fmt: skip
def test_response_formats_that_are_not_json_schemas_are_400(response_format, code):
    for parse, body in ((parse_chat, CHAT), (parse_completion, {"model": "m", "prompt": "p"})):
        with pytest.raises(ApiError) as e:
            parse({**body, "response_format": response_format}, 16384)
        assert e.value.status == 400 and e.value.code == code and e.value.param.startswith("response_format")


def test_response_formats_parse_and_keywords_the_library_cannot_enforce_are_400(engine):
    assert parse_chat({**CHAT, "response_format": {"type": "text"}}).response_format is None
    assert parse_chat({**CHAT, "response_format": {"type": "json_object"}}).response_format == {"type": "json_object"}
    spec = {"name": "w", "schema": SCHEMA, "strict": True}
    assert parse_chat({**CHAT, "response_format": {"type": "json_schema", "json_schema": spec}}).response_format == {
        "type": "json_schema",
        "json_schema": spec,
    }
    unenforceable = {"type": "object", "not": {"required": ["a"]}}
    text = grammar(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": unenforceable}}, None, "none", None, 1
    )
    with pytest.raises(ApiError) as e:
        engine.grammars.start(text)
    assert e.value.status == 400 and e.value.code == "unsupported_schema" and "not" in e.value.message


def test_two_hundred_random_requests_batched_with_free_ones_are_all_valid(engine):
    """Schemas with nested objects, arrays, enums and required keys, and tool sets of 1-5 tools, drawn at random and
    sent at once beside free greedy requests: every constrained answer that stops is valid, and every free answer
    equals its solo answer."""
    rng = random.Random(7)

    def draw(depth: int) -> dict:
        kind = rng.choice(["enum", "int", "bool", "array", "object"] if depth < 2 else ["enum", "int", "bool"])
        if kind == "enum":
            return {"enum": rng.sample(["a", "b", "c", 1, 2, None, True], rng.randint(1, 4))}
        if kind == "int":
            low = rng.randint(-5, 5)
            return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 20)}
        if kind == "bool":
            return {"type": "boolean"}
        if kind == "array":
            return {"type": "array", "items": draw(depth + 1), "maxItems": rng.randint(0, 3)}
        keys = [f"k{i}" for i in range(rng.randint(1, 4))]
        return {"type": "object", "properties": {k: draw(depth + 1) for k in keys}, "required": keys,
                "additionalProperties": False}  # fmt: skip

    cases = []
    for n in range(200):
        if n % 2:
            schema = (
                draw(0)
                if rng.random() < 0.5
                else {"type": "object", "properties": {"v": draw(0)}, "additionalProperties": False}
            )
            schema = schema if schema.get("type") == "object" else {"type": "object", "properties": {"v": schema},
                                                                    "required": ["v"], "additionalProperties": False}  # fmt: skip
            fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
            cases.append(("json", schema, grammar(fmt, None, "none", None, True)))
        else:
            tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": draw(1) | {"type": "object"}
                                                       if rng.random() < 0.8 else NO_PARAMETERS}}
                     for i in range(rng.randint(1, 5))]  # fmt: skip
            tools = [t for t in tools if "properties" in t["function"]["parameters"]] or [
                {"type": "function", "function": {"name": "f0"}}
            ]
            choice = rng.choice(["required", "function"])
            name = rng.choice(tools)["function"]["name"] if choice == "function" else None
            cases.append(("tools", tools, grammar(None, tools, choice, name, rng.random() < 0.5)))
    prompts = [TOK(f"free prompt {i}", add_special_tokens=False).input_ids for i in range(20)]
    solo = [wait_for(engine, GenRequest(ids, None, 12, 0)).text for ids in prompts]
    results: dict = {}

    def ask(key, req):
        results[key] = wait_for(engine, req, timeout_s=300)

    threads = [threading.Thread(target=ask, args=(("free", i), GenRequest(ids, None, 12, 0)))
               for i, ids in enumerate(prompts)]  # fmt: skip
    threads += [threading.Thread(target=ask, args=(n, GenRequest(IDS, None, 300, 1.0, 1.0, (), n, engine.grammars.start(text))))
                for n, (_, _, text) in enumerate(cases)]  # fmt: skip
    rng.shuffle(threads)
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [results["free", i].text for i in range(20)] == solo
    stopped = 0
    for n, (kind, spec, _) in enumerate(cases):
        event = results[n]
        assert event.error is None, event
        if event.finish_reason != "stop":
            continue
        stopped += 1
        if kind == "json":
            jsonschema.validate(json.loads(event.text), spec)
            continue
        params = {t["function"]["name"]: t["function"].get("parameters", NO_PARAMETERS) for t in spec}
        content, calls = split_calls(event.text, set(params))
        assert content is None and calls, event
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), params[call["function"]["name"]])
    assert stopped >= 180  # finite languages: all but a few long arrays of nested objects close within 300 tokens
