"""Preference objectives: DPO (sigmoid, IPO), SimPO and ORPO on chosen / rejected answers, and KTO on answers
labelled desirable or not, as TRL computes them.

A preference pack holds whole units, each as two consecutive examples (:mod:`raylora.data.pairs`): example
``2i`` is the prompt with the chosen answer, ``2i + 1`` the prompt's last token with the rejected one, reading the
rest of the prompt from example ``2i`` (prefix sharing: the prompt is computed once), the prompt masked out of the
labels; for kto, ``2i`` is the prompt with its own answer and ``2i + 1`` the prompt with another row's answer (the
mismatched sequence KTO's KL estimate is read from), the unit's label beside the pack. One forward over the pack gives every answer's log-probability (the sum over its label tokens,
or that sum over their count where the objective averages), read off the label positions through the chunked head
(:func:`~raylora.ops.linear_ce.linear_token_losses`). DPO's reference is the same model with the adapter off (peft's
``disable_adapter``), run without gradients: never a second copy of the weights.

Per pair, with ``c`` / ``r`` the policy's log-probabilities of the chosen / rejected answer and ``c0`` / ``r0`` the
reference's (TRL's ``DPOTrainer``, ``CPOTrainer`` with ``loss_type="simpo"`` and ``cpo_alpha=0``, ``ORPOTrainer``):

- dpo, sigmoid: ``z = (c - c0) - (r - r0)``; ``-(1 - ls) logsigmoid(beta z) - ls logsigmoid(-beta z)``
- dpo, ipo: the same ``z`` on length-averaged log-probabilities; ``(z - 1 / (2 beta))^2``
- simpo (averaged): ``z = c - r - gamma / beta``; ``-(1 - ls) logsigmoid(beta z) - ls logsigmoid(-beta z)``
- orpo (averaged): ``-beta logsigmoid((c - r) - (log(1 - e^c) - log(1 - e^r)))``, plus the chosen answers'
  cross-entropy per token; dpo adds that cross-entropy times ``sft_weight`` (RPO, TRL's ``sft`` loss type).
- kto: with ``a`` / ``a0`` the policy's / reference's log-probability of an answer and ``kl`` the batch's mean
  log-ratio on the mismatched sequences (over every worker, detached, at least 0): ``w_d (1 - sigmoid(beta (a - a0 -
  kl)))`` for a desirable answer, ``w_u (1 - sigmoid(beta (kl - a + a0)))`` for an undesirable one; the loss is the
  mean over answers (TRL's ``KTOTrainer``, ``loss_type="kto"``).

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


def kto_losses(
    pref: PreferenceArgs, logps: torch.Tensor, reference: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each answer's KTO loss (weighted) and its reward, both (U,): ``desirable`` (U,) bool, ``kl`` the batch's KL
    estimate (a detached scalar, at least 0)."""
    ratio = logps - reference
    chosen = pref.desirable_weight * (1 - torch.sigmoid(pref.beta * (ratio - kl)))
    rejected = pref.undesirable_weight * (1 - torch.sigmoid(pref.beta * (kl - ratio)))
    return torch.where(desirable, chosen, rejected), pref.beta * ratio


