"""Fused LoRA linear for training: one down-projection for the layers that share an input, scaling folded in.

peft's LoRA linear computes ``base(x) + B(A(dropout(x))) * scaling`` in every adapted layer: two small
matrix products, a dropout (an identity module at p=0) and an elementwise scale over the whole (tokens,
out_features) output, then an add. Here, in each adapted layer:

- the down-projections of siblings that read the same input (q/k/v of attention, gate/up of the MLP) run as
  one matrix product against their stacked ``A`` weights, rank columns each, on one dropout of that input;
- the scaling, and dropout's 1/(1-p), multiply ``B`` (rank x out elements) instead of the output or the
  input, and the up-projection is added to the base output by one ``addmm``.

Parameters are peft's own, untouched, so ``save_pretrained`` still writes a plain peft adapter. A layer holding
DoRA, a LoRA bias, several active adapters, merged weights or disabled adapters runs peft's forward.

Dropout differs from peft's in two ways, both in how masks are drawn, not in their distribution: siblings share
one mask (peft draws one per layer: 7 per decoder layer instead of 4, and one matrix product needs one input),
and the mask comes from :func:`raylora.ops.dropout.lora_dropout` (on CPU, p rounded to a multiple of 1/32768).
Each layer still computes from its input with every element kept with probability 1 - p and scaled by 1/(1 - p). The reference is peft's forward;
``tests/unit/test_ops_fused_lora.py`` holds the fused path to it.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear
from torch import nn

from raylora.ops.dropout import dropout_scale, lora_dropout
from raylora.ops.lora import plain_lora

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # layers of one parent reading one input


class SharedDown(threading.local):
    """Siblings sharing one down-projection; ``parts`` holds the latest input's results until the parent returns.

    Each adapter has its own parts: in a grouped sweep's forward (:mod:`raylora.train.group`) several adapters
    share the siblings, and the group's members may adapt different subsets of them. Each thread has its own
    input and parts (``threading.local`` runs ``__init__`` again in every thread that uses the object): a group
    runs its members' forwards on several threads at once over the same layers."""

    def __init__(self, members: list[nn.Module]):
        self.members = members
        self.x: torch.Tensor | None = None
        self.parts: dict[tuple[str, int], torch.Tensor] = {}

    def down(self, layer: nn.Module, x: torch.Tensor, adapter: str, dropped) -> torch.Tensor | None:
        """``dropout(x) @ A.T`` of ``layer``'s ``adapter``; the first sibling holding ``adapter`` to see ``x``
        computes every such sibling's at once, on ``dropped()`` (its dropout of the rows the adapter reads). None
        when another sibling holding ``adapter`` should have seen ``x`` first (no shared input to use)."""
        if self.x is not x:
            self.x, self.parts = x, {}
        key = (adapter, id(layer))
        if key not in self.parts:
            holders = [m for m in self.members if adapter in m.lora_A]
            if layer is not holders[0]:
                return None
            weights = [m.lora_A[adapter].weight for m in holders]
            both = F.linear(dropped(), torch.cat(weights))
            keys = [(adapter, id(m)) for m in holders]
            self.parts.update(zip(keys, both.split([w.shape[0] for w in weights], dim=-1), strict=True))
        part = self.parts.pop(key)
        if not self.parts:  # every sibling took its part: keep no reference to x (a recompute may never clear it)
            self.x = None
        return part

    def clear(self, *_) -> None:
        self.x, self.parts = None, {}


def clear_siblings(parent: nn.Module, *_) -> None:
    """A parent module's forward hook: its LoRA children's shared down-projections hold nothing past its forward
    (neither the input nor unused parts: with activation recompute they would keep what it frees)."""
    for child in parent.children():
        if getattr(child, "_raylora_group", None) is not None:
            child._raylora_group.clear()


def siblings(parent: nn.Module) -> list[list[nn.Module]]:
    """The sets of ``parent``'s LoRA linears that read one input (:data:`SIBLINGS`, same ``in_features``)."""
    children = {n: m for n, m in parent.named_children() if isinstance(m, LoraLinear)}
    found = []
    for names in SIBLINGS:
        members = [children[n] for n in names if n in children]
        if len(members) > 1 and len({m.in_features for m in members}) == 1:
            found.append(members)
    return found


def _lora_input(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # autocast casts inside the matmul; without it, a bf16 base feeding fp32 LoRA weights needs the cast
    return x if torch.is_autocast_enabled(x.device.type) else x.to(weight.dtype)


def _dropout(layer: nn.Module) -> tuple[float, bool]:
    """``(p, training)`` of the layer's LoRA dropout (``nn.Dropout`` or ``nn.Identity``)."""
    dropout = layer.lora_dropout[layer.active_adapters[0]]
    return getattr(dropout, "p", 0.0), dropout.training


def _fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``base(x) + (x A^T)(s B)^T`` for one plain LoRA linear; peft's forward for anything else. x: (..., in)."""
    active = self.active_adapters
    if (
        self.disable_adapters
        or self.merged
        or kwargs.get("adapter_names") is not None
        or len(active) != 1
        or active[0] not in self.lora_A
    ):
        return type(self).forward(self, x, *args, **kwargs)
    name = active[0]
    a, b = self.lora_A[name].weight, self.lora_B[name].weight
    result = self.base_layer(x, *args, **kwargs)
    p, training = _dropout(self)

    def dropped() -> torch.Tensor:
        return lora_dropout(_lora_input(x, a), p, training)

    down = self._raylora_group.down(self, x, name, dropped) if self._raylora_group is not None else None
    if down is None:
        down = F.linear(dropped(), a)
    up = (b * (self.scaling[name] * dropout_scale(p, training))).to(down.dtype)
    flat = torch.addmm(result.reshape(-1, result.shape[-1]).to(down.dtype), down.reshape(-1, down.shape[-1]), up.T)
    return flat.reshape(result.shape).to(result.dtype)


def fuse_lora(model: nn.Module) -> int:
    """Give every plain single-adapter LoRA linear of a peft ``model`` the fused forward, in place.

    Args:
        model: a peft model (or any module holding peft LoRA linears).
    Returns:
        The number of layers now running the fused forward; siblings listed in :data:`SIBLINGS` under one
        parent share a down-projection.
    """
    count = 0
    for parent in model.modules():
        children = [m for m in parent.children() if isinstance(m, LoraLinear)]
        for layer in children:
            if not plain_lora(layer, list(layer.lora_A)):
                continue
            layer._raylora_group = None
            layer.forward = _fused_forward.__get__(layer)
            count += 1
        shared = False
        for members in siblings(parent):
            members = [m for m in members if getattr(m, "_raylora_group", 1) is None]
            dropouts = {getattr(m.lora_dropout[m.active_adapters[0]], "p", 0.0) for m in members}
            if len(members) < 2 or len(dropouts) != 1:
                continue
            group = SharedDown(members)
            for m in members:
                m._raylora_group = group
            shared = True
        if shared:
            parent.register_forward_hook(clear_siblings)
    return count
