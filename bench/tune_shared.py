"""Shared-base sweep benchmark: the same 8-trial grid and budget, tune.trials_per_group 1 against K, back to back.

Baseline: trials_per_group=1, today's sweep: each trial is its own Ray Train run (its own processes, its own copy of
the base model), two one-CPU trials at a time on a 2-core machine. Ours: trials_per_group=K (default 4): as many
groups as the 8 trials fill (two of 4, or one of 8), each training its trials at once on one copy of the base, with
``--group-cpus`` CPUs (train.cpus_per_worker; 2 gives one group of 8 both cores). Both search lora.rank 4 / 16 x train.lr
3e-2 / 1e-2 / 1e-3 / 1e-4 on the tiny model with every trial run to train.max_steps (tune.scheduler=none, so both
do the same work), in one Ray session after a warm-up sweep.

``--at-once N`` runs N trials at a time on both sides (``tune.max_concurrent``; the baseline's trials then get
cores / N CPUs each, and each group of the shared side the CPUs of the K trials it stands for, unless ``--group-cpus``
says otherwise): the same number of adapters in training on the same CPUs, each on its own base or sharing one.
Without it each side runs as many as it fits: two one-CPU trials alone, every group's K trials shared.

Prints, for each: the sweep's wall time, the peak of the summed proportional set size (PSS: shared pages split
between the processes that map them) of the driver and every process under it (Ray's own, the trials', the
workers', the groups'), sampled every 3 s from a thread at the lowest CPU priority (reading every process's
smaps_rollup took a fifth of a core at nice 0 and slowed the multi-threaded group most), with its split by kind of
process at the peak, and the best trial's config and eval loss; then each config's eval loss on both sides and the
ratios.

    .venv/bin/python bench/tune_shared.py [--steps 16] [--k 4] [--model tiny-llama] [--group-cpus 1] [--at-once N]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
SPACE = "tune.space={lora.rank: {grid: [4, 16]}, train.lr: {grid: [3.0e-2, 1.0e-2, 1.0e-3, 1.0e-4]}}"


class PeakMemory:
    """The largest summed PSS of this process and all its descendants, sampled on a thread, and at that peak the PSS
    of each kind of process (Ray actors by class, Ray's own daemons by name)."""

    def __init__(self, every: float = 3.0):
        self.every, self.peak, self.kinds, self._stop = every, 0, {}, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        import psutil

        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        me = psutil.Process()
        while not self._stop.wait(self.every):
            kinds: dict[str, int] = {}
            for proc in [me, *me.children(recursive=True)]:
                try:
                    kind = "driver" if proc.pid == me.pid else _kind(proc)
                    kinds[kind] = kinds.get(kind, 0) + proc.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            if sum(kinds.values()) > self.peak:
                self.peak, self.kinds = sum(kinds.values()), kinds


def _kind(proc) -> str:
    """``ray::GroupWorker.run`` -> GroupWorker; an idle Ray worker -> ray idle worker; a daemon -> its name."""
    line = proc.cmdline()
    name = line[0] if line else proc.name()  # Ray titles its workers ray::<Class>.<method> in their command line
    if name.startswith("ray::"):
        return name[5:].split(".")[0].split(":")[0].strip() or "ray worker"
    return Path(name).name


def run(tmp: Path, name: str, k: int, steps: int, model: str, cpus: float = 1, at_once: int = 0) -> dict:
    from raylora.config import load_config
    from raylora.tune.sweep import sweep

    cfg = load_config(
        ROOT / "configs" / "tiny_sweep_cpu.yaml",
        [
            SPACE, "tune.search=grid", "tune.num_samples=1", "tune.scheduler=none", f"train.max_steps={steps}",
            f"tune.trials_per_group={k}", f"model.name_or_path={model}", f"train.cpus_per_worker={cpus}",
            f"data.sources=[{{path: {ROOT / 'data' / 'raylora_identity.jsonl'}}}]", f"data.output_dir={tmp}/data-{model}",
            f"train.output_dir={tmp}/{name}", "tracking.enabled=false", f"tune.max_concurrent={at_once or 'null'}",
        ],
    )  # fmt: skip
    started = time.perf_counter()
    with PeakMemory() as memory:
        result = sweep(cfg, log=lambda s: None)
    return {
        "seconds": time.perf_counter() - started,
        "peak_gb": memory.peak / 2**30,
        "best": result["best"],
        "kinds": memory.kinds,
        "trials": result["trials"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--k", type=int, default=4, help="trials per group of the shared-base sweep")
    parser.add_argument("--model", default="tiny-llama", help="e.g. smollm2-135m-instruct (needs its files cached)")
    parser.add_argument("--group-cpus", type=int, help="train.cpus_per_worker of the shared side's groups "
                        "(default: 1; with --at-once N, cores x K / N)")  # fmt: skip
    parser.add_argument("--at-once", type=int, default=0, help="trials at a time on both sides (0: as many as fit)")
    args = parser.parse_args()
    from raylora.cluster import ensure_ray

    ensure_ray()
    with tempfile.TemporaryDirectory() as tmp:
        run(Path(tmp), "warm-up", 1, 2, args.model)  # data prepared, Ray's worker processes and imports cached
        cores = os.cpu_count()
        alone_cpus = cores / args.at_once if args.at_once else 1
        # with --at-once, a group gets the CPUs of the K trials it stands for
        args.group_cpus = args.group_cpus or (min(cores, max(1, cores * args.k // args.at_once)) if args.at_once else 1)
        alone = run(Path(tmp), "alone", 1, args.steps, args.model, alone_cpus, args.at_once)
        shared = run(Path(tmp), "shared", args.k, args.steps, args.model, args.group_cpus, args.at_once)
    at_once = f"{args.at_once} trials at a time on both sides" if args.at_once else "as many trials at a time as fit"
    setup = (f"{args.model}, 8 trials (rank 4/16 x lr 3e-2/1e-2/1e-3/1e-4), {args.steps} steps each, no scheduler, "
             f"{alone_cpus:g}-CPU trials alone, groups of {args.group_cpus} CPU(s), {at_once}, {os.cpu_count()} cores")  # fmt: skip
    print(setup)
    for name, r in (("trials_per_group=1", alone), (f"trials_per_group={args.k}", shared)):
        best = ", ".join(f"{key}={value}" for key, value in r["best"]["config"].items())
        print(f"{name:19s} {r['seconds']:6.1f} s  peak memory {r['peak_gb']:5.2f} GB  "
              f"best eval_loss {r['best']['metric']:.4f} ({best})")  # fmt: skip
    for name, r in (("trials_per_group=1", alone), (f"trials_per_group={args.k}", shared)):
        kinds = sorted(r["kinds"].items(), key=lambda item: -item[1])
        print(
            f"at the peak of {name}: " + ", ".join(f"{kind} {pss / 2**30:.2f} GB" for kind, pss in kinds if pss > 2**24)
        )
    print("eval_loss of each config (trials_per_group=1 / " + f"{args.k}): " + "; ".join(_by_config(alone, shared)))
    ratio = (f"wall time ratio (1 / {args.k}): {alone['seconds'] / shared['seconds']:.2f}x faster; peak memory ratio "
             f"({args.k} / 1): {shared['peak_gb'] / alone['peak_gb']:.2f}x; best eval_loss difference "
             f"{shared['best']['metric'] - alone['best']['metric']:+.4f}")  # fmt: skip
    print(ratio)
    from chart import IMG, bars  # here, not at the top: the peak memory counts this process

    bars(
        IMG / f"tune_shared_{args.model}{f'_at_once_{args.at_once}' if args.at_once else ''}.png",
        f"Sweep wall time: shared base vs a base per trial ({args.model})",
        {f"trials_per_group={args.k} (shared base)": shared["seconds"], "trials_per_group=1": alone["seconds"]},
        "sweep wall time, s (lower is better)",
        f"{ratio}\n{setup}",
    )


def _by_config(alone: dict, shared: dict) -> list[str]:
    """``rank 4, lr 0.01: 2.0717 / 2.1876`` for each config of the grid, in the grid's order."""

    def metrics(r: dict) -> dict[tuple, float]:
        return {(t["lora.rank"], t["train.lr"]): t["metric"] for t in r["trials"]}

    ours = metrics(shared)
    return [f"rank {rank}, lr {lr:g}: {loss:.4f} / {ours.get((rank, lr), float('nan')):.4f}"
            for (rank, lr), loss in sorted(metrics(alone).items(), key=lambda kv: (-kv[0][1], kv[0][0]))]  # fmt: skip


if __name__ == "__main__":
    main()
