"""What a Ray Train run costs around its training: raylora's trainer against Ray's ``TorchTrainer`` as shipped.

Ours: :class:`raylora.train.lean.LeanTorchTrainer`, which starts no dataset manager (a run of prepared packs has no
Ray Dataset) and no placement-group cleaner. Baseline: Ray's ``TorchTrainer`` with every default helper, built from
the same arguments (``build_trainer`` with the class swapped). Each run: the tiny Llama, 2 gloo workers, 4 steps,
the data prepared once before, MLflow off, on one local cluster with Ray's own settings; the runs alternate, ours
first. Per run: wall seconds of ``fit`` and busy CPU seconds of the whole machine (``/proc/stat``: every Ray process
the run starts); printed: each run, the medians and the ratios.

    .venv/bin/python bench/run_start.py [--runs 4] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ROOT = Path(__file__).resolve().parents[1]


def busy_cpu_s() -> float:
    """Busy CPU seconds of the whole machine so far (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return sum(fields[i] for i in (0, 1, 2, 5, 6, 7)) / os.sysconf("SC_CLK_TCK")


def one_run(trainer_cls, cfg) -> tuple[float, float]:
    """Wall and busy CPU seconds of one ``fit`` with ``trainer_cls`` as raylora's trainer class."""
    import raylora.train.lean as lean
    from raylora.train.fit import fit

    shipped, lean.LeanTorchTrainer = lean.LeanTorchTrainer, trainer_cls  # build_trainer imports it at each call
    try:
        cpu, start = busy_cpu_s(), time.perf_counter()
        fit(cfg, log=lambda s: None)
        return time.perf_counter() - start, busy_cpu_s() - cpu
    finally:
        lean.LeanTorchTrainer = shipped


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    from ray.train.torch import TorchTrainer

    from raylora.cluster import ensure_ray
    from raylora.config import load_config
    from raylora.data.pipeline import training_data
    from raylora.train.lean import LeanTorchTrainer

    ensure_ray()
    results: dict[str, list[tuple[float, float]]] = {"ours": [], "baseline": []}
    with tempfile.TemporaryDirectory() as tmp:

        def job(name: str):
            return load_config(
                ROOT / "configs" / "tiny_lora_cpu.yaml",
                [f"train.output_dir={tmp}/{name}", f"data.output_dir={tmp}/data", "tracking.enabled=false",
                 f"train.num_workers={args.workers}", "train.batch_size=2", "train.max_steps=4",
                 f"data.sources=[{{path: {ROOT / 'data' / 'raylora_identity.jsonl'}}}]"],
            )  # fmt: skip

        training_data(job("warm"), log=lambda s: None).finish()
        one_run(LeanTorchTrainer, job("warm"))  # the first run on a cluster starts its idle workers
        for k in range(args.runs):
            for side, cls in (("ours", LeanTorchTrainer), ("baseline", TorchTrainer)):
                wall, cpu = one_run(cls, job(f"{side}{k}"))
                results[side].append((wall, cpu))
                print(f"run {k + 1} {side:8s}: {wall:5.1f} s wall, {cpu:5.1f} CPU-s", flush=True)
    print(f"\ntiny Llama, {args.workers} gloo workers, 4 steps, {args.runs} runs a side, alternated; medians:")
    med = {side: [statistics.median(r[i] for r in runs) for i in (0, 1)] for side, runs in results.items()}
    for side, label in (("ours", "LeanTorchTrainer (raylora)"), ("baseline", "TorchTrainer (Ray, as shipped)")):
        print(f"  {label:31s} {med[side][0]:5.1f} s wall, {med[side][1]:5.1f} CPU-s a run")
    print(f"  ratio: {med['baseline'][0] / med['ours'][0]:.2f}x less wall, {med['baseline'][1] / med['ours'][1]:.2f}x "
          "less CPU a run")  # fmt: skip


if __name__ == "__main__":
    main()
