import json
from pathlib import Path

import jsonschema
import pytest
import torch

from raylora import model_files
from raylora.config import ModelArgs
from raylora.data.encode import Encoder, tokenizer_spec
from raylora.data.formats import Conversation
from raylora.generation import Engine, GenRequest, answer_all, wait_for
from raylora.model_files import SMOLLM2, cache_root, check_cache
from raylora.models import load_model
from raylora.serve.structured import Grammars, grammar
from raylora.serve.tools import split_calls

pytestmark = pytest.mark.slow
SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def test_smollm2_is_converted_once_then_loaded_from_the_cache(monkeypatch):
    args = ModelArgs()
    model, tokenizer = load_model(args)
    folder = cache_root(args) / "models" / SMOLLM2
    check_cache(folder)
    assert {"config.json", "model.safetensors", "tokenizer.json", "raylora-cache.json"} <= {
        p.name for p in folder.iterdir()
    }
    assert (model.config.model_type, model.config.num_hidden_layers, model.config.hidden_size) == ("llama", 30, 576)

    def no_conversion(path):
        raise AssertionError(f"the cache was not used: {path} was read again")

    monkeypatch.setattr(model_files, "gguf_architecture", no_conversion)
    cached, cached_tokenizer = load_model(args)
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(cached(input_ids=ids).logits, model(input_ids=ids).logits, atol=0, rtol=0)
    assert cached_tokenizer.chat_template == tokenizer.chat_template

    encoder = Encoder(tokenizer_spec(cached_tokenizer, "auto"), 1024, "tail", False)
    prompt = encoder.prompt(Conversation([{"role": "user", "content": "What is the capital of France?"}]))
    ids = cached_tokenizer(prompt, add_special_tokens=False).input_ids
    answer = answer_all(cached, cached_tokenizer, [GenRequest(ids, max_tokens=24, temperature=0)])[0]
    assert "Paris" in answer.text


def test_the_shipped_serving_config_quantises_smollm2_and_still_answers(root, monkeypatch):
    from raylora.config import load_config
    from raylora.data.encode import Encoder, tokenizer_spec
    from raylora.generation import Engine, GenRequest, wait_for
    from raylora.serve.replica import load_serving_model

    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data (the calibration rows) is not beside this checkout")
    monkeypatch.chdir(root)
    calibration = f"data.sources=[{{path: {SHARED_DATA / 'alpaca_en_demo.json'}}}]"
    model, tokenizer, summary = load_serving_model(load_config("configs/smollm2_serve_cpu.yaml", [calibration]))
    assert summary["method"] == "w8a8-smoothquant" and summary["ratio"] <= 0.3
    encoder = Encoder(tokenizer_spec(tokenizer, "auto"), 1024, "tail", False)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer(encoder.render(question, add_generation_prompt=True), add_special_tokens=False).input_ids
    engine = Engine(model, tokenizer, 4, 0)
    answer = wait_for(engine, GenRequest(ids, max_tokens=16, temperature=0))
    # its words differ between CPUs ("The capital of France is Paris, France." and its end of turn after 9 tokens on one,
    # "L'Étoile ... is the capital of France" cut at 16 on another: the fp32 model's two likeliest first tokens are
    # close), the topic and the fact do not
    assert "France" in answer.text and 0 < answer.completion_tokens <= 16
    assert answer.finish_reason == ("length" if answer.completion_tokens == 16 else "stop")
    stem = tokenizer(encoder.render(question, add_generation_prompt=True) + "The capital of France is",
                     add_special_tokens=False, return_tensors="pt").input_ids  # fmt: skip
    with torch.no_grad():
        assert tokenizer.decode(model(input_ids=stem).logits[0, -1].argmax()) == " Paris"
    # constrained decoding on the W8A8 base: a named call, and any JSON object
    grammars = Grammars(tokenizer, model.config.vocab_size, engine.eos_ids)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}}}  # fmt: skip
    view, _, shown = encoder.template_view(Conversation([{"role": "user", "content": "Weather in Paris?"}], [weather]))
    ids = tokenizer(encoder.render(view, add_generation_prompt=True, tools=shown), add_special_tokens=False).input_ids
    constraint = grammars.start(grammar(None, [weather], "function", "get_weather", True))
    event = wait_for(engine, GenRequest(ids, None, 96, 0, 1.0, (), None, constraint))
    [call] = split_calls(event.text, {"get_weather"})[1]
    jsonschema.validate(json.loads(call["function"]["arguments"]), weather["function"]["parameters"])
    # a JSON schema whose every value is bounded: "any JSON object" let one CPU's greedy answer write a number's digits
    # until max_tokens ({"name": "Paris", "population": 11.1988888...), where another's closed it
    question = [{"role": "user", "content": "Give the capital of France as a JSON object."}]
    ids = tokenizer(encoder.render(question, add_generation_prompt=True), add_special_tokens=False).input_ids
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 40}}, "required": ["capital"],
              "additionalProperties": False}  # fmt: skip
    constraint = grammars.start(grammar({"type": "json_schema", "json_schema": {"schema": schema}}, None, "none", None,
                                        True))  # fmt: skip
    event = wait_for(engine, GenRequest(ids, None, 96, 0, 1.0, (), None, constraint))
    engine.stop()
    assert event.finish_reason == "stop", event.text
    jsonschema.validate(json.loads(event.text), schema)


