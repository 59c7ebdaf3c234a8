"""Clusters raylora starts: a local one stays on 127.0.0.1 whatever the host's routable address. (Stopping one stops
every process it started: the demo's `ray start`ed cluster, test_demo.py.)"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from raylora.cluster import stop_cluster
from raylora.ports import free_port

SCRIPT = """
from raylora.cluster import ensure_ray
import ray
ensure_ray()
print("node", ray.util.get_node_ip_address(), ray.get_runtime_context().gcs_address, flush=True)

@ray.remote(num_cpus=0)
def state_api() -> str:  # where Ray's state API, as Ray Train's placement-group cleaner calls it, goes
    from ray.dashboard.utils import get_address_for_submission_client
    try:
        return get_address_for_submission_client(None)
    except ConnectionError as e:
        return str(e).replace(" ", "_")

dashboard = "http://" + ray._private.worker.global_worker.node.address_info["webui_url"]
print("state", ray.get(state_api.remote()), dashboard, flush=True)
ray.shutdown()
"""


def start_local_clusters(*stale_addresses: str | None) -> list[tuple[str, str, str, tuple[str, str]]]:
    """For each entry, a cluster that ``ensure_ray`` starts, all at the same moment, each in a fresh interpreter as
    `raylora train` or `python jobs/train.py` does: ``(node address, GCS address, stderr, (state API address its
    workers use, its dashboard))`` (Ray reads the setting that keeps a 127.0.0.1 node address on loopback when it is
    first imported, and this process imported it long ago); an entry that is an address makes Ray's file name a
    `ray start` at that address that is gone."""
    temp_dirs = [tempfile.mkdtemp(prefix="rl-", dir="/tmp") for _ in stale_addresses]  # Ray's socket paths: <107 bytes
    runs = []
    try:
        for temp_dir, stale_address in zip(temp_dirs, stale_addresses, strict=True):
            if stale_address:
                (Path(temp_dir) / "ray").mkdir()
                (Path(temp_dir) / "ray" / "ray_current_cluster").write_text(stale_address)
            env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
            env["RAY_TMPDIR"] = temp_dir
            runs.append(subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True))  # fmt: skip
        done = []
        for run in runs:
            out, err = run.communicate(timeout=120)
            done.append((run.returncode, out, err))
    finally:
        for run in runs:
            run.kill()
        for temp_dir in temp_dirs:
            stop_cluster(temp_dir)
            shutil.rmtree(temp_dir, ignore_errors=True)
    found = []
    for code, out, err in done:
        assert code == 0, err[-3000:]
        lines = out.splitlines()
        node, gcs = next(line.split()[1:] for line in lines if line.startswith("node "))
        state, dashboard = next(line.split()[1:] for line in lines if line.startswith("state "))
        found.append((node, gcs, err, (state, dashboard)))
    return found


def test_local_clusters_started_at_once_beside_another_stay_on_loopback_with_dashboards_of_their_own(ray_session):
    """Two clusters that ``ensure_ray`` starts at the same moment, beside this test process's own Ray; the second
    where Ray's file still names the last `ray start`, killed without `ray stop`. Each started a cluster on a host
    with another cluster, costing about 10 s of CPU, so the three faults found by use share one start:

    - found beside another Ray instance, Ray's state API in the new cluster's workers (Ray Train's placement-group
      cleaner) failed with "Found multiple active Ray instances";
    - both took Ray's default port 8265 when they looked, and the second's dashboard failed to bind it;
    - with a `ray start` that is gone, Ray would wait for it and fail."""
    dead = f"127.0.0.1:{free_port()}"
    first, second = start_local_clusters(None, dead)
    for node, gcs, _, (state, dashboard) in (first, second):
        assert node == "127.0.0.1" and gcs.startswith("127.0.0.1:")
        assert state == dashboard and dashboard.startswith("http://127.0.0.1:")
    assert first[3][1] != second[3][1]
    assert f"the last `ray start` on this host ({dead}) does not answer" in second[2]
    assert "does not answer" not in first[2]
