"""Preference objectives on chosen / rejected answers: DPO (sigmoid, IPO), SimPO and ORPO, as TRL computes them.

A preference pack holds whole pairs, each as two consecutive examples (:mod:`raylora.data.preference`): example
``2i`` is the prompt with the chosen answer, ``2i + 1`` the same prompt with the rejected one, the prompt masked
out of the labels. One forward over the pack gives every answer's log-probability (the sum over its label tokens,
or that sum over their count where the objective averages), read off the label positions through the chunked head
(:func:`~raylora.ops.linear_ce.linear_token_losses`). DPO's reference is the same model with the adapter off (peft's
``disable_adapter``), run without gradients: never a second copy of the weights.

Per pair, with ``c`` / ``r`` the policy's log-probabilities of the chosen / rejected answer and ``c0`` / ``r0`` the
reference's (TRL's ``DPOTrainer``, ``CPOTrainer`` with ``loss_type="simpo"`` and ``cpo_alpha=0``, ``ORPOTrainer``):

- dpo, sigmoid: ``z = (c - c0) - (r - r0)``; ``-(1 - ls) logsigmoid(beta z) - ls logsigmoid(-beta z)``
- dpo, ipo: the same ``z`` on length-averaged log-probabilities; ``(z - 1 / (2 beta))^2``
- simpo (averaged): ``z = c - r - gamma / beta``; ``-(1 - ls) logsigmoid(beta z) - ls logsigmoid(-beta z)``
- orpo (averaged): ``-beta logsigmoid((c - r) - (log(1 - e^c) - log(1 - e^r)))``, plus the chosen answers'
  cross-entropy per token.

Rewards are ``beta (c - c0)`` and ``beta (r - r0)`` (``beta c`` and ``beta r`` without a reference); the metrics
carry TRL's names.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from raylora.config import PreferenceArgs
from raylora.data.collate import collate_packs
from raylora.ops.linear_ce import IGNORE_INDEX, linear_token_losses
from raylora.train.policy import take_step

REFERENCE_FREE = ("simpo", "orpo")
# the step's statistics, summed over pairs (then divided by their number), in this order
STATS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


def pair_losses(
    objective: str,
    pref: PreferenceArgs,
    chosen: tuple[torch.Tensor, torch.Tensor],
    rejected: tuple[torch.Tensor, torch.Tensor],
    reference: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Each pair's loss, its two rewards and the two log-probabilities the metrics show, all (P,).

    Args:
        chosen, rejected: each answer's summed log-probability and its label tokens.
        reference: the reference's summed log-probabilities of the chosen and of the rejected answers (dpo only).
    """
    beta, smoothing = pref.beta, pref.label_smoothing
    (c, nc), (r, nr) = chosen, rejected
    if objective == "dpo":
        chosen_ratio, rejected_ratio = c - reference[0], r - reference[1]
        if pref.loss_type == "ipo":  # on log-ratios per token, as TRL's (and the IPO paper's results)
            z = chosen_ratio / nc.clamp(min=1) - rejected_ratio / nr.clamp(min=1)
            losses = (z - 1 / (2 * beta)) ** 2
        else:
            losses = _smoothed(beta * (chosen_ratio - rejected_ratio), smoothing)
        return losses, beta * chosen_ratio, beta * rejected_ratio, c, r
    c, r = c / nc.clamp(min=1), r / nr.clamp(min=1)  # simpo and orpo score answers per token
    if objective == "simpo":
        losses = _smoothed(beta * (c - r - pref.gamma / beta), smoothing)
    elif objective == "orpo":
        losses = -beta * F.logsigmoid((c - r) - (_log1mexp(c) - _log1mexp(r)))
    else:
        raise ValueError(f"unknown preference objective {objective!r}")
    return losses, beta * c, beta * r, c, r


