"""CPUs per training worker: `raylora train` with train.cpus_per_worker unset (the workers share the cluster's free
CPUs) against train.cpus_per_worker=1 (the default before), back to back and alternated, on the same machine.

Both: SmolLM2-135M-Instruct, the shared alpaca_en samples, data.cutoff_len 512, batch 2, LoRA r=8 alpha 16 on every
linear layer, one worker, 16 steps, the data prepared once before the runs. Prints each run's real tokens/s over its
16 steps (history.json) and the ratio of the medians.

    .venv/bin/python bench/cpus_per_worker.py [--steps 16] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALPACA = ROOT.parent / "shared" / "data" / "alpaca_en_demo.json"
SIDES = {"cpus_per_worker=1": ["train.cpus_per_worker=1"], "unset (shared free CPUs)": []}


def run(tmp: str, name: str, extra: list[str], steps: int) -> float:
    out = Path(tmp) / name.split()[0]
    args = [
        str(ROOT / ".venv" / "bin" / "raylora"), "train", str(ROOT / "configs" / "smollm2_lora_cpu.yaml"),
        f"data.sources.0.path={ALPACA}", "data.sources.0.format=alpaca", "data.cutoff_len=512",
        "train.batch_size=2", "lora.rank=8", "lora.alpha=16", "lora.dropout=0.05", "lora.target_modules=[all-linear]",
        f"train.max_steps={steps}", f"train.log_every={steps}", "train.lr=2e-4", "tracking.enabled=false",
        f"data.output_dir={tmp}/data", f"train.output_dir={out}", *extra,
    ]  # fmt: skip
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }
    subprocess.run(args, check=True, cwd=ROOT, env=env, capture_output=True)
    history = json.loads((out / "history.json").read_text())
    subprocess.run(["rm", "-rf", str(out)], check=True)
    return history[-1]["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    figures: dict[str, list[float]] = {name: [] for name in SIDES}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for name, extra in SIDES.items():
                figures[name].append(run(tmp, name, extra, args.steps))
                print(f"{name}: {figures[name][-1]:.0f} real tokens/s", flush=True)
    one, shared = (statistics.median(v) for v in figures.values())
    print(f"unset / cpus_per_worker=1: {shared / one:.2f}x ({shared:.0f} vs {one:.0f} tokens/s, medians of "
          f"{args.repeats}, {os.cpu_count()} cores)")  # fmt: skip


if __name__ == "__main__":
    main()
