"""Causal attention computed example by example inside packed rows.

A pack row holds several examples. The block-causal 4D mask of :mod:`raylora.data.collate` gives each example
exactly its own logits, but sdpa then computes the whole T x T square of every row and masks most of it. Given
the examples' boundaries over the flattened ``(B*T)`` tokens (flash-attention's ``cu_seqlens``, from
:func:`raylora.data.collate.segment_bounds`), each example's causal attention runs on its own: the work is the
sum of n_i^2 / 2 instead of T^2 (on CPU our own kernel, :class:`CausalAttention`, over all examples at once; on an
Ascend NPU torch_npu's fused kernel for packed sequences, :func:`npu_fusion_attention`, in one call; elsewhere sdpa's,
example by example, the portable reference). The math is the same; only the summation order differs. A row's padding
is a few more causal segments whose outputs nothing reads (its labels are ignored and it comes after every
example of its row).

A preference pair's second sequence reads the first one's prompt (prefix sharing, :mod:`raylora.data.pairs`): with
``shared_prefix`` (:func:`raylora.data.collate.segment_shared`) a segment's queries attend to that many leading keys
of the segment before it, then causally to their own. Our kernel and the per-example path take such segments; the
NPU's fused kernel is given only batches without them (its TND layout has no way to say it), so on an NPU a batch
of pairs takes the per-example path.

The function is registered with transformers' ``AttentionInterface`` under :data:`NAME`; without boundaries
(evaluation through ``generate``, a model called directly) it is transformers' own sdpa attention.
"""

from __future__ import annotations

import functools
import importlib
import itertools

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "raylora_packed"
FLASH_FROM = 256  # example length (tokens) from which sdpa_attend() takes sdpa's 4-D (flash) path
OURS_UP_TO = 512  # longest example (tokens) that CausalAttention takes on CPU: it holds its probabilities
FUSED_ON = "npu"  # the device type whose packed batches go to npu_fusion_attention()
# torch_npu documents npu_fusion_attention's TND (varlen) layout for at most 1K sequences a call; a batch of more
# segments (many short examples) takes the per-example path
FUSED_MAX_SEGMENTS = 1024


def packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    shared_prefix: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query (B, H, T, D), key and value (B, H_kv, T, D); returns (B, T, H, D).

    With ``cu_seq_lens_q`` (from :func:`~raylora.data.collate.segment_bounds`) each segment attends causally
    within itself, and to the ``shared_prefix`` leading keys of the segment before it, and the mask is not read;
    otherwise, or with attention dropout, this is transformers' sdpa (over the mask, which says the same).
    """
    if cu_seq_lens_q is None or dropout:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows, heads, width, dim = query.shape
    bounds = tuple(cu_seq_lens_q.tolist())
    shared = tuple(shared_prefix.tolist()) if shared_prefix is not None and bool(shared_prefix.any()) else None
    scale = dim**-0.5 if scaling is None else scaling
    if query.device.type == FUSED_ON and shared is None and len(bounds) - 1 <= FUSED_MAX_SEGMENTS:
        tnd = [x.transpose(1, 2).reshape(rows * width, x.shape[1], dim) for x in (query, key, value)]
        return npu_fusion_attention(*tnd, scale, bounds).reshape(rows, width, heads, dim), None

    def flat(x: torch.Tensor) -> torch.Tensor:  # (B, h, T, D) -> (h, B*T, D)
        return x.transpose(0, 1).reshape(x.shape[1], rows * width, dim)

    q, k, v = flat(query), flat(key), flat(value)
    spans = segment_spans(bounds, shared)
    if q.device.type == "cpu" and max(e - s + pe - ps for ps, pe, s, e in spans) <= OURS_UP_TO:
        out = CausalAttention.apply(q, k, v, scale, bounds, shared)  # one node for all segments
    else:
        out = torch.cat(
            [attend(q[:, s:e], _keys(k, ps, pe, s, e), _keys(v, ps, pe, s, e), scale, pe - ps) for ps, pe, s, e in spans],
            dim=1,
        )  # fmt: skip
    return out.reshape(heads, rows, width, dim).permute(1, 2, 0, 3), None


def segment_spans(bounds: tuple[int, ...], shared: tuple[int, ...] | None) -> list[tuple[int, int, int, int]]:
    """Each segment as ``(prefix start, prefix end, start, end)``: its shared prefix, the first ``shared[j]`` keys
    of the segment before it (empty without one), then its own tokens."""
    starts = bounds[:-1]
    return [
        (starts[j - 1], starts[j - 1] + shared[j], s, e) if shared and shared[j] else (s, s, s, e)
        for j, (s, e) in enumerate(itertools.pairwise(bounds))
    ]


def _keys(t: torch.Tensor, ps: int, pe: int, s: int, e: int) -> torch.Tensor:
    """``t``'s (H_kv, N, D) keys or values a segment ``[s, e)`` reads: its shared prefix ``[ps, pe)``, then its own."""
    return t[:, s:e] if ps == pe else torch.cat([t[:, ps:pe], t[:, s:e]], dim=1)


