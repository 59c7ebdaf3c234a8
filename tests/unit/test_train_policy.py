"""The training policy both a Ray Train worker and a shared-base group member follow (raylora.train.policy)."""

import math

import pyarrow as pa
import pytest
import torch

from raylora.config import LoraArgs, TrainArgs, from_dict
from raylora.data.packs import PackShard
from raylora.models import attach_lora, tiny_model
from raylora.train.checkpoint import TrainState
from raylora.train.group import Group
from raylora.train.policy import NanGuard, due, eval_scores, label_tokens, params_finite, take_step

NAN = math.nan


def test_the_guard_skips_rolls_back_once_then_says_diverged():
    guard, state = NanGuard(tolerance=2), TrainState()
    verdicts = [guard.verdict(loss, 1.0, state) for loss in (1.0, NAN, 1.0, NAN, NAN)]
    assert verdicts == ["ok", "skip", "ok", "skip", "rollback"]
    state.rollbacks = 1  # what roll_back records
    assert [guard.verdict(NAN, 1.0, state) for _ in range(2)] == ["skip", "diverged"]
    assert state.skipped_steps == 5
    assert NanGuard(1).verdict(1.0, math.inf, TrainState()) == "rollback"  # an infinite gradient norm counts too


def test_the_cadence_logs_evaluates_and_saves_on_its_steps_and_always_on_the_last():
    train = TrainArgs(max_steps=10, log_every=3, eval_every=4, checkpoint_every=5)
    seen = {step: due(step, train) for step in range(1, 11)}
    assert [s for s, d in seen.items() if d.log] == [3, 4, 5, 6, 8, 9, 10]
    assert [s for s, d in seen.items() if d.evaluate] == [4, 8, 10]
    assert [s for s, d in seen.items() if d.save] == [5, 10]
    assert [s for s, d in seen.items() if d.final] == [10]
    assert not any(due(s, TrainArgs(max_steps=10, log_every=20)).log for s in range(1, 10))
    assert not any(d.generate for d in seen.values())  # train.generate_eval_every: 0


def test_generation_evals_come_on_their_steps_and_the_last_and_are_logged():
    seen = {step: due(step, TrainArgs(max_steps=10, log_every=20, generate_eval_every=4)) for step in range(1, 11)}
    assert [s for s, d in seen.items() if d.generate] == [4, 8, 10]
    assert [s for s, d in seen.items() if d.log] == [4, 8, 10]


@pytest.mark.parametrize(
    "lora",
    [
        {"rank": 4, "alpha": 32.0, "dropout": 0.1, "use_rslora": True, "target_modules": ["mlp"]},
        {"rank": 8, "alpha": 8.0, "dropout": 0.0, "use_rslora": False, "target_modules": ["attention", "gate_proj"]},
        {"rank": 2, "alpha": 4.0, "dropout": 0.05, "use_rslora": True, "target_modules": ["all-linear"]},
    ],
)
def test_a_group_member_trains_with_the_lora_config_of_the_same_run_alone(lora):
    cfg = from_dict({"model": {"name_or_path": "tiny-llama"}, "data": {"cutoff_len": 16}, "lora": lora,
                     "backend": {"device": "cpu", "precision": "fp32"}, "tracking": {"enabled": False}})  # fmt: skip
    alone = attach_lora(tiny_model("llama"), LoraArgs(**lora)).peft_config["default"].to_dict()
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "position_ids": [0, 1, 2], "seq_lens": [3],
             "num_tokens": 3}] * 2  # fmt: skip
    group = Group(cfg, PackShard(pa.Table.from_pylist(rows)), None, lanes=1)
    group.join("member", cfg)
    grouped = group.model.peft_config["member"].to_dict()
    assert grouped == alone


def test_a_step_is_taken_only_when_its_loss_and_gradient_norm_are_finite_and_the_gradients_are_cleared_either_way():
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    weight.grad = torch.tensor([3.0, 4.0, 0.0])
    assert take_step([weight], optimizer, scheduler, scaler, 1.0, loss=2.0) == pytest.approx(5.0)
    assert weight.detach().tolist() == pytest.approx([0.7, 0.6, 1.0])  # clipped to norm 1, then stepped
    assert weight.grad is None and scheduler.last_epoch == 1
    weight.grad = torch.tensor([1.0, 1.0, 1.0])
    take_step([weight], optimizer, scheduler, scaler, 0.0, loss=NAN)
    assert weight.detach().tolist() == pytest.approx([0.7, 0.6, 1.0]) and weight.grad is None
    assert scheduler.last_epoch == 1
    weight.grad = torch.tensor([NAN, 0.0, 0.0])
    assert math.isnan(take_step([weight], optimizer, scheduler, scaler, 0.0, loss=1.0))
    assert weight.detach().tolist() == pytest.approx([0.7, 0.6, 1.0])
    assert params_finite([weight]) and not params_finite([weight, torch.tensor([math.inf])])


def test_losses_are_per_label_token_after_the_first_and_a_model_with_none_gets_no_score():
    rows = [{"labels": [5, 6, -100, 7]}, {"labels": [-100, -100, 8]}]
    assert label_tokens(rows) == 3  # each row's first label has no prediction
    scores = eval_scores(torch.tensor([[6.0, 3.0], [1.0, 0.0]], dtype=torch.float64), world=1, replicated=False)
    assert scores == [{"eval_loss": 2.0, "eval_perplexity": pytest.approx(math.exp(2.0))}, {}]


def test_the_rollback_snapshot_never_looks_the_base_up_on_the_hub(monkeypatch):
    # peft's get_peft_model_state_dict asks the Hub whether the recorded base has a config (save_embedding_layers
    # "auto"): a network call at every checkpoint of an offline run, and a DNS wait where there is no network
    from peft.utils import save_and_load

    from raylora.train.checkpoint import TrainState, snapshot

    asked = []
    monkeypatch.setattr(save_and_load, "check_file_exists_on_hf_hub", lambda *a, **k: asked.append(a))
    model = attach_lora(tiny_model("llama"), LoraArgs(rank=4, alpha=8, dropout=0.0, target_modules=["all-linear"]))
    model.peft_config["default"].base_model_name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    saved = snapshot(model, optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False), TrainState())
    assert asked == []
    assert len(saved["adapter"]) == 2 * 7 * 2  # lora_A and lora_B of the 7 linear layers of each of 2 layers
