"""Plain CPU: gloo, fp32 unless bf16 autocast is asked for."""

from __future__ import annotations

from raylora.backends.base import Backend, amp_from_precision
from raylora.config import BackendArgs

NAME = "cpu"
DIST_BACKEND = "gloo"
RAY_RESOURCE = "CPU"
INSTALL_HINT = ""


def probe() -> tuple[bool, str]:
    return True, "cpu is always available"


def make(args: BackendArgs, detected_by: str) -> Backend:
    dtype, scaler = amp_from_precision(args.precision, (None, False))
    return Backend(NAME, detected_by, DIST_BACKEND, RAY_RESOURCE, None, dtype, scaler)
