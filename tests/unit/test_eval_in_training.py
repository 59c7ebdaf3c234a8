"""The generation eval during training (raylora.eval.in_training): the adapter being trained answers the rows as
Hugging Face's greedy ``generate`` does, scored as ``raylora eval`` scores, and the model keeps its mode."""

import pytest
import torch

from raylora.backends import resolve_backend
from raylora.config import BackendArgs, LoraArgs, TrainArgs, load_config
from raylora.eval.in_training import generation_scores
from raylora.eval.metrics import means, score_row
from raylora.models import attach_lora, randomise_lora, tiny_model, tiny_tokenizer
from raylora.train.lm import training_model


def _rows(tok) -> list[dict]:
    texts = [("Say hi.", "hi there"), ("Name a colour.", "blue"), ("Count to three.", "one two three")]
    return [
        {"prompt_ids": tok(q, add_special_tokens=False).input_ids, "reference": ref, "calls": None, "tools": None,
         "keys": [ref.split()[0]], "source": "a.json"}
        for q, ref in texts
    ]  # fmt: skip


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_trained_adapter_answers_as_generate_does_and_is_scored_as_eval_scores(precision):
    backend = resolve_backend(BackendArgs(device="cpu", precision=precision))
    model = attach_lora(tiny_model("llama"), LoraArgs(rank=4, dropout=0.1)).train()
    randomise_lora(model, 3, 0.2)
    training_model(model, TrainArgs(), backend)  # the training path: fused LoRA, frozen weights in the autocast dtype
    tok = tiny_tokenizer()
    cfg = load_config(None, ["model.name_or_path=tiny-llama", "eval.max_tokens=12",
                             "eval.metrics=[exact_match, contains, rouge-l, bleu-4, length, reference_loss]"])  # fmt: skip
    rows = _rows(tok)
    scores = generation_scores(model, tok, rows, cfg, backend.autocast)["default"]
    assert model.training  # back to training after answering

    model.eval()
    scored = []
    with torch.no_grad(), backend.autocast():
        for r in rows:
            out = model.generate(input_ids=torch.tensor([r["prompt_ids"]]), max_new_tokens=12, do_sample=False)[0]
            new = out[len(r["prompt_ids"]) :].tolist()
            ends = [k for k, t in enumerate(new) if t == tok.eos_token_id]
            new = new[: ends[0]] if ends else new
            answer = tok.decode(new, skip_special_tokens=True)
            metrics = ["exact_match", "contains", "rouge-l", "bleu-4", "length"]
            scored.append({"candidate": "c", "source": r["source"],
                           "scores": score_row(answer, r["reference"], None, None, r["keys"], len(new), metrics)})  # fmt: skip
    expected = {f"gen_{m}": v for m, v in means(scored, metrics)["c"]["metrics"].items()}
    assert scores == expected and "gen_reference_loss" not in scores
    assert scores["gen_length"] > 0
