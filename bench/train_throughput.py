"""Training throughput: `raylora train` against Hugging Face Trainer + peft, back to back on the same machine.

Baseline: `transformers.Trainer` + peft with its usual padding collator (`DataCollatorForSeq2Seq`, labels padded
with -100), batch 4, in fp32 and with `bf16=True`. Ours: `raylora train` (`fit()`, one Ray Train worker) with the
shipped `configs/smollm2_lora_cpu.yaml` (fast defaults: precision auto, fused LoRA, chunked loss), 2 packed
sequences of <= 512 tokens per step, then the lean configuration (chunked loss + recompute) at N in
{off, 4, 2, 1}, and with `train.compile: true`. Both sides: the shared alpaca_en samples (the last 32 rows held out for eval), length cap 512,
LoRA r=8, alpha 16, dropout 0.05 on every linear layer, lr 2e-4 with linear decay, seed 42.

Every run is its own process (peak resident memory is that process's, or the Ray worker's for ours). Figures:
real (non-padding) tokens per second of training, model FLOPs utilisation, peak memory, and the eval loss of the
saved adapter on the same 32 held-out rows (fp32, per label token) after about the same number of real tokens.
MFU = 4 * N * real tokens/s / matmul peak: N is the base model's parameter count (forward 2N, backward 2N for
the input gradients; a frozen base computes no weight gradients), attention's own FLOPs are left out, and the
peak is a 2048^3 GEMM in the run's precision measured by this script just before the runs.

Our single worker takes every core (train.cpus_per_worker = cores), as the baseline's process does: training reads
the prepared shards from Ray's object store, with no Ray Data task asking for a CPU. The load averages before and
after the runs are printed: on a shared machine, quote figures only with them.
With --profile, one more run of the shipped configuration with train.profile=true prints its top operators.

    .venv/bin/python bench/train_throughput.py [--size smollm2|tiny|both] [--hf-steps 12] [--skip-recompute] [--skip-compile]
        [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
ALPACA = ROOT.parent / "shared" / "data" / "alpaca_en_demo.json"
CONFIG = ROOT / "configs" / "smollm2_lora_cpu.yaml"
MODELS = {"smollm2": "smollm2-135m-instruct", "tiny": "tiny-llama"}
EVAL_ROWS, CUTOFF, SEED = 32, 512, 42


def alpaca_rows() -> tuple[list[dict], list[dict]]:
    rows = json.loads(ALPACA.read_text())
    return rows[:-EVAL_ROWS], rows[-EVAL_ROWS:]


def encode(rows: list[dict], tokenizer) -> list[dict]:
    """Chat-template encoding with the prompt masked, truncated at :data:`CUTOFF` (the baseline's dataset)."""
    out = []
    for row in rows:
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        user = [{"role": "user", "content": prompt}]
        head = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": row["output"]}], tokenize=False)
        head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
        ids = tokenizer(full, add_special_tokens=False)["input_ids"][:CUTOFF]
        labels = ([-100] * len(head_ids) + ids[len(head_ids) :])[: len(ids)]
        out.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels})
    return out


def load(size: str):
    from raylora.config import ModelArgs
    from raylora.models import load_model

    model, tokenizer = load_model(ModelArgs(name_or_path=MODELS[size]))
    return model, tokenizer


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")


def eval_loss(model, tokenizer) -> float:
    """Loss per label token of ``model`` on the held-out rows, fp32, batches of 4 padded rows."""
    import torch
    import torch.nn.functional as F
    from transformers import DataCollatorForSeq2Seq

    collate = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    rows = encode(alpaca_rows()[1], tokenizer)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(rows), 4):
            batch = collate(rows[i : i + 4])
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
            labels = batch["labels"][:, 1:]
            total += F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), reduction="sum").item()
            count += int((labels != -100).sum())
    return total / count


def base_parameters(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)


def run_hf(size: str, precision: str, steps: int) -> dict:
    import torch
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainerCallback, TrainingArguments

    model, tokenizer = load(size)
    params = base_parameters(model)
    model = get_peft_model(model.train(), lora_config())
    train = Dataset.from_list(encode(alpaca_rows()[0], tokenizer))
    padded = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    real, slots, ends = [], [], []

    def collate(features):
        batch = padded(features)
        real.append(int(batch["attention_mask"].sum()))
        slots.append(batch["attention_mask"].numel())
        return batch

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=4, max_steps=steps, learning_rate=2e-4,
            lr_scheduler_type="linear", bf16=precision == "bf16", logging_steps=steps, save_strategy="no",
            report_to=[], seed=SEED, use_cpu=True, dataloader_num_workers=0,
        )  # fmt: skip
        trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collate, callbacks=[Clock()])
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    real, slots = real[:steps], slots[:steps]  # the loader may have collated a batch ahead
    return {
        "tokens": sum(real), "tokens_per_s": sum(real) / seconds, "steady_tokens_per_s": sum(real[1:]) / (ends[-1] - ends[0]),
        "padding": 1 - sum(real) / sum(slots), "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "eval_loss": eval_loss(model, tokenizer), "params": params, "threads": torch.get_num_threads(),
        "tokens_per_step": sum(slots) / steps,
    }  # fmt: skip


