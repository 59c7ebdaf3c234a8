"""The new data shapes on SmolLM2's own chat template and tokenizer (read from its GGUF; no model weights)."""

import json
from pathlib import Path

import pytest

from raylora.data.encode import IGNORE_INDEX, Encoder, tokenizer_spec
from raylora.data.formats import detect_format, to_conversation
from raylora.data.read import iter_raw
from raylora.data.tokenize import PieceTokenizer
from raylora.data.words import WordEncoder
from raylora.model_files import ModelError, _smollm2_gguf

DATA = Path(__file__).resolve().parents[2] / "data"
SAMPLES = ("glaive_toolcall_demo.json", "openai_tools_demo.jsonl", "v1_parts_demo.jsonl", "reasoning_demo.jsonl",
           "mask_history_demo.jsonl")  # fmt: skip


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    try:
        gguf = _smollm2_gguf()
    except ModelError as e:
        pytest.skip(str(e))
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="module")
def encoder(smol):
    return Encoder(tokenizer_spec(smol, "auto"), 4096, "tail", False)


def conversations(name):
    path = DATA / name
    with path.open("rb") as f:
        rows = [json.loads(raw) for _, raw, _ in iter_raw(f, str(path))]
    return [to_conversation(r, detect_format(r), {}, {}) for r in rows]


def learned_and_ignored(smol, e):
    keep = [lab != IGNORE_INDEX for lab in e.labels]
    return (
        smol.decode([i for i, k in zip(e.input_ids, keep, strict=True) if k]),
        smol.decode([i for i, k in zip(e.input_ids, keep, strict=True) if not k]),
    )


@pytest.mark.parametrize("name", SAMPLES)
def test_smollm2_renders_each_sample_as_its_template_does_and_learns_exactly_the_learned_turns(smol, encoder, name):
    assert not encoder.native_tools and encoder.reasoning_field is None  # SmolLM2's template knows neither
    for c in conversations(name):
        view, learned, _ = encoder.template_view(c)
        (e,) = encoder.encode_many([c])
        text = smol.apply_chat_template(view, tokenize=False)
        last = max(i for i, m in enumerate(view) if m["role"] == "assistant")
        end = text.rindex(view[last]["content"] + "<|im_end|>\n") + len(view[last]["content"] + "<|im_end|>\n")
        # the ids are the tokenizer's own for the whole rendered text, through the last assistant turn
        assert e.input_ids == smol(text[:end], add_special_tokens=False).input_ids
        got, ignored = learned_and_ignored(smol, e)
        assert got == "".join(
            m["content"] + "<|im_end|>\n"
            for m, lrn in zip(view, learned, strict=True)
            if lrn and m["role"] == "assistant"
        )
        for tool in c.tools or []:
            assert json.dumps(tool, ensure_ascii=False) in ignored  # the schemas are in the prompt, not learned
        for m in c.messages:
            if m["role"] == "tool":
                assert m["content"] in ignored and m["content"] not in got


def test_smollm2_tool_calls_reasoning_and_weights_on_the_samples(smol, encoder):
    (glaive, *_) = conversations("glaive_toolcall_demo.json")
    got, ignored = learned_and_ignored(smol, encoder.encode_many([glaive])[0])
    assert got == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "It is 21 °C with a clear sky in Paris.<|im_end|>\n"
    )
    assert ignored.startswith("<|im_start|>system\n# Tools\n") and "<tools>\n" in ignored
    (_, umbrella, _) = conversations("reasoning_demo.jsonl")
    got, _ = learned_and_ignored(smol, encoder.encode_many([umbrella])[0])
    assert got == (
        "<think>\nI need today's weather in Bergen; get_weather gives it.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bergen"}}\n</tool_call><|im_end|>\n'
        "<think>\nRain is forecast, so yes.\n</think>\n\nYes: it is raining in Bergen (9 °C).<|im_end|>\n"
    )
    (primes, *_) = conversations("v1_parts_demo.jsonl")
    assert learned_and_ignored(smol, encoder.encode_many([primes])[0])[0] == "Two is the only even prime.<|im_end|>\n"
    masked, unmasked = conversations("mask_history_demo.jsonl")
    assert learned_and_ignored(smol, encoder.encode_many([masked])[0])[0] == "Oslo.<|im_end|>\n"
    assert learned_and_ignored(smol, encoder.encode_many([unmasked])[0])[0] == (
        "One, two.<|im_end|>\nOne, two, three.<|im_end|>\n"
    )


def test_word_by_word_tokenisation_stays_exact_on_the_new_shapes(encoder):
    texts = [text for name in SAMPLES for c in conversations(name) for text, _ in encoder.segments(c)]
    pieces = PieceTokenizer(encoder.backend)
    assert pieces.split is not None and isinstance(pieces.encode_pieces, WordEncoder)
    whole = [e.ids for e in encoder.backend.encode_batch(texts, add_special_tokens=False)]
    assert pieces(texts) == whole and pieces(texts) == whole  # second call: from the memos
