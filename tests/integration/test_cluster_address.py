"""Clusters raylora starts: a local one stays on 127.0.0.1 whatever the host's routable address, and stopping one
stops every process it started."""

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

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


def test_stopping_a_cluster_leaves_none_of_its_processes():
    """`ray start`'s daemons carry the temp folder in their command lines, but the raylet's agents rename themselves
    (ray::DashboardAgent, ray::RuntimeEnvAgent) and outlived the raylet: they go too."""
    temp_dir = tempfile.mkdtemp(prefix="rl-", dir="/tmp")
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    family: dict[int, psutil.Process] = {}
    try:
        subprocess.run(
            [str(Path(sys.executable).with_name("ray")), "start", "--head", "--node-ip-address=127.0.0.1",
             f"--port={free_port()}", "--include-dashboard=false", "--num-cpus=1", f"--temp-dir={temp_dir}",
             f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
             f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
             f"--ray-client-server-port={free_port()}"],
            env=env, check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("Agent" in name for name in _names(family.values())):
            time.sleep(0.5)  # the agents rename themselves once they are up
            family = {
                p.pid: p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])
            }
            for p in list(family.values()):
                with contextlib.suppress(psutil.Error):
                    family.update({c.pid: c for c in p.children(recursive=True)})
        assert sum("Agent" in name for name in _names(family.values())) == 2, _names(family.values())
    finally:
        stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    alive = [p for p in family.values() if _running(p)]
    assert not alive, _names(alive)


def _names(processes) -> list[str]:
    names = []
    for p in processes:
        with contextlib.suppress(psutil.Error):
            names.append(p.name())
    return names


def _running(p) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
