"""MLflow run identity, made in this one place: a training job's run, a sweep's parent run, and the child run of
each trial (a lone trial's or a shared-base group member's).

Each is written beside the outputs it belongs to (``mlflow_run.json``, ``sweep.json``), so a rerun or resume finds
its run again instead of opening a new one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from raylora.config import JobConfig, to_record
from raylora.tracking import finish_run, reopen_run, start_run, tracking_uri

RUN_FILE = "mlflow_run.json"  # in train.output_dir: the MLflow run the job's checkpoints belong to


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and prefix == "":
            flat.update(flatten(value, f"{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def job_run(cfg: JobConfig, out: Path, resumes: bool) -> str | None:
    """The MLflow run a job logs to (``None`` with tracking off).

    A job that ``resumes`` from its checkpoints with the same settings continues the run that wrote them, so its
    curves go on; with other settings (a raised ``train.max_steps``) it opens a new run tagged
    ``raylora.continues_run``.
    """
    if not cfg.tracking.enabled:
        return None
    params, saved = flatten(to_record(cfg)), out / RUN_FILE
    earlier = json.loads(saved.read_text())["run_id"] if saved.exists() and resumes else None
    if earlier is not None and reopen_run(cfg.tracking, earlier, params):
        return earlier
    run_id = start_run(cfg.tracking, out.name, params, tags={"raylora.continues_run": earlier} if earlier else None)
    saved.write_text(json.dumps({"run_id": run_id}))
    return run_id


def parent_run(cfg: JobConfig, out: Path, resume: bool) -> str | None:
    """The sweep's MLflow parent run (reopened on resume): the base job's params and the search space."""
    if not cfg.tracking.enabled:
        return None
    saved = out / "sweep.json"
    if resume and saved.exists():
        import mlflow  # only once tracking is on: see the note at the top of raylora.tracking

        run_id = json.loads(saved.read_text())["parent_run_id"]
        mlflow.MlflowClient(tracking_uri(cfg.tracking)).update_run(run_id, status="RUNNING")
        return run_id
    params = {**flatten(to_record(cfg)), **{f"space.{k}": v for k, v in cfg.tune.space.items()}}
    run_id = start_run(cfg.tracking, f"{out.name} sweep", params, tags={"raylora.sweep": "parent"})
    saved.write_text(json.dumps({"parent_run_id": run_id}))
    return run_id


def child_run(
    cfg: JobConfig, out: Path, parent: str | None, trial_id: str, values: dict[str, Any], resumes: bool
) -> str | None:
    """The trial's MLflow child run: created once, and found again in ``out/mlflow_run.json`` when the trial
    ``resumes`` from a checkpoint. A trial that trains again from step 0 (stopped before its first checkpoint) gets a
    new child run, tagged ``raylora.replaces_run``, whose curve does not repeat the steps of the one it replaces
    (closed as KILLED)."""
    if parent is None:
        return None
    saved = out / "mlflow_run.json"
    tags = {"mlflow.parentRunId": parent, "raylora.trial": trial_id}
    if saved.exists():
        earlier = json.loads(saved.read_text())["run_id"]
        if resumes:
            return earlier
        finish_run(cfg.tracking, earlier, [], "KILLED")
        tags["raylora.replaces_run"] = earlier
    label = " ".join(f"{k.split('.')[-1]}={_short(v)}" for k, v in values.items())
    run_id = start_run(cfg.tracking, f"{trial_id} {label}", flatten(to_record(cfg)), tags=tags)
    saved.write_text(json.dumps({"run_id": run_id}))
    return run_id


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
