"""``fit(cfg)``: the driver side of a training job, top to bottom.

check what is cheap to check (devices, cluster CPUs, MLflow) → ask the data layer for the training data
(prepared shards, or with ``data.streaming`` the lazy pipeline) → open the MLflow run → build and run the
TorchTrainer → copy out the adapter, write the loss plot and the resolved config → close the MLflow run.
Rerunning a job with the same ``train.output_dir`` resumes from its newest checkpoint, with any
number of workers, and continues the job's MLflow run when the settings are the same (:func:`raylora.runs.job_run`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import yaml

from raylora.backends import BackendError, planned_backend, worker_plan
from raylora.cluster import ensure_ray, sigterm_stops
from raylora.comm.hooks import check_hook
from raylora.config import ConfigError, JobConfig, to_record
from raylora.data.pipeline import DataError, TrainingData, training_data
from raylora.data.sources import plan_sources
from raylora.model_files import ModelError
from raylora.models import model_skeleton, target_modules
from raylora.runs import job_run
from raylora.tracking import check_reachable, finish_run, tracking_uri
from raylora.train.checkpoint import CheckpointError, check_compatible, checkpoint_step, drop_unregistered
from raylora.train.checkpoint import newest as newest_checkpoint
from raylora.train.cpus import free_share
from raylora.train.plot import plot_history
from raylora.train.trainer import TrainingError, build_trainer, check_outcome, run_settings

# The streamed pipeline's tasks each ask for a whole CPU: the workers must leave one free or training waits forever.
READ_CPUS = 1.0


def fit(cfg: JobConfig, log=print) -> dict[str, Any]:
    """Run a LoRA fine-tune on ``cfg.train.num_workers`` Ray Train workers.

    Returns:
        ``{"adapter", "steps", "loss", "eval_loss", "run_id", "history"}``.
    Raises:
        DataError, TrackingError, BackendError, ModelError: before any worker starts (all but DataError before any
            data work).
        TrainingError: the run failed or diverged.
    """
    out = Path(cfg.train.output_dir).resolve()
    done = _finished(cfg, out, log)
    if done is not None:
        return done
    unset = cfg.train.cpus_per_worker is None
    cfg, rows = check_before_data(cfg)
    log(worker_cpus_line(cfg, unset))
    if cfg.train.compile and (warning := planned_backend(cfg.backend).compile_warning()):
        log(f"warning: {warning}")
    out.mkdir(parents=True, exist_ok=True)
    data = training_data(cfg, log)
    check_enough(cfg, data.packs)
    run_id = job_run(cfg, out, newest_checkpoint(out) is not None)
    trainer = build_trainer(cfg, out, datasets(data), run_id, run_settings(cfg, out), 0, rows)
    stopped = functools.partial(finish_run, cfg.tracking, run_id, [], "KILLED")
    try:
        with sigterm_stops(stopped):
            result = trainer.fit()
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C (Ray Train aborts the run and exits) or SIGTERM
        stopped()
        raise TrainingError(
            f"training was stopped; run the same command again to resume from the last checkpoint in {out / 'ray'}"
        ) from None
    except Exception as e:
        finish_run(cfg.tracking, run_id, [], "FAILED")
        raise TrainingError(_explain(e, out)) from None
    try:
        outcome = check_outcome(result, cfg)
        data.finish()
    except Exception:
        finish_run(cfg.tracking, run_id, [], "FAILED")
        raise
    with result.checkpoint.as_directory() as folder:
        history = save_outputs(Path(folder), cfg, out)
    drop_unregistered(out)
    finish_run(
        cfg.tracking,
        run_id,
        [out / "adapter", out / "config.yaml", out / "loss.png", out / "history.json", out / "profile"],
        "FINISHED",
    )
    log(
        f"adapter saved to {out / 'adapter'}; loss plot {out / 'loss.png'}"
        + (f"; MLflow run {run_id}" if run_id else "")
    )
    return {
        "adapter": str(out / "adapter"),
        "steps": outcome["step"],
        "loss": history[-1]["loss"],
        "eval_loss": history[-1].get("eval_loss"),
        "resumed_from": outcome["resumed_from"],
        "skipped_steps": outcome["skipped_steps"],
        "run_id": run_id,
        "history": history,
    }


def _finished(cfg: JobConfig, out: Path, log) -> dict[str, Any] | None:
    """A rerun of a job whose newest checkpoint already reached ``train.max_steps``: its outputs, written again from
    that checkpoint, with no cluster, worker or MLflow run (a rerun used to record an empty MLflow run); ``None``
    when there is training left to do."""
    latest = newest_checkpoint(out)
    step = checkpoint_step(latest) if latest is not None else 0
    if step < cfg.train.max_steps:
        return None
    check_compatible(latest, cfg)
    # the adapter's own settings stay: this command's may differ (another lr) though there is nothing to train
    history = save_outputs(latest, cfg, out, config=not (out / "config.yaml").is_file())
    log(f"nothing to train: {out} already holds step {step} of train.max_steps={cfg.train.max_steps} (raise "
        f"train.max_steps to train on); adapter {out / 'adapter'}")  # fmt: skip
    last = history[-1] if history else {}
    return {"adapter": str(out / "adapter"), "steps": step, "loss": last.get("loss"),
            "eval_loss": last.get("eval_loss"), "resumed_from": step, "skipped_steps": 0, "run_id": None,
            "history": history}  # fmt: skip


def generation_rows(cfg: JobConfig) -> list[dict[str, Any]]:
    """With ``train.generate_eval_every``, the eval rows it answers (none without it).

    Raises:
        ConfigError: every problem with the eval set: unreadable, no rows, unknown metrics.
    """
    if not cfg.train.generate_eval_every:
        return []
    # here, not at the top: the eval set's reader and metrics (nltk, jieba) take 2 s to import, for such runs only
    from raylora.eval.in_training import training_rows

    return training_rows(cfg)


def _all_at_once(checks: dict[str, Callable[[], object]]) -> dict[str, object]:
    """Run every check; one problem raises as it is, several as one :class:`ConfigError` listing each (a job with a
    mistyped data path, model and layer took three runs to learn of all three). Returns each check's result.

    Raises:
        BackendError, DataError, ModelError, CheckpointError: the one problem found.
        ConfigError: several problems, each under the setting it concerns.
    """
    found: list[tuple[str, Exception]] = []
    results = {}
    for key, check in checks.items():
        try:
            results[key] = check()
        except ConfigError as e:  # several problems of one kind (the eval set's)
            found += [(key, ConfigError([problem], "the job")) for problem in e.problems]
        except (BackendError, DataError, ModelError, CheckpointError) as e:
            found.append((key, e))
    if len(found) == 1:
        raise found[0][1]
    if found:
        raise ConfigError([(e.problems[0] if isinstance(e, ConfigError) else (key, str(e))) for key, e in found],
                          "the job")  # fmt: skip
    return results


def check_before_data(cfg: JobConfig) -> tuple[JobConfig, list[dict[str, Any]]]:
    """The checks that take seconds, run before data preparation (which can take minutes) so they fail first.

    Starts or joins Ray, after the checks that need no cluster.
    Returns:
        ``cfg``, with ``train.cpus_per_worker`` set to the workers' share of the free CPUs when it was unset, and the
        eval rows its generation evals answer (:func:`generation_rows`, read once here).
    Raises:
        BackendError: the device asked for is missing, or its collectives cannot carry ``train.comm_hook``.
        ModelError: the base model is missing, or ``lora.target_modules`` names a layer it lacks (before Ray starts).
        CheckpointError: the checkpoint a rerun would resume from was written for another model or LoRA shape.
        DataError: a data source is missing or unreadable (every such problem listed, before Ray starts).
        DataError: the workers would not leave the streamed pipeline a CPU (``data.streaming``).
        TrainingError: the workers ask for more CPUs or devices than the cluster has (Ray would wait forever).
        TrackingError: the MLflow tracking server does not answer.
        ConfigError: more than one of the input problems above (device, data, model, checkpoint), listed together.
    """
    resume = newest_checkpoint(Path(cfg.train.output_dir).resolve())
    checks = {
        "backend.device": lambda: check_hook(cfg.train, planned_backend(cfg.backend)),  # a missing device or hook
        # a mistyped path, or data of another objective: fails in a second, not after a cluster starts
        "data.sources": lambda: plan_sources(cfg.data, cfg.train.objective),
        "model": lambda: target_modules(model_skeleton(cfg.model), cfg.lora.target_modules),  # a model or layer name
        # a checkpoint of another model or LoRA shape: here, not in every restart of the workers
        "train.output_dir": lambda: resume is not None and check_compatible(resume, cfg),
        # the eval set a generation eval during training answers: readable, with rows, known metrics
        "train.generate_eval_every": lambda: generation_rows(cfg),
    }
    rows = _all_at_once(checks)["train.generate_eval_every"]
    if cfg.tracking.enabled:  # a server down is a failed run (exit 1), not bad input: on its own
        check_reachable(tracking_uri(cfg.tracking))
    ensure_ray()
    if cfg.train.cpus_per_worker is None:
        device = planned_backend(cfg.backend).ray_resource
        share = free_share(
            [n["Resources"] for n in ray.nodes() if n["Alive"]], ray.available_resources().get("CPU", 0.0),
            cfg.train.num_workers, None if device == "CPU" else device, READ_CPUS if cfg.data.streaming else 0.0,
        )  # fmt: skip
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, cpus_per_worker=float(share)))
    _, scaling, _ = worker_plan(cfg.backend, cfg.train.num_workers, cfg.train.cpus_per_worker)
    cluster = ray.cluster_resources()
    per_worker = scaling["resources_per_worker"]
    short = {
        k: v * cfg.train.num_workers for k, v in per_worker.items() if v * cfg.train.num_workers > cluster.get(k, 0)
    }
    if short:
        raise TrainingError(
            f"the workers ask for {', '.join(f'{v:g} {k}' for k, v in short.items())} (train.num_workers="
            f"{cfg.train.num_workers} x {per_worker}) and the cluster has "
            f"{', '.join(f'{cluster.get(k, 0):g} {k}' for k in short)}, so training would wait forever. Lower "
            "train.num_workers or train.cpus_per_worker, or add nodes."
        )
    cpus = cluster.get("CPU", 0)
    asked = cfg.train.num_workers * per_worker.get("CPU", 0)
    if cfg.data.streaming and cpus - asked < READ_CPUS:
        raise DataError(
            f"the workers would take {asked:g} of the cluster's {cpus:g} CPUs, leaving less than {READ_CPUS:g} for "
            "Ray Data to run the streamed pipeline, so training would wait forever. Lower train.cpus_per_worker or "
            "train.num_workers, or prepare the data first (data.streaming=false)."
        )
    return cfg, rows


def worker_cpus_line(cfg: JobConfig, unset: bool) -> str:
    """The start-up line saying what each worker got and why, given the ``cfg`` :func:`check_before_data` returned
    (``unset``: the job left ``train.cpus_per_worker`` unset)."""
    cpus = cfg.train.cpus_per_worker
    why = "the cluster's free CPUs shared by the workers (train.cpus_per_worker unset)" if unset else (
        "train.cpus_per_worker")  # fmt: skip
    return (f"workers: {cfg.train.num_workers}, each with {cpus:g} CPUs and {max(1, math.ceil(cpus))} torch threads: "
            f"{why}")  # fmt: skip


def check_enough(cfg: JobConfig, packs: int | None) -> None:
    """Check there is a micro-batch per worker in ``packs`` training sequences (``None``: not known yet, streamed).

    Raises:
        DataError: fewer training sequences than ``num_workers x batch_size``.
    """
    needed = cfg.train.num_workers * cfg.train.batch_size
    if packs is not None and packs < needed:
        raise DataError(
            f"the training data has {packs} sequences, fewer than one micro-batch per worker "
            f"(train.num_workers={cfg.train.num_workers} x train.batch_size={cfg.train.batch_size} = {needed}). "
            "Add data, lower data.cutoff_len or turn off data.packing, or use fewer workers or a smaller batch."
        )


def datasets(data: TrainingData) -> dict[str, Any]:
    """What the workers read: ``train``, and ``eval`` when the job holds one out (see :func:`build_trainer`)."""
    return {"train": data.train, **({"eval": data.eval} if data.eval is not None else {})}


def save_outputs(checkpoint: Path, cfg: JobConfig, out: Path, config: bool = True) -> list[dict[str, float]]:
    """Copy a checkpoint folder's adapter to ``out/adapter``; write ``history.json``, ``loss.png`` and (``config``)
    ``config.yaml``.

    Returns:
        The metric history, one dict per logged step.
    """
    shutil.rmtree(out / "adapter", ignore_errors=True)
    shutil.copytree(checkpoint / "adapter", out / "adapter")
    history = json.loads((checkpoint / "history.json").read_text())
    if config:
        (out / "config.yaml").write_text(yaml.safe_dump(to_record(cfg), sort_keys=False, allow_unicode=True))
    (out / "history.json").write_text(json.dumps(history, indent=1))
    plot_history(history, out / "loss.png")
    return history


def _explain(error: Exception, out: Path) -> str:
    """One paragraph for a failed run: the root cause's own message, and where the logs are."""
    root = error
    while root.__cause__ is not None or getattr(root, "cause", None) is not None:
        root = root.__cause__ or root.cause
    message = str(root).strip().splitlines()
    text = next((line for line in reversed(message) if line.strip()), repr(root))
    hint = ""
    if "out of memory" in text.lower() or isinstance(root, MemoryError):
        hint = " A batch does not fit: lower train.batch_size or data.cutoff_len, or raise train.grad_accum."
    return f"training failed: {type(root).__name__}: {text}.{hint} Worker logs: Ray's session logs; checkpoints: {out / 'ray'}"
