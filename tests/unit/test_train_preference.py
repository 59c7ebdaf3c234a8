"""Preference objectives against TRL 1.16 (a test-only dependency): DPO and KTO through ``DPOTrainer.compute_loss``
and ``KTOTrainer.compute_loss`` on the same tiny model, adapter and rows (loss, every LoRA gradient and the logged
metrics); SimPO and ORPO through ``CPOTrainer.cpo_loss`` and ``ORPOTrainer.odds_ratio_loss`` on the same
log-probabilities. Also: an answer's
log-probability inside a pack equals its log-probability alone, and accumulation and two DDP workers leave a
preference step unchanged."""

import os
import random
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from ranks import run_two_ranks
from torch.nn.parallel import DistributedDataParallel

from raylora.backends import resolve_backend
from raylora.config import BackendArgs, LoraArgs, PreferenceArgs, TrainArgs
from raylora.data.packing import join
from raylora.models import attach_lora, randomise_lora, tiny_model, tiny_tokenizer
from raylora.train.lm import training_model
from raylora.train.preference import (
    STATS,
    PreferenceModel,
    collate_pairs,
    metrics,
    objective_terms,
    pair_losses,
    preference_step,
)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
BACKEND = resolve_backend(BackendArgs(device="cpu", precision="fp32"))


def _pairs(shapes=((5, 4, 6), (3, 7, 2)), seed: int = 0) -> list[dict]:
    gen = random.Random(seed)
    return [
        {key: [gen.randrange(3, 200) for _ in range(n)] for key, n in zip(("prompt_ids", "chosen_ids", "rejected_ids"), shape, strict=True)}
        for shape in shapes
    ]  # fmt: skip


def _shared_pack(units: list[tuple[list[int], list[int], list[int]]]) -> dict:
    """One pack of ``(prompt, first answer, second answer)`` units as the data side lays them out
    (:mod:`raylora.data.pairs`): the prompt with the first answer, then the prompt's last token with the second,
    which reads the rest of the prompt from the first."""
    examples, shared = [], []
    for prompt, first, second in units:
        examples += [(prompt + first, [-100] * len(prompt) + first), (prompt[-1:] + second, [-100] + second)]
        shared += [0, len(prompt) - 1]
    row = join(examples, shared)
    return row | {"num_tokens": len(row["input_ids"])}


def _row(pairs: list[dict]) -> dict:
    """One pack of the pairs: the prompt once, its chosen then its rejected answer."""
    return _shared_pack([(p["prompt_ids"], p["chosen_ids"], p["rejected_ids"]) for p in pairs])


def _peft():
    model = attach_lora(tiny_model("llama"), LoraArgs(rank=4, alpha=8, dropout=0.0, target_modules=["all-linear"]))
    randomise_lora(model, 3, 0.1)
    return model


def _ours(objective: str, pref: PreferenceArgs, chunked: bool = True) -> PreferenceModel:
    loss_model, _ = training_model(_peft(), TrainArgs(chunked_loss=chunked), BACKEND)
    return PreferenceModel(loss_model.model, loss_model.chunked, objective, pref, loss_model.head)


