"""Device backends: the only place that names npu, cuda, hccl or nccl.

``resolve_backend(args)`` picks the device (npu → cuda → cpu unless one is asked for) and
returns a :class:`Backend` describing everything the rest of raylora needs from it.
raylora imports torch_npu only when an NPU is asked for or probed (torch_npu 2.5 and later also loads itself with
``import torch``, through torch's device-backend autoload, unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from raylora.backends import cpu, cuda, npu
from raylora.backends.base import Backend, BackendError
from raylora.config import BackendArgs

__all__ = [
    "Backend", "BackendError", "resolve_backend", "planned_backend", "worker_plan", "replica_plan", "install_rows",
    "PROBE_ORDER", "store_timeout_s", "init_process_group",
]  # fmt: skip

PROBE_ORDER = (npu, cuda, cpu)


def resolve_backend(args: BackendArgs) -> Backend:
    """Pick and describe the device for a job.

    Args:
        args: ``backend.device`` is ``auto`` (probe in :data:`PROBE_ORDER`, the portable cpu last)
            or a device name, which must then be usable.
    Returns:
        The :class:`Backend` for that device.
    Raises:
        BackendError: the device asked for is absent, or its precision is not supported, with the fix.
    """
    if args.device == "auto":
        notes = []
        for module in PROBE_ORDER:
            ok, how = module.probe()
            if ok:
                return module.make(args, f"auto: {how}" + (f" ({'; '.join(notes)})" if notes else ""))
            notes.append(how)
        raise BackendError("no device found, not even the cpu backend")  # cpu.probe() is always True
    module = {m.NAME: m for m in PROBE_ORDER}[args.device]
    ok, how = module.probe()
    if not ok:
        raise BackendError(f"backend.device={args.device} was asked for, but {how}. {module.INSTALL_HINT}")
    return module.make(args, f"asked for: {how}")


def planned_backend(args: BackendArgs) -> Backend:
    """The device the driver plans for, without needing that device itself.

    The driver may have no accelerator (a CPU head node of an NPU cluster), so an explicit ``backend.device`` is
    taken at its word here and probed where the work runs; ``auto`` probes the driver. Raises :class:`BackendError`
    as :func:`resolve_backend` does.
    """
    if args.device == "auto":
        return resolve_backend(args)
    module = {m.NAME: m for m in PROBE_ORDER}[args.device]
    env = npu.hccl_env(args) if module is npu else cpu.worker_env() if module is cpu else {}
    return Backend(module.NAME, "planned", module.DIST_BACKEND, module.RAY_RESOURCE, None, None, False, env)


def replica_plan(args: BackendArgs, cpus: float) -> dict:
    """``ray_actor_options`` for a Serve model replica (see :func:`planned_backend`)."""
    return planned_backend(args).actor_options(cpus)


def worker_plan(args: BackendArgs, num_workers: int, cpus_per_worker: float) -> tuple[str, dict, dict[str, str]]:
    """What the driver asks Ray for: ``(dist backend, ScalingConfig kwargs, worker environment)``.

    See :func:`planned_backend` for how the device is chosen.
    """
    plan = planned_backend(args)
    return plan.dist_backend, plan.scaling(num_workers, cpus_per_worker), plan.env


# HCCL waits HCCL_CONNECT_TIMEOUT and 20 s more, in which it tells the other ranks why it failed (CANN 8.2 and later)
HCCL_CONNECT_GRACE_S = 20


def store_timeout_s(env: dict[str, str]) -> int:
    """How long the ranks' store waits for each other: Ray's default 1800 s, or as long as HCCL may take to connect
    (``HCCL_CONNECT_TIMEOUT`` in ``env``, the value in effect for the workers: see :func:`worker_plan`).

    Raises:
        BackendError: that ``HCCL_CONNECT_TIMEOUT`` is not one CANN accepts.
    """
    timeout = npu.connect_timeout_s(env)
    return max(1800, timeout + HCCL_CONNECT_GRACE_S) if timeout else 1800


def init_process_group(dist_backend: str, init_method: str, rank: int, world: int) -> None:
    """Start torch.distributed in this process, as a grouped sweep's worker does (Ray Train starts its own).

    HCCL exists once torch_npu is imported, which is done here rather than left to torch's device-backend autoload
    (off with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``). The store waits :func:`store_timeout_s` of this process's
    environment, where the actor was started with the job's ``HCCL_CONNECT_TIMEOUT``.

    Raises:
        BackendError: HCCL asked for and torch_npu does not import; an invalid ``HCCL_CONNECT_TIMEOUT``.
    """
    if dist_backend == npu.DIST_BACKEND:
        npu.ensure_loaded()
    timeout = timedelta(seconds=store_timeout_s(dict(os.environ)))
    dist.init_process_group(dist_backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)


def install_rows() -> list[tuple[str, str]]:
    """``raylora doctor``'s rows on the device software installed here (torch_npu and CANN), device or not."""
    return npu.install_rows()