def kl_parts(logps: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """KTO's KL estimate of a batch as (sum, count), detached: the policy's log-ratio to the reference on the
    mismatched sequences (each prompt with another row's answer: the odd examples)."""
    ratios = (logps[1::2] - reference[1::2]).detach()
    return torch.stack([ratios.sum(), ratios.new_tensor(float(ratios.numel()))])


def objective_terms(
    objective: str,
    pref: PreferenceArgs,
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    desirable: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's loss terms and statistics from :class:`PreferenceModel`'s ``outputs``.

    Returns:
        ``terms`` = (the units' losses summed, the chosen answers' cross-entropy summed over their tokens: ORPO's
        second term, and DPO's times ``preference.sft_weight``; 0 otherwise) and the sums :func:`metrics` reads (:data:`STATS` of the pairs; for kto, the
        desirable and undesirable answers' rewards and log-probabilities, their counts, the KL estimate and 1).
    Args:
        desirable, kl: kto only: each unit's label, and the KL estimate (:func:`kl_parts`, reduced over workers).
    """
    logps, tokens, reference = outputs
    if objective == "kto":
        losses, rewards = kto_losses(pref, logps[0::2], reference[0::2], desirable, kl)
        good = desirable.float()
        bad = 1 - good
        rewards, answer = rewards.detach(), logps[0::2].detach()
        stats = torch.stack([(rewards * good).sum(), (rewards * bad).sum(), (answer * good).sum(),
                             (answer * bad).sum(), good.sum(), bad.sum(), kl.detach(), kl.new_ones(())])  # fmt: skip
        return torch.stack([losses.sum(), losses.new_zeros(())]), stats
    pairs = None if objective in REFERENCE_FREE else (reference[0::2], reference[1::2])
    losses, chosen_rewards, rejected_rewards, chosen, rejected = pair_losses(
        objective, pref, (logps[0::2], tokens[0::2]), (logps[1::2], tokens[1::2]), pairs
    )
    weight = 1.0 if objective == "orpo" else pref.sft_weight if objective == "dpo" else 0.0
    nll = -weight * logps[0::2].sum() if weight else logps.new_zeros(())
    margins = (chosen_rewards - rejected_rewards).detach()
    stats = torch.stack([chosen_rewards.detach().sum(), rejected_rewards.detach().sum(), margins.sum(),
                         (margins > 0).float().sum(), chosen.detach().sum(), rejected.detach().sum()])  # fmt: skip
    return torch.stack([losses.sum(), nll]), stats


def metrics(objective: str, sums: list[float], units: float) -> dict[str, float]:
    """The step's (or an evaluation's) metrics from :func:`objective_terms`' statistics summed over its batches;
    ``units``: its pairs (kto: its answers)."""
    if objective != "kto":
        return dict(zip(STATS, (value / max(units, 1.0) for value in sums), strict=True))
    chosen_reward, rejected_reward, chosen_logps, rejected_logps, good, bad, kl, batches = sums
    scores = {"kl": kl / max(batches, 1.0)}
    if good:
        scores |= {"rewards/chosen": chosen_reward / good, "logps/chosen": chosen_logps / good}
    if bad:
        scores |= {"rewards/rejected": rejected_reward / bad, "logps/rejected": rejected_logps / bad}
    if good and bad:
        scores["rewards/margins"] = scores["rewards/chosen"] - scores["rewards/rejected"]
    return scores


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
    """What DDP wraps for a preference objective: the peft model's forward to every answer's log-probability.

    ``forward(input_ids, labels, position_ids, attention_mask, cu_seq_lens, examples, shared_prefix)`` (``examples``
    from :func:`example_index`, ``shared_prefix`` from :func:`~raylora.data.collate.segment_shared`) returns ``(logps, tokens, reference)``, each (E,) fp32 for the batch's E examples: the
    summed log-probability of each example's label tokens, their count, and the reference's log-probability (the
    adapter off, no gradients; zeros for a reference-free objective). :func:`objective_terms` makes the loss of them.
    """

    def __init__(self, model: nn.Module, chunked: bool, objective: str, pref: PreferenceArgs, head=None):
        super().__init__()
        self.model, self.chunked, self.objective, self.pref = model, chunked, objective, pref
        self.head = head  # as LossModel's: the frozen head in the autocast dtype

    def forward(self, input_ids, labels, position_ids, attention_mask, cu_seq_lens, examples, shared_prefix):
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                  "cu_seq_lens_q": cu_seq_lens, "shared_prefix": shared_prefix}  # fmt: skip
        count = int(examples.max().item()) + 1
        logps, tokens = self.answer_logps(inputs, labels, examples, count)
        if self.objective in REFERENCE_FREE:
            return logps, tokens, torch.zeros_like(tokens)
        with torch.no_grad(), self.model.disable_adapter():
            reference = self.answer_logps(inputs, labels, examples, count)[0]
        return logps, tokens, reference

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
    (:func:`example_index`) and, for kto's packs, each unit's label (``desirable``)."""
    batch = collate_packs(rows, pad_id, dtype)
    batch["examples"] = example_index([list(r["seq_lens"]) for r in rows], batch["input_ids"].shape[1])
    if rows and "desirable" in rows[0]:
        batch["desirable"] = torch.tensor([bool(d) for r in rows for d in r["desirable"]], dtype=torch.bool)
    return batch


def _counts(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """A batch's units (pairs; kto: answers), and its chosen answers' label tokens (ORPO's cross-entropy is per
    token)."""
    owner = batch["examples"][:, 1:]
    learned = batch["labels"][:, 1:] != IGNORE_INDEX
    return (int(batch["examples"].max().item()) + 1) // 2, int((learned & (owner % 2 == 0)).sum().item())


def _loss(terms: torch.Tensor, units: float, chosen_tokens: float) -> torch.Tensor:
    """The step's objective from its summed terms: the mean unit loss, plus ORPO's cross-entropy per chosen token."""
    return terms[0] / max(units, 1.0) + terms[1] / max(chosen_tokens, 1.0)


def _terms(model, batch: dict[str, torch.Tensor], objective: str, pref: PreferenceArgs, world: int):
    """One batch's forward and :func:`objective_terms`; kto's KL estimate is the batch's over ``world`` workers
    (each worker's batch is one micro-batch of the same step, as TRL's per-device batches are)."""
    inputs = {key: v for key, v in batch.items() if key != "desirable"}
    outputs = model(**inputs)
    kl = None
    if objective == "kto":
        parts = kl_parts(outputs[0], outputs[2])
        if world > 1:
            dist.all_reduce(parts)
        kl = (parts[0] / parts[1].clamp(min=1)).clamp(min=0)
    return objective_terms(objective, pref, outputs, batch.get("desirable"), kl)


def preference_step(ddp, batches, optimizer, scheduler, scaler, pad_id, mask_dtype, device, train, backend, world):
    """One optimizer step of a preference objective over ``grad_accum`` micro-batches on ``world`` workers, as
    :func:`~raylora.train.loop.train_step` takes one (its arguments and its returns, then the step's
    :func:`metrics` and its count of ``pairs``, kto's of ``answers``: a preference step's tokens count each prompt
    once, so pairs per second is what compares with a trainer that computes the prompt twice).

    The objective is the mean over every unit of the step (pairs; kto: answers; all micro-batches, all workers;
    ORPO adds its chosen answers' cross-entropy per token): the counts are all-reduced before the first backward and
    each micro-batch's sums scaled by ``world`` over them (DDP averages gradients over workers).
    """
    module = ddp.module if hasattr(ddp, "module") else ddp
    objective, pref = module.objective, module.pref
    micro = []
    counts = torch.zeros(3, device=device)  # units, chosen label tokens, real tokens
    for _ in range(train.grad_accum):
        rows, position = next(batches)
        batch = {key: v.to(device) for key, v in collate_pairs(rows, pad_id, mask_dtype).items()}
        micro.append(batch)
        counts += torch.tensor([*_counts(batch), sum(r["num_tokens"] for r in rows)], device=device)
    if world > 1:
        dist.all_reduce(counts)
    units, chosen_tokens, tokens = counts.tolist()
    terms = torch.zeros(2, device=device)
    stats = None
    for k, batch in enumerate(micro):
        sync = k == train.grad_accum - 1 or world == 1
        with contextlib.nullcontext() if sync else ddp.no_sync():
            with backend.autocast():
                parts, sums = _terms(ddp, batch, objective, pref, world)
            scaler.scale(_loss(parts, units, chosen_tokens) * world).backward()
        terms += parts.detach().float()
        stats = sums.float() if stats is None else stats + sums.float()
    if world > 1:
        dist.all_reduce(terms)
        dist.all_reduce(stats)
    loss = _loss(terms, units, chosen_tokens).item()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = take_step(params, optimizer, scheduler, scaler, train.max_grad_norm, loss)
    counted = {"answers" if objective == "kto" else "pairs": units}  # the step's, over every worker
    return loss, int(tokens), grad_norm, position, metrics(objective, stats.tolist(), units) | counted


@torch.no_grad()
def evaluate_pairs(model, shard, batch_size: int, pad_id: int, mask_dtype, backend, world: int) -> dict[str, float]:
    """The objective and :func:`metrics` (``eval_`` before each name) over every worker's held-out units;
    ``model``: a :class:`PreferenceModel`. Workers hold different numbers of batches, so kto's KL estimate is each
    batch's own (no collective inside the loop)."""
    model.eval()
    device = next(model.parameters()).device
    sums = None  # terms, units, chosen tokens, then the statistics
    for batch in shard.iter_batches(batch_size=batch_size, batch_format="pyarrow"):
        tensors = {k: v.to(device) for k, v in collate_pairs(batch.to_pylist(), pad_id, mask_dtype).items()}
        with backend.autocast():
            terms, stats = _terms(model, tensors, model.objective, model.pref, 1)
        part = torch.cat([terms.double(), torch.tensor(_counts(tensors), device=device), stats.double()])
        sums = part if sums is None else sums + part
    model.train()
    if sums is None:
        width = 2 + 2 + (8 if model.objective == "kto" else len(STATS))
        sums = torch.zeros(width, dtype=torch.float64, device=device)
    if world > 1:
        total = sums.float()  # HCCL all-reduces no float64
        dist.all_reduce(total)
        sums = total.double()
    units, chosen_tokens = sums[2].item(), sums[3].item()
    if units == 0:
        return {}
    scores = {"eval_loss": _loss(sums[:2], units, chosen_tokens).item()}
    return scores | {f"eval_{k}": v for k, v in metrics(model.objective, sums[4:].tolist(), units).items()}
