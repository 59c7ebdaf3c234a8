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

The generation engine names each forward pass's adapters with :func:`adapters_of` instead of peft's ``adapter_names``
argument when every LoRA layer of the model is stacked (:func:`stacked`): peft installs its per-call hooks by walking
every module of the model at each forward pass, whatever the batch (with them gone, and the prefill packed,
``bench/invariance.py``'s batch-1 decode on a model holding 4 adapters went from 18.9 to 32.4 tok/s). :func:`adapters_of` also names the adapters of a packed row (several prompts
side by side in one row, the engine's prefill), which peft's per-row argument cannot.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
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
    count, others = 0, 0
    for layer in model.modules():
        if not isinstance(layer, LoraLayer):
            continue
        names = [n for n in layer.lora_A if n in layer.lora_B] if isinstance(layer, LoraLinear) else []
        if not names or not plain_lora(layer, names):
            for attribute in ("_mixed_batch_forward", "forward"):
                layer.__dict__.pop(attribute, None)
            others += bool(getattr(layer, "lora_A", None) or getattr(layer, "lora_embedding_A", None))
            continue
        layer._raylora_stack = _build(layer, names)
        layer._mixed_batch_forward = _stacked_forward.__get__(layer)
        layer.forward = _named_forward.__get__(layer)
        count += 1
    model._raylora_stacked = count > 0 and not others
    return count


def stacked(model: nn.Module) -> bool:
    """Whether every LoRA layer of ``model`` holding an adapter runs the stacked op (:func:`adapters_of` then names a
    forward pass's adapters)."""
    return getattr(model, "_raylora_stacked", False)


_batch = threading.local()  # the adapters of the forward pass in flight on this thread (adapters_of)


@contextlib.contextmanager
def adapters_of(names: list[str], counts: list[int] | None = None) -> Iterator[None]:
    """Within the block, a forward pass of a :func:`stacked` model on this thread applies adapter ``names[i]``
    (:data:`BASE`: none) to batch row ``i``, or with ``counts`` to the ``i``-th run of ``counts[i]`` tokens of a
    single packed row."""
    _batch.names, _batch.counts, _batch.chosen = names, counts, {}
    try:
        yield
    finally:
        _batch.names, _batch.chosen = None, {}


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
    """peft's mixed-batch forward: ``base(x) + x A_i B_i s_i`` per row ``i``; ``x`` is (batch, tokens, in_features)."""
    for key in ("alora_offsets",):
        kwargs.pop(key, None)
    return _add_lora(self, x, self.base_layer(x, *args, **kwargs), _choice(self._raylora_stack, adapter_names, None))


def _named_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A stacked layer's forward: the adapters :func:`adapters_of` names, else peft's own forward."""
    names = getattr(_batch, "names", None)
    if names is None or self.disable_adapters or self.merged:
        return type(self).forward(self, x, *args, **kwargs)
    stack: _Stack = self._raylora_stack
    key = (tuple(stack.slots), stack.rank)  # layers with the same adapters in the same blocks choose alike
    chosen = _batch.chosen.get(key)
    if chosen is None:
        chosen = _batch.chosen[key] = _choice(stack, names, _batch.counts)
    return _add_lora(self, x, self.base_layer(x, *args, **kwargs), chosen)


def _choice(stack: _Stack, names: list[str], counts: list[int] | None):
    """The column blocks of ``stack`` that a batch of rows (or packed runs of ``counts`` tokens) using adapters
    ``names`` needs, as indices (None: all of them), and the (tokens or rows, columns) 0/1 matrix that keeps each
    token's own block (None: every row uses the same); None when no row uses an adapter of ``stack``."""
    blocks = [stack.slots.get(n, -1) for n in names]  # -1: the base model, no LoRA
    used = sorted(set(blocks) - {-1})
    if not used:
        return None
    r = stack.rank
    columns = torch.cat([torch.arange(k * r, (k + 1) * r) for k in used]) if len(used) < len(stack.slots) else None
    keep = None
    if len(used) > 1 or -1 in blocks:  # rows differ: each keeps only its own adapter's block
        own = torch.tensor([used.index(k) if k >= 0 else -1 for k in blocks])
        if counts is not None:
            own = own.repeat_interleave(torch.tensor(counts))
        block = torch.arange(len(used)).repeat_interleave(r)
        keep = (own[:, None] == block[None, :]).to(device=stack.a.device, dtype=stack.a.dtype)
    return columns, keep


def _add_lora(self, x: torch.Tensor, result: torch.Tensor, chosen) -> torch.Tensor:
    if chosen is None:
        return result
    stack: _Stack = self._raylora_stack
    columns, keep = chosen
    a, b = (stack.a, stack.b) if columns is None else (stack.a[:, columns], stack.b[columns])
    h = x.to(a.dtype) @ a  # (batch, tokens, len(used) * rank)
    if keep is not None:
        h = h * keep.view(h.shape[0], -1, keep.shape[-1])
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