def _lora_grads(model) -> dict[str, torch.Tensor]:
    """Gradients by LoRA weight, named without peft's wrapper prefix and adapter name."""
    grads = {}
    for name, p in model.named_parameters():
        if p.requires_grad and p.grad is not None:
            grads[name.split("base_model.model.")[-1].replace(".default", "")] = p.grad
    return grads


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "sigmoid+sft"])
@pytest.mark.parametrize("chunked", [True, False])
def test_dpo_equals_trls_dpo_trainer_in_loss_gradients_and_metrics(tmp_path, loss_type, chunked):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    pairs = _pairs()
    sft = 0.5 if loss_type.endswith("+sft") else 0.0  # RPO: TRL's loss types [sigmoid, sft] weighted [1, 0.5]
    kind = loss_type.split("+")[0]
    losses = {"loss_type": [kind, "sft"], "loss_weights": [1.0, sft]} if sft else {"loss_type": [kind]}
    args = DPOConfig(output_dir=str(tmp_path), beta=0.1, report_to=[], use_cpu=True, bf16=False,
                     per_device_train_batch_size=2, **losses)  # fmt: skip
    tiny = Dataset.from_list([{"prompt": "a b", "chosen": " c", "rejected": " d"}] * 2)  # TRL wants one; unused
    trainer = DPOTrainer(model=_peft(), args=args, train_dataset=tiny, processing_class=tiny_tokenizer())
    trainer.model.delete_adapter("ref")  # TRL copies a trained adapter as the reference; ours is the base
    theirs = trainer.compute_loss(trainer.model, trainer.data_collator(pairs))
    theirs.backward()

    pref = PreferenceArgs(beta=0.1, loss_type=kind, sft_weight=sft)
    ours = _ours("dpo", pref, chunked)
    batch = collate_pairs([_row(pairs)], 0, torch.float32)
    terms, stats = objective_terms("dpo", pref, ours(**batch))
    chosen_tokens = sum(len(p["chosen_ids"]) for p in pairs)
    loss = terms[0] / len(pairs) + terms[1] / chosen_tokens
    loss.backward()

    assert loss.item() == pytest.approx(theirs.item(), abs=1e-5)
    expected, got = _lora_grads(trainer.model), _lora_grads(ours)
    assert set(expected) == set(got) and len(got) == 28
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    for name, value in zip(STATS, (stats / len(pairs)).tolist(), strict=True):
        assert value == pytest.approx(logged[name], abs=1e-5), name


def _kto_rows(seed: int = 0) -> list[dict]:
    """TRL's tokenized unpaired rows, each with its KL completion: the previous row's (TRL's rotation by one)."""
    gen = random.Random(seed)
    rows = [
        {"prompt_ids": [gen.randrange(3, 200) for _ in range(p)], "completion_ids": [gen.randrange(3, 200) for _ in range(c)],
         "label": label}
        for p, c, label in ((5, 4, True), (3, 7, False), (6, 2, True), (2, 5, False), (4, 3, False))
    ]  # fmt: skip
    for k, row in enumerate(rows):
        row["KL_completion_ids"] = rows[k - 1]["completion_ids"]
    return rows


def _kto_pack(rows: list[dict]) -> dict:
    """The rows as raylora packs them: each its prompt with its answer, then with its KL answer; labels beside."""
    pack = _shared_pack([(r["prompt_ids"], r["completion_ids"], r["KL_completion_ids"]) for r in rows])
    return pack | {"desirable": [r["label"] for r in rows]}


@pytest.mark.parametrize(("seed", "weights"), [(5, (1.0, 1.0)), (5, (1.0, 1.5)), (0, (1.0, 1.0))])
def test_kto_equals_trls_kto_trainer_in_loss_gradients_and_metrics(tmp_path, seed, weights):
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    rows = _kto_rows(seed)
    args = KTOConfig(output_dir=str(tmp_path), beta=0.1, desirable_weight=weights[0], undesirable_weight=weights[1],
                     report_to=[], use_cpu=True, bf16=False, per_device_train_batch_size=len(rows))  # fmt: skip
    tiny = Dataset.from_list([{"prompt": "a b", "completion": " c", "label": k % 2 == 0} for k in range(2)])
    trainer = KTOTrainer(model=_peft(), args=args, train_dataset=tiny, processing_class=tiny_tokenizer())
    if "ref" in trainer.model.peft_config:
        trainer.model.delete_adapter("ref")  # ours is the base with the adapter off
    theirs = trainer.compute_loss(trainer.model, trainer.data_collator(rows))
    theirs.backward()

    pref = PreferenceArgs(beta=0.1, desirable_weight=weights[0], undesirable_weight=weights[1])
    ours = _ours("kto", pref)
    batch = collate_pairs([_kto_pack(rows)], 0, torch.float32)
    outputs = ours(**{k: v for k, v in batch.items() if k != "desirable"})
    kl = ((outputs[0][1::2] - outputs[2][1::2]).mean()).clamp(min=0).detach()
    terms, stats = objective_terms("kto", pref, outputs, batch["desirable"], kl)
    loss = terms[0] / len(rows)
    loss.backward()

    assert (kl.item() > 0) == (seed == 5)  # rows 5: the KL term in play; rows 0: a negative estimate clamped to 0
    assert loss.item() == pytest.approx(theirs.item(), abs=1e-6)
    expected, got = _lora_grads(trainer.model), _lora_grads(ours)
    assert set(expected) == set(got) and len(got) == 28
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-5, msg=name)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    scores = metrics("kto", stats.tolist(), len(rows))
    assert set(scores) == {
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "kl",
    }
    for name, value in scores.items():
        assert value == pytest.approx(logged[name], abs=1e-5), name


