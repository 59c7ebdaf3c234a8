"""The replica's adapter lifecycle without Serve: loads, LRU evictions and requests in any order."""

import asyncio
import gc
import json
import shutil

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from raylora.config import from_dict, to_dict
from raylora.generation import GenRequest, answer_text, wait_for
from raylora.model_files import tiny_tokenizer
from raylora.models import randomise_lora, tiny_model
from raylora.serve.protocol import ApiError
from raylora.serve.replica import LLMServer, _Held

TOK = tiny_tokenizer()
NAMES = ("a", "b", "c")


class _Server:
    def __init__(self):
        self.retired: list[str] = []

    def retire(self, name: str) -> None:
        self.retired.append(name)


def test_an_evicted_adapter_is_retired_once_even_when_collected_later():
    # Serve's LRU calls __del__ on eviction and then replaces it on the instance; Python's collector still
    # calls the class's __del__, by which time the adapter may be loaded again: that must not unload it.
    server = _Server()
    held = _Held(server, "alpha")
    held.__del__()
    held.__del__ = lambda *_: None
    del held
    gc.collect()
    assert server.retired == ["alpha"]


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for seed, name in enumerate(NAMES):
        model = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        randomise_lora(model, seed, 0.5)
        model.save_pretrained(root / name)
    cfg = from_dict({"model": {"name_or_path": "tiny-llama"},
                     "serve": {"adapter_root": str(root), "max_adapters": 1, "max_prompt_tokens": 100},
                     "backend": {"device": "cpu"}, "tracking": {"enabled": False}})  # fmt: skip
    server = LLMServer(to_dict(cfg))
    expected = {}
    ids = TOK("hello there", add_special_tokens=False).input_ids
    for name in (None, *NAMES):
        model = tiny_model("llama").eval()
        model = PeftModel.from_pretrained(model, str(root / name)).eval() if name else model
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)
        expected[name] = answer_text(TOK, out[0, len(ids) :].tolist())
    assert len(set(expected.values())) == 4
    yield server, ids, expected
    server.engine.stop()


def _answer(server, ids, name) -> str:
    out = wait_for(server.engine, GenRequest(ids, name, max_tokens=8, temperature=0), timeout_s=60)
    assert out.error is None, out.error
    return out.text


def test_base_and_adapters_answer_right_through_lru_evictions(replica):
    server, ids, expected = replica
    held = None
    for name in (None, "a", None, "b", "b", None, "c", "a", None, "a"):  # base -> A -> base -> B was the fault
        if name and name not in server.info()["adapters"]:
            if held is not None:
                held.__del__()  # what Serve's LRU of one does before loading the next adapter
            held = asyncio.run(server._load(name))
        assert _answer(server, ids, name) == expected[name], name
        server.engine.call(lambda: None).result(10)  # the collection queued by an eviction has run
        assert len(server.info()["adapters"]) <= 1
    held.__del__()
    server.engine.call(lambda: None).result(10)
    assert server.info()["adapters"] == [] and not hasattr(server.engine.model, "peft_config")
    assert _answer(server, ids, None) == expected[None]


def test_an_adapter_loaded_again_while_its_unload_is_queued_stays(replica):
    server, ids, expected = replica
    held = asyncio.run(server._load("a"))
    held.__del__()  # evicted: its collection is queued on the engine thread ...
    with server.bank.pinned("a"):  # ... while a request for it arrives and Serve loads it again
        again = asyncio.run(server._load("a"))
    server.bank.collect_soon()
    server.engine.call(lambda: None).result(10)
    assert server.info()["adapters"] == ["a"]
    assert _answer(server, ids, "a") == expected["a"]
    again.__del__()


def test_an_adapter_loaded_anew_under_its_name_never_reuses_the_old_weights_cached_prefixes(tmp_path):
    root = tmp_path / "adapters"
    weights = {}
    for seed, name in enumerate(("old", "new")):
        model = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        randomise_lora(model, seed, 0.5)
        model.save_pretrained(tmp_path / name)
        weights[name] = tmp_path / name
    shutil.copytree(weights["old"], root / "mine")
    cfg = from_dict({"model": {"name_or_path": "tiny-llama"}, "serve": {"adapter_root": str(root), "max_adapters": 1},
                     "backend": {"device": "cpu"}, "tracking": {"enabled": False}})  # fmt: skip
    server = LLMServer(to_dict(cfg))
    ids = TOK(
        "A long system prompt that many requests share, then a question. " * 3, add_special_tokens=False
    ).input_ids
    expected = {}
    for name, path in weights.items():
        model = PeftModel.from_pretrained(tiny_model("llama"), str(path)).eval()
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)
        expected[name] = answer_text(TOK, out[0, len(ids) :].tolist())
    assert expected["old"] != expected["new"]

    def ask():
        return wait_for(server.engine, GenRequest(ids, "mine", max_tokens=8, temperature=0), timeout_s=60)

    try:
        held = asyncio.run(server._load("mine"))
        first, second = ask(), ask()
        assert first.text == second.text == expected["old"] and first.cached_tokens == 0 < second.cached_tokens
        held.__del__()  # evicted and unloaded; the adapter is then published again with other weights
        server.engine.call(lambda: None).result(10)
        shutil.rmtree(root / "mine")
        shutil.copytree(weights["new"], root / "mine")
        held = asyncio.run(server._load("mine"))
        third = ask()
        assert third.text == expected["new"] and third.cached_tokens == 0
        held.__del__()
    finally:
        server.engine.stop()


