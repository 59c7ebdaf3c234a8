"""Ray Train with two gloo workers on a local Ray (tiny Llama, the bundled identity data)."""

import asyncio
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlflow
import pytest
import ray
import torch
from peft import PeftModel

from raylora.config import ModelArgs, load_config, to_dict
from raylora.generation import GenRequest, answer_text, wait_for
from raylora.model_files import HUB_IDS, SMOLLM2, model_folder
from raylora.models import load_model, tiny_model
from raylora.serve.replica import LLMServer
from raylora.train.checkpoint import CheckpointError
from raylora.train.fit import TrainingError, fit

pytestmark = pytest.mark.usefixtures("ray_session")


def job(tmp_path, *overrides):
    return load_config(
        "configs/tiny_lora_cpu.yaml",
        [
            f"train.output_dir={tmp_path}/run", f"data.output_dir={tmp_path}/data", "data.eval_fraction=0.2",
            "tracking.enabled=true", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tracking.experiment=tests",
            "train.num_workers=2", "train.batch_size=2", "train.log_every=2", "train.lr=3e-2", *overrides,
        ],
    )  # fmt: skip


def checkpoints(out: Path) -> list[Path]:
    return [p for p in (out / "ray").glob("checkpoint_*") if p.is_dir()] if (out / "ray").exists() else []


