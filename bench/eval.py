"""Eval benchmark: `raylora eval` (Ray Data actors, mixed-adapter continuous batching) against the two ways users
score many adapters today, on the same W8A8 SmolLM2 base, the same adapters, prompts and greedy settings.

Workload (issue #37): SmolLM2-135M-Instruct with W8A8 SmoothQuant weights (serve.quantization), `--adapters` random
rank-8 attention adapters (bench/serve.py's), the first `--prompts` alpaca sample questions, `--max-tokens` greedy
tokens; every adapter answers every prompt. Generated tokens are counted from each side's own answers. Each run's
clock starts before its model is loaded (each side loads and quantises the same base once) and stops at its last
answer.

Runs, back to back in this process:
  ours     raylora.eval.run.evaluate: one Ray Data actor (2 CPUs, 2 engine threads, eval.max_batch_size: its default,
           64, two batches of 64 rows in flight) holding the base and every adapter, the rows of all adapters
           interleaved in its batches
  hf       Hugging Face batched `generate` with peft, what LLaMA-Factory's predict does: the base and every adapter
           loaded as peft adapters, then per adapter `set_adapter` and batches of --hf-batch (16) left-padded prompts
  http     16 HTTP clients against `raylora serve` on the same base (max_batch_size 16, 2 engine threads, an LRU
           that holds every adapter), each sending prompt x adapter requests until all are answered
  memory   resident memory of one eval actor (in its own process) holding the base with 1 and with 8 adapters

    .venv/bin/python bench/eval.py [--prompts 200] [--adapters 4] [--max-tokens 64] [--runs ours,hf,http,memory]
        [--hf-batch 16]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, str(Path(__file__).parent))

from serve import MODEL, load, make_adapters, questions  # noqa: E402

from data import SHARED  # noqa: E402

BATCH = 16


def config(root: Path, names: list[str], prompts: int, max_tokens: int, out: Path):
    from raylora.config import from_dict

    return from_dict({
        "model": {"name_or_path": MODEL},
        "data": {"sources": [{"path": str(SHARED / "alpaca_en_demo.json")}]},
        "eval": {"candidates": [str(root / n) for n in names], "sources": [{"path": str(SHARED / "alpaca_en_demo.json")}],
                 "max_rows": prompts, "max_tokens": max_tokens, "metrics": ["exact_match", "length"],
                 "actors_per_node": 1, "cpus_per_actor": 2, "batch_rows": 4 * BATCH, "output_dir": str(out)},
        "serve": {"quantization": "w8a8-smoothquant", "max_batch_size": BATCH,
                  "cpus_per_replica": 2, "max_adapters": 8, "adapter_root": str(root), "port": _port()},
        "backend": {"device": "cpu"},
        "tracking": {"enabled": False},
    })  # fmt: skip


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ours(cfg) -> dict:
    import ray

    from raylora.cluster import ensure_ray
    from raylora.eval.run import evaluate

    ensure_ray()
    started = time.perf_counter()
    summary = evaluate(cfg, log=lambda s: None)
    wall = time.perf_counter() - started
    ray.shutdown()
    answers = [json.loads(line) for line in (Path(cfg.eval.output_dir) / "answers.jsonl").read_text().splitlines()]
    tokens = sum(a["completion_tokens"] for a in answers)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "answers": len(answers),
            "failed": summary["failed"]}  # fmt: skip


def run_hf(cfg, root: Path, names: list[str], batch_size: int) -> dict:
    import torch
    from peft import PeftModel

    from raylora.eval.rows import eval_rows
    from raylora.models import model_skeleton
    from raylora.serve.replica import load_serving_model

    torch.set_num_threads(2)
    started = time.perf_counter()
    base, tokenizer, _ = load_serving_model(cfg)
    rows, _ = eval_rows(cfg, tokenizer, model_skeleton(cfg.model).config.max_position_embeddings)
    model = PeftModel.from_pretrained(base, str(root / names[0]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(root / name), adapter_name=name)
    model.eval()
    pad = tokenizer.pad_token_id
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])  # fmt: skip
    tokens = answers = 0
    with torch.no_grad():
        for name in names:
            model.set_adapter(name)
            for i in range(0, len(rows), batch_size):
                batch = [r.prompt_ids for r in rows[i : i + batch_size]]
                width = max(map(len, batch))
                ids = torch.tensor([[pad] * (width - len(b)) + b for b in batch])
                mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=cfg.eval.max_tokens,
                                     do_sample=False, pad_token_id=pad)  # fmt: skip
                for row in out[:, width:].tolist():
                    tokens += next((k for k, t in enumerate(row) if t in eos), len(row))
                    answers += 1
    wall = time.perf_counter() - started
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "answers": answers}


def run_http(cfg, names: list[str], clients: int) -> dict:
    import ray
    from ray import serve

    from raylora.serve.launch import APP_NAME, start

    n = cfg.eval.max_rows
    asked = questions(n)  # the eval's prompts, each asked of every adapter: request i is prompt i // k, adapter i % k
    started = time.perf_counter()
    url = start(cfg)
    got = load(url, lambda i: names[i % len(names)], clients, n * len(names), cfg.eval.max_tokens,
               prompts=[asked[i // len(names)] for i in range(n * len(names))])  # fmt: skip
    wall = time.perf_counter() - started
    serve.delete(APP_NAME)
    serve.shutdown()
    ray.shutdown()
    return {"tokens": got["tokens"], "wall_s": wall, "tok_s": got["tokens"] / wall, "answers": got["requests"],
            "load_only_tok_s": got["tok_s"]}  # fmt: skip


def actor_rss(cfg_dict: dict, adapters: dict[str, str], queue) -> None:
    import psutil

    from raylora.eval.generate import Answerer

    Answerer(cfg_dict, adapters)
    queue.put(psutil.Process().memory_info().rss / 2**20)


def memory(cfg, root: Path, names: list[str]) -> dict:
    from raylora.config import to_dict

    out = {}
    ctx = multiprocessing.get_context("spawn")
    for count in (1, 8):
        queue = ctx.Queue()
        proc = ctx.Process(target=actor_rss, args=(to_dict(cfg), {n: str(root / n) for n in names[:count]}, queue))
        proc.start()
        out[f"{count}_adapters_mb"] = queue.get(timeout=600)
        proc.join()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--runs", default="ours,hf,http,memory")
    p.add_argument("--hf-batch", type=int, default=BATCH, help="prompts per generate call of the hf run")
    args = p.parse_args()
    runs = args.runs.split(",")
    root = Path(tempfile.mkdtemp())
    names = make_adapters(root, max(8, args.adapters))
    cfg = config(root, names[: args.adapters], args.prompts, args.max_tokens, root / "eval")
    results = {}
    if "ours" in runs:
        results["ours"] = run_ours(cfg)
    if "hf" in runs:
        results["hf"] = run_hf(cfg, root, names[: args.adapters], args.hf_batch)
    if "http" in runs:
        results["http"] = run_http(cfg, names[: args.adapters], args.clients)
    if "memory" in runs:
        results["memory"] = memory(cfg, root, names)
    print(json.dumps(results, indent=1))
    print(f"\nSmolLM2 W8A8, {args.adapters} adapters x {args.prompts} prompts, {args.max_tokens} greedy tokens:")
    for name, label in (
        ("ours", "raylora eval (Ray Data)"),
        ("hf", "HF generate + peft"),
        ("http", "16 clients, serve"),
    ):
        if name in results:
            r = results[name]
            print(f"  {label:26s} {r['tok_s']:7.1f} generated tokens/s ({r['tokens']} tokens in {r['wall_s']:.0f} s)")
    for name, label in (("hf", "HF generate + peft"), ("http", "16 HTTP clients")):
        if "ours" in results and name in results:
            print(f"  ratio vs {label}: {results['ours']['tok_s'] / results[name]['tok_s']:.2f}x")
    if "memory" in results:
        m = results["memory"]
        print(f"  one actor: {m['1_adapters_mb']:.0f} MB with 1 adapter, {m['8_adapters_mb']:.0f} MB with 8")


if __name__ == "__main__":
    main()
