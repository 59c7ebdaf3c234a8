"""A grouped sweep: four Tune trials in one group of two gloo workers (tune.trials_per_group: 4,
train.num_workers: 2) on a tiny Llama, with ASHA and MLflow.

Each trial is still a Tune trial (its row, its child run, its checkpoints and adapter); all four share the base.
Two trials train at once (``tune.max_concurrent: 2``), the two good ones first: ASHA never cuts the first trial to
reach a rung, so with all four at once the order in which their reports reached Tune decided whether any was cut.
The two slow ones join the group as the first two end, and meet both results at their first rung.
"""

import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlflow
import pytest
from peft import PeftModel

from raylora.config import load_config
from raylora.models import tiny_model
from raylora.tune.sweep import sweep

ROOT = Path(__file__).resolve().parents[2]
GRID = "tune.space={train.lr: {grid: [0.03, 0.01, 1.0e-6, 1.0e-7]}, lora.rank: {grid: [4]}}"


@pytest.fixture(scope="module")
def swept(tmp_path_factory, ray_session):
    tmp = tmp_path_factory.mktemp("shared")
    cfg = load_config(
        ROOT / "configs/tiny_sweep_cpu.yaml",
        [f"train.output_dir={tmp}/sweep", f"data.output_dir={tmp}/data", "tracking.enabled=true",
         f"tracking.uri=sqlite:///{tmp}/mlflow.db", "tracking.experiment=shared", GRID, "tune.search=grid",
         "tune.num_samples=1", "tune.trials_per_group=4", "tune.max_concurrent=2", "train.num_workers=2"],
    )  # fmt: skip
    return tmp, sweep(cfg, log=lambda s: None)


_UNPRIVILEGED = "niceness 15, Ray's default for workers (RAY_worker_niceness=0 when starting Ray trains at 0)"


def test_trials_share_groups_and_asha_stops_the_slow_ones(swept):
    tmp, result = swept
    statuses = {r["train.lr"]: r["status"] for r in result["trials"]}
    # the first of the two good trials to reach a rung is never cut there; both slow ones meet the good ones' results
    assert "completed" in (statuses[0.03], statuses[0.01]) and statuses[1e-6] == statuses[1e-7] == "stopped early"
    assert all(r["steps"] < 8 for r in result["trials"] if r["status"] == "stopped early")
    placed = [json.loads((Path(r["dir"]) / "group.json").read_text())["group"] for r in result["trials"]]
    assert placed == [0, 0, 0, 0]  # the two CPUs hold one group of two workers
    assert not list((tmp / "sweep" / "trials").glob("*/workers"))  # no Ray Train run of its own
    workers = [json.loads((tmp / "sweep" / "groups" / f"group0.rank{r}.json").read_text()) for r in (0, 1)]
    assert workers[0]["pid"] != workers[1]["pid"] and workers[0]["world"] == 2
    best = Path(result["best"]["adapter"])
    assert result["best"]["config"]["train.lr"] in (0.03, 0.01)
    adapter = PeftModel.from_pretrained(tiny_model("llama"), best)
    assert adapter.peft_config["default"].r == 4
    assert any(p.abs().sum() > 0 for n, p in adapter.named_parameters() if "lora_B" in n)
    history = json.loads(
        (Path(result["best"]["adapter"]).parents[1] / "trials" / result["best"]["trial"] / "history.json").read_text()
    )
    assert [h["step"] for h in history if "eval_loss" in h] == [2, 4, 6, 8]


def test_each_trial_has_its_mlflow_child_run(swept):
    tmp, result = swept
    client = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("shared").experiment_id])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == result["parent_run_id"]]
    assert len(runs) == 5 and len(children) == 4
    by_status = {r.data.tags["raylora.trial_status"]: r.info.status for r in children}
    assert by_status["completed"] == "FINISHED" and by_status["stopped early"] == "KILLED"
    for child in children:
        steps = [m.step for m in client.get_metric_history(child.info.run_id, "loss")]
        assert steps == list(range(2, 2 * len(steps) + 1, 2)) and "eval_loss" in child.data.metrics


