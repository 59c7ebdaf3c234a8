"""Plain CPU: gloo; bf16 autocast under ``precision: auto`` only where a timed GEMM shows bf16 units pay off.

A CPU with AMX or AVX-512 BF16 runs bf16 matrix products several times faster than fp32 (about 4x on the
2-core machines raylora is developed on); one without them emulates bf16 and is slower. ``auto`` reads the
CPU's flags and, where they promise bf16 units, times both GEMMs before choosing.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import torch

from raylora.backends.base import Backend, amp_from_precision
from raylora.config import BackendArgs

NAME = "cpu"
DIST_BACKEND = "gloo"
RAY_RESOURCE = "CPU"
INSTALL_HINT = ""
BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo names of the x86 bf16 matrix instructions
BF16_MIN_SPEEDUP = 1.5  # below this, bf16's rounding is not worth its speed
CPUINFO = Path("/proc/cpuinfo")
# oneDNN keeps a compiled primitive per matrix-product shape, in its own cache and in ideep's (PyTorch's wrapper)
# in front of it, 1,024 of each by default. Packs of changing lengths bring new shapes every step: a DPO worker's
# heap grew 30 MB a step, its peak from 1.4 to 2.1 GB over 30 steps (bench/preference.py). 256 of each hold a step's
# shapes at the same speed; 16 in oneDNN's cost 45% of the speed, 16 in ideep's 8%.
PRIMITIVE_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
PRIMITIVE_CACHE_CAPACITY = "256"


def probe() -> tuple[bool, str]:
    return True, "cpu is always available"


def cpu_flags() -> set[str] | None:
    """The CPU feature flags of ``/proc/cpuinfo`` (``None`` where there is no such file, e.g. macOS)."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.partition(":")[2].split())
    return set()


def gemm_gflops(dtypes: tuple[torch.dtype, ...], size: int = 1024, repeats: int = 8) -> list[float]:
    """GFLOP/s of a ``size`` x ``size`` matrix product in each of ``dtypes`` on this process's threads.

    The dtypes take turns, ``repeats`` times, and each keeps its best time: on a shared machine a burst of
    load then slows both alike instead of deciding the comparison.
    """
    pairs = [(torch.randn(size, size).to(d), torch.randn(size, size).to(d)) for d in dtypes]
    for a, b in pairs:
        torch.mm(a, b)  # the first call allocates and picks the kernel
    best = [float("inf")] * len(dtypes)
    for _ in range(repeats):
        for i, (a, b) in enumerate(pairs):
            start = time.perf_counter()
            torch.mm(a, b)
            best[i] = min(best[i], time.perf_counter() - start)
    return [2 * size**3 / t / 1e9 for t in best]


@functools.cache
def bf16_is_fast() -> tuple[bool, str]:
    """Whether bf16 autocast speeds up this CPU, and the evidence: its flags, then a timed GEMM of each dtype."""
    flags = cpu_flags()
    capability = torch.backends.cpu.get_cpu_capability()
    if flags is not None and not flags.intersection(BF16_FLAGS):
        return False, f"no AMX or AVX-512 BF16 in the CPU flags (torch kernels: {capability})"
    fp32, bf16 = gemm_gflops((torch.float32, torch.bfloat16))
    have = ", ".join(sorted(flags.intersection(BF16_FLAGS))) if flags is not None else "flags unknown"
    evidence = f"{have}; 1024^3 GEMM bf16 {bf16:.0f} vs fp32 {fp32:.0f} GFLOP/s on {torch.get_num_threads()} thread(s)"
    return bf16 >= BF16_MIN_SPEEDUP * fp32, evidence


def worker_env() -> dict[str, str]:
    """The primitive caches' bounds for a training worker's process (read when it starts), unless this process's
    environment sets its own."""
    return {name: os.environ.get(name, PRIMITIVE_CACHE_CAPACITY) for name in PRIMITIVE_CACHES}


def make(args: BackendArgs, detected_by: str) -> Backend:
    if args.precision == "auto":
        fast, evidence = bf16_is_fast()
        dtype, scaler = (torch.bfloat16, False) if fast else (None, False)
        how = f"auto: {'bf16' if fast else 'fp32'} ({evidence})"
    else:
        dtype, scaler = amp_from_precision(args.precision, (None, False))
        how = f"asked for: {args.precision}"
    return Backend(NAME, detected_by, DIST_BACKEND, RAY_RESOURCE, None, dtype, scaler, worker_env(), precision_by=how)
