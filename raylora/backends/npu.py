"""Huawei Ascend NPUs through torch_npu: HCCL, bf16 on Atlas A2/A3, fp16 + scaler on 910A and 310P.

raylora imports torch_npu only inside :func:`probe` (installed without CANN it breaks ``import torch``, which also
loads it through torch's device-backend autoload from torch_npu 2.5 on, unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
from pathlib import Path

import torch

from raylora.backends.base import Backend, BackendError, amp_from_precision, precision_note
from raylora.config import BackendArgs, HcclArgs

NAME = "npu"
DIST_BACKEND = "hccl"
RAY_RESOURCE = "NPU"
INSTALL_HINT = (
    "Install Ascend CANN (toolkit and kernels) for your driver, run "
    "`source /usr/local/Ascend/ascend-toolkit/set_env.sh`, then `pip install 'raylora[npu]'` "
    "(torch_npu built for your torch version); or use backend.device=auto or cpu."
)
CANN_DEFAULT = Path("/usr/local/Ascend/ascend-toolkit/latest")

# SoC names as torch_npu.npu.get_device_name() reports them. Atlas A2 (Ascend910B*), A3 (Ascend910_93*) and
# later have bf16 matrix units; 910A-class training chips and the 310P inference chip do not.
_BF16_PREFIXES = ("Ascend910B", "Ascend910_93", "Ascend910_95", "Ascend950")


def probe() -> tuple[bool, str]:
    """Whether torch_npu imports and sees a device; never raises."""
    if importlib.util.find_spec("torch_npu") is None:
        return False, "torch_npu is not installed"
    try:
        importlib.import_module("torch_npu")
    except Exception as e:  # a torch_npu without CANN fails in many ways; report, do not crash
        return (
            False,
            f"torch_npu is installed but does not import ({type(e).__name__}: {e}); is CANN's set_env.sh sourced?",
        )
    if not torch.npu.is_available():
        return False, "torch_npu imports but sees no NPU (check npu-smi info and ASCEND_RT_VISIBLE_DEVICES)"
    return True, f"torch_npu with {torch.npu.device_count()} NPU(s), {soc_name()}"


def amp_for_soc(soc: str) -> tuple[torch.dtype, bool]:
    """Autocast dtype and grad-scaler need for an Ascend SoC name such as ``Ascend910B2``."""
    if soc.startswith(_BF16_PREFIXES):
        return torch.bfloat16, False
    return torch.float16, True


def hccl_env(args: BackendArgs) -> dict[str, str]:
    """HCCL variables for every worker, built only from documented HCCL settings.

    HCCL_ALGO is deliberately never set: setting it turns off HCCL's automatic algorithm choice. What the config
    sets wins; the optional variables are sent only when set there, so a node's own (a per-host ``HCCL_IF_IP``)
    stays in effect; ``HCCL_CONNECT_TIMEOUT`` left at raylora's default takes this environment's value if it has one.
    """
    hccl = args.hccl
    timeout = str(hccl.connect_timeout)
    if hccl.connect_timeout == HcclArgs().connect_timeout:
        timeout = os.environ.get("HCCL_CONNECT_TIMEOUT", timeout)
    env = {"HCCL_CONNECT_TIMEOUT": timeout}
    optional = {
        "HCCL_EXEC_TIMEOUT": hccl.exec_timeout,
        "HCCL_BUFFSIZE": hccl.buffsize,
        "HCCL_IF_IP": hccl.if_ip,
        "HCCL_SOCKET_IFNAME": hccl.socket_ifname,
    }
    env.update({k: str(v) for k, v in optional.items() if v is not None})
    return env


def grad_scaler() -> torch.amp.GradScaler:
    """torch_npu's fp16 gradient scaler (a subclass of torch's; its state_dict is the same)."""
    from torch_npu.npu.amp import GradScaler  # only once probe() found torch_npu importable

    return GradScaler(enabled=True)


def soc_name() -> str:
    """Device 0's SoC name, e.g. ``Ascend910B2``."""
    return torch.npu.get_device_name(0)


def install_rows() -> list[tuple[str, str]]:
    """``raylora doctor``'s rows on the Ascend software found here, whether or not an NPU is in use."""
    try:
        version = importlib.metadata.version("torch_npu")
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    return [("torch_npu", version), ("CANN", cann_home() or "not found")]


def cann_home() -> str | None:
    """The CANN toolkit folder in effect, if any."""
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        if os.environ.get(var):
            return os.environ[var]
    return str(CANN_DEFAULT) if CANN_DEFAULT.exists() else None


def make(args: BackendArgs, detected_by: str) -> Backend:
    """The NPU backend for device 0's SoC."""
    soc = soc_name()
    auto = amp_for_soc(soc)
    if args.precision == "bf16" and auto[0] is not torch.bfloat16:
        raise BackendError(f"{soc} has no bf16 support; use backend.precision=fp16 (with a grad scaler) or auto")
    dtype, scaler = amp_from_precision(args.precision, auto)
    how = precision_note(args.precision, auto, f"{soc} {'has' if auto[0] is torch.bfloat16 else 'has no'} bf16 units")
    no_bf16 = "" if auto[0] is torch.bfloat16 else f"HCCL reduces bf16 only on Atlas A2 and later, and this is {soc}"
    return Backend(
        NAME, detected_by, DIST_BACKEND, RAY_RESOURCE, "ASCEND_RT_VISIBLE_DEVICES", dtype, scaler, hccl_env(args), how,
        no_bf16,
    )  # fmt: skip
