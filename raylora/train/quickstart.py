"""The quickstart job, top to bottom: load the base model, attach LoRA, fine-tune a few steps in one
process on packed examples, save the adapter, and answer a question with the base and the tuned model.

It runs the same encode and pack functions as the Ray Data pipeline, in-process and without Ray,
and is the local precursor of the Ray Train job (``raylora train``).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import torch

from raylora.backends import Backend, resolve_backend
from raylora.config import JobConfig, to_record
from raylora.data.encode import Encoder, tokenizer_spec
from raylora.data.formats import Conversation, to_messages
from raylora.data.pipeline import gather_side
from raylora.data.read import first_row, iter_blocks
from raylora.data.sources import DataError, plan_sources
from raylora.data.transforms import encode_batch, pack_batch, worker_spec
from raylora.generation import GenRequest, answer_all
from raylora.models import attach_lora, load_model
from raylora.train.lm import training_model
from raylora.train.loop import train_step
from raylora.train.optim import build_optimizer, build_scheduler

MAX_TOKENS = 48  # the question's answer, before and after


def run_quickstart(cfg: JobConfig, log=print) -> dict:
    """Run the quickstart job and write its outputs under ``cfg.train.output_dir``.

    Returns:
        Summary dict (also written to ``summary.json``): losses per step, tokens/s, adapter folder,
        row counts, and the question with the answers before and after tuning.
    Raises:
        DataError: bad sources, or no usable training row.
    """
    out = Path(cfg.train.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    backend = resolve_backend(cfg.backend)
    torch.manual_seed(cfg.train.seed)
    plan = plan_sources(cfg.data, cfg.train.objective)
    model, tokenizer = load_model(cfg.model)
    packs, counts = load_packs(cfg, plan, worker_spec(cfg.data, tokenizer_spec(tokenizer, cfg.data.template)), out)
    log(
        f"data: {counts['rows_kept']} rows in {len(packs)} packed sequences, {counts['rows_rejected']} rejected (see {out / 'rejects.jsonl'})"
    )
    if not packs:
        raise DataError(f"no usable training row in {', '.join(plan)}; see {out / 'rejects.jsonl'}")
    path = next(iter(plan))
    first = to_messages(first_row(path)[1], plan[path]["format"], plan[path]["columns"], cfg.data.placeholders)
    question = [m for m in first if m["role"] in ("system", "user")][-1:]
    encoder = Encoder(tokenizer_spec(tokenizer, cfg.data.template), cfg.data.cutoff_len, "tail", False)
    prompt = tokenizer(encoder.prompt(Conversation(question)), add_special_tokens=False).input_ids
    model = attach_lora(model, cfg.lora).to(backend.torch_device())
    before = answer_all(model, tokenizer, [GenRequest(prompt, max_tokens=MAX_TOKENS, temperature=0)])[0].text.strip()
    losses, tokens, seconds = train_steps(model, packs, tokenizer.pad_token_id, cfg, backend, log)
    model.save_pretrained(out / "adapter", save_embedding_layers=False)  # see raylora.train.checkpoint's SAVE_NOTE
    # training stored the frozen weights in the autocast dtype (raylora.train.lm.store_frozen_linears)
    after = answer_all(model, tokenizer, [GenRequest(prompt, "default", MAX_TOKENS, temperature=0)], backend.autocast)
    after = after[0].text.strip()
    summary = {
        "losses": losses,
        "tokens_per_s": tokens / seconds,
        "adapter": str(out / "adapter"),
        **counts,
        "sequences": len(packs),
        "question": question[0]["content"],
        "answer_before": before,
        "answer_after": after,
    }
    (out / "config.json").write_text(json.dumps(to_record(cfg), indent=2))
    (out / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False))
    log(
        f"question: {summary['question']}\nbase model: {before}\nwith adapter: {after}\nadapter saved to {out / 'adapter'}"
    )
    return summary


def load_packs(cfg: JobConfig, plan: dict, spec: str, out: Path) -> tuple[list[dict], dict]:
    """Encode and pack every training row in this process; returns the train packs and the row counts."""
    (out / "rejects").mkdir(exist_ok=True)
    (out / "counts").mkdir(exist_ok=True)
    encoded = []
    for path in sorted(plan):
        with open(path, "rb") as f:
            for block in iter_blocks(f, path, cfg.data.max_samples):
                encoded.append(encode_batch(block, spec, plan, str(out), None))
    packs = pack_batch(pa.concat_tables(encoded), cfg.data.cutoff_len, cfg.data.packing).to_pylist()
    return [p for p in packs if p["split"] == "train"], gather_side(out)


def train_steps(
    model, packs: list[dict], pad_id: int, cfg: JobConfig, backend: Backend, log
) -> tuple[list[float], int, float]:
    """The training job's own step (:func:`~raylora.train.loop.train_step`: its optimizer, schedule, objective and
    speed options) over shuffled micro-batches of packs, in this process.

    Returns per-step losses, real tokens seen and seconds."""
    train = cfg.train
    loss_model, notes = training_model(model, train, backend)
    log("training path: " + "; ".join(notes))
    optimizer = build_optimizer(model, train, backend)
    scheduler = build_scheduler(optimizer, train, [1.0])
    scaler = backend.grad_scaler()
    device = backend.torch_device()
    losses, tokens = [], 0
    model.train()
    batches = shuffled(packs, train.batch_size, train.seed)
    start = time.perf_counter()
    for step in range(1, train.max_steps + 1):
        loss, seen, _, _, _ = train_step(
            loss_model, batches, optimizer, scheduler, scaler, pad_id, backend.amp_dtype or model.dtype, device,
            train, backend, 1,
        )  # fmt: skip
        losses.append(loss)
        tokens += seen
        backend.synchronize()
        elapsed = time.perf_counter() - start
        log(f"step {step}/{train.max_steps}  loss {losses[-1]:.4f}  tokens/s {tokens / elapsed:.0f}")
    model.eval()
    return losses, tokens, time.perf_counter() - start


def shuffled(packs: list[dict], batch_size: int, seed: int) -> Iterator[tuple[list[dict], tuple[int, int]]]:
    """Micro-batches of packs drawn from a seeded reshuffle of all of them, each time the pool runs low."""
    order = random.Random(seed)
    pool: list[dict] = []
    while True:
        while len(pool) < batch_size:
            pool += order.sample(packs, len(packs))
        yield [pool.pop() for _ in range(batch_size)], (0, 0)
