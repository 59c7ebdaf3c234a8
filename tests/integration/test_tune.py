"""Ray Tune sweeps: real Ray Train trials on a tiny Llama, ASHA, MLflow parent and children, resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
from peft import PeftModel

from raylora.config import load_config
from raylora.models import tiny_model
from raylora.tune.sweep import sweep

ROOT = Path(__file__).resolve().parents[2]
# Two good learning rates first, then one that barely moves the loss: with two trials at a time, the slow one starts
# once a good one has finished, and ASHA stops it at its first rung against the good ones' results there (a lone
# trial costs about 35 s of CPU, so the sweep has no fourth).
GRID = "tune.space={train.lr: {grid: [0.03, 0.01, 1.0e-7]}, lora.rank: {choice: [4]}}"


def overrides(tmp, *more):
    return [
        f"train.output_dir={tmp}/sweep", f"data.output_dir={tmp}/data", "tracking.enabled=true",
        f"tracking.uri=sqlite:///{tmp}/mlflow.db", "tracking.experiment=sweeps", "tune.register_as=tiny-best", *more,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def swept(tmp_path_factory, ray_session):
    tmp = tmp_path_factory.mktemp("tune")
    cfg = load_config(
        ROOT / "configs/tiny_sweep_cpu.yaml", overrides(tmp, GRID, "tune.search=grid", "tune.num_samples=1")
    )
    return tmp, sweep(cfg, log=lambda s: None)


def test_asha_stops_a_slow_trial_and_the_best_adapter_is_copied_and_loads(swept):
    tmp, result = swept
    statuses = {r["train.lr"]: r["status"] for r in result["trials"]}
    # ASHA may also stop the weaker of the two good rates at a rung; the slow one never completes.
    assert len(statuses) == 3 and "completed" in statuses.values() and statuses[1e-7] == "stopped early"
    stopped = [r for r in result["trials"] if r["status"] == "stopped early"]
    assert all(r["steps"] < 8 for r in stopped)
    assert result["best"]["config"]["train.lr"] in (0.03, 0.01)
    adapter = PeftModel.from_pretrained(tiny_model("llama"), tmp / "sweep" / "best" / "adapter")
    assert any(p.abs().sum() > 0 for n, p in adapter.named_parameters() if "lora_B" in n)
    table = (tmp / "sweep" / "results.csv").read_text().splitlines()
    assert table[0] == "trial,train.lr,lora.rank,status,steps,metric" and len(table) == 4
    assert (tmp / "sweep" / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mlflow_has_one_parent_and_a_child_per_trial_and_the_best_is_registered(swept):
    tmp, result = swept
    client = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("sweeps").experiment_id])
    parent = client.get_run(result["parent_run_id"])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(runs) == 4 and len(children) == 3
    assert parent.info.status == "FINISHED" and parent.data.params["best.train.lr"] == str(
        result["best"]["config"]["train.lr"]
    )
    assert {"adapter", "results.csv", "sweep.png"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    by_status = {r.data.tags["raylora.trial_status"]: r.info.status for r in children}
    assert by_status["completed"] == "FINISHED" and by_status["stopped early"] == "KILLED"
    for child in children:
        assert child.data.params["lora.rank"] == "4" and "eval_loss" in child.data.metrics
        assert [m.step for m in client.get_metric_history(child.info.run_id, "eval_loss")][0] == 2
    version = client.get_model_version("tiny-best", str(result["registered"][1]))
    assert version.tags["raylora.kind"] == "lora-adapter" and version.run_id == parent.info.run_id


def test_a_sweep_stopped_by_a_signal_says_so_and_resumes_without_rerunning_finished_trials(tmp_path, session_address):
    """Found by use: a stopped sweep (SIGINT) marked its running trials 'stopped early' (ASHA's label) and closed
    their MLflow runs; with SIGTERM, as schedulers stop jobs, it left every run RUNNING and wrote no results.

    Stopped while the second trial trains, the sweep says how to resume, labels no trial and marks its parent run
    KILLED; ``--resume`` does not rerun the finished first trial and completes the second. (A sweep killed outright
    resumes too: test_tune_shared.py.)"""
    env = {**os.environ, "RAY_ADDRESS": session_address}
    cmd = [sys.executable, "-m", "raylora.cli", "tune", str(ROOT / "configs/tiny_sweep_cpu.yaml"),
           *overrides(tmp_path, "tune.space={train.lr: {grid: [0.03, 0.01]}}", "tune.search=grid", "tune.num_samples=1",
                      "tune.max_concurrent=1", "tune.scheduler=none", "train.max_steps=8", "train.eval_every=0")]  # fmt: skip
    with open(tmp_path / "driver.err", "w") as err:
        driver = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=err)
    trials = tmp_path / "sweep" / "trials"
    deadline = time.time() + 300
    try:
        while time.time() < deadline and len(list(trials.glob("*/workers/rank0.json"))) < 2:
            time.sleep(0.2)  # the second trial starts once the first has finished
        driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=180)
        first = min(trials.iterdir(), key=lambda p: p.stat().st_mtime)
        finished_pid = json.loads((first / "workers" / "rank0.json").read_text())["pid"]
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    said = (tmp_path / "driver.err").read_text()
    assert driver.returncode == 1 and "stopped by a signal" in said and "--resume" in said, said[-3000:]
    assert not (tmp_path / "sweep" / "results.csv").exists()  # no trial labelled before the sweep ends
    parent = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["parent_run_id"]
    assert mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(parent).info.status == "KILLED"

    resumed = subprocess.run([*cmd, "--resume"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((first / "workers" / "rank0.json").read_text())["pid"] == finished_pid  # not rerun
    rows = (tmp_path / "sweep" / "results.csv").read_text().splitlines()[1:]
    assert len(rows) == 2 and all(",completed,8," in row for row in rows), rows
    assert (tmp_path / "sweep" / "best" / "adapter" / "adapter_model.safetensors").is_file()


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
