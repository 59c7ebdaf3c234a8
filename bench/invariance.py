"""What batch invariance costs the engine: its own attention and float64 LoRA sums against sdpa and float32 sums.

The engine alone, in this process, on SmolLM2-135M-Instruct as `raylora serve` loads it (W8A8 SmoothQuant, 2 engine
threads) with --adapters random rank-8 attention adapters (bench/serve.py's) stacked as the adapter bank stacks them.
Workloads, each run on both paths, alternated --repeats times (medians and their ratio printed):
  b1       one request, a long answer: 256 greedy tokens, no adapter
  b16      32 alpaca questions, 128 tokens each, batch 16, no adapter
  mix64    64 alpaca questions x 2, adapters round-robin, 64 tokens each, batch 64 (an eval actor's workload)

  invariant   the engine as it is (raylora/ops/engine_attention.py; LoRA sums in float64)
  baseline    torch's sdpa for each attention the engine computes (each prompt still prefilled over its own keys, as
              its packed prefill needs; decode keys still in whole blocks) and float32 LoRA sums: the engine without
              batch invariance

    .venv/bin/python bench/invariance.py [--adapters 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from serve import LONG_ANSWER, _config, make_adapters, questions  # noqa: E402


def paths():
    """``{name: switch}``: each switch turns the engine's path on for the runs after it."""
    import torch

    from raylora.ops import engine_attention, lora

    attend, build = engine_attention.attend, lora._build

    def sdpa(query, key, value, mask, scale):
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scale, enable_gqa=True
        )

    def float32_build(layer, names):
        stack = build(layer, names)
        stack.a, stack.b = stack.a.float(), stack.b.float()
        return stack

    def invariant(model):
        engine_attention.attend, lora._build = attend, build
        lora.stack_adapters(model)

    def baseline(model):
        engine_attention.attend, lora._build = sdpa, float32_build
        lora.stack_adapters(model)

    return {"invariant": invariant, "baseline": baseline}


def workloads(model, tokenizer, names: list[str]) -> dict:
    from raylora.generation import Engine, GenRequest, run_all

    def ids(messages):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]

    asked = [list(ids(m)) for m in questions(64)]

    def rate(batch: int, reqs: list) -> float:
        engine = Engine(model, tokenizer, batch, 0, 2, 64)
        try:
            started = time.perf_counter()
            events = run_all(engine, reqs)
            return sum(e.completion_tokens for e in events) / (time.perf_counter() - started)
        finally:
            engine.stop()

    long = list(ids([{"role": "user", "content": LONG_ANSWER}]))
    return {
        "b1": lambda: rate(1, [GenRequest(long, None, max_tokens=256, temperature=0)]),
        "b16": lambda: rate(16, [GenRequest(q, None, max_tokens=128, temperature=0) for q in asked[:32]]),
        "mix64": lambda: rate(
            64, [GenRequest(q, names[i % len(names)], max_tokens=64, temperature=0) for i, q in enumerate(asked * 2)]
        ),
    }


def served_with_adapters(adapters: int):
    """SmolLM2 as `raylora serve` loads it (W8A8 SmoothQuant) holding ``adapters`` random rank-8 attention adapters:
    ``(peft model, tokenizer, adapter names)``."""
    from peft import PeftModel

    from raylora.generation import on_passing_thread
    from raylora.serve.replica import load_serving_model

    base, tokenizer, _ = on_passing_thread(lambda: load_serving_model(_config("float32", 16, "w8a8-smoothquant")), 2)
    root = Path(tempfile.mkdtemp(prefix="raylora-bench-"))
    names = make_adapters(root, adapters)
    model = PeftModel.from_pretrained(base, str(root / names[0]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(root / name), adapter_name=name)
    return model.eval(), tokenizer, names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    model, tokenizer, names = served_with_adapters(args.adapters)
    runs = workloads(model, tokenizer, names)
    results: dict[str, dict[str, list[float]]] = {p: {w: [] for w in runs} for p in ("invariant", "baseline")}
    for _ in range(args.repeats):
        for path, switch in paths().items():
            switch(model)
            for work, run in runs.items():
                results[path][work].append(run())
                print(f"{path:9} {work:5} {results[path][work][-1]:7.1f} tok/s", flush=True)
    paths()["invariant"](model)
    print("\n| workload | invariant tok/s | baseline tok/s | ratio |\n|---|---|---|---|")
    for work in runs:
        ours, base_ = (statistics.median(results[p][work]) for p in ("invariant", "baseline"))
        print(f"| {work} | {ours:.1f} | {base_:.1f} | {ours / base_:.2f}x |")


if __name__ == "__main__":
    main()
