"""``serve.engine: vllm``: the OpenAI-compatible app of Ray Serve LLM (``ray.serve.llm``) on vLLM with LoRA.

On CUDA this is vLLM; on Ascend it is vLLM with the vllm-ascend platform plugin. raylora's own
transformers + peft engine (``serve.engine: hf``) stays the portable default. Everything here is
written against Ray 2.60's ``ray.serve.llm`` and checked against its source:

* ``build_openai_app({"llm_configs": [LLMConfig(...)]})`` builds the app; clients call the base model
  as ``model=<base>`` and an adapter as ``model=<base>:<adapter>`` (Ray splits model ids on ``:``).
* Ray's own LoRA loader fetches ``<dynamic_lora_loading_path>/<adapter>`` from cloud storage only
  (``s3://``, ``gs://``, ``abfss://``, ``azure://``; ``LoraConfig`` rejects local paths). A remote
  ``serve.adapter_root`` is handed to it; a local one is served by :class:`LocalAdapterLoader`,
  injected through ``LLMConfig.server_cls`` and ``LLMServer``'s ``model_downloader`` argument. A
  local root must be at the same path on every node that hosts a replica (as the model folder must).
* Ray Serve LLM knows GPU, TPU and CPU kinds only. A device Ray exposes as a custom resource (Ascend's
  ``NPU``) is reserved for the replica actor itself, so Ray sets its visible-devices variable there,
  and the ``cpu`` kind makes Ray run the vLLM engine inside the replica (``mp`` executor), where the
  vllm-ascend plugin finds that device. One device per replica: no tensor parallelism.
* The OpenAI app checks no API key, so this path refuses to start while one is configured.
* vLLM quantises no model to int8 W8A8 while loading it; it serves checkpoints quantised beforehand
  (llm-compressor's compressed-tensors, msModelSlim's W8A8 on vllm-ascend), so ``serve.quantization`` must be none.

``serve.batch_wait_ms`` has no counterpart (vLLM batches continuously); ``serve.max_tokens`` becomes vLLM's
``max_new_tokens`` generation default, which vLLM also applies as the most a request may ask for.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any

from fastapi import HTTPException
from ray.llm._internal.common.models import global_id_manager
from ray.llm._internal.common.utils.lora_utils import get_lora_id
from ray.llm._internal.serve.core.configs.llm_config import DiskMultiplexConfig

from raylora.backends import Backend, BackendError
from raylora.config import HF_ENGINE_KEYS, JobConfig, ServeArgs
from raylora.model_files import INT8_MANIFEST, TINY, ModelError, model_folder
from raylora.registry import AdapterError
from raylora.serve.adapters import local_adapter
from raylora.serve.ingress import resolve_keys, served_name

# The schemes Ray 2.60's LoraConfig accepts for dynamic_lora_loading_path (ray.llm cloud_utils.is_remote_path).
REMOTE_SCHEMES = ("s3://", "gs://", "abfss://", "azure://")
# vLLM's LoRAConfig.max_lora_rank must be one of these (vllm/config/lora.py, MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def check_vllm_config(cfg: JobConfig, backend: Backend) -> list[str]:
    """Every reason ``cfg`` cannot be served by vLLM through Ray Serve LLM, found without touching the cluster.

    The base model is located (a GGUF file or registry model is converted into the cache once, as for
    ``engine: hf``); whether vLLM itself is installed is checked by :func:`build_vllm_app`.

    Args:
        cfg: the job; its ``serve``, ``model``, ``lora`` and ``data`` sections are read.
        backend: the device the replicas run on (:func:`raylora.backends.planned_backend`).
    Returns:
        One line per problem, each naming the setting, what is expected and the fix; empty when servable.
    """
    problems = [backend.vllm_problem()] if backend.vllm_problem() else []
    serve = cfg.serve
    if serve.quantization != "none":
        problems.append(
            f"serve.quantization={serve.quantization}: vLLM quantises no model to int8 W8A8 while loading it; it "
            "serves checkpoints quantised beforehand (llm-compressor's compressed-tensors, found by vLLM in "
            "config.json; on vllm-ascend also msModelSlim's W8A8, which vllm-ascend releases document with "
            "quantization='ascend', not passed by raylora). Set serve.quantization=none and point "
            "model.name_or_path at a compressed-tensors checkpoint, or use serve.engine=hf for raylora's own W8A8"
        )
    if serve.adapter_bits != 16:
        problems.append(
            f"serve.adapter_bits={serve.adapter_bits}: vLLM holds LoRA weights in the model's dtype only; "
            "set serve.adapter_bits=16, or use serve.engine=hf for 4-bit adapters"
        )
    if serve.max_lora_rank not in VLLM_LORA_RANKS:
        above = [r for r in VLLM_LORA_RANKS if r >= serve.max_lora_rank]
        fix = f"set serve.max_lora_rank={above[0]}" if above else "retrain with lora.rank ≤ 512"
        problems.append(
            f"serve.max_lora_rank={serve.max_lora_rank}: vLLM accepts only "
            f"{', '.join(map(str, VLLM_LORA_RANKS))}; {fix} (the smallest allowed value your adapters fit under)"
        )
    defaults = ServeArgs()
    for key in HF_ENGINE_KEYS:
        value = getattr(serve, key)
        if value != getattr(defaults, key):
            problems.append(
                f"serve.{key}={value}: only serve.engine=hf reads it, so vLLM would silently ignore it; unset it, "
                "or use serve.engine=hf"
            )
    if cfg.lora.use_dora:
        problems.append(
            "lora.use_dora=true: vLLM refuses DoRA adapters ('vLLM does not yet support DoRA'); "
            "serve them with serve.engine=hf, or train plain LoRA (lora.use_dora=false)"
        )
    api_key, admin_key = resolve_keys(cfg)
    if api_key:
        problems.append(
            "serve.api_key (or RAYLORA_API_KEY) is set, but Ray Serve LLM's OpenAI app checks no API key, so it would "
            "serve everyone: unset both and put an authenticating proxy in front, or use serve.engine=hf, which "
            "enforces the key"
        )
    if admin_key:
        problems.append(
            "serve.admin_key (or RAYLORA_ADMIN_KEY) is set, but Ray Serve LLM has no POST /v1/adapters: unset both "
            "and add adapters by placing their folders under serve.adapter_root, or use serve.engine=hf"
        )
    problems += _adapter_root_problems(serve.adapter_root)
    problems += _model_problems(cfg)
    return problems


def vllm_llm_config(cfg: JobConfig, backend: Backend) -> dict[str, Any]:
    """Keyword arguments of Ray Serve LLM's ``LLMConfig`` for ``cfg``, as a plain dict.

    Args:
        cfg: the job.
        backend: a CUDA or NPU backend (see :func:`check_vllm_config`).
    Returns:
        ``model_loading_config`` (id :func:`~raylora.serve.ingress.served_name`, source the absolute local
        Hugging Face folder of the base model), ``engine_kwargs`` (dtype, context length, batch size,
        LoRA slots and rank, default generation length), ``lora_config``, ``deployment_config``
        (``serve.replicas``, the replica's resources) and the placement of the engine. With a local
        ``serve.adapter_root`` the dict has no ``dynamic_lora_loading_path``: :func:`build_vllm_app`
        adds the loader that reads that folder.
    Raises:
        ValueError: listing every problem :func:`check_vllm_config` finds.
        ModelError: the base model cannot be converted into a Hugging Face folder.
    """
    problems = check_vllm_config(cfg, backend)
    if problems:
        raise ValueError("serve.engine=vllm cannot serve this job:\n  - " + "\n  - ".join(problems))
    serve = cfg.serve
    folder = model_folder(cfg.model).resolve()
    lora: dict[str, Any] = {"max_num_adapters_per_replica": serve.max_adapters}
    if _is_remote(serve.adapter_root):
        lora["dynamic_lora_loading_path"] = serve.adapter_root
    return {
        "model_loading_config": {"model_id": served_name(cfg), "model_source": str(folder)},
        "engine_kwargs": {
            "dtype": cfg.model.dtype,
            "max_model_len": _max_model_len(cfg, folder),
            "max_num_seqs": serve.max_batch_size,
            "enable_lora": True,
            "max_lora_rank": serve.max_lora_rank,
            # every adapter a replica keeps loaded may share one batch
            "max_loras": serve.max_adapters,
            "override_generation_config": {"max_new_tokens": serve.max_tokens},
        },
        "lora_config": lora,
        **backend.vllm_placement(serve.replicas, serve.cpus_per_replica),
    }


def build_vllm_app(cfg: JobConfig, backend: Backend):
    """The Ray Serve application of ``cfg`` on vLLM: Ray Serve LLM's OpenAI ingress and one LLM deployment.

    Call it on the driver after ``ray.init`` (Ray Serve LLM reads the job's runtime environment), then
    ``serve.run`` the result. Requests name ``<base>`` or ``<base>:<adapter>`` as their model.

    Args:
        cfg: the job.
        backend: a CUDA or NPU backend.
    Returns:
        The ``ray.serve.Application`` from ``ray.serve.llm.build_openai_app``.
    Raises:
        BackendError: vLLM or ``ray.serve.llm`` does not import here, with the install command for the device.
        ValueError: listing every problem :func:`check_vllm_config` finds.
        ModelError: the base model cannot be converted into a Hugging Face folder.
    """
    serve_llm = _import_serve_llm(backend)
    llm_config = vllm_llm_config(cfg, backend)
    if not _is_remote(cfg.serve.adapter_root):
        llm_config["server_cls"] = _local_adapter_server(str(Path(cfg.serve.adapter_root).resolve()))
    return serve_llm.build_openai_app({"llm_configs": [serve_llm.LLMConfig(**llm_config)]})


class LocalAdapterLoader:
    """Ray Serve LLM's LoRA loader for adapters in a local folder; runs in each replica.

    It stands in for Ray's ``LoraModelLoader`` (which only downloads from cloud storage): Ray builds it
    with ``(download_timeout_s=..., max_tries=...)`` and calls :meth:`load_model_from_config` when a
    request names an adapter the replica has not loaded; Ray Serve's multiplexing keeps the
    ``serve.max_adapters`` most recently used.

    Args:
        root: the absolute adapter folder, one sub-folder per adapter (a peft ``save_pretrained`` output).
        download_timeout_s: Ray's download timeout, unused: nothing is downloaded.
        max_tries: Ray's download retries, unused.
    """

    def __init__(self, root: str, download_timeout_s: float | None = None, max_tries: int = 1):
        self.root = Path(root)

    async def load_model_from_config(self, lora_model_id: str, llm_config: Any = None):
        """Find adapter ``<adapter>`` of ``lora_model_id`` (``<base>:<adapter>``) under the root.

        Returns:
            Ray's ``DiskMultiplexConfig`` naming the adapter folder, which vLLM then loads.
        Raises:
            fastapi.HTTPException: 400 for a name that is not a safe folder name, 404 when the folder or
                its files are missing; Ray's own loader raises the same, and Ray Serve LLM answers with its status.
        """
        try:
            folder = local_adapter(self.root, get_lora_id(lora_model_id))
        except AdapterError as e:
            raise HTTPException(status_code=e.status, detail=str(e)) from None
        return DiskMultiplexConfig(
            model_id=lora_model_id,
            max_total_tokens=None,
            local_path=str(folder),
            lora_assigned_int_id=global_id_manager.next(),
        )


def _local_adapter_server(root: str) -> type:
    """Ray Serve LLM's ``LLMServer`` loading adapters from ``root`` through :class:`LocalAdapterLoader`.

    Built on demand because ``LLMServer`` imports vLLM; Ray Serve ships the class to the replicas by value.
    """
    from ray.serve.llm.deployment import LLMServer  # imports vLLM, an optional dependency: only here, on demand

    loader = functools.partial(LocalAdapterLoader, root)

    class RayloraLLMServer(LLMServer):
        async def __init__(self, llm_config, *, engine_cls=None):
            await super().__init__(llm_config, engine_cls=engine_cls, model_downloader=loader)

    return RayloraLLMServer


def _import_serve_llm(backend: Backend):
    """``ray.serve.llm``, after checking that vLLM imports (``ray.serve.llm`` needs it on the driver too)."""
    try:
        importlib.import_module("vllm")
        return importlib.import_module("ray.serve.llm")
    except ImportError as e:
        fix = backend.vllm_install_hint(importlib.metadata.version("ray"), _pinned_vllm())
        raise BackendError(
            f"serve.engine=vllm needs vLLM and ray.serve.llm on the driver and on every node hosting a replica, but "
            f"they do not import here ({e}). {fix} Or use serve.engine=hf."
        ) from None


def _pinned_vllm() -> str:
    """The vLLM version ``ray[llm]`` requires, read from Ray's package metadata."""
    for req in importlib.metadata.requires("ray") or []:
        if req.startswith("vllm") and 'extra == "llm"' in req and "==" in req:
            return req.split("==", 1)[1].split(";", 1)[0].strip()
    return "that ray[llm] requires"


def _max_model_len(cfg: JobConfig, folder: Path) -> int:
    """Context per sequence: the longest training example plus a default answer, within the model's positions."""
    wanted = cfg.data.cutoff_len + cfg.serve.max_tokens
    limit = json.loads((folder / "config.json").read_text()).get("max_position_embeddings")
    return min(wanted, limit) if isinstance(limit, int) else wanted


def _adapter_root_problems(root: str) -> list[str]:
    if _is_remote(root):
        return []
    if "://" in root:
        return [
            f"serve.adapter_root={root}: Ray Serve LLM loads adapters from {', '.join(REMOTE_SCHEMES)} or, through "
            "raylora, from a local folder; copy the adapters to one of those and point serve.adapter_root there"
        ]
    if Path(root).exists() and not Path(root).is_dir():
        return [f"serve.adapter_root={root} is a file; it must be a folder of adapters"]
    return []


def _model_problems(cfg: JobConfig) -> list[str]:
    name = cfg.model.name_or_path
    if name in TINY:
        return [
            f"model.name_or_path={name} is a tiny random model built in memory; vLLM loads checkpoints only: "
            "name a Hugging Face folder, a .gguf file or smollm2-135m-instruct, or use serve.engine=hf"
        ]
    problems = []
    if ":" in served_name(cfg):
        problems.append(
            f"model.name_or_path={name}: the served model id {served_name(cfg)!r} has a ':', which Ray Serve LLM "
            "reads as '<base>:<adapter>'; rename the folder or file without ':'"
        )
    try:
        folder = model_folder(cfg.model)
    except ModelError as e:
        return [*problems, str(e)]
    if (folder / INT8_MANIFEST).is_file():
        problems.append(
            f"model.name_or_path={name} is raylora's int8 export, which only serve.engine=hf reads; give vLLM the "
            "unquantised folder (export.quantization=none) or one of its own pre-quantised checkpoints"
        )
    return problems


def _is_remote(root: str) -> bool:
    return root.startswith(REMOTE_SCHEMES)
