"""How much of the gradient all-reduce hides behind backward, read from a profiler trace of one step.

With gradient accumulation only the last micro-batch's backward all-reduces (the others run under
``no_sync``). DDP hands a bucket to the communication hook as soon as its gradients are ready, so the
collective of an early bucket runs while backward still computes the later ones; the last bucket's
collective can only start when backward is done, and the step waits for it. The share of collective time
that coincides with backward compute is what bucketing buys; the rest is exposed.

gloo runs each collective on its own worker threads, where ``torch.profiler`` records it as
``gloo:<collective>`` spanning the work itself (including the wait for the slowest rank). On NCCL and
HCCL the collectives run on device streams and the host trace holds only their launches: the measure is
for gloo, and :func:`hidden_share` finds nothing to measure elsewhere.
"""

from __future__ import annotations

import torch

_COLLECTIVE_PREFIX = "gloo:"
_BACKWARD_PREFIX = "autograd::engine::evaluate_function"
_COPY_BACK = "torch.distributed.ddp.reducer::copy_bucket_to_grad"


def hidden_share(
    events: list[tuple[str, float, float]], backward_from: float, backward_until: float = float("inf")
) -> dict[str, float] | None:
    """The all-reduce time overlapped by backward compute in one step's trace.

    Args:
        events: ``(name, start, end)`` of every profiled event, any unit of time (microseconds from the profiler).
        backward_from: the time the synchronising backward starts (events before it, e.g. the ``no_sync``
            micro-batches, are ignored).
        backward_until: the time DDP has written the reduced gradients back (collectives started after it, such
            as the loop's own loss all-reduce, are not the gradients').
    Returns:
        ``comm_collectives`` (how many ran: one per bucket for an all-reduce hook), ``comm_ms`` (union of their spans), ``comm_hidden_ms`` (the part of it inside backward's
        compute) and ``comm_hidden_fraction`` (their ratio), assuming microseconds; ``None`` when the trace
        holds no gloo collective after ``backward_from``.
    """
    spans = [
        (a, b) for name, a, b in events if name.startswith(_COLLECTIVE_PREFIX) and backward_from <= a <= backward_until
    ]
    comm = _union(spans)
    if not comm:
        return None
    compute = _union([(a, b) for name, a, b in events if name.startswith(_BACKWARD_PREFIX) and a >= backward_from])
    total = sum(b - a for a, b in comm)
    hidden = _overlap(comm, compute)
    return {"comm_collectives": len(spans), "comm_ms": total / 1e3, "comm_hidden_ms": hidden / 1e3,
            "comm_hidden_fraction": hidden / total}  # fmt: skip


def start_trace(enabled: bool) -> torch.profiler.profile | None:
    """A started host-thread profiler for the step about to run (``None`` when not ``enabled``)."""
    if not enabled:
        return None
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    prof.start()
    return prof


def finish_trace(prof: torch.profiler.profile | None) -> dict[str, float]:
    """Stop ``prof`` (from :func:`start_trace`) and measure its step with :func:`hidden_share`.

    Returns:
        :func:`hidden_share`'s figures; empty when there was no profiler or no gloo collective in the trace.
    """
    if prof is None:
        return {}
    prof.stop()
    events = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()]
    # The synchronising backward follows the last forward (DDP's forward marks it) and ends when DDP has copied the
    # last reduced bucket into the gradients.
    forwards = [end for name, _, end in events if name == "DistributedDataParallel.forward"]
    copies = [end for name, _, end in events if name == _COPY_BACK]
    return hidden_share(events, max(forwards, default=0.0), max(copies, default=float("inf"))) or {}


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _overlap(first: list[tuple[float, float]], second: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted lists of disjoint spans."""
    total, i, j = 0.0, 0, 0
    while i < len(first) and j < len(second):
        total += max(0.0, min(first[i][1], second[j][1]) - max(first[i][0], second[j][0]))
        if first[i][1] < second[j][1]:
            i += 1
        else:
            j += 1
    return total