def _logps(seed: int = 1) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    sums = -torch.rand(4, 8, generator=gen) * 40 - 1  # chosen, rejected: summed log-probabilities
    tokens = torch.randint(1, 30, (2, 8), generator=gen).float()
    return sums[0], sums[1], tokens[0], tokens[1]


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_simpo_equals_trls_cpo_loss_with_simpo(smoothing):
    from trl.experimental.cpo import CPOTrainer

    c, r, nc, nr = _logps()
    pref = PreferenceArgs(beta=2.0, gamma=0.5, label_smoothing=smoothing)
    trl = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=0.5, beta=2.0, label_smoothing=smoothing,
                          accelerator=SimpleNamespace(device=torch.device("cpu")))  # fmt: skip
    expected = CPOTrainer.cpo_loss(trl, c / nc, r / nr)  # TRL's CPO averages per token for simpo
    losses, chosen_reward, rejected_reward, _, _ = pair_losses("simpo", pref, (c, nc), (r, nr))
    for got, want in zip((losses, chosen_reward, rejected_reward), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_orpo_equals_trls_odds_ratio_loss():
    from trl.experimental.orpo import ORPOTrainer

    c, r, nc, nr = _logps()
    trl = SimpleNamespace(beta=0.1, accelerator=SimpleNamespace(device=torch.device("cpu")))
    ratio_losses, chosen_reward, rejected_reward, _, _ = ORPOTrainer.odds_ratio_loss(trl, c / nc, r / nr)
    losses, ours_chosen, ours_rejected, _, _ = pair_losses("orpo", PreferenceArgs(beta=0.1), (c, nc), (r, nr))
    torch.testing.assert_close(losses, -ratio_losses)  # TRL subtracts its ``losses`` from the NLL
    torch.testing.assert_close(ours_chosen, chosen_reward)
    torch.testing.assert_close(ours_rejected, rejected_reward)


def test_dpo_label_smoothing_is_conservative_dpo():
    c, r, nc, nr = _logps()
    c0, r0 = c + 0.3, r - 0.2
    losses = pair_losses("dpo", PreferenceArgs(beta=0.1, label_smoothing=0.1), (c, nc), (r, nr), (c0, r0))[0]
    z = 0.1 * ((c - c0) - (r - r0))
    torch.testing.assert_close(
        losses, -0.9 * torch.nn.functional.logsigmoid(z) - 0.1 * torch.nn.functional.logsigmoid(-z)
    )


def test_an_answers_log_probability_in_a_pack_equals_its_log_probability_alone():
    """Packed with other pairs, the rejected answer after the prompt it shares with the chosen one, each answer has
    the log-probability it has after its prompt in a sequence of its own (no pack, plain causal attention)."""
    pairs = _pairs(((5, 4, 6), (3, 7, 2), (8, 1, 9), (1, 3, 3)))
    model = _ours("dpo", PreferenceArgs())
    with torch.no_grad():
        batch = collate_pairs([_row(pairs)], 0, torch.float32)
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")} | {
            "cu_seq_lens_q": batch["cu_seq_lens"], "shared_prefix": batch["shared_prefix"]
        }  # fmt: skip
        packed, tokens = model.answer_logps(inputs, batch["labels"], batch["examples"], 2 * len(pairs))
        alone = []
        for pair in pairs:
            for answer in ("chosen_ids", "rejected_ids"):
                ids = torch.tensor([pair["prompt_ids"] + pair[answer]])
                logits = model.model(input_ids=ids).logits[0, :-1].log_softmax(-1)
                rows = torch.arange(len(pair["prompt_ids"]) - 1, ids.shape[1] - 1)
                alone.append(logits[rows, ids[0, rows + 1]].sum())
        torch.testing.assert_close(packed, torch.stack(alone), atol=1e-5, rtol=1e-5)
        assert tokens.tolist() == [len(p[a]) for p in pairs for a in ("chosen_ids", "rejected_ids")]


