"""The generation engine's attention: a sequence's result does not depend on the batch it runs in.

With sdpa, a sequence's keys and values padded to another width, or its prompt prefilled beside others, changed the
last bits of its attention output (sdpa's CPU kernel splits the keys by the batch's width: one decode row among
others differed from the same row alone in 151 of 160 random cases on 2 cores), and a W8A8 model turns such bits
into other int8 activations, so a greedy answer could differ between `raylora eval` (64 rows) and `raylora serve`
(its own batch). Here:

- a decode step (one query per row) computes scores, softmax and the weighted values with plain matmuls over keys
  padded to whole blocks of :data:`BLOCK` columns (the engine's cache hands them so, :mod:`raylora.kv_slots`), the
  weighted values summed :data:`SUM_KEYS` keys at a time: a row's sums then run over the same columns in the same
  order whatever the batch (none of 600 such cases differ; unpadded, a quarter did);
- a prefill computes each prompt on its own: its queries over its own keys (``prefill``), tiled from its first
  position, shaped exactly as if it were alone.

On a W8A8 base the linears are exact and per token (a float base's own matmuls still vary with the batch's shape),
and the LoRA op sums in float64 on CPU (:mod:`raylora.ops.lora`). So on a W8A8 base on CPU a greedy answer is the same
alone or in any batch, for prompts prefilled whole (not cut into chunks of ``max_prefill_tokens``, not started from
the prefix cache), plain LoRA adapters, and the same number of threads (``tests/unit/test_engine_attention.py``).
Models with sliding windows or logit soft-capping keep their own attention (:func:`plain`).

The function is registered with transformers' ``AttentionInterface`` under :data:`NAME`; the engine selects it for
its own forward passes only (:func:`selected`), so a model that trains between generations keeps its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface

NAME = "raylora_engine"
# Keys are attended in whole blocks of this many columns: padded to whole blocks of 8 or more, a row's result no longer
# depended on the batch's width on this machine's 16-float vectors (4: 8 of 320 cases differed); 16, one AVX-512
# vector, for margin.
BLOCK = 16
# The weighted values are summed over at most this many keys per matmul, the sums added in order: on one of the 2-core
# machines here, MKL splits a longer sum (between 384 and 512 terms) in a way that depends on its length, so one matmul
# over all the keys gave a row other last bits beside wider rows (76 of 300 cases, contexts up to 1,100 keys); by
# sums of 256, none of 600 (nor by 384).
SUM_KEYS = 256
QUERY_TILE = 256  # a prefill's queries computed at a time (bounds its scores' memory)


def _ceil(n: int, step: int) -> int:
    return -(-n // step) * step


def attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked attention with grouped key heads, keys padded to whole blocks of :data:`BLOCK`.

    Args:
        query: (B, H, Q, D); key, value: (B, H_kv, L, D); mask: bool (B, 1, Q, L), True where a query may look.
    Returns:
        (B, H, Q, D).
    """
    b, h, q, d = query.shape
    kv, width = key.shape[1], key.shape[2]
    if width % BLOCK:  # the cache hands a decode step whole blocks; other callers may not
        extra = _ceil(width, BLOCK) - width
        key, value = F.pad(key, (0, 0, 0, extra)), F.pad(value, (0, 0, 0, extra))
        mask = torch.cat([mask, mask.new_zeros(*mask.shape[:-1], extra)], dim=-1)
        width += extra
    group = h // kv
    # the query scaled first: a float16 product of unscaled queries and keys can overflow
    scores = torch.matmul((query * scale).reshape(b, kv, group * q, d), key.transpose(-1, -2))
    scores = scores.view(b, kv, group, q, width).masked_fill_(~mask[:, :, None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).view(b, kv, group * q, width)
    out = torch.matmul(probs[..., :SUM_KEYS], value[:, :, :SUM_KEYS])
    for start in range(SUM_KEYS, width, SUM_KEYS):  # in order; keys past a row's own add zeros
        out = out + torch.matmul(probs[..., start : start + SUM_KEYS], value[:, :, start : start + SUM_KEYS])
    return out.view(b, h, q, d)


def causal(start: int, end: int, width: int, device: torch.device) -> torch.Tensor:
    """(1, 1, end - start, width) bool: queries at positions ``start .. end - 1`` see the keys up to their own."""
    positions = torch.arange(start, end, device=device)
    return (torch.arange(width, device=device)[None, :] <= positions[:, None])[None, None]


def prefill_row(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """One prompt's causal attention: query (1, H, Q, D) at its last Q positions of key and value (1, H_kv, L, D).

    Queries go :data:`QUERY_TILE` at a time, counted from the prompt's first position (so a prompt is tiled the same
    whatever the batch), each over the keys up to its last position, in whole blocks: the scores take
    (H, QUERY_TILE, L) floats, not (H, Q, L)."""
    length, first = key.shape[2], key.shape[2] - query.shape[2]
    width = _ceil(length, BLOCK)
    key, value = F.pad(key, (0, 0, 0, width - length)), F.pad(value, (0, 0, 0, width - length))
    tiles, start = [], first
    while start < length:
        end = min(length, (start // QUERY_TILE + 1) * QUERY_TILE)
        seen = _ceil(end, BLOCK)
        tiles.append(attend(query[:, :, start - first : end - first], key[:, :, :seen], value[:, :, :seen],
                            causal(start, end, seen, query.device), scale))  # fmt: skip
        start = end
    return torch.cat(tiles, dim=2)


def engine_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    prefill: list[tuple[int, int, int]] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query (B, H, Q, D), key and value (B, H_kv, L, D); returns (B, Q, H, D).

    ``prefill`` (the engine's prefill: prompts side by side in one row, B = 1): per prompt, ``(held_at, held,
    count)``: its ``count`` queries follow the previous prompts' in ``query``, its keys are the ``held`` columns from
    ``held_at`` of the keys the cache held before this pass (the first ``L - Q``), then its ``count`` new ones; each
    prompt is computed alone (:func:`prefill_row`). Without it the mask is read (None: causal).

    Raises:
        ValueError: the layer asks for what this attention does not compute (:func:`plain` keeps such models away).
    """
    unsupported = [k for k in ("sliding_window", "softcap", "s_aux") if kwargs.get(k) is not None]
    if unsupported:
        raise ValueError(f"the engine's attention computes plain causal attention; this layer asks for {unsupported}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if prefill is None:
        count, width = query.shape[2], key.shape[2]
        mask = attention_mask if attention_mask is not None else causal(width - count, width, width, query.device)
        out = attend(query, key, value, mask.bool(), scale)
    else:
        past, start, parts = key.shape[2] - query.shape[2], 0, []
        for held_at, held, count in prefill:
            keys, values = (prompt_columns(t, held_at, held, past + start, count) for t in (key, value))
            parts.append(prefill_row(query[:, :, start : start + count], keys, values, scale))
            start += count
        out = torch.cat(parts, dim=2)
    return out.transpose(1, 2).contiguous(), None


def prompt_columns(t: torch.Tensor, held_at: int, held: int, new_at: int, count: int) -> torch.Tensor:
    """One prompt's columns of a packed prefill's keys or values ``t`` (batch 1, dim 2 the columns): the ``held`` from
    ``held_at``, then the ``count`` new ones from ``new_at``; a view when they are adjacent (a prompt that held none,
    or one prompt's next chunk), else a copy."""
    if not held or held_at + held == new_at:
        return t[:, :, new_at - held : new_at + count]
    return torch.cat([t[:, :, held_at : held_at + held], t[:, :, new_at : new_at + count]], dim=2)


# No mask function is registered with it: transformers then builds no mask for it (a decode step hands its own).
AttentionInterface.register(NAME, engine_attention)


def plain(config) -> bool:
    """Whether a text model's attention is what :func:`engine_attention` computes: causal over every earlier key, no
    sliding window (Mistral's, Gemma 2/3's, gpt-oss's), no logit soft-capping (Gemma 2)."""
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    layers = getattr(config, "layer_types", None) or ()
    return not (sliding or getattr(config, "attn_logit_softcapping", None) or "sliding_attention" in layers)


@contextlib.contextmanager
def selected(model: nn.Module) -> Iterator[None]:
    """Run ``model``'s attention through :func:`engine_attention` within the block, its own choice again after; a
    model whose attention is not :func:`plain` keeps its own (and is not batch-invariant). Only the text model's
    config changes (a vision tower keeps its own attention)."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not plain(text):
        yield
        return
    previous = text._attn_implementation_internal
    text._attn_implementation_internal = NAME
    try:
        yield
    finally:
        text._attn_implementation_internal = previous
