"""What runs in a sweep trial's own process: :func:`run_trial`, one Ray Train run of the job with the trial's values.

That process only drives the run, so it imports no model or data stack (see :mod:`raylora.train.trainer`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback

from raylora.config import JobConfig
from raylora.runs import child_run
from raylora.train.checkpoint import drop_unregistered
from raylora.train.checkpoint import newest as newest_checkpoint
from raylora.train.trainer import TrainingError, build_trainer, check_outcome, run_settings
from raylora.tune.space import trial_config


def run_trial(
    values: dict[str, Any], job: dict, datasets: dict, parent: str | None, generate_rows: list[dict[str, Any]]
) -> None:
    """One trial (a Ray Tune function trainable): a Ray Train run of the job with the trial's ``values``; with
    generation evals, ``generate_rows`` are the eval rows they answer (read by the sweep's driver).

    It logs to an MLflow child run of ``parent`` and passes every report holding the sweep's metric to
    Tune. Tune ends the trial's process as soon as ASHA stops it or its last step is reported, so
    the driver, not this function, copies out the adapter and closes the child run
    (:func:`_finish_trial`). A restored trial resumes its Train run from its own checkpoints.
    Raises:
        TrainingError: the run failed or diverged (an errored trial in Tune).
    """
    # Ray Train's preemption watcher (an actor per run that logs node drains) is one more process for every
    # trial to start; a trial's controller reads this variable from the trial's own process.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    trial_id = tune.get_context().get_trial_id()
    out = Path(job["train"]["output_dir"]) / "trials" / trial_id
    out.mkdir(parents=True, exist_ok=True)
    cfg = trial_config(job, values, out)
    run_id = child_run(cfg, out, parent, trial_id, values, newest_checkpoint(out) is not None)  # Train resumes there
    settings = {**run_settings(cfg, out), "callbacks": [_metric_reports(cfg.tune.rung_metric)]}
    try:
        trainer = build_trainer(cfg, out, datasets, run_id, settings, _report_every(cfg), generate_rows)
        check_outcome(trainer.fit(), cfg)
    except Exception as e:
        raise TrainingError(f"trial {trial_id} ({values}): {e}") from None
    drop_unregistered(out)


def _report_every(cfg: JobConfig) -> int:
    """Steps between a trial's reports besides evaluations and checkpoints: ASHA reads the metric at every report
    that holds it; evaluations carry ``eval_*``, generation evals ``gen_*``, logged steps the loss."""
    metric = cfg.tune.rung_metric
    if metric.startswith("gen_"):
        return cfg.train.generate_eval_every
    return 0 if metric.startswith("eval_") else cfg.train.log_every


def _metric_reports(metric: str):
    """A Ray Train callback passing to Tune the reports that hold ``metric`` (evaluation steps).

    Tune refuses a result without the sweep's metric, and training reports eval loss only every
    ``train.eval_every`` steps. The metric goes first, so Tune's progress table (a trial's first four metrics) shows it.
    """

    class MetricReports(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            if metric in metrics[0]:  # first: Tune's table shows a trial's first four reported metrics
                super().after_report(run_context, [{metric: metrics[0][metric], **metrics[0]}, *metrics[1:]], None)

    return MetricReports()
