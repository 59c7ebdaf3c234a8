"""``sweep(cfg)``: a Ray Tune search over LoRA and training settings, top to bottom.

check the sweep → check MLflow answers (and, resuming, holds the sweep's parent run) → count the trials the cluster
fits → prepare the data once → open the MLflow parent run → Tune runs the trials (each a Ray Train run with its own
MLflow child run; ASHA stops laggards) → mark each child run → copy, log and register the best adapter; write the
results table and plot.

Layout of ``train.output_dir``::

    tune/                 Ray Tune's experiment state (``--resume`` restores it)
    trials/<trial id>/    one training run each: adapter/, history.json, loss.png, Ray Train checkpoints
    best/adapter/         the best completed trial's adapter (peft format)
    results.csv           one row per trial: its values, status, steps and metric
    sweep.png             the metric over lora.rank x train.lr (or the first two searched keys)
    sweep.json            the MLflow parent run id, so a resumed sweep logs to the same parent
    sweep_config.json     the settings the sweep started with; ``--resume`` refuses others
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import math
import os
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune import Callback
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter
from ray.tune.search.optuna import OptunaSearch  # imports without optuna (optional): OptunaSearch() asks for it
from ray.util.placement_group import PlacementGroup, remove_placement_group

from raylora.backends import worker_plan
from raylora.cluster import ensure_ray, sigterm_stops
from raylora.config import ConfigError, JobConfig, from_dict, to_dict, to_record
from raylora.data.pipeline import DataError, training_data
from raylora.data.sources import plan_sources
from raylora.eval.run import check_eval, evaluate
from raylora.registry import register
from raylora.runs import flatten, parent_run
from raylora.tracking import check_reachable, finish_run, tracking_uri
from raylora.train import group_worker
from raylora.train.fit import TrainingError, check_enough, datasets, generation_rows, save_outputs
from raylora.tune import groups, space
from raylora.tune.trial import run_trial

STATUS_TAG = "raylora.trial_status"
ERROR_TAG = "raylora.trial_error"  # a failed trial's reason (its last line; error.txt holds all of it)
MAX_TAG_CHARS = 5000  # MLflow's limit on a tag's value in its SQL stores
TRIAL_DRIVER_MEMORY = 256 * 2**20


def sweep(cfg: JobConfig, resume: bool = False, log=print) -> dict[str, Any]:
    """Run (or, with ``resume``, continue) the sweep that ``cfg.tune`` describes.

    Returns:
        ``{"best": {"config", "metric", "adapter", "trial"}, "trials": [row, ...], "parent_run_id",
        "registered": (name, version) or None}``; a row holds the trial id, its searched values,
        ``status`` (completed, stopped early, failed), ``steps`` and the metric.
    Raises:
        ConfigError: a bad sweep, or a trial that does not fit the cluster, before any trial starts.
        TrainingError: no trial completed; each trial's error is in its MLflow child run.
    """
    if cfg.train.cpus_per_worker is None:  # trials run side by side: one CPU each, as before the default was unset
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, cpus_per_worker=1.0))
    check_sweep(cfg)
    cfg = _generating_at_rungs(cfg)
    out = Path(cfg.train.output_dir).resolve()
    state = out / "tune"
    if resume and not state.exists():
        raise ConfigError([("--resume", f"no sweep to resume in {out}; run it without --resume first")], "the sweep")
    if resume:
        _check_same_settings(cfg, out)
    if not resume and state.exists():
        raise ConfigError(
            [
                (
                    "train.output_dir",
                    f"a sweep already ran in {out}; continue it with --resume, or choose another folder",
                )
            ],
            "the sweep",
        )
    if cfg.data.streaming:
        raise ConfigError(
            [("data.streaming", "a sweep prepares its data once for every trial; set data.streaming=false")],
            "the sweep",
        )
    # a mistyped data path, or data of another objective: fails in a second, not after a cluster has started
    plan_sources(cfg.data, cfg.train.objective)
    if cfg.tracking.enabled:
        check_reachable(tracking_uri(cfg.tracking))
        if resume:
            _check_parent(cfg, out)
    ensure_ray()
    at_once = trials_at_once(cfg)
    data = training_data(cfg, log)
    _check_data(cfg, data)
    out.mkdir(parents=True, exist_ok=True)
    if not resume:
        (out / "sweep_config.json").write_text(json.dumps(_settings(cfg), indent=1))
    parent = parent_run(cfg, out, resume)
    callbacks = [_release_stopped_callback(out)]
    group_broker = None
    if cfg.tune.trials_per_group > 1:
        slots = at_once
        group_count, at_once = groups.plan(cfg, slots)
        group_broker = group_worker.start(cfg, data, group_count, generation_rows(cfg))
        callbacks.append(groups.leave_callback(cfg))
        trainable = tune.with_parameters(groups.run_member, job=to_dict(cfg), parent=parent, broker=group_broker)
        layout = f", {group_count} group(s) of up to {cfg.tune.trials_per_group} trials sharing a base"
        if group_count < slots:
            layout += (
                f" ({slots - group_count} of {slots} worker slots left free: the trials fill {group_count}; "
                "raise train.cpus_per_worker or train.num_workers to give each group more)"
            )
    else:
        trainable = tune.with_parameters(
            run_trial, job=to_dict(cfg), datasets=datasets(data), parent=parent, generate_rows=generation_rows(cfg)
        )
        layout = ""
    # The trial's own process only drives its Ray Train run (or its group's member), so it asks for no CPU: with
    # even 0.01 CPU, two one-CPU trials would not fit two cores. Tune refuses an empty request, hence memory.
    trainable = tune.with_resources(trainable, {"cpu": 0, "memory": TRIAL_DRIVER_MEMORY})
    log(
        f"sweep: {space.trial_count(cfg.tune)} trial(s), {at_once} at a time{layout}, {cfg.tune.search} search, "
        f"scheduler {cfg.tune.scheduler}"
    )
    if resume:
        tuner = tune.Tuner.restore(str(state), trainable=trainable, resume_unfinished=True, resume_errored=False)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=space.to_tune(cfg.tune.space, cfg.tune.search),
            tune_config=tune.TuneConfig(
                metric=cfg.tune.rung_metric,
                mode=cfg.tune.rung_mode,
                num_samples=cfg.tune.num_samples,
                search_alg=_searcher(cfg, at_once),
                scheduler=_scheduler(cfg),
            ),
            run_config=tune.RunConfig(name="tune", storage_path=str(out), verbose=1, callbacks=callbacks),
        )
    stopped_by_signal = TrainingError(
        f"the sweep was stopped by a signal before every trial completed; continue it with: raylora tune <config> "
        f"--resume (same train.output_dir={out})"
    )
    try:
        with sigterm_stops(lambda: finish_run(cfg.tracking, parent, [], "KILLED")), _sigint_seen() as stopped:
            grid = tuner.fit()
            stopped = stopped()
    except KeyboardInterrupt:  # a second Ctrl-C, or one before Tune took over its handling
        finish_run(cfg.tracking, parent, [], "KILLED")
        raise stopped_by_signal from None
    finally:
        if group_broker is not None:
            group_worker.stop(group_broker)
    if stopped and _reported_last_step(grid, cfg.train.max_steps) < space.trial_count(cfg.tune):
        # the trials Tune ended are not "stopped early" (nor are ASHA's told apart here): --resume runs them on
        finish_run(cfg.tracking, parent, [], "KILLED")
        raise stopped_by_signal
    rows = [_finish_trial(cfg, result) for result in grid]
    completed = [r for r in rows if r["status"] == "completed"]
    if cfg.tune.answers and completed:
        _score_answers(cfg, out, rows, log)
    _write_table(rows, out / "results.csv")
    _plot(cfg, rows, out / "sweep.png")
    if not completed:
        finish_run(cfg.tracking, parent, [out / "results.csv", out / "sweep.png"], "FAILED")
        raise TrainingError(
            f"no trial of the sweep completed ({', '.join(r['trial'] + ': ' + r['status'] for r in rows)}); "
            f"see {out / 'results.csv'}, each trial's folder under {out / 'trials'} and its MLflow child run"
        )
    if cfg.tune.answers:  # equal scores (a few rows, coarse metrics): the lower eval loss wins
        sign = 1 if cfg.tune.mode == "max" else -1
        best = max(completed, key=lambda r: (sign * r["metric"], -r["eval_loss"]))
    else:
        best = (min if cfg.tune.mode == "min" else max)(completed, key=lambda r: r["metric"])
    shutil.rmtree(out / "best", ignore_errors=True)
    shutil.copytree(Path(best["dir"]) / "adapter", out / "best" / "adapter")
    (out / "best" / "config.yaml").write_text((Path(best["dir"]) / "config.yaml").read_text())
    registered = _log_best(cfg, parent, best, out)
    log(
        f"best trial {best['trial']}: {cfg.tune.metric} {best['metric']:.4f} with "
        + ", ".join(f"{k}={best[k]}" for k in cfg.tune.space)
        + f"; adapter {out / 'best' / 'adapter'}"
        + (f"; registered as models:/{registered[0]}/{registered[1]}" if registered else "")
    )
    return {
        "best": {"trial": best["trial"], "metric": best["metric"], "adapter": str(out / "best" / "adapter"),
                 "config": {k: best[k] for k in cfg.tune.space}},
        "trials": rows,
        "parent_run_id": parent,
        "registered": registered,
    }  # fmt: skip


@contextlib.contextmanager
def _sigint_seen() -> Iterator[Callable[[], bool]]:
    """Around ``tuner.fit()``: yields whether SIGINT (Ctrl-C, or SIGTERM through :func:`sigterm_stops`) stopped it.

    Tune stops gracefully on SIGINT (saving its state for --resume), ending its trials as if they had finished.
    Tune's handler puts back the one it found at its first SIGINT, and otherwise stays: the handler in place
    afterwards tells. Signals reach only the main thread: elsewhere, none is reported.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or os.environ.get("TUNE_DISABLE_SIGINT_HANDLER") == "1"
    ):
        yield lambda: False  # no signal reaches this thread, or Tune does not handle it (then it raises)
        return

    def before_tune(*_) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, before_tune)
    try:
        yield lambda: signal.getsignal(signal.SIGINT) is before_tune
    finally:
        signal.signal(signal.SIGINT, previous)


