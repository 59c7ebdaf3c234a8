"""DDP communication hooks chosen by ``train.comm_hook``, with their state kept for checkpoints.

``none``      all-reduce of the fp32 bucket (DDP's own algorithm, through a hook so its bytes are counted)
``fp16``      the bucket cast to fp16, all-reduced, cast back (half the bytes)
``bf16``      the same in bf16: PyTorch's ``bf16_compress_hook`` refuses gloo, this one needs only a backend that
              all-reduces bf16 (gloo, NCCL, HCCL on Atlas A2 and later)
``powersgd``  PyTorch's PowerSGD (rank ``train.powersgd_rank``, plain all-reduce for ``train.powersgd_warmup``
              steps), with error feedback and warm start
``topk``      the ``train.topk_fraction`` largest entries of each bucket (after adding what earlier steps left
              out: error feedback), exchanged as values and indices by all-gather and summed into the bucket
``sign``      one bit per entry, the sign, and one scale per tensor (its mean absolute value), with error feedback:
              about 1/32 of the bytes, and every entry moves every step, which suits Adam better than top-k's
              sparse updates (bench/comm.py measures both)

Every hook averages over ranks, as DDP does, and sends its collectives through :mod:`raylora.comm.bytes`, so
``bytes_sent()`` is the payload measured this step. Only ``torch.distributed`` is used: the same hooks run on
gloo, NCCL and HCCL.
"""

# no `from __future__ import annotations`: DDP compares the hook's annotations with the real types
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from raylora.backends import Backend, BackendError
from raylora.comm import bytes as comm_bytes
from raylora.config import TrainArgs

HOOKS = ("none", "fp16", "bf16", "powersgd", "topk", "sign")
_CAST = {"fp16": torch.float16, "bf16": torch.bfloat16}

comm_bytes.install(powerSGD_hook)
_dist = comm_bytes.PROXY


