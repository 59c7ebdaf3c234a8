"""The training objective: loss per label token over every micro-batch and worker of a step.

The same four sequences (with different numbers of label tokens) trained as one micro-batch, as four
accumulated micro-batches, and on two real DDP workers (gloo, two processes) must give the same loss,
gradient norm and update (plain SGD, lr 1, no clipping: the update is the gradient). Also: the training
model's options (fused LoRA, chunked loss, recompute) leave the loss and gradients unchanged.
"""

import random

import pytest
import torch
import torch.distributed as dist
from ranks import run_two_ranks
from torch.nn.parallel import DistributedDataParallel

from raylora.backends import resolve_backend
from raylora.config import BackendArgs, LoraArgs, TrainArgs
from raylora.models import attach_lora, randomise_lora, tiny_model
from raylora.train.lm import autocast_outputs, training_model
from raylora.train.loop import train_step

BACKEND = resolve_backend(BackendArgs(device="cpu", precision="fp32"))


def _rows() -> list[dict]:
    gen = random.Random(0)
    rows = []
    for length, prompt in ((12, 3), (7, 5), (16, 2), (9, 7)):  # 9, 2, 14 and 2 label tokens
        ids = [gen.randrange(3, 200) for _ in range(length)]
        rows.append({
            "input_ids": ids, "labels": [-100] * prompt + ids[prompt:], "position_ids": list(range(length)),
            "seq_lens": [length], "num_tokens": length,
        })  # fmt: skip
    return rows


def _model(backend=BACKEND, **train):
    model = attach_lora(tiny_model("llama"), LoraArgs(rank=4, alpha=8, dropout=0.0, target_modules=["all-linear"]))
    randomise_lora(model, 3, 0.1)
    return training_model(model, TrainArgs(**train), backend)


