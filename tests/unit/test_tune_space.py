"""Every bad sweep is refused before any trial, naming the exact key and the fix."""

from pathlib import Path

import pytest

from raylora.config import ConfigError, load_config
from raylora.tune import space

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_sweep_cpu.yaml"


def problems(*overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        space.check(load_config(TINY, list(overrides)))
    return dict(err.value.problems)


def test_the_shipped_tiny_sweep_passes():
    space.check(load_config(TINY))


def test_empty_space():
    assert "is empty; give at least one key" in problems("tune.space={}")["tune.space"]


@pytest.mark.parametrize(
    ("entry", "key", "fragment"),
    [
        ("lora.rank: [4, 8]", "lora.rank", "expected one distribution"),
        ("lora.rank: {choise: [4, 8]}", "lora.rank", "unknown distribution 'choise'; did you mean 'choice'?"),
        ("train.lr: {loguniform: [1.0e-3, 1.0e-5]}", "train.lr", "low 0.001 must be below high 1e-05"),
        ("train.lr: {uniform: [0.1]}", "train.lr", "uniform takes [low, high]"),
        ("train.lr: {loguniform: [0, 1.0e-3]}", "train.lr", "loguniform needs low > 0"),
        ("lora.rnak: {choice: [4]}", "lora.rnak", "did you mean 'lora.rank'?"),
        (
            "data.cutoff_len: {choice: [64]}",
            "data.cutoff_len",
            "only lora.*, train.* and preference.* keys can be searched",
        ),
        ("lora.target_modules: {uniform: [1, 2]}", "lora.target_modules", "uniform needs a number key"),
        ("lora.rank: {uniform: [4, 16]}", "lora.rank", "use randint or choice"),
        ("train.lr: {randint: [1, 3]}", "train.lr", "randint needs an integer key"),
        ("lora.rank: {choice: [4, 0]}", "lora.rank", "value 0: got 0, allowed: ≥ 1"),
        ("lora.alpha: {choice: [16, big]}", "lora.alpha", "value 'big': got 'big' (str), expected float"),
        ("train.max_steps: {choice: [4, 8]}", "train.max_steps", "ASHA's budget is train.max_steps"),
        ("lora.rank: {choice: []}", "lora.rank", "takes a non-empty list"),
    ],
)
def test_bad_entries_name_the_key(entry, key, fragment):
    found = problems("tune.space={" + entry + "}")
    assert fragment in found[f"tune.space.{key}"]


def test_every_problem_is_listed_at_once():
    found = problems("tune.space={lora.rank: {choise: [4]}, train.lr: {loguniform: [1, 0.1]}}", "tune.metric=eval_loss",
                     "data.eval_fraction=0", "train.eval_every=0")  # fmt: skip
    assert {"tune.space.lora.rank", "tune.space.train.lr", "tune.metric", "train.eval_every"} <= set(found)
    assert "data.eval_fraction" in found["tune.metric"] and "tune.scheduler=none" in found["train.eval_every"]


def test_grid_search_over_a_continuous_distribution():
    found = problems("tune.search=grid")
    assert "search: grid cannot search a continuous distribution (loguniform)" in found["tune.space.train.lr"]


def test_optuna_missing_says_how_to_install(monkeypatch):
    real = space.importlib.util.find_spec
    monkeypatch.setattr(space.importlib.util, "find_spec", lambda name: None if name == "optuna" else real(name))
    assert "pip install optuna" in problems("tune.search=optuna")["tune.search"]


def test_a_metric_training_does_not_report_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match=r"tune.metric: got 'accuracy', allowed: eval_loss, eval_perplexity, loss"):
        load_config(TINY, ["tune.metric=accuracy"])


def test_a_bad_registered_name():
    assert "tune.register_as" in problems("tune.register_as=../best")


def test_a_trial_larger_than_the_cluster_is_refused(monkeypatch):
    import ray

    from raylora.tune.sweep import trials_at_once

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    assert trials_at_once(load_config(TINY)) == 2
    assert trials_at_once(load_config(TINY, ["tune.max_concurrent=1"])) == 1
    with pytest.raises(ConfigError) as err:
        trials_at_once(load_config(TINY, ["train.num_workers=3"]))
    assert "one trial asks for 3 CPU" in dict(err.value.problems)["train.num_workers"]


def test_to_tune_and_apply():
    from ray import tune

    domains = space.to_tune({"lora.rank": {"choice": [4, 8]}, "train.lr": {"loguniform": [1e-5, 1e-3]}}, "grid")
    assert domains["lora.rank"] == tune.grid_search([4, 8]) and domains["train.lr"].lower == 1e-5
    job = space.apply({"lora": {"rank": 8}, "train": {"lr": 1.0}}, {"lora.rank": 4})
    assert job == {"lora": {"rank": 4}, "train": {"lr": 1.0}}


def test_asha_rungs_past_the_last_step_are_refused():
    """Found by use: ASHA's assertion ended the sweep with a traceback, after the data was prepared."""
    assert "past train.max_steps=8" in problems("tune.grace_steps=9")["tune.grace_steps"]
    assert "past train.max_steps=8" in problems("train.eval_every=10")["train.eval_every"]  # the default rung
    no_rung = problems("tune.metric=loss", "train.eval_every=0")
    assert "set it (e.g. 2)" in no_rung["tune.grace_steps"]


