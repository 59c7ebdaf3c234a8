"""Whether a LoRA adapter fits the served base model, read from its config and tensor shapes only."""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch
from peft.utils.other import get_pattern_key
from safetensors import SafetensorError, safe_open

from raylora.registry import AdapterError
from raylora.serve.adapters import adapter_files, lora_config

# peft's saved keys: "base_model.model.<module>.<part>", <module> named as in the base model.
_LORA_KEY = re.compile(
    r"(?P<module>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_B\.bias|lora_magnitude_vector"
    r"|lora_embedding_A|lora_embedding_B)"
)


def check_compatible(adapter_dir: Path, model: torch.nn.Module, max_rank: int) -> dict[str, Any]:
    """Check, from the adapter's config and tensor shapes only, that it can be applied to ``model``.

    No weight is read into memory: safetensors headers (or a memory-mapped ``.bin``) give the shapes.
    Expected shapes, for a module with ``in_features`` / ``out_features`` (``num_embeddings`` /
    ``embedding_dim`` for embeddings) and the module's rank ``r`` (``r`` or its ``rank_pattern`` entry):
    ``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``, ``lora_B.bias`` and DoRA's magnitude ``[out]``;
    other saved tensors (``modules_to_save``) must match the base model's tensor of the same name.

    Args:
        adapter_dir: a peft adapter folder.
        model: the served base model (a ``PeftModel`` wrapping it is accepted too). Quantised linear
            layers are fine: their ``in_features`` / ``out_features`` are used, never ``weight.shape``.
        max_rank: the largest rank served (``serve.max_lora_rank``).
    Returns:
        The adapter's ``adapter_config.json`` as a dict.
    Raises:
        AdapterError: 422 ``adapter_incompatible`` when the adapter is not LoRA, its rank exceeds
            ``max_rank``, or a tensor names a module the model lacks or has the wrong shape.
    """
    config = lora_config(adapter_dir)
    _check_rank(adapter_dir, config, max_rank)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    modules = dict(base.named_modules())
    shapes = _tensor_shapes(adapter_files(adapter_dir)[1])
    problems = [p for key, shape in shapes.items() if (p := _tensor_problem(key, shape, modules, config))]
    if not shapes or problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        found = problems[0] + more if problems else "no tensors at all"
        raise AdapterError(
            422,
            "adapter_incompatible",
            f"adapter {adapter_dir.name!r} does not fit the served model {type(base).__name__}: {found}. It was "
            f"trained on base model {config.get('base_model_name_or_path') or '(not recorded)'}; serve it with "
            "that base model, or retrain it on this one.",
        )
    return config


def _check_rank(adapter_dir: Path, config: dict[str, Any], max_rank: int) -> None:
    """Refuse an adapter whose largest rank (``r`` or any ``rank_pattern`` entry) exceeds ``max_rank``."""
    rank = max([config["r"], *(config.get("rank_pattern") or {}).values()])
    if rank > max_rank:
        raise AdapterError(
            422,
            "adapter_incompatible",
            f"adapter {adapter_dir.name!r} has LoRA rank r={rank}, above this server's max_rank={max_rank}. "
            f"Raise serve.max_lora_rank to at least {rank}, or retrain with lora.rank <= {max_rank}.",
        )


def _tensor_shapes(weights: Path) -> dict[str, list[int]]:
    """``{tensor name: shape}`` of an adapter weights file, without reading the tensors' data.

    Raises:
        AdapterError: 422 ``adapter_unreadable`` for a file that is not whole (safetensors checks that its header
            and the tensors it lists fit the file) or not a tensor file at all.
    """
    try:
        if weights.suffix == ".safetensors":
            with safe_open(str(weights), framework="pt") as f:
                return {key: list(f.get_slice(key).get_shape()) for key in f.keys()}
        # mmap leaves the data on disk; weights_only refuses pickled code in an uploaded file.
        state = torch.load(weights, map_location="cpu", mmap=True, weights_only=True)
        return {key: list(tensor.shape) for key, tensor in state.items()}
    except (SafetensorError, pickle.UnpicklingError, EOFError, RuntimeError, ValueError, AttributeError) as e:
        raise AdapterError(
            422, "adapter_unreadable", f"adapter {weights.parent.name!r}: {weights.name} is damaged or not an "
            f"adapter weights file ({type(e).__name__}: {e}); save or copy the adapter again",
        ) from None  # fmt: skip


def _tensor_problem(
    key: str, shape: list[int], modules: dict[str, torch.nn.Module], config: dict[str, Any]
) -> str | None:
    """What is wrong with one saved tensor against the base model's modules, or ``None`` when it fits."""
    name = key.removeprefix("base_model.model.")
    lora = _LORA_KEY.fullmatch(name)
    if lora is None:  # modules_to_save copies, saved under the base model's own tensor names
        owner, _, attr = name.rpartition(".")
        owner = owner.removesuffix(".base_layer")
        expected = getattr(modules[owner], attr, None) if owner in modules else None
        if not isinstance(expected, torch.Tensor):
            return f"tensor {key} has no counterpart {owner}.{attr} in the base model"
        return None if list(expected.shape) == shape else f"{name}: expected {list(expected.shape)}, found {shape}"
    module = modules.get(lora["module"])
    dims = _dims(module) if module is not None else None
    if dims is None:
        return f"module {lora['module']} is not a linear or embedding layer of the base model"
    pattern = config.get("rank_pattern") or {}
    rank = pattern.get(get_pattern_key(pattern.keys(), lora["module"]), config["r"])
    expected = _expected_shape(lora["part"], dims, rank)
    return None if expected == shape else f"{lora['module']}.{lora['part']}: expected {expected}, found {shape}"


def _dims(module: torch.nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` sizes of a linear (quantised or peft-wrapped too) or embedding layer, else ``None``."""
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return module.in_features, module.out_features
    if isinstance(module, torch.nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    return None


def _expected_shape(part: str, dims: tuple[int, int], rank: int) -> list[int]:
    """The shape peft gives LoRA tensor ``part`` on a layer of ``dims = (in, out)`` at ``rank``."""
    n_in, n_out = dims
    return {
        "lora_A.weight": [rank, n_in],
        "lora_embedding_A": [rank, n_in],
        "lora_B.weight": [n_out, rank],
        "lora_embedding_B": [n_out, rank],
        "lora_B.bias": [n_out],
        "lora_magnitude_vector": [n_out],
    }[part]
