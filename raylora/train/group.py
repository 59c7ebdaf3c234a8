"""Many LoRA adapters trained together on one frozen base: the grouped step.

A :class:`Group` holds one copy of the frozen base model and the data, and up to K members. A member is one
training run (a sweep's trial): its own LoRA shape (rank, alpha, dropout, target modules), optimizer, schedule,
gradient clipping, NaN guard, grad scaler, step count and data position. Each member is a named adapter of one
peft model, so it saves as a plain peft adapter.

One grouped step: every member takes its own next micro-batch (members that joined later are at an earlier
place in the data: each starts at its own step 0 and data position 0) → the rows are stacked, member after
member → one forward: each base linear runs once over all rows, and each adapted linear adds, to each member's
rows only, that member's LoRA → each member's loss over its own rows → one backward → each member clips, checks
and steps its own optimizer. The base is frozen, so no gradient is summed over rows: member m's gradients are
exactly those of its own loss, and a member that joins or leaves changes nothing in the others' numbers (rows are
padded to one fixed width, ``data.cutoff_len``, for that): bit for bit in one lane; in lanes, up to the rounding
of kernels that run on another number of threads when the members change.

On CPU, a step of several members runs in lanes: the members are split into as many parts as the worker has
intra-op threads, and each part's forwards and backwards run on its own Python thread with its share of those
threads (one each when there are as many members as threads), over the same base (torch releases the GIL in its
ops). One multi-threaded op waits for its slowest thread at every op, so any process that takes a core for a
moment (Tune's driver, Ray's daemons) stalls all of them; lanes meet once a step. ``bench/group_step.py``
measures both.

Members join and leave between steps. With several workers (``world > 1``, torch.distributed started), every
worker holds the same members, reads its own shard of the rows, and each member's gradients are all-reduced.
"""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import get_peft_model
from peft.tuners.lora import Linear as LoraLinear

from raylora.backends import resolve_backend
from raylora.config import JobConfig
from raylora.data.collate import collate_packs
from raylora.data.packs import PackShard
from raylora.models import load_model, lora_config
from raylora.ops.dropout import dropout_scale, lora_dropout
from raylora.ops.fused_lora import SharedDown, clear_siblings, siblings
from raylora.ops.linear_ce import IGNORE_INDEX, label_positions, linear_cross_entropy
from raylora.ops.packed_attention import use_packed_attention
from raylora.train import checkpoint as ckpt
from raylora.train.checkpoint import TrainState
from raylora.train.lm import autocast_outputs, enable_recompute, head_is_plain_linear, store_frozen_linears
from raylora.train.optim import adamw, build_scheduler
from raylora.train.policy import (
    NanGuard,
    due,
    eval_scores,
    label_tokens,
    params_finite,
    roll_back,
    step_metrics,
    take_step,
)


@dataclass
class Member:
    """One adapter of the group and everything its training owns."""

    name: str  # the adapter's name in the group's peft model
    cfg: JobConfig
    out: Path | None  # checkpoints go to out/ray/checkpoint_<step> (None: none written)
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    lr_scale: list[float]
    state: TrainState
    last_good: dict
    resumed_from: int = 0
    guard: NanGuard | None = None  # train.nan_tolerance's, made with the member
    tokens_seen: int = 0
    tokens_before: int = 0  # trained before the checkpoint it resumed from
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        self.guard = self.guard or NanGuard(self.cfg.train.nan_tolerance)


@dataclass
class Event:
    """What one member's step produced. ``status``: running, done (reached max_steps) or diverged (it left).

    ``report`` holds the metrics of a log, eval or checkpoint step (``None`` otherwise); ``checkpoint`` the folder
    written at this step.
    """

    member: str
    step: int
    status: str
    report: dict | None = None
    checkpoint: Path | None = None


class _Lane:
    """What the forward in flight reads: its members' rows (``spans``), what their dropout masks derive from
    (``masks``) and the generator drawing them."""

    def __init__(self, device: torch.device):
        self.spans: dict[str, slice] = {}
        self.masks: dict[str, tuple] = {}
        self.generator = torch.Generator(device)


