"""``raylora export``: a merged Hugging Face folder, or raylora's int8 (W8A8) folder, from a base and an adapter.

The int8 folder holds ``raylora_int8.safetensors`` (int8 weights, their scales, SmoothQuant input multipliers),
the model's ``config.json`` (its ``quantization_config`` names ``raylora-int8``), the tokenizer and
``raylora_int8.json``. ``model.name_or_path`` may point at it (``raylora.models.load_model`` rebuilds the int8
layers), so ``raylora serve`` serves it without quantising again; transformers alone refuses it (no
``model.safetensors``) rather than read the int8 codes as float weights.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from peft import PeftModel
from safetensors.torch import save_model

from raylora.config import ConfigError, JobConfig, to_record
from raylora.model_files import INT8_MANIFEST, TINY, ModelError, model_folder
from raylora.models import INT8_QUANTIZATION, INT8_WEIGHTS, load_model
from raylora.quantize import quantize

INT8_README = """# raylora int8 export (W8A8)

Base `{base}`, adapter `{adapter}`, quantised by `raylora export`. Only raylora reads this folder: its int8 weights
are in `raylora_int8.safetensors`, which transformers' `from_pretrained` does not load (it reports no
`model.safetensors`, and warns of the unknown quantisation method `raylora-int8`). Serve it with `raylora serve`
(`model.name_or_path` set to this folder, `serve.quantization: none`) or load it with
`raylora.models.load_model(ModelArgs(name_or_path=...))`.
"""


def _check_trained_on(cfg: JobConfig) -> None:
    """Refuse to merge an adapter into a base other than the one peft recorded it was trained on.

    Shapes alone do not tell (a base model and its instruct version have the same ones): merged, the adapter's
    update would land on weights it never saw. The recorded base is a name, a hub id or a folder; each counts by its
    last part, in any case, so an adapter moved to another machine (another cache path) or trained on the hub's copy
    still matches.

    Raises:
        ModelError: the adapter names another base model.
    """
    config = json.loads((Path(cfg.export.adapter) / "adapter_config.json").read_text())
    recorded = config.get("base_model_name_or_path")
    ours = cfg.model.name_or_path
    if not recorded or recorded == ours:
        return
    folder = ours if ours in TINY else model_folder(cfg.model).name
    if Path(recorded).name.lower() not in (Path(ours).name.lower(), folder.lower()):  # HuggingFaceTB/SmolLM2-135M-...
        raise ModelError(
            f"export.adapter={cfg.export.adapter} was trained on {recorded}, and model.name_or_path={ours} is another "
            f"model: export it with model.name_or_path={recorded} (or the folder of that model)"
        )


def export(cfg: JobConfig, log=print) -> Path:
    """Write ``export.output_dir``; returns it.

    Raises:
        ConfigError: ``export.output_dir`` exists (nothing is overwritten).
        ValueError: bad quantisation settings; ModelError: the base model or adapter is missing, the adapter was
            trained on another base model, or the base is already an int8 export.
    """
    out = Path(cfg.export.output_dir)
    if out.exists():
        raise ConfigError([("export.output_dir", f"{out} exists; remove it or choose another folder")], "the export")
    if cfg.model.name_or_path not in TINY and (model_folder(cfg.model) / INT8_MANIFEST).is_file():
        raise ModelError(
            f"model.name_or_path={cfg.model.name_or_path} is already an int8 export; export from the original base "
            "(its int8 weights written as a plain folder would be read as floats)"
        )
    model, tokenizer = load_model(cfg.model)
    if cfg.export.adapter:
        if not (Path(cfg.export.adapter) / "adapter_config.json").is_file():
            raise ModelError(
                f"export.adapter={cfg.export.adapter} is not a peft adapter folder (no adapter_config.json)"
            )
        _check_trained_on(cfg)
        model = PeftModel.from_pretrained(model, cfg.export.adapter).merge_and_unload()
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        manifest = {
            "base": cfg.model.name_or_path,
            "adapter": cfg.export.adapter,
            "quantization": cfg.export.quantization,
        }
        if cfg.export.quantization == "none":
            model.save_pretrained(stage)
        else:
            summary = quantize(model, tokenizer, cfg, cfg.export.quantization)
            model.config.quantization_config = INT8_QUANTIZATION
            model.config.save_pretrained(stage)
            save_model(model, str(stage / INT8_WEIGHTS))  # handles the tied head's shared int8 tensor
            smoothed = sorted(n.removesuffix(".smooth") for n, _ in model.named_buffers() if n.endswith(".smooth"))
            manifest |= {"summary": summary, "smoothed": smoothed}
            (stage / INT8_MANIFEST).write_text(json.dumps(manifest, indent=1))
            (stage / "README.md").write_text(
                INT8_README.format(base=cfg.model.name_or_path, adapter=cfg.export.adapter or "none")
            )
        tokenizer.save_pretrained(stage)
        (stage / "raylora_export.json").write_text(json.dumps({**manifest, "config": to_record(cfg)}, indent=1))
        stage.rename(out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    log(f"raylora export: wrote {out} ({cfg.export.quantization}, {size:.0f} MiB)")
    return out
