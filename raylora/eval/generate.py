"""Answers of every candidate to every prompt, generated on Ray Data by a pool of actors.

Each actor (:class:`Answerer`) holds one copy of the base model (quantised per ``serve.quantization``), every
candidate adapter attached through the serving replica's :class:`~raylora.serve.bank.AdapterBank`, and the serving
:class:`~raylora.generation.Engine`: the rows of a batch, whatever candidate each asks, decode together (peft's
mixed-adapter batch), ``eval.max_batch_size`` at a time, continuously batched. The dataset holds one row per
(prompt, candidate), candidates interleaved, so every batch mixes adapters; ``map_batches`` streams batches through
``eval.actors_per_node`` actors per node, two batches in flight in each actor, so that its engine takes the next
batch's rows while the last answers of a batch finish (a batch waits for its longest answer).
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
import torch.nn.functional as F

from raylora.config import EvalArgs, JobConfig, from_dict, to_dict
from raylora.eval.candidates import Candidate
from raylora.eval.rows import EvalRow
from raylora.generation import BASE, Engine, GenRequest, on_passing_thread, run_all
from raylora.prefix_cache import sized
from raylora.serve.bank import AdapterBank
from raylora.serve.replica import load_serving_model


class Answerer:
    """A Ray Data actor: the base once, the candidate adapters attached, an engine answering batches of rows.

    Args:
        cfg: the job as a plain dict.
        adapters: candidate name -> adapter folder.
    """

    def __init__(self, cfg: dict, adapters: dict[str, str]):
        self.cfg = cfg = from_dict(cfg)
        threads = cfg.serve.engine_threads or max(1, round(cfg.eval.cpus_per_actor))
        model, tokenizer, quantization = on_passing_thread(lambda: load_serving_model(cfg), threads)
        self.engine = Engine(model, tokenizer, cfg.eval.max_batch_size, 0, threads, cfg.serve.max_prefill_tokens,
                             prefix_cache=sized(cfg.serve.prefix_cache_mb, model.config))  # fmt: skip
        bank = AdapterBank(self.engine, model, cfg.serve, bool(quantization))
        for name, path in adapters.items():
            asyncio.run(bank.hold(name, Path(path)))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        e = self.cfg.eval
        adapters = [a or None for a in batch["adapter"]]
        reqs = [
            eval_request([int(i) for i in ids], adapter, e)
            for ids, adapter in zip(batch["prompt_ids"], adapters, strict=True)
        ]
        events = run_all(self.engine, reqs)
        losses = [math.nan] * len(reqs)
        if "reference_loss" in e.metrics:
            items = list(zip(batch["prompt_ids"], batch["answer_ids"], adapters, strict=True))
            losses = self.engine.call(lambda: reference_losses(self.engine.model, items)).result()
        return {
            "row": batch["row"],
            "candidate": batch["candidate"],
            "answer": np.array([ev.text for ev in events], dtype=object),
            "completion_tokens": np.array([ev.completion_tokens for ev in events]),
            "finish_reason": np.array([ev.finish_reason or "" for ev in events], dtype=object),
            "error": np.array([ev.error or "" for ev in events], dtype=object),
            "reference_loss": np.array(losses, dtype=np.float64),
        }


def eval_request(prompt_ids: list[int], adapter: str | None, e: EvalArgs) -> GenRequest:
    """One eval answer's request: ``eval``'s sampling settings, length and stop strings."""
    return GenRequest(prompt_ids, adapter, e.max_tokens, e.temperature, e.top_p, tuple(e.stop), e.seed)


@torch.no_grad()
def reference_losses(model, items: list[tuple[np.ndarray, np.ndarray, str | None]]) -> list[float]:
    """Cross-entropy per token of each reference answer after its prompt, under its candidate; NaN without one.

    Runs on the engine thread (between decode steps), one row at a time: a row's full logits are (length, vocab).
    """
    out = []
    for prompt, answer, adapter in items:
        if len(answer) == 0:
            out.append(math.nan)
            continue
        ids = torch.tensor([[*prompt, *answer]], device=model.device)
        kwargs = {"adapter_names": [adapter or BASE]} if hasattr(model, "peft_config") else {}
        logits = model(input_ids=ids, **kwargs).logits[0, len(prompt) - 1 : -1].float()
        out.append(F.cross_entropy(logits, ids[0, len(prompt) :]).item())
    return out


def generate(cfg: JobConfig, rows: list[EvalRow], candidates: list[Candidate]) -> list[dict[str, Any]]:
    """Every candidate's answer to every row, on the connected Ray cluster.

    Returns:
        ``{"row", "candidate", "answer", "completion_tokens", "finish_reason", "error"}`` per (row, candidate), in
        row order, candidates in ``candidates``' order.
    """
    items = [
        {
            "row": r.row,
            "candidate": c.name,
            "adapter": "" if c.path is None else c.name,
            "prompt_ids": r.prompt_ids,
            "answer_ids": r.answer_ids or [],
        }
        for r in rows
        for c in candidates
    ]
    nodes = sum(1 for n in ray.nodes() if n["Alive"])
    actors = min(cfg.eval.actors_per_node * nodes, max(1, -(-len(items) // cfg.eval.batch_rows)))
    adapters = {c.name: c.path for c in candidates if c.path is not None}
    answers = ray.data.from_items(items, override_num_blocks=max(1, -(-len(items) // cfg.eval.batch_rows))).map_batches(
        Answerer,
        fn_constructor_kwargs={"cfg": to_dict(cfg), "adapters": adapters},
        batch_size=cfg.eval.batch_rows,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(
            size=actors, max_concurrent_calls_per_actor=2, enable_true_multi_threading=True
        ),
        num_cpus=cfg.eval.cpus_per_actor,
    )
    order = {c.name: k for k, c in enumerate(candidates)}
    out = [{k: (v.item() if isinstance(v, np.generic) else v) for k, v in row.items()} for row in answers.iter_rows()]
    return sorted(out, key=lambda a: (a["row"], order[a["candidate"]]))