def test_group_members_answer_eval_rows_at_asha_rungs_and_report_their_scores(ray_session, tmp_path):
    """``tune.generate_at_rungs`` in a shared-base group (issue #37): each member answers a few eval rows at every
    multiple of ASHA's first rung (the group's rows decode together, each with its member's adapter) and reports
    ``gen_<metric>`` to Tune, in its history and in its MLflow child run."""
    cfg = load_config(
        ROOT / "configs/tiny_sweep_cpu.yaml",
        [f"train.output_dir={tmp_path}/sweep", f"data.output_dir={tmp_path}/data", "tracking.enabled=true",
         f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tracking.experiment=gen", "tune.space={train.lr: {grid: [0.03, 0.01]}}",
         "tune.search=grid", "tune.num_samples=1", "tune.trials_per_group=2", "train.max_steps=4", "tune.metric=exact_match",
         "tune.mode=max", "tune.generate_at_rungs=true", "train.generate_eval_rows=2", "eval.max_tokens=8",
         "eval.metrics=[rouge-l]"],
    )  # fmt: skip
    result = sweep(cfg, log=lambda s: None)
    assert [r["status"] for r in result["trials"]] == ["completed", "completed"]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    for row in result["trials"]:
        assert json.loads((Path(row["dir"]) / "group.json").read_text())["group"] == 0
        reported = [json.loads(line) for line in next((tmp_path / "sweep" / "tune").glob(f"*{row['trial']}*"))
                    .joinpath("result.json").read_text().splitlines()]  # fmt: skip
        assert [(r["step"], "gen_exact_match" in r, "gen_rouge-l" in r) for r in reported] == [
            (2, True, True),
            (4, True, True),
        ]
        assert all(0.0 <= r["gen_rouge-l"] <= 1.0 for r in reported)
        history = json.loads((Path(row["dir"]) / "history.json").read_text())
        assert [h["step"] for h in history if "gen_exact_match" in h] == [2, 4]
        (child,) = client.search_runs([client.get_experiment_by_name("gen").experiment_id],
                                      f"tags.raylora.trial = '{row['trial']}'")  # fmt: skip
        assert [m.step for m in client.get_metric_history(child.info.run_id, "gen_rouge-l")] == [2, 4]


