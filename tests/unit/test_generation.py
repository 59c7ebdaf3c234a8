"""The continuous-batching engine against plain ``generate`` on a tiny model (exact greedy equality)."""

import os
import threading
import time

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from raylora import kv_slots
from raylora.generation import Engine, Event, GenRequest, answer_text, on_passing_thread, wait_for
from raylora.model_files import tiny_tokenizer
from raylora.models import randomise_lora, tiny_model

TOK = tiny_tokenizer()
PROMPTS = ["hello world", "a much longer prompt than the other ones, to pad", "x", "yy zz"]


def _ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False).input_ids


def _generate(model, text: str, n: int) -> str:
    """``generate``'s greedy answer as the engine sends it: decode(), less a last character whose bytes were cut
    short (the engine holds them back; decode() shows them as U+FFFD)."""
    ids = _ids(text)
    out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return answer_text(TOK, out[0, len(ids) :].tolist())


def _in_threads(ask, n: int) -> None:
    """``ask(0)`` .. ``ask(n - 1)`` at once, each on its own thread; returns when all have."""
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


@pytest.fixture
def engine():
    e = Engine(tiny_model("llama").eval(), TOK, max_batch_size=8, batch_wait_s=0)
    yield e
    e.stop()


def _adapters(tmp_path) -> PeftModel:
    for seed, name in enumerate(["a", "b"]):
        model = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        randomise_lora(model, seed, 0.5)
        model.save_pretrained(tmp_path / name)
    model = PeftModel.from_pretrained(tiny_model("llama"), str(tmp_path / "a"), adapter_name="a")
    model.load_adapter(str(tmp_path / "b"), adapter_name="b")
    return model.eval()