def test_piecewise_tokenisation_matches_the_smollm2_tokenizer_on_the_shared_samples():
    import json

    from raylora.data.encode import Encoder, tokenizer_spec
    from raylora.data.formats import to_messages
    from raylora.data.tokenize import PieceTokenizer
    from raylora.data.words import WordEncoder
    from raylora.model_files import load_tokenizer

    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not beside this checkout")
    tokenizer = load_tokenizer(ModelArgs())
    encoder = Encoder(tokenizer_spec(tokenizer, "auto"), 4096, "tail", False)
    rows = [
        r
        for name in ("alpaca_en_demo.json", "alpaca_zh_demo.json")
        for r in json.loads((SHARED_DATA / name).read_text())
    ]
    texts = [text for r in rows for text, _ in encoder.segments(to_messages(r, "alpaca", {}, {}))]
    pieces = PieceTokenizer(encoder.backend)
    assert pieces.split is not None
    assert isinstance(pieces.encode_pieces, WordEncoder)
    whole = [e.ids for e in encoder.backend.encode_batch(texts, add_special_tokens=False)]
    assert [pieces(texts[i : i + 512]) for i in range(0, len(texts), 512)] == [
        whole[i : i + 512] for i in range(0, len(texts), 512)
    ]
    assert len(pieces.memo) >= 3
    assert len(pieces.encode_pieces.memo) > 1000


def test_smollm2_calls_the_forced_tool_and_answers_in_the_schema():
    """The issue's case: tool_choice "required" on the base SmolLM2 gave text and finish_reason "length"."""
    model, tokenizer = load_model(ModelArgs())
    engine = Engine(model.eval(), tokenizer, 4, 0)
    grammars = Grammars(tokenizer, model.config.vocab_size, engine.eos_ids)
    encoder = Encoder(tokenizer_spec(tokenizer, "auto"), 2048, "tail", False)
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                              "required": ["city"]}}}  # fmt: skip

    def ask(text: str, tools=None, structure=None, max_tokens=96):
        view, _, shown = encoder.template_view(Conversation([{"role": "user", "content": text}], tools))
        ids = tokenizer(encoder.render(view, add_generation_prompt=True, tools=shown), add_special_tokens=False)
        return wait_for(
            engine, GenRequest(ids.input_ids, None, max_tokens, 0, 1.0, (), None, grammars.start(structure))
        )

    try:
        event = ask("What is the weather in Paris? Use the tool.", [weather], grammar(None, [weather], "required",
                                                                                      None, False))  # fmt: skip
        content, [call] = split_calls(event.text, {"get_weather"})
        assert event.finish_reason == "stop" and content is None and call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), weather["function"]["parameters"])
        place = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                 "country": {"type": "string", "maxLength": 40}}, "required": ["city", "country"]}  # fmt: skip
        fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": place}}
        event = ask("Name a big city and its country.", structure=grammar(fmt, None, "none", None, True))
        assert event.finish_reason == "stop"
        jsonschema.validate(json.loads(event.text), place)
    finally:
        engine.stop()