def registered_checkpoints(out: Path) -> list:
    """Checkpoints Ray Train has registered (a checkpoint folder appears before its report is processed)."""
    try:
        return json.loads((out / "ray" / "checkpoint_manager_snapshot.json").read_text())["checkpoint_results"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return []


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    cfg = job(
        tmp, "train.max_steps=12", "train.checkpoint_every=4", "train.keep_checkpoints=2", "train.grad_accum=2",
        "train.recompute_every=1", "train.profile=true", "train.generate_eval_every=6", "train.generate_eval_rows=4",
        "eval.max_tokens=16", "eval.metrics=[exact_match, rouge-l, length]",
    )  # fmt: skip
    return tmp, cfg, fit(cfg, log=lambda s: None)


def test_two_workers_learn_and_write_adapter_plot_and_config(trained):
    tmp, cfg, result = trained
    out = tmp / "run"
    assert result["steps"] == 12 and result["resumed_from"] == 0
    losses = [h["loss"] for h in result["history"]]
    assert losses[-1] < 0.92 * losses[0]
    assert result["eval_loss"] is not None and result["history"][-1]["eval_perplexity"] > 1
    adapter = PeftModel.from_pretrained(tiny_model("llama"), out / "adapter")
    assert any(p.abs().sum() > 0 for n, p in adapter.named_parameters() if "lora_B" in n)
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "max_steps: 12" in (out / "config.yaml").read_text()
    workers = sorted(json.loads(p.read_text())["rank"] for p in (out / "workers").glob("rank*.json"))
    assert workers == [0, 1]
    assert len(checkpoints(out)) == 2  # keep_checkpoints


def test_mlflow_run_has_params_metrics_and_artifacts(trained):
    tmp, cfg, result = trained
    client = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    run = client.get_run(result["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == "12" and run.data.params["lora.rank"] == "8"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    assert steps == [2, 4, 6, 8, 10, 12]
    assert {"tokens_per_s", "lr", "grad_norm", "eval_loss", "peak_memory_mb"} <= set(run.data.metrics)
    # rank 0 answered 4 held-out rows at steps 6 and 12 (the other worker waiting), scored as raylora eval scores
    for name in ("gen_exact_match", "gen_rouge-l", "gen_length"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, name)] == [6, 12], name
    history = json.loads((tmp / "run" / "history.json").read_text())
    assert [h["step"] for h in history if "gen_length" in h] == [6, 12]
    assert all(0 < h["gen_length"] <= 16 and 0 <= h["gen_rouge-l"] <= 100 for h in history if "gen_length" in h)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"adapter", "config.yaml", "loss.png", "history.json", "profile"} <= artifacts
    profile = {a.path for a in client.list_artifacts(run.info.run_id, "profile")}
    assert profile == {"profile/trace.json", "profile/top_operators.txt"}
    table = (tmp / "run" / "profile" / "top_operators.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    path = run.data.tags["train.path"]
    assert run.data.tags["backend.precision_by"].startswith("precision: ") and "fused LoRA: 8 layers" in path
    assert "recompute: every 1 decoder layer(s)" in path and "chunked loss: on" in path
    assert "adapter/adapter_model.safetensors" in {a.path for a in client.list_artifacts(run.info.run_id, "adapter")}


def test_checkpoint_of_another_lora_shape_is_refused(trained):
    tmp, cfg, _ = trained
    with pytest.raises(CheckpointError, match=r"written for lora.rank 8 \(this job: 4\)"):  # before any worker
        fit(job(tmp, "train.max_steps=20", "lora.rank=4"), log=lambda s: None)


def test_a_killed_worker_is_replaced_and_the_run_resumes_with_every_ranks_compression_state(tmp_path):
    """A top-k compression hook trains, logs its bytes and checkpoints every rank's state; rank 1 is killed once a
    checkpoint is registered; Ray Train replaces it and the run resumes from that checkpoint, every rank restoring its
    top-k error feedback (its hook state is in the checkpoint) and counting tokens on."""
    cfg = job(tmp_path, "train.max_steps=60", "train.checkpoint_every=5", "train.max_failures=1", "train.log_every=5",
              "train.comm_hook=topk", "train.topk_fraction=0.05")  # fmt: skip
    out = tmp_path / "run"
    box = {}
    thread = threading.Thread(target=lambda: box.update(result=fit(cfg, log=lambda s: None)))
    thread.start()
    deadline = time.time() + 240
    while not registered_checkpoints(out) and time.time() < deadline:
        time.sleep(0.2)
    victim = json.loads((out / "workers" / "rank1.json").read_text())["pid"]
    os.kill(victim, signal.SIGKILL)
    thread.join(timeout=300)
    result = box["result"]
    assert result["steps"] == 60
    assert result["resumed_from"] > 0
    assert json.loads((out / "workers" / "rank1.json").read_text())["pid"] != victim
    for saved in checkpoints(out):
        assert sorted(p.name for p in (saved / "comm").iterdir()) == ["rank0.pt", "rank1.pt"]
    tokens = [h["tokens"] for h in result["history"]]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens) and tokens[0] > 0  # counted on
    sent = [h["comm_bytes_per_step"] for h in result["history"]]
    lora_bytes = 4 * sum(p.numel() for n, p in _lora_model(cfg).named_parameters() if "lora_" in n)
    # 5% of the entries, as values and int32 indices: a tenth of the fp32 gradient, and never more
    assert all(0 < s <= 0.1 * lora_bytes + 64 for s in sent), (sent, lora_bytes)
    traced = [h for h in result["history"] if "comm_hidden_fraction" in h]
    assert traced and all(h["comm_collectives"] >= 1 and h["comm_ms"] > 0 for h in traced)
    client = mlflow.MlflowClient(cfg.tracking.uri)
    # every logged step in MLflow (those between the checkpoint and the kill twice: the resumed run logs them again)
    assert {m.step for m in client.get_metric_history(result["run_id"], "comm_bytes_per_step")} == set(range(5, 61, 5))
    # each worker group traced one step: the share of its all-reduce time that backward hid
    hidden = client.get_metric_history(result["run_id"], "comm_hidden_fraction")
    assert 1 <= len(hidden) <= 2 and all(0 <= h.value <= 1 for h in hidden)


def test_divergence_rolls_back_once_then_fails_with_the_causes(tmp_path):
    cfg = job(tmp_path, "train.max_steps=40", "train.lr=1.0", "lora.alpha=4096", "train.max_grad_norm=0", "backend.precision=fp16",
              "train.nan_tolerance=2", "train.num_workers=1")  # fmt: skip
    with pytest.raises(TrainingError) as err:
        fit(cfg, log=lambda s: None)
    assert "training diverged" in str(err.value) and "train.lr=1.0" in str(err.value)
    runs = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_runs(
        [mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_experiment_by_name("tests").experiment_id]
    )
    assert runs[0].info.status == "FAILED"
    assert not (tmp_path / "run" / "adapter").exists()


def test_dataset_too_small_for_one_batch_per_worker_is_refused_before_training(tmp_path):
    from raylora.data.pipeline import DataError

    with pytest.raises(
        DataError, match=r"fewer than one micro-batch per worker \(train.num_workers=2 x train.batch_size=64"
    ):
        fit(job(tmp_path, "train.batch_size=64"), log=lambda s: None)
    assert not (tmp_path / "run" / "ray").exists()


def test_cheap_checks_fail_before_any_data_work(tmp_path):
    import socket

    import ray

    from raylora.tracking import TrackingError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens once the socket is closed
    with pytest.raises(TrackingError, match=f"127.0.0.1:{closed} does not answer"):
        fit(job(tmp_path, f"tracking.uri=http://127.0.0.1:{closed}"), log=lambda s: None)
    cpus = ray.cluster_resources()["CPU"]
    with pytest.raises(TrainingError, match=rf"the workers ask for {cpus + 2:g} CPU .* the cluster has {cpus:g} CPU"):
        fit(job(tmp_path, f"train.cpus_per_worker={cpus / 2 + 1}"), log=lambda s: None)
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


def test_training_data_hands_over_the_shards_the_pack_count_and_the_summary(tmp_path):
    from raylora.data.packs import read_packs
    from raylora.data.pipeline import training_data

    train, held_out, packs, finish = training_data(job(tmp_path), log=lambda s: None)
    summary = finish()
    assert packs == train.rows == read_packs(train).num_rows == summary["splits"]["train"]["packs"] > 0
    assert held_out.rows == read_packs(held_out).num_rows == summary["splits"]["eval"]["packs"] > 0
    assert summary["rows_read"] == 24 and sorted(read_packs(train).column_names) == sorted(
        ["input_ids", "labels", "position_ids", "seq_lens", "num_tokens"]
    )


def test_workers_holding_every_cpu_read_their_shards_and_are_not_held_to_ray_trains_report_interval(tmp_path):
    """Workers that hold every CPU of the cluster still read their shards (the data pipeline keeps none). Found by use:
    every logged step reported to Ray Train, whose controller takes one report every 2 s (0.5 s under these tests:
    conftest.py), so each step of a tiny model took that long."""
    cpus = ray.cluster_resources()["CPU"]
    result = fit(job(tmp_path, f"train.cpus_per_worker={cpus / 2}", "train.max_steps=12", "train.log_every=1"),
                 log=lambda s: None)  # fmt: skip
    assert result["steps"] == 12 and result["eval_loss"] is not None
    clock = [h["tokens"] / h["tokens_per_s"] for h in result["history"]]
    # held to the controller, the 11 steps after the first would take at least 11 of its intervals; free, a tiny
    # model's steps took 1-3.5 s in all (3.5 with the other test process busy on both cores)
    interval = float(os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"])
    assert len(clock) == 12 and clock[-1] - clock[0] < 11 * interval, clock


def test_streaming_workers_that_leave_no_cpu_for_the_pipeline_are_refused(tmp_path):
    from raylora.data.pipeline import DataError

    with pytest.raises(DataError, match="leaving less than 1 for Ray Data"):
        fit(job(tmp_path, "data.streaming=true", "train.cpus_per_worker=1"), log=lambda s: None)


def test_streaming_trains_from_the_raw_files_and_writes_no_shards(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "Say hi", "output": "Hi!"}\n{"instruction": "no answer"}\n')
    sources = "data.sources=[{path: data/raylora_identity.jsonl}, {path: " + str(bad) + "}]"
    cfg = job(tmp_path, "data.streaming=true", sources, "data.max_reject_fraction=0.1", "train.max_steps=6")
    result = fit(cfg, log=lambda s: None)
    assert result["steps"] == 6 and result["eval_loss"] is not None
    assert not (tmp_path / "data").exists()
    side = tmp_path / "run" / "data"
    summary = json.loads((side / "summary.json").read_text())
    assert (summary["rows_read"], summary["rows_rejected"]) == (26, 1)
    (reject,) = [json.loads(line) for line in (side / "rejects.jsonl").read_text().splitlines()]
    assert (reject["source"], reject["line"]) == (str(bad), 2) and "output" in reject["reason"]
    run = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(result["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["data.streaming"] == "True"


def test_streaming_fails_the_run_when_too_many_rows_are_rejected(tmp_path):
    from raylora.data.pipeline import DataError

    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join('{"instruction": "no answer"}\n' for _ in range(5)))
    sources = "data.sources=[{path: data/raylora_identity.jsonl}, {path: " + str(bad) + "}]"
    with pytest.raises(DataError, match=r"5 of 29 rows were rejected"):
        fit(
            job(tmp_path, "data.streaming=true", sources, "train.max_steps=2", "train.num_workers=1"),
            log=lambda s: None,
        )
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.status == "FAILED"


def _lora_model(cfg):
    from raylora.models import attach_lora

    return attach_lora(tiny_model("llama"), cfg.lora)


def test_a_stopped_run_ends_its_mlflow_run_killed_and_says_how_to_resume(tmp_path, session_address):
    """Found by use: Ctrl-C or `ray job stop` (SIGTERM) left the MLflow run RUNNING for good, with no word."""
    cmd = [sys.executable, "-m", "raylora.cli", "train", "configs/tiny_lora_cpu.yaml", f"train.output_dir={tmp_path}/run",
           f"data.output_dir={tmp_path}/data", "train.num_workers=1", "train.max_steps=5000", "train.log_every=100",
           "tracking.enabled=true", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]  # fmt: skip
    with open(tmp_path / "driver.err", "w") as err:
        driver = subprocess.Popen(cmd, env={**os.environ, "RAY_ADDRESS": session_address}, start_new_session=True,
                                  stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (tmp_path / "run" / "workers" / "rank0.json").exists():
            time.sleep(0.5)
        driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=120)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    said = (tmp_path / "driver.err").read_text()
    assert driver.returncode == 1 and "training was stopped; run the same command again" in said, said[-3000:]
    run_id = json.loads((tmp_path / "run" / "mlflow_run.json").read_text())["run_id"]
    assert mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(run_id).info.status == "KILLED"


@pytest.mark.slow
def test_a_smollm2_adapter_names_its_hub_base_and_serves_offline_after_the_cache_moved(tmp_path):
    """``raylora train`` on the default model, its workers given the free CPUs; then the cache folder moves (another
    machine, another user) and the adapter is served through the id it recorded."""
    first = tmp_path / "cache-a"
    shutil.copytree(model_folder(ModelArgs()), first / "models" / SMOLLM2)  # the suite's conversion, copied
    cfg = load_config(
        "configs/smollm2_lora_cpu.yaml",
        [f"train.output_dir={tmp_path}/run", f"data.output_dir={tmp_path}/data", f"model.cache_dir={first}",
         "train.max_steps=1", "train.batch_size=1", "data.cutoff_len=64", "data.max_samples=4",
         "tracking.enabled=false"],
    )  # fmt: skip
    cpus = ray.cluster_resources()["CPU"]
    lines = []
    fit(cfg, log=lines.append)
    assert f"workers: 1, each with {cpus:g} CPUs and {math.ceil(cpus)} torch threads: the cluster's free CPUs" in (
        "\n".join(lines)
    )
    adapter = tmp_path / "run" / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == HUB_IDS[SMOLLM2]

    moved = first.rename(tmp_path / "cache-b")
    shutil.copytree(adapter, tmp_path / "adapters" / "mine")
    serving = load_config(
        None,
        [f"model.name_or_path={HUB_IDS[SMOLLM2]}", f"model.cache_dir={moved}", "serve.quantization=none",
         f"serve.adapter_root={tmp_path}/adapters", "tracking.enabled=false", "backend.device=cpu"],
    )  # fmt: skip
    server = LLMServer(to_dict(serving))
    try:
        asyncio.run(server._load("mine"))
        ids = server.tokenizer("Who are you?").input_ids
        served = wait_for(server.engine, GenRequest(ids, "mine", max_tokens=8, temperature=0), timeout_s=120)
    finally:
        server.engine.stop()
    assert served.error is None, served.error
    base, _ = load_model(ModelArgs(name_or_path=HUB_IDS[SMOLLM2], cache_dir=str(moved)))
    peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
    out = peft_model.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert served.text == answer_text(server.tokenizer, out[0, len(ids) :].tolist())