def _reported_last_step(grid, max_steps: int) -> int:
    """How many trials of a result grid reported their last step to Tune. Not the trials holding its checkpoint: a
    trial stopped by a signal between writing it and reporting was taken as completed, with no steps and no metric
    (found by use); ``--resume`` reports it."""
    return sum(int((result.metrics or {}).get("step", 0)) == max_steps for result in grid)


def _score_answers(cfg: JobConfig, out: Path, rows: list[dict[str, Any]], log) -> None:
    """``tune.metric`` of each completed trial: its answers to the eval set, scored by ``raylora eval`` (one pass over
    every trial's adapter, ``out/eval``). Each row's ``eval_loss`` keeps the metric its trial reported; ``metric``
    becomes the answers' score (NaN for trials that did not complete); each trial's MLflow child run gets it too."""
    metrics = list(dict.fromkeys([*cfg.eval.metrics, cfg.tune.metric]))
    job = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, candidates=[str(out)], metrics=metrics,
                                                            output_dir=str(out / "eval")))  # fmt: skip
    scores = evaluate(job, "the sweep", log)["candidates"]
    client = None
    if cfg.tracking.enabled:
        import mlflow  # see _check_parent

        client = mlflow.MlflowClient(tracking_uri(cfg.tracking))
    for row in rows:
        row["eval_loss"] = row["metric"]
        got = scores.get(f"trial-{row['trial']}")
        row["metric"] = (
            got["metrics"].get(cfg.tune.metric, math.nan) if got and row["status"] == "completed" else math.nan
        )
        saved = Path(row["dir"]) / "mlflow_run.json"
        if client is not None and saved.exists() and math.isfinite(row["metric"]):
            client.log_metric(json.loads(saved.read_text())["run_id"], cfg.tune.metric, row["metric"])


