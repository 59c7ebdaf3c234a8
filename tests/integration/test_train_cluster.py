"""Training on a `ray start`ed cluster through `ray job submit`, and across two Ray nodes."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlflow
import psutil
import pytest
import ray
from ray.cluster_utils import Cluster

from raylora.config import load_config
from raylora.train.fit import fit

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_cluster(temp_dir: str) -> None:
    """Stop the processes of the cluster this test started (found by its own temp folder), by PID."""
    ours = [p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])]
    for p in ours:
        p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(ours, timeout=15)
    for p in alive:
        p.kill()


@pytest.fixture
def head():
    """A head node from `ray start` on 127.0.0.1, with token auth as `ray start` sets it up."""
    temp_dir = tempfile.mkdtemp(prefix="rl-", dir="/tmp")
    dashboard = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    subprocess.run(
        [str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={free_port()}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", "--num-cpus=2", f"--temp-dir={temp_dir}",
         "--disable-usage-stats"],
        env=env, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        stop_cluster(temp_dir)


def test_ray_job_submit_trains_and_tracks(head, tmp_path, root):
    address, env = head
    proc = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(root), "--",
         sys.executable, "jobs/train.py", "configs/tiny_lora_cpu.yaml", f"train.output_dir={tmp_path}/run",
         f"data.output_dir={tmp_path}/data", "train.max_steps=4", "tracking.enabled=true",
         f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tracking.experiment=jobs"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "succeeded" in (proc.stdout + proc.stderr).lower()
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("jobs").experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4]


def test_two_nodes_one_worker_each(tmp_path):
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3})
    cluster.add_node(num_cpus=3)
    try:
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
