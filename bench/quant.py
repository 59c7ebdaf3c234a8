"""Serving quantisation benchmark: SmolLM2-135M-Instruct in fp32, bf16, W8A8 and W8A8-SmoothQuant.

Baseline: the faster of the unquantised precisions (fp32, bf16) at each batch size, for speed; fp32 for
perplexity and size. Ours: ``raylora.ops.quantize_model`` with ``w8a8`` and ``w8a8-smoothquant`` (alpha 0.5,
calibrated on 32 alpaca_en rows rendered with the tokenizer's chat template).

Prints, per precision: weight bytes (ratio to fp32; target <= 0.3), perplexity on 64 other alpaca_en rows
(target: SmoothQuant within 1% of fp32), greedy decode tokens/s at batch 1, 8 and 16 (32-token prompts, 64 new
tokens, one KV-cache decode loop for all, best of ``--repeats`` runs interleaved across precisions so that
load from other users of the machine hits all alike; target >= 1.3x the best unquantised), and how often
its most likely next token (teacher-forced, on the perplexity rows) is fp32's.

    .venv/bin/python bench/quant.py [--repeats 5] [--new-tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
MODEL = "smollm2-135m-instruct"
# Decode batch sizes; 16 is the serving engine's batch.
BATCHES = (1, 8, 16)


def rows(tokenizer, start: int, count: int, max_len: int = 512) -> list:
    """``count`` alpaca_en rows from ``start``, each a 1-D LongTensor of its chat-template rendering."""
    data = json.loads((SHARED / "alpaca_en_demo.json").read_text())[start : start + count]
    out = []
    for r in data:
        prompt = f"{r['instruction']}\n\n{r['input']}" if r["input"].strip() else r["instruction"]
        chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": r["output"]}]
        text = tokenizer.apply_chat_template(chat, tokenize=False)
        out.append(torch.tensor(tokenizer(text, add_special_tokens=False).input_ids[:max_len]))
    return out


def perplexity(model, sequences: list) -> tuple[float, torch.Tensor]:
    """exp of the mean next-token loss over every token of ``sequences`` (each run alone), and the argmax tokens."""
    total, count, argmax = 0.0, 0, []
    with torch.inference_mode():
        for ids in sequences:
            logits = model(input_ids=ids[None]).logits[0, :-1].float()
            total += torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum").item()
            count += ids.numel() - 1
            argmax.append(logits.argmax(-1))
    return math.exp(total / count), torch.cat(argmax)


def decode(model, prompts: torch.Tensor, new_tokens: int) -> float:
    """Greedy decode with a KV cache; returns decode tokens/s (after the prefill)."""
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=prompts, cache=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(input_ids=token, cache=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        seconds = time.perf_counter() - start
    return prompts.shape[0] * (new_tokens - 1) / seconds


def build(name: str, calibration: list):
    from raylora.config import ModelArgs
    from raylora.models import load_model
    from raylora.ops import quantize_model

    model, _ = load_model(ModelArgs(name_or_path=MODEL, dtype="bfloat16" if name == "bf16" else "float32"))
    summary = None
    if name.startswith("w8a8"):
        summary = quantize_model(model, name, calibration=calibration if "smooth" in name else None, alpha=0.5)
    return model, summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5, help="decode runs per precision and batch; the best counts")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from raylora.config import ModelArgs
    from raylora.model_files import load_tokenizer
    from raylora.ops import weight_bytes

    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(ModelArgs(name_or_path=MODEL))
    calibration, held_out = rows(tokenizer, 0, 32), rows(tokenizer, 32, 64)
    # 32-token prompts from held-out rows, cut to one length so that no batch needs padding.
    prompts = torch.stack([r[:32] for r in held_out[: max(BATCHES)]])

    names = ["fp32", "bf16", "w8a8", "w8a8-smoothquant"]
    models, results = {}, {}
    for name in names:
        start = time.perf_counter()
        models[name], summary = build(name, calibration)
        build_s = time.perf_counter() - start
        ppl, argmax = perplexity(models[name], held_out)
        results[name] = {
            "bytes": weight_bytes(models[name]),
            "build_s": build_s,
            "kernel": summary["kernel"] if summary else "-",
            "ppl": ppl,
            "argmax": argmax,
            "tok_s": dict.fromkeys(BATCHES, 0.0),
        }
    for batch in BATCHES:
        for name in names:
            decode(models[name], prompts[:batch], 8)  # warm-up: kernel selection, allocator, caches
        for _ in range(args.repeats):
            for name in names:
                speed = decode(models[name], prompts[:batch], args.new_tokens)
                results[name]["tok_s"][batch] = max(results[name]["tok_s"][batch], speed)

    fp32 = results["fp32"]
    best = {b: max(results[n]["tok_s"][b] for n in ("fp32", "bf16")) for b in BATCHES}
    print(
        f"model {MODEL}, {torch.get_num_threads()} threads; ppl on 64 held-out alpaca_en rows (<=512 tokens), "
        f"calibration on 32 other rows; decode: 32-token prompts, {args.new_tokens} new tokens, greedy, "
        f"best of {args.repeats} (shared CPU: other users' load makes single runs noisy)"
    )
    print(
        f"{'precision':18} {'weights MB':>10} {'vs fp32':>8} {'ppl':>8} {'vs fp32':>8} {'tok/s b1':>9} "
        f"{'tok/s b8':>9} {'tok/s b16':>9} {'top-1=fp32':>10}  kernel"
    )
    for name in names:
        r = results[name]
        same = (r["argmax"] == fp32["argmax"]).float().mean().item()
        print(
            f"{name:18} {r['bytes'] / 1e6:10.1f} {r['bytes'] / fp32['bytes']:8.3f} {r['ppl']:8.3f} "
            f"{r['ppl'] / fp32['ppl'] - 1:+8.2%} {r['tok_s'][1]:9.1f} {r['tok_s'][8]:9.1f} {r['tok_s'][16]:9.1f} "
            f"{same:10.1%}  {r['kernel']}"
        )
    for name in ("w8a8", "w8a8-smoothquant"):
        r = results[name]
        print(
            f"{name}: decode vs best unquantised {r['tok_s'][1] / best[1]:.2f}x at batch 1, "
            f"{r['tok_s'][8] / best[8]:.2f}x at batch 8, {r['tok_s'][16] / best[16]:.2f}x at batch 16 "
            f"(targets >= 1.3x); weights {r['bytes'] / fp32['bytes']:.3f}x "
            f"fp32 (target <= 0.3); ppl {r['ppl'] / fp32['ppl'] - 1:+.2%} vs fp32; loaded and quantised in {r['build_s']:.1f} s"
        )


if __name__ == "__main__":
    main()