def _check_data(cfg: JobConfig, data) -> None:
    """What only the prepared data tells, before any trial: an eval metric needs eval rows, and the largest
    trial a micro-batch per worker.

    Raises:
        ConfigError: the eval split came out empty. DataError: too few training sequences for the largest trial.
    """
    if cfg.tune.rung_metric.startswith("eval_") and data.eval is None:
        raise ConfigError(
            [("data.eval_fraction", f"left no eval rows, and tune.metric={cfg.tune.metric} needs them; raise "
                                    "data.eval_fraction (or set data.eval_count), or use tune.metric=loss")],
            "the sweep",
        )  # fmt: skip
    keys = ("train.batch_size", "train.num_workers")
    biggest = {key: space.largest(cfg, key) for key in keys}
    try:
        check_enough(from_dict(space.apply(to_dict(cfg), biggest)), data.packs)
    except DataError as e:
        searched = ", ".join(f"{k}={v}" for k, v in biggest.items() if k in cfg.tune.space)
        raise DataError(f"a trial with {searched}: {e}" if searched else str(e)) from None


def check_sweep(cfg: JobConfig) -> None:
    """The search space's, for a grouped sweep the groups', and for a sweep choosing on answers (or generating during
    training) the eval set's problems, all in one :class:`ConfigError`."""
    problems = []
    checks = [space.check] + ([groups.check] if cfg.tune.trials_per_group > 1 else [])
    answers = cfg.tune.answers or cfg.train.generate_eval_every  # the eval set is read to choose, or to generate
    for check in checks + ([lambda c: check_eval(c, with_candidates=False)] if answers else []):
        try:
            check(cfg)
        except ConfigError as e:
            problems += e.problems
    if problems:
        raise ConfigError(problems, "the sweep")