def run_ours(size: str, steps: int, recompute: int, compile_layers: bool, tmp: str, profile: bool = False) -> dict:
    import ray
    from peft import PeftModel

    from raylora.config import load_config
    from raylora.train.fit import fit

    cores = os.cpu_count() or 1
    ray.init(num_cpus=cores, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=True)
    cfg = load_config(
        CONFIG,
        [
            f"data.sources=[{{path: {ALPACA}, format: alpaca}}]", f"data.max_samples={len(alpaca_rows()[0])}",
            f"data.cutoff_len={CUTOFF}", f"data.output_dir={tmp}/data", f"model.name_or_path={MODELS[size]}",
            "lora.rank=8", "lora.alpha=16", "lora.dropout=0.05", "lora.target_modules=[all-linear]",
            "train.lr=2e-4", "train.scheduler=linear", f"train.max_steps={steps}", "train.batch_size=2",
            f"train.output_dir={tmp}/run-{recompute}-{compile_layers}-{profile}", f"train.cpus_per_worker={cores}",
            "train.log_every=1", f"train.profile={str(profile).lower()}",
            f"train.recompute_every={recompute}", f"train.seed={SEED}", "tracking.enabled=false",
            f"train.compile={str(compile_layers).lower()}",
        ],
    )  # fmt: skip
    result = fit(cfg, log=lambda s: None)
    ray.shutdown()
    history = result["history"]
    last = history[-1]
    clock = [h["tokens"] / h["tokens_per_s"] for h in history]  # seconds since the loop started, at each step
    base, tokenizer = load(size)
    params = base_parameters(base)
    adapted = PeftModel.from_pretrained(base, result["adapter"])
    return {
        "tokens_per_s": last["tokens_per_s"], "tokens": last["tokens"], "peak_mb": last["peak_memory_mb"],
        "steady_tokens_per_s": (last["tokens"] - history[0]["tokens"]) / (clock[-1] - clock[0]),
        "first_step_s": clock[0],
        "eval_loss": eval_loss(adapted, tokenizer),
        "params": params, "threads": cores, "tokens_per_step": 2 * CUTOFF, "train_loss": last["loss"],
        **({"top_operators": (Path(result["adapter"]).parent / "profile" / "top_operators.txt").read_text()} if profile else {}),
    }  # fmt: skip


def child(spec: dict) -> dict:
    if spec["side"] == "hf":
        return run_hf(spec["size"], spec["precision"], spec["steps"])
    return run_ours(spec["size"], spec["steps"], spec["recompute"], spec["compile"], spec["tmp"], spec["profile"])