@functools.lru_cache(maxsize=8)
def _compressed_causal_mask(device: torch.device) -> torch.Tensor:
    """The 2048 x 2048 mask ``npu_fusion_attention`` reads in its causal sparse modes: True above the diagonal
    (masked), whatever the sequences' lengths."""
    return torch.ones(2048, 2048, dtype=torch.bool, device=device).triu_(1)


def npu_fusion_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bounds: tuple[int, ...]
) -> torch.Tensor:
    """Causal attention of each segment of a packed batch on its own, in one call to torch_npu's fused kernel.

    ``torch_npu.npu_fusion_attention`` in its TND layout (tokens, heads, head dim: the batch's rows end to end), with
    each segment's end as the cumulative ``actual_seq_qlen`` / ``actual_seq_kvlen`` (lengths 9, 6, 7 -> 9, 15, 22:
    no leading 0), and ``sparse_mode=3`` (causal from the bottom-right corner of each segment's square, equal to the
    top-left one since queries and keys are the same tokens) with the compressed 2048 x 2048 causal mask that mode
    reads. It takes fewer key/value heads than query heads (grouped-query attention) as they are. Under autocast
    q, k and v run in its dtype, as sdpa's inputs would (the kernel wants one dtype).

    Args:
        q: (N, H, D); k, v: (N, H_kv, D), H a multiple of H_kv.
        scale: the softmax scale.
        bounds: the segments' boundaries ``(0, ..., N)``.
    Returns:
        (N, H, D).
    """
    torch_npu = importlib.import_module("torch_npu")  # only NPU tensors come here, and torch_npu made them
    kind = q.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else q.dtype
    ends = list(bounds[1:])
    return torch_npu.npu_fusion_attention(
        q.to(dtype), k.to(dtype), v.to(dtype), head_num=q.shape[1], input_layout="TND",
        atten_mask=_compressed_causal_mask(q.device), scale=scale, sparse_mode=3,
        actual_seq_qlen=ends, actual_seq_kvlen=ends,
    )[0]  # fmt: skip


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None, prefix: int = 0) -> torch.Tensor:
    """Causal attention of one example: q (H, n, D), k and v (H_kv, prefix + n, D) -> (H, n, D); the first
    ``prefix`` keys (a shared prompt) come before the example's own and every query reads them.

    On CPU up to :data:`OURS_UP_TO` tokens and without a prefix, :class:`CausalAttention` (batched matrix products);
    otherwise :func:`sdpa_attend`: below :data:`FLASH_FROM` tokens sdpa's 3-D call (math kernel, grouped heads), from there
    its 4-D call with repeated key/value heads (flash, which holds one value per row for the backward).
    """
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    if q.device.type == "cpu" and q.shape[1] <= OURS_UP_TO and not prefix:
        return CausalAttention.apply(q, k, v, scale)
    return sdpa_attend(q, k, v, scaling, prefix)


