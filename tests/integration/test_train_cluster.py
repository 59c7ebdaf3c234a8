"""Training across two Ray nodes (inspected by `raylora doctor --cluster` first).

Training and a sweep submitted with `ray job submit` to a `ray start`ed head are the demo's train and sweep stages
(test_demo.py)."""

import json
import re
import time

import ray
from ray.cluster_utils import Cluster

from raylora.cli import main
from raylora.cluster import dashboard_port
from raylora.config import load_config
from raylora.train.fit import fit


def test_two_nodes_the_doctor_reports_each_and_a_run_puts_one_worker_on_each(tmp_path, ray_tmp, monkeypatch, capsys):
    """Both nodes on 127.0.0.1. Ray's test cluster writes its address where ``ray start`` records its own, which
    ``ensure_ray`` joins: in the default folder, the other pytest process's next module joined this cluster and
    died when it shut down. Here the file goes to the test's own folder.

    Issue #40 first (on the same cluster: a 2-node cluster costs about 20 s of CPU to start): `raylora doctor
    --cluster` runs one task on each node and reports each by its node id."""
    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    # The dashboard port as raylora's own clusters take theirs: Ray's default, 8265, raced the other test process's.
    with dashboard_port() as port:
        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 3, "node_ip_address": "127.0.0.1", "dashboard_port": port}
        )
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