class _ThreadLane(_Lane, threading.local):
    """A :class:`_Lane` of its own on each thread (``threading.local`` runs ``__init__`` again in each), for a group
    that runs lanes. Only on CPU: on CUDA and NPU the backward, and a recompute in it, runs on a device thread of
    autograd's, which must read the forward's lane."""


class Group:
    """One frozen base model and its member adapters, on this worker.

    Args:
        cfg: the job every member shares: model, data, backend, and the fixed row width ``data.cutoff_len``.
        shard: this worker's training packs (``input_ids``, ``labels``, ``position_ids``, ``seq_lens``,
            ``num_tokens``); each member reads each epoch in the order its ``train.seed`` draws, as a Ray Train
            worker does (:func:`raylora.train.loop.micro_batches`).
        eval_rows: the evaluation pack rows (every worker reads all of them), or ``None``.
        rank, world, local_rank: this worker's place among the group's workers (torch.distributed started when
            world > 1) and on its node (which device it uses).
        lanes: the most lanes a step splits its members into, each with its share of the calling thread's
            intra-op threads (default: on CPU as many as those threads, elsewhere 1; 1: every member on the
            calling thread).
        generate_rows: the eval rows a member's generation eval answers at its ``train.generate_eval_every``
            (:func:`raylora.eval.in_training.training_rows`); rank 0 answers them, none without.
    """

    def __init__(
        self,
        cfg: JobConfig,
        shard: PackShard,
        eval_rows: list[dict] | None,
        rank: int = 0,
        world: int = 1,
        local_rank: int = 0,
        lanes: int | None = None,
        generate_rows: list[dict] | None = None,
    ):
        self.cfg = cfg
        self.backend = resolve_backend(cfg.backend)
        self.device = self.backend.torch_device()
        self.shard, self.eval_rows = shard, eval_rows or []
        self.rank, self.world = rank, world
        self.generate_rows = generate_rows or []
        self.base, self.tokenizer = load_model(cfg.model)
        self.base.requires_grad_(False).to(self.device)
        use_packed_attention(self.base)
        if cfg.train.recompute_every:
            enable_recompute(self.base, cfg.train.recompute_every)
        if self.backend.amp_dtype is not None:
            # as a Ray Train worker does (raylora.train.lm.store_frozen_linears): no fp32 copy of the base and no
            # cast per forward. peft then rounds each new member's initial LoRA weights to this dtype before it
            # casts them back to fp32, a relative change below 2^-8 from the same member trained alone.
            store_frozen_linears(self.base, self.backend.amp_dtype)
            autocast_outputs(self.base, self.backend.amp_dtype)
        self.head = None  # the frozen head's weight in the autocast dtype, cast at the first chunked loss
        self.pad_id = self.tokenizer.pad_token_id
        self.mask_dtype = self.backend.amp_dtype or self.base.dtype
        self.model = None  # the peft model, built when the first member joins
        self.chunked = False
        self.lanes = (lanes or torch.get_num_threads()) if self.device.type == "cpu" else 1
        self.pool: ThreadPoolExecutor | None = None  # runs every lane but the first (made at the first such step)
        self.lane = (_ThreadLane if self.lanes > 1 else _Lane)(self.device)  # read by every LoRA layer
        self.members: dict[str, Member] = {}

    def join(self, name: str, cfg: JobConfig, out: Path | None = None, resume_from: Path | None = None) -> None:
        """Add a member at its own step 0, or at the step of the checkpoint folder ``resume_from``.

        Its LoRA weights are drawn as a run of ``cfg`` alone draws them (``train.seed``, peft's initialisation).
        Raises:
            ValueError: ``name`` is already a member.
            ModelError: ``cfg.lora.target_modules`` names a layer the base does not have.
            CheckpointError: ``resume_from`` was written for another base model or LoRA shape.
        """
        if name in self.members:
            raise ValueError(f"{name} is already a member of this group")
        lora = lora_config(self.base, cfg.lora)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.train.seed)
            if self.model is None:
                self.model = get_peft_model(self.base, lora, adapter_name=name)
            else:
                self.model.add_adapter(name, lora)
        self.model.to(self.device)
        self._wire_layers()
        named = [(n, p) for n, p in self.model.named_parameters() if f".{name}." in n and "lora_" in n]
        for _, p in named:
            p.requires_grad_(True)
        if self.chunked is False and cfg.train.chunked_loss:
            with self.backend.autocast():  # the base may be stored in amp
                self.chunked = head_is_plain_linear(self.model)[0]
        optimizer = adamw(named, cfg.train, self.backend)
        lr_scale = [1.0]
        scheduler = build_scheduler(optimizer, cfg.train, lr_scale)
        scaler = self.backend.grad_scaler()
        state = TrainState()
        if resume_from is not None:
            ckpt.check_compatible(resume_from, cfg)
            state = ckpt.load(resume_from, self.model, optimizer, scheduler, scaler, adapter=name)
            lr_scale[0] = state.lr_scale
        params = [p for _, p in named]
        snap = ckpt.snapshot(self.model, optimizer, scheduler, scaler, state, adapter=name)
        self.members[name] = Member(
            name, cfg, out, params, optimizer, scheduler, scaler, lr_scale, state, snap, state.step,
            tokens_before=ckpt.tokens_trained(state),
        )  # fmt: skip
        self._keep_an_active_adapter()
        self._trainable()

    def leave(self, name: str) -> None:
        """Remove a member and its adapter (its saved checkpoints stay); the others are untouched."""
        if name not in self.members:
            return
        del self.members[name]
        self.model.delete_adapter(name)
        self._keep_an_active_adapter()
        self._trainable()

    def _keep_an_active_adapter(self) -> None:
        """peft's model names one active adapter and reads its config on every forward, but after a deletion it
        moves that name on only when exactly one adapter remains active: a group whose first member left, or
        whose members all left before a new one joined, failed with a KeyError. The grouped forward applies
        every member's adapter to its own rows whatever peft calls active, so any member's name will do."""
        if self.members and self.model.active_adapter not in self.model.peft_config:
            self.model.set_adapter(next(iter(self.members)))

    def step(self, names: list[str] | None = None) -> list[Event]:
        """One optimizer step of the members ``names`` (default: all), their forward and backward passes grouped.

        A member that reaches ``train.max_steps`` reports ``done``; one that diverges (non-finite loss or
        gradient norm ``train.nan_tolerance`` times in a row, again after one rollback to its last good
        checkpoint with half the learning rate) reports ``diverged``. Both stay members until :meth:`leave`.
        Returns:
            One :class:`Event` per stepped member.
        """
        members = [self.members[n] for n in (names if names is not None else list(self.members))]
        if not members:
            return []
        results = self._train_step(members)
        events, due_eval, due_generate, saving = [], [], [], set()
        for m in members:
            loss, tokens, grad_norm, position = results[m.name]
            event = self._guard(m, loss, grad_norm)
            if event is not None:
                events.append(event)
                continue
            m.state.epoch, m.state.rows_in_epoch = position
            m.state.step += 1
            m.tokens_seen += tokens
            when = due(m.state.step, m.cfg.train)
            report = None
            if when.log:
                seconds = time.perf_counter() - m.started
                report = step_metrics(loss, m.scheduler.get_last_lr()[0], grad_norm, m.tokens_seen, seconds,
                                      m.tokens_before, self.backend, m.state)  # fmt: skip
            if when.evaluate and self.eval_rows:
                due_eval.append(m)
            if when.generate and self.generate_rows and self.rank == 0:
                due_generate.append(m)
            events.append(Event(m.name, m.state.step, "done" if when.final else "running", report, None))
            if when.save:
                saving.add(m.name)
        scores = self._evaluate(due_eval) if due_eval else {}
        for name, generated in (self._generation_scores(due_generate) if due_generate else {}).items():
            scores.setdefault(name, {}).update(generated)
        for event in events:
            m = self.members[event.member]
            if event.report is None or event.status == "diverged":
                continue
            event.report.update(scores.get(m.name, {}))
            if event.status == "done" and not params_finite(m.params):
                event.status, event.report = "diverged", None
                continue
            m.state.history.append({"step": m.state.step, **event.report})
            event.report = {**event.report, "step": m.state.step, "resumed_from": m.resumed_from}
            if m.name in saving:
                m.state.lr_scale = m.lr_scale[0]
                m.last_good = ckpt.snapshot(self.model, m.optimizer, m.scheduler, m.scaler, m.state, adapter=m.name)
                if m.out is not None and self.rank == 0:
                    event.checkpoint = ckpt.save_in_run(m.out, m.cfg.train.keep_checkpoints, self.model, m.optimizer,
                                                        m.scheduler, m.scaler, m.state, m.cfg, adapter=m.name)  # fmt: skip
        return events

    def save_adapter(self, name: str, folder: Path) -> None:
        """Write member ``name``'s adapter as a plain peft adapter folder (``PeftModel.from_pretrained`` loads it)."""
        ckpt.save_adapter(self.model, name, folder)

    def _guard(self, m: Member, loss: float, grad_norm: float) -> Event | None:
        """The NaN guard of one member's step; returns an Event when the step did not count."""
        verdict = m.guard.verdict(loss, grad_norm, m.state)
        if verdict == "ok":
            return None
        if verdict == "rollback":
            m.state = roll_back(m.last_good, m.state, m.lr_scale, self.model, m.optimizer, m.scheduler, m.scaler,
                                adapter=m.name)  # fmt: skip
        return Event(m.name, m.state.step, "diverged" if verdict == "diverged" else "running")

    def _train_step(self, members: list[Member]) -> dict[str, tuple[float, int, float, tuple[int, int]]]:
        """Forward and backward of every member's micro-batches together, then each member's optimizer step.

        The objective of each member is the one of :func:`raylora.train.loop.train_step`: its cross-entropy
        summed over the label tokens of its step (all micro-batches, all workers), divided by their number.
        Returns:
            member -> (loss per label token, real tokens over workers, gradient norm, data position).
        """
        micro: dict[str, list[list[dict]]] = {}
        counts, positions = {}, {}
        for m in members:
            position, batches = (m.state.epoch, m.state.rows_in_epoch), []
            for _ in range(m.cfg.train.grad_accum):
                rows, position = self.shard.batch_after(position, m.cfg.train.batch_size, m.cfg.train.seed)
                batches.append(rows)
            micro[m.name], positions[m.name] = batches, position
            rows = [r for batch in batches for r in batch]
            counts[m.name] = [float(label_tokens(rows)), float(sum(r["num_tokens"] for r in rows))]
        count = torch.tensor([counts[m.name] for m in members], device=self.device)
        if self.world > 1:
            dist.all_reduce(count)
        scales = {m.name: self.world / max(count[i, 0].item(), 1.0) for i, m in enumerate(members)}
        totals = self._in_lanes(members, lambda part: self._backward(part, micro, scales))
        if self.world > 1:
            self._all_reduce_grads(members, totals)
        results = {}
        for i, m in enumerate(members):
            loss = totals[m.name].item() / max(count[i, 0].item(), 1.0)
            grad_norm = take_step(m.params, m.optimizer, m.scheduler, m.scaler, m.cfg.train.max_grad_norm, loss)
            results[m.name] = (loss, int(count[i, 1].item()), grad_norm, positions[m.name])
        self.backend.release_freed_memory()
        return results

    def _backward(
        self, members: list[Member], micro: dict[str, list[list[dict]]], scales: dict[str, float]
    ) -> dict[str, torch.Tensor]:
        """Forward and backward of ``members``' micro-batches (each loss times its scale); returns each member's
        summed loss."""
        totals = {m.name: torch.zeros((), device=self.device) for m in members}
        for k in range(max(m.cfg.train.grad_accum for m in members)):
            present = [m for m in members if k < m.cfg.train.grad_accum]
            self.lane.masks = {m.name: (m.cfg.train.seed, m.state.step, m.state.skipped_steps, k) for m in present}
            losses = self._losses({m.name: micro[m.name][k] for m in present})
            objective = 0
            for m in present:
                objective = objective + m.scaler.scale(losses[m.name] * scales[m.name])
                totals[m.name] += losses[m.name].detach().float()
            objective.backward()
        return totals

    def _in_lanes(self, members: list[Member], work) -> dict:
        """``work(part)`` for parts of ``members``, each part on its own thread with its share of the intra-op
        threads, the first on this one; returns the union of their dicts. Parts balance the members' rows per step
        (``batch_size x grad_accum``); a member's numbers do not depend on which part it is in."""
        parts: list[list[Member]] = [[] for _ in range(min(self.lanes, len(members)))]
        load = [0] * len(parts)
        for m in sorted(members, key=lambda m: -m.cfg.train.batch_size * m.cfg.train.grad_accum):
            lane = load.index(min(load))
            parts[lane].append(m)
            load[lane] += m.cfg.train.batch_size * m.cfg.train.grad_accum
        if len(parts) == 1:
            return work(members)
        own = torch.get_num_threads()
        threads = max(1, own // len(parts))

        def run(part: list[Member]) -> dict:
            torch.get_num_threads()  # a new thread's first call takes the process's count: take it before we set ours
            torch.set_num_threads(threads)  # this thread's own count (and the process's, restored below)
            return work(part)

        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.lanes - 1, thread_name_prefix="raylora-lane")
        futures = [self.pool.submit(run, part) for part in parts[1:]]
        try:
            results = run(parts[0])
        finally:
            wait(futures)  # no lane may still be using the model when this returns or raises
            torch.set_num_threads(own)
        for future in futures:
            results.update(future.result())
        return results

    def _all_reduce_grads(self, members: list[Member], totals: dict[str, torch.Tensor]) -> None:
        """Sum every member's gradients (already scaled by world / label count) and summed losses over workers, in one call."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for m in members for p in m.params]
        flat = torch.cat([g.flatten().float() for g in grads] + [totals[m.name].reshape(1) for m in members])
        dist.all_reduce(flat)
        # DDP averages gradients over workers; the per-member scale of world / label count expects that.
        offset = 0
        for m in members:
            for p in m.params:
                n = p.numel()
                p.grad = (flat[offset : offset + n] / self.world).view_as(p).to(p.dtype)
                offset += n
        for m in members:
            totals[m.name] = flat[offset]
            offset += 1

    def _losses(self, micro: dict[str, list[dict]], train: bool = True) -> dict[str, torch.Tensor]:
        """Each member's cross-entropy summed over its label tokens, from one forward over all members' rows.

        Args:
            micro: member -> its pack rows for this forward (the rows are stacked in this order).
        Returns:
            member -> 0-d fp32 tensor.
        """
        rows, start, spans = [], 0, self.lane.spans
        spans.clear()
        for name, member_rows in micro.items():
            spans[name] = slice(start, start + len(member_rows))
            rows += member_rows
            start += len(member_rows)
        batch = {
            k: v.to(self.device)
            for k, v in collate_packs(rows, self.pad_id, self.mask_dtype, self.cfg.data.cutoff_len).items()
        }
        causal_lm = self.model.get_base_model()
        amp = self.backend.amp_dtype
        losses = {}
        with self.backend.autocast():
            inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
            inputs["cu_seq_lens_q"] = batch["cu_seq_lens"]
            if self.chunked:
                hidden = causal_lm.get_decoder()(**inputs).last_hidden_state
                if self.head is None:
                    self.head = causal_lm.get_output_embeddings().weight.detach().to(amp or self.base.dtype)
                for name, span in spans.items():
                    scored, targets = label_positions(hidden[span], batch["labels"][span])
                    losses[name] = linear_cross_entropy(scored, self.head, targets, amp)
            else:
                logits = causal_lm(**inputs).logits
                for name, span in spans.items():
                    losses[name] = F.cross_entropy(
                        logits[span, :-1].flatten(0, 1).float(),
                        batch["labels"][span, 1:].flatten(),
                        ignore_index=IGNORE_INDEX,
                        reduction="sum",
                    )
        return losses

    def _evaluate(self, members: list[Member]) -> dict[str, dict[str, float]]:
        """Eval loss per label token (and perplexity) of each of ``members`` over the eval rows, evaluated together."""
        self.model.eval()
        size = members[0].cfg.train.batch_size
        try:
            sums = self._in_lanes(members, lambda part: self._eval_sums(part, size))
        finally:
            self.model.train()
        targets = float(label_tokens(self.eval_rows))
        sums = torch.tensor([[sums[m.name], targets] for m in members], dtype=torch.float64, device=self.device)
        scores = eval_scores(sums, self.world, replicated=True)  # every worker evaluated all the eval rows
        return {m.name: score for m, score in zip(members, scores, strict=True) if score}

    def _generation_scores(self, members: list[Member]) -> dict[str, dict[str, float]]:
        """The generation eval of ``members`` (``train.generate_eval_every``): their rows decode together through the
        serving engine, each row with its member's adapter (peft's mixed-adapter batch: the grouped forward is set
        aside while they answer)."""
        # here, not at the top: the metrics' libraries (nltk, jieba) take 2 s to import, for groups that generate only
        from raylora.eval.in_training import generation_scores

        for layer in self.model.modules():
            if isinstance(layer, LoraLinear):
                del layer.forward  # peft's own forward, which reads the rows' adapter names
        try:
            return generation_scores(self.model, self.tokenizer, self.generate_rows, self.cfg, self.backend.autocast,
                                     tuple(m.name for m in members))  # fmt: skip
        finally:
            self._wire_layers()

    @torch.no_grad()
    def _eval_sums(self, members: list[Member], size: int) -> dict[str, float]:
        """Each member's cross-entropy summed over the eval rows' label tokens, ``size`` rows a forward."""
        sums = dict.fromkeys((m.name for m in members), 0.0)
        for start in range(0, len(self.eval_rows), size):
            losses = self._losses({m.name: self.eval_rows[start : start + size] for m in members})
            for name in sums:
                sums[name] += losses[name].double().item()
        return sums

    def _wire_layers(self) -> None:
        """Give every LoRA linear of the peft model the grouped forward (new ones appear as members join), and
        the siblings that read one input (q/k/v, gate/up) one down-projection per member."""
        for name, layer in self.model.named_modules():
            if isinstance(layer, LoraLinear):
                layer._raylora_lane = self.lane
                layer._raylora_masks = self._masks
                layer._raylora_name = name
                layer._raylora_group = None
                layer.forward = _grouped_forward.__get__(layer)
        for parent in self.model.modules():
            for members in siblings(parent):
                group = SharedDown(members)
                for m in members:
                    m._raylora_group = group
                if not getattr(parent, "_raylora_clears", False):
                    parent.register_forward_hook(clear_siblings)
                    parent._raylora_clears = True
        self.model.train()

    def _masks(self, member: str, layer: str) -> torch.Generator:
        """The generator of member ``member``'s dropout masks in layer ``layer`` for the forward in flight: seeded
        from the member's seed, step, skipped steps, micro-batch and the layer's name, so the masks are the
        member's own whoever else is in the group, a resumed member draws what it would have drawn, and the
        backward's recompute of a layer draws its forward's masks again."""
        seed = hashlib.blake2b(repr((*self.lane.masks[member], layer)).encode(), digest_size=8).digest()
        return self.lane.generator.manual_seed(int.from_bytes(seed, "big") >> 1)

    def _trainable(self) -> None:
        """peft marks only its active adapter trainable when adapters come and go; every member trains."""
        for m in self.members.values():
            for p in m.params:
                p.requires_grad_(True)


def _grouped_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``base(x)`` over all rows, plus, added in place to each member's own rows, ``(dropout(x) A^T)(s B)^T``.

    Siblings reading one input share each member's down-projection, as the fused LoRA linear does
    (:mod:`raylora.ops.fused_lora`: one dropout mask, one matmul against the stacked ``A``). Dropout masks come
    from :meth:`Group._masks`. The scaling, and dropout's 1/(1-p), multiply ``B`` (rank x out elements).

    ``x``: (rows, tokens, in_features), rows stacked member after member as ``self._raylora_lane.spans`` says.
    """
    result = self.base_layer(x, *args, **kwargs)
    for name, span in self._raylora_lane.spans.items():
        if name not in self.lora_A:
            continue
        a, b = self.lora_A[name].weight, self.lora_B[name].weight
        p = getattr(self.lora_dropout[name], "p", 0.0)

        def dropped(name=name, span=span, a=a, p=p) -> torch.Tensor:
            rows = x[span] if torch.is_autocast_enabled(x.device.type) else x[span].to(a.dtype)
            if not self.training or p == 0:
                return rows
            return lora_dropout(rows, p, True, self._raylora_masks(name, self._raylora_name))

        down = self._raylora_group.down(self, x, name, dropped) if self._raylora_group is not None else None
        if down is None:
            down = F.linear(dropped(), a)
        scale = self.scaling[name] * dropout_scale(p, self.training)
        result[span].add_(F.linear(down, b * scale).to(result.dtype))
    return result
