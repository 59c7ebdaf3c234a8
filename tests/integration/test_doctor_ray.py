import re

import ray
from ray.cluster_utils import Cluster

from raylora.cli import main


def test_doctor_reaches_a_running_ray_cluster(monkeypatch, capsys):
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=1)
    try:
        address = ray.get_runtime_context().gcs_address
        assert address.startswith("127.0.0.1:")
        monkeypatch.setenv("RAY_ADDRESS", address)
        assert main(["doctor"]) == 0
        assert f"{address} reachable" in capsys.readouterr().out
    finally:
        ray.shutdown()


def test_cluster_doctor_reports_every_node(ray_tmp, monkeypatch, capsys):
    """Issue #40: `raylora doctor --cluster` runs one task on each node of a 2-node cluster (both on 127.0.0.1, CPU)
    and reports each by its node id."""
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)  # this cluster's files, and its address file, in the test's own folder
    node_args = {"node_ip_address": "127.0.0.1", "num_cpus": 1, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=node_args)
    try:
        worker = cluster.add_node(**node_args)
        cluster.wait_for_nodes()
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        assert main(["doctor", "--cluster"]) == 0
        out = capsys.readouterr().out
        nodes = re.findall(r"^node 127\.0\.0\.1 +node id (\w+), 0 NPU\(s\) in Ray$", out, re.M)
        assert sorted(nodes) == sorted([cluster.head_node.node_id, worker.node_id])
        assert out.count("\n  torch_npu ") == 2 and out.count("\n  npu-smi ") == 2  # each node's own rows
        assert "OK: this environment can run a raylora job." in out
        assert not ray.is_initialized()  # the doctor's connection is closed
    finally:
        cluster.shutdown()
