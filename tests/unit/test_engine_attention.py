"""The engine's attention gives sdpa's results, and a sequence's result does not depend on the batch it runs in: its
attention output, and on a W8A8 base with mixed adapters its logits at every step, are bitwise the same alone and
among others (issues #37, #38: `raylora eval` scores what `raylora serve` answers)."""

import random
import threading

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model

from raylora.generation import Engine, Event, GenRequest, joined, wait_for
from raylora.model_files import tiny_tokenizer
from raylora.models import randomise_lora, tiny_model
from raylora.ops import engine_attention
from raylora.ops.engine_attention import attend, causal
from raylora.ops.engine_attention import engine_attention as attention
from raylora.ops.int8 import quantize_model
from raylora.ops.lora import stack_adapters

KV, GROUP, DIM = 3, 3, 64
HEADS = KV * GROUP
TOK = tiny_tokenizer()


def _sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def test_decode_and_prefill_rows_give_sdpas_results():
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(4, HEADS, 1, DIM, generator=g),
        torch.randn(4, KV, 70, DIM, generator=g),
        torch.randn(4, KV, 70, DIM, generator=g),
    )
    mask = torch.arange(70)[None, :] < torch.tensor([70, 3, 41, 64])[:, None]
    mask = mask[:, None, None, :]
    out, _ = attention(None, q, k, v, mask, scaling=DIM**-0.5)
    torch.testing.assert_close(out, _sdpa(q, k, v, mask).transpose(1, 2), atol=1e-5, rtol=1e-5)

    # a prefill, two prompts in one row: prompt 0 brings 9 tokens, prompt 1 holds 3 keys and brings 2 more; the keys
    # are the 3 held, then the 9 + 2 new ones
    q, k, v = (torch.randn(1, h, n, DIM, generator=g) for h, n in ((HEADS, 11), (KV, 14), (KV, 14)))
    out, _ = attention(None, q, k, v, None, scaling=DIM**-0.5, prefill=[(0, 0, 9), (0, 3, 2)])
    first = _sdpa(q[:, :, :9], k[:, :, 3:12], v[:, :, 3:12], causal(0, 9, 9, q.device))
    torch.testing.assert_close(out[0, :9], first[0].transpose(0, 1))
    k1, v1 = (torch.cat([t[:, :, :3], t[:, :, 12:]], dim=2) for t in (k, v))
    torch.testing.assert_close(out[0, 9:], _sdpa(q[:, :, 9:], k1, v1, causal(3, 5, 5, q.device))[0].transpose(0, 1))

    # a prompt longer than a query tile, 40 of its 300 positions held: tiled from its first position
    q, k, v = (torch.randn(1, h, n, DIM, generator=g) for h, n in ((HEADS, 260), (KV, 300), (KV, 300)))
    out, _ = attention(None, q, k, v, None, scaling=DIM**-0.5, prefill=[(0, 40, 260)])
    torch.testing.assert_close(out[0], _sdpa(q, k, v, causal(40, 300, 300, q.device))[0].transpose(0, 1))


def test_models_with_sliding_windows_or_soft_capping_keep_their_own_attention():
    model = tiny_model("llama")
    own = model.config._attn_implementation
    with engine_attention.selected(model):
        assert model.config._attn_implementation == engine_attention.NAME
    assert model.config._attn_implementation == own
    for key, value in (
        ("sliding_window", 64),
        ("attn_logit_softcapping", 50.0),
        ("layer_types", ["sliding_attention"]),
    ):
        model = tiny_model("llama")
        setattr(model.config, key, value)
        with engine_attention.selected(model):
            assert model.config._attn_implementation == own, key
    model.config.use_sliding_window = False  # Qwen2's configs name a window they do not use
    model.config.layer_types, model.config.sliding_window = None, 64
    with engine_attention.selected(model):
        assert model.config._attn_implementation == engine_attention.NAME