def _step(model, rows: list[dict], per_micro: int, world: int) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    batches = iter([(rows[i : i + per_micro], (0, i)) for i in range(0, len(rows), per_micro)])
    train = TrainArgs(grad_accum=len(rows) // per_micro, max_grad_norm=0.0)
    ddp = DistributedDataParallel(model) if world > 1 else model
    loss, tokens, norm, _, metrics = preference_step(
        ddp, batches, optimizer, scheduler, scaler, 0, torch.float32, torch.device("cpu"), train, BACKEND, world
    )
    named = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"loss": loss, "tokens": tokens, "norm": norm, "metrics": metrics, "params": named}


def _rows() -> list[dict]:
    """Four packs of one or two pairs (pairs, and chosen tokens for ORPO, differ between packs)."""
    shapes = [((5, 4, 6),), ((3, 7, 2), (2, 2, 3)), ((6, 1, 4),), ((4, 9, 5), (2, 3, 3))]
    return [_row(_pairs(s, seed=k)) for k, s in enumerate(shapes)]


def _assert_same(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a["tokens"] == b["tokens"]
    assert a["loss"] == pytest.approx(b["loss"], rel=tol) and a["norm"] == pytest.approx(b["norm"], rel=tol)
    assert a["metrics"] == pytest.approx(b["metrics"], rel=tol, abs=tol)
    for name in a["params"]:
        torch.testing.assert_close(a["params"][name], b["params"][name], atol=tol, rtol=tol, msg=name)


def _ddp_worker(rank: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    result = _step(_ours("orpo", PreferenceArgs()), _rows()[2 * rank : 2 * rank + 2], per_micro=1, world=2)
    if rank == 0:
        torch.save(result, f"{folder}/result.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_accumulation_does_not_change_a_preference_step(objective):
    whole = _step(_ours(objective, PreferenceArgs()), _rows(), per_micro=4, world=1)
    accumulated = _step(_ours(objective, PreferenceArgs()), _rows(), per_micro=1, world=1)
    _assert_same(accumulated, whole)
    assert set(whole["metrics"]) == {*STATS, "pairs"} and whole["metrics"]["pairs"] == 6


def test_two_workers_take_the_same_preference_step_as_one(tmp_path):
    whole = _step(_ours("orpo", PreferenceArgs()), _rows(), per_micro=4, world=1)
    run_two_ranks(_ddp_worker, str(tmp_path))
    _assert_same(torch.load(tmp_path / "result.pt"), whole)


def _kto_packs() -> list[dict]:
    """Four kto packs of one to three answers, both labels in the step."""
    return [_kto_pack(_kto_rows(5 + k)[: 1 + k % 3]) for k in range(4)]


def _kto_ddp_worker(rank: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    result = _step(_ours("kto", PreferenceArgs()), _kto_packs()[2 * rank : 2 * rank + 2], per_micro=1, world=2)
    if rank == 0:
        torch.save(result, f"{folder}/result.pt")
    dist.destroy_process_group()


def test_two_kto_workers_take_the_step_of_one_whose_micro_batches_hold_the_same_packs(tmp_path):
    # TRL's KL estimate is per micro-batch over every worker: micro-batch k of workers 0 and 1 holds packs k and 2 + k
    packs = _kto_packs()
    one = _step(_ours("kto", PreferenceArgs()), [packs[0], packs[2], packs[1], packs[3]], per_micro=2, world=1)
    assert set(one["metrics"]) == {"rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                                   "logps/rejected", "kl", "answers"} and one["metrics"]["answers"] == 7  # fmt: skip
    run_two_ranks(_kto_ddp_worker, str(tmp_path))
    _assert_same(torch.load(tmp_path / "result.pt"), one)
