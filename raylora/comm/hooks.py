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
``hadamard3``  three bits per entry: each 128-entry block of the bucket (plus the residual: error feedback) is
              rotated by a fixed random-sign Hadamard transform, which spreads its large entries over the whole
              block so that its values look Gaussian, then each value is sent as the nearest of the 8 Lloyd-Max
              levels of a Gaussian times the block's RMS (one bf16 scale per block): 0.098 of the bytes of ``none``

Why ``hadamard3`` keeps Adam's loss where ``sign`` and ``topk`` lose it: Adam divides each entry's step by the root
of its mean square gradient. A compressor with error feedback delivers each entry's gradient on average, but with
noise; Adam's mean square sees that noise too, so the entries' steps shrink. Top-k hands an entry rare full quanta
and sign a steady quantum-sized sign, far larger than a small entry's gradient; levels scaled by a block's largest
entry (tried before this hook: 0 and ±1, ±1/4, ±1/16 of it) round most of a heavy-tailed block to zero. After the
rotation no entry stands out, the block's RMS is the right scale, and Lloyd-Max levels make the error the least a
3-bit code can (about 3.5% of the block's energy). bench/comm.py measures the loss over several data orders.

Every hook averages over ranks, as DDP does, and sends its collectives through :mod:`raylora.comm.bytes`, so
``bytes_sent()`` is the payload measured this step. Only ``torch.distributed`` is used: the same hooks run on
gloo, NCCL and HCCL.
"""

# no `from __future__ import annotations`: DDP compares the hook's annotations with the real types
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from raylora.backends import Backend, BackendError
from raylora.comm import bytes as comm_bytes
from raylora.config import TrainArgs

HOOKS = ("none", "fp16", "bf16", "powersgd", "topk", "sign", "hadamard3")
_CAST = {"fp16": torch.float16, "bf16": torch.bfloat16}
# hadamard3's levels in units of the rotated block's RMS, codes 0 to 7: the Lloyd-Max quantiser of a unit Gaussian
HADAMARD3_LEVELS = (-2.1520, -1.3439, -0.7560, -0.2451, 0.2451, 0.7560, 1.3439, 2.1520)
HADAMARD3_BLOCK = 128  # a power of 2 (the transform's size)
HADAMARD3_SEED = 20240917  # the rotation's signs: the same on every rank

comm_bytes.install(powerSGD_hook, default_hooks)  # PowerSGD's warm-up steps all-reduce through default_hooks
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
        self.shapes: dict[str, torch.Size] = {}
        # PowerSGD keys its state by bucket index, and a bucket's parameters change when DDP lays its buckets out
        # anew (after the first step, and after a resume): which parameters each bucket's state is laid out for,
        # and per-parameter state taken out of a layout that changed, waiting for its new bucket.
        self.layout: dict[int, list[str]] = {}
        self.pieces: dict[str, dict[str, torch.Tensor]] = {}
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
        self.shapes = {name: p.shape for name, p in ddp.module.named_parameters()}
        if self.name == "powersgd":
            ddp.register_comm_hook(self, _powersgd_hook)
        elif self.name == "topk":
            ddp.register_comm_hook(self, _topk_hook)
        elif self.name == "sign":
            ddp.register_comm_hook(self, _sign_hook)
        elif self.name == "hadamard3":
            ddp.register_comm_hook(self, _hadamard3_hook)
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
        self.pieces.clear()
        self.layout.clear()
        if self.powersgd is not None:
            for memory in (self.powersgd.error_dict, self.powersgd.p_memory_dict, self.powersgd.q_memory_dict):
                memory.clear()

    def state_dict(self) -> dict[str, Any]:
        """This rank's hook state, keyed by parameter name: topk's, sign's and hadamard3's residuals; PowerSGD's
        settings and counters, and per parameter its error and warm-start factors."""
        if self.powersgd is not None:
            settings = {k: v for k, v in self.powersgd.__getstate__().items() if k not in _POWERSGD_MEMORY}
            pieces = {n: {k: t.clone() for k, t in piece.items()} for n, piece in self._powersgd_pieces().items()}
            return {"powersgd": settings, "pieces": pieces}
        return {"residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if self.powersgd is not None:
            for slot, value in saved["powersgd"].items():
                setattr(self.powersgd, slot, value)
            self.forget()
            self.pieces = {n: dict(piece) for n, piece in saved["pieces"].items()}
        else:
            self.residuals = {k: v.clone() for k, v in saved["residuals"].items()}

    def powersgd_layout(self, index: int, names: list[str]) -> None:
        """Lay PowerSGD's state for bucket ``index`` out for its parameters ``names``, in their order.

        The state of this bucket's old layout, and of any bucket whose old layout holds one of ``names`` (DDP moves
        parameters between buckets), is taken apart per parameter; this bucket's is put back together from its
        parameters' pieces, the others' on their own next call. Only buckets not yet called this step are taken
        apart, so no collective in flight loses its state.
        """
        state = self.powersgd
        wanted = set(names)
        for old in [j for j, held in self.layout.items() if j == index or wanted.intersection(held)]:
            for name, piece in self._powersgd_split(old).items():
                self.pieces.setdefault(name, {}).update(piece)
            for memory in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
                memory.pop(old, None)
            del self.layout[old]
        self.layout[index] = names
        parts = [self.pieces.pop(n, {}) for n in names]
        if not names or not all("error" in part for part in parts):
            return  # PowerSGD has not run yet (warm-up), or starts afresh
        state.error_dict[index] = torch.cat([part["error"] for part in parts])
        by_name = dict(zip(names, parts, strict=True))
        order = [n for n, _, _ in self._powersgd_order(names)]
        empty = state.error_dict[index].new_empty(0)
        state.p_memory_dict[index] = torch.cat([by_name[n]["p"] for n in order]) if order else empty
        state.q_memory_dict[index] = torch.cat([by_name[n]["q"] for n in order]) if order else empty

    def _powersgd_pieces(self) -> dict[str, dict[str, torch.Tensor]]:
        """PowerSGD's state per parameter, from every bucket and the pieces waiting for theirs (views, not copies)."""
        pieces = {n: dict(piece) for n, piece in self.pieces.items()}
        for index in self.layout:
            pieces.update(self._powersgd_split(index))
        return pieces

    def _powersgd_split(self, index: int) -> dict[str, dict[str, torch.Tensor]]:
        """Bucket ``index``'s PowerSGD state per parameter: ``error`` (flat, gradient-sized) and, for the matrices it
        compresses, ``p`` and ``q`` (the flat warm-start factors); views into PowerSGD's tensors."""
        state, names = self.powersgd, self.layout[index]
        if index not in state.error_dict:
            return {}
        sizes = [self.shapes[n].numel() for n in names]
        pieces = {
            name: {"error": error} for name, error in zip(names, state.error_dict[index].split(sizes), strict=True)
        }
        order = self._powersgd_order(names)
        ps = state.p_memory_dict[index].split([p for _, p, _ in order])
        qs = state.q_memory_dict[index].split([q for _, _, q in order])
        for (name, _, _), p, q in zip(order, ps, qs, strict=True):
            pieces[name].update(p=p, q=q)
        return pieces

    def _powersgd_order(self, names: list[str]) -> list[tuple[str, int, int]]:
        """``(name, P length, Q length)`` of the matrices PowerSGD compresses in a bucket of ``names``, in the order
        its hook lays them out in P and Q memory: grouped by matrix shape, groups in order of first appearance."""
        groups: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        for name in names:
            shape = self.shapes[name]
            n, m = shape[0], shape[1:].numel()
            rank = min(n, m, self.powersgd.matrix_approximation_rank)
            if powerSGD_hook._should_compress(n, m, rank, self.powersgd.min_compression_rate)[0]:
                groups.setdefault((n, m), []).append((name, n * rank, m * rank))
        return [entry for group in groups.values() for entry in group]


