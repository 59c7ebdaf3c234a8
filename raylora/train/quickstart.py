"""The quickstart job, top to bottom: load the base model, attach LoRA, fine-tune a few steps on one
process, save the adapter, and answer a question with the base and the tuned model.

It is the local, single-process precursor of the Ray Train job (``raylora train``).
"""

from __future__ import annotations

import glob
import itertools
import json
import random
import time
from pathlib import Path

import torch

from raylora.backends import Backend, resolve_backend
from raylora.config import DataArgs, JobConfig, to_dict
from raylora.data.alpaca import RowError, read_rows, to_messages
from raylora.data.encode import IGNORE_INDEX, encode_messages
from raylora.models import attach_lora, load_model


def run_quickstart(cfg: JobConfig, log=print) -> dict:
    """Run the quickstart job and write its outputs under ``cfg.train.output_dir``.

    Returns:
        Summary dict (also written to ``summary.json``): losses per step, tokens/s, adapter folder,
        rejected row count, and the question with the answers before and after tuning.
    Raises:
        ValueError: no usable training row.
    """
    out = Path(cfg.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    backend = resolve_backend(cfg.backend)
    torch.manual_seed(cfg.train.seed)
    model, tokenizer = load_model(cfg.model)
    examples, messages, rejects = load_examples(cfg.data, tokenizer)
    write_rejects(out / "rejects.jsonl", rejects)
    log(f"data: {len(examples)} examples, {len(rejects)} rejected (see {out / 'rejects.jsonl'})")
    if not examples:
        raise ValueError(f"no usable training row in {[s.path for s in cfg.data.sources]}; see {out / 'rejects.jsonl'}")
    question = [m for m in messages[0] if m["role"] != "assistant"][-1:]
    device = backend.torch_device()
    model = attach_lora(model, cfg.lora).to(device)
    with model.disable_adapter():
        before = generate(model, tokenizer, question, device)
    losses, tokens, seconds = train_steps(model, examples, tokenizer.pad_token_id, cfg, backend, log)
    model.save_pretrained(out / "adapter")
    after = generate(model, tokenizer, question, device)
    summary = {
        "losses": losses,
        "tokens_per_s": tokens / seconds,
        "adapter": str(out / "adapter"),
        "examples": len(examples),
        "rejected": len(rejects),
        "question": question[0]["content"],
        "answer_before": before,
        "answer_after": after,
    }
    (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    (out / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False))
    log(
        f"question: {summary['question']}\nbase model: {before}\nwith adapter: {after}\nadapter saved to {out / 'adapter'}"
    )
    return summary


def load_examples(data: DataArgs, tokenizer) -> tuple[list[dict], list[list[dict]], list[dict]]:
    """Read every source, returning encoded examples, their messages, and rejected rows with reasons."""
    examples, conversations, rejects = [], [], []
    for source in data.sources:
        files = sorted(glob.glob(source.path)) or [source.path]
        files = [str(f) for p in files for f in (sorted(Path(p).glob("*.json*")) if Path(p).is_dir() else [p])]
        for file in files:
            if not Path(file).is_file():
                raise FileNotFoundError(f"data.sources: {file} does not exist")
            rows = read_rows(Path(file))
            for line, row in itertools.islice(rows, data.max_samples):
                try:
                    messages = to_messages(row, data.placeholders)
                    examples.append(encode_messages(tokenizer, messages, data.cutoff_len))
                    conversations.append(messages)
                except RowError as e:
                    rejects.append({"source": file, "line": line, "reason": str(e), "row": row})
    return examples, conversations, rejects


def write_rejects(path: Path, rejects: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for r in rejects:
            f.write(json.dumps(r, ensure_ascii=False, default=str) + "\n")


def collate(examples: list[dict], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-pad a micro-batch: ``input_ids``, ``labels`` and ``attention_mask`` of shape (B, T_max)."""
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), IGNORE_INDEX)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        labels[i, :n] = torch.tensor(e["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids.to(device), "labels": labels.to(device), "attention_mask": mask.to(device)}


def train_steps(
    model, examples: list[dict], pad_id: int, cfg: JobConfig, backend: Backend, log
) -> tuple[list[float], int, float]:
    """AdamW steps over shuffled micro-batches; returns per-step losses, tokens seen and seconds taken."""
    train = cfg.train
    params = [p for p in model.parameters() if p.requires_grad]
    eps = 1e-6 if backend.needs_grad_scaler else 1e-8
    optimizer = torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay, eps=eps)
    scaler = torch.amp.GradScaler(backend.name, enabled=backend.needs_grad_scaler)
    order = random.Random(train.seed)
    pool: list[dict] = []
    losses, tokens = [], 0
    model.train()
    start = time.perf_counter()
    for step in range(1, train.max_steps + 1):
        while len(pool) < train.batch_size:
            pool += order.sample(examples, len(examples))
        batch = collate([pool.pop() for _ in range(train.batch_size)], pad_id, backend.torch_device())
        with torch.autocast(backend.name, dtype=backend.amp_dtype, enabled=backend.amp_dtype is not None):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        if train.max_grad_norm > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, train.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tokens += int(batch["attention_mask"].sum())
        backend.synchronize()
        elapsed = time.perf_counter() - start
        log(f"step {step}/{train.max_steps}  loss {losses[-1]:.4f}  tokens/s {tokens / elapsed:.0f}")
    model.eval()
    return losses, tokens, time.perf_counter() - start


@torch.no_grad()
def generate(model, tokenizer, messages: list[dict], device: torch.device, max_new_tokens: int = 48) -> str:
    """Greedy answer to a conversation, decoded without special tokens."""
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    output = model.generate(
        **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