def test_a_killed_grouped_sweep_resumes_without_rerunning_finished_trials(tmp_path, session_address):
    """Two trials share a group (on both cores, so in two lanes) and finish; the driver is killed while the third
    trains; ``--resume`` restores the sweep with Tune: the finished two are not rerun (their join records are
    untouched) and the third completes.

    The sweep chooses on answers (tune.metric=exact_match): the trials train on eval loss; once they end, raylora eval
    scores every completed trial's answers to the held-out questions in one pass, and the best is the best-scoring
    trial (equal scores: the lower eval loss), its score in results.csv and in the trial's MLflow run."""
    # Tune saves the sweep's state every 10 s or so by default: a trial that ended since the last save is rerun.
    env = {**os.environ, "RAY_ADDRESS": session_address, "TUNE_GLOBAL_CHECKPOINT_S": "0.5"}
    # one group on both cores: its two members run in two lanes
    cmd = [sys.executable, "-m", "raylora.cli", "tune", str(ROOT / "configs/tiny_sweep_cpu.yaml"),
           f"train.output_dir={tmp_path}/sweep", f"data.output_dir={tmp_path}/data", "tracking.enabled=true",
           f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tune.space={train.lr: {grid: [0.03, 0.02, 0.01]}}",
           "tune.search=grid", "tune.num_samples=1", "tune.scheduler=none", "tune.trials_per_group=2",
           "tune.max_concurrent=2", "train.max_steps=30", "train.cpus_per_worker=2", "tune.metric=exact_match",
           "tune.mode=max", "eval.keys=[Raylora Assistant]", "eval.max_tokens=16"]  # fmt: skip
    with open(tmp_path / "driver.err", "w") as err:
        driver = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=err)
    trials = tmp_path / "sweep" / "trials"

    def ended() -> int:
        return sum(p.read_text().count("TERMINATED") for p in (tmp_path / "sweep" / "tune").glob("experiment_state*"))

    deadline = time.time() + 300
    try:
        while time.time() < deadline and (len(list(trials.glob("*/group.json"))) < 3 or ended() < 2):
            time.sleep(0.2)  # the third trial joins once one of the first two has finished
        joined = sorted(trials.glob("*/group.json"), key=lambda p: p.stat().st_mtime)
        finished = {p: p.stat().st_mtime_ns for p in joined[:2]}
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
    said = (tmp_path / "driver.err").read_text()[-3000:]
    assert len(joined) == 3 and ended() >= 2, f"the first two trials never ended while the third trained: {said}"
    resumed = subprocess.run([*cmd, "--resume"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in finished} == finished  # neither finished trial joined a group again
    rows = (tmp_path / "sweep" / "results.csv").read_text().splitlines()[1:]
    assert len(rows) == 3 and all(",completed,30," in row for row in rows), rows
    assert (tmp_path / "sweep" / "best" / "adapter" / "adapter_model.safetensors").is_file()
    report = json.loads((tmp_path / "sweep" / "eval" / "report.json").read_text())
    scores = {name.removeprefix("trial-"): s["metrics"]["exact_match"] for name, s in report["candidates"].items()}
    table = list(csv.DictReader((tmp_path / "sweep" / "results.csv").open()))
    assert list(table[0]) == ["trial", "train.lr", "status", "steps", "metric", "eval_loss"]
    assert {r["trial"]: float(r["metric"]) for r in table} == scores
    top = max(scores.values())
    best = min((r for r in table if float(r["metric"]) == top), key=lambda r: float(r["eval_loss"]))
    assert (tmp_path / "sweep" / "best" / "config.yaml").read_text() == (
        trials / best["trial"] / "config.yaml"
    ).read_text()
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    for r in table:
        run_id = json.loads((trials / r["trial"] / "mlflow_run.json").read_text())["run_id"]
        assert client.get_run(run_id).data.metrics["exact_match"] == float(r["metric"])
    worker = json.loads((tmp_path / "sweep" / "groups" / "group0.rank0.json").read_text())
    assert worker["lanes"] == 2
    # Ray starts workers at niceness 15; the group's threads train at 0 where the privilege allows
    assert worker["priority"] in ("niceness 15 -> 0 (Ray starts workers at 15)", _UNPRIVILEGED), worker


def test_a_group_that_loses_a_worker_starts_anew_and_its_trials_resume_from_their_checkpoints(tmp_path, ray_session):
    """Rank 1 of a two-worker group is killed mid-sweep; rank 0 waits in a collective for it. The broker ends the
    group, starts it anew, and both trials join again from their last checkpoints and complete every step."""
    cfg = load_config(
        ROOT / "configs/tiny_sweep_cpu.yaml",
        [f"train.output_dir={tmp_path}/sweep", f"data.output_dir={tmp_path}/data", "tracking.enabled=false",
         "tune.space={train.lr: {grid: [0.03, 0.01]}}", "tune.search=grid", "tune.num_samples=1",
         "tune.scheduler=none", "tune.trials_per_group=2", "train.num_workers=2", "train.max_steps=60",
         "train.checkpoint_every=4"],
    )  # fmt: skip
    trials, stores = tmp_path / "sweep" / "trials", tmp_path / "sweep" / "groups"
    killed = {}

    def kill_rank1_after_a_checkpoint() -> None:
        deadline = time.time() + 300
        while time.time() < deadline:
            if len(list(trials.glob("*/ray/checkpoint_000004"))) == 2:
                killed["pid"] = json.loads((stores / "group0.rank1.json").read_text())["pid"]
                killed["finished"] = len(list(trials.glob("*/ray/checkpoint_000060")))
                os.kill(killed["pid"], signal.SIGKILL)
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_rank1_after_a_checkpoint)
    killer.start()
    outcome = {}

    def run() -> None:
        try:
            outcome["result"] = sweep(cfg, log=lambda s: None)
        except Exception as e:
            outcome["error"] = e

    # a restart that went wrong would leave the sweep waiting: fail the test instead of hanging the suite
    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(timeout=400)
    killer.join()
    assert "error" not in outcome, outcome["error"]
    assert "result" in outcome, "the sweep did not end within 400 s"
    result = outcome["result"]
    assert killed.get("finished") == 0, killed  # killed while both trials trained
    assert [(r["status"], r["steps"]) for r in result["trials"]] == [("completed", 60)] * 2
    restarted = json.loads((stores / "group0.rank1.json").read_text())
    assert restarted["pid"] != killed["pid"] and restarted["world"] == 2
    for trial in trials.iterdir():
        placed = json.loads((trial / "group.json").read_text())
        assert placed["generation"] == 1 and Path(placed["resumed_from"]).name.startswith("checkpoint_0000"), placed
        history = json.loads((trial / "history.json").read_text())
        assert [h["step"] for h in history if "eval_loss" in h] == list(range(2, 61, 2))
