"""Which int8 matmul the W8A8 base runs: the kernels raylora selects on this CPU (the fastest exact one at 1 row, for
calls of fewer than FEW_ROWS rows, and at 16) against ``torch._int_mm`` for every call (what it always used before
the choice was timed), in the serving engine and alone.

The engine, in this process, on SmolLM2-135M-Instruct as `raylora serve` loads it (W8A8 SmoothQuant, 2 engine
threads) with --adapters random rank-8 attention adapters (bench/serve.py's) stacked as the adapter bank stacks them:
the selected kernels, then each kernel of raylora.ops.int8.INT8_MATMUL_KERNELS for every call (every kernel gives the
same numbers: the answers are compared):
  b1       one request, --tokens greedy tokens, no adapter
  b16      16 alpaca questions, --tokens / 2 tokens each, batch 16, no adapter
  mix64    64 alpaca questions, adapters round-robin, --tokens / 4 tokens each, batch 64 (an eval actor's workload)
then each kernel alone: a pass through matrices of SmolLM2's shapes (30 layers of fused q/k/v 576 -> 960, o 576 -> 576,
fused gate/up 576 -> 3,072, down 1,536 -> 576, and the LM head 576 -> 49,152: 134 MB of int8, read from memory as a
decode step reads them) at 1, 2, 3 and 16 rows, then each shape alone, held in cache, at 1, 16 and 64 rows. Short
workloads: torch._int_mm without VNNI decodes about 10 tokens/s.

    .venv/bin/python bench/int8_kernel.py [--adapters 4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from invariance import served_with_adapters  # noqa: E402
from serve import LONG_ANSWER, questions  # noqa: E402

BASELINE = "torch._int_mm"
SHAPES = ((576, 960), (1536, 576), (576, 49152))
LAYER = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (in, out) of one SmolLM2 decoder layer's matmuls


def seconds(kernel, a, weights, repeats: int = 5) -> float:
    """Best of ``repeats`` timings of ``kernel`` on ``a``'s rows through every one of ``weights``, after a warm-up."""
    kernel(a[weights[0].shape[1]], weights[0].t())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            kernel(a[w.shape[1]], w.t())
        best = min(best, time.perf_counter() - start)
    return best


def workloads(model, tokenizer, names: list[str], tokens: int) -> dict:
    from raylora.generation import Engine, GenRequest, run_all

    def ids(messages):
        return list(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )

    asked = [ids(m) for m in questions(64)]

    def run(batch: int, reqs: list) -> tuple[float, list[str]]:
        engine = Engine(model, tokenizer, batch, 0, 2, 64)
        try:
            started = time.perf_counter()
            events = run_all(engine, reqs)
            return sum(e.completion_tokens for e in events) / (time.perf_counter() - started), [e.text for e in events]
        finally:
            engine.stop()

    long = ids([{"role": "user", "content": LONG_ANSWER}])
    return {
        "b1": lambda: run(1, [GenRequest(long, None, max_tokens=tokens, temperature=0)]),
        "b16": lambda: run(16, [GenRequest(q, None, max_tokens=tokens // 2, temperature=0) for q in asked[:16]]),
        "mix64": lambda: run(
            64,
            [GenRequest(q, names[i % len(names)], max_tokens=tokens // 4, temperature=0) for i, q in enumerate(asked)],
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    import torch

    import raylora.ops.int8 as int8
    from raylora.generation import on_passing_thread
    from raylora.ops.lora import stack_adapters

    model, tokenizer, names = served_with_adapters(args.adapters)
    cpu = torch.device("cpu")
    selected = int8._kernels(cpu)
    print(f"selected on this CPU: {selected} (torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()})")
    choices = {"selected": dict(int8._selected)}
    choices.update({k: dict.fromkeys([("cpu", True), ("cpu", False)], k) for k in int8.INT8_MATMUL_KERNELS})
    stack_adapters(model)  # as the serving adapter bank and an eval actor do
    for warm_up in workloads(model, tokenizer, names, 8).values():  # first calls: kernels loaded, shapes seen
        on_passing_thread(warm_up, 2)
    runs = workloads(model, tokenizer, names, args.tokens)
    rates: dict[str, dict[str, float]] = {}
    answers: dict[str, dict[str, list[str]]] = {}
    for choice, table in choices.items():
        int8._selected.clear()
        int8._selected.update(table)
        rates[choice], answers[choice] = {}, {}
        for work, run in runs.items():
            rates[choice][work], answers[choice][work] = on_passing_thread(run, 2)
            print(f"{choice:15} {work:5} {rates[choice][work]:7.1f} tok/s", flush=True)
    int8._selected.clear()
    int8._selected.update(choices["selected"])
    print(f"\n| workload | {' tok/s | '.join(choices)} tok/s | selected / {BASELINE} | same answers |")
    print("|---|" + "---|" * (len(choices) + 2))
    for work in runs:
        same = all(answers[c][work] == answers["selected"][work] for c in choices)
        cells = " | ".join(f"{rates[c][work]:.1f}" for c in choices)
        print(f"| {work} | {cells} | {rates['selected'][work] / rates[BASELINE][work]:.2f}x | {same} |")
    kernels = list(int8.INT8_MATMUL_KERNELS)
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)

    def rows_of(m: int) -> dict:
        return {k: torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen) for k in (576, 1536)}

    model_weights = [torch.ones(n, k, dtype=torch.int8) for k, n in LAYER * 30 + ((576, 49152),)]
    mb = sum(w.numel() for w in model_weights) / 1e6
    print(f"\n| a pass through {mb:.0f} MB of SmolLM2's int8 weights, 2 threads | {' ms | '.join(kernels)} ms |")
    print("|---|" + "---|" * len(kernels))
    for rows in (1, 2, 3, 16):
        a = rows_of(rows)
        cells = " | ".join(f"{seconds(int8.INT8_MATMUL_KERNELS[kn], a, model_weights) * 1e3:.2f}" for kn in kernels)
        print(f"| {rows} row(s) | {cells} |")
    print(f"\n| matmul held in cache (rows x in -> out) | {' ms | '.join(kernels)} ms |\n|---|" + "---|" * len(kernels))
    for k, n in SHAPES:
        weight = [torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)]
        for rows in (1, 16, 64):
            a = rows_of(rows)
            cells = " | ".join(f"{seconds(int8.INT8_MATMUL_KERNELS[kn], a, weight) * 1e3:.2f}" for kn in kernels)
            print(f"| {rows} x {k} -> {n} | {cells} |")


if __name__ == "__main__":
    main()