class CommHook:
    """The hook registered on one DDP model, and the state a checkpoint must keep for an exact resume.

    Args:
        train: ``comm_hook`` and its settings.
        group: the process group (None: the default group).
    """

    def __init__(self, train: TrainArgs, group=None):
        self.name = train.comm_hook
        self.group = group
        self.fraction = train.topk_fraction
        self.residuals: dict[str, torch.Tensor] = {}  # topk's error feedback, per parameter name
        self.names: dict[torch.nn.Parameter, str] = {}
        self.powersgd = (
            powerSGD_hook.PowerSGDState(
                process_group=group,
                matrix_approximation_rank=train.powersgd_rank,
                start_powerSGD_iter=train.powersgd_warmup,
                min_compression_rate=1,
                use_error_feedback=True,
                warm_start=True,
                random_seed=train.seed,
            )
            if self.name == "powersgd"
            else None
        )

    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Register this hook on ``ddp``."""
        self.names = {p: name for name, p in ddp.module.named_parameters()}
        if self.name == "powersgd":
            ddp.register_comm_hook(self.powersgd, powerSGD_hook.powerSGD_hook)
        elif self.name == "topk":
            ddp.register_comm_hook(self, _topk_hook)
        elif self.name == "sign":
            ddp.register_comm_hook(self, _sign_hook)
        else:
            ddp.register_comm_hook(self, _cast_hook)

    def corrected(self, bucket: dist.GradBucket) -> tuple[torch.Tensor, list[str], list[int]]:
        """The bucket plus the residual each of its parameters kept from earlier steps (fp32), their names and sizes.

        Residuals are kept per parameter: DDP lays its buckets out anew after the first step (and after a resume).
        """
        names = [self.names[p] for p in bucket.parameters()]
        sizes = [p.numel() for p in bucket.parameters()]
        buffer = bucket.buffer()
        residual = [
            self.residuals.get(n, buffer.new_zeros(k, dtype=torch.float32)) for n, k in zip(names, sizes, strict=True)
        ]
        return buffer.float() + torch.cat(residual), names, sizes

    def forget(self) -> None:
        """Drop the error feedback: after a non-finite step it holds NaN or inf, which would poison every later step."""
        self.residuals.clear()
        if self.powersgd is not None:
            for memory in (self.powersgd.error_dict, self.powersgd.p_memory_dict, self.powersgd.q_memory_dict):
                memory.clear()

    def state_dict(self) -> dict[str, Any]:
        """This rank's hook state: topk residuals or PowerSGD's errors and warm-start factors."""
        if self.powersgd is not None:
            return {"powersgd": self.powersgd.__getstate__()}
        return {"residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if self.powersgd is not None:
            self.powersgd.__setstate__(saved["powersgd"])
            self.powersgd.process_group = self.group
        else:
            self.residuals = {k: v.clone() for k, v in saved["residuals"].items()}


def check_hook(train: TrainArgs, backend: Backend) -> None:
    """Refuse ``train.comm_hook`` where the backend's collectives cannot carry its wire dtype.

    Called on the driver with the planned backend (before any worker starts) and again on each worker, which
    knows its device (an NPU's SoC) when the driver does not.

    Raises:
        BackendError: the reason, and the hook to use instead.
    """
    wire = _CAST.get(train.comm_hook)
    problem = backend.collective_problem(wire) if wire is not None else None
    if problem:
        raise BackendError(
            f"train.comm_hook={train.comm_hook} cannot run on this {backend.dist_backend} backend: {problem}. "
            "Use train.comm_hook=fp16, which sends the same bytes, or none."
        )


def bytes_sent() -> int:
    """Payload bytes this rank handed to collectives since the last call."""
    return comm_bytes.COUNTER.take()


def _world(group) -> int:
    return dist.get_world_size(group)


def _cast_hook(hook: CommHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket's mean, in fp32 (``none``) or cast to fp16 / bf16 on the wire."""
    buffer = bucket.buffer()
    wire = buffer.to(_CAST[hook.name]) if hook.name in _CAST else buffer
    wire.div_(_world(hook.group))
    future = _dist.all_reduce(wire, group=hook.group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


def _topk_hook(hook: CommHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Send the largest ``fraction`` of the bucket (plus its residual) as (values, int32 indices); keep the rest.

    Each rank all-gathers the others' selections, scatter-adds them into a zero bucket and divides by the
    number of ranks. The entries a rank did not send are its residual, added to the same bucket next step.
    """
    buffer = bucket.buffer()
    corrected, names, sizes = hook.corrected(bucket)
    k = max(1, round(hook.fraction * corrected.numel()))
    index = corrected.abs().topk(k, sorted=False).indices
    values = corrected[index]
    corrected[index] = 0
    hook.residuals.update(zip(names, corrected.split(sizes), strict=True))
    # values and indices travel as one float32 tensor: the indices' bits reinterpreted, never converted
    packed = torch.cat([values, index.to(torch.int32).view(torch.float32)])
    world = _world(hook.group)
    gathered = [torch.empty_like(packed) for _ in range(world)]
    future = _dist.all_gather(gathered, packed, group=hook.group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        total = torch.zeros(buffer.numel(), dtype=torch.float32, device=buffer.device)
        for part in gathered:
            total.index_add_(0, part[k:].view(torch.int32).long(), part[:k])
        buffer.copy_(total.div_(world))
        return buffer

    return future.then(decompress)


def _sign_hook(hook: CommHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Send each entry's sign as one bit and each tensor's mean absolute value; keep what that misses.

    Each rank all-gathers the others' bits and scales (uint8), rebuilds ``sign * scale`` per tensor, sums and
    divides by the number of ranks. ``corrected - sign * scale`` is the residual added next step.
    """
    buffer = bucket.buffer()
    corrected, names, sizes = hook.corrected(bucket)
    scales = torch.stack([part.abs().mean() for part in corrected.split(sizes)])
    positive = corrected >= 0
    sent = _signed(positive, scales, sizes)
    hook.residuals.update(zip(names, (corrected - sent).split(sizes), strict=True))
    packed = torch.cat([_pack_bits(positive), scales.view(torch.uint8)])
    world = _world(hook.group)
    gathered = [torch.empty_like(packed) for _ in range(world)]
    future = _dist.all_gather(gathered, packed, group=hook.group, async_op=True).get_future()
    bits = packed.numel() - 4 * len(sizes)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        total = torch.zeros(buffer.numel(), dtype=torch.float32, device=buffer.device)
        for part in gathered:
            total += _signed(_unpack_bits(part[:bits], buffer.numel()), part[bits:].view(torch.float32), sizes)
        buffer.copy_(total.div_(world))
        return buffer

    return future.then(decompress)


_BITS = 2 ** torch.arange(8, dtype=torch.uint8)


def _pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """A bool vector as uint8 bytes, 8 flags a byte (zero-padded at the end)."""
    padded = torch.zeros(-(-flags.numel() // 8) * 8, dtype=torch.uint8, device=flags.device)
    padded[: flags.numel()] = flags
    return (padded.view(-1, 8) * _BITS.to(flags.device)).sum(1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    return (packed[:, None] & _BITS.to(packed.device)).ne(0).flatten()[:n]


def _signed(positive: torch.Tensor, scales: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``+scale`` where ``positive``, else ``-scale``, each tensor of the bucket with its own scale."""
    magnitude = torch.repeat_interleave(scales, torch.tensor(sizes, device=scales.device))
    return torch.where(positive, magnitude, -magnitude)
