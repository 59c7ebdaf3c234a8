"""A local cluster that raylora starts stays on 127.0.0.1, whatever the host's routable address.

A fresh interpreter, as `raylora train` or `python jobs/train.py` is: Ray reads the setting that keeps a
127.0.0.1 node address on loopback when it is first imported, and this process imported it long ago.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from raylora.cluster import stop_cluster

SCRIPT = """
from raylora.cluster import ensure_ray
import ray
ensure_ray()
print("node", ray.util.get_node_ip_address(), ray.get_runtime_context().gcs_address, flush=True)
ray.shutdown()
"""


def test_a_local_cluster_started_by_raylora_binds_to_loopback():
    temp_dir = tempfile.mkdtemp(prefix="rl-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    env["RAY_TMPDIR"] = temp_dir
    try:
        done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=180)
    finally:
        stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    node, gcs = next(line.split()[1:] for line in done.stdout.splitlines() if line.startswith("node "))
    assert node == "127.0.0.1"
    assert gcs.startswith("127.0.0.1:")


def test_stopping_a_cluster_leaves_none_of_its_processes():
    """`ray start`'s daemons carry the temp folder in their command lines, but the raylet's agents rename themselves
    (ray::DashboardAgent, ray::RuntimeEnvAgent) and outlived the raylet: every descendant goes too."""
    import psutil

    temp_dir = tempfile.mkdtemp(prefix="rl-", dir="/tmp")
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    ray = str(Path(sys.executable).with_name("ray"))
    try:
        subprocess.run(
            [ray, "start", "--head", "--node-ip-address=127.0.0.1", "--port=0", "--include-dashboard=false",
             "--num-cpus=1", f"--temp-dir={temp_dir}"],
            env=env, check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        time.sleep(3)  # the raylet starts its agents
        started = [p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])]
        family = {p.pid: p for p in started}
        for p in started:
            family.update({c.pid: c for c in p.children(recursive=True)})
        names = {p.name() for p in family.values()}
        assert any("Agent" in name for name in names), names  # the renamed ones are there to be stopped
    finally:
        stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    alive = [p for p in family.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.name()) for p in alive]
