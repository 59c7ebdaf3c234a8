"""``raylora doctor``: can this environment run a job, and if not, what to fix."""

from __future__ import annotations

import importlib.metadata
import os
import platform

from raylora.backends import BackendError, install_rows, resolve_backend
from raylora.cluster import last_ray_start, unanswered
from raylora.comm.hooks import check_hook
from raylora.config import JobConfig
from raylora.tracking import tracking_uri

REQUIRED = {"torch": "torch==2.13.0", "ray": "ray[data,train,tune,serve,default]", "peft": "peft",
            "transformers": "transformers", "mlflow": "mlflow==3.17.2"}  # fmt: skip


def check(cfg: JobConfig) -> tuple[list[tuple[str, str]], list[str]]:
    """Inspect the environment for the job ``cfg``.

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
    rows.append(("mlflow tracking uri", tracking_uri(cfg.tracking) if cfg.tracking.enabled else "disabled"))
    return rows, problems


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
