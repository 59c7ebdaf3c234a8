"""Training on a `ray start`ed cluster through `ray job submit`, and across two Ray nodes (inspected by `raylora doctor
--cluster` first).

A sweep submitted with `ray job submit` to a `ray start`ed head is the demo's sweep stage (test_demo.py)."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlflow
import pytest
import ray
from ray.cluster_utils import Cluster

from raylora.cli import main
from raylora.cluster import stop_cluster
from raylora.config import load_config
from raylora.ports import free_port
from raylora.train.fit import fit

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def head():
    """A head node from `ray start` on 127.0.0.1, with token auth as `ray start` sets it up (one per module)."""
    temp_dir = tempfile.mkdtemp(prefix="rl-", dir="/tmp")
    dashboard = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    subprocess.run(
        [str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={free_port()}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", "--num-cpus=2", f"--temp-dir={temp_dir}",
         # every port of its own: another cluster on this machine may hold Ray's defaults (the job agent's 52365)
         f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
         f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
         f"--ray-client-server-port={free_port()}",
         "--disable-usage-stats"],
        env=env, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{dashboard}", env, temp_dir
    finally:
        stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def submit(address: str, env: dict, root: Path, *args: str, runtime_env: dict | None = None):
    extra = ["--runtime-env-json", json.dumps(runtime_env)] if runtime_env else []
    for _ in range(15):  # the head's job agent starts a little after `ray start` returns
        proc = subprocess.run(
            [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(root), *extra, "--",
             sys.executable, *args],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if "No available agent to submit job" not in proc.stderr:
            return proc
        time.sleep(2)
    return proc


def test_ray_job_outputs_and_mlflow_artifacts_outlive_rays_temporary_folder(head, tmp_path, root):
    """Relative outputs under `ray job submit` land in the folder the job names, not Ray's copy of the working folder."""
    address, env, temp_dir = head
    args = ["jobs/train.py", "configs/tiny_lora_cpu.yaml", "train.max_steps=4", "tracking.enabled=true",
            "tracking.experiment=jobs"]  # fmt: skip
    refused = submit(address, env, root, *args)
    assert refused.returncode != 0
    assert "train.output_dir: 'outputs/tiny_lora_cpu' is relative" in refused.stdout + refused.stderr
    proc = submit(address, env, root, *args, runtime_env={"env_vars": {"RAYLORA_BASE_DIR": str(tmp_path)}})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # what the user sees: one progress line per logged step, with its ETA, and no Ray Train report lines
    console = (proc.stdout + proc.stderr).splitlines()
    progress = [line for line in console if re.search(r"step \d+/4 ", line)]
    assert [re.search(r"step (\d+)/4 .* ETA \d+s", line).group(1) for line in progress] == ["1", "2", "3", "4"], (
        progress
    )
    assert not [line for line in console if "Reporting training result" in line]
    stop_cluster(temp_dir)
    shutil.rmtree(temp_dir)
    assert (tmp_path / "outputs" / "tiny_lora_cpu" / "adapter" / "adapter_model.safetensors").is_file()
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("jobs").experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4]
    artifacts = tmp_path / "mlartifacts" / run.info.run_id / "artifacts"
    assert (artifacts / "adapter" / "adapter_model.safetensors").is_file() and (artifacts / "loss.png").is_file()
    assert {"adapter", "config.yaml", "loss.png", "history.json"} <= {
        a.path for a in client.list_artifacts(run.info.run_id)
    }


def test_two_nodes_the_doctor_reports_each_and_a_run_puts_one_worker_on_each(tmp_path, ray_tmp, monkeypatch, capsys):
    """Both nodes on 127.0.0.1. Ray's test cluster writes its address where ``ray start`` records its own, which
    ``ensure_ray`` joins: in the default folder, the other pytest process's next module joined this cluster and
    died when it shut down. Here the file goes to the test's own folder.

    Issue #40 first (on the same cluster: a 2-node cluster costs about 20 s of CPU to start): `raylora doctor
    --cluster` runs one task on each node and reports each by its node id."""
    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "node_ip_address": "127.0.0.1"})
    worker = cluster.add_node(num_cpus=3, node_ip_address="127.0.0.1")
    try:
        cluster.wait_for_nodes()
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        assert main(["doctor", "--cluster"]) == 0
        out = capsys.readouterr().out
        nodes = re.findall(r"^node 127\.0\.0\.1 +node id (\w+), 0 NPU\(s\) in Ray$", out, re.M)
        assert sorted(nodes) == sorted([cluster.head_node.node_id, worker.node_id])
        assert out.count("\n  torch_npu ") == 2 and out.count("\n  npu-smi ") == 2  # each node's own rows
        assert "OK: this environment can run a raylora job." in out
        assert not ray.is_initialized()  # the doctor's connection is closed

        ray.init(address=cluster.address)
        cfg = load_config(
            "configs/tiny_lora_cpu.yaml",
            [f"train.output_dir={tmp_path}/run", f"data.output_dir={tmp_path}/data", "train.num_workers=2",
             "train.cpus_per_worker=2", "train.max_steps=3", "train.batch_size=2"],
        )  # fmt: skip
        result = fit(cfg, log=lambda s: None)
        assert result["steps"] == 3
        workers = [json.loads(p.read_text()) for p in sorted((tmp_path / "run" / "workers").glob("rank*.json"))]
        assert len({w["node"] for w in workers}) == 2
    finally:
        ray.shutdown()
        cluster.shutdown()
        time.sleep(1)
