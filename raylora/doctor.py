"""``raylora doctor``: can this environment run a job, and if not, what to fix."""

from __future__ import annotations

import importlib.metadata
import os
import platform

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raylora.backends import BackendError, install_rows, planned_backend, resolve_backend
from raylora.backends.ascend_env import findings, node_facts
from raylora.cluster import last_ray_start, unanswered
from raylora.comm.hooks import check_hook
from raylora.config import ConfigError, JobConfig
from raylora.tracking import TrackingError, check_reachable, tracking_uri
from raylora.tune.space import trial_count

REQUIRED = {"torch": "torch==2.13.0", "ray": "ray[data,train,tune,serve,default]", "peft": "peft",
            "transformers": "transformers", "mlflow": "mlflow==3.17.2"}  # fmt: skip
NODE_TIMEOUT_S = 60  # a node's inspection: a new Ray worker process, which imports torch, and a few tool calls


def check(cfg: JobConfig, cluster: bool = False) -> tuple[list[tuple[str, str]], list[str]]:
    """Inspect the environment for the job ``cfg``.

    A sweep's config (a non-empty ``tune.space``) is checked as ``raylora tune`` checks it, and a tracking server as
    the job reaches it; nothing starts Ray or prepares data. With ``cluster``, every node of the running Ray cluster
    is inspected too (:func:`cluster_nodes`).

    Returns:
        ``(rows, problems)``: table rows ``(item, finding)`` and one line per blocking problem, each naming its fix.
    """
    rows = [("python", platform.python_version())]
    problems = []
    for dist, spec in REQUIRED.items():
        try:
            rows.append((dist, importlib.metadata.version(dist)))
        except importlib.metadata.PackageNotFoundError:
            rows.append((dist, "MISSING"))
            problems.append(f"{dist} is not installed: pip install '{spec}' (or make install)")
    rows += install_rows()
    try:
        backend = resolve_backend(cfg.backend)
    except BackendError as e:
        rows.append(("device", f"UNUSABLE: backend.device={cfg.backend.device}"))
        problems.append(str(e))
    else:
        rows += backend.describe(cfg.train.num_workers)
        try:
            check_hook(cfg.train, backend)
        except BackendError as e:
            problems.append(str(e))
    if cfg.train.compile and (warning := compile_warning(cfg)):
        rows.append(("train.compile", f"WARNING: {warning}"))
    address, problem = ray_cluster()
    rows.append(("ray cluster", address))
    if problem:
        problems.append(problem)
    row, problem = tracking(cfg)
    rows.append(("mlflow tracking uri", row))
    if problem:
        problems.append(problem)
    if cfg.tune.space:
        row, found = sweep(cfg)
        rows.append(("sweep", row))
        problems += found
    if cluster:
        found = cluster_nodes(cfg)
        rows += found[0]
        problems += found[1]
    return rows, problems


def compile_warning(cfg: JobConfig) -> str | None:
    """What ``train.compile`` risks on the device the job plans for (not found when the device itself is the problem,
    which :func:`check` reports)."""
    try:
        return planned_backend(cfg.backend).compile_warning()
    except BackendError:
        return None


def tracking(cfg: JobConfig) -> tuple[str, str | None]:
    """Where the job logs, and the problem when it is a tracking server that does not answer."""
    if not cfg.tracking.enabled:
        return "disabled", None
    uri = tracking_uri(cfg.tracking)
    try:
        check_reachable(uri)  # a server URL only: a SQLite file or folder is made by the job
    except TrackingError as e:
        return f"{uri} UNREACHABLE", str(e)
    return uri, None


def sweep(cfg: JobConfig) -> tuple[str, list[str]]:
    """What ``raylora tune`` refuses in this sweep (the checks it runs before anything starts), one line a problem."""
    # here, not at the top: tune.sweep imports transformers, peft and Ray Data (about 3 s more), and the doctor must
    # still run, and report them MISSING, where they are not installed
    from raylora.tune.sweep import check_sweep

    try:
        check_sweep(cfg)
    except ConfigError as e:
        return f"{len(e.problems)} problem(s) in the sweep's settings", [f"{key}: {msg}" for key, msg in e.problems]
    return f"{trial_count(cfg.tune)} trial(s), {cfg.tune.search} search, scheduler {cfg.tune.scheduler}", []