def test_a_decode_row_is_bitwise_the_same_alone_and_among_rows_of_other_lengths():
    """sdpa's CPU kernel changes a row's output with the batch's width (most of these cases), and so did one matmul
    over all the keys on some machines (past 384 keys); this one does not."""
    rng, g = random.Random(0), torch.Generator().manual_seed(1)
    for _ in range(40):
        n = rng.randint(5, 700)
        q1, k1, v1 = (torch.randn(1, h, length, DIM, generator=g) for h, length in ((HEADS, 1), (KV, n), (KV, n)))
        ref = attend(q1, k1, v1, torch.ones(1, 1, 1, n, dtype=torch.bool), DIM**-0.5)
        rows, pos = rng.choice([2, 7, 16, 64]), None
        width = -(-max(n, rng.randint(5, 800)) // 64) * 64
        q = torch.randn(rows, HEADS, 1, DIM, generator=g)
        k, v = torch.randn(rows, KV, width, DIM, generator=g), torch.randn(rows, KV, width, DIM, generator=g)
        lengths = torch.tensor([rng.randint(1, width) for _ in range(rows)])
        pos = rng.randrange(rows)
        q[pos], k[pos, :, :n], v[pos, :, :n], lengths[pos] = q1[0], k1[0], v1[0], n
        mask = (torch.arange(width)[None, :] < lengths[:, None])[:, None, None, :]
        assert torch.equal(attend(q, k, v, mask, DIM**-0.5)[pos], ref[0])


def test_packed_prompts_are_bitwise_what_each_prompt_gives_alone():
    g = torch.Generator().manual_seed(2)
    lengths = [5, 31, 12, 70]
    q, k, v = (torch.randn(1, h, sum(lengths), DIM, generator=g) for h in (HEADS, KV, KV))
    packed, _ = attention(None, q, k, v, None, scaling=DIM**-0.5, prefill=[(0, 0, n) for n in lengths])
    start = 0
    for n in lengths:  # side by side: prompt i is the n columns after the ones before it
        alone, _ = attention(None, *(t[:, :, start : start + n] for t in (q, k, v)), None, scaling=DIM**-0.5,
                             prefill=[(0, 0, n)])  # fmt: skip
        assert torch.equal(packed[0, start : start + n], alone[0])
        start += n


def _w8a8_with_adapters(tmp_path) -> PeftModel:
    names = ["a", "b", "c"]
    for seed, name in enumerate(names):
        model = get_peft_model(tiny_model("llama"), LoraConfig(r=4 * (seed + 1), target_modules=["q_proj", "v_proj"]))
        randomise_lora(model, seed, 0.5)
        model.save_pretrained(tmp_path / name)
    base = tiny_model("llama").eval()
    quantize_model(base, "w8a8")
    model = PeftModel.from_pretrained(base, str(tmp_path / names[0]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(tmp_path / name), adapter_name=name)
    assert stack_adapters(model) > 0  # the serving and eval path's mixed-adapter op
    return model.eval()


def test_on_a_w8a8_base_each_requests_logits_are_bitwise_its_own_in_any_batch(tmp_path, monkeypatch):
    """Each request alone, then together (six prefilled as one batch, one joining them as they decode; prompts of
    3 to 200 tokens, mixed adapters and the base, keys past several blocks of columns):
    every step's logits are equal bit for bit, so the greedy answers are too. (Each of the three parts fails it
    alone: sdpa, float32 LoRA sums, prompts prefilled through one padded mask.)"""
    model = _w8a8_with_adapters(tmp_path)
    seen: dict[int, list[torch.Tensor]] = {}
    sample = Engine._sample

    def spy(self, logits, seqs):
        for row, seq in zip(logits, seqs, strict=True):
            seen.setdefault(id(seq.req), []).append(row.clone())
        return sample(self, logits, seqs)

    monkeypatch.setattr(Engine, "_sample", spy)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, len(TOK), (n,), generator=g).tolist() for n in (3, 150, 17, 90, 29, 200, 41)]
    adapters = ["a", None, "b", "c", "a", "b", None]
    jobs = [GenRequest(ids, adapter, max_tokens=70 - 9 * i, temperature=0)
            for i, (ids, adapter) in enumerate(zip(prompts, adapters, strict=True))]  # fmt: skip
    # prompts up to 256 tokens are prefilled whole, as one batch when they arrive together
    engine = Engine(model, TOK, max_batch_size=8, batch_wait_s=0.2, max_prefill_tokens=256)
    alone = [wait_for(engine, job) for job in jobs]

    again = [GenRequest(j.prompt_ids, j.adapter, max_tokens=j.max_tokens, temperature=0) for j in jobs]
    events: list[list[Event]] = [[] for _ in again]
    started, done = threading.Event(), threading.Semaphore(0)

    def listener(i: int):
        def emit(event: Event) -> None:
            events[i].append(event)
            started.set()
            if event.final:
                done.release()

        return emit

    for i in range(len(again) - 1):  # at once: prefilled together, side by side in one row
        engine.submit(again[i], listener(i))
    assert started.wait(60)
    engine.submit(again[-1], listener(len(again) - 1))  # joins the running batch
    for _ in again:
        assert done.acquire(timeout=120)
    engine.stop()
    assert engine.max_running >= 4
    for job, redo in zip(jobs, again, strict=True):
        steps, steps_again = seen[id(job)], seen[id(redo)]
        assert len(steps) == len(steps_again) > 0
        assert all(torch.equal(x, y) for x, y in zip(steps, steps_again, strict=True)), job.adapter
    assert [joined(e).text for e in events] == [a.text for a in alone]
