"""LoRA dropout for the fused path: nn.Dropout's distribution, its mask cheap to draw and apply on CPU, its scale
left to the caller.

A LoRA layer computes ``dropout(x) @ A^T`` and then a rank-wide up-projection, so nn.Dropout's 1/(1-p) scale can
multiply ``B`` (rank x out elements) instead of every element of ``x``: :func:`lora_dropout` returns ``x``
times a 0/1 mask in ``x``'s dtype, and :func:`dropout_scale` is the factor the caller folds into its
up-projection. A 0/1 mask is exact in bf16, where ``1/(1-p)`` is not (1/0.95 rounds to 1.0547).

On CPU two costs dominated ``F.dropout`` (``bernoulli_``: 18% of a SmolLM2 LoRA step at p=0.05) and the first
version of this module (a bool mask): drawing a random number per element, and every op mixing a bool tensor
with a float one (a comparison to bool, a bool x bf16 product forward and backward), which does not vectorise.
Here :func:`keep_mask` builds the mask with 16-bit integer ops only, from 16-bit random words, four to a
64-bit number of torch's generator. Each element is dropped with probability ``round(p * 32768) / 32768``
(0.05 becomes 0.0499878). Drawing the words on two threads made the draw 1.9x faster alone but a training
step 2% slower (the intra-op threads spin between ops), so they come from one. Other devices draw with
``bernoulli_`` (Philox on CUDA and NPU). ``bench/lora_dropout.py`` measures the CPU path against ``F.dropout``.
"""

from __future__ import annotations

import math

import torch

LEVELS = 1 << 15  # each element's draw: the top 15 bits of a 16-bit random word
ONE_BITS = {torch.bfloat16: 0x3F80, torch.float16: 0x3C00}  # the bit patterns of 1.0


def keep_mask(
    shape: tuple[int, ...],
    p: float,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """A mask of ``shape`` in ``dtype``: 1 where kept, 0 where dropped (probability ``round(p * 32768) / 32768``),
    from ``generator`` (default: the global generator of ``device``). Off the CPU, a bool mask (probability
    ``p``), which those devices multiply at full speed."""
    if torch.device(device).type != "cpu":  # a bool mask: what autograd saves for the backward is 1 byte a flag
        return torch.empty(shape, dtype=torch.bool, device=device).bernoulli_(1 - p, generator=generator)
    count = math.prod(shape)
    words = torch.empty((count + 3) // 4, dtype=torch.int64).random_(-(1 << 63), None, generator=generator)
    draws = words.view(torch.int16)[:count] >> 1  # uniform in [-2^14, 2^14)
    threshold = round(p * LEVELS) - LEVELS // 2  # dropped: draw < threshold
    # (threshold - 1 - draw) is negative exactly when kept; an arithmetic shift by 15 makes that all one bits
    keep = draws.neg_().add_(threshold - 1).bitwise_right_shift_(15)
    if dtype in ONE_BITS:
        return keep.bitwise_and_(ONE_BITS[dtype]).view(dtype).view(shape)
    return keep.bitwise_and_(ONE_BITS[torch.bfloat16]).view(torch.bfloat16).to(dtype).view(shape)


def lora_dropout(x: torch.Tensor, p: float, training: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` with each element zeroed with probability ``p`` (in training, p > 0), **not scaled**: the caller
    multiplies what it computes from it by :func:`dropout_scale`. With ``generator`` every mask comes from it
    (a grouped sweep's member draws its own masks)."""
    if not training or p == 0:
        return x
    return x * keep_mask(x.shape, p, x.dtype, x.device, generator)


def dropout_scale(p: float, training: bool) -> float:
    """The factor that makes :func:`lora_dropout`'s output nn.Dropout's: ``1/(1-p)`` in training, else 1."""
    return 1 / (1 - p) if training and p else 1.0
