"""Packed attention against sdpa over the block-causal mask (baseline), on SmolLM2-135M LoRA training steps.

One process builds the model twice (LoRA r=8 on every linear layer, dropout 0.05, the shipped training path:
bf16 autocast, fused LoRA, chunked loss, frozen weights in bf16); the baseline copy keeps transformers' sdpa, which
reads the (B, 1, T, T) block mask. Both take forward + backward steps on the same batch of two 512-token pack
rows of 3 and 4 examples (170/150/180 and 200/120/100/60 tokens, random ids), alternating, 2 torch threads.
Medians of ``--steps`` steps after one warm-up are printed with the ratio.

    .venv/bin/python bench/packed_attention.py [--steps 6]
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(2)
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
