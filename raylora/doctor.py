"""``raylora doctor``: can this environment run a job, and if not, what to fix."""

from __future__ import annotations

import importlib.metadata
import os
import platform

from raylora.backends import BackendError, install_rows, resolve_backend
from raylora.cluster import last_ray_start, unanswered
from raylora.comm.hooks import check_hook
from raylora.config import ConfigError, JobConfig
from raylora.tracking import TrackingError, check_reachable, tracking_uri
from raylora.tune.space import trial_count

REQUIRED = {"torch": "torch==2.13.0", "ray": "ray[data,train,tune,serve,default]", "peft": "peft",
            "transformers": "transformers", "mlflow": "mlflow==3.17.2"}  # fmt: skip


def check(cfg: JobConfig) -> tuple[list[tuple[str, str]], list[str]]:
    """Inspect the environment for the job ``cfg``.

    A sweep's config (a non-empty ``tune.space``) is checked as ``raylora tune`` checks it, and a tracking server as
    the job reaches it; nothing starts Ray or prepares data.

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
    cluster, problem = ray_cluster()
    rows.append(("ray cluster", cluster))
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
    return rows, problems


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


def render(rows: list[tuple[str, str]], problems: list[str]) -> str:
    """The doctor report as a two-column table followed by problems and their fixes."""
    width = max(len(k) for k, _ in rows)
    lines = [f"{'item'.ljust(width)}  finding", f"{'-' * width}  {'-' * 40}"]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines.append("")
    lines += [f"PROBLEM: {p}" for p in problems] or ["OK: this environment can run a raylora job."]
    return "\n".join(lines)