def test_requests_joining_a_running_batch_get_exactly_their_solo_answers(engine):
    model = tiny_model("llama").eval()
    expected = [_generate(model, p, 24 if i == 0 else 10) for i, p in enumerate(PROMPTS)]
    first = threading.Event()
    results: dict[int, Event] = {}

    def ask(i: int) -> None:
        results[i] = wait_for(engine, GenRequest(_ids(PROMPTS[i]), max_tokens=24 if i == 0 else 10, temperature=0))

    parts: list[Event] = []
    engine.submit(GenRequest(_ids(PROMPTS[0]), max_tokens=24, temperature=0), lambda e: (parts.append(e), first.set()))
    assert first.wait(30)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(1, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    while not parts[-1].finish_reason:
        threading.Event().wait(0.01)
    assert "".join(p.text for p in parts) == expected[0]
    assert [results[i].text for i in range(1, 4)] == expected[1:]
    assert all(results[i].finish_reason == "length" and results[i].completion_tokens == 10 for i in range(1, 4))
    assert engine.max_running >= 2  # they really shared decode steps


def test_rows_leaving_in_any_order_and_joining_mid_batch_keep_every_answer_exact(monkeypatch):
    """Sequences end at different steps (the last row moves into each leaving one's place), others join while they run,
    and the cache's columns grow past several blocks and shrink back: every answer is still ``generate``'s."""
    monkeypatch.setattr(kv_slots, "COLUMNS", 4)
    model = tiny_model("llama").eval()
    prompts = [*PROMPTS, "one two three four five six seven eight nine ten eleven twelve", "b", "cc dd ee", "q r"]
    lengths = [20, 5, 12, 3, 7, 15, 2, 9]
    expected = [_generate(model, p, n) for p, n in zip(prompts, lengths, strict=True)]
    engine = Engine(model, TOK, max_batch_size=8, batch_wait_s=0)
    results: dict[int, Event] = {}
    first_wave = threading.Event()

    def ask(i: int) -> None:
        if i >= 4:
            first_wave.wait(30)
        results[i] = wait_for(engine, GenRequest(_ids(prompts[i]), max_tokens=lengths[i], temperature=0))
        if i == 3:
            first_wave.set()  # the shortest of the first wave is done; the others still run

    _in_threads(ask, 8)
    engine.stop()
    assert [results[i].text for i in range(8)] == expected
    assert [results[i].completion_tokens for i in range(8)] == lengths
    assert engine.max_running >= 4


def test_adapters_mix_in_one_batch(tmp_path):
    model = _adapters(tmp_path)
    engine = Engine(model, TOK, max_batch_size=8, batch_wait_s=0.2)
    jobs = [("a", PROMPTS[0]), ("b", PROMPTS[1]), (None, PROMPTS[2]), ("b", PROMPTS[3])]
    expected = []
    for name, prompt in jobs:
        ref = tiny_model("llama").eval()
        ref = PeftModel.from_pretrained(ref, str(tmp_path / name)).eval() if name else ref
        expected.append(_generate(ref, prompt, 10))
    results: dict[int, Event] = {}

    def ask(i: int) -> None:
        results[i] = wait_for(engine, GenRequest(_ids(jobs[i][1]), jobs[i][0], max_tokens=10, temperature=0))

    _in_threads(ask, 4)
    engine.stop()
    assert [results[i].text for i in range(4)] == expected
    assert len(set(expected)) == 4 and engine.max_running == 4


def test_stop_strings_end_the_answer_and_never_leak_into_the_stream(engine):
    whole = wait_for(engine, GenRequest(_ids("abc"), max_tokens=20, temperature=0)).text
    stop = whole[6:8]
    parts: list[Event] = []
    done = threading.Event()
    engine.submit(GenRequest(_ids("abc"), max_tokens=20, temperature=0, stop=(stop,)),
                  lambda e: (parts.append(e), e.finish_reason and done.set()))  # fmt: skip
    assert done.wait(30)
    assert "".join(p.text for p in parts) == whole[: whole.find(stop)] and parts[-1].finish_reason == "stop"
    assert all(stop not in p.text for p in parts)


def test_end_of_sequence_token_finishes_with_stop(engine):
    with torch.no_grad():
        first = int(engine.model(torch.tensor([_ids("abc")])).logits[0, -1].argmax())
    engine.eos_ids = {first}
    out = wait_for(engine, GenRequest(_ids("abc"), max_tokens=5, temperature=0))
    assert (out.text, out.finish_reason, out.completion_tokens) == ("", "stop", 0)


def test_seeded_sampling_repeats_and_differs_by_seed(engine):
    def sample(seed):
        return wait_for(engine, GenRequest(_ids("abc"), max_tokens=16, temperature=1.0, top_p=0.9, seed=seed)).text

    assert sample(1) == sample(1) and sample(1) != sample(2)


def test_cancelled_request_leaves_the_batch_and_others_finish(engine):
    parts: list[Event] = []
    seq = engine.submit(GenRequest(_ids("abc"), max_tokens=1000, temperature=0), parts.append)
    while not parts:
        threading.Event().wait(0.01)
    seq.cancel()
    out = wait_for(engine, GenRequest(_ids("def"), max_tokens=5, temperature=0))
    assert out.completion_tokens == 5 and not any(p.finish_reason for p in parts)


def test_a_failed_forward_fails_its_requests_and_the_engine_keeps_serving(engine, monkeypatch):
    real = engine._forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device lost")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "_forward", flaky)
    failed = wait_for(engine, GenRequest(_ids("abc"), max_tokens=5, temperature=0))
    assert failed.error == "generation failed: RuntimeError: device lost"
    assert wait_for(engine, GenRequest(_ids("abc"), max_tokens=5, temperature=0)).completion_tokens == 5


def test_engine_calls_run_between_steps_and_return_values(engine):
    assert engine.call(lambda: 41 + 1).result(10) == 42
    with pytest.raises(ValueError):
        engine.call(lambda: int("x")).result(10)


LONG = " ".join(f"word{i}" for i in range(60))  # about 200 tokens of the tiny tokenizer


def test_chunked_prefill_gives_the_solo_answers(tmp_path):
    model = tiny_model("llama").eval()
    engine = Engine(model, TOK, max_batch_size=8, batch_wait_s=0.1, max_prefill_tokens=16)
    prompts = [LONG, "hello world", LONG[:90], "x"]
    expected = [_generate(model, p, 10) for p in prompts]
    results: dict[int, Event] = {}

    def ask(i: int) -> None:
        results[i] = wait_for(engine, GenRequest(_ids(prompts[i]), max_tokens=10, temperature=0))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    engine.stop()
    assert len(_ids(LONG)) > 10 * 16
    assert [results[i].text for i in range(len(prompts))] == expected


def test_a_long_prompt_is_prefilled_between_the_running_streams_tokens():
    engine = Engine(tiny_model("llama").eval(), TOK, max_batch_size=8, batch_wait_s=0, max_prefill_tokens=16)
    engine.eos_ids = set()
    stream = engine.submit(GenRequest(_ids("abc"), max_tokens=400, temperature=0), lambda e: None)
    while not stream.ids:
        threading.Event().wait(0.01)
    before = len(stream.ids)
    at_first_token: list[int] = []
    done = threading.Event()
    engine.submit(GenRequest(_ids(LONG), max_tokens=1, temperature=0),
                  lambda e: (at_first_token.append(len(stream.ids)), done.set()))  # fmt: skip
    assert done.wait(60)
    engine.stop()
    chunks = -(-len(_ids(LONG)) // 16)
    # The stream kept decoding while the long prompt was prefilled: a token after each chunk.
    assert chunks > 10 and at_first_token[0] - before >= chunks - 1


def test_a_failed_prefill_fails_only_its_request_and_each_failure_is_told_once(engine, monkeypatch):
    engine.eos_ids = set()
    stream: list[Event] = []
    engine.submit(GenRequest(_ids("abc"), max_tokens=60, temperature=0), stream.append)
    while not stream:
        threading.Event().wait(0.01)
    real = engine._forward

    def failing_prefill(ids, *args, **kwargs):
        if ids.shape[1] > 1:
            raise RuntimeError("bad adapter")
        return real(ids, *args, **kwargs)

    monkeypatch.setattr(engine, "_forward", failing_prefill)
    parts: list[Event] = []
    done = threading.Event()
    engine.submit(GenRequest(_ids("hello world"), max_tokens=5, temperature=0),
                  lambda e: (parts.append(e), done.set()))  # fmt: skip
    assert done.wait(30)
    while not stream[-1].final:
        threading.Event().wait(0.01)
    threading.Event().wait(0.2)
    assert [p.error for p in parts] == ["generation failed: RuntimeError: bad adapter"]
    assert stream[-1].finish_reason == "length" and stream[-1].completion_tokens == 60
    assert all(e.error is None for e in stream)


def test_a_failed_decode_step_tells_each_request_once(engine, monkeypatch):
    real = engine._forward
    calls = {"n": 0}

    def failing_step(ids, *args, **kwargs):
        calls["n"] += 1
        if ids.shape[1] == 1 and calls["n"] > 3:
            raise RuntimeError("device lost")
        return real(ids, *args, **kwargs)

    monkeypatch.setattr(engine, "_forward", failing_step)
    events: dict[int, list[Event]] = {0: [], 1: []}
    for i, text in enumerate(["abc", "hello world"]):
        engine.submit(GenRequest(_ids(text), max_tokens=50, temperature=0), events[i].append)
    deadline = threading.Event()
    while not all(e and e[-1].final for e in events.values()):
        deadline.wait(0.01)
    threading.Event().wait(0.2)
    assert [[e.error for e in evs if e.error] for evs in events.values()] == [
        ["generation failed: RuntimeError: device lost"]
    ] * 2
    monkeypatch.setattr(engine, "_forward", real)
    assert wait_for(engine, GenRequest(_ids("abc"), max_tokens=5, temperature=0)).completion_tokens == 5


def test_text_is_decoded_incrementally(engine, monkeypatch):
    whole = _generate(engine.model, "abc", 200)
    calls = []
    real = TOK.decode
    monkeypatch.setattr(TOK, "decode", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    engine.eos_ids = set()
    out = wait_for(engine, GenRequest(_ids("abc"), max_tokens=200, temperature=0))
    assert out.text == whole and len(calls) == 1  # once, at the end: not once per token


def test_a_new_short_prompt_is_not_kept_waiting_behind_a_long_prefill():
    engine = Engine(tiny_model("llama").eval(), TOK, max_batch_size=8, batch_wait_s=0, max_prefill_tokens=8)
    long = engine.submit(GenRequest(_ids(LONG * 2), max_tokens=1, temperature=0), lambda e: None)
    while not long.prefilled:
        threading.Event().wait(0.001)
    progress: list[int] = []
    done = threading.Event()
    engine.submit(GenRequest(_ids("abc"), max_tokens=1, temperature=0),
                  lambda e: (progress.append(long.prefilled), done.set()))  # fmt: skip
    assert done.wait(60)
    engine.stop()
    assert progress[0] < len(long.req.prompt_ids) / 2  # answered long before the long prompt was prefilled


def test_an_answer_cut_inside_a_multi_byte_character_holds_its_incomplete_bytes_back(engine, monkeypatch):
    # the byte-level tiny tokenizer: "a" is one token, "é" two (its two UTF-8 bytes); five tokens end after the first
    # byte of the second "é", which decode() would show as U+FFFD
    script = iter(_ids("aéaé"))
    monkeypatch.setattr(engine, "_sample", lambda logits, seqs: torch.tensor([[next(script)] for _ in seqs]))
    engine.eos_ids = set()
    out = wait_for(engine, GenRequest(_ids("abc"), max_tokens=5, temperature=0))  # the text of every event joined
    assert out.text == "aéa" and out.finish_reason == "length" and out.completion_tokens == 5


def test_the_engine_tells_when_its_last_running_sequence_has_ended():
    """A replica hands the heap's freed pages back then (issue #38: 170 MB of a W8A8 replica after a load)."""
    told = []
    e = Engine(tiny_model("llama").eval(), TOK, max_batch_size=8, batch_wait_s=0,
               on_idle=lambda: told.append(threading.current_thread().name))  # fmt: skip
    try:
        for k, n in ((1, 5), (2, 5), (3, 1)):  # the last ends at its prefill, with no decode step
            out = wait_for(e, GenRequest(_ids(PROMPTS[k]), max_tokens=n, temperature=0))
            assert out.completion_tokens == n
            deadline = time.monotonic() + 10
            while len(told) < k and time.monotonic() < deadline:
                time.sleep(0.01)
            assert told == ["raylora-engine"] * k
    finally:
        e.stop()


def test_work_on_a_passing_thread_returns_its_value_and_leaves_no_thread_or_openmp_pool_behind():
    def os_threads() -> int:
        return len(os.listdir("/proc/self/task"))

    seen = {}

    def load():
        seen["threads"], seen["name"] = torch.get_num_threads(), threading.current_thread().name
        return (torch.randn(512, 512) @ torch.randn(512, 512)).shape  # a parallel region: this thread's own pool

    on_passing_thread(load, 2)  # torch starts a thread of its own at its first parallel region: that one stays
    before = os_threads()
    assert on_passing_thread(load, 2) == (512, 512)
    assert seen == {"threads": 2, "name": seen["name"]} and seen["name"].startswith("raylora-load")
    assert not any(t.name.startswith("raylora-load") for t in threading.enumerate())
    deadline = time.monotonic() + 5
    while os_threads() > before and time.monotonic() < deadline:  # its pool's workers exit after it
        time.sleep(0.05)
    assert os_threads() <= before  # (threads of earlier tests' engines may still be ending)
    with pytest.raises(ValueError, match="bad checkpoint"):
        on_passing_thread(lambda: (_ for _ in ()).throw(ValueError("bad checkpoint")), 1)


def test_a_burst_of_short_prompts_is_prefilled_in_one_forward_idle_or_not(monkeypatch):
    model = tiny_model("llama").eval()
    prompts = ["hi you", "abc", "cat sat", "x y z"]  # each within max_prefill_tokens (8)
    expected = [_generate(model, p, 6) for p in prompts]
    engine = Engine(model, TOK, max_batch_size=8, batch_wait_s=0.5, max_prefill_tokens=8)
    prefills: list[int] = []
    prefill = engine._prefill
    monkeypatch.setattr(engine, "_prefill", lambda seqs: (prefills.append(len(seqs)), prefill(seqs)))
    assert 8 < max(len(_ids(p)) for p in prompts) * len(prompts) <= 8 * 8  # past one prompt's budget, within 8 of them
    results: dict[int, Event] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, wait_for(engine, GenRequest(_ids(prompts[i]), max_tokens=6, temperature=0))))
        for i in range(len(prompts))
    ]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert prefills[0] == len(prompts)  # at an idle engine
    assert [results[i].text for i in range(len(prompts))] == expected
    # at a busy one: the four arrive while a step runs, and join the decoding stream in one prefill
    engine.eos_ids = set()
    stream = engine.submit(GenRequest(_ids("abc"), max_tokens=300, temperature=0), lambda e: None)
    while not stream.ids:
        threading.Event().wait(0.01)
    gate, held = threading.Event(), threading.Event()
    engine.call(lambda: (held.set(), gate.wait(10)))
    assert held.wait(10)  # the engine waits in the call: the four arrive before its next turn, not part way through it
    later = [engine.submit(GenRequest(_ids(p), max_tokens=1, temperature=0), lambda e: None) for p in prompts]
    prefills.clear()
    gate.set()
    while any(not s.ids for s in later):
        threading.Event().wait(0.01)
    engine.stop()
    assert prefills == [len(prompts)]
