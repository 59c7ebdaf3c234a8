"""The model as training runs it: fused LoRA, recompute every N layers, per-example attention in packs,
optional compile, and a loss module returning the summed cross-entropy over label tokens (chunked over the LM
head where the model allows it).

:func:`training_model` applies ``train.fused_lora``, ``train.recompute_every``, ``train.chunked_loss`` and
``train.compile`` to a peft model, switches its sdpa attention to packed attention (not under compile), stores
its frozen linear weights in the autocast dtype, and returns the :class:`LossModel` that DDP wraps, with one line
per choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raylora.backends import Backend
from raylora.config import TrainArgs
from raylora.models import own_weights
from raylora.ops.fused_lora import fuse_lora
from raylora.ops.linear_ce import IGNORE_INDEX, label_positions, linear_cross_entropy
from raylora.ops.packed_attention import use_packed_attention


class LossModel(nn.Module):
    """What DDP wraps: the peft model's forward to the summed loss, so the all-reduce hooks see every step.

    ``forward(input_ids, labels, position_ids, attention_mask, cu_seq_lens)`` (each (B, T); the mask
    (B, 1, T, T); the examples' boundaries, for packed attention) returns the cross-entropy summed over label
    tokens, a 0-d fp32 tensor. With ``chunked`` the decoder's hidden states
    of the label positions go through :func:`~raylora.ops.linear_ce.linear_cross_entropy` (with ``head``, a
    frozen head's weight already in the autocast dtype, when autocast runs in that dtype: casting SmolLM2's
    tied 49,152 x 576 head took 16 ms a micro-batch); otherwise the model's own logits are scored in full.
    """

    def __init__(self, model: nn.Module, chunked: bool, head: torch.Tensor | None = None):
        super().__init__()
        self.model = model
        self.chunked = chunked
        self.head = head  # the frozen head's weight cast once to the autocast dtype (a copy: not a parameter or buffer)

    def forward(self, input_ids, labels, position_ids, attention_mask, cu_seq_lens=None) -> torch.Tensor:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        if cu_seq_lens is not None:
            inputs["cu_seq_lens_q"] = cu_seq_lens
        if not self.chunked:
            logits = self.model(**inputs).logits
            return F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(),
                labels[:, 1:].flatten(),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
        causal_lm = self.model.get_base_model()
        hidden = causal_lm.get_decoder()(**inputs).last_hidden_state
        rows, targets = label_positions(hidden, labels)
        kind = rows.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        head = (
            self.head
            if self.head is not None and dtype == self.head.dtype
            else causal_lm.get_output_embeddings().weight
        )
        return linear_cross_entropy(rows, head, targets, dtype)


def head_is_plain_linear(model: nn.Module) -> tuple[bool, str]:
    """Probe whether the model's logits are exactly ``decoder output @ output embeddings.T`` (no bias, soft-cap
    or scale), on 8 tokens: the condition for scoring label positions through the chunked head."""
    causal_lm = model.get_base_model()
    head = causal_lm.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        return False, "the LM head is not a bias-free linear layer"
    ids = torch.arange(8, device=head.weight.device)[None] % head.weight.shape[0]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
        ours = (causal_lm.get_decoder()(input_ids=ids).last_hidden_state @ head.weight.T).float()
    model.train(was_training)
    if not torch.allclose(logits, ours, rtol=1e-4, atol=1e-4):
        return False, f"{type(causal_lm).__name__} transforms its logits after the head (soft-cap or scale)"
    return True, "logits are the head's matmul"


def store_frozen_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Convert the frozen weights of ``model``'s linear layers to ``dtype`` (the autocast dtype), in place, once.

    Autocast casts a weight that needs no gradient again at every call (its cast cache keeps only leaves that
    require grad), and keeps the cast copy for the backward: for SmolLM2-135M that is a full read and a
    half-size write of the base model per forward, and as much again held until the backward. Under autocast
    the matrix products see the same rounded values either way, so results do not change. Embeddings (and a
    head tied to them) and norms keep their precision: the residual stream stays as autocast leaves it. The
    model then runs only under autocast (a matrix product mixing fp32 inputs and these weights fails).

    The tensors left in the checkpoint file's memory map (embeddings, norms) are copied out so that the mapping
    closes (:func:`raylora.models.own_weights`; SmolLM2-135M: 390 MB less resident).

    Returns:
        The number of weight matrices converted.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    count, converted = 0, set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and not weight.requires_grad and id(weight) not in embeddings:
            weight.data = weight.data.to(dtype)
            converted.add(id(weight))
            count += 1
    own_weights(model, frozenset(converted))
    return count


PRE_NORM_MODELS = ("llama", "mistral", "qwen2", "qwen3")  # model types whose norms below only feed linear layers
PRE_NORMS = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm")


def autocast_outputs(causal_lm: nn.Module, dtype: torch.dtype) -> int:
    """Make the decoder's pre-norms, final norm and rotary embedding return ``dtype`` under autocast, in place.

    They compute in fp32 and return fp32 under autocast, so every linear layer reading a norm's output casts it
    again (q, k and v each, and the LoRA down-projection: four casts of one tensor, and four casts back in the
    backward), and RoPE turns the bf16 queries and keys into fp32 ones that attention casts back. Cast once at
    the source, the linear layers see the values they saw (a 0/1 dropout mask keeps them exact); RoPE's products
    round to ``dtype``, as in a bf16 model. Only for :data:`PRE_NORM_MODELS`, where these norms feed linear
    layers alone: the residual stream stays fp32 (a post-norm model adds its norms' outputs to it). Calling it
    again on the same model changes nothing more.

    Returns:
        The number of modules that return ``dtype`` (0 for other model types).
    """
    if causal_lm.config.model_type not in PRE_NORM_MODELS:
        return 0

    def cast(module, args, output):
        if not torch.is_autocast_enabled((output[0] if isinstance(output, tuple) else output).device.type):
            return output
        return tuple(t.to(dtype) for t in output) if isinstance(output, tuple) else output.to(dtype)

    count = 0
    for name, module in causal_lm.get_decoder().named_modules():
        if name.rsplit(".", 1)[-1] in PRE_NORMS or name in ("norm", "rotary_emb"):
            if not getattr(module, "_raylora_cast", False):
                module.register_forward_hook(cast)
                module._raylora_cast = True
            count += 1
    return count


def enable_recompute(causal_lm: nn.Module, every: int) -> None:
    """Recompute the activations of every ``every``-th decoder layer in the backward (non-reentrant checkpoints).

    Raises:
        ValueError: a model transformers cannot checkpoint.
    """
    if not causal_lm.supports_gradient_checkpointing:
        raise ValueError(
            f"train.recompute_every={every}: {type(causal_lm).__name__} does not support activation checkpointing; "
            "set train.recompute_every=0."
        )
    causal_lm.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=every)


def training_model(model: nn.Module, train: TrainArgs, backend: Backend) -> tuple[LossModel, list[str]]:
    """Apply the training-speed options to a peft ``model`` (in place) and wrap it for the loop.

    Returns:
        ``(loss model, notes)``: one human-readable note per option, for the log and MLflow.
    Raises:
        ValueError: ``train.recompute_every`` on a model transformers cannot checkpoint.
    """
    notes = [f"precision: {backend.precision_by or backend.precision}"]
    if train.fused_lora:
        notes.append(f"fused LoRA: {fuse_lora(model)} layers")
    causal_lm = model.get_base_model()
    if train.recompute_every:
        enable_recompute(causal_lm, train.recompute_every)
        notes.append(f"recompute: every {train.recompute_every} decoder layer(s), non-reentrant")
    chunked = False
    if train.chunked_loss:
        chunked, why = head_is_plain_linear(model)
        notes.append(f"chunked loss: {'on' if chunked else 'off'} ({why})")
    if train.compile:
        notes.append("attention: sdpa over the block mask (per-example attention would recompile per batch)")
    elif use_packed_attention(causal_lm):
        notes.append("attention: each packed example on its own (raylora_packed)")
    head = None
    if backend.amp_dtype is not None:
        count = store_frozen_linears(model, backend.amp_dtype)
        notes.append(f"frozen linear weights stored in {backend.precision}: {count} matrices")
        count = autocast_outputs(causal_lm, backend.amp_dtype)
        kind = causal_lm.config.model_type
        notes.append(
            f"norm and rotary outputs in {backend.precision}: {count} modules"
            if count
            else f"norm and rotary outputs in fp32 ({kind} is not a pre-norm model we list)"
        )
        weight = causal_lm.get_output_embeddings().weight
        head = weight.detach().to(backend.amp_dtype) if chunked and not weight.requires_grad else None
    if train.compile:
        compiler = backend.compile_backend()
        for layer in causal_lm.get_decoder().layers:
            layer.compile(backend=compiler)
        notes.append(f"torch.compile: each decoder layer, backend {getattr(compiler, '__name__', compiler)}")
        if warning := backend.compile_warning():
            notes.append(f"warning: {warning}")
    return LossModel(model, chunked, head), notes
