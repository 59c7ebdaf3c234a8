"""What every training run does between its steps, whoever runs it: a Ray Train worker (:mod:`raylora.train.loop`)
or a member of a shared-base group (:mod:`raylora.train.group`).

The NaN guard and its one rollback, the cadence of logs, evaluations and checkpoints, and the step's metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from raylora.backends import Backend
from raylora.config import TrainArgs
from raylora.train import checkpoint as ckpt
from raylora.train.checkpoint import TrainState


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
        if math.isfinite(loss) and math.isfinite(grad_norm):
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
    """What a counted step ends with: ``final`` (``train.max_steps``), an evaluation, a checkpoint, a log line."""

    final: bool
    evaluate: bool
    save: bool
    log: bool


def due(step: int, train: TrainArgs) -> Due:
    """The cadence of step ``step`` (counted from 1): the last step evaluates, saves and logs."""
    final = step == train.max_steps
    evaluate = final or bool(train.eval_every and step % train.eval_every == 0)
    save = final or bool(train.checkpoint_every and step % train.checkpoint_every == 0)
    return Due(final, evaluate, save, final or evaluate or save or step % train.log_every == 0)


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
