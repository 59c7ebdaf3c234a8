"""Ray Tune sweeps: real Ray Train trials on a tiny Llama, ASHA, MLflow parent and children, a sweep stopped by a
signal and resumed."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
import ray
import yaml
from peft import PeftModel

from raylora.config import load_config
from raylora.models import tiny_model
from raylora.tune.sweep import sweep

ROOT = Path(__file__).resolve().parents[2]
# The weaker good rate first, then the better one, then one that barely moves the loss, one trial at a time. The
# sweep is stopped by a signal while the second trains and resumed; Tune does not keep ASHA's rung results across a
# resume, so the first (never compared) completes, the resumed second meets no result at its rungs and completes, and
# the slow one meets the second's there (eval loss 5.68 against 5.04 at step 2) and is stopped. A lone trial costs
# about 35 s of CPU, so the sweep has no fourth, and the signal and the resume are this sweep's, not one of their own.
GRID = "tune.space={train.lr: {grid: [0.01, 0.03, 1.0e-7]}, lora.rank: {choice: [4]}}"


def overrides(tmp, *more):
    return [
        f"train.output_dir={tmp}/sweep", f"data.output_dir={tmp}/data", "tracking.enabled=true",
        f"tracking.uri=sqlite:///{tmp}/mlflow.db", "tracking.experiment=sweeps", "tune.register_as=tiny-best", *more,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def swept(tmp_path_factory, ray_session):
    """``raylora tune`` stopped by SIGTERM (as schedulers stop jobs) while the second trial trains, then ``--resume``d.

    Found by use: a stopped sweep (SIGINT) marked its running trials 'stopped early' (ASHA's label) and closed
    their MLflow runs; with SIGTERM it left every run RUNNING and wrote no results. (A sweep killed outright resumes
    too: test_tune_shared.py.)"""
    tmp = tmp_path_factory.mktemp("tune")
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    cmd = [sys.executable, "-m", "raylora.cli", "tune", str(ROOT / "configs/tiny_sweep_cpu.yaml"),
           *overrides(tmp, GRID, "tune.search=grid", "tune.num_samples=1", "tune.max_concurrent=1")]  # fmt: skip
    with open(tmp / "driver.err", "w") as err:
        driver = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=err)
    trials = tmp / "sweep" / "trials"
    deadline = time.time() + 300
    try:
        while time.time() < deadline and len(list(trials.glob("*/workers/rank0.json"))) < 2:
            time.sleep(0.2)  # the second trial starts once the first has finished
        driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=180)
        first = min(trials.iterdir(), key=lambda p: p.stat().st_mtime)
        stopped = {
            "returncode": driver.returncode,
            "said": (tmp / "driver.err").read_text(),
            "results": (tmp / "sweep" / "results.csv").exists(),
            "parent": json.loads((tmp / "sweep" / "sweep.json").read_text())["parent_run_id"],
            "first": first,
            "finished_pid": json.loads((first / "workers" / "rank0.json").read_text())["pid"],
        }
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    stopped["parent_status"] = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db").get_run(stopped["parent"]).info.status
    resumed = subprocess.run([*cmd, "--resume"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = list(csv.DictReader((tmp / "sweep" / "results.csv").open()))
    return tmp, stopped, rows


def test_a_sweep_stopped_by_a_signal_says_so_and_resumes_without_rerunning_finished_trials(swept):
    """Stopped while the second trial trains, the sweep says how to resume, labels no trial and marks its parent run
    KILLED; ``--resume`` does not rerun the finished first trial and runs the others to their end."""
    tmp, stopped, rows = swept
    said = stopped["said"]
    assert stopped["returncode"] == 1 and "stopped by a signal" in said and "--resume" in said, said[-3000:]
    assert not stopped["results"]  # no trial labelled before the sweep ends
    assert stopped["parent_status"] == "KILLED"
    first = stopped["first"]
    assert json.loads((first / "workers" / "rank0.json").read_text())["pid"] == stopped["finished_pid"]  # not rerun
    assert [(r["trial"], r["status"], r["steps"]) for r in rows][:2] == [
        (first.name, "completed", "8"),
        (rows[1]["trial"], "completed", "8"),
    ]
    assert (tmp / "sweep" / "best" / "adapter" / "adapter_model.safetensors").is_file()


def test_asha_stops_a_slow_trial_and_the_best_adapter_is_copied_and_loads(swept):
    tmp, _, rows = swept
    statuses = {float(r["train.lr"]): r["status"] for r in rows}
    assert len(statuses) == 3 and "completed" in statuses.values() and statuses[1e-7] == "stopped early"
    assert all(int(r["steps"]) < 8 for r in rows if r["status"] == "stopped early")
    best = yaml.safe_load((tmp / "sweep" / "best" / "config.yaml").read_text())
    assert best["train"]["lr"] in (0.03, 0.01)
    adapter = PeftModel.from_pretrained(tiny_model("llama"), tmp / "sweep" / "best" / "adapter")
    assert any(p.abs().sum() > 0 for n, p in adapter.named_parameters() if "lora_B" in n)
    table = (tmp / "sweep" / "results.csv").read_text().splitlines()
    assert table[0] == "trial,train.lr,lora.rank,status,steps,metric" and len(table) == 4
    assert (tmp / "sweep" / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mlflow_has_one_parent_and_a_child_per_trial_and_the_best_is_registered(swept):
    tmp, stopped, rows = swept
    client = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("sweeps").experiment_id])
    parent = client.get_run(stopped["parent"])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(runs) == 1 + len(children)
    # a trial the signal stopped before its first checkpoint trains again from step 0 under a new child run that
    # names the one it replaces, closed KILLED
    labelled = [r for r in children if "raylora.trial_status" in r.data.tags]
    replaced = {r.data.tags["raylora.replaces_run"] for r in labelled if "raylora.replaces_run" in r.data.tags}
    assert sorted(r.data.tags["raylora.trial"] for r in labelled) == sorted(r["trial"] for r in rows)
    assert {r.info.run_id for r in children} - {r.info.run_id for r in labelled} == replaced
    assert all(client.get_run(run_id).info.status == "KILLED" for run_id in replaced)
    best = yaml.safe_load((tmp / "sweep" / "best" / "config.yaml").read_text())
    assert parent.info.status == "FINISHED" and parent.data.params["best.train.lr"] == str(best["train"]["lr"])
    assert {"adapter", "results.csv", "sweep.png"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    by_status = {r.data.tags["raylora.trial_status"]: r.info.status for r in labelled}
    assert by_status["completed"] == "FINISHED" and by_status["stopped early"] == "KILLED"
    for child in labelled:
        assert child.data.params["lora.rank"] == "4" and "eval_loss" in child.data.metrics
        assert [m.step for m in client.get_metric_history(child.info.run_id, "eval_loss")][0] == 2
    (version,) = client.search_model_versions("name='tiny-best'")
    assert version.tags["raylora.kind"] == "lora-adapter" and version.run_id == parent.info.run_id


def test_a_diverging_trial_fails_and_asha_compares_the_other_on_answers_generated_at_its_rungs(ray_session, tmp_path):
    """The NaN guard's divergence is an errored trial in Tune and a FAILED child run; with ``tune.generate_at_rungs``
    (issue #37) the trial that trains answers a few eval rows at every multiple of ASHA's first rung and reports
    ``gen_<metric>`` to Tune (ASHA's metric); the best is still chosen on the whole eval set.

    Under fp16 with alpha 4096 on peft's own path (the fused LoRA and chunked loss keep these gradients finite),
    the grad scaler overflows for the first steps: a trial that tolerates one non-finite step diverges, one that
    tolerates 30 lets the scaler back off and trains. What ASHA does with the reports is Ray's.
    """
    cfg = load_config(
        ROOT / "configs/tiny_sweep_cpu.yaml",
        overrides(tmp_path, "tune.space={train.nan_tolerance: {grid: [1, 30]}}", "tune.search=grid",
                  "tune.num_samples=1", "lora.alpha=4096", "train.lr=1.0e-5", "backend.precision=fp16",
                  "train.max_steps=4", "train.fused_lora=false", "train.chunked_loss=false", "tune.metric=exact_match",
                  "tune.mode=max", "tune.generate_at_rungs=true", "train.generate_eval_rows=2", "eval.max_tokens=8",
                  "eval.metrics=[rouge-l]"),
    )  # fmt: skip
    result = sweep(cfg, log=lambda s: None)
    statuses = {r["train.nan_tolerance"]: r["status"] for r in result["trials"]}
    assert statuses == {1: "failed", 30: "completed"} and result["best"]["config"]["train.nan_tolerance"] == 30
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("sweeps").experiment_id
    runs = client.search_runs([experiment], "tags.raylora.trial_status = 'failed'")
    assert len(runs) == 1 and runs[0].info.status == "FAILED"
    # found by use: the reason was in the console only, though the sweep's message sends users to the child run
    assert "training diverged" in runs[0].data.tags["raylora.trial_error"]
    assert [a.path for a in client.list_artifacts(runs[0].info.run_id)] == ["error.txt"]
    failed = next(Path(r["dir"]) for r in result["trials"] if r["status"] == "failed")
    assert "nan_tolerance=1" in (failed / "error.txt").read_text()

    row = next(r for r in result["trials"] if r["status"] == "completed")
    assert result["best"]["trial"] == row["trial"]
    # what Tune (and ASHA) saw: the generated scores at the rungs, steps 2 and 4 (the last)
    reported = [json.loads(line) for line in next((tmp_path / "sweep" / "tune").glob(f"*{row['trial']}*"))
                .joinpath("result.json").read_text().splitlines()]  # fmt: skip
    assert [(r["step"], "gen_exact_match" in r, "gen_rouge-l" in r) for r in reported] == [
        (2, True, True),
        (4, True, True),
    ]
    assert all(0.0 <= r["gen_exact_match"] <= 1.0 for r in reported)
    history = json.loads((Path(row["dir"]) / "history.json").read_text())
    assert [h["step"] for h in history if "gen_exact_match" in h] == [2, 4]
    (child,) = client.search_runs([experiment], "tags.raylora.trial_status = 'completed'")
    assert child.data.tags["mlflow.parentRunId"] == result["parent_run_id"]
    assert [m.step for m in client.get_metric_history(child.info.run_id, "gen_exact_match")] == [2, 4]
