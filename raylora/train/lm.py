"""The model as training runs it: fused LoRA, recompute every N layers, optional compile, and a loss module
returning the summed cross-entropy over label tokens (chunked over the LM head where the model allows it).

:func:`training_model` applies ``train.fused_lora``, ``train.recompute_every``, ``train.chunked_loss`` and
``train.compile`` to a peft model and returns the :class:`LossModel` that DDP wraps, with one line per choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raylora.backends import Backend
from raylora.config import TrainArgs
from raylora.ops.fused_lora import fuse_lora
from raylora.ops.linear_ce import IGNORE_INDEX, label_positions, linear_cross_entropy


class LossModel(nn.Module):
    """What DDP wraps: the peft model's forward to the summed loss, so the all-reduce hooks see every step.

    ``forward(input_ids, labels, position_ids, attention_mask)`` (each (B, T); the mask (B, 1, T, T)) returns
    the cross-entropy summed over label tokens, a 0-d fp32 tensor. With ``chunked`` the decoder's hidden states
    of the label positions go through :func:`~raylora.ops.linear_ce.linear_cross_entropy`; otherwise the
    model's own logits are scored in full.
    """

    def __init__(self, model: nn.Module, chunked: bool):
        super().__init__()
        self.model = model
        self.chunked = chunked

    def forward(self, input_ids, labels, position_ids, attention_mask) -> torch.Tensor:
        if not self.chunked:
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
            return F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(),
                labels[:, 1:].flatten(),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
        causal_lm = self.model.get_base_model()
        hidden = causal_lm.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        rows, targets = label_positions(hidden, labels)
        kind = rows.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        return linear_cross_entropy(rows, causal_lm.get_output_embeddings().weight, targets, dtype)


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
        if not causal_lm.supports_gradient_checkpointing:
            raise ValueError(
                f"train.recompute_every={train.recompute_every}: {type(causal_lm).__name__} does not support "
                "activation checkpointing; set train.recompute_every=0."
            )
        causal_lm.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=train.recompute_every)
        notes.append(f"recompute: every {train.recompute_every} decoder layer(s), non-reentrant")
    chunked = False
    if train.chunked_loss:
        chunked, why = head_is_plain_linear(model)
        notes.append(f"chunked loss: {'on' if chunked else 'off'} ({why})")
    if train.compile:
        compiler = backend.compile_backend()
        for layer in causal_lm.get_decoder().layers:
            layer.compile(backend=compiler)
        notes.append(f"torch.compile: each decoder layer, backend {getattr(compiler, '__name__', compiler)}")
    return LossModel(model, chunked), notes