def trials_at_once(cfg: JobConfig) -> int:
    """How many trials run together: ``tune.max_concurrent``, capped by how many trials' workers the cluster holds.

    Raises:
        ConfigError: one trial asks for more CPUs / GPUs / NPUs than the whole cluster has.
    """
    _, scaling, _ = worker_plan(cfg.backend, cfg.train.num_workers, cfg.train.cpus_per_worker)
    per_worker = scaling["resources_per_worker"]
    cluster = ray.cluster_resources()
    fits = min(int(cluster.get(k, 0) // (v * cfg.train.num_workers)) for k, v in per_worker.items())
    if fits == 0:
        asked = ", ".join(f"{v * cfg.train.num_workers:g} {k}" for k, v in per_worker.items())
        has = ", ".join(f"{cluster.get(k, 0):g} {k}" for k in per_worker)
        raise ConfigError(
            [("train.num_workers", f"one trial asks for {asked} (train.num_workers={cfg.train.num_workers} x "
              f"{per_worker}), and the cluster has {has}; lower train.num_workers or train.cpus_per_worker, "
              "or add nodes")], "the sweep",
        )  # fmt: skip
    return min(fits, cfg.tune.max_concurrent or fits)


def _final_checkpoint(out: Path, max_steps: int) -> Path | None:
    """The trial's checkpoint of its last step, if it got there (Ray Train writes it before the report reaches Tune)."""
    for folder in sorted((out / "ray").glob("checkpoint_*")):
        meta = folder / "meta.json"
        if meta.exists() and json.loads(meta.read_text())["step"] == max_steps:
            return folder
    return None


def _release_stopped_callback(out: Path):
    """A Tune callback releasing each ended trial's worker placement group (see :func:`_release_placement_groups`)."""

    class ReleaseStopped(Callback):
        def on_trial_complete(self, iteration, trials, trial, **info):
            _release_placement_groups(out / "trials" / trial.trial_id)

        def on_trial_error(self, iteration, trials, trial, **info):
            self.on_trial_complete(iteration, trials, trial)

    return ReleaseStopped()


def _check_same_settings(cfg: JobConfig, out: Path) -> None:
    """A resumed sweep runs with the settings it started with: Tune restores its trials as they were, so other
    settings (a forgotten override) would train some trials for one budget and some for another, and pick a best
    across them.

    Raises:
        ConfigError: one problem per setting that differs from ``sweep_config.json``.
    """
    saved = out / "sweep_config.json"
    if not saved.is_file():  # a sweep started by an earlier raylora
        return
    started, now = _trial_settings(json.loads(saved.read_text())), _trial_settings(_settings(cfg))
    problems = [
        (key, f"the sweep started with {started[key]!r}, this command gives {now.get(key)!r}")
        for key in sorted(started)  # a key a later raylora added is not in the file: not compared
        if started[key] != now.get(key)
    ]
    if problems:
        problems.append(("--resume", f"continues the sweep with the settings it started with (in {saved}): give the "
                                     "same config and overrides, or start a new sweep in another train.output_dir"))  # fmt: skip
        raise ConfigError(problems, "the resumed sweep")


def _settings(cfg: JobConfig) -> dict[str, Any]:
    """The job's settings as ``sweep_config.json`` keeps them: flat, JSON values."""
    return json.loads(json.dumps(flatten(to_record(cfg)), default=str))


def _trial_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings that change what a trial trains: not where outputs go, how many trials run at once, retries,
    serving, export or tracking; data files by name (a `ray job submit` resume reads them from another folder)."""
    kept = {k: v for k, v in settings.items() if k.split(".")[0] in ("model", "lora", "train", "data", "tune", "backend")
            and k not in ("train.output_dir", "data.output_dir", "tune.max_concurrent", "train.max_failures")}  # fmt: skip
    if isinstance(kept.get("data.sources"), list):
        kept["data.sources"] = [s | {"path": Path(str(s.get("path"))).name} if isinstance(s, dict) else s
                                for s in kept["data.sources"]]  # fmt: skip
    return kept


def _check_parent(cfg: JobConfig, out: Path) -> None:
    """A resumed sweep's MLflow parent run is in this job's store (a sweep started against another store's is not)."""
    saved = out / "sweep.json"
    if not saved.exists():
        return
    import mlflow  # 0.7 s after Ray: only once tracking is on, as in raylora.tracking

    run_id = json.loads(saved.read_text())["parent_run_id"]
    uri = tracking_uri(cfg.tracking)
    where = (
        f"the sweep in {out} logs to MLflow run {run_id}, which {uri} does not hold; resume with the "
        "tracking.uri (and working folder) the sweep started with"
    )
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise ConfigError([("tracking.uri", where)], "the sweep")  # opening a client would create an empty store
    try:
        run = mlflow.MlflowClient(uri).get_run(run_id)
    except mlflow.exceptions.MlflowException:
        raise ConfigError([("tracking.uri", where)], "the sweep") from None
    if run.info.lifecycle_stage != "active":
        raise ConfigError(
            [("tracking.uri", f"the sweep's MLflow parent run {run_id} was deleted; restore it in MLflow, or start "
                              "the sweep again in another train.output_dir")],
            "the sweep",
        )  # fmt: skip


def _searcher(cfg: JobConfig, at_once: int):
    if cfg.tune.search == "optuna":
        return ConcurrencyLimiter(OptunaSearch(seed=cfg.train.seed), max_concurrent=at_once)
    return BasicVariantGenerator(random_state=cfg.train.seed, max_concurrent=at_once)


def _release_placement_groups(trial_dir: Path) -> None:
    """Remove the placement group of a trial's Ray Train workers, once Tune has ended the trial.

    Tune ends a trial that ASHA stops by killing its process, and with it the Ray Train controller.
    The controller's placement group belongs to the sweep's driver, so it would hold its CPUs until the
    sweep ends, and the next trials would wait for CPUs forever. Ray Train's own cleaner actor, which would
    remove it, is not started (:mod:`raylora.train.lean`). Each worker records its group's id.
    """
    ids = {json.loads(p.read_text()).get("placement_group") for p in (trial_dir / "workers").glob("rank*.json")}
    table = ray.util.placement_group_table()
    for pg_id in ids - {None}:
        if table.get(pg_id, {}).get("state") not in (None, "REMOVED"):
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))


def _generating_at_rungs(cfg: JobConfig) -> JobConfig:
    """With ``tune.generate_at_rungs``, the job every trial runs: generating at each multiple of ASHA's first rung
    (``train.generate_eval_every``), scoring ``tune.metric`` among ``eval.metrics``."""
    if not cfg.tune.generate_at_rungs:
        return cfg
    train = dataclasses.replace(cfg.train, generate_eval_every=cfg.tune.grace_steps or cfg.train.eval_every)
    metrics = [*cfg.eval.metrics, *([] if cfg.tune.metric in cfg.eval.metrics else [cfg.tune.metric])]
    return dataclasses.replace(cfg, train=train, eval=dataclasses.replace(cfg.eval, metrics=metrics))


def _scheduler(cfg: JobConfig):
    if cfg.tune.scheduler == "none":
        return None
    return ASHAScheduler(
        time_attr="step",
        max_t=cfg.train.max_steps,
        grace_period=cfg.tune.grace_steps or cfg.train.eval_every,
        reduction_factor=cfg.tune.reduction_factor,
    )


def _finish_trial(cfg: JobConfig, result) -> dict[str, Any]:
    """Classify one ended trial, copy out a completed trial's adapter, close its MLflow child run; returns its row.

    A trial is ``completed`` when its Train run wrote the checkpoint of ``train.max_steps`` with a finite
    metric, ``failed`` when it raised (diverged, crashed) or its metric is not finite (never the best),
    and ``stopped early`` when ASHA ended it. The child run ends FINISHED, FAILED or KILLED, tagged
    ``raylora.trial_status``.
    """
    metrics = result.metrics or {}
    values = {k: (result.config or {}).get(k) for k in cfg.tune.space}
    trial = metrics.get("trial_id") or _trial_id(Path(result.path))
    out = Path(cfg.train.output_dir).resolve() / "trials" / trial
    value = metrics.get(cfg.tune.rung_metric)
    metric = float(value) if value is not None else math.nan
    final = _final_checkpoint(out, cfg.train.max_steps)
    if result.error is not None or (value is not None and not math.isfinite(metric)):
        status = "failed"
    elif final is not None:
        status = "completed"
        save_outputs(final, space.trial_config(to_dict(cfg), values, out), out)
    else:
        status = "stopped early"
    if status == "failed":  # the reason, where the sweep's message sends the user (it was in the console only)
        reason = str(result.error) if result.error is not None else f"{cfg.tune.rung_metric} is {metric}, not finite"
        out.mkdir(parents=True, exist_ok=True)
        (out / "error.txt").write_text(reason + "\n")
    saved = out / "mlflow_run.json"
    if cfg.tracking.enabled and saved.exists():
        import mlflow  # see _check_parent

        run_id = json.loads(saved.read_text())["run_id"]
        client = mlflow.MlflowClient(tracking_uri(cfg.tracking))
        client.set_tag(run_id, STATUS_TAG, status)
        mlflow_status = {"completed": "FINISHED", "failed": "FAILED", "stopped early": "KILLED"}[status]
        artifacts = [out / "config.yaml", out / "loss.png", out / "history.json"] if status == "completed" else []
        if status == "failed":
            last = next((line for line in reversed(reason.splitlines()) if line.strip()), reason)
            client.set_tag(run_id, ERROR_TAG, last.strip()[:MAX_TAG_CHARS])
            artifacts.append(out / "error.txt")
        finish_run(cfg.tracking, run_id, artifacts, mlflow_status)
    steps = int(metrics.get("step", 0))
    return {"trial": trial, **values, "status": status, "steps": steps, "metric": metric, "dir": str(out)}


def _trial_id(path: Path) -> str:
    """The trial id in the name of Tune's trial folder (``run_trial_<id>_<index>_<values>...``)."""
    parts = path.name.split("_")
    return f"{parts[2]}_{parts[3]}"


def _log_best(cfg: JobConfig, parent: str | None, best: dict[str, Any], out: Path) -> tuple[str, int] | None:
    """Log the best config, metric, adapter, table and plot to the parent run and register the adapter."""
    if parent is None:
        return None
    import mlflow  # see _check_parent

    uri = tracking_uri(cfg.tracking)
    client = mlflow.MlflowClient(uri)
    for key in cfg.tune.space:
        client.log_param(parent, f"best.{key}", best[key])
    client.log_param(parent, "best.trial", best["trial"])
    client.log_metric(parent, f"best_{cfg.tune.metric}", best["metric"])
    finish_run(cfg.tracking, parent, [out / "best" / "adapter", out / "results.csv", out / "sweep.png"], "FINISHED")
    name = cfg.tune.register_as or out.name
    return name, register(uri, name, f"runs:/{parent}/adapter")


def _write_table(rows: list[dict[str, Any]], path: Path) -> None:
    columns = [k for k in rows[0] if k != "dir"] if rows else ["trial"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _plot(cfg: JobConfig, rows: list[dict[str, Any]], path: Path) -> None:
    """The metric of every trial over lora.rank x train.lr (else the first two searched keys; with one, the metric
    over it), one marker per status."""
    import matplotlib  # see raylora.train.plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # see raylora.train.plot

    keys = [k for k in ("train.lr", "lora.rank") if k in cfg.tune.space]
    keys += [k for k in cfg.tune.space if k not in keys]
    x_key, y_key = (keys + [None])[:2]
    fig, ax = plt.subplots(figsize=(7, 5), dpi=100)
    finite = [r["metric"] for r in rows if math.isfinite(r["metric"])]
    low, high = (min(finite), max(finite)) if finite else (0.0, 1.0)
    x_of = _axis(rows, x_key)
    y_of = _axis(rows, y_key) if y_key else lambda r: r["metric"] if math.isfinite(r["metric"]) else high
    for status, marker in (("completed", "o"), ("stopped early", "s"), ("failed", "x")):
        group = [r for r in rows if r["status"] == status]
        if not group:
            continue
        xs = [x_of(r) for r in group]
        ys = [y_of(r) for r in group]
        colours = [r["metric"] if math.isfinite(r["metric"]) else high for r in group]
        points = ax.scatter(xs, ys, c=colours, cmap="viridis_r" if cfg.tune.mode == "min" else "viridis",
                            vmin=low, vmax=high, marker=marker, s=90, label=status)  # fmt: skip
        for x, y, r in zip(xs, ys, group, strict=True):
            ax.annotate(f"{r['metric']:.3g}", (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
    if finite:
        fig.colorbar(points, ax=ax, label=cfg.tune.metric)
    if x_key == "train.lr":
        ax.set_xscale("log")
    if y_key == "lora.rank":
        ax.set_yscale("log", base=2)
    ax.set_xlabel(x_key)
    ax.set_ylabel(y_key or cfg.tune.metric)
    ax.set_title(f"{cfg.tune.metric} per trial ({cfg.tune.mode}imise)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _axis(rows: list[dict[str, Any]], key: str):
    """Position of a row on a plot axis: the value of ``key`` if numeric, else its index among the sorted values."""
    values = [row[key] for row in rows]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return lambda row: float(row[key])
    order = sorted({str(v) for v in values})
    return lambda row: float(order.index(str(row[key])))
