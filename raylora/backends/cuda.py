"""CUDA GPUs: NCCL, bf16 autocast where supported, else fp16 with a scaler."""

from __future__ import annotations

import torch

from raylora.backends.base import Backend, amp_from_precision, precision_note
from raylora.config import BackendArgs

NAME = "cuda"
DIST_BACKEND = "nccl"
RAY_RESOURCE = "GPU"
INSTALL_HINT = "Install a CUDA build of torch (make install TORCH_SPEC='torch --index-url <your CUDA wheel index>') or use backend.device=cpu."


def probe() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} sees no CUDA device"
    return True, f"torch.cuda.is_available() with {torch.cuda.device_count()} device(s)"


def make(args: BackendArgs, detected_by: str) -> Backend:
    bf16 = torch.cuda.is_bf16_supported(including_emulation=False)  # emulated bf16 (before sm80) is slow
    auto = (torch.bfloat16, False) if bf16 else (torch.float16, True)
    dtype, scaler = amp_from_precision(args.precision, auto)
    how = precision_note(args.precision, auto, f"torch.cuda.is_bf16_supported(including_emulation=False) is {bf16}")
    nccl = torch.cuda.nccl.version()
    no_bf16 = f"NCCL {'.'.join(map(str, nccl))} reduces no bf16 (2.10 and later do)" if nccl < (2, 10) else ""
    return Backend(
        NAME, detected_by, DIST_BACKEND, RAY_RESOURCE, "CUDA_VISIBLE_DEVICES", dtype, scaler,
        precision_by=how, no_bf16_collectives=no_bf16,
    )  # fmt: skip
