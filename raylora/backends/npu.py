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

from raylora.backends.ascend_env import RELEASES, cann_home, cann_version, connect_timeout_problem, release
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

# SoC names as torch_npu.npu.get_device_name() reports them. Atlas A2 (Ascend910B1-B4), A3 (Ascend910_93*) and later
# have bf16 matrix units and take HCCL_EXEC_TIMEOUT 0 (never) up to 2147483647 s; the 910A class (Ascend910A,
# Ascend910ProA, Ascend910PremiumA, Ascend910ProB and the older SoC named exactly Ascend910B, which torch_npu's
# NpuVariables.cpp lists with them) and the 310P do not, and take 1-17340 s.
_A2_PREFIXES = ("Ascend910B", "Ascend910_93", "Ascend910_95", "Ascend950")
_OLD_910B = "Ascend910B"
EXEC_TIMEOUT_BEFORE_A2 = (1, 17340)


def probe() -> tuple[bool, str]:
    """Whether torch_npu imports and sees a device; never raises."""
    if importlib.util.find_spec("torch_npu") is None:
        return False, "torch_npu is not installed"
    try:
        importlib.import_module("torch_npu")
    except Exception as e:  # a torch_npu without CANN fails in many ways; report, do not crash
        return False, f"torch_npu is installed but does not import ({type(e).__name__}: {e}); {_cann_hint()}"
    if not torch.npu.is_available():
        return False, "torch_npu imports but sees no NPU (check npu-smi info and ASCEND_RT_VISIBLE_DEVICES)"
    return True, f"torch_npu with {torch.npu.device_count()} NPU(s), {soc_name()}"


def _cann_hint() -> str:
    """What a torch_npu that does not import most likely lacks: CANN, the one it was released with."""
    try:
        version = importlib.metadata.version("torch_npu")
    except importlib.metadata.PackageNotFoundError:
        return INSTALL_HINT
    wanted = f"CANN {RELEASES[version][1]}" if version in RELEASES else "the CANN it was released with"
    home = cann_home(os.environ)
    if home is None:
        return f"no CANN toolkit was found: torch_npu {version} needs {wanted} (docs/ascend.md#versions)"
    return f"CANN is at {home}: is it {wanted}, and was its set_env.sh sourced?"


def a2_or_later(soc: str) -> bool:
    """Whether an Ascend SoC name such as ``Ascend910B2`` is Atlas A2 or later (see :data:`_A2_PREFIXES`)."""
    return soc.startswith(_A2_PREFIXES) and soc != _OLD_910B


def bf16_support(soc: str) -> tuple[bool, str]:
    """Whether device 0 runs bf16, and the test that said so: ``torch.npu.is_bf16_supported()`` where torch_npu has
    it, else the SoC name (:func:`a2_or_later`)."""
    if hasattr(torch.npu, "is_bf16_supported"):
        bf16 = bool(torch.npu.is_bf16_supported())
        return bf16, f"torch.npu.is_bf16_supported() is {bf16} on {soc}"
    bf16 = a2_or_later(soc)
    return bf16, f"{soc} {'is' if bf16 else 'is not'} Atlas A2 or later, by its name"


def hccl_env(args: BackendArgs) -> dict[str, str]:
    """HCCL variables for every worker, built only from documented HCCL settings.

    HCCL_ALGO is deliberately never set: setting it turns off HCCL's automatic algorithm choice. What the config
    sets wins; the optional variables are sent only when set there, so a node's own (a per-host ``HCCL_IF_IP``)
    stays in effect; ``HCCL_CONNECT_TIMEOUT`` left at raylora's default takes this environment's value if it has one.
    """
    hccl = args.hccl
    timeout = str(hccl.connect_timeout)
    if hccl.connect_timeout == HcclArgs().connect_timeout and "HCCL_CONNECT_TIMEOUT" in os.environ:
        timeout = os.environ["HCCL_CONNECT_TIMEOUT"]
        if why := connect_timeout_problem(timeout):
            raise BackendError(
                f"{why} (this environment's, which raylora sends its workers while backend.hccl.connect_timeout is "
                "left at its default): export a valid one, or unset it"
            )
    env = {"HCCL_CONNECT_TIMEOUT": timeout}
    optional = {
        "HCCL_EXEC_TIMEOUT": hccl.exec_timeout,
        "HCCL_BUFFSIZE": hccl.buffsize,
        "HCCL_IF_IP": hccl.if_ip,
        "HCCL_SOCKET_IFNAME": hccl.socket_ifname,
    }
    env.update({k: str(v) for k, v in optional.items() if v is not None})
    return env


def connect_timeout_s(env: dict[str, str]) -> int:
    """``HCCL_CONNECT_TIMEOUT`` in ``env`` (0 when unset), in seconds.

    Raises:
        BackendError: it is not a whole number of seconds CANN accepts.
    """
    if "HCCL_CONNECT_TIMEOUT" not in env:
        return 0
    if why := connect_timeout_problem(env["HCCL_CONNECT_TIMEOUT"]):
        raise BackendError(f"{why}: set a valid one, or unset it")
    return int(env["HCCL_CONNECT_TIMEOUT"])


def ensure_loaded() -> None:
    """Import torch_npu, which registers the ``hccl`` backend with torch.distributed (torch's device-backend
    autoload does it only unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``).

    Raises:
        BackendError: torch_npu does not import, with what it most likely lacks.
    """
    try:
        importlib.import_module("torch_npu")
    except Exception as e:  # as in probe(): say what is most likely missing
        raise BackendError(
            f"HCCL needs torch_npu, which does not import ({type(e).__name__}: {e}); {_cann_hint()}"
        ) from e


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
    else:
        needed = RELEASES.get(version, (release(version),))[0]
        if release(torch.__version__) != needed:
            version += f" (built for torch {needed}, this is torch {torch.__version__}: docs/ascend.md#versions)"
    home = cann_home(os.environ)
    cann = cann_version(Path(home)) if home else None
    return [("torch_npu", version), ("CANN", f"{cann or 'version file not found'} ({home})" if home else "not found")]


def make(args: BackendArgs, detected_by: str) -> Backend:
    """The NPU backend for device 0's SoC.

    Raises:
        BackendError: bf16 asked for where the SoC has none; ``backend.hccl.exec_timeout`` outside what the SoC takes.
    """
    soc = soc_name()
    bf16, why = bf16_support(soc)
    auto = (torch.bfloat16, False) if bf16 else (torch.float16, True)
    if args.precision == "bf16" and not bf16:
        raise BackendError(
            f"{soc} has no bf16 support ({why}); use backend.precision=fp16 (with a grad scaler) or auto"
        )
    low, high = EXEC_TIMEOUT_BEFORE_A2
    exec_timeout = args.hccl.exec_timeout
    if exec_timeout is not None and not a2_or_later(soc) and not low <= exec_timeout <= high:
        raise BackendError(
            f"backend.hccl.exec_timeout={exec_timeout}: on {soc} (before Atlas A2) CANN takes HCCL_EXEC_TIMEOUT from "
            f"{low} to {high} s (0, 'never', is for Atlas A2 and later); set one in that range, or leave it unset"
        )
    dtype, scaler = amp_from_precision(args.precision, auto)
    how = precision_note(args.precision, auto, why)
    no_bf16 = "" if a2_or_later(soc) else f"HCCL reduces bf16 only on Atlas A2 and later, and this is {soc}"
    return Backend(
        NAME, detected_by, DIST_BACKEND, RAY_RESOURCE, "ASCEND_RT_VISIBLE_DEVICES", dtype, scaler, hccl_env(args), how,
        no_bf16,
    )  # fmt: skip
