"""Sweeps whose trials share a frozen base: ``tune.trials_per_group: K`` trials train in one group.

Three kinds of Ray processes, and why:

- A **group** actor (:class:`raylora.train.group_worker.GroupWorker`) holds one copy of the base model and the training rows, and trains its
  members with :class:`raylora.train.group.Group`, step after step, on its main thread (on CPU in lanes: parts
  of the members on threads of their own, each with its share of the intra-op threads). It takes the CPUs / devices of one Ray
  Train worker.
- A **broker** actor (:class:`raylora.train.group_broker.Broker`, asyncio, no CPU) starts the groups and is the mailbox between them and the
  trials: it gives each new trial a group with a free place, and carries each member's reports to its trial. A
  group asks it, once a step, for the members that join and leave, and hands it the step's reports. When a group
  loses a worker, its members' trials see it, and the first to ask has the broker start the group anew (up to
  ``train.max_failures`` times a group); each member joins again from its last checkpoint.
- Each **trial** stays a Tune function trainable (:func:`run_member`, no CPU): it joins a group through the
  broker and passes the reports that hold the sweep's metric (its group's rank 0 logs every report to the member's
  MLflow child run) to
  ``tune.report``, with the member's checkpoint. Tune, ASHA and the search see them as they see any trial.
  ``tune.report`` returns only when Tune lets the trial go on; until then the group holds that member out of
  its steps (the others go on), so ASHA's decision comes before the member trains further. A trial that Tune
  ends leaves its group through the sweep's callback (:func:`leave_callback`), at the group's next step.

Layout per trial is the one of an ungrouped sweep: ``trials/<trial id>/ray/checkpoint_<step>`` (adapter, state,
meta, history), so the driver finishes each trial the same way; ``group.json`` says which group trained it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune import Callback

from raylora.config import ConfigError, JobConfig, to_dict
from raylora.train.group_broker import broker_name
from raylora.train.trainer import TrainingError
from raylora.tune.space import problem_key, trial_config, trial_count, trial_values

# Keys a group's members must share: they shape the group's workers or its single forward pass.
SHARED_TRAIN_KEYS = {
    "train.num_workers": "the group's workers",
    "train.cpus_per_worker": "the group's workers",
    "train.comm_hook": "the group all-reduces its members' gradients in fp32",
    "train.recompute_every": "one forward pass serves every member",
    "train.compile": "one forward pass serves every member",
}


def check(cfg: JobConfig) -> None:
    """Refuse what a grouped sweep (``tune.trials_per_group > 1``) cannot run, naming each trial value and field.

    Raises:
        ConfigError: a searched key that members must share, DoRA, a ``torch.compile`` or ``comm_hook`` job, a
            preference objective, generation evals during training.
    """
    k = cfg.tune.trials_per_group
    problems: list[tuple[str, str]] = []
    for key, why in SHARED_TRAIN_KEYS.items():
        if key in cfg.tune.space:
            problems.append(
                (f"tune.space.{key}", f"members of a group share it ({why}); search it with tune.trials_per_group=1")
            )
    if cfg.train.comm_hook != "none":
        problems.append(
            ("train.comm_hook", f"must be none with tune.trials_per_group={k} ({SHARED_TRAIN_KEYS['train.comm_hook']})")
        )
    if cfg.train.compile:
        problems.append(("train.compile", f"is not supported with tune.trials_per_group={k}; set it to false"))
    if cfg.train.objective != "sft":
        problems.append(("train.objective", f"{cfg.train.objective}: a group trains supervised fine-tuning only; set "
                         "tune.trials_per_group=1 (each trial its own Ray Train run)"))  # fmt: skip
    for value in trial_values(cfg, "lora.use_dora"):
        if value:
            problems.append((problem_key(cfg, "lora.use_dora"), "a trial with lora.use_dora=true: DoRA cannot be grouped; "
                             "set tune.trials_per_group=1 or lora.use_dora=false"))  # fmt: skip
    if problems:
        raise ConfigError(problems, "the grouped sweep")


def plan(cfg: JobConfig, worker_slots: int) -> tuple[int, int]:
    """``(groups, trials at once)``: as many groups as the cluster fits workers, but no more than the sweep's trials
    (and ``tune.max_concurrent``) fill at K trials each: a group without members would hold a base for nothing."""
    k = cfg.tune.trials_per_group
    wanted = min(cfg.tune.max_concurrent or worker_slots * k, trial_count(cfg.tune))
    groups = max(1, min(worker_slots, math.ceil(wanted / k)))
    return groups, min(wanted, groups * k)


def leave_callback(cfg: JobConfig):
    """A Tune callback that takes each ended trial (stopped, finished or failed) out of its group.

    Tune keeps its callbacks in the experiment state, and a resumed sweep has a new broker: the callback looks
    the broker up by name each time.
    """
    name = broker_name(cfg)

    class LeaveGroup(Callback):
        def on_trial_complete(self, iteration, trials, trial, **info):
            ray.get_actor(name).leave.remote(trial.trial_id)

        def on_trial_error(self, iteration, trials, trial, **info):
            self.on_trial_complete(iteration, trials, trial)

    return LeaveGroup()


def run_member(values: dict[str, Any], job: dict, parent: str | None, broker) -> None:
    """One trial of a grouped sweep (a Tune function trainable): join a group, pass its reports on, until done.

    Its group does the rest, MLflow included, so this process opens no MLflow run. When a worker of its group fails,
    the trial joins a group again (:meth:`raylora.train.group_broker.Broker.rejoin`) from the last checkpoint its
    group reported, and Tune sees its steps since then reported again.

    Raises:
        TrainingError: the member diverged, could not join (its error), or its group failed with no restart left.
    """
    trial_id = tune.get_context().get_trial_id()
    out = Path(job["train"]["output_dir"]) / "trials" / trial_id
    out.mkdir(parents=True, exist_ok=True)
    cfg = trial_config(job, values, out)
    restored = tune.get_checkpoint()
    resume_from = restored.path if restored else None
    placed = ray.get(broker.join.remote(trial_id, to_dict(cfg), str(out), resume_from, values, parent))
    _record(out, placed, resume_from)
    while True:
        report = _next_report(broker, trial_id, placed["runs"])
        if report is None:
            try:
                placed = ray.get(broker.rejoin.remote(trial_id, placed["group"], placed["generation"], resume_from))
            except ray.exceptions.RayTaskError as e:
                raise TrainingError(f"trial {trial_id} ({values}): {e.cause}") from None
            _record(out, placed, resume_from)
            continue
        if "error" in report:
            raise TrainingError(f"trial {trial_id} ({values}): {report['error']}")
        folder = report.pop("checkpoint")
        done = report.pop("done")
        resume_from = folder or resume_from
        if cfg.tune.rung_metric in report:
            checkpoint = tune.Checkpoint.from_directory(folder) if folder else None
            # the metric first: Tune's table shows a trial's first four reported metrics
            tune.report(
                {cfg.tune.rung_metric: report[cfg.tune.rung_metric], **report, "done": done}, checkpoint=checkpoint
            )
        if done:
            return


def _record(out: Path, placed: dict, resume_from: str | None) -> None:
    """``group.json``: the group the trial trains in (and how many times it was started anew), and the checkpoint
    the trial joined it from."""
    record = {"group": placed["group"], "generation": placed["generation"], "resumed_from": resume_from}
    (out / "group.json").write_text(json.dumps(record))


def _next_report(broker, trial: str, runs: list) -> dict | None:
    """The trial's next report from its group, or None when a worker of the group ended first."""
    pending = broker.next_report.remote(trial)
    ready, _ = ray.wait([pending, *runs], num_returns=1)
    if pending in ready:
        return ray.get(pending)
    ray.cancel(pending)
    return None
