"""Dropout whose mask is a uniform draw compared with ``p``: ``nn.Dropout``'s distribution, drawn faster on CPU.

peft puts an ``nn.Dropout`` on the input of every LoRA layer, and ``nn.Dropout`` draws its mask with
``bernoulli_``. On this machine class's CPU that took 4.4 ms for one SmolLM2 layer's input (2 x 512 x 576
values), 19% of a training step at dropout 0.05 (``bench/train_throughput.py --profile``); ``torch.rand`` and a
compare draw the same mask in about a third of the time. Each value is kept with probability ``1 - p`` and scaled
by ``1 / (1 - p)``, exactly as ``nn.Dropout`` does; only the random stream differs, so a run is reproducible
under its seed but does not draw peft's masks. The reference is ``nn.Dropout``'s definition; the statistics and
the gradient are checked in ``tests/unit/test_ops_dropout.py``.
"""

from __future__ import annotations

import torch
from torch import nn


class UniformDropout(nn.Dropout):
    """``nn.Dropout(p)`` with the mask drawn as ``uniform[0, 1) >= p``. x: any shape; returns x's shape and dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keep = torch.rand(x.shape, device=x.device) >= self.p
        return x * keep * (1.0 / (1.0 - self.p))


def use_uniform_dropout(model: nn.Module) -> int:
    """Replace every LoRA input dropout of a peft ``model`` that drops anything (``p > 0``) with :class:`UniformDropout`.

    Returns:
        The number of layers changed. The adapter's config, and so what ``save_pretrained`` writes, is unchanged.
    """
    from peft.tuners.lora import LoraLayer

    count = 0
    for layer in model.modules():
        if not isinstance(layer, LoraLayer):
            continue
        for name, dropout in layer.lora_dropout.items():
            if type(dropout) is nn.Dropout and dropout.p > 0:
                layer.lora_dropout[name] = UniformDropout(dropout.p).train(dropout.training)
                count += 1
    return count
