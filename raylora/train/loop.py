"""The Ray Train worker loop, top to bottom: setup → resume → steps (accumulate, clip, guard) → eval → checkpoint.

Every worker runs :func:`train_worker`. Rank 0 alone logs to MLflow, prints progress and writes
checkpoints; every rank calls ``ray.train.report`` at the same steps, as Ray Train requires.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import ray.train
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from raylora.backends import Backend, resolve_backend
from raylora.backends.base import PROFILE_STEPS
from raylora.cluster import normal_priority
from raylora.comm.hooks import CommHook, bytes_sent, check_hook
from raylora.comm.overlap import finish_trace, start_trace
from raylora.config import TrainArgs, from_dict
from raylora.data.collate import collate_packs
from raylora.data.packs import PackShard, worker_share
from raylora.models import attach_lora, load_model
from raylora.tracking import metric_logger, set_tags
from raylora.train import checkpoint as ckpt
from raylora.train.checkpoint import TrainState
from raylora.train.lm import training_model
from raylora.train.optim import build_optimizer, build_scheduler
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
from raylora.train.preference import REFERENCE_FREE, PreferenceModel, evaluate_pairs, preference_step


def train_worker(config: dict) -> dict:
    """One Ray Train worker. ``config``: ``cfg`` (the job as a dict), ``tracking_uri``, ``run_id``, ``datasets``
    (the names of the job's datasets) and ``packs`` (those of them that are prepared packs).

    Returns (rank 0's reaches the driver as ``result.return_value``): ``status`` (``done`` or
    ``diverged``), ``step``, ``resumed_from`` and ``skipped_steps``.
    """
    cfg = from_dict(config["cfg"])
    priority = normal_priority()  # before torch starts its intra-op threads, which take this thread's niceness
    quiet_report_logs()
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    backend = resolve_backend(cfg.backend)
    if world > 1:
        check_hook(cfg.train, backend)  # the driver may not have seen this device (an NPU's SoC)
    device = backend.torch_device()
    record_worker(Path(cfg.train.output_dir), rank, device)
    torch.set_num_threads(
        max(1, math.ceil(cfg.train.cpus_per_worker))
    )  # Ray sets one thread per whole CPU, rounding down
    torch.manual_seed(cfg.train.seed)

    model, tokenizer = load_model(cfg.model)
    model = attach_lora(model, cfg.lora).to(device).train()
    loss_model, notes = training_model(model, cfg.train, backend)
    step, evaluation = train_step, evaluate
    if cfg.train.objective != "sft":
        loss_model = PreferenceModel(loss_model.model, loss_model.chunked, cfg.train.objective, cfg.preference,
                                     loss_model.head)  # fmt: skip
        step, evaluation = preference_step, evaluate_pairs
        notes.append(f"objective {cfg.train.objective}" + ("" if cfg.train.objective in REFERENCE_FREE else
                                                          ", reference: the base with the adapter off"))  # fmt: skip
    notes.append(priority)
    optimizer = build_optimizer(model, cfg.train, backend)
    lr_scale = [1.0]
    scheduler = build_scheduler(optimizer, cfg.train, lr_scale)
    scaler = backend.grad_scaler()
    state = TrainState()
    train = cfg.train
    restored = ray.train.get_checkpoint()
    stack = contextlib.ExitStack()  # the handed checkpoint's folder, until the hook state is read from it too
    handed = Path(stack.enter_context(restored.as_directory())) if restored else None
    folder = ckpt.resume_point(handed, Path(train.output_dir))
    if world > 1:
        folder = agreed(folder, handed, device)
    if folder is not None:
        ckpt.check_compatible(folder, cfg)
        try:
            state = ckpt.load(folder, model, optimizer, scheduler, scaler)
        except Exception as e:  # a checkpoint cut short as its worker was killed while writing it
            if folder == handed:
                raise
            say(f"rank {rank}: the unregistered checkpoint {folder} does not load ({e}); resuming from {handed}")
            folder = handed
            state = ckpt.load(folder, model, optimizer, scheduler, scaler) if folder else TrainState()
        lr_scale[0] = state.lr_scale
    resumed_from = state.step
    ddp, hook = loss_model, None
    if world > 1:
        ddp = DistributedDataParallel(
            loss_model, device_ids=backend.ddp_device_ids(device), bucket_cap_mb=train.bucket_mb
        )
        hook = CommHook(train)
        hook.register(ddp)
        if folder is not None:
            note = ckpt.load_comm(folder, hook, rank, world)
            if note and rank == 0:
                say(note)
    stack.close()
    last_good = ckpt.snapshot(model, optimizer, scheduler, scaler, state)
    log_metrics = metric_logger(config["tracking_uri"], config["run_id"], rank)
    eval_shard = data_shard(config, "eval", 0, 1) if "eval" in config["datasets"] else None
    batches = micro_batches(
        data_shard(config, "train", rank, world), cfg.train.batch_size, state, world, cfg.train.seed
    )
    mask_dtype = backend.amp_dtype or model.dtype
    if rank == 0:
        say("training path: " + "; ".join(notes))
        set_tags(
            config["tracking_uri"], config["run_id"], {"backend.precision_by": notes[0], "train.path": "; ".join(notes)}
        )
    if rank == 0 and resumed_from:
        say(f"resumed from step {resumed_from} (epoch {state.epoch}, {state.rows_in_epoch} rows into it)")
    profiler = backend.profiler(Path(cfg.train.output_dir) / "profile") if train.profile and rank == 0 else None
    if profiler is not None:
        profiler.start()

    guard = NanGuard(train.nan_tolerance)
    tokens_seen, started = 0, time.perf_counter()
    tokens_before = ckpt.tokens_trained(state)
    comm_bytes, comm_steps = 0, 0
    overlap_due, overlap = hook is not None, {}  # measured once, on this run's third step (buckets settled)
    while state.step < train.max_steps:
        trace = start_trace(overlap_due and profiler is None and state.step >= resumed_from + 2)
        overlap_due = overlap_due and trace is None
        loss, tokens, grad_norm, position, extra = step(
            ddp,
            batches,
            optimizer,
            scheduler,
            scaler,
            tokenizer.pad_token_id,
            mask_dtype,
            device,
            train,
            backend,
            world,
        )
        state.epoch, state.rows_in_epoch = position
        backend.release_freed_memory()
        overlap.update(finish_trace(trace))
        comm_bytes, comm_steps = comm_bytes + bytes_sent(), comm_steps + 1
        if profiler is not None:
            profiler.step()
            if profiler.step_num >= PROFILE_STEPS:
                profiler.stop()
                profiler = None
        verdict = guard.verdict(loss, grad_norm, state)
        if verdict != "ok":
            if hook is not None:
                hook.forget()
            if verdict == "diverged":
                return outcome("diverged", state, resumed_from)
            if verdict == "rollback":
                state = roll_back(last_good, state, lr_scale, model, optimizer, scheduler, scaler)
                if rank == 0:
                    say(
                        f"{train.nan_tolerance} non-finite steps in a row: rolled back to step {state.step}, lr x{state.lr_scale}"
                    )
            continue
        state.step += 1
        tokens_seen += tokens
        when = due(state.step, train)
        if not when.log:
            continue
        elapsed = time.perf_counter() - started
        lr = scheduler.get_last_lr()[0]
        metrics = step_metrics(loss, lr, grad_norm, tokens_seen, elapsed, tokens_before, backend, state) | extra
        if hook is not None:
            metrics["comm_bytes_per_step"] = comm_bytes / comm_steps
            comm_bytes, comm_steps = 0, 0
            metrics.update(overlap)
            overlap = {}
        if when.evaluate and eval_shard is not None:
            metrics.update(
                evaluation(loss_model, eval_shard, train.batch_size, tokenizer.pad_token_id, mask_dtype, backend, world)
            )
        if when.generate and rank == 0:
            # here, not at the top: the metrics' libraries (nltk, jieba) take 2 s to import, for runs that generate only
            from raylora.eval.in_training import generation_scores

            metrics.update(
                generation_scores(model, tokenizer, config["generate_rows"], cfg, backend.autocast)["default"]
            )
        if when.final and not params_finite(p for p in model.parameters() if p.requires_grad):
            return outcome("diverged", state, resumed_from)
        state.history.append({"step": state.step, **metrics})
        if rank == 0:
            eta = elapsed / (state.step - resumed_from) * (train.max_steps - state.step)
            extra = f"  eval_loss {metrics['eval_loss']:.4f}" if "eval_loss" in metrics else ""
            say(
                f"step {state.step}/{train.max_steps}  loss {loss:.4f}  lr {metrics['lr']:.2e}  tokens/s {metrics['tokens_per_s']:.0f}  ETA {eta:.0f}s{extra}"
            )
            if log_metrics:
                log_metrics(metrics, state.step)
        report = {**metrics, "step": state.step, "resumed_from": resumed_from, "done": int(when.final)}
        every = config["report_every"]
        if not (when.save or when.evaluate or (every and state.step % every == 0)):
            continue  # a report waits for Ray Train's controller to take the last one (one every 2 s)
        if when.save:
            state.lr_scale = lr_scale[0]
            last_good = ckpt.snapshot(model, optimizer, scheduler, scaler, state)
        # Every rank's hook state differs (residuals, PowerSGD's errors): each rank adds its own file.
        with checkpoint_dir(when.save and (rank == 0 or hook is not None)) as folder:
            if folder is not None:
                if rank == 0:
                    ckpt.save(folder, model, optimizer, scheduler, scaler, state, cfg)
                if hook is not None:
                    ckpt.save_comm(folder, hook, rank)
                ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(folder))
            else:
                ray.train.report(report)
    if resumed_from == train.max_steps and state.history:
        # Restored at its last step: stopped after writing that checkpoint and before Tune took its report (a sweep
        # stopped by a signal), so no trial result held it; the report goes again.
        ray.train.report({**state.history[-1], "resumed_from": resumed_from, "done": 1})
    if profiler is not None:
        profiler.stop()
    return outcome("done", state, resumed_from)


def say(line: str) -> None:
    """Write one console line from a worker; Ray forwards the worker's stdout to the driver.

    Not ``print``: Ray Train replaces ``print`` on its workers with a function that logs the line through the
    root logger (whose console handler writes to stderr) and, because a worker's ``sys.stdout`` is a wrapper,
    also prints it, so every line reached the driver twice.
    """
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def quiet_report_logs() -> None:
    """Silence Ray Train's per-step ``Reporting training result ...`` INFO line on the console.

    Ray 2.60 logs it through a logger named after its source file, outside ``ray.train``, so RunConfig's
    ``LoggingConfig(log_level=...)`` does not reach it; the progress line already says what it would.
    """
    with contextlib.suppress(ImportError, AttributeError):
        from ray.train.v2._internal.execution import context  # Ray's private module: may move in any release

        context.logger.setLevel(logging.WARNING)


def agreed(folder: Path | None, handed: Path | None, device: torch.device) -> Path | None:
    """The checkpoint every rank resumes from: each rank's own pick (:func:`~raylora.train.checkpoint.resume_point`)
    when they all picked the same step, else the one Ray Train handed them all (a rank whose network filesystem
    lists a new folder late must not start at another step than the others)."""
    step = float(ckpt.checkpoint_step(folder)) if folder is not None else -1.0
    steps = torch.tensor([step, -step], dtype=torch.float32, device=device)  # steps are exact in float32
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    return folder if steps[0].item() == -steps[1].item() else handed


def outcome(status: str, state: TrainState, resumed_from: int) -> dict:
    return {"status": status, "step": state.step, "resumed_from": resumed_from, "skipped_steps": state.skipped_steps}


def record_worker(output_dir: Path, rank: int, device: torch.device) -> None:
    """``<output_dir>/workers/rank<N>.json``: host, Ray node, pid, device and placement group of each worker.

    For operators, and for a sweep, which removes the placement group of a trial that Tune ended.
    """
    folder = output_dir / "workers"
    folder.mkdir(parents=True, exist_ok=True)
    node = ray.get_runtime_context().get_node_id()
    group = ray.util.get_current_placement_group()
    info = {"rank": rank, "host": socket.gethostname(), "node": node, "pid": os.getpid(), "device": str(device),
            "placement_group": group.id.hex() if group else None}  # fmt: skip
    (folder / f"rank{rank}.json").write_text(json.dumps(info))


def data_shard(config: dict, name: str, rank: int, world: int):
    """This worker's rows of dataset ``name``: its share of prepared packs (rank ``rank`` of ``world``), else
    Ray Train's split of a streamed dataset."""
    if name in config["packs"]:
        return worker_share(config["packs"][name], rank, world)
    return ray.train.get_dataset_shard(name)


def micro_batches(
    shard, batch_size: int, state: TrainState, world: int, seed: int
) -> Iterator[tuple[list[dict], tuple[int, int]]]:
    """Micro-batches of pack rows, epoch after epoch, starting at the position in ``state``.

    Prepared packs (a :class:`~raylora.data.packs.PackShard`) are read in each epoch's order drawn from
    ``seed`` (:meth:`~raylora.data.packs.PackShard.batch_after`); a streamed shard in the stream's order. Yields
    ``(rows, (epoch, rows consumed in the epoch by all workers))``. A resumed run skips ``state.rows_in_epoch``
    rows of the epoch in total, whatever the number of workers that wrote it.
    """
    position = (state.epoch, state.rows_in_epoch)
    if isinstance(shard, PackShard):
        while True:
            rows, position = shard.batch_after(position, batch_size, seed)
            yield rows, position
    epoch, skip = position[0], position[1] // (batch_size * world)
    while True:
        index = 0
        for batch in shard.iter_batches(batch_size=batch_size, batch_format="pyarrow", drop_last=True):
            index += 1
            if skip:
                skip -= 1
                continue
            yield batch.to_pylist(), (epoch, index * batch_size * world)
        if index == 0:
            raise RuntimeError(f"this worker's data shard holds fewer than train.batch_size={batch_size} sequences")
        epoch += 1


def train_step(
    ddp,
    batches,
    optimizer,
    scheduler,
    scaler,
    pad_id,
    mask_dtype,
    device,
    train: TrainArgs,
    backend: Backend,
    world: int,
):
    """One optimizer step over ``grad_accum`` micro-batches on each of ``world`` workers.

    The objective is the cross-entropy summed over every label token of the step (all micro-batches, all
    workers) divided by their number, so neither accumulation nor the worker count changes it: the label
    count is all-reduced before the first backward, and each micro-batch's summed loss is scaled by
    ``world / count`` (DDP averages gradients over workers). All but the last micro-batch run under
    ``no_sync()``; the last one's backward all-reduces the accumulated gradients. The step is taken only
    if the loss and the gradient norm are finite.

    Args:
        ddp: the :class:`~raylora.train.lm.LossModel`, DDP-wrapped when ``world > 1``.
        batches: iterator of ``(pack rows, data position)``.
    Returns:
        ``(loss per label token over workers, real tokens over workers, gradient norm, data position, {})``: the
        last, metrics of the step's objective, has none for this one (see
        :func:`~raylora.train.preference.preference_step`).
    """
    micro, labels, tokens = [], 0, 0
    for _ in range(train.grad_accum):
        rows, position = next(batches)
        micro.append({key: v.to(device) for key, v in collate_packs(rows, pad_id, mask_dtype).items()})
        labels, tokens = labels + label_tokens(rows), tokens + sum(r["num_tokens"] for r in rows)
    counts = torch.tensor([float(labels), float(tokens)], device=device)
    if world > 1:
        dist.all_reduce(counts)
    scale = world / max(counts[0].item(), 1.0)
    total = torch.zeros((), device=device)
    for k, batch in enumerate(micro):
        sync = k == train.grad_accum - 1 or world == 1
        with contextlib.nullcontext() if sync else ddp.no_sync():
            with backend.autocast():
                loss_sum = ddp(**batch)
            scaler.scale(loss_sum * scale).backward()
        total += loss_sum.detach().float()
    if world > 1:
        dist.all_reduce(total)
    loss = total.item() / max(counts[0].item(), 1.0)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = take_step(params, optimizer, scheduler, scaler, train.max_grad_norm, loss)
    return loss, int(counts[1].item()), grad_norm, position, {}


@torch.no_grad()
def evaluate(model, shard, batch_size: int, pad_id: int, mask_dtype, backend: Backend, world: int) -> dict[str, float]:
    """Eval loss per label token (and perplexity) over every worker's eval shard; ``model``: a ``LossModel``."""
    model.eval()
    device = next(model.parameters()).device
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in shard.iter_batches(batch_size=batch_size, batch_format="pyarrow"):
        rows = batch.to_pylist()
        tensors = {k: v.to(device) for k, v in collate_packs(rows, pad_id, mask_dtype).items()}
        with backend.autocast():
            loss_sum = model(**tensors)
        total[0] += loss_sum.double()
        total[1] += label_tokens(rows)
    model.train()
    return eval_scores(total[None], world, replicated=False)[0]


@contextlib.contextmanager
def checkpoint_dir(wanted: bool) -> Iterator[Path | None]:
    if not wanted:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="raylora-ckpt-") as folder:
        yield Path(folder)
