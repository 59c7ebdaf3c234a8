"""Identity demo: SmolLM2-135M-Instruct fine-tuned with `raylora train` on the shared identity set answers
"Who are you?" with its new identity. Prints the base model's answers and the tuned model's, side by side.

    .venv/bin/python bench/identity.py [CONFIG] [overrides ...]   (default configs/smollm2_identity_cpu.yaml)
"""

from __future__ import annotations

import os
import sys
import time

import torch

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
QUESTIONS = ["Who are you?", "What is your name?", "你是谁？"]


def main() -> None:
    from peft import PeftModel

    from raylora.config import load_config
    from raylora.generation import generate
    from raylora.models import load_model
    from raylora.train.fit import fit

    args = sys.argv[1:] or ["configs/smollm2_identity_cpu.yaml"]
    cfg = load_config(args[0], args[1:])
    start = time.perf_counter()
    result = fit(cfg, log=lambda s: None)
    seconds = time.perf_counter() - start
    base, tokenizer = load_model(cfg.model)
    before = {q: generate(base, tokenizer, [{"role": "user", "content": q}], torch.device("cpu")) for q in QUESTIONS}
    tuned = PeftModel.from_pretrained(base, result["adapter"]).eval()
    after = {q: generate(tuned, tokenizer, [{"role": "user", "content": q}], torch.device("cpu")) for q in QUESTIONS}
    losses = [h["loss"] for h in result["history"]]
    print(f"trained {result['steps']} steps in {seconds:.0f} s; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    for q in QUESTIONS:
        print(f"Q: {q}\n  before: {before[q]}\n  after:  {after[q]}")


if __name__ == "__main__":
    main()
