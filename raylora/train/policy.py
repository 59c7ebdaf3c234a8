"""What every training run does between its steps, whoever runs it: a Ray Train worker (:mod:`raylora.train.loop`)
or a member of a shared-base group (:mod:`raylora.train.group`).

The end of an optimizer step (clip, and step only when finite), the NaN guard and its one rollback, the cadence of
logs, evaluations and checkpoints, the step's metrics and the evaluation's scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from raylora.backends import Backend
from raylora.config import TrainArgs
from raylora.ops.linear_ce import IGNORE_INDEX
from raylora.train import checkpoint as ckpt
from raylora.train.checkpoint import TrainState


def finite(*values: float) -> bool:
    """Whether every value is a finite number (the one test of a step's loss and gradient norm)."""
    return all(math.isfinite(v) for v in values)


def params_finite(params) -> bool:
    """Whether every tensor of ``params`` (an adapter's trained weights) holds finite numbers only."""
    return all(bool(torch.isfinite(p).all()) for p in params)


def label_tokens(rows: list[dict]) -> int:
    """The tokens of pack rows whose next-token prediction is trained (every label after the first that is not
    ignored): the denominator of a step's and an evaluation's loss."""
    return sum(1 for r in rows for t in r["labels"][1:] if t != IGNORE_INDEX)


def take_step(params, optimizer, scheduler, scaler, max_grad_norm: float, loss: float) -> float:
    """End an optimizer step whose gradients are in: unscale them, clip them to ``max_grad_norm`` (0: no clip), and
    step the optimizer and the schedule only when ``loss`` and the gradient norm are finite (the NaN guard judges
    the step then). Returns the gradient norm."""
    scaler.unscale_(optimizer)
    clip = max_grad_norm if max_grad_norm > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, clip).item()
    if finite(loss, grad_norm):
        scaler.step(optimizer)
        scheduler.step()
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def eval_scores(sums: torch.Tensor, world: int, replicated: bool) -> list[dict[str, float]]:
    """Eval loss per label token and perplexity of each model evaluated, over every worker.

    Args:
        sums: ``[models, 2]``: this worker's summed loss and label tokens of each model.
        replicated: every worker evaluated the same rows (their sums are averaged, not added).
    Returns:
        One dict per model (``eval_loss``, ``eval_perplexity``), empty for a model with no label token.
    """
    total = sums
    if world > 1:
        total = sums.float()  # HCCL all-reduces no float64
        dist.all_reduce(total)
        if replicated:
            total /= world
    scores = []
    for loss_sum, targets in total.tolist():
        value = loss_sum / targets if targets > 0 else None
        scores.append({} if value is None else {"eval_loss": value, "eval_perplexity": math.exp(min(value, 50))})
    return scores


@dataclass
class NanGuard:
    """Counts non-finite steps in a row (``train.nan_tolerance`` of them roll back once, then the run diverged)."""

    tolerance: int
    bad_in_row: int = 0

    def verdict(self, loss: float, grad_norm: float, state: TrainState) -> str:
        """What a step's loss and gradient norm mean for the run.

        Returns:
            ``ok`` (the step counts), ``skip`` (it does not: counted in ``state.skipped_steps``), ``rollback``
            (the tolerance is reached: :func:`roll_back` now) or ``diverged`` (reached again after a rollback).
        """
        if finite(loss, grad_norm):
            self.bad_in_row = 0
            return "ok"
        state.skipped_steps += 1
        self.bad_in_row += 1
        if self.bad_in_row < self.tolerance:
            return "skip"
        if state.rollbacks >= 1:
            return "diverged"
        self.bad_in_row = 0
        return "rollback"


def roll_back(
    last_good: dict[str, Any], state: TrainState, lr_scale: list[float], model, optimizer, scheduler, scaler,
    adapter: str = "default",
) -> TrainState:  # fmt: skip
    """Restore the last good checkpoint's content (:func:`raylora.train.checkpoint.snapshot`) with half its learning
    rate; the skipped steps stay counted. Returns the restored state; ``lr_scale[0]`` (the scheduler's multiplier)
    follows."""
    skipped = state.skipped_steps
    restored = ckpt.restore(last_good, model, optimizer, scheduler, scaler, adapter=adapter)
    restored.rollbacks, restored.skipped_steps, restored.lr_scale = 1, skipped, restored.lr_scale * 0.5
    lr_scale[0] = restored.lr_scale
    return restored


@dataclass(frozen=True)
class Due:
    """What a counted step ends with: ``final`` (``train.max_steps``), an evaluation, a checkpoint, a log line, a
    generation eval."""

    final: bool
    evaluate: bool
    save: bool
    log: bool
    generate: bool


def due(step: int, train: TrainArgs) -> Due:
    """The cadence of step ``step`` (counted from 1): the last step evaluates, saves and logs, and generates when
    ``train.generate_eval_every`` is set."""
    final = step == train.max_steps
    evaluate = final or bool(train.eval_every and step % train.eval_every == 0)
    save = final or bool(train.checkpoint_every and step % train.checkpoint_every == 0)
    every = train.generate_eval_every
    generate = bool(every) and (final or step % every == 0)
    return Due(final, evaluate, save, final or evaluate or save or generate or step % train.log_every == 0, generate)


def step_metrics(
    loss: float, lr: float, grad_norm: float, tokens_seen: int, seconds: float, tokens_before: int,
    backend: Backend, state: TrainState,
) -> dict[str, float]:  # fmt: skip
    """The metrics of a logged step, under the names MLflow, Tune and ``history.json`` share.

    Args:
        tokens_seen: real tokens trained since this run (re)started, in ``seconds``.
        tokens_before: real tokens trained before the checkpoint it resumed from.
    """
    return {
        "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_seen / seconds,
        "tokens": tokens_before + tokens_seen, "peak_memory_mb": backend.peak_memory_mb(),
        "skipped_steps": state.skipped_steps,
    }  # fmt: skip
