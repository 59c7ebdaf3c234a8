"""Mixed-adapter LoRA for a batch: two matmuls per layer, whatever the number of adapters.

peft's mixed-batch forward (``adapter_names``, the reference this op is tested against) runs, in every LoRA
linear, an index, two matmuls and a scatter for each distinct adapter in the batch; with 8 adapters in a
16-row decode batch those small ops cost about a quarter of the throughput on 2 CPU cores. Here each layer keeps
its adapters side by side (``lora_A`` as column blocks of one matrix, ``lora_B`` as row blocks of another); a
batch multiplies by the blocks of the adapters it uses, zeroes in each row the blocks of the others, and
multiplies by their ``lora_B`` blocks. Gathering each row's own factors instead (two ``bmm`` of (rows, in, rank)
copies) cost 29% of a 64-row mixed-adapter decode of SmolLM2 W8A8 on 2 cores.

On CPU the two matmuls run in float64 and their sum is rounded once to the layer's dtype: a float32 matmul's sums follow
the batch's shape (MKL takes other kernels for 1-3 rows than for 4 or more, and for other widths), so a row's
LoRA output changed in its last bits with the rows beside it and a W8A8 base could answer otherwise; in float64 those
differences stay far below float32's rounding (0 of 161,280 outputs differed across batch shapes, against most in
float32), so a row's result is its own (:mod:`raylora.ops.engine_attention`).

Only plain LoRA on ``nn.Linear`` is stacked; a layer holding DoRA, a LoRA bias or int4-stored factors keeps
peft's own path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from peft.tuners.lora import Linear as LoraLinear
from torch import nn

from raylora.ops.int4 import Int4Linear

BASE = "__base__"


@dataclass
class _Stack:
    slots: dict[str, int]  # adapter name -> its block in a and b, from 0
    rank: int  # columns of a block: the largest rank, smaller ones zero-padded
    a: torch.Tensor  # (in_features, adapters * rank), float64 on CPU: lora_A transposed, one column block per adapter
    b: torch.Tensor  # (adapters * rank, out_features), float64 on CPU: lora_B transposed, times the adapter's scaling


def stack_adapters(model: nn.Module) -> int:
    """(Re)build the stacks of every plain-LoRA linear in a peft ``model``; call after loading or deleting adapters.

    Returns:
        The number of layers that now use the stacked forward.
    """
    count = 0
    for layer in model.modules():
        if not isinstance(layer, LoraLinear):
            continue
        names = [n for n in layer.lora_A if n in layer.lora_B]
        if not plain_lora(layer, names) or not names:
            layer.__dict__.pop("_mixed_batch_forward", None)
            continue
        layer._raylora_stack = _build(layer, names)
        layer._mixed_batch_forward = _stacked_forward.__get__(layer)
        count += 1
    return count


def plain_lora(layer, names: list[str]) -> bool:
    """Whether the adapters ``names`` of a peft LoRA linear are plain LoRA: no DoRA or other variant, no LoRA
    bias, no int4-stored factors (the layers the stacked and fused ops take over)."""
    return all(
        n in layer.lora_B
        and n not in layer.lora_variant
        and not isinstance(layer.lora_A[n], Int4Linear)
        and not isinstance(layer.lora_B[n], Int4Linear)
        and layer.lora_B[n].bias is None
        for n in names
    )


def _build(layer, names: list[str]) -> _Stack:
    rank = max(layer.lora_A[n].weight.shape[0] for n in names)
    ref = layer.lora_A[names[0]].weight
    # float64 on CPU (module docs); elsewhere the factors' dtype: GPUs run float64 matmuls at a fraction of float32's
    # speed, and Ascend's cube units have none
    dtype = torch.float64 if ref.device.type == "cpu" else ref.dtype
    a = ref.new_zeros(layer.in_features, len(names) * rank, dtype=dtype)
    b = ref.new_zeros(len(names) * rank, layer.out_features, dtype=dtype)
    for i, n in enumerate(names):
        wa, wb = layer.lora_A[n].weight.detach(), layer.lora_B[n].weight.detach()
        a[:, i * rank : i * rank + wa.shape[0]] = wa.T
        b[i * rank : i * rank + wb.shape[1]] = (wb * layer.scaling[n]).T
    return _Stack({n: i for i, n in enumerate(names)}, rank, a, b)


def _stacked_forward(self, x: torch.Tensor, *args, adapter_names: list[str], **kwargs) -> torch.Tensor:
    """``base(x) + x A_i B_i s_i`` per row ``i``; ``x`` is (batch, tokens, in_features)."""
    for key in ("alora_offsets",):
        kwargs.pop(key, None)
    result = self.base_layer(x, *args, **kwargs)
    stack: _Stack = self._raylora_stack
    blocks = [stack.slots.get(n, -1) for n in adapter_names]  # -1: the base model, no LoRA
    used = sorted(set(blocks) - {-1})
    if not used:
        return result
    r = stack.rank
    columns = torch.cat([torch.arange(k * r, (k + 1) * r) for k in used]) if len(used) < len(stack.slots) else None
    a, b = (stack.a, stack.b) if columns is None else (stack.a[:, columns], stack.b[columns])
    h = x.to(a.dtype) @ a  # (batch, tokens, len(used) * rank)
    if len(used) > 1 or -1 in blocks:  # rows differ: each keeps only its own adapter's block
        own = torch.tensor([used.index(k) if k >= 0 else -1 for k in blocks], device=x.device)
        block = torch.arange(len(used), device=x.device).repeat_interleave(r)
        h = h * (own[:, None] == block[None, :]).to(h.dtype)[:, None, :]
    return result + (h @ b).to(result.dtype)


def mixed_batch_reference(model: nn.Module, input_ids: torch.Tensor, adapter_names: list[str]) -> torch.Tensor:
    """Logits of each row alone with its adapter (peft's ``set_adapter`` path, or the base model), stacked."""
    rows = []
    for row, name in zip(input_ids, adapter_names, strict=True):
        if name == BASE:
            with model.disable_adapter():
                rows.append(model(row[None]).logits)
        else:
            model.set_adapter(name)
            rows.append(model(row[None]).logits)
    return torch.cat(rows)
