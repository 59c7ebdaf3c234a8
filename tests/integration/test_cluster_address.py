"""A local cluster that raylora starts stays on 127.0.0.1, whatever the host's routable address.

A fresh interpreter, as `raylora train` or `python jobs/train.py` is: Ray reads the setting that keeps a
127.0.0.1 node address on loopback when it is first imported, and this process imported it long ago.
"""

import os
import shutil
import subprocess
import sys
import tempfile

from processes import stop_processes

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
        stop_processes(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    node, gcs = next(line.split()[1:] for line in done.stdout.splitlines() if line.startswith("node "))
    assert node == "127.0.0.1"
    assert gcs.startswith("127.0.0.1:")
