"""Training checkpoints: adapter weights (peft format) plus optimizer, scheduler, step and data position.

Layout of a checkpoint folder::

    adapter/       peft save_pretrained output (loads with PeftModel.from_pretrained)
    state.pt       optimizer, scheduler, grad scaler, step, data position, NaN-guard state
    meta.json      base model and LoRA shape, to refuse a checkpoint of another model
    history.json   logged metrics so far (for the loss plot)
    comm/rank<N>.pt  each rank's communication-hook state (topk residuals, PowerSGD errors), with train.comm_hook
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from raylora.config import JobConfig, to_dict
from raylora.errors import BadInput

LORA_SHAPE = ("rank", "alpha", "target_modules", "use_rslora", "use_dora")
# SAVE_NOTE: adapters are saved (and snapshot for rollback) with save_embedding_layers=False. raylora never trains or
# resizes embeddings, and peft's "auto" looks the recorded base (a Hub id) up on the Hub at every save to find out.
CHECKPOINT_FILES = ("meta.json", "state.pt", "history.json", "adapter/adapter_model.safetensors")


class CheckpointError(BadInput, RuntimeError):
    """A checkpoint that does not fit this job; the message says why and what to do."""


@dataclass
class TrainState:
    """Where a run is. ``rows_in_epoch`` counts rows consumed by all workers together, so a run
    resumed on a different number of workers skips the same data."""

    step: int = 0
    epoch: int = 0
    rows_in_epoch: int = 0
    lr_scale: float = 1.0
    rollbacks: int = 0
    skipped_steps: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


def tokens_trained(state: TrainState) -> int:
    """Real tokens trained up to ``state``'s last logged step (0 for a fresh run), so a resumed run counts on."""
    return int(state.history[-1].get("tokens", 0)) if state.history else 0


def save(
    folder: Path, model, optimizer, scheduler, scaler, state: TrainState, cfg: JobConfig, adapter: str = "default"
) -> None:
    """Write a checkpoint of ``model``'s adapter ``adapter`` (a peft model, unwrapped from DDP) into ``folder``."""
    save_adapter(model, adapter, folder / "adapter")
    save_state(folder, optimizer, scheduler, scaler, state, cfg)


def save_adapter(model, adapter: str, folder: Path) -> None:
    """Write ``model``'s adapter ``adapter`` as a plain peft adapter folder (``PeftModel.from_pretrained`` loads it):
    peft writes any adapter but ``default`` into a sub-folder of its name, which becomes ``folder``."""
    if adapter == "default":
        model.save_pretrained(folder, save_embedding_layers=False)  # see SAVE_NOTE
        return
    with tempfile.TemporaryDirectory(prefix="raylora-adapter-") as tmp:
        model.save_pretrained(tmp, selected_adapters=[adapter], save_embedding_layers=False)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.move(str(Path(tmp) / adapter), str(folder))


def save_state(folder: Path, optimizer, scheduler, scaler, state: TrainState, cfg: JobConfig) -> None:
    """Everything of a checkpoint but the adapter: ``state.pt``, ``meta.json`` and ``history.json``."""
    torch.save(
        {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "state": asdict(state),
        },
        folder / "state.pt",
    )
    meta = {"model": cfg.model.name_or_path, "lora": {k: to_dict(cfg.lora)[k] for k in LORA_SHAPE}, "step": state.step}
    (folder / "meta.json").write_text(json.dumps(meta, indent=2))
    (folder / "history.json").write_text(json.dumps(state.history))


def save_in_run(out: Path, keep: int, model, optimizer, scheduler, scaler, state: TrainState, cfg: JobConfig,
                adapter: str = "default") -> Path:  # fmt: skip
    """Write a checkpoint where Ray Train would, ``out/ray/checkpoint_<step>``, for a run Ray Train does not drive
    (a shared-base group's member), keeping the newest ``keep``; returns its folder. It is written aside and renamed
    in, so :func:`newest` never finds it half written."""
    root = out / "ray"
    folder = root / f"checkpoint_{state.step:06d}"
    partial = root / f".{folder.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save(partial, model, optimizer, scheduler, scaler, state, cfg, adapter=adapter)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    for old in sorted(root.glob("checkpoint_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return folder


def newest(out: Path) -> Path | None:
    """The checkpoint a rerun of the job writing to ``out`` resumes from: the highest step among the complete ones
    in ``out/ray/checkpoint_*`` (every file there, ``meta.json`` readable: Ray copies files straight into the folder,
    so a run killed mid-copy leaves one cut short), or ``None``."""
    found = []
    for folder in (out / "ray").glob("checkpoint_*"):
        if all((folder / name).is_file() for name in CHECKPOINT_FILES):
            try:
                found.append((checkpoint_step(folder), folder.name, folder))
            except (ValueError, OSError):  # meta.json cut short
                continue
    return max(found)[2] if found else None