def _smoothed(z: torch.Tensor, smoothing: float) -> torch.Tensor:
    """``-logsigmoid(z)``, with ``smoothing`` of the labels taken as flipped (conservative DPO)."""
    return -(1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable on both sides of ``-log 2``."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def example_index(seq_lens: list[list[int]], width: int) -> torch.Tensor:
    """(B, width) long: the batch-wide index of the example each token belongs to (rows' examples numbered in
    order), -1 on padding."""
    index = torch.full((len(seq_lens), width), -1, dtype=torch.long)
    k = 0
    for row, lens in enumerate(seq_lens):
        start = 0
        for n in lens:
            index[row, start : start + n] = k
            start, k = start + n, k + 1
    return index


class PreferenceModel(nn.Module):
    """What DDP wraps for a preference objective: the peft model's forward to the step's loss terms.

    ``forward(input_ids, labels, position_ids, attention_mask, cu_seq_lens, examples)`` (``examples`` from
    :func:`example_index`) returns ``(terms, stats)``: ``terms`` = (the pairs' losses summed, the chosen answers'
    cross-entropy summed over their tokens: ORPO's second term, 0 otherwise), ``stats`` the sums of :data:`STATS`.
    """

    def __init__(self, model: nn.Module, chunked: bool, objective: str, pref: PreferenceArgs, head=None):
        super().__init__()
        self.model, self.chunked, self.objective, self.pref = model, chunked, objective, pref
        self.head = head  # as LossModel's: the frozen head in the autocast dtype

    def forward(self, input_ids, labels, position_ids, attention_mask, cu_seq_lens, examples):
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                  "cu_seq_lens_q": cu_seq_lens}  # fmt: skip
        count = int(examples.max().item()) + 1
        sums, tokens = self.answer_logps(inputs, labels, examples, count)
        reference = None
        if self.objective not in REFERENCE_FREE:
            with torch.no_grad(), self.model.disable_adapter():
                ref = self.answer_logps(inputs, labels, examples, count)[0]
            reference = ref[0::2], ref[1::2]
        losses, chosen_rewards, rejected_rewards, chosen, rejected = pair_losses(
            self.objective, self.pref, (sums[0::2], tokens[0::2]), (sums[1::2], tokens[1::2]), reference
        )
        nll = -sums[0::2].sum() if self.objective == "orpo" else sums.new_zeros(())
        margins = (chosen_rewards - rejected_rewards).detach()
        stats = torch.stack([chosen_rewards.detach().sum(), rejected_rewards.detach().sum(), margins.sum(),
                             (margins > 0).float().sum(), chosen.detach().sum(), rejected.detach().sum()])  # fmt: skip
        return torch.stack([losses.sum(), nll]), stats

    def answer_logps(self, inputs: dict, labels, examples, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each example's summed log-probability of its label tokens and their number, both (count,) fp32."""
        targets = labels[:, 1:]
        keep = targets != IGNORE_INDEX
        owner = examples[:, 1:][keep]
        if self.chunked:
            causal_lm = self.model.get_base_model()
            hidden = causal_lm.get_decoder()(**inputs).last_hidden_state[:, :-1][keep]
            kind = hidden.device.type
            dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
            head = self.head if self.head is not None and dtype == self.head.dtype else None
            head = head if head is not None else causal_lm.get_output_embeddings().weight
            losses = linear_token_losses(hidden, head, targets[keep], dtype)
        else:
            logits = self.model(**inputs).logits[:, :-1][keep]
            losses = F.cross_entropy(logits.float(), targets[keep], reduction="none")
        zeros = torch.zeros(count, dtype=torch.float32, device=losses.device)
        return zeros.index_add(0, owner, -losses), zeros.index_add(0, owner, torch.ones_like(losses))


def collate_pairs(rows: list[dict], pad_id: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """:func:`~raylora.data.collate.collate_packs` of preference packs, with each token's example
    (:func:`example_index`)."""
    batch = collate_packs(rows, pad_id, dtype)
    batch["examples"] = example_index([list(r["seq_lens"]) for r in rows], batch["input_ids"].shape[1])
    return batch


def _counts(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """A batch's pairs, and its chosen answers' label tokens (ORPO's cross-entropy is per token)."""
    owner = batch["examples"][:, 1:]
    learned = batch["labels"][:, 1:] != IGNORE_INDEX
    return (int(batch["examples"].max().item()) + 1) // 2, int((learned & (owner % 2 == 0)).sum().item())


def _loss(terms: torch.Tensor, pairs: float, chosen_tokens: float) -> torch.Tensor:
    """The step's objective from its summed terms: the mean pair loss, plus ORPO's cross-entropy per chosen token."""
    return terms[0] / max(pairs, 1.0) + terms[1] / max(chosen_tokens, 1.0)


def preference_step(ddp, batches, optimizer, scheduler, scaler, pad_id, mask_dtype, device, train, backend, world):
    """One optimizer step of a preference objective over ``grad_accum`` micro-batches on ``world`` workers, as
    :func:`~raylora.train.loop.train_step` takes one (its arguments and its returns, then the step's
    :data:`STATS` averaged over its pairs).

    The objective is the mean over every pair of the step (all micro-batches, all workers; ORPO adds its chosen
    answers' cross-entropy per token): the counts are all-reduced before the first backward and each micro-batch's
    sums scaled by ``world`` over them (DDP averages gradients over workers).
    """
    micro = []
    counts = torch.zeros(3, device=device)  # pairs, chosen label tokens, real tokens
    for _ in range(train.grad_accum):
        rows, position = next(batches)
        batch = {key: v.to(device) for key, v in collate_pairs(rows, pad_id, mask_dtype).items()}
        micro.append(batch)
        counts += torch.tensor([*_counts(batch), sum(r["num_tokens"] for r in rows)], device=device)
    if world > 1:
        dist.all_reduce(counts)
    pairs, chosen_tokens, tokens = counts.tolist()
    terms = torch.zeros(2, device=device)
    stats = torch.zeros(len(STATS), device=device)
    for k, batch in enumerate(micro):
        sync = k == train.grad_accum - 1 or world == 1
        with contextlib.nullcontext() if sync else ddp.no_sync():
            with backend.autocast():
                parts, sums = ddp(**batch)
            scaler.scale(_loss(parts, pairs, chosen_tokens) * world).backward()
        terms += parts.detach().float()
        stats += sums.float()
    if world > 1:
        dist.all_reduce(terms)
        dist.all_reduce(stats)
    loss = _loss(terms, pairs, chosen_tokens).item()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = take_step(params, optimizer, scheduler, scaler, train.max_grad_norm, loss)
    return loss, int(tokens), grad_norm, position, dict(zip(STATS, (stats / max(pairs, 1.0)).tolist(), strict=True))


@torch.no_grad()
def evaluate_pairs(model, shard, batch_size: int, pad_id: int, mask_dtype, backend, world: int) -> dict[str, float]:
    """The objective and :data:`STATS` (``eval_`` before each name) over every worker's held-out pairs; ``model``:
    a :class:`PreferenceModel`."""
    model.eval()
    device = next(model.parameters()).device
    sums = torch.zeros(4 + len(STATS), dtype=torch.float64, device=device)  # terms, pairs, chosen tokens, stats
    for batch in shard.iter_batches(batch_size=batch_size, batch_format="pyarrow"):
        tensors = {k: v.to(device) for k, v in collate_pairs(batch.to_pylist(), pad_id, mask_dtype).items()}
        with backend.autocast():
            terms, stats = model(**tensors)
        sums += torch.cat([terms.double(), torch.tensor(_counts(tensors), device=device), stats.double()])
    model.train()
    if world > 1:
        total = sums.float()  # HCCL all-reduces no float64
        dist.all_reduce(total)
        sums = total.double()
    pairs, chosen_tokens = sums[2].item(), sums[3].item()
    if pairs == 0:
        return {}
    scores = {"eval_loss": _loss(sums[:2], pairs, chosen_tokens).item()}
    return scores | {f"eval_{name}": value / pairs for name, value in zip(STATS, sums[4:].tolist(), strict=True)}
