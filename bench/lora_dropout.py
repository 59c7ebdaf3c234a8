"""LoRA dropout on CPU: ``raylora.ops.dropout.lora_dropout`` against ``torch.nn.functional.dropout`` (baseline).

Forward and backward of dropout at p=0.05 on the inputs a SmolLM2-135M LoRA step drops (2 x 512 tokens; 576
wide for attention and gate/up, 1536 for down), in fp32 (what autocast leaves after a norm) and bf16 (a
linear's output), 2 torch threads. Ours leaves out the 1/(1-p) scale, which the fused LoRA linear folds into its
rank-wide up-projection. Both run back to back in one process, alternating, 30 times each; medians are printed
with the ratio.

    .venv/bin/python bench/lora_dropout.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from raylora.ops.dropout import lora_dropout  # noqa: E402

P = 0.05


def _time(fn, x: torch.Tensor) -> float:
    started = time.perf_counter()
    fn(x).sum().backward()
    return time.perf_counter() - started


def main() -> None:
    torch.set_num_threads(2)
    paths = {
        "F.dropout (baseline)": lambda x: F.dropout(x, P, True),
        "raylora lora_dropout": lambda x: lora_dropout(x, P, True),
    }
    print("| input | F.dropout ms | lora_dropout ms | speed-up |\n|---|---|---|---|")
    for width, dtype in ((576, torch.float32), (1536, torch.float32), (576, torch.bfloat16), (1536, torch.bfloat16)):
        x = torch.randn(2, 512, width, dtype=dtype, requires_grad=True)
        times = {name: [] for name in paths}
        for k in range(31):
            for name, fn in paths.items():
                elapsed = _time(fn, x)
                if k:
                    times[name].append(elapsed)
        base, ours = (statistics.median(times[name]) * 1000 for name in paths)
        print(
            f"| (2, 512, {width}) {str(dtype).removeprefix('torch.')} | {base:.2f} | {ours:.2f} | {base / ours:.2f}x |"
        )


if __name__ == "__main__":
    main()
