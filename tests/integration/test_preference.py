"""Preference training end to end on the tiny model and the bundled identity pairs: DPO on two gloo workers through
Ray Train, resumed on one worker; KTO on the same answers labelled one by one, on two workers; a Tune sweep over
preference.beta choosing on held-out reward accuracy; a preference file under the sft objective refused before Ray
starts."""

import csv
import json
from pathlib import Path

import mlflow
import pytest
from peft import PeftModel

from raylora.config import load_config
from raylora.data.sources import DataError
from raylora.models import tiny_model
from raylora.train.fit import fit
from raylora.train.preference import STATS
from raylora.tune.sweep import sweep

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny_dpo_cpu.yaml"

pytestmark = pytest.mark.usefixtures("ray_session")


def job(tmp_path, *overrides):
    return load_config(
        CONFIG,
        [f"train.output_dir={tmp_path}/run", f"data.output_dir={tmp_path}/data", "tracking.enabled=true",
         f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tracking.experiment=dpo", *overrides],
    )  # fmt: skip


def test_dpo_on_two_workers_prefers_the_chosen_answers_and_resumes_on_one_worker(tmp_path):
    """Also the suite's test of a run resumed on fewer workers than wrote its checkpoint, for every objective:
    neither the checkpoint nor the resume depends on the objective (test_train.py resumes a supervised run on the
    same workers after a kill)."""
    first = fit(job(tmp_path, "train.num_workers=2", "train.eval_every=10", "train.log_every=5"), log=lambda s: None)
    assert first["steps"] == 20
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    evaluations = [h for h in history if "eval_loss" in h]
    assert [h["step"] for h in evaluations] == [10, 20]
    # the loss starts at log 2 (adapter B = 0: policy = reference) and the held-out pairs come to prefer the chosen
    assert history[0]["loss"] < 0.6931 and evaluations[-1]["eval_loss"] < evaluations[0]["eval_loss"]
    assert evaluations[-1]["eval_rewards/accuracies"] >= 0.9 and evaluations[-1]["eval_rewards/margins"] > 0
    assert all(set(STATS) <= set(h) for h in history)

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.get_run(json.loads((tmp_path / "run" / "mlflow_run.json").read_text())["run_id"])
    assert {*STATS, "eval_rewards/accuracies", "eval_loss"} <= set(run.data.metrics)
    assert run.data.params["train.objective"] == "dpo" and run.data.params["preference.beta"] == "0.1"
    adapter = PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "run" / "adapter")
    assert adapter.peft_config["default"].r == 8

    resumed = fit(job(tmp_path, "train.num_workers=1", "train.max_steps=24", "train.log_every=4"), log=lambda s: None)
    assert resumed["steps"] == 24 and resumed["resumed_from"] == 20
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    assert history[-1]["step"] == 24 and set(STATS) <= set(history[-1])


def test_kto_on_two_workers_rewards_the_desirable_answers(tmp_path):
    """Resuming on one worker is DPO's test above, not repeated here (a Ray Train run is 30-40 s of CPU)."""
    kto = ROOT / "configs" / "tiny_kto_cpu.yaml"
    overrides = [f"train.output_dir={tmp_path}/run", f"data.output_dir={tmp_path}/data", "tracking.enabled=true",
                 f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tracking.experiment=kto"]  # fmt: skip
    first = fit(load_config(kto, [*overrides, "train.num_workers=2", "train.eval_every=10", "train.log_every=1"]),
                log=lambda s: None)  # fmt: skip
    assert first["steps"] == 20
    summary = json.loads((tmp_path / "data" / "summary.json").read_text())
    assert summary["answers"] == 456 and summary["rows_rejected"] == 0
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    evaluations = [h for h in history if "eval_loss" in h]
    assert [h["step"] for h in evaluations] == [10, 20]
    # the loss starts at 0.5 (adapter B = 0: policy = reference, 1 - sigmoid(0)); the held-out desirable answers come
    # to be rewarded above the undesirable ones
    assert (
        history[0]["step"] == 1
        and history[0]["loss"] == pytest.approx(0.5, abs=0.01)
        and evaluations[-1]["eval_loss"] < 0.5
    )
    assert evaluations[-1]["eval_rewards/margins"] > 0 and evaluations[-1]["eval_rewards/chosen"] > 0
    assert all({"rewards/chosen", "rewards/rejected", "kl", "logps/chosen"} <= set(h) for h in history)
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.get_run(json.loads((tmp_path / "run" / "mlflow_run.json").read_text())["run_id"])
    assert {"kl", "rewards/margins", "eval_rewards/margins", "eval_kl"} <= set(run.data.metrics)
    assert run.data.params["train.objective"] == "kto" and run.data.params["preference.desirable_weight"] == "1.0"
    assert PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "run" / "adapter").peft_config["default"].r == 8


def test_a_sweep_over_beta_chooses_on_held_out_reward_accuracy(tmp_path):
    cfg = job(
        tmp_path, "tune.space={preference.beta: {grid: [0.1, 0.5]}}", "tune.search=grid", "tune.num_samples=1",
        "tune.scheduler=none", "tune.metric=eval_rewards/accuracies", "tune.mode=max", "train.max_steps=6",
        "train.eval_every=3", "train.num_workers=1", "train.cpus_per_worker=1", "tune.register_as=tiny-dpo",
    )  # fmt: skip
    result = sweep(cfg, log=lambda s: None)
    rows = list(csv.DictReader((tmp_path / "run" / "results.csv").open()))
    assert sorted(float(r["preference.beta"]) for r in rows) == [0.1, 0.5]
    assert all(r["status"] == "completed" and r["steps"] == "6" for r in rows)
    best = max(float(r["metric"]) for r in rows)
    assert result["best"]["metric"] == best
    assert (tmp_path / "run" / "best" / "adapter" / "adapter_model.safetensors").is_file()
    assert result["registered"][0] == "tiny-dpo"


def test_a_preference_file_under_sft_is_refused_before_ray_starts(tmp_path):
    with pytest.raises(DataError, match=r"set train\.objective: dpo .*columns: \{output: chosen\} still trains SFT"):
        fit(job(tmp_path, "train.objective=sft"), log=lambda s: None)
