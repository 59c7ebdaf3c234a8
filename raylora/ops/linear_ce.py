"""Chunked linear + cross-entropy for the LM head: the full logits tensor is never materialised.

A causal LM's head turns (tokens, hidden) into (tokens, vocabulary) logits; for SmolLM2 a 2 x 512 micro-batch
makes 1,024 x 49,152 fp32 logits (200 MB), kept by autograd for the backward together with their softmax.
Here only the label positions are scored, a chunk of rows at a time, and each chunk's gradient with respect to
its hidden rows (and to the head's weight, when that is trained) is computed at once in the forward, so the
memory held is one chunk of logits and the (label tokens, hidden) gradient. The backward scales the stored
gradients by the incoming one. A chunk's logits come from one matrix product in the products' dtype; log-sum-exp
and the gradient (softmax - one_hot) are computed in fp32 a few rows at a time, so the passes over those rows
stay in the CPU's cache (one pass each over the chunk in memory instead of six), and the gradient overwrites
the logits in place. ``bench/linear_ce.py`` (1,000 rows of SmolLM2's head, bf16, 2 threads): 1.52x full logits
+ ``F.cross_entropy``; the version before, which made each pass over the whole chunk in fp32, was 1.13x. The plain reference is
:func:`linear_cross_entropy_reference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 2**24  # logits per chunk (one matrix product): 32 MB in bf16, enough rows for an efficient GEMM
CACHE_ELEMENTS = 2**20  # logits scored at a time: their fp32 copy (4 MB) stays in cache through the passes


def _score(logits: torch.Tensor, targets: torch.Tensor, grad: bool) -> torch.Tensor:
    """The cross-entropy of each of a few rows of ``logits`` (in fp32); with ``grad``, overwrites them with its
    gradient with respect to them, ``softmax - one_hot(target)``."""
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1)
    loss = lse - z.gather(1, targets[:, None]).squeeze(1)
    if grad:
        z.sub_(lse[:, None]).exp_()
        z[torch.arange(targets.shape[0], device=targets.device), targets] -= 1
        logits.copy_(z)
    return loss


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed over rows (``per_row`` False) or one loss a row (``per_row`` True: the head's weight is then frozen,
    since its gradient, a sum over rows, cannot be weighted by row afterwards)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, rows, dtype, per_row=False):
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        losses = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        w = weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], rows):
                h = hidden[start : start + rows].to(dtype)
                t = targets[start : start + rows]
                logits = h @ w.T
                step = max(1, CACHE_ELEMENTS // logits.shape[1])
                for part in range(0, logits.shape[0], step):
                    scored = _score(logits[part : part + step], t[part : part + step], want_h or want_w)
                    losses[start + part : start + part + scored.shape[0]] = scored
                if want_h:
                    grad_h[start : start + rows] = logits @ w
                if want_w:
                    grad_w += (logits.T @ h).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype, ctx.per_row = weight.dtype, per_row
        return losses if per_row else losses.sum()

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        if ctx.per_row:
            grad_out = grad_out[:, None]
        return (
            grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None,
            (grad_w * grad_out).to(ctx.weight_dtype) if grad_w is not None else None,
            None,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Sum over rows of ``cross_entropy(hidden @ weight.T, targets)``, scored a chunk of rows at a time.

    Args:
        hidden: (N, H) the hidden states of the positions to score (label positions only).
        weight: (V, H) the LM head's weight (frozen or trained).
        targets: (N,) token ids in [0, V); no ignore index (select the label positions before).
        dtype: dtype of the matrix products (the autocast dtype in training; ``None``: the hidden states' dtype).
            Log-sum-exp and the loss are always fp32.
    Returns:
        The summed loss, a 0-d fp32 tensor; its gradient reaches ``hidden`` and ``weight``.
    """
    if hidden.shape[0] == 0:
        return (hidden.sum() + weight.sum()).float() * 0
    rows = max(1, CHUNK_ELEMENTS // weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, targets, rows, dtype or hidden.dtype)


def linear_token_losses(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T, targets)`` of each row, (N,) fp32, scored as :func:`linear_cross_entropy`
    scores (a chunk of rows at a time, the logits never held); the gradient reaches ``hidden`` only.

    Raises:
        ValueError: ``weight`` requires a gradient (a trained head: use :func:`linear_cross_entropy`).
    """
    if weight.requires_grad:
        raise ValueError("linear_token_losses needs a frozen head: its gradient is a sum over rows, not per row")
    if hidden.shape[0] == 0:
        return hidden.sum(dim=1).float() * 0
    rows = max(1, CHUNK_ELEMENTS // weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, targets, rows, dtype or hidden.dtype, True)


def linear_cross_entropy_reference(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The plain path :func:`linear_cross_entropy` is held to: full logits, then ``F.cross_entropy`` (sum)."""
    dtype = dtype or hidden.dtype
    logits = F.linear(hidden.to(dtype), weight.to(dtype)).float()
    return F.cross_entropy(logits, targets, reduction="sum")


def label_positions(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states that predict a label, and those labels (the usual shift by one).

    Args:
        hidden: (B, T, H) the decoder's output.
        labels: (B, T) token ids, ``-100`` where nothing is learnt (prompt, padding).
    Returns:
        ``(hidden rows (N, H), targets (N,))`` for the N positions t whose next token ``labels[:, t + 1]`` is a label.
    """
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    return hidden[:, :-1][keep], targets[keep]
