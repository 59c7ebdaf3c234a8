"""CPUs per training worker when ``train.cpus_per_worker`` is unset: the workers share what the cluster has free.

A worker's torch threads follow its CPUs, so a lone worker held to one CPU on a 2-core machine trains at about
0.7x the speed of two threads (``bench/cpus_per_worker.py``). With the data prepared before training, nothing else needs
those cores; a streamed pipeline keeps ``reserve`` CPUs for its readers.
"""

from __future__ import annotations

import math


def free_share(nodes: list[dict[str, float]], available_cpus: float, workers: int, device: str | None,
               reserve: float) -> int:  # fmt: skip
    """The most whole CPUs each of ``workers`` workers can take so that all of them fit at once; at least 1.

    Args:
        nodes: each alive node's resources (``ray.nodes()``'s ``Resources``).
        available_cpus: the cluster's free CPUs now (``ray.available_resources()``); other jobs keep theirs.
        workers: the training workers.
        device: the resource each worker also takes one of (``"NPU"``, ``"GPU"``), or ``None`` for CPU workers.
        reserve: CPUs left free on the largest node (for a streamed pipeline's read tasks).
    """
    ordered = sorted(nodes, key=lambda n: -n.get("CPU", 0.0))
    cpus = [n.get("CPU", 0.0) for n in ordered]
    devices = [n.get(device, 0.0) if device else math.inf for n in ordered]
    if cpus:
        cpus[0] -= reserve
    budget = available_cpus - reserve
    for each in range(int(max(cpus, default=1)), 1, -1):
        fits = sum(min(int(c // each), d) for c, d in zip(cpus, devices, strict=True))
        if fits >= workers and each * workers <= budget:
            return each
    return 1
