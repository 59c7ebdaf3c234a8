"""The processes of a Ray cluster that a test started, found the way a user would look for them: by the cluster's temp
folder in their command lines, and their children (the raylet's agents rename themselves). Independent of
``raylora.cluster.stop_cluster``, which these tests check."""

import contextlib

import psutil


def cluster_processes(temp_dir: str) -> list[psutil.Process]:
    """The processes naming ``temp_dir`` in their command lines, and their children."""
    family = {p.pid: p for p in psutil.process_iter(["cmdline"]) if str(temp_dir) in " ".join(p.info["cmdline"] or [])}
    for p in list(family.values()):
        with contextlib.suppress(psutil.Error):
            family.update({c.pid: c for c in p.children(recursive=True)})
    return list(family.values())


def alive(temp_dir: str) -> list[psutil.Process]:
    """Those of :func:`cluster_processes` still running (not exited, not zombies)."""
    return [p for p in cluster_processes(temp_dir) if running(p)]


def names(processes: list[psutil.Process]) -> list[str]:
    found = []
    for p in processes:
        with contextlib.suppress(psutil.Error):
            found.append(p.name())
    return found


def running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