def sdpa_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None, prefix: int = 0
) -> torch.Tensor:
    """:func:`attend` through sdpa's kernels (the path off the CPU): causal, or with a shared prefix the causal mask
    from the bottom-right corner (every query reads the prefix)."""
    heads, n = q.shape[0], q.shape[1]
    mask = torch.ones(n, prefix + n, dtype=torch.bool, device=q.device).tril_(prefix) if prefix else None
    if n < FLASH_FROM:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=k.shape[0] != heads
        )
    k, v = (t.repeat_interleave(heads // t.shape[0], dim=0) for t in (k, v))
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None, scale=scaling
    )[0]


QUERY_BLOCK = 128  # query rows per block of a long example (CausalAttention)
SPLIT_FROM = 256  # example length (tokens) from which CausalAttention splits an example's queries into blocks


def query_blocks(start: int, end: int) -> list[tuple[int, int]]:
    """The query blocks of the example ``[start, end)``: the whole example below :data:`SPLIT_FROM` tokens, else
    ``ceil(n / QUERY_BLOCK)`` blocks of near-equal size. Block ``[s, e)`` attends to the keys ``[start, e)``."""
    n = end - start
    count = 1 if n < SPLIT_FROM else -(-n // QUERY_BLOCK)
    cuts = [start + n * i // count for i in range(count + 1)]
    return list(itertools.pairwise(cuts))


@functools.lru_cache(maxsize=64)
def _causal_bias(rows: int, keys: int, group: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(group * rows, keys): 0 where a query may attend, -inf elsewhere, for the last ``rows`` queries of an example
    over its first ``keys`` keys (query i sits at position ``keys - rows + i``), for ``group`` query heads stacked
    one after another. Cached: every layer of a step sees the same example lengths (at most 64 entries: 25 MB
    for SmolLM2's 3-head groups in bf16: an unsplit example is at most 255 x 255, a block at most 128 x 512)."""
    bias = torch.zeros(rows, keys, dtype=dtype, device=device)
    above = torch.ones(rows, keys, dtype=torch.bool, device=device).triu_(keys - rows + 1)
    return bias.masked_fill_(above, float("-inf")).repeat(group, 1)


class CausalAttention(torch.autograd.Function):
    """Causal attention of each segment (example) of a sequence on its own, in batched matrix products (two
    forward, four backward per query block), for the CPU.

    ``apply(q, k, v, scale, bounds=None, shared=None)``: q (H, N, D), k and v (H_kv, N, D) -> (H, N, D); ``bounds``:
    the segments' boundaries ``(0, ..., N)`` (default: one segment); ``shared``: each segment's count of leading keys
    of the segment before it that its queries read first (a preference pair's prompt, :func:`segment_spans`). One autograd node for all segments: the
    gradients are written into whole (H, N, D) tensors, with no per-segment slices for autograd to zero-fill
    and sum. The query heads that share a key/value head are stacked, so one ``baddbmm`` per key head scores
    them all (no repeated keys), adding the causal mask (cached per shape) and scaling in the same call. Under
    autocast the products run in its dtype, as sdpa's would; scores, probabilities and their gradients stay in
    that dtype, and softmax and its backward (``dS = P * (dP - rowsum(dP * P))``, aten's own
    ``_softmax_backward_data``, the op autograd runs for softmax) accumulate in fp32 inside, so no fp32 copy of
    the scores is made.

    An example of :data:`SPLIT_FROM` tokens or more runs as blocks of about :data:`QUERY_BLOCK` queries
    (:func:`query_blocks`), each scoring only the keys up to its last query: of the square's masked half only the
    triangles inside the diagonal blocks are computed (at 512 tokens, 4 blocks compute 62.5% of the square), and
    a block's scores stay in cache through softmax and the products. Against the whole square per example,
    forward + backward, bf16, 2 threads: ``bench/packed_attention.py --blocks``; against sdpa's CPU kernels:
    ``--kernels``. Under autocast, each block adds its keys' and values' gradients to the example's in bf16 (4
    roundings at 512 tokens; held to sdpa's error by the tests). The cost is memory: the probabilities, (H, rows,
    keys) per block and layer, are held until the backward (2.9 MB for a 512-token example in bf16, 30 layers:
    88 MB), where the flash kernel keeps one value per row; hence :data:`OURS_UP_TO`.
    """

    @staticmethod
    def forward(
        ctx, q, k, v, scale: float, bounds: tuple[int, ...] | None = None, shared: tuple[int, ...] | None = None
    ):
        ctx.dtypes = q.dtype, k.dtype, v.dtype
        kind = q.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else q.dtype
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        kv_heads, group = k.shape[0], q.shape[0] // k.shape[0]
        blocks = [
            (ps, pe, s, qs, qe)
            for ps, pe, s, e in segment_spans(bounds or (0, q.shape[1]), shared)
            for qs, qe in query_blocks(s, e)
        ]
        out = torch.empty_like(q)
        probs = []
        for ps, pe, s, qs, qe in blocks:
            stacked = q[:, qs:qe].reshape(
                kv_heads, -1, q.shape[2]
            )  # (H_kv, group * rows, D): the group's heads in turn
            bias = _causal_bias(qe - qs, pe - ps + qe - s, group, dtype, q.device)
            keys = _keys(k, ps, pe, s, qe).transpose(1, 2)
            probs.append(torch.baddbmm(bias, stacked, keys, alpha=scale).softmax(-1))
            out[:, qs:qe] = torch.bmm(probs[-1], _keys(v, ps, pe, s, qe)).view(q.shape[0], qe - qs, q.shape[2])
        ctx.save_for_backward(q, k, v, *probs)
        ctx.scale, ctx.blocks = scale, blocks
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, *probs = ctx.saved_tensors
        grad_out = grad_out.to(probs[0].dtype)
        # every block of an example adds to the gradients of the keys and values it read
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        kv_heads, dim = k.shape[0], k.shape[2]
        for (ps, pe, s, qs, qe), p in zip(ctx.blocks, probs, strict=True):
            stacked = q[:, qs:qe].reshape(kv_heads, -1, dim)
            grad = grad_out[:, qs:qe].reshape(kv_heads, -1, dim)
            grad_scores = torch._softmax_backward_data(
                torch.bmm(grad, _keys(v, ps, pe, s, qe).transpose(1, 2)), p, -1, p.dtype
            )
            grad_q[:, qs:qe] = torch.bmm(grad_scores, _keys(k, ps, pe, s, qe)).mul_(ctx.scale).view(-1, qe - qs, dim)
            if ps == pe:
                grad_v[:, s:qe].baddbmm_(p.transpose(1, 2), grad)
                grad_k[:, s:qe].baddbmm_(grad_scores.transpose(1, 2), stacked, alpha=ctx.scale)
                continue
            n = pe - ps  # the shared prefix's keys come first in the block's scores
            for into, part in ((grad_v, torch.bmm(p.transpose(1, 2), grad)),
                               (grad_k, torch.bmm(grad_scores.transpose(1, 2), stacked).mul_(ctx.scale))):  # fmt: skip
                into[:, ps:pe] += part[:, :n]
                into[:, s:qe] += part[:, n:]
        return *(g.to(t) for g, t in zip((grad_q, grad_k, grad_v), ctx.dtypes, strict=True)), None, None, None


def use_packed_attention(model: nn.Module) -> bool:
    """Switch a transformers ``model`` whose attention runs through sdpa to :func:`packed_attention`, in place.

    Returns:
        Whether the model now uses it (False for eager, flash or a model that cannot switch).
    """
    if model.config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(NAME, packed_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME
