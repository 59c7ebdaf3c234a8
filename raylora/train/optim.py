"""The optimizer and learning-rate schedule shared by the Ray Train loop and the quickstart job."""

from __future__ import annotations

import math

import torch

from raylora.backends import Backend
from raylora.config import TrainArgs

MLP_MODULES = ("gate_proj", "up_proj", "down_proj", "fc1", "fc2", "mlp")


def build_optimizer(model, train: TrainArgs, backend: Backend) -> torch.optim.Optimizer:
    """AdamW over the LoRA weights in two groups: attention (lr) and MLP (lr x lr_mlp_scale)."""
    return adamw([(n, p) for n, p in model.named_parameters() if p.requires_grad], train, backend)


def adamw(named: list[tuple[str, torch.nn.Parameter]], train: TrainArgs, backend: Backend) -> torch.optim.Optimizer:
    """AdamW over ``named`` parameters (module path, parameter) in two groups: attention (lr) and MLP (lr x lr_mlp_scale)."""
    groups: dict[str, list] = {"attention": [], "mlp": []}
    for name, p in named:
        groups["mlp" if any(f".{m}." in name for m in MLP_MODULES) else "attention"].append(p)
    eps = max(train.adam_eps, 1e-6) if backend.needs_grad_scaler else train.adam_eps
    params = [
        {"params": groups["attention"], "lr": train.lr, "name": "attention"},
        {"params": groups["mlp"], "lr": train.lr * train.lr_mlp_scale, "name": "mlp"},
    ]
    return torch.optim.AdamW([g for g in params if g["params"]], weight_decay=train.weight_decay, eps=eps)


def build_scheduler(optimizer, train: TrainArgs, lr_scale: list[float]) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then cosine, linear or constant decay to 0 at ``max_steps``; times ``lr_scale[0]`` (NaN rollbacks halve it)."""

    def factor(step: int) -> float:
        if step < train.warmup_steps:
            return lr_scale[0] * (step + 1) / train.warmup_steps
        progress = (step - train.warmup_steps) / max(1, train.max_steps - train.warmup_steps)
        decay = {"cosine": 0.5 * (1 + math.cos(math.pi * progress)), "linear": 1 - progress, "constant": 1.0}[
            train.scheduler
        ]
        return lr_scale[0] * decay

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
