"""Base models (HF folder, GGUF file, registry name, tiny random models) and LoRA through peft.

Where model files come from (registry, GGUF cache, tokenizers) is ``raylora.model_files``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_model as load_safetensors
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
)

from raylora.config import LoraArgs, ModelArgs
from raylora.model_files import (
    INT8_MANIFEST,
    TINY,
    ModelError,
    base_id,
    load_tokenizer,
    model_folder,
    tiny_tokenizer,
)
from raylora.ops.int8 import quantize_model

LORA_PRESETS = {
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mlp": ["gate_proj", "up_proj", "down_proj"],
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The int8 folder's weights are not named model.safetensors, so transformers refuses the folder instead of reading
# int8 codes as float weights; its config.json names a quantisation method vLLM refuses (and transformers warns of).
INT8_WEIGHTS = "raylora_int8.safetensors"
INT8_QUANTIZATION = {"quant_method": "raylora-int8", "load_with": "raylora.models.load_model"}


def load_model(args: ModelArgs) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the base model and its tokenizer named by ``args.name_or_path``.

    Args:
        args: a registry name (:data:`REGISTRY`), a Hugging Face model folder, or a ``.gguf`` file.
    Returns:
        ``(model, tokenizer)``; the model is in eval mode on the cpu in ``args.dtype``, and the
        tokenizer always has a pad token.
    Raises:
        ModelError: missing path, unsupported GGUF architecture, incomplete cache.
    """
    if args.name_or_path in TINY:
        model = tiny_model(TINY[args.name_or_path]).to(_DTYPES[args.dtype])
    elif (model_folder(args) / INT8_MANIFEST).is_file():
        model = load_int8_folder(model_folder(args), _DTYPES[args.dtype])
    else:
        model = AutoModelForCausalLM.from_pretrained(model_folder(args), dtype=_DTYPES[args.dtype]).to(
            _DTYPES[args.dtype]
        )
    model.name_or_path = model.config._name_or_path = base_id(args)  # what peft records as an adapter's base
    return model.eval(), load_tokenizer(args)


def own_weights(model: torch.nn.Module, skip: frozenset[int] = frozenset()) -> None:
    """Copy every parameter and buffer of ``model`` (but those whose ``id`` is in ``skip``) out of the checkpoint file's
    memory map, in place, so that the mapping closes.

    Weights loaded from safetensors lie in the file's mapping; once read (a dtype conversion or a quantisation reads
    every one), the file's pages stay resident while any tensor still references the mapping: the embeddings and
    norms a conversion leaves kept all of SmolLM2-135M's 540 MB file resident.
    """
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in skip:
            tensor.data = tensor.data.clone()


def model_skeleton(args: ModelArgs) -> torch.nn.Module:
    """The base model's modules without its weights (on the meta device), to check layer names cheaply.

    Raises:
        ModelError: as :func:`load_model`.
    """
    if args.name_or_path in TINY:
        return tiny_model(TINY[args.name_or_path])
    # resolved (on first use, converted) first: transformers refuses from_pretrained under the meta device
    config = base_config(model_folder(args))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def base_config(folder: Path):
    """The folder's transformers config, less the quantisation entry of raylora's int8 folder."""
    config = AutoConfig.from_pretrained(folder)
    if getattr(config, "quantization_config", None) == INT8_QUANTIZATION:
        del config.quantization_config
    return config


def load_int8_folder(folder: Path, dtype: torch.dtype) -> PreTrainedModel:
    """Rebuild a model exported with int8 weights: the same int8 layers, then the saved tensors (strictly)."""
    manifest = json.loads((folder / INT8_MANIFEST).read_text())
    model = AutoModelForCausalLM.from_config(base_config(folder), dtype=dtype)
    quantize_model(model, "w8a8")
    for name in manifest["smoothed"]:
        layer = model.get_submodule(name)
        layer.register_buffer("smooth", torch.ones(layer.in_features))
    weights = folder / INT8_WEIGHTS
    if not weights.is_file():  # exported before the weights were renamed
        weights = folder / "model.safetensors"
    load_safetensors(model, str(weights), strict=True)
    return model.eval()


def tiny_model(kind: str, seed: int = 0) -> PreTrainedModel:
    """A 2-layer, hidden-64 random model shaped like ``kind`` (``llama`` or ``qwen2``), for tests.

    The same ``seed`` always gives the same weights.
    """
    if kind not in ("llama", "qwen2"):
        raise ValueError(f"tiny_model: kind {kind!r}; expected 'llama' or 'qwen2'")

    shape = dict(
        vocab_size=len(tiny_tokenizer()), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False, initializer_range=0.1,
    )  # fmt: skip
    config = (LlamaConfig if kind == "llama" else Qwen2Config)(**shape)
    config._name_or_path = f"tiny-{kind}"  # what peft records as an adapter's base model (it recorded null)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config)


def randomise_lora(model, seed: int, scale: float) -> None:
    """Fill every LoRA weight of ``model`` from ``seed`` (normal, times ``scale``), for tests.

    LoRA B starts at zero, which makes any comparison of adapters trivial.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def target_modules(model: torch.nn.Module, names: list[str]) -> list[str] | str:
    """Expand presets in ``lora.target_modules`` and check each name matches a Linear layer.

    Returns:
        Module names for peft, or peft's ``"all-linear"``.
    Raises:
        ModelError: a name matches no ``nn.Linear`` of the model, or ``all-linear`` is mixed with names.
    """
    if "all-linear" in names:
        if len(names) > 1:
            raise ModelError("lora.target_modules: all-linear already covers every Linear layer; give it alone.")
        return "all-linear"
    wanted = list(dict.fromkeys(n for name in names for n in LORA_PRESETS.get(name, [name])))
    # In a peft model that already holds adapters (a training group's), a wrapped layer counts as its base layer.
    linear = {
        full.rsplit(".", 1)[-1]
        for full, m in model.named_modules()
        if isinstance(getattr(m, "base_layer", m), torch.nn.Linear)
        and not any(part.startswith("lora_") or part == "base_layer" for part in full.split("."))
    }
    missing = [n for n in wanted if n not in linear]
    if missing:
        raise ModelError(
            f"lora.target_modules: {', '.join(missing)} match no Linear layer of {type(model).__name__}. "
            f"Its Linear layers are: {', '.join(sorted(linear))}; presets: {', '.join(LORA_PRESETS)}, all-linear."
        )
    return wanted


def lora_config(model: torch.nn.Module, args: LoraArgs) -> LoraConfig:
    """peft's LoRA config for ``args`` on ``model`` (its layer names checked): the one both a lone run and a member
    of a shared-base group train with."""
    return LoraConfig(
        r=args.rank, lora_alpha=args.alpha, lora_dropout=args.dropout,
        target_modules=target_modules(model, args.target_modules),
        use_rslora=args.use_rslora, use_dora=args.use_dora, task_type="CAUSAL_LM",
    )  # fmt: skip


def attach_lora(model: PreTrainedModel, args: LoraArgs):
    """Wrap ``model`` in a peft LoRA model; only the adapter weights are trainable.

    Returns:
        ``peft.PeftModel`` whose ``save_pretrained`` output loads with ``PeftModel.from_pretrained``.
    """
    with warnings.catch_warnings():  # peft 0.21 reads transformers' deprecated is_gradient_checkpointing: noise per run
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, lora_config(model, args))
