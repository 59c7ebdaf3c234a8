"""Causal attention computed example by example inside packed rows.

A pack row holds several examples. The block-causal 4D mask of :mod:`raylora.data.collate` gives each example
exactly its own logits, but sdpa then computes the whole T x T square of every row and masks most of it. Given
the examples' boundaries over the flattened ``(B*T)`` tokens (flash-attention's ``cu_seqlens``, from
:func:`raylora.data.collate.segment_bounds`), each example's causal attention runs on its own: the work is the
sum of n_i^2 / 2 instead of T^2, and a causal kernel needs no mask (on CPU our own, :class:`CausalAttention`;
elsewhere sdpa's). The math is the same; only the summation order differs. A row's padding is one more causal
segment whose outputs nothing reads (its labels are ignored and it comes after every example of its row).

The function is registered with transformers' ``AttentionInterface`` under :data:`NAME`; without boundaries
(evaluation through ``generate``, a model called directly) it is transformers' own sdpa attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NAME = "raylora_packed"
FLASH_FROM = 256  # example length (tokens) from which sdpa_attend() takes sdpa's 4-D (flash) path
OURS_UP_TO = 512  # longest example (tokens) that CausalAttention takes on CPU: it holds (H, n, n) per example


def packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query (B, H, T, D), key and value (B, H_kv, T, D); returns (B, T, H, D).

    With ``cu_seq_lens_q`` (from :func:`~raylora.data.collate.segment_bounds`) each segment attends causally
    within itself and the mask is not read; otherwise, or with attention dropout, this is transformers' sdpa.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None or dropout:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows, heads, width, dim = query.shape

    def flat(x: torch.Tensor) -> torch.Tensor:  # (B, h, T, D) -> (h, B*T, D)
        return x.transpose(0, 1).reshape(x.shape[1], rows * width, dim)

    q, k, v = flat(query), flat(key), flat(value)
    bounds = cu_seq_lens_q.tolist()
    parts = [attend(q[:, s:e], k[:, s:e], v[:, s:e], scaling) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    return torch.cat(parts, dim=1).reshape(heads, rows, width, dim).permute(1, 2, 0, 3), None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Causal attention of one example: q (H, n, D), k and v (H_kv, n, D) -> (H, n, D).

    On CPU up to :data:`OURS_UP_TO` tokens, :class:`CausalAttention` (batched matrix products); otherwise
    :func:`sdpa_attend`: below :data:`FLASH_FROM` tokens sdpa's 3-D call (math kernel, grouped heads), from there
    its 4-D call with repeated key/value heads (flash, which holds one value per row for the backward).
    """
    if q.device.type == "cpu" and q.shape[1] <= OURS_UP_TO:
        return CausalAttention.apply(q, k, v, q.shape[-1] ** -0.5 if scaling is None else scaling)
    return sdpa_attend(q, k, v, scaling)


def sdpa_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """:func:`attend` through sdpa's causal kernels (the path off the CPU)."""
    heads = q.shape[0]
    if q.shape[1] < FLASH_FROM:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=k.shape[0] != heads)
    k, v = (t.repeat_interleave(heads // t.shape[0], dim=0) for t in (k, v))
    return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scaling)[0]


class CausalAttention(torch.autograd.Function):
    """Causal attention of one example in batched matrix products (two forward, four backward), for the CPU.

    The query heads that share a key/value head are stacked, so one ``bmm`` per key head scores them all (no
    repeated keys). Under autocast the products run in its dtype, as sdpa's would; scores, probabilities and their
    gradients stay in that dtype, and softmax and its backward (``dS = P * (dP - rowsum(dP * P))``, aten's own
    ``_softmax_backward_data``, the op autograd runs for softmax) accumulate in fp32 inside, so no fp32 copy of
    the (H, n, n) scores is made. Against sdpa's CPU kernels, forward + backward on 2 cores, SmolLM2's 9 / 3
    heads of 64, bf16: see ``bench/packed_attention.py --kernels``. The cost is memory: the probabilities,
    (H, n, n) per example and layer, are held until the backward (4.7 MB at 512 tokens in bf16, 30 layers:
    141 MB), where the flash kernel keeps one value per row; hence :data:`OURS_UP_TO`.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.dtypes = q.dtype, k.dtype, v.dtype
        kind = q.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else q.dtype
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        kv_heads, n, dim = k.shape
        stacked = q.reshape(kv_heads, -1, dim)  # (H_kv, group * n, D): the group's heads one after another
        scores = torch.bmm(stacked, k.transpose(1, 2)).view(kv_heads, -1, n, n).mul_(scale)
        scores.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
        probs = scores.softmax(-1).view(kv_heads, -1, n)
        ctx.save_for_backward(stacked, k, v, probs)
        ctx.scale = scale
        return torch.bmm(probs, v).view(q.shape)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        stacked, k, v, probs = ctx.saved_tensors
        grad_out = grad_out.reshape(stacked.shape).to(probs.dtype)
        grad_v = torch.bmm(probs.transpose(1, 2), grad_out)
        grad_probs = torch.bmm(grad_out, v.transpose(1, 2))
        grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype).mul_(ctx.scale)
        grad_q = torch.bmm(grad_scores, k).view(-1, k.shape[1], k.shape[2])
        grad_k = torch.bmm(grad_scores.transpose(1, 2), stacked)
        return *(g.to(t) for g, t in zip((grad_q, grad_k, grad_v), ctx.dtypes, strict=True)), None


def use_packed_attention(model: nn.Module) -> bool:
    """Switch a transformers ``model`` whose attention runs through sdpa to :func:`packed_attention`, in place.

    Returns:
        Whether the model now uses it (False for eager, flash or a model that cannot switch).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if model.config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(NAME, packed_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME
