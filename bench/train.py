"""Training scaling benchmark: 2 Ray Train workers against 1, same global batch, same data, back to back.

Baseline: one worker (one torch thread) with gradient accumulation 2. Ours: two gloo workers with one thread
each, one micro-batch each per step. (Ray Data keeps one of the machine's two CPUs for reading.) Both see 4 packed sequences per step.
Prints tokens/s of both, the scaling efficiency (tokens/s of 2 / (2 x tokens/s of 1)) and the largest
gap between the two loss curves.

    .venv/bin/python bench/train.py [--model smollm2-135m-instruct] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def run(tmp: Path, name: str, model: str, steps: int, workers: int, accum: int, cpus: float) -> dict:
    from raylora.config import load_config
    from raylora.train.fit import fit

    cfg = load_config(
        None,
        [
            f"data.sources=[{{path: {SHARED / 'alpaca_en_demo.json'}}}]", "data.max_samples=200", "data.cutoff_len=256",
            f"data.output_dir={tmp}/data", f"model.name_or_path={model}", "lora.target_modules=[attention,mlp]",
            f"train.output_dir={tmp}/{name}", f"train.max_steps={steps}", "train.batch_size=2", f"train.grad_accum={accum}",
            f"train.num_workers={workers}", f"train.cpus_per_worker={cpus}", "train.lr=5e-4", "train.scheduler=constant",
            "tracking.enabled=false", "backend.device=cpu",
        ],
    )  # fmt: skip
    result = fit(cfg, log=lambda s: None)
    history = result["history"]
    return {"tokens_per_s": history[-1]["tokens_per_s"], "losses": [h["loss"] for h in history]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        one = run(Path(tmp), "one", args.model, args.steps, workers=1, accum=2, cpus=1.0)
        two = run(Path(tmp), "two", args.model, args.steps, workers=2, accum=1, cpus=0.5)
    gap = max(abs(a - b) for a, b in zip(one["losses"], two["losses"], strict=True))
    mean = {k: statistics.mean(r["losses"]) for k, r in (("one", one), ("two", two))}
    spread = statistics.stdev(one["losses"] + two["losses"])
    print(f"model {args.model}, {args.steps} steps, 4 sequences of <=256 tokens per step, alpaca_en samples, 2 cores")
    print(
        f"1 worker (1 thread, grad_accum 2):  {one['tokens_per_s']:7.1f} tokens/s  losses {[round(x, 3) for x in one['losses']]}"
    )
    print(
        f"2 workers (1 thread each, gloo DDP):{two['tokens_per_s']:7.1f} tokens/s  losses {[round(x, 3) for x in two['losses']]}"
    )
    print(f"speed-up {two['tokens_per_s'] / one['tokens_per_s']:.2f}x, scaling efficiency {two['tokens_per_s'] / (2 * one['tokens_per_s']):.0%}; "
          f"largest loss gap {gap:.4f} (relative {gap / one['losses'][0]:.2%})")  # fmt: skip
    print(f"mean loss: 1 worker {mean['one']:.3f}, 2 workers {mean['two']:.3f}; difference {abs(mean['one'] - mean['two']):.3f} "
          f"against a per-step spread (std) of {spread:.3f}: the workers see the data in different orders")  # fmt: skip


if __name__ == "__main__":
    main()
