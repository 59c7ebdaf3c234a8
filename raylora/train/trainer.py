"""The TorchTrainer of one training run (:class:`~raylora.train.lean.LeanTorchTrainer`), and what the driver reads
back from it.

Every trial of a sweep builds and fits one of these in its own process, which only drives the run: this
module leaves the model and data stacks (transformers, peft, Ray Data) to the workers, so that process
imports Ray Train's torch side instead of all of :mod:`raylora.train.fit` (about half the import time).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig

from raylora.config import JobConfig, to_dict
from raylora.data.packs import Packs
from raylora.errors import RunFailed
from raylora.startup import gc_paused
from raylora.tracking import tracking_uri


class TrainingError(RunFailed, RuntimeError):
    """The run failed; the message names the likely causes and fixes, not Ray's internals."""


def build_trainer(
    cfg: JobConfig,
    out: Path,
    datasets: dict[str, Any],
    run_id: str | None,
    run_config: dict[str, Any],
    report_every: int = 0,
    generate_rows: list[dict[str, Any]] = (),
):
    """The TorchTrainer of one training run writing to ``out``, logging to MLflow run ``run_id``.

    Args:
        datasets: from :func:`raylora.train.fit.datasets`. Prepared packs travel in the workers' config (each worker reads its
            share from Ray's object store); a streamed job's Ray Datasets go to Ray Train, which splits them.
        run_config: keyword arguments of ``ray.train.RunConfig`` (see :func:`run_settings`).
        report_every: steps between reports to Ray Train besides evaluations, checkpoints and the last step (0:
            none; a sweep whose metric is the training loss needs them). Ray 2.60's controller takes one report
            every 2 s, and a worker's next report waits for it: reporting every step held a fast step to 2 s.
        generate_rows: the eval rows the generation evals answer (:func:`raylora.eval.in_training.training_rows`),
            read by the driver: a sweep's trial runs in a folder of its own, where relative data paths lead nowhere.
    """
    # these import torch: 1.3 s and 0.18 GB more in a grouped trial's process, which imports this module for
    # TrainingError alone; in a lone trial's process, the largest import, so with the collector paused (raylora.startup)
    with gc_paused():
        from ray.train.torch import TorchConfig

        from raylora.backends import store_timeout_s, worker_plan  # see above
        from raylora.train.lean import LeanTorchTrainer  # see above

    dist_backend, scaling, env = worker_plan(cfg.backend, cfg.train.num_workers, cfg.train.cpus_per_worker)
    packs = {name: d for name, d in datasets.items() if isinstance(d, Packs)}
    return LeanTorchTrainer(
        _train_worker,
        train_loop_config={
            "cfg": {**to_dict(cfg), "train": {**to_dict(cfg.train), "output_dir": str(out)}},
            "tracking_uri": tracking_uri(cfg.tracking) if run_id else None,
            "run_id": run_id,
            "packs": packs,
            "datasets": sorted(datasets),
            "report_every": report_every,
            "generate_rows": list(generate_rows),
        },
        torch_config=TorchConfig(backend=dist_backend, timeout_s=store_timeout_s(env)),
        scaling_config=ScalingConfig(**scaling),
        run_config=RunConfig(**run_config, worker_runtime_env={"env_vars": env} if env else None),
        datasets={name: d for name, d in datasets.items() if name not in packs},
        # Ray splits every dataset equally across workers, dropping rows to do so: a small eval set could leave
        # each worker none. Each worker reads the whole eval set instead (the token-weighted all-reduce is unchanged).
        dataset_config=DataConfig(datasets_to_split=["train"]),
    )


def run_settings(cfg: JobConfig, out: Path) -> dict[str, Any]:
    """Ray Train's run settings of a job writing to ``out``: checkpoints under ``out/ray``, restarts on failure."""
    return {
        "name": "ray",
        "storage_path": str(out),
        "failure_config": FailureConfig(max_failures=cfg.train.max_failures),
        "checkpoint_config": CheckpointConfig(num_to_keep=cfg.train.keep_checkpoints),
    }


def check_outcome(result, cfg: JobConfig) -> dict[str, Any]:
    """Rank 0's outcome of a finished ``trainer.fit()``.

    Raises:
        TrainingError: the run diverged (NaN guard) or left no checkpoint, naming the likely causes.
    """
    outcome = result.return_value or {}
    if outcome.get("status") != "done" or result.checkpoint is None:
        raise TrainingError(
            f"training diverged: non-finite loss or gradients for train.nan_tolerance={cfg.train.nan_tolerance} steps "
            "in a row, again after rolling back to the last good checkpoint with half the learning rate. Likely causes: "
            f"a learning rate too high (train.lr={cfg.train.lr}), Adam's epsilon too small under fp16 "
            f"(train.adam_eps={cfg.train.adam_eps}), or a LoRA rank/alpha that scales updates too far "
            f"(lora.rank={cfg.lora.rank}, lora.alpha={cfg.lora.alpha})."
        )
    return outcome


def _train_worker(config: dict) -> dict:
    """Ray Train's worker function: :func:`raylora.train.loop.train_worker`, imported in the worker only."""
    with gc_paused():  # see raylora.startup
        from raylora.train.loop import train_worker  # the model and data stacks (4 s): in the worker only

    return train_worker(config)
