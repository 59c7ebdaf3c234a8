"""The :class:`Backend` record shared by every device module."""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import resource
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch

from raylora.errors import BadInput


class BackendError(BadInput, RuntimeError):
    """A device asked for cannot be used; the message names the fix."""


# One schedule for torch.profiler and torch_npu.profiler: skip the first step (allocations, lazy init), warm up on
# the second, record three.
PROFILE_SCHEDULE = {"wait": 1, "warmup": 1, "active": 3, "repeat": 1}
PROFILE_STEPS = PROFILE_SCHEDULE["wait"] + PROFILE_SCHEDULE["warmup"] + PROFILE_SCHEDULE["active"]

_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; None under another C library
_PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Backend:
    """What a job needs to know about its device.

    Attributes:
        name: torch device type (``npu``, ``cuda`` or ``cpu``).
        detected_by: how the device was chosen, for ``raylora doctor`` and logs.
        dist_backend: torch.distributed backend (hccl, nccl, gloo).
        ray_resource: Ray resource a worker asks for (``NPU``, ``GPU``, ``CPU``).
        visible_devices_env: variable through which Ray hands devices to a worker, if any.
        amp_dtype: autocast dtype, ``None`` for full fp32.
        needs_grad_scaler: fp16 autocast needs a gradient scaler (and Adam eps ≥ 1e-6).
        env: environment variables every training worker must have (HCCL settings on NPU, bounds of oneDNN's
            primitive caches on CPU).
        precision_by: how the autocast dtype was chosen (``auto`` states its evidence), printed and logged.
        no_bf16_collectives: why the collectives cannot reduce bf16 (an old NCCL, an Ascend SoC without bf16);
            empty where they can, or where the driver plans for a device it cannot see (the worker checks again).
    """

    name: str
    detected_by: str
    dist_backend: str
    ray_resource: str
    visible_devices_env: str | None
    amp_dtype: torch.dtype | None
    needs_grad_scaler: bool
    env: dict[str, str] = field(default_factory=dict)
    precision_by: str = ""
    no_bf16_collectives: str = ""

    @property
    def precision(self) -> str:
        """``bf16``, ``fp16`` or ``fp32``: the autocast dtype by name."""
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.amp_dtype, "fp32")

    def torch_device(self) -> torch.device:
        """This process's device, made current: in a Ray Train worker, the accelerator Ray assigned it, at its index
        among the devices the process sees (``ray.train.torch.get_device``: Ray Train shares a node's CUDA devices
        among its workers, while each NPU worker sees only its own card); index 0 elsewhere (a plain Ray actor, such
        as a Serve replica or a grouped sweep's worker, sees only the device Ray gave it)."""
        if self.name == "cpu":
            return torch.device("cpu")
        device = torch.device(self.name, 0)
        if ray.is_initialized():
            from ray.train.torch import get_device  # Ray Train, 0.9 s: only a Ray process on an accelerator asks

            with contextlib.suppress(RuntimeError):  # outside a Ray Train training function
                assigned = get_device()
                device = assigned if assigned.type == self.name else device
        getattr(torch, self.name).set_device(device)  # torch.cuda / torch.npu: collectives and kernels use it
        return device

    def autocast(self) -> torch.autocast:
        """Autocast to this backend's dtype; a disabled one in fp32."""
        return torch.autocast(self.name, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """The gradient scaler fp16 autocast needs (a disabled one otherwise). On an NPU, torch_npu's own: it also
        clears the chip's overflow flag and agrees on overflow across the ranks."""
        if self.name == "npu" and self.needs_grad_scaler:
            from raylora.backends.npu import grad_scaler  # npu.py imports this module: a top-level import is a cycle

            return grad_scaler()
        return torch.amp.GradScaler(self.name, enabled=self.needs_grad_scaler)

    def ddp_device_ids(self, device: torch.device) -> list[int] | None:
        """``device_ids`` for ``DistributedDataParallel``: the worker's accelerator, none on cpu."""
        return None if self.name == "cpu" else [device.index]

    def collective_problem(self, dtype: torch.dtype) -> str | None:
        """Why this backend's collectives cannot carry ``dtype`` (a communication hook's wire type); ``None`` if they can."""
        return self.no_bf16_collectives or None if dtype is torch.bfloat16 else None

    def describe(self, num_workers: int) -> list[tuple[str, str]]:
        """``raylora doctor``'s rows for this device: ``(item, finding)`` pairs, device settings last."""
        resources = self.scaling(num_workers)
        rows = [
            ("device", f"{self.name} ({self.detected_by})"),
            ("dist backend", self.dist_backend),
            ("ray worker resources", str(resources["resources_per_worker"])),
            ("autocast", str(self.amp_dtype or "off (fp32)") + (" + grad scaler" if self.needs_grad_scaler else "")
                         + f"; {self.precision_by}"),
        ]  # fmt: skip
        if self.name == "npu":  # what HCCL will read: raylora's settings, and the caller's environment beside them
            env = {**{k: v for k, v in os.environ.items() if k.startswith("HCCL_")}, **self.env}
            rows += sorted(env.items())
        return rows

    def scaling(self, num_workers: int, cpus_per_worker: float = 1.0) -> dict[str, Any]:
        """Keyword arguments for ``ray.train.ScalingConfig``: NPUs are a custom resource with use_gpu=False."""
        resources = {"CPU": cpus_per_worker}
        if self.ray_resource != "CPU":
            resources[self.ray_resource] = 1
        return {"num_workers": num_workers, "use_gpu": self.ray_resource == "GPU", "resources_per_worker": resources}

    def actor_options(self, cpus: float) -> dict[str, Any]:
        """Ray actor options for one actor holding a model on this device: a Serve replica, a group's worker."""
        if self.ray_resource == "GPU":
            return {"num_cpus": cpus, "num_gpus": 1}
        if self.ray_resource == "CPU":
            return {"num_cpus": cpus}
        return {"num_cpus": cpus, "resources": {self.ray_resource: 1}}

    def vllm_problem(self) -> str | None:
        """Why Ray Serve LLM's vLLM engine cannot run on this device (``None``: it can)."""
        if self.ray_resource == "CPU":
            return (
                f"serve.engine=vllm needs an accelerator vLLM runs on, but the backend is {self.name}: "
                "set backend.device to a CUDA GPU (vLLM) or an Ascend NPU (vllm-ascend), or use serve.engine=hf"
            )
        return None

    def vllm_placement(self, replicas: int, cpus: float) -> dict[str, Any]:
        """Ray Serve LLM's ``deployment_config`` and engine placement (``LLMConfig`` keys), one device per replica.

        Ray Serve LLM schedules its own engine workers on GPUs, so a GPU goes to the engine's placement bundle.
        It has no kind for other accelerators (Ray 2.60): an NPU goes to the replica actor itself, so Ray sets its
        visible-devices variable there, and the ``cpu`` kind keeps the engine in the replica's processes, where
        vllm-ascend finds that device. The first placement bundle also holds the replica actor (Ray merges them);
        the ``CPU`` bundle is the engine's.
        """
        if self.ray_resource == "GPU":
            return {
                "deployment_config": {"num_replicas": replicas, "ray_actor_options": {"num_cpus": cpus}},
                "placement_group_config": {"bundles": [{"GPU": 1}]},
            }
        return {
            "deployment_config": {
                "num_replicas": replicas,
                "ray_actor_options": {"num_cpus": cpus, "resources": {self.ray_resource: 1}},
            },
            "accelerator_config": {"kind": "cpu"},
            "placement_group_config": {"bundles": [{"CPU": 1}]},
        }

    def vllm_install_hint(self, ray_version: str, vllm_version: str) -> str:
        """How to install the vLLM that ``ray[llm]`` pins (``vllm_version``) for this device."""
        if self.name == "npu":
            return (
                "On Ascend install vLLM through vllm-ascend (its installation guide or container image: vLLM built "
                "with VLLM_TARGET_DEVICE=empty, plus vllm-ascend for your CANN and torch_npu), choosing the release "
                f"for vllm {vllm_version}, the version ray[llm] pins; then install ray[llm]'s other requirements "
                'without letting pip replace that vLLM (a plain `pip install "ray[llm]"` would swap in the CUDA build).'
            )
        return (
            f'Install them with `pip install "ray[llm]=={ray_version}"`, which brings the '
            f"vLLM {vllm_version} this Ray is written against."
        )

    def synchronize(self) -> None:
        """Wait for queued device work, so timings are honest."""
        if self.name != "cpu":
            getattr(torch, self.name).synchronize()

    def compile_backend(self) -> Any:
        """The ``torch.compile`` backend: TorchAir's GE graph backend on NPU, inductor on CUDA and CPU."""
        if self.name == "npu":
            torchair = importlib.import_module("torchair")
            return torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())
        return "inductor"

    def compile_warning(self) -> str | None:
        """What ``train.compile`` risks on this device (``None``: nothing known), for the driver's log and doctor."""
        if self.name == "npu":
            return (
                "train.compile on NPU compiles through TorchAir, which its own guide calls a beta feature aimed at "
                "inference; raylora has not run it on an NPU: keep train.compile=false unless you have measured it"
            )
        return None

    def profiler(self, folder: Path) -> Any:
        """A step profiler with :data:`PROFILE_SCHEDULE` (call ``.step()`` after each training step).

        ``torch_npu.profiler`` on NPU, whose trace handler writes a run folder under ``folder``
        (``<worker>_<timestamp>_ascend_pt/``, with the trace and operator tables in its ``ASCEND_PROFILER_OUTPUT/``); ``torch.profiler`` elsewhere,
        writing ``trace.json`` (Chrome trace) and ``top_operators.txt`` (operators by self time).
        """
        folder.mkdir(parents=True, exist_ok=True)
        if self.name == "npu":
            module = importlib.import_module("torch_npu").profiler
            activities = [module.ProfilerActivity.CPU, module.ProfilerActivity.NPU]
            ready = module.tensorboard_trace_handler(str(folder))
        else:
            module = torch.profiler
            activities = [module.ProfilerActivity.CPU] + ([module.ProfilerActivity.CUDA] if self.name == "cuda" else [])
            sort = "self_cpu_time_total" if self.name == "cpu" else "self_device_time_total"

            def ready(prof) -> None:
                prof.export_chrome_trace(str(folder / "trace.json"))
                table = prof.key_averages().table(sort_by=sort, row_limit=25)
                (folder / "top_operators.txt").write_text(table + "\n")

        return module.profile(
            activities=activities,
            schedule=module.schedule(**PROFILE_SCHEDULE),
            on_trace_ready=ready,
            record_shapes=True,
        )

    def release_freed_memory(self) -> None:
        """On the CPU, hand the heap's free pages back to the system (:func:`trim_heap`), after a training step or a
        serving model's load: freed tensors stay resident otherwise, in holes that the next ones, sized otherwise,
        do not fill (140 MB of a DPO worker's 1.6 GB peak, at the same speed). An accelerator's host heap holds none."""
        if self.name == "cpu":
            trim_heap()

    def peak_memory_mb(self) -> float:
        """Peak device memory allocated by torch (accelerators) or peak resident set size (cpu), in MiB."""
        if self.name == "cpu":
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return getattr(torch, self.name).max_memory_allocated() / 2**20


def trim_heap() -> None:
    """glibc's ``malloc_trim(0)``: free pages of the C heap go back to the system (nothing under another C library)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def precision_note(precision: str, auto: tuple[torch.dtype | None, bool], why: str) -> str:
    """``precision_by`` of a device whose ``auto`` choice follows from ``why`` (a capability it reports)."""
    if precision != "auto":
        return f"asked for: {precision}"
    return f"auto: { ({torch.bfloat16: 'bf16', torch.float16: 'fp16'}.get(auto[0], 'fp32')) } ({why})"


def amp_from_precision(precision: str, auto: tuple[torch.dtype | None, bool]) -> tuple[torch.dtype | None, bool]:
    """``backend.precision`` to (autocast dtype, needs grad scaler); ``auto`` takes the device's choice."""
    if precision == "auto":
        return auto
    dtype = _PRECISIONS[precision]
    return dtype, dtype is torch.float16