_POWERSGD_MEMORY = ("error_dict", "p_memory_dict", "q_memory_dict")


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


def _powersgd_hook(hook: CommHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's PowerSGD hook, its state first laid out for this bucket's parameters if they changed.

    One bucket at a time: PyTorch's hook waits for its P all-reduce inside a future's callback, which on gloo runs
    on one of the process group's worker threads; with two buckets in flight both threads can block that way and
    the step hangs (seen with 0.002 MiB buckets on 2 gloo processes). LoRA's gradients usually fill one bucket.
    """
    names = [hook.names[p] for p in bucket.parameters()]
    if hook.layout.get(bucket.index()) != names:
        hook.powersgd_layout(bucket.index(), names)
    future = powerSGD_hook.powerSGD_hook(hook.powersgd, bucket)
    future.wait()
    return future


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


def _hadamard3_hook(hook: CommHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Send each rotated block as 3-bit codes of :data:`HADAMARD3_LEVELS` and its bf16 RMS; keep what they miss.

    Each rank all-gathers the others' codes and scales (uint8), sums what they stand for in the rotated space,
    rotates the sum back once and divides by the number of ranks. ``corrected - decoded`` is the residual added
    next step.
    """
    buffer = bucket.buffer()
    corrected, names, sizes = hook.corrected(bucket)
    codes, scales = _hadamard3_encode(corrected)
    sent = _rotate(_hadamard3_values(codes, scales))[: corrected.numel()]
    hook.residuals.update(zip(names, (corrected - sent).split(sizes), strict=True))
    packed = torch.cat([_pack3(codes), scales.view(torch.uint8)])
    world = _world(hook.group)
    gathered = [torch.empty_like(packed) for _ in range(world)]
    future = _dist.all_gather(gathered, packed, group=hook.group, async_op=True).get_future()
    n, code_bytes = buffer.numel(), packed.numel() - 2 * scales.numel()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        total = torch.zeros(codes.numel(), dtype=torch.float32, device=buffer.device)
        for part in gathered:
            total += _hadamard3_values(
                _unpack3(part[:code_bytes], codes.numel()), part[code_bytes:].view(torch.bfloat16)
            )
        buffer.copy_(_rotate(total)[:n].div_(world))
        return buffer

    return future.then(decompress)


def _hadamard3_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of fp32 vector ``x``, zero-padded to whole blocks and rotated (:func:`_rotate`): one
    bf16 RMS per block (fp32's range: without loss scaling a block's RMS can fall below fp16's smallest normal,
    6e-5), and uint8 codes 0-7, one per padded entry, the nearest level to each rotated value over the
    scale as sent. A block of zeros sends scale 0; a non-finite block a non-finite scale, so the decoded step is
    non-finite and skipped."""
    rotated = _rotate(torch.nn.functional.pad(x, (0, -x.numel() % HADAMARD3_BLOCK))).view(-1, HADAMARD3_BLOCK)
    scales = rotated.square().mean(1).sqrt().bfloat16()
    sent = scales.float()[:, None]
    ratio = torch.where(sent > 0, rotated / sent, 0.0)
    levels = torch.tensor(HADAMARD3_LEVELS, device=x.device)
    codes = torch.bucketize(ratio, (levels[1:] + levels[:-1]) / 2)
    return codes.flatten().to(torch.uint8), scales


def _hadamard3_values(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The rotated fp32 vector that ``codes`` (one per padded entry) and ``scales`` (one per block) stand for."""
    levels = torch.tensor(HADAMARD3_LEVELS, device=codes.device)
    return (levels[codes.long()].view(-1, HADAMARD3_BLOCK) * scales.float()[:, None]).flatten()


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """``x`` (whole blocks) with each block multiplied by :func:`_rotation`; the same call rotates back."""
    return (x.view(-1, HADAMARD3_BLOCK) @ _rotation(x.device)).flatten()


@functools.cache
def _rotation(device: torch.device) -> torch.Tensor:
    """``D H D / sqrt(block)``: ``H`` the Hadamard matrix, ``D`` a diagonal of random signs drawn from
    :data:`HADAMARD3_SEED` (the same on every rank). Symmetric and orthogonal: its own inverse. One matmul rotates
    every block (128 multiply-adds an entry), fewer kernel launches than the 7 butterfly stages of a fast transform.
    """
    signs = torch.randint(0, 2, (HADAMARD3_BLOCK,), generator=torch.Generator().manual_seed(HADAMARD3_SEED))
    signs = 2.0 * signs - 1
    hadamard = torch.ones(1, 1)
    while hadamard.shape[0] < HADAMARD3_BLOCK:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)])
    return (signs[:, None] * hadamard * signs / HADAMARD3_BLOCK**0.5).to(device)


def _pack3(codes: torch.Tensor) -> torch.Tensor:
    """3-bit codes (uint8 values 0-7) as bytes: every 8 codes in 3 bytes (zero-padded at the end)."""
    eight = torch.nn.functional.pad(codes, (0, -codes.numel() % 8)).view(-1, 8).int()
    word = (eight << _SHIFT3.to(codes.device)).sum(1, dtype=torch.int32)
    return torch.stack([(word >> s) & 255 for s in (0, 8, 16)], 1).to(torch.uint8).flatten()


def _unpack3(packed: torch.Tensor, n: int) -> torch.Tensor:
    three = packed.view(-1, 3).int()
    word = three[:, 0] | (three[:, 1] << 8) | (three[:, 2] << 16)
    return ((word[:, None] >> _SHIFT3.to(packed.device)) & 7).to(torch.uint8).flatten()[:n]


_SHIFT3 = 3 * torch.arange(8, dtype=torch.int32)
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