def _step(loss_model, rows: list[dict], per_micro: int, world: int, backend=BACKEND) -> dict:
    params = [p for p in loss_model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    batches = iter([(rows[i : i + per_micro], (0, i)) for i in range(0, len(rows), per_micro)])
    train = TrainArgs(grad_accum=len(rows) // per_micro, max_grad_norm=0.0)
    ddp = DistributedDataParallel(loss_model) if world > 1 else loss_model
    loss, tokens, norm, _, _ = train_step(
        ddp, batches, optimizer, scheduler, scaler, 0, backend.amp_dtype or torch.float32, torch.device("cpu"), train,
        backend, world,
    )  # fmt: skip
    named = {n: p.detach().clone() for n, p in loss_model.named_parameters() if p.requires_grad}
    return {"loss": loss, "tokens": tokens, "norm": norm, "params": named}


def _assert_same(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a["tokens"] == b["tokens"]
    assert a["loss"] == pytest.approx(b["loss"], rel=tol) and a["norm"] == pytest.approx(b["norm"], rel=tol)
    for name in a["params"]:
        torch.testing.assert_close(a["params"][name], b["params"][name], atol=tol, rtol=tol, msg=name)


def _ddp_worker(rank: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    loss_model, _ = _model()
    result = _step(loss_model, _rows()[2 * rank : 2 * rank + 2], per_micro=1, world=2)
    if rank == 0:
        torch.save(result, f"{folder}/result.pt")
    dist.destroy_process_group()


def test_accumulation_and_workers_do_not_change_the_objective(tmp_path):
    whole = _step(_model()[0], _rows(), per_micro=4, world=1)
    accumulated = _step(_model()[0], _rows(), per_micro=1, world=1)
    _assert_same(accumulated, whole)
    # the objective is the mean over label tokens, not the mean of per-micro-batch means
    plain = _model()[0]
    with torch.no_grad():
        sums = [plain(**_batch(r)).item() for r in _rows()]
    assert whole["loss"] == pytest.approx(sum(sums) / 27, rel=1e-5)
    assert abs(whole["loss"] - sum(s / n for s, n in zip(sums, (9, 2, 14, 2), strict=True)) / 4) > 1e-3

    run_two_ranks(_ddp_worker, str(tmp_path))
    _assert_same(torch.load(tmp_path / "result.pt"), whole)


def _batch(row: dict) -> dict:
    from raylora.data.collate import collate_packs

    return collate_packs([row], 0)


@pytest.mark.parametrize(
    "options",
    [
        {"fused_lora": False, "chunked_loss": True},
        {"fused_lora": True, "chunked_loss": False},
        {"fused_lora": True, "chunked_loss": True, "recompute_every": 1},
        {"fused_lora": True, "chunked_loss": True, "recompute_every": 2},
    ],
)
def test_training_options_keep_the_loss_and_gradients(options):
    reference, notes = _model(fused_lora=False, chunked_loss=False)
    assert notes == ["precision: asked for: fp32", "attention: each packed example on its own (raylora_packed)"]
    ours, notes = _model(**options)
    assert any(n.startswith("chunked loss: on") for n in notes) is options["chunked_loss"]
    _assert_same(_step(ours, _rows(), per_micro=2, world=1), _step(reference, _rows(), per_micro=2, world=1))


def test_frozen_linears_stored_in_bf16_train_exactly_like_autocast_over_fp32_weights():
    bf16 = resolve_backend(BackendArgs(device="cpu", precision="bf16"))
    stored, notes = _model(bf16)
    assert "frozen linear weights stored in bf16: 15 matrices" in notes  # q k v o gate up down x 2 layers, head
    frozen = {n: p for n, p in stored.named_parameters() if not p.requires_grad}
    linear = {n for n in frozen if n.endswith(("base_layer.weight", "lm_head.weight"))}
    assert len(linear) == 15 and {frozen[n].dtype for n in linear} == {torch.bfloat16}
    assert {p.dtype for n, p in frozen.items() if n not in linear} == {torch.float32}  # embeddings, norms
    assert {p.dtype for p in stored.parameters() if p.requires_grad} == {torch.float32}
    # the reference: the same model with its original fp32 weights, which autocast casts at every product
    reference, _ = _model(bf16)
    originals = dict(_model(BACKEND)[0].named_parameters())
    for name, param in reference.named_parameters():
        param.data = originals[name].data.clone()
    assert {p.dtype for p in reference.parameters()} == {torch.float32}
    _assert_same(_step(stored, _rows(), 2, 1, bf16), _step(reference, _rows(), 2, 1, bf16), tol=0)


def test_norm_and_rotary_outputs_come_in_bf16_under_autocast_and_train_within_bf16_error(monkeypatch):
    bf16 = resolve_backend(BackendArgs(device="cpu", precision="bf16"))
    ours, notes = _model(bf16)
    assert "norm and rotary outputs in bf16: 6 modules" in notes  # 2 norms x 2 layers, final norm, rotary
    decoder = ours.model.get_base_model().get_decoder()
    seen = []
    decoder.layers[0].input_layernorm.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    decoder.rotary_emb.register_forward_hook(lambda m, a, out: seen.append(out[0].dtype))
    batch = _batch(_rows()[0])
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours(**batch)
        assert seen == [torch.bfloat16, torch.bfloat16]
        seen.clear()
        assert decoder.layers[0].input_layernorm(torch.randn(1, 3, 64)).dtype == torch.float32  # no autocast: no cast
    assert autocast_outputs(ours.model.get_base_model(), torch.bfloat16) == 6  # again: no second hook
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        seen.clear()
        ours(**batch)
        assert seen == [torch.bfloat16, torch.bfloat16]
    # against fp32, the step errs by at most 1.25x (plus 1e-3) what it errs without the casts
    exact = _step(_model()[0], _rows(), 2, 1)
    got = _step(ours, _rows(), 2, 1, bf16)
    monkeypatch.setattr("raylora.train.lm.autocast_outputs", lambda decoder, dtype: 0)
    plain = _step(_model(bf16)[0], _rows(), 2, 1, bf16)

    def error(result):
        diffs = [(result["params"][n] - exact["params"][n]).norm() / exact["params"][n].norm() for n in exact["params"]]
        return max(abs(result["loss"] - exact["loss"]) / exact["loss"], *(d.item() for d in diffs))

    assert error(got) <= 1.25 * error(plain) + 1e-3


def test_a_frozen_head_is_cast_once_and_scores_as_the_head_itself():
    bf16 = resolve_backend(BackendArgs(device="cpu", precision="bf16"))
    loss_model, _ = _model(bf16)
    head = loss_model.model.get_base_model().get_output_embeddings().weight
    assert loss_model.head.dtype == torch.bfloat16 and torch.equal(loss_model.head, head.to(torch.bfloat16))
    assert not any(t is loss_model.head for t in loss_model.state_dict().values())
    batch = _batch(_rows()[2])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cached = loss_model(**batch)
        loss_model.head = None
        assert torch.equal(loss_model(**batch), cached)
    assert _model()[0].head is None  # fp32: nothing to cast
    model = attach_lora(tiny_model("llama"), LoraArgs(rank=4, alpha=8, target_modules=["all-linear"]))
    model.get_base_model().get_output_embeddings().weight.requires_grad_(True)
    trained_head, _ = training_model(model, TrainArgs(), bf16)
    assert trained_head.head is None  # a trained head is read as it is at every step


def test_recompute_checkpoints_every_nth_layer():
    loss_model, notes = _model(recompute_every=2)
    layers = loss_model.model.get_base_model().model.layers
    assert [layer.gradient_checkpointing for layer in layers] == [True, False]
    assert "recompute: every 2 decoder layer(s), non-reentrant" in notes


@pytest.mark.slow
def test_compiled_layers_train_like_eager():
    """Two micro-batches of one shape (lengths 12 and 7 each, 9, 2, 6 and 5 label tokens): a second shape would
    make inductor compile every layer again for dynamic shapes, 30 s more on 2 cores for torch's work, not ours."""
    rows = [_rows()[0], _rows()[1], {**_rows()[0], "labels": [-100] * 6 + _rows()[0]["input_ids"][6:]},
            {**_rows()[1], "labels": [-100] * 2 + _rows()[1]["input_ids"][2:]}]  # fmt: skip
    eager = _step(_model()[0], rows, per_micro=2, world=1)
    compiled_model, notes = _model(compile=True)
    assert "torch.compile: each decoder layer, backend inductor" in notes
    _assert_same(_step(compiled_model, rows, per_micro=2, world=1), eager, tol=1e-4)


def test_ray_train_per_step_report_line_is_silenced():
    import logging

    from ray.train.v2._internal.execution import context

    from raylora.train.loop import quiet_report_logs

    quiet_report_logs()
    assert not context.logger.isEnabledFor(logging.INFO) and context.logger.isEnabledFor(logging.WARNING)


def test_micro_batches_read_each_epoch_in_its_seeded_order_and_resume_where_the_run_stopped():
    """Prepared packs are written longest first; a worker reads each epoch in the order drawn from train.seed, on
    into the next epoch, and a run resumed from a checkpoint's position reads on from the same pack."""
    import pyarrow as pa

    from raylora.data.packs import PackShard, epoch_order
    from raylora.train.checkpoint import TrainState
    from raylora.train.loop import micro_batches

    shard = PackShard(pa.table({"num_tokens": list(range(10))}))
    batches = micro_batches(shard, 2, TrainState(), 1, seed=3)
    read = [next(batches) for _ in range(7)]
    ids = [row["num_tokens"] for rows, _ in read for row in rows]
    assert ids == epoch_order(10, 3, 0) + epoch_order(10, 3, 1)[:4] and ids[:10] != list(range(10))
    assert [position for _, position in read] == [(0, 2), (0, 4), (0, 6), (0, 8), (0, 10), (1, 2), (1, 4)]
    state = TrainState()
    state.epoch, state.rows_in_epoch = read[5][1]
    assert next(micro_batches(shard, 2, state, 1, seed=3)) == read[6]
