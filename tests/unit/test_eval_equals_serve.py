"""Issue #37: a greedy `raylora eval` scores what `raylora serve` answers, on a W8A8 SmoothQuant base too. The eval
actor (every candidate's rows decoding together, 16 at a time) and the serving replica (one request at a time, its
adapter loaded on demand) each quantise the base themselves; every answer is the same, so every score is (the
integration test of `raylora eval` against a running server, test_serve.py, holds the scores equal on a float32
base)."""

import asyncio

import numpy as np
import torch
from peft import LoraConfig, get_peft_model

from raylora.config import from_dict, to_dict
from raylora.eval.generate import Answerer, eval_request
from raylora.generation import Engine, wait_for
from raylora.models import randomise_lora, tiny_model
from raylora.serve.replica import LLMServer

QUESTIONS = [
    "Who are you?", "What is the capital of France?", "Name three colours.", "Write one word.",
    "Count from one to ten, slowly, and then say something about each number you counted.", "hi",
]  # fmt: skip


def _adapter(folder, seed: int, rank: int):
    model = get_peft_model(
        tiny_model("llama"), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"])
    )
    randomise_lora(model, seed, 0.5)
    model.save_pretrained(folder)
    return folder


def test_eval_answers_equal_the_servers_on_a_w8a8_base(tmp_path, monkeypatch):
    """Answers, and the logits of every step behind them, bit for bit (a random tiny model's answers alone rarely
    show a difference in the last bits: its logits do)."""
    root = tmp_path / "adapters"
    names = {"alpha": 4, "beta": 8, "gamma": 4}
    for seed, (name, rank) in enumerate(names.items()):
        _adapter(root / name, seed + 1, rank)
    cfg = to_dict(from_dict({
        "model": {"name_or_path": "tiny-llama"},
        "data": {"sources": [{"path": "data/raylora_identity.jsonl"}]},
        "serve": {"quantization": "w8a8-smoothquant", "adapter_root": str(root), "max_adapters": 1, "cpus_per_replica": 2,
                  "max_batch_size": 16,
                  # the guarantee's conditions: every prompt prefilled whole, no prefix-cache hit (docs/serving.md)
                  "max_prefill_tokens": 512, "prefix_cache_mb": 0},
        "eval": {"max_tokens": 24, "max_batch_size": 16, "cpus_per_actor": 2, "metrics": ["exact_match", "rouge-l"]},
        "backend": {"device": "cpu"},
        "tracking": {"enabled": False},
    }))  # fmt: skip
    logits: dict[str, dict[tuple, list[torch.Tensor]]] = {"serve": {}, "eval": {}}
    side = "serve"
    sample = Engine._sample

    def spy(self, rows, seqs):
        for row, seq in zip(rows, seqs, strict=True):
            logits[side].setdefault((tuple(seq.req.prompt_ids), seq.req.adapter), []).append(row.clone())
        return sample(self, rows, seqs)

    monkeypatch.setattr(Engine, "_sample", spy)
    server = LLMServer(cfg)
    try:
        ids = [server.render([{"role": "user", "content": q}], None) for q in QUESTIONS]
        candidates = [None, *names]
        served = {}
        for name in candidates:  # one request at a time, as one user would send them; the LRU holds one adapter
            if name:
                asyncio.run(server._load(name))
            for i, prompt in enumerate(ids):
                event = wait_for(server.engine, eval_request(prompt, name, server.cfg.eval))
                served[(i, name)] = event
            if name:
                server.retire(name)
    finally:
        server.engine.stop()

    side = "eval"
    answerer = Answerer(cfg, {name: str(root / name) for name in names})
    try:
        rows = [(i, name) for i in range(len(ids)) for name in candidates]  # interleaved: every batch mixes them
        out = answerer({
            "row": np.array([i for i, _ in rows]), "candidate": np.array([n or "base" for _, n in rows], dtype=object),
            "adapter": np.array([n or "" for _, n in rows], dtype=object),
            "prompt_ids": [np.array(ids[i]) for i, _ in rows], "answer_ids": [np.array([1]) for _ in rows],
        })  # fmt: skip
    finally:
        answerer.engine.stop()
    assert answerer.engine.max_running > 4  # the eval's rows decoded together
    evaluated = {row: answer for row, answer in zip(rows, out["answer"], strict=True)}
    assert {row: e.text for row, e in served.items()} == evaluated
    assert len(set(evaluated.values())) > len(QUESTIONS)  # the candidates answer differently
    assert logits["serve"].keys() == logits["eval"].keys() and len(logits["eval"]) == len(rows)
    for key, steps in logits["serve"].items():
        assert len(steps) == len(logits["eval"][key])
        assert all(torch.equal(a, b) for a, b in zip(steps, logits["eval"][key], strict=True)), key[1]
