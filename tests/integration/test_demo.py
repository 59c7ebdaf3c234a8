"""`raylora demo` end to end on the tiny model: prepare, a `ray job submit` training job, a sweep that registers its
best adapter, `raylora eval` of the base and every trial, a W8A8 base served with the best adapter, the before/after
report; and a failing stage.

The demo's jobs are also the suite's `ray job submit` jobs on a `ray start`ed head with token auth: their relative
outputs go to their RAYLORA_BASE_DIR, the training job prints one progress line per logged step, and what they
wrote outlives Ray's temporary folder (a job with a relative output and no RAYLORA_BASE_DIR is refused)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlflow
from processes import alive, cluster_processes, names, running

from raylora.cluster import stop_cluster
from raylora.ports import free_port

BIN = Path(sys.executable).parent
STAGES = ("prepare", "train", "sweep", "eval", "serve", "report")


def home(tmp_path: Path) -> dict[str, str]:
    """The environment of a user who never ran Ray: an empty home, no ``~/.ray/auth_token`` (found by use: ``ray
    start`` under token auth makes none, and the demo started it before anything else had made one)."""
    (tmp_path / "home").mkdir(exist_ok=True)
    return {**os.environ, "HOME": str(tmp_path / "home")}


def demo(root: Path, tmp_path: Path, *overrides: str, keep: bool = False) -> subprocess.CompletedProcess:
    env = {**home(tmp_path), **({"KEEP_SERVING": "1"} if keep else {})}
    return subprocess.run(
        [str(BIN / "raylora"), "demo", "configs/tiny_demo_cpu.yaml", f"train.output_dir={tmp_path}/demo",
         f"data.output_dir={tmp_path}/data", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", *overrides],
        cwd=root, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_demo_goes_from_raw_data_to_a_served_adapter_with_its_report(root, tmp_path):
    port = free_port()
    proc = demo(root, tmp_path, f"serve.port={port}", keep=True)
    out = tmp_path / "demo"
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else None
    try:
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        for k, stage in enumerate(STAGES, 1):
            assert f"[{k}/6] {stage} done in" in proc.stdout
            assert (out / "logs" / f"{stage}.log").is_file()
        train_log = (out / "logs" / "train.log").read_text()  # the log of `ray job submit`
        assert "Job 'raysubmit_" in train_log and "train.output_dir=train\n" in train_log
        # what the user sees: one progress line per logged step (every 2nd), with its ETA, no Ray Train report lines
        progress = [line for line in train_log.splitlines() if re.search(r"step \d+/4 ", line)]
        assert [re.search(r"step (\d+)/4 .* ETA \d+s", line).group(1) for line in progress] == ["2", "4"], progress
        assert "Reporting training result" not in train_log

        # the table and what it was made of: the eval of the base and both trials on the held-out questions
        text = (out / "report.md").read_text()
        assert "| exact match (every held-out question) |" in text and "| loss of the reference answers |" in text
        scores = report["eval"]["candidates"]
        best = f"trial-{report['best']['trial']}"
        assert len(scores) == 1 + report["best"]["statuses"].count("completed") and {"base", best} <= set(scores)
        assert scores[best]["metrics"]["reference_loss"] < scores["base"]["metrics"]["reference_loss"]
        questions = report["questions"]
        assert questions and all(q["reference"] and "before" in q and "after" in q for q in questions)
        assert len(report["served"]["answers"]) == len(questions) and report["served"]["tokens_per_s"] > 0
        assert report["served"]["same_as_eval"] == len(questions)  # the served adapter answers as the eval's did
        assert set(report["stages"]) == {*STAGES, "total"}
        assert (out / "eval" / "metrics.png").is_file() and (out / "eval" / "answers.jsonl").is_file()

        # the files of every stage
        assert (out / "train" / "adapter" / "adapter_config.json").is_file()
        assert len((out / "sweep" / "results.csv").read_text().splitlines()) == 3
        assert (out / "sweep" / "best" / "adapter" / "adapter_config.json").is_file()
        assert json.loads((out / "export" / "raylora_int8.json").read_text())["quantization"] == "w8a8-smoothquant"
        assert (out / "adapters" / "tiny-demo" / "adapter_config.json").is_file()

        # MLflow: the training run, the sweep's parent and two children, the eval's parent and a child per candidate
        # (the base and each completed trial: ASHA may stop one on a busy machine), each trial's linked to the trial's
        # run, the best adapter registered
        client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
        runs = client.search_runs([client.get_experiment_by_name("tiny-demo").experiment_id])
        assert len(runs) == 1 + 3 + 1 + len(scores) and all(r.info.status in ("FINISHED", "KILLED") for r in runs)
        completed = {r.info.run_id for r in runs if r.data.tags.get("raylora.trial_status") == "completed"}
        linked = {r.data.tags.get("raylora.trained_by_run") for r in runs if r.info.run_name.startswith("trial-")}
        assert len([r for r in runs if r.data.tags.get("raylora.trial")]) == 2 and linked == completed
        (version,) = client.search_model_versions("name='tiny-demo'")
        assert version.tags["raylora.kind"] == "lora-adapter"

        # the endpoint the demo left serving (KEEP_SERVING=1) answers with the adapter
        url = f"http://127.0.0.1:{port}/v1"
        models = json.loads(urllib.request.urlopen(f"{url}/models", timeout=60).read())
        assert {"export", "tiny-demo"} <= {m["id"] for m in models["data"]}
        reply = post(f"{url}/chat/completions", {"model": "tiny-demo", "max_tokens": 8,
                                                 "messages": [{"role": "user", "content": "Who are you?"}]})  # fmt: skip
        assert reply["model"] == "tiny-demo" and reply["usage"]["completion_tokens"] > 0
        assert isinstance(reply["choices"][0]["message"]["content"], str)

        # in Ray's copy of the working folder, a relative output needs RAYLORA_BASE_DIR: refused without it
        refused = subprocess.run(
            [str(BIN / "ray"), "job", "submit", "--address", report["urls"]["dashboard"], "--working-dir", str(root),
             "--", sys.executable, "jobs/train.py", "configs/tiny_lora_cpu.yaml", "tracking.enabled=true"],
            env={**home(tmp_path), "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert refused.returncode != 0
        assert "train.output_dir: 'outputs/tiny_lora_cpu' is relative" in refused.stdout + refused.stderr
        family = cluster_processes(report["cluster"]["temp_dir"])
        # `ray start`'s daemons carry the temp folder in their command lines, but the raylet's agents rename
        # themselves (ray::DashboardAgent, ray::RuntimeEnvAgent) and outlived the raylet: stopping takes them too
        assert sum("Agent" in name for name in names(family)) == 2, names(family)
    finally:
        if report is not None:
            stop_cluster(report["cluster"]["temp_dir"])
            shutil.rmtree(report["cluster"]["temp_dir"], ignore_errors=True)
    alive = [p for p in family if running(p)]
    assert not alive, names(alive)  # nothing the demo's cluster started (workers, replicas, agents) outlives it
    # the training job's outputs and MLflow artifacts outlive Ray's temporary folder (removed above)
    assert (out / "train" / "adapter" / "adapter_model.safetensors").is_file()
    (run,) = [r for r in runs if r.info.run_name == "train"]
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [2, 4]
    artifacts = tmp_path / "mlartifacts" / run.info.run_id / "artifacts"
    assert (artifacts / "adapter" / "adapter_model.safetensors").is_file() and (artifacts / "loss.png").is_file()
    assert {"adapter", "config.yaml", "loss.png", "history.json"} <= {
        a.path for a in client.list_artifacts(run.info.run_id)
    }


def test_a_failing_stage_stops_the_demo_naming_the_stage_and_its_log(root, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('not json\n{"instruction": "Who are you?", "output": "I am {{name}}."}\n')
    proc = demo(root, tmp_path, f"data.sources=[{{path: {bad}}}]", f"serve.port={free_port()}")
    assert proc.returncode == 1
    log = tmp_path / "demo" / "logs" / "prepare.log"
    assert "stage 'prepare' failed" in proc.stderr and str(log) in proc.stderr
    assert f"{bad}:1" in log.read_text()  # prepare's own message, naming the file and line
    assert not (tmp_path / "demo" / "logs" / "train.log").exists()
    # the cluster the demo started for its stages, up while prepare failed, is stopped: none of its processes is left
    temp_dir = re.search(r"--temp-dir=(\S+)", log.read_text()).group(1)
    assert not alive(temp_dir)


def test_a_signal_stops_the_demo_and_the_cluster_it_started(root, tmp_path):
    """SIGTERM, as a scheduler or `timeout` sends it, once the demo's cluster is up: the demo stops it, as Ctrl-C
    does (review finding: Python's default SIGTERM skipped the `finally` that stops the cluster)."""
    cmd = [str(BIN / "raylora"), "demo", "configs/tiny_demo_cpu.yaml", f"train.output_dir={tmp_path}/demo",
           f"data.output_dir={tmp_path}/data", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"serve.port={free_port()}"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=root, env=home(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    log, temp_dir = tmp_path / "demo" / "logs" / "prepare.log", None
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            text = log.read_text() if log.is_file() else ""
            if "Ray runtime started" in text:
                temp_dir = re.search(r"--temp-dir=(\S+)", text).group(1)
                break
            time.sleep(0.2)
        assert temp_dir and alive(temp_dir), "the demo's cluster never started"
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # where the demo was and which signals it ignored (SIGINT: cefbf85)
            where = subprocess.run(
                [str(BIN / "py-spy"), "dump", "--pid", str(proc.pid)], capture_output=True, text=True
            )
            masks = [
                line for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines() if line.startswith("Sig")
            ]
            raise AssertionError(
                f"the demo went on 120 s after SIGTERM; {masks}; its stack:\n{where.stdout}{where.stderr}"
            ) from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if temp_dir:
            stop_cluster(temp_dir)
    assert proc.returncode == 1 and "stopped by a signal; the cluster it started is stopped" in err, err[-3000:]
    assert not alive(temp_dir)
