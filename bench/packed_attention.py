"""Packed attention against sdpa over the block-causal mask (baseline), on SmolLM2-135M LoRA training steps.

One process builds the model twice (LoRA r=8 on every linear layer, dropout 0.05, the shipped training path:
bf16 autocast, fused LoRA, chunked loss, frozen weights in bf16); the baseline copy keeps transformers' sdpa, which
reads the (B, 1, T, T) block mask. Both take forward + backward steps on the same batch of two 512-token pack
rows of 3 and 4 examples (170/150/180 and 200/120/100/60 tokens, random ids), alternating, 2 torch threads.
Medians of ``--steps`` steps after one warm-up are printed with the ratio.

``--blocks``: our kernel splitting examples of ``SPLIT_FROM`` tokens or more into query blocks (shipped) against
the same kernel computing each example's whole n x n square (``SPLIT_FROM`` set past any length: the kernel as
it was before blocks, but for its zero-initialised key and value gradients), alternated in one process. First one example's attention alone, forward + backward, bf16,
SmolLM2's heads, 128 to 512 tokens (median of 15 alternated runs); then whole training steps of the shipped model
on the throughput benchmark's data (the shared alpaca samples chat-encoded and packed into 512-token rows as
``raylora prepare`` packs them, micro-batches of 2 rows in the seeded epoch order), each micro-batch forward +
backward both ways, in alternating order; real tokens/s of each and the ratio.

``--kernels``: one example's causal attention alone, forward + backward, bf16, SmolLM2's 9 query heads over 3
key/value heads of 64, 2 threads, at 32 to 512 tokens: our CPU kernel (``CausalAttention``) against sdpa's 3-D
call with grouped heads (math kernel) and its 4-D call with repeated key/value heads (flash kernel), median of
10 runs after two warm-ups each, with each one's relative error against the fp32 result.

    .venv/bin/python bench/packed_attention.py [--steps 6] [--kernels | --blocks [--batches 16]]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from raylora.backends import resolve_backend  # noqa: E402
from raylora.config import BackendArgs, LoraArgs, ModelArgs, TrainArgs  # noqa: E402
from raylora.data.collate import collate_packs  # noqa: E402
from raylora.models import attach_lora, load_model  # noqa: E402
from raylora.train.lm import training_model  # noqa: E402

EXAMPLES = ([170, 150, 180], [200, 120, 100, 60])


def _rows() -> list[dict]:
    gen = random.Random(0)
    rows = []
    for lens in EXAMPLES:
        ids = [gen.randrange(3, 40000) for _ in range(sum(lens))]
        rows.append({
            "input_ids": ids, "labels": [t if gen.random() > 0.3 else -100 for t in ids],
            "position_ids": [i for n in lens for i in range(n)], "seq_lens": lens, "num_tokens": sum(lens),
        })  # fmt: skip
    return rows


def _model(backend, packed: bool):
    base, _ = load_model(ModelArgs(name_or_path="smollm2-135m-instruct"))
    model = attach_lora(base, LoraArgs(rank=8, alpha=16, dropout=0.05, target_modules=["all-linear"]))
    model.train()
    if packed:
        return training_model(model, TrainArgs(), backend)
    with mock.patch("raylora.train.lm.use_packed_attention", return_value=False):
        return training_model(model, TrainArgs(), backend)


def kernels() -> None:
    import torch.nn.functional as F

    from raylora.ops.packed_attention import CausalAttention

    def flash(q, k, v, scale):
        k, v = (t.repeat_interleave(q.shape[0] // t.shape[0], 0) for t in (k, v))
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)[0]

    paths = {
        "ours (CausalAttention)": CausalAttention.apply,
        "sdpa 3-D, grouped heads": lambda q, k, v, s: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=s, enable_gqa=True
        ),
        "sdpa 4-D, flash": flash,
    }

    def run(path, inputs, grad, dtype, repeats):
        xs = [x.to(dtype).requires_grad_() for x in inputs]
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            out = path(*xs, 0.125)
            grads = torch.autograd.grad(out, xs, grad.to(dtype))
            times.append(time.perf_counter() - started)
        return statistics.median(times[2:]), [t.float() for t in (out, *grads)]

    for n in (32, 64, 128, 256, 384, 512):
        gen = torch.Generator().manual_seed(n)
        inputs = [torch.randn(h, n, 64, generator=gen) for h in (9, 3, 3)]
        grad = torch.randn(9, n, 64, generator=gen)
        _, exact = run(flash, inputs, grad, torch.float32, 3)
        figures = {}
        for name, path in paths.items():
            seconds, got = run(path, inputs, grad, torch.bfloat16, 12)
            error = max(((a - b).norm() / b.norm()).item() for a, b in zip(got, exact, strict=True))
            figures[name] = seconds
            print(f"{n} tokens, {name}: {seconds * 1e3:.2f} ms, relative error {error:.4f}")
        faster = min(v for k, v in figures.items() if k.startswith("sdpa"))
        print(f"{n} tokens: ours {faster / figures['ours (CausalAttention)']:.2f}x the faster sdpa kernel")


def blocks(batches: int) -> None:
    from raylora.data.packs import epoch_order
    from raylora.model_files import load_tokenizer
    from raylora.ops import packed_attention as packed

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ray_helpers import packed_rows
    from train_throughput import SEED

    shipped = packed.SPLIT_FROM
    ways = {"whole square (baseline)": 10**9, "query blocks": shipped}
    print(f"query blocks of about {packed.QUERY_BLOCK} rows from {shipped} tokens; load average before: "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    for n in (128, 192, 256, 320, 384, 448, 512):
        gen = torch.Generator().manual_seed(n)
        xs = [torch.randn(h, n, 64, generator=gen).bfloat16().requires_grad_() for h in (9, 3, 3)]
        grad = torch.randn(9, n, 64, generator=gen).bfloat16()
        times = {name: [] for name in ways}
        for rep in range(17):
            for name, split_from in ways.items() if rep % 2 == 0 else reversed(ways.items()):
                packed.SPLIT_FROM = split_from
                started = time.perf_counter()
                torch.autograd.grad(packed.CausalAttention.apply(*xs, 0.125), xs, grad)
                if rep >= 2:
                    times[name].append(time.perf_counter() - started)
        base, ours = (statistics.median(t) for t in times.values())
        print(f"{n} tokens: whole square {base * 1e3:.2f} ms, query blocks {ours * 1e3:.2f} ms: {base / ours:.2f}x")
    backend = resolve_backend(BackendArgs(device="cpu", precision="bf16"))
    loss_model, notes = _model(backend, True)
    print(f"training path: {'; '.join(notes)}")
    tokenizer = load_tokenizer(ModelArgs(name_or_path="smollm2-135m-instruct"))
    rows = packed_rows(tokenizer)
    order = epoch_order(len(rows), SEED, 0)
    seconds, tokens = {name: 0.0 for name in ways}, 0
    for i in range(batches + 1):
        pair = [rows[j] for j in order[2 * i : 2 * i + 2]]
        batch = collate_packs(pair, tokenizer.pad_token_id, torch.bfloat16, 512)
        for name, split_from in ways.items() if i % 2 == 0 else reversed(ways.items()):
            packed.SPLIT_FROM = split_from
            started = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_model(**batch)
            loss.backward()
            loss_model.zero_grad(set_to_none=True)
            if i:  # the first micro-batch warms both up
                seconds[name] += time.perf_counter() - started
        tokens += sum(r["num_tokens"] for r in pair) if i else 0
    base, ours = (tokens / s for s in seconds.values())
    print(f"training steps, {batches} micro-batches of 2 x 512 ({tokens} real tokens), forward + backward: whole "
          f"square {base:.1f} real tokens/s, query blocks {ours:.1f}: {ours / base:.3f}x; load average after: "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kernels", action="store_true", help="one example's attention kernels alone")
    parser.add_argument("--blocks", action="store_true", help="query blocks against the whole square per example")
    parser.add_argument("--batches", type=int, default=16, help="micro-batches of --blocks' training steps")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.kernels:
        kernels()
        return
    if args.blocks:
        blocks(args.batches)
        return
    backend = resolve_backend(BackendArgs(device="cpu", precision="bf16"))
    models = {"sdpa over the block mask (baseline)": _model(backend, False), "packed attention": _model(backend, True)}
    for name, (_, notes) in models.items():
        print(f"{name}: {'; '.join(notes)}")
    batch = collate_packs(_rows(), 0, torch.bfloat16, 512)
    times = {name: [] for name in models}
    for step in range(args.steps + 1):
        for name, (loss_model, _) in models.items():
            started = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_model(**batch)
            loss.backward()
            loss_model.zero_grad(set_to_none=True)
            if step:
                times[name].append(time.perf_counter() - started)
    base, ours = (statistics.median(t) for t in times.values())
    print(f"load average before/after: {os.getloadavg()[0]:.2f} (1 min)")
    print(f"step (forward + backward, 2 x 512 tokens): baseline {base:.2f} s, packed {ours:.2f} s: {base / ours:.2f}x")


if __name__ == "__main__":
    main()
