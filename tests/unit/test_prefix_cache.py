"""The engine's prefix cache on a tiny model: greedy answers equal with the cache on and off (whole and chunked
prefill, concurrent requests), never shared across adapters, bounded in bytes with the oldest blocks out first, and
forgotten for an adapter that is loaded anew."""

import threading

import pytest
import torch
from test_generation import _adapters  # the same two random adapters, a and b

from raylora.generation import Engine, GenRequest, answer_text, wait_for
from raylora.model_files import tiny_tokenizer
from raylora.models import tiny_model
from raylora.prefix_cache import BLOCK, PrefixCache

TOK = tiny_tokenizer()
SYSTEM = "You are a careful assistant. Answer in one short sentence, and never make anything up. " * 2
QUESTIONS = ["Sky?", "What is two and two?", "Name a colour.", "Who wrote it?"]


def _ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False).input_ids


def _solo(model, ids: list[int], n: int, adapter: str | None = None) -> str:
    if adapter is not None:
        model.set_adapter(adapter)
    out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return answer_text(TOK, out[0, len(ids) :].tolist())


def _ask_together(engine: Engine, reqs: list[GenRequest]) -> list:
    results = [None] * len(reqs)

    def ask(i: int) -> None:
        results[i] = wait_for(engine, reqs[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


@pytest.mark.parametrize("chunk", [None, 24])
def test_answers_are_the_same_with_the_cache_on_and_off(chunk):
    model = tiny_model("llama").eval()
    prompts = [_ids(SYSTEM + q) for q in QUESTIONS]
    shared = len(_ids(SYSTEM))
    expected = [_solo(model, ids, 12) for ids in prompts]
    cache = PrefixCache(64 * 2**20, model.config)
    engine = Engine(model, TOK, 8, 0, max_prefill_tokens=chunk, prefix_cache=cache)
    try:
        first = wait_for(engine, GenRequest(prompts[0], max_tokens=12, temperature=0))
        rest = _ask_together(engine, [GenRequest(ids, max_tokens=12, temperature=0) for ids in prompts])
    finally:
        engine.stop()
    assert first.text == expected[0] and first.cached_tokens == 0
    assert [r.text for r in rest] == expected
    # every later prompt reuses the blocks of the shared system prompt; the first one its whole prompt but a token
    assert rest[0].cached_tokens == (len(prompts[0]) - 1) // BLOCK * BLOCK
    assert all(r.cached_tokens >= shared // BLOCK * BLOCK > 0 for r in rest)
    assert cache.hits == len(prompts) and cache.tokens_saved == sum(r.cached_tokens for r in rest)


def test_adapters_never_share_cached_prefixes(tmp_path):
    model = _adapters(tmp_path)
    ids = _ids(SYSTEM + QUESTIONS[0])
    expected = {name: _solo(model, ids, 10, name) for name in ("a", "b")}
    with model.disable_adapter():
        expected[None] = _solo(model, ids, 10)
    assert len(set(expected.values())) == 3
    engine = Engine(model, TOK, 8, 0, prefix_cache=PrefixCache(64 * 2**20, model.config))
    try:
        order = ["a", "b", None, "b", "a", None]
        got = [wait_for(engine, GenRequest(ids, adapter, max_tokens=10, temperature=0)) for adapter in order]
    finally:
        engine.stop()
    assert [g.text for g in got] == [expected[name] for name in order]
    assert [g.cached_tokens > 0 for g in got] == [False, False, False, True, True, True]


def test_the_cache_stays_within_its_bytes_and_drops_the_least_recently_used_first():
    model = tiny_model("llama").eval()
    config = model.config
    per_block = 2 * config.num_hidden_layers * config.num_key_value_heads * BLOCK * 16 * 4  # head dim 16, fp32
    with torch.no_grad():
        kv = model(input_ids=torch.tensor([_ids(SYSTEM)]), use_cache=True).cache
    assert kv.layers[0].keys.shape[-1] == 16
    cache = PrefixCache(5 * per_block, config)
    prompts = [_ids(f"Prompt number {k}: " + "tell me something long enough to fill two blocks. ") for k in range(4)]
    assert all(len(p) > 2 * BLOCK for p in prompts)
    expected = [_solo(model, ids, 8) for ids in prompts]
    engine = Engine(model, TOK, 8, 0, prefix_cache=cache)
    try:
        first = [wait_for(engine, GenRequest(ids, max_tokens=8, temperature=0)) for ids in prompts]
        assert cache.bytes <= 5 * per_block and cache.evicted > 0
        again = [wait_for(engine, GenRequest(ids, max_tokens=8, temperature=0)) for ids in reversed(prompts)]
    finally:
        engine.stop()
    assert [r.text for r in first] == expected and [r.text for r in again] == expected[::-1]
    assert again[0].cached_tokens > 0  # the last prompt stored is still there
    assert again[-1].cached_tokens == 0  # the first one was evicted long ago
    assert cache.bytes <= 5 * per_block


def test_dropping_an_adapter_forgets_its_blocks_and_keeps_the_others():
    model = tiny_model("llama").eval()
    cache = PrefixCache(64 * 2**20, model.config)
    ids = _ids(SYSTEM)
    with torch.no_grad():
        kv = model(input_ids=torch.tensor([ids]), use_cache=True).cache
    for adapter in ("a", "b"):
        cache.store(adapter, ids, kv, 0, 0)
    cache.drop("a")
    assert cache.match("a", ids)[0] == 0 and cache.match(None, ids)[0] == 0
    tokens, found = cache.match("b", ids)
    assert tokens == (len(ids) - 1) // BLOCK * BLOCK
    torch.testing.assert_close(found.layers[0].keys, kv.layers[0].keys[:, :, :tokens])


def test_prompts_that_hit_the_cache_are_prefilled_together_with_the_others(monkeypatch):
    """Found by measuring: a prompt whose start was cached was prefilled alone, one per engine turn, so 16 clients'
    requests sharing a system prompt got their first tokens one decode step apart (p99 1.9 s through HTTP)."""
    model = tiny_model("llama").eval()
    prompts = [_ids(SYSTEM + q) for q in QUESTIONS] + [_ids("No shared start at all.")]
    expected = [_solo(model, ids, 8) for ids in prompts]
    engine = Engine(model, TOK, 8, 0.5, max_prefill_tokens=24, prefix_cache=PrefixCache(64 * 2**20, model.config))
    prefills: list[int] = []
    prefill = engine._prefill
    monkeypatch.setattr(engine, "_prefill", lambda seqs: (prefills.append(len(seqs)), prefill(seqs)))
    try:
        wait_for(engine, GenRequest(prompts[0], max_tokens=8, temperature=0))
        # each longer than a chunk: only its cached start makes it short
        assert all(len(ids) > 24 for ids in prompts[:-1])
        prefills.clear()
        rest = _ask_together(engine, [GenRequest(ids, max_tokens=8, temperature=0) for ids in prompts])
    finally:
        engine.stop()
    assert prefills == [len(prompts)]
    assert [r.text for r in rest] == expected
    assert [r.cached_tokens > 0 for r in rest] == [True] * len(QUESTIONS) + [False]