def launch(spec: dict, script: str = __file__) -> dict:
    """Run one side in its own process (``script --child SPEC``: this bench's, or bench/preference.py's); returns
    its figures (the last line it prints)."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, script, "--child", json.dumps(spec)], capture_output=True, text=True, cwd=ROOT
    )
    if done.returncode != 0:
        raise SystemExit(f"{spec} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - started
    path = [line for line in done.stdout.splitlines() + done.stderr.splitlines() if "training path:" in line]
    result["path"] = path[-1].split("training path:", 1)[1].strip() if path else ""
    return result


def peaks() -> dict[str, float]:
    import torch

    from raylora.backends.cpu import gemm_gflops

    fp32, bf16 = gemm_gflops((torch.float32, torch.bfloat16), size=2048, repeats=5)
    return {"fp32": fp32, "bf16": bf16}


def bench(size: str, hf_steps: int, recompute: bool, compile_layers: bool, profile: bool) -> None:
    load_before = os.getloadavg()
    peak = peaks()
    print(f"\n== {size} ({MODELS[size]}), {os.cpu_count()} cores; matmul peak measured now: "
          f"fp32 {peak['fp32']:.0f}, bf16 {peak['bf16']:.0f} GFLOP/s (2048^3 GEMM, best of 5 alternated)", flush=True)  # fmt: skip
    runs = {}
    for precision in ("fp32", "bf16"):
        runs[f"HF Trainer + peft, {precision}"] = launch(
            {"side": "hf", "size": size, "precision": precision, "steps": hf_steps}
        )
        print(f"  done: HF {precision}: {json.dumps(runs[f'HF Trainer + peft, {precision}'])}", flush=True)
    hf_tokens = runs["HF Trainer + peft, fp32"]["tokens"]
    steps = max(2, round(hf_tokens / (2 * CUTOFF * 0.95)))  # packs are ~95% full: about the baseline's real tokens
    settings = (
        [(0, False)]
        + ([(4, False), (2, False), (1, False)] if recompute else [])
        + ([(0, True)] if compile_layers else [])
    )
    with tempfile.TemporaryDirectory() as tmp:
        for n, compiled in settings:
            name = "raylora train (shipped config)" if n == 0 else f"raylora train, recompute every {n}"
            name = "raylora train, train.compile=true" if compiled else name
            spec = {"side": "ours", "size": size, "steps": steps, "recompute": n, "compile": compiled, "tmp": tmp,
                    "profile": False}  # fmt: skip
            runs[name] = launch(spec)
            print(f"  done: {name}: {json.dumps(runs[name])}", flush=True)
        if profile:
            spec = {"side": "ours", "size": size, "steps": max(steps, 6), "recompute": 0, "compile": False, "tmp": tmp,
                    "profile": True}  # fmt: skip
            profiled = launch(spec)
    load_after = os.getloadavg()
    print(
        f"baseline: {hf_steps} steps of 4 padded rows; ours: {steps} steps of 2 packed sequences of <= {CUTOFF} tokens"
    )
    print("MFU = 4 * N * real tokens/s / matmul peak of the precision in use; "
          f"N = {runs['HF Trainer + peft, fp32']['params'] / 1e6:.1f} M base parameters")  # fmt: skip
    print("real tokens/s: steady = after the first step (which also starts the data loading); all = whole run")
    print(
        "| run | precision | real tokens/s steady (all) | MFU (steady) | peak memory | tokens/step (slots) | real tokens | eval loss | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        chosen = re.search(r"precision: (?:auto|asked for): (\w+)", r["path"])
        precision = "bf16" if "bf16" in name or (chosen and chosen.group(1) == "bf16") else "fp32"
        mfu = 4 * r["params"] * r["steady_tokens_per_s"] / (peak[precision] * 1e9)
        print(f"| {name} | {precision} | {r['steady_tokens_per_s']:.0f} ({r['tokens_per_s']:.0f}) | {mfu:.1%} | "
              f"{r['peak_mb'] / 1024:.2f} GB | {r['tokens_per_step']:.0f} | {r['tokens']} | {r['eval_loss']:.4f} | {r['wall_s']:.0f} |")  # fmt: skip
    ours = runs["raylora train (shipped config)"]
    print(f"our path: {ours['path']}")
    speed = {}
    for key, what in (("steady_tokens_per_s", "steady"), ("tokens_per_s", "whole run")):
        faster = max(runs["HF Trainer + peft, fp32"][key], runs["HF Trainer + peft, bf16"][key])
        speed[key] = f"speed ({what}): ours / faster baseline = {ours[key] / faster:.2f}x (target >= 2.0x)"
        print(speed[key])
    if recompute:
        lean = min((runs[f"raylora train, recompute every {n}"] for n in (4, 2, 1)), key=lambda r: r["peak_mb"])
        ratio = lean["peak_mb"] / runs["HF Trainer + peft, fp32"]["peak_mb"]
        print(f"memory: leanest ours / HF fp32 = {ratio:.2f} (target <= 0.35)")
    if compile_layers:
        compiled = runs["raylora train, train.compile=true"]
        print(f"torch.compile: steady {compiled['steady_tokens_per_s'] / ours['steady_tokens_per_s']:.2f}x eager; "
              f"first step {compiled['first_step_s']:.0f} s against {ours['first_step_s']:.0f} s (compilation)")  # fmt: skip
    if profile:
        print(f"top operators of the shipped configuration (train.profile, steps 3-5):\n{profiled['top_operators']}")
    print(f"load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; "
          f"after: {', '.join(f'{x:.2f}' for x in load_after)} ({os.cpu_count()} cores)")  # fmt: skip
    print(f"padding in the baseline's batches: {runs['HF Trainer + peft, fp32']['padding']:.0%}")
    spread = abs(ours["eval_loss"] - runs["HF Trainer + peft, fp32"]["eval_loss"])
    print(f"eval loss: ours {ours['eval_loss']:.4f}, HF fp32 {runs['HF Trainer + peft, fp32']['eval_loss']:.4f}, "
          f"HF bf16 {runs['HF Trainer + peft, bf16']['eval_loss']:.4f} (difference {spread:.4f})")  # fmt: skip
    from chart import IMG, bars  # here, not at the top: the --child processes' peak memory leaves matplotlib out

    shipped_first = sorted(runs, key=lambda name: name != "raylora train (shipped config)")
    bars(
        IMG / f"train_throughput_{size}.png",
        f"Training tokens/s: raylora vs Hugging Face Trainer ({MODELS[size]})",
        {name: runs[name]["steady_tokens_per_s"] for name in shipped_first},
        "real tokens/s after the first step (higher is better)",
        f"{speed['steady_tokens_per_s']}\n{os.cpu_count()} cores, one process per run, back to back",
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=("smollm2", "tiny", "both"), default="both")
    parser.add_argument("--hf-steps", type=int, default=12)
    parser.add_argument("--skip-recompute", action="store_true")
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--profile", action="store_true", help="one more profiled run: its top operators")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return
    if not ALPACA.is_file():
        raise SystemExit(f"{ALPACA} is missing: this benchmark needs the shared alpaca_en samples")
    for size in ("tiny", "smollm2") if args.size == "both" else (args.size,):
        bench(size, args.hf_steps, not args.skip_recompute, not args.skip_compile, args.profile)


if __name__ == "__main__":
    main()
