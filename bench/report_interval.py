"""Steps held by Ray Train's report interval: the shipped report schedule against reporting every logged step.

Ray 2.60's Train controller takes a worker's report from a one-slot queue every 2 s (its health-check interval), and
a worker's next ``ray.train.report`` waits for the slot. Baseline: a report at every logged step (``log_every=1``),
which raylora did before; ours: reports at evaluations, checkpoints and the last step (what ``raylora train`` does;
a sweep on the training loss also reports logged steps). Both train the tiny model for the same steps on one
worker, back to back in one Ray session, with Ray's default interval. Prints the median step time of each (from
the run's history: tokens / tokens per second at each logged step) and the ratio.

    .venv/bin/python bench/report_interval.py [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.pop("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", None)  # Ray's own 2 s, as users get it
ROOT = Path(__file__).resolve().parents[1]


def step_times(cfg, data, out: Path, report_every: int) -> list[float]:
    from raylora.train.fit import datasets
    from raylora.train.trainer import build_trainer, run_settings

    result = build_trainer(cfg, out, datasets(data), None, run_settings(cfg, out), report_every).fit()
    with result.checkpoint.as_directory() as folder:
        history = json.loads((Path(folder) / "history.json").read_text())
    clock = [h["tokens"] / h["tokens_per_s"] for h in history]
    return [b - a for a, b in zip(clock, clock[1:], strict=False)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    import ray

    from raylora.config import load_config
    from raylora.data.pipeline import training_data

    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            ROOT / "configs" / "tiny_lora_cpu.yaml",
            [f"train.max_steps={args.steps}", "train.log_every=1", "train.num_workers=1", "tracking.enabled=false",
             f"data.sources=[{{path: {ROOT / 'data' / 'raylora_identity.jsonl'}}}]", f"data.output_dir={tmp}/data"],
        )  # fmt: skip
        data = training_data(cfg, log=lambda s: None)
        ours = step_times(cfg, data, Path(tmp) / "ours", report_every=0)
        every = step_times(cfg, data, Path(tmp) / "every", report_every=1)
    ray.shutdown()
    ours_s, every_s = statistics.median(ours), statistics.median(every)
    print(f"tiny model, {args.steps} steps, 1 worker, Ray's default report interval")
    print(f"baseline (a report every logged step): median step {every_s * 1000:.0f} ms")
    print(f"raylora (reports at evaluations, checkpoints, last step): median step {ours_s * 1000:.0f} ms")
    print(f"ratio: {every_s / ours_s:.1f}x faster steps")


if __name__ == "__main__":
    main()
