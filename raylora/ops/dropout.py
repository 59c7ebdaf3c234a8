"""LoRA dropout for the fused path: nn.Dropout's distribution, with its random flags drawn in 64-bit words on CPU.

On CPU, ``F.dropout`` draws one Bernoulli per element (``bernoulli_``), which took 18% of a SmolLM2 LoRA step
at dropout 0.05. Here one 64-bit random number gives four 16-bit uniforms, each compared with the drop
threshold: P(drop) is p rounded to a multiple of 1/65536 (0.05 becomes 0.0500031). Kept values are scaled by
1/(1-p), as nn.Dropout does. Other devices draw their masks fast already (Philox on CUDA and NPU) and keep
``F.dropout``. ``bench/lora_dropout.py`` measures both.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

LEVELS = 1 << 16


def keep_mask(
    shape: tuple[int, ...], p: float, device: torch.device | str = "cpu", generator: torch.Generator | None = None
) -> torch.Tensor:
    """Bool flags of ``shape``, each True with probability ``1 - round(p * 65536) / 65536``, from ``generator``
    (default: the global generator of ``device``)."""
    count = math.prod(shape)
    words = torch.empty((count + 3) // 4, dtype=torch.int64, device=device)
    words.random_(-(1 << 63), None, generator=generator)
    threshold = round(p * LEVELS) - LEVELS // 2
    return (words.view(torch.int16)[:count] >= threshold).view(shape)


def lora_dropout(x: torch.Tensor, p: float, training: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    """``F.dropout(x, p, training)``, its CPU mask from :func:`keep_mask`; with ``generator``, every mask comes from
    it (a grouped sweep's member draws its own masks), elsewhere than CPU through ``bernoulli_``."""
    if not training or p == 0:
        return x
    if x.device.type == "cpu":
        return x * keep_mask(x.shape, p, x.device, generator) * (1 / (1 - p))
    if generator is None:
        return F.dropout(x, p, training)
    return x * torch.empty_like(x).bernoulli_(1 - p, generator=generator) * (1 / (1 - p))
