"""The sweep's search space: written in YAML over dotted config keys, checked whole before any trial.

``tune.space`` maps a ``lora.*``, ``train.*`` or ``preference.*`` key to one distribution::

    lora.rank: {choice: [4, 8, 16]}          # any values the key accepts
    train.lr: {loguniform: [1.0e-5, 1.0e-3]} # low > 0
    lora.alpha: {grid: [16, 32]}             # every value, in every combination
    lora.dropout: {uniform: [0.0, 0.1]}
    train.warmup_steps: {randint: [0, 10]}   # high excluded

:func:`check` lists every problem of the space and of the sweep's settings (with the exact key and
the fix) as one :class:`~raylora.config.ConfigError`; :func:`to_tune` turns a checked space into Ray
Tune's domains; :func:`apply` sets one trial's values into the job.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib.util
import typing
from pathlib import Path
from typing import Any

from raylora.config import (
    PREFERENCE_METRICS,
    ConfigError,
    JobConfig,
    LoraArgs,
    PreferenceArgs,
    TrainArgs,
    coerce,
    from_dict,
    to_dict,
)
from raylora.registry import AdapterError, check_name

DISTRIBUTIONS = ("choice", "grid", "uniform", "loguniform", "randint")
RANGES = ("uniform", "loguniform", "randint")
SWEPT_SECTIONS = {"lora": LoraArgs, "train": TrainArgs, "preference": PreferenceArgs}
# The sweep decides these per trial or for the whole sweep; a trial must not change them.
FIXED = {
    "train.output_dir": "each trial writes to train.output_dir/trials/<trial id>",
    "train.eval_every": "the ASHA rungs and the reported metric depend on it",
    "train.max_steps": "ASHA's budget is train.max_steps",
    "train.objective": "every trial trains on the data prepared once, which is of one objective's kind",
}


def check(cfg: JobConfig) -> None:
    """Raise one :class:`ConfigError` naming every problem of the sweep, before anything starts.

    Raises:
        ConfigError: an empty or malformed space, an unknown distribution or key, low >= high, a
            non-number where one is needed, a value the key does not accept, grid search over a
            continuous distribution, ``search: optuna`` without optuna, a metric training does not
            report for this job, ASHA without evaluations or with a first rung that no report reaches before the
            last step, a missing base model, target modules (the job's, or a searched value) that are not Linear
            layers of the base model.
    """
    problems: list[tuple[str, str]] = []
    tune = cfg.tune
    if not tune.space:
        problems.append(
            ("tune.space", "is empty; give at least one key to search, e.g. lora.rank: {choice: [4, 8, 16]}")
        )
    for key, spec in tune.space.items():
        problems += _check_entry(cfg, key, spec)
    kinds = {next(iter(spec)) for spec in tune.space.values() if isinstance(spec, dict) and len(spec) == 1}
    if tune.search == "grid" and kinds & set(RANGES):
        for key, spec in tune.space.items():
            if isinstance(spec, dict) and next(iter(spec), None) in RANGES:
                problems.append(
                    (
                        f"tune.space.{key}",
                        f"search: grid cannot search a continuous distribution ({next(iter(spec))}); list the "
                        "values ({grid: [...]}) or use search: random or optuna",
                    )
                )
    if tune.search == "optuna":
        if "grid" in kinds:
            problems.append(("tune.search", "optuna cannot search grid entries; use choice, or search: random"))
        if importlib.util.find_spec("optuna") is None:
            problems.append(("tune.search", "optuna is not installed; pip install optuna, or use search: random"))
    evaluates = cfg.data.eval_fraction > 0 or cfg.data.eval_count is not None
    lower_better = tune.metric in ("eval_loss", "eval_perplexity", "loss", "reference_loss")
    if (tune.answers or tune.metric in PREFERENCE_METRICS) and tune.mode != ("min" if lower_better else "max"):
        problems.append(("tune.mode", f"is {tune.mode}, and a {'lower' if lower_better else 'higher'} {tune.metric} "
                                      f"is better; set tune.mode={'min' if lower_better else 'max'}"))  # fmt: skip
    if cfg.train.objective == "sft" and tune.metric in PREFERENCE_METRICS:
        problems.append(("tune.metric", f"{tune.metric} is reported by a preference objective (train.objective dpo, "
                                        "simpo, orpo or kto); this job trains sft"))  # fmt: skip
    if cfg.train.objective == "kto" and tune.metric == "eval_rewards/accuracies":
        problems.append(("tune.metric", "kto's answers are unpaired: it reports no eval_rewards/accuracies; use "
                                        "eval_loss or eval_rewards/margins"))  # fmt: skip
    if cfg.train.objective != "sft" and tune.metric == "eval_perplexity":
        problems.append(("tune.metric", f"train.objective {cfg.train.objective} reports no perplexity: its eval_loss "
                                        f"is its objective on the held-out pairs; use eval_loss or one of "
                                        f"{', '.join(PREFERENCE_METRICS)}"))  # fmt: skip
    if tune.generate_at_rungs:
        problems += _check_generate_at_rungs(cfg)
    if tune.metric == "judge" and not cfg.eval.judge.url:
        problems.append(("tune.metric", "judge scores answers with eval.judge.url's model, and it is not set"))
    if tune.rung_metric.startswith("eval_") and not evaluates:
        problems.append(
            (
                "tune.metric",
                f"{tune.metric} needs an eval split, and this job holds none out; set data.eval_fraction "
                "(e.g. 0.1) or data.eval_count, or use tune.metric=loss",
            )
        )
    if tune.scheduler == "asha" and tune.rung_metric.startswith("eval_") and cfg.train.eval_every == 0:
        problems.append(
            (
                "train.eval_every",
                "is 0 (evaluate only at the end), so ASHA could never stop a trial early; set it to a few steps "
                f"(e.g. {max(1, cfg.train.max_steps // 8)}) or use tune.scheduler=none",
            )
        )
    if tune.scheduler == "asha":
        grace = tune.grace_steps or cfg.train.eval_every
        if grace > cfg.train.max_steps:
            key = "tune.grace_steps" if tune.grace_steps else "train.eval_every"
            problems.append(
                (key, f"is {grace}, past train.max_steps={cfg.train.max_steps}: ASHA's first rung must come before "
                      "the last step; lower it, or use tune.scheduler=none")
            )  # fmt: skip
        elif grace == 0 and not tune.rung_metric.startswith("eval_"):  # an eval metric: the eval_every problem above
            problems.append(
                ("tune.grace_steps", "is not set and train.eval_every is 0: ASHA needs the steps every trial runs "
                                     f"before it may stop one; set it (e.g. {max(1, cfg.train.max_steps // 4)})")
            )  # fmt: skip
        elif grace and not (tune.rung_metric.startswith("eval_") and cfg.train.eval_every == 0):
            problems += _check_first_rung(cfg, grace)
    if tune.register_as is not None:
        try:
            check_name(tune.register_as)
        except AdapterError as e:
            problems.append(("tune.register_as", str(e)))
    if "tune.space.lora.target_modules" not in dict(problems):  # values of the wrong type are reported already
        problems += _check_targets(cfg)
    if problems:
        raise ConfigError(problems, "the sweep")


def trial_values(cfg: JobConfig, key: str) -> list[Any]:
    """Every value a trial may take for ``key``: the listed values of its search entry, else the job's own."""
    spec = cfg.tune.space.get(key)
    if isinstance(spec, dict) and next(iter(spec)) in ("choice", "grid"):
        return as_numbers(key, list(next(iter(spec.values()))))
    section, name = key.split(".")
    return [getattr(getattr(cfg, section), name)]


def largest(cfg: JobConfig, key: str) -> Any:
    """The largest value a trial may take for a numeric ``key`` (a range's high end, randint's excluded)."""
    spec = cfg.tune.space.get(key)
    if isinstance(spec, dict) and next(iter(spec)) in RANGES:
        kind, values = next(iter(spec.items()))
        low, high = as_numbers(key, values)
        return high - 1 if kind == "randint" else high
    return max(trial_values(cfg, key))


def as_numbers(key: str, values: list[Any]) -> list[Any]:
    """``values`` of a float ``key`` with the numbers YAML 1.1 reads as strings (``1e-4``: no dot) made floats, by the
    rule that reads ``train.lr=1e-3`` from a config; other keys' values, and strings that are no number, stay as
    they are."""
    section, _, name = key.partition(".")
    cls = SWEPT_SECTIONS.get(section)
    hints = typing.get_type_hints(cls) if cls else {}
    if hints.get(name) not in (float, float | None):
        return values
    out = []
    for value in values:
        refused: list[tuple[str, str]] = []
        number = coerce(value, float, key, refused) if isinstance(value, str) else value
        out.append(value if refused else number)
    return out


def _check_generate_at_rungs(cfg: JobConfig) -> list[tuple[str, str]]:
    """``tune.generate_at_rungs`` needs a generation metric that a few rows score during training, ASHA's rungs, and
    ``train.generate_eval_every`` left to it: every problem of these."""
    tune, key, problems = cfg.tune, "tune.generate_at_rungs", []
    if not tune.answers or tune.metric in ("reference_loss", "judge"):
        problems.append((key, f"ASHA would compare trials on answers scored during training, and tune.metric="
                              f"{tune.metric} is not such a score; choose a generation metric (exact_match, contains, "
                              "rouge-l, bleu-4, ...) or set it to false"))  # fmt: skip
    if tune.scheduler != "asha":
        problems.append((key, "has no rungs to generate at with tune.scheduler=none; set it to false (the best trial "
                              "is still chosen on its answers when it completes)"))  # fmt: skip
    grace = tune.grace_steps or cfg.train.eval_every
    if cfg.train.generate_eval_every not in (0, grace):
        problems.append(("train.generate_eval_every", f"is {cfg.train.generate_eval_every}; with "
                         f"tune.generate_at_rungs the sweep sets it to ASHA's first rung ({grace}): leave it unset "
                         "(0)"))  # fmt: skip
    return problems


def _check_first_rung(cfg: JobConfig, grace: int) -> list[tuple[str, str]]:
    """ASHA's first rung (at step ``grace``) when no report of the metric lands on or after it before the last step.

    ASHA decides at a trial's first report at or past a rung; at ``max_t`` (``train.max_steps``) it only ends the
    trial. Trials report an ``eval_*`` metric at evaluations, the loss at every logged, evaluated or checkpointed step.
    """
    last, metric = cfg.train.max_steps, cfg.tune.rung_metric
    if metric.startswith("gen_"):  # trials generate at every multiple of the first rung
        key = "tune.grace_steps" if cfg.tune.grace_steps else "train.eval_every"
        return [] if grace < last else [(key, f"is {grace} and train.max_steps={last}: ASHA's first rung, where "
                                              "trials first generate, comes at the last step, so ASHA could never stop a trial early; "
                                              "lower it, or use tune.scheduler=none")]  # fmt: skip
    keys = ["train.eval_every"]
    if not metric.startswith("eval_"):
        keys = ["train.log_every", *keys, "train.checkpoint_every"]
    every = {}
    for key in keys:
        if key in cfg.tune.space and not _listed(cfg.tune.space[key]):
            return []  # a searched range (or an entry with its own problem): the cadence is not known here
        values = trial_values(cfg, key)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            return []  # a searched value the key refuses: its entry's problem
        every[key] = [v for v in values if v > 0]
    cadences = {c for values in every.values() for c in values}
    if any(-(-grace // c) * c < last for c in cadences):  # the first multiple of c at or past grace
        return []
    latest = max([(last - 1) // c * c for c in cadences] + [0])
    if latest:
        fix = f"set tune.grace_steps={latest} or lower"
    else:
        fix = f"lower {keys[0]} below train.max_steps={last} (e.g. {max(1, last // 4)})"
    reports = ", ".join(f"{k}={'/'.join(map(str, v))}" for k, v in every.items() if v)
    rung = "" if cfg.tune.grace_steps else " (ASHA's first rung while tune.grace_steps is unset)"
    return [
        (
            "tune.grace_steps" if cfg.tune.grace_steps else "train.eval_every",
            f"is {grace}{rung}, and trials report {metric} at multiples of {reports} and at the last step ({last}), where "
            f"ASHA only ends them: no report lands from step {grace} on before it, so ASHA could never stop a trial "
            f"early; {fix}, or use tune.scheduler=none",
        )
    ]


def _listed(spec: Any) -> bool:
    """Whether ``spec`` is a well-formed ``choice`` or ``grid`` entry (its values listed)."""
    return (
        isinstance(spec, dict)
        and len(spec) == 1
        and next(iter(spec)) in ("choice", "grid")
        and isinstance(next(iter(spec.values())), list)
    )


def problem_key(cfg: JobConfig, key: str) -> str:
    """Where a problem with ``key``'s trial values lies: its search entry, else the job's own key."""
    return f"tune.space.{key}" if key in cfg.tune.space else key


def _check_targets(cfg: JobConfig) -> list[tuple[str, str]]:
    """A missing base model, or each trial value of ``lora.target_modules`` that names a layer it lacks (checked on
    the model's skeleton: no weights are read)."""
    from raylora.model_files import ModelError  # with models, torch and transformers (3.7 s): the CLI imports space
    from raylora.models import model_skeleton, target_modules  # see the line above

    try:
        skeleton = model_skeleton(cfg.model)
    except (ModelError, ValueError, OSError) as e:  # ValueError, OSError: a config.json transformers cannot read
        return [("model.name_or_path", str(e))]
    problems = []
    for value in trial_values(cfg, "lora.target_modules"):
        try:
            target_modules(skeleton, list(value))
        except ModelError as e:
            problems.append(
                (problem_key(cfg, "lora.target_modules"), f"a trial with lora.target_modules={list(value)}: {e}")
            )
    return problems


def _check_entry(cfg: JobConfig, key: str, spec: Any) -> list[tuple[str, str]]:
    where = f"tune.space.{key}"
    section, _, name = key.partition(".")
    if section not in SWEPT_SECTIONS:
        return [
            (
                where,
                f"only lora.*, train.* and preference.* keys can be searched (trials share the data prepared once and the "
                f"model); got section {section!r}",
            )
        ]
    fields = {f.name: f for f in dataclasses.fields(SWEPT_SECTIONS[section])}
    if name not in fields:
        near = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.5)
        hint = f"did you mean '{section}.{near[0]}'? " if near else ""
        return [(where, f"{key} is not a config key; {hint}valid keys: {', '.join(fields)}")]
    if key in FIXED:
        return [(where, f"cannot be searched: {FIXED[key]}")]
    if not isinstance(spec, dict) or len(spec) != 1:
        return [
            (where, f"got {spec!r}; expected one distribution, e.g. {{choice: [4, 8]}} or {{loguniform: [1e-5, 1e-3]}}")
        ]
    kind, values = next(iter(spec.items()))
    if kind not in DISTRIBUTIONS:
        near = difflib.get_close_matches(str(kind), DISTRIBUTIONS, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        return [(where, f"unknown distribution {kind!r}; {hint}allowed: {', '.join(DISTRIBUTIONS)}")]
    if not isinstance(values, list) or not values:
        return [(where, f"{kind} takes a non-empty list, got {values!r}")]
    given, values = values, as_numbers(key, values)
    if kind in RANGES:
        field_type = typing.get_type_hints(SWEPT_SECTIONS[section])[name]
        number = int if kind == "randint" else (int, float)
        if field_type is int and kind != "randint":
            return [(where, f"{kind} samples floats, and {key} is an integer; use randint or choice")]
        if field_type not in (int, float) or (kind == "randint" and field_type is not int):
            wanted = "an integer" if kind == "randint" else "a number"
            return [
                (
                    where,
                    f"{kind} needs {wanted} key, and {key} is {getattr(field_type, '__name__', field_type)}; use choice",
                )
            ]
        if len(values) != 2 or not all(isinstance(v, number) and not isinstance(v, bool) for v in values):
            return [
                (where, f"{kind} takes [low, high] ({'integers' if kind == 'randint' else 'numbers'}), got {given!r}")
            ]
        low, high = values
        if low >= high:
            return [(where, f"low {low} must be below high {high}")]
        if kind == "loguniform" and low <= 0:
            return [(where, f"loguniform needs low > 0, got {low}")]
        values = [low, high - 1] if kind == "randint" else [low, high]
    problems = []
    for value in values:
        try:
            from_dict(apply(to_dict(cfg), {key: value}))
        except ConfigError as e:
            problems += [(where, f"value {value!r}: {msg}") for _, msg in e.problems]
    return problems


def to_tune(space: dict[str, dict[str, Any]], search: str) -> dict[str, Any]:
    """Ray Tune's ``param_space`` for a checked space (keys stay dotted); ``choice`` is a grid under grid search."""
    from ray import tune  # 0.9 s: the CLI imports this module, and only `raylora tune` gets here

    domains = {}
    for key, spec in space.items():
        kind, values = next(iter(spec.items()))
        values = as_numbers(key, values)
        if _is_grid(kind, search):
            domains[key] = tune.grid_search(values)
        elif kind == "choice":
            domains[key] = tune.choice(values)
        else:
            domains[key] = getattr(tune, kind)(*values)
    return domains


def trial_count(tune_args) -> int:
    """How many trials a sweep runs: ``num_samples`` times the size of every grid (Tune repeats each grid per sample)."""
    count = tune_args.num_samples
    for spec in tune_args.space.values():
        kind, values = next(iter(spec.items()))
        if _is_grid(kind, tune_args.search):
            count *= len(values)
    return count


def _is_grid(kind: str, search: str) -> bool:
    """Whether Tune expands an entry of this kind into every value: a grid, or a choice under grid search."""
    return kind == "grid" or (kind == "choice" and search == "grid")


def trial_config(job: dict, values: dict[str, Any], out: Path) -> JobConfig:
    """The job of one trial: ``job`` (a :func:`~raylora.config.to_dict` dict) with the trial's ``values``, writing to
    ``out``."""
    return from_dict(apply(job, {**values, "train.output_dir": str(out)}))


def apply(job: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``job`` (a :func:`~raylora.config.to_dict` dict) with dotted ``values`` set."""
    out = copy.deepcopy(job)
    for key, value in values.items():
        section, name = key.split(".", 1)
        out[section][name] = value
    return out