def resume_point(handed: Path | None, out: Path) -> Path | None:
    """The checkpoint a worker resumes from: the one Ray Train hands it, or a newer complete one in ``out/ray``.

    Ray Train registers a checkpoint when its controller takes the report, up to a poll interval after the workers
    wrote it; a run stopped (Ctrl-C, SIGTERM, a killed worker) in between left that checkpoint on disk, unregistered,
    and Ray handed the one before, so finished steps were trained again.
    """
    found = newest(out)
    if found is None:
        return handed
    if handed is not None and checkpoint_step(handed) >= checkpoint_step(found):
        return handed
    return found


def drop_unregistered(out: Path) -> list[str]:
    """Delete the checkpoints in ``out/ray`` that Ray Train never registered (see :func:`resume_point`), once a run
    has finished: Ray keeps ``train.keep_checkpoints`` of those it registered and never sees these. Returns their
    names."""
    snapshot = out / "ray" / "checkpoint_manager_snapshot.json"
    if not snapshot.is_file():
        return []
    kept = {r["checkpoint_dir_name"] for r in json.loads(snapshot.read_text()).get("checkpoint_results", [])}
    dropped = sorted(f.name for f in (out / "ray").glob("checkpoint_*") if f.is_dir() and f.name not in kept)
    for name in dropped:
        shutil.rmtree(out / "ray" / name, ignore_errors=True)
    return dropped


def checkpoint_step(folder: Path) -> int:
    """The optimizer step a checkpoint folder was written at."""
    return int(json.loads((folder / "meta.json").read_text()).get("step", 0))


def check_compatible(folder: Path, cfg: JobConfig) -> None:
    """Raise :class:`CheckpointError` unless the checkpoint was written for this base model and LoRA shape."""
    meta = json.loads((folder / "meta.json").read_text())
    ours = {"model": cfg.model.name_or_path, "lora": {k: to_dict(cfg.lora)[k] for k in LORA_SHAPE}}
    diffs = [f"model {meta['model']!r} (this job: {ours['model']!r})"] if meta["model"] != ours["model"] else []
    diffs += [
        f"lora.{k} {meta['lora'][k]!r} (this job: {ours['lora'][k]!r})"
        for k in LORA_SHAPE
        if meta["lora"][k] != ours["lora"][k]
    ]
    if diffs:
        raise CheckpointError(
            f"the checkpoint in {folder} was written for {', '.join(diffs)}, so it cannot resume this job. "
            "Use a new train.output_dir for a new model or LoRA shape, or restore the settings it was trained with."
        )


def load(folder: Path, model, optimizer, scheduler, scaler, adapter: str = "default") -> TrainState:
    """Restore a checkpoint into live objects (its weights into the peft ``model``'s adapter ``adapter``);
    returns its :class:`TrainState`."""
    from peft import set_peft_model_state_dict  # peft and transformers, 2.8 s: a trial's process never loads them

    weights = load_file(str(folder / "adapter" / "adapter_model.safetensors"))
    saved = torch.load(folder / "state.pt", weights_only=False)  # both read before anything changes
    set_peft_model_state_dict(model, weights, adapter_name=adapter)
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    scaler.load_state_dict(saved["scaler"])
    return TrainState(**saved["state"])


def save_comm(folder: Path, hook, rank: int) -> None:
    """Write this rank's communication-hook state (:class:`raylora.comm.hooks.CommHook`) into ``folder``."""
    (folder / "comm").mkdir(exist_ok=True)
    torch.save(hook.state_dict(), folder / "comm" / f"rank{rank}.pt")


def load_comm(folder: Path, hook, rank: int, world: int) -> str | None:
    """Restore this rank's hook state; returns a note when it cannot be (another worker count or hook)."""
    saved = sorted((folder / "comm").glob("rank*.pt")) if (folder / "comm").is_dir() else []
    if len(saved) != world:
        return (
            f"the checkpoint holds communication-hook state for {len(saved)} workers, this run has {world}: "
            f"train.comm_hook={hook.name} starts with empty error feedback"
        )
    state = torch.load(folder / "comm" / f"rank{rank}.pt", weights_only=False)
    if ("powersgd" in state) != (hook.powersgd is not None):
        return f"the checkpoint was written with another train.comm_hook: {hook.name} starts with empty state"
    hook.load_state_dict(state)
    return None


def snapshot(model, optimizer, scheduler, scaler, state: TrainState, adapter: str = "default") -> dict[str, Any]:
    """An in-memory copy of everything a rollback restores (the last good checkpoint's content)."""
    from peft import get_peft_model_state_dict  # see load()

    return copy.deepcopy(
        {
            "adapter": get_peft_model_state_dict(model, adapter_name=adapter, save_embedding_layers=False),  # SAVE_NOTE
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "state": asdict(state),
        }
    )


def restore(saved: dict[str, Any], model, optimizer, scheduler, scaler, adapter: str = "default") -> TrainState:
    from peft import set_peft_model_state_dict  # see load()

    set_peft_model_state_dict(model, saved["adapter"], adapter_name=adapter)
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    scaler.load_state_dict(saved["scaler"])
    return TrainState(**copy.deepcopy(saved["state"]))
