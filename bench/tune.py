"""Sweep benchmark: the same 8-trial grid on the tiny model, ASHA against no scheduler, back to back.

Baseline: every trial runs to train.max_steps (tune.scheduler=none). Ours: ASHA (reduction factor 2, rungs
at 2, 4, 8 and 16 of 32 steps) stops trials whose eval loss lags. Each trial pays Ray Train's start-up (about
30 s here) however early it stops, so ASHA's gain grows with the budget: --steps sets it. Both search the same grid (lora.rank 4 / 16 x
train.lr 3e-2 / 1e-2 / 1e-3 / 1e-4) with two trials at a time on a 2-core machine, in one Ray session.
Prints the wall time of each sweep, how many trials ASHA stopped, the best eval loss of each and the ratio. Then,
to say what "within noise" means here, it trains the no-scheduler sweep's best config with three other seeds
(train.seed: LoRA's initial weights and dropout masks) and prints how far apart those equal configs land.

    .venv/bin/python bench/tune.py [--steps 32]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
SPACE = "tune.space={lora.rank: {grid: [4, 16]}, train.lr: {grid: [3.0e-2, 1.0e-2, 1.0e-3, 1.0e-4]}}"


def run(tmp: Path, name: str, scheduler: str, steps: int, space: str = SPACE, *overrides: str) -> dict:
    from raylora.config import load_config
    from raylora.tune.sweep import sweep

    cfg = load_config(
        ROOT / "configs" / "tiny_sweep_cpu.yaml",
        [
            space, "tune.search=grid", "tune.num_samples=1", f"tune.scheduler={scheduler}", f"train.max_steps={steps}",
            f"data.sources=[{{path: {ROOT / 'data' / 'raylora_identity.jsonl'}}}]", f"data.output_dir={tmp}/data",
            f"train.output_dir={tmp}/{name}", "tracking.enabled=false", *overrides,
        ],
    )  # fmt: skip
    started = time.perf_counter()
    result = sweep(cfg, log=lambda s: None)
    return {
        "seconds": time.perf_counter() - started,
        "stopped": sum(r["status"] == "stopped early" for r in result["trials"]),
        "steps": sum(r["steps"] for r in result["trials"]),
        "best": result["best"],
        "metrics": [r["metric"] for r in result["trials"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    from raylora.cluster import ensure_ray

    ensure_ray()
    with tempfile.TemporaryDirectory() as tmp:
        run(Path(tmp), "warm-up", "none", 2)  # warm-up: data prepared, Ray's worker processes and imports cached
        asha = run(Path(tmp), "asha", "asha", args.steps)
        full = run(Path(tmp), "none", "none", args.steps)
        fixed = [f"{k}={v}" for k, v in full["best"]["config"].items()]
        seeds = run(Path(tmp), "seeds", "none", args.steps, "tune.space={train.seed: {grid: [1, 2, 3]}}", *fixed)
    print(
        f"tiny Llama, 8 trials (rank 4/16 x lr 3e-2/1e-2/1e-3/1e-4), {args.steps} steps each, 2 trials at a time, 2 cores"
    )
    for name, r in (("ASHA", asha), ("no scheduler", full)):
        best = ", ".join(f"{k}={v}" for k, v in r["best"]["config"].items())
        print(f"{name:13s} {r['seconds']:6.1f} s  stopped {r['stopped']}/8  steps run {r['steps']:3d}  "
              f"best eval_loss {r['best']['metric']:.4f} ({best})")  # fmt: skip
    print(
        f"wall time ratio (no scheduler / ASHA): {full['seconds'] / asha['seconds']:.2f}x; "
        f"best eval_loss difference {asha['best']['metric'] - full['best']['metric']:+.4f}"
    )
    spread = seeds["metrics"] + [full["best"]["metric"]]
    print(
        f"noise: the no-scheduler best ({', '.join(fixed)}) with the sweep's seed and train.seed 1, 2, 3: eval_loss "
        f"{min(spread):.4f} to {max(spread):.4f} (spread {max(spread) - min(spread):.4f}, "
        f"{(max(spread) - min(spread)) / min(spread):.1%})"
    )


if __name__ == "__main__":
    main()
