"""LM-head loss on CPU: ``raylora.ops.linear_ce.linear_cross_entropy`` against full logits + ``F.cross_entropy``.

Forward and backward of the summed cross-entropy of 1,000 label positions through SmolLM2-135M's head (576 wide,
49,152 tokens, frozen as in LoRA) with bf16 matrix products, as a training step runs it, 2 torch threads. The
baseline is :func:`~raylora.ops.linear_ce.linear_cross_entropy_reference` (the (1,000 x 49,152) fp32 logits, then
``F.cross_entropy``). Both run back to back in one process, alternating, 10 times each; medians are printed with
the ratio and the largest difference of loss and hidden-state gradient.

    .venv/bin/python bench/linear_ce.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from raylora.ops.linear_ce import linear_cross_entropy, linear_cross_entropy_reference  # noqa: E402

ROWS, HIDDEN, VOCAB = 1000, 576, 49152


def _run(fn, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    started = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fn(h, w, t, torch.bfloat16)
    loss.backward()
    elapsed = time.perf_counter() - started
    grad, h.grad = h.grad, None
    return elapsed, loss.item(), grad


def main() -> None:
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    h = (torch.randn(ROWS, HIDDEN, generator=gen) * 0.5).requires_grad_()
    w = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05
    t = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    paths = {"full logits + F.cross_entropy (baseline)": linear_cross_entropy_reference, "ours": linear_cross_entropy}
    times, results = {name: [] for name in paths}, {}
    for k in range(11):
        for name, fn in paths.items():
            elapsed, loss, grad = _run(fn, h, w, t)
            results[name] = loss, grad
            if k:
                times[name].append(elapsed)
    base, ours = (statistics.median(times[name]) * 1000 for name in paths)
    (loss_b, grad_b), (loss_o, grad_o) = results.values()
    print(f"| rows x vocab | baseline ms | ours ms | speed-up |\n|---|---|---|---|\n| {ROWS} x {VOCAB} | {base:.0f} | "
          f"{ours:.0f} | {base / ours:.2f}x |")  # fmt: skip
    print(f"loss {loss_o:.3f} vs {loss_b:.3f}; largest gradient difference {(grad_o - grad_b).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