def ray_cluster() -> tuple[str, str | None]:
    """Where a running Ray cluster is, if any: ``RAY_ADDRESS``, else the last ``ray start`` on this host."""
    address = os.environ.get("RAY_ADDRESS") or last_ray_start()
    if not address or address in ("local", "auto"):
        return "none running (jobs start a local cluster on 127.0.0.1)", None
    why = unanswered(address)
    if why is None:
        return f"{address} reachable", None
    if not os.environ.get("RAY_ADDRESS"):  # a stale address file: jobs start their own cluster (ensure_ray)
        return f"none running (last `ray start` at {address} is gone; jobs start a local cluster)", None
    return f"{address} UNREACHABLE ({why})", (
        f"RAY_ADDRESS={address} does not answer: start a cluster with "
        "`ray start --head --node-ip-address=127.0.0.1`, or unset RAY_ADDRESS to let jobs start a local one."
    )


def cluster_nodes(cfg: JobConfig) -> tuple[list[tuple[str, str]], list[str]]:
    """Every alive node of the running Ray cluster (``RAY_ADDRESS``, else the last ``ray start`` on this host),
    inspected by one small task pinned to it (:func:`~raylora.backends.ascend_env.node_facts`): torch, torch_npu and
    CANN and whether they match, the NPUs, driver and firmware, the HCCL variables a job's workers get there and whether
    their NIC and address exist on that node, the NPUs' own NICs.

    The task asks for no CPU (it runs beside a training job) and imports torch with its device-backend autoload off,
    so that torch does not load a torch_npu that a missing CANN breaks; a node whose task fails or does not finish in
    :data:`NODE_TIMEOUT_S` is a problem, the others are reported all the same.

    Returns:
        ``(rows, problems)`` as :func:`check`'s; each node's rows under a ``node <ip>`` row, each problem naming its node.
    """
    address = os.environ.get("RAY_ADDRESS") or last_ray_start()
    if not ray.is_initialized() and (not address or address in ("local", "auto") or unanswered(address)):
        return [("cluster nodes", "not inspected")], [
            "raylora doctor --cluster inspects a running Ray cluster, and none answers here: start one (`ray start "
            "--head` here, `ray start --address=HEAD:6379` on each other node) or set RAY_ADDRESS to it"
        ]
    rows, problems = [], []
    try:
        job_env = planned_backend(cfg.backend).env
    except BackendError as e:  # an invalid HCCL_CONNECT_TIMEOUT here: said once, the nodes checked without it
        problems.append(str(e))
        job_env = {}
    connected = ray.is_initialized()
    if not connected:
        ray.init(address=address, log_to_driver=False)
    try:
        nodes = [n for n in ray.nodes() if n["Alive"]]
        inspect = ray.remote(num_cpus=0, runtime_env={"env_vars": {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}})(node_facts)
        refs = [
            inspect.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
            for n in nodes
        ]
        ray.wait(refs, num_returns=len(refs), timeout=NODE_TIMEOUT_S)
        facts = []
        for ref in refs:
            try:
                facts.append(ray.get(ref, timeout=0))
            except Exception as e:  # a node that cannot run the task, or not in time: reported, the others go on
                ray.cancel(ref, force=True)
                facts.append(f"{type(e).__name__}: {str(e).strip().splitlines()[-1]}")
    finally:
        if not connected:
            ray.shutdown()
    npu_nodes = sum(1 for f in facts if isinstance(f, dict) and f["devices"])
    for node, found in zip(nodes, facts, strict=True):
        name = f"node {node['NodeManagerAddress']}"
        rows.append((name, f"node id {node['NodeID']}, {node['Resources'].get('NPU', 0):g} NPU(s) in Ray"))
        if isinstance(found, str):
            rows.append(("  inspection", "FAILED"))
            problems.append(f"{name} ({node['NodeID'][:8]}): its inspection failed or took over {NODE_TIMEOUT_S} s "
                            f"({found})")  # fmt: skip
            continue
        node_rows, node_problems = findings(found, job_env, npu_nodes)
        rows += [(f"  {item}", finding) for item, finding in node_rows]
        problems += [f"{name} ({found['host']}): {problem}" for problem in node_problems]
    return rows, problems


def render(rows: list[tuple[str, str]], problems: list[str]) -> str:
    """The doctor report as a two-column table followed by problems and their fixes."""
    width = max(len(k) for k, _ in rows)
    lines = [f"{'item'.ljust(width)}  finding", f"{'-' * width}  {'-' * 40}"]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines.append("")
    lines += [f"PROBLEM: {p}" for p in problems] or ["OK: this environment can run a raylora job."]
    return "\n".join(lines)