def test_prompts_past_the_limits_are_refused_and_default_max_tokens_fits_the_context(replica):
    server, _, _ = replica
    context = server.engine.max_context
    assert server.budget(10, None, "messages") == server.cfg.serve.max_tokens
    with pytest.raises(ApiError) as e:
        server.budget(101, None, "messages")  # serve.max_prompt_tokens is 100
    assert (e.value.status, e.value.code, e.value.param) == (400, "context_length_exceeded", "messages")
    assert "100" in e.value.message
    server.cfg.serve.max_prompt_tokens = None
    try:
        for n in (context, context + 900):
            with pytest.raises(ApiError) as e:
                server.budget(n, None, "prompt")  # no max_tokens: still refused, never admitted past the context
            assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
        assert server.budget(context - 5, None, "prompt") == 5
        with pytest.raises(ApiError) as e:
            server.budget(context - 5, 6, "prompt")
        assert e.value.param == "max_tokens"
    finally:
        server.cfg.serve.max_prompt_tokens = 100


def _loaded_by(imports: str, watched: tuple[str, ...]) -> list[str]:
    """Which of ``watched`` a fresh interpreter has loaded after ``import {imports}``."""
    import subprocess
    import sys

    code = f"import json, sys, {imports}\nprint(json.dumps(sorted(m for m in {watched!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def test_a_replica_imports_neither_the_data_pipeline_nor_ray_data():
    imports = "raylora.serve.replica, raylora.export, raylora.data.sources"
    assert _loaded_by(imports, ("ray.data", "raylora.data.pipeline")) == []


def test_the_ingress_imports_nothing_of_the_model_stack():
    """Its replica imports it: an HTTP router that held torch, transformers and peft (tests/integration/test_serve.py)."""
    assert _loaded_by("raylora.serve.ingress", ("torch", "transformers", "peft", "raylora.serve.replica")) == []


def test_a_tool_conversation_is_rendered_as_training_renders_it(replica):
    """Served prompts with tools, calls and results are the training text plus the generation prompt."""
    from raylora.data.formats import Conversation

    server, _, _ = replica
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}
    messages = [{"role": "user", "content": "time?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "12:00"}]  # fmt: skip
    trained = server.encoder.text(Conversation(messages, tools))
    served = TOK.decode(server.render(messages, None, tools))
    assert served == trained + "<|im_start|>assistant\n"
    assert '"name": "get_time"' in served and "<tool_response>\n12:00\n</tool_response>" in served
    assert TOK.decode(server.render(messages[:1], None)) == "<|im_start|>user\ntime?<|im_end|>\n<|im_start|>assistant\n"


def test_a_forced_call_is_held_to_hermes_calls_only_where_the_template_writes_them(replica):
    import dataclasses

    from raylora.data.encode import Encoder, tokenizer_spec
    from raylora.templates import CHATML

    server, _, _ = replica
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    request = {"tool_choice": "function", "tool_name": "get_time", "tools": [tool], "response_format": None,
               "parallel_tool_calls": True}  # fmt: skip
    assert '"<tool_call>\\n"' in server.structure(request) and '"const": "get_time"' in server.structure(request)
    assert server.structure({**request, "tool_choice": "auto", "tool_name": None}) is None
    # a template that shows tools itself and writes calls its own way (as Llama 3.1's writes bare JSON)
    own = CHATML.replace(
        "message['content']", "message['content'] + (message['tool_calls'] | tojson if message['tool_calls'] else '')"
    ).replace("{% for message in messages %}", "{{ tools | tojson if tools else '' }}{% for message in messages %}")
    encoder = Encoder(dataclasses.replace(tokenizer_spec(TOK, "auto"), template=own), 64, "tail", False)
    assert encoder.native_tools and not encoder.writes_hermes_calls() and server.hermes_calls
    hermes = server.hermes_calls
    server.hermes_calls = False
    try:
        with pytest.raises(ApiError) as e:
            server.structure(request)
        assert (e.value.status, e.value.param, e.value.code) == (400, "tool_choice", "unsupported_value")
        schema = {"type": "json_object"}
        assert server.structure({**request, "tool_choice": "none", "tools": None, "response_format": schema})
    finally:
        server.hermes_calls = hermes


def test_a_conversation_the_template_refuses_is_a_400_not_a_503(replica):
    """Found in review: a template's raise_exception (Llama 3.1 takes one tool call a turn) escaped as a replica
    error, a 503 'retry shortly' and a traceback."""
    from raylora.templates import compile_template

    server, _, _ = replica
    template = server.encoder.template
    server.encoder.template = compile_template("{{ raise_exception('only one tool call a turn') }}")
    try:
        with pytest.raises(ApiError) as e:
            server.render([{"role": "user", "content": "x"}], None)
        assert (e.value.status, e.value.param) == (400, "messages") and "only one tool call a turn" in e.value.message
    finally:
        server.encoder.template = template