def test_what_only_the_prepared_data_tells_is_refused_before_any_trial():
    """Found by use: an empty eval split ended in Tune's traceback (runs left RUNNING); a searched batch larger than
    the data failed every trial three times."""
    from raylora.data.pipeline import DataError, TrainingData
    from raylora.tune.sweep import _check_data

    data = TrainingData(train=None, eval=None, packs=20, finish=dict)
    with pytest.raises(ConfigError, match="left no eval rows"):
        _check_data(load_config(TINY), data)
    cfg = load_config(TINY, ["tune.metric=loss", "tune.space={train.batch_size: {choice: [2, 32]}}"])
    with pytest.raises(DataError, match=r"a trial with train.batch_size=32: the training data has 20 sequences"):
        _check_data(cfg, data)
    _check_data(load_config(TINY, ["tune.metric=loss"]), data)


def test_numbers_yaml_reads_as_strings_are_numbers():
    """Found by use: YAML 1.1 reads 1e-4 (no dot) as a string, and `{loguniform: [1e-4, 1e-2]}`, the very form the
    error suggested, was refused; `train.lr=1e-3` was always a number."""
    cfg = load_config(TINY, ["tune.space={train.lr: {loguniform: [1e-4, 1e-2]}, lora.dropout: {choice: [0, 1e-2]}}"])
    space.check(cfg)
    domains = space.to_tune(cfg.tune.space, cfg.tune.search)
    assert (domains["train.lr"].lower, domains["train.lr"].upper) == (1e-4, 1e-2)
    assert domains["lora.dropout"].categories == [0, 0.01] and space.trial_values(cfg, "lora.dropout") == [0, 0.01]
    assert space.largest(cfg, "train.lr") == 1e-2
    refused = problems("tune.space={train.lr: {loguniform: [small, 1e-2]}}")["tune.space.train.lr"]
    assert "loguniform takes [low, high] (numbers), got ['small', '1e-2']" in refused


def test_a_first_rung_no_report_reaches_is_refused():
    """Found by use: tune.grace_steps=7 with evaluations every 2 of 8 steps was accepted; ASHA ends a trial at its
    last step without a decision, so no report ever met its one rung and it could stop none early."""
    found = problems("tune.grace_steps=7")["tune.grace_steps"]
    assert "report eval_loss at multiples of train.eval_every=2" in found and "set tune.grace_steps=6 or lower" in found
    assert "tune.grace_steps" in problems("tune.grace_steps=8")  # the last step itself
    default_rung = problems("train.eval_every=8")["train.eval_every"]
    assert "lower train.eval_every below train.max_steps=8 (e.g. 2)" in default_rung
    loss = problems("tune.metric=loss", "tune.grace_steps=7")["tune.grace_steps"]
    assert "train.log_every=2, train.eval_every=2" in loss
    for fine in (["tune.grace_steps=3"], ["tune.grace_steps=6"], ["tune.grace_steps=7", "tune.scheduler=none"],
                 ["tune.metric=loss", "tune.grace_steps=7", "train.log_every=1"],
                 ["tune.metric=loss", "tune.grace_steps=7", "train.checkpoint_every=7"],
                 ["tune.metric=loss", "tune.grace_steps=7", "tune.space={train.log_every: {choice: [1, 2]}}"]):  # fmt: skip
        space.check(load_config(TINY, fine))


def test_a_generation_metric_reports_eval_loss_to_asha_and_needs_its_direction():
    tune = load_config(TINY, ["tune.metric=exact_match", "tune.mode=max"]).tune
    assert (tune.answers, tune.rung_metric, tune.rung_mode) == (True, "eval_loss", "min")
    space.check(load_config(TINY, ["tune.metric=exact_match", "tune.mode=max"]))
    assert "set tune.mode=max" in problems("tune.metric=rouge-l", "tune.mode=min")["tune.mode"]
    assert "set tune.mode=min" in problems("tune.metric=reference_loss", "tune.mode=max")["tune.mode"]
    assert (
        "needs an eval split"
        in problems("tune.metric=exact_match", "tune.mode=max", "data.eval_fraction=0")["tune.metric"]
    )
    plain = load_config(TINY).tune
    assert (plain.answers, plain.rung_metric, plain.rung_mode) == (False, "eval_loss", "min")


def test_generating_at_rungs_makes_asha_compare_answers_and_is_refused_where_it_cannot():
    """Issue #37: ``tune.generate_at_rungs`` has ASHA compare trials on a few answers scored during training."""
    cfg = load_config(TINY, ["tune.metric=exact_match", "tune.mode=max", "tune.generate_at_rungs=true"])
    assert (cfg.tune.rung_metric, cfg.tune.rung_mode) == ("gen_exact_match", "max")
    space.check(cfg)
    assert (
        "tune.metric=eval_loss is not such a score" in problems("tune.generate_at_rungs=true")["tune.generate_at_rungs"]
    )
    judged = problems("tune.metric=reference_loss", "tune.mode=min", "tune.generate_at_rungs=true")
    assert "not such a score" in judged["tune.generate_at_rungs"]
    answers = ["tune.metric=contains", "tune.mode=max", "tune.generate_at_rungs=true"]
    assert "no rungs" in problems(*answers, "tune.scheduler=none")["tune.generate_at_rungs"]
    assert (
        "sets it to ASHA's first rung (2)"
        in problems(*answers, "train.generate_eval_every=3")["train.generate_eval_every"]
    )
    assert "could never stop a trial early" in problems(*answers, "tune.grace_steps=8")["tune.grace_steps"]
    with pytest.raises(ConfigError) as err:  # every problem at once
        space.check(load_config(TINY, ["tune.generate_at_rungs=true", "tune.scheduler=none",
                                       "train.generate_eval_every=3"]))  # fmt: skip
    said = [f"{key}: {why}" for key, why in err.value.problems]
    assert ["not such a score" in s for s in said] == [True, False, False]
    assert "no rungs" in said[1] and said[2].startswith("train.generate_eval_every: is 3")
