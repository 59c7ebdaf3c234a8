"""The grouped step: K LoRA members on one frozen tiny Llama, against each member trained alone.

"Alone" is the Ray Train worker's own path (``attach_lora`` after ``train.seed``, ``training_model`` with its fused
LoRA and chunked loss, ``train_step``) on the same rows in the same order, fp32, dropout 0. Tolerance: 1e-5
relative on every loss and 1e-5 on every adapter weight (the fused path orders its sums differently). Members
that join and leave change nothing in the others: that is checked bit for bit.
"""

import random
import threading

import pyarrow as pa
import pytest
import torch
import torch.distributed as dist
from peft import PeftModel
from peft.tuners.lora import Linear as LoraLinear
from ranks import run_two_ranks

import raylora.ops.dropout
from raylora.backends import resolve_backend
from raylora.config import from_dict
from raylora.data.packs import PackShard
from raylora.eval.in_training import generation_scores
from raylora.models import attach_lora, tiny_model, tiny_tokenizer
from raylora.train.checkpoint import TrainState
from raylora.train.group import Group
from raylora.train.lm import training_model
from raylora.train.loop import micro_batches, train_step
from raylora.train.optim import build_optimizer, build_scheduler

WIDTH = 16
BASE = {
    "model": {"name_or_path": "tiny-llama"}, "data": {"cutoff_len": WIDTH}, "backend": {"device": "cpu", "precision": "fp32"},
    "tracking": {"enabled": False}, "lora": {"dropout": 0.0}, "train": {"max_steps": 4, "lr": 1e-2},
}  # fmt: skip
MEMBERS = {
    "ma": {"lora": {"rank": 4, "alpha": 8, "target_modules": ["attention"]}},
    "mb": {"lora": {"rank": 8, "alpha": 32, "target_modules": ["mlp"]},
          "train": {"lr": 3e-2, "max_grad_norm": 0.05, "scheduler": "linear", "warmup_steps": 1}},
    "mc": {"lora": {"rank": 2, "alpha": 2, "target_modules": ["all-linear"], "use_rslora": True},
          "train": {"batch_size": 1, "grad_accum": 3, "seed": 7, "lr_mlp_scale": 0.5}},
    "md": {"lora": {"rank": 4, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}, "train": {"lr": 2e-2}},
}  # fmt: skip


def _cfg(name: str | None = None, lora_dropout: float = 0.0, **train):
    job = {k: dict(v) for k, v in BASE.items()}
    for section, values in MEMBERS.get(name, {}).items():
        job[section] = {**job[section], **values}
    job["train"] = {**job["train"], **train}
    job["lora"]["dropout"] = lora_dropout
    return from_dict(job)


def _rows(n: int = 12) -> list[dict]:
    gen = random.Random(0)
    rows = []
    for _ in range(n):
        length, prompt = gen.randrange(6, WIDTH + 1), gen.randrange(1, 5)
        ids = [gen.randrange(3, 200) for _ in range(length)]
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:], "position_ids": list(range(length)),
                     "seq_lens": [length], "num_tokens": length})  # fmt: skip
    return rows


def _alone(cfg, rows, steps):
    """Train one adapter the way a Ray Train worker does; returns (losses, adapter weights by name)."""
    backend = resolve_backend(cfg.backend)
    torch.manual_seed(cfg.train.seed)
    model = attach_lora(tiny_model("llama"), cfg.lora).train()
    loss_model, _ = training_model(model, cfg.train, backend)
    optimizer = build_optimizer(model, cfg.train, backend)
    scheduler = build_scheduler(optimizer, cfg.train, [1.0])
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    batches = micro_batches(_shard(rows), cfg.train.batch_size, TrainState(), 1, cfg.train.seed)
    cpu = torch.device("cpu")
    losses = [
        train_step(loss_model, batches, optimizer, scheduler, scaler, 0, torch.float32, cpu, cfg.train, backend, 1)[0]
        for _ in range(steps)
    ]
    return losses, _weights(model, "default")


def _shard(rows: list[dict], rank: int = 0, world: int = 1) -> PackShard:
    return PackShard(pa.Table.from_pylist(rows), rank, world)


def _weights(model, adapter: str) -> dict[str, torch.Tensor]:
    tag = f".{adapter}."
    return {n.replace(tag, "."): p.detach().clone() for n, p in model.named_parameters() if tag in n}


def _run(group: Group, steps: int, names=None) -> dict[str, list[float]]:
    losses: dict[str, list[float]] = {}
    for _ in range(steps):
        for event in group.step(names):
            losses.setdefault(event.member, []).append(event.report["loss"])
    return losses


@pytest.fixture(scope="module")
def grouped():
    """One lane, as a lone worker's one thread team: a kernel run on fewer threads may round its sums otherwise
    (two lanes against one are held to 1e-5 in their own test)."""
    group = Group(_cfg(), _shard(_rows()), None, lanes=1)
    for name in ("ma", "mb", "mc"):
        group.join(name, _cfg(name, log_every=1))
    losses = _run(group, 4)
    return group, losses


def test_members_train_as_each_would_alone(grouped):
    group, losses = grouped
    for name in ("ma", "mb", "mc"):
        alone_losses, alone_weights = _alone(_cfg(name), _rows(), 4)
        assert losses[name] == pytest.approx(alone_losses, rel=1e-5), name
        ours = _weights(group.model, name)
        assert ours.keys() == alone_weights.keys() and ours
        for key, value in alone_weights.items():
            torch.testing.assert_close(ours[key], value, atol=1e-5, rtol=1e-5, msg=f"{name} {key}")
    assert len({round(v[-1], 6) for v in losses.values()}) == 3  # the members really differ


def test_a_member_that_leaves_leaves_the_others_bit_identical(grouped):
    group, _ = grouped
    other = Group(_cfg(), _shard(_rows()), None, lanes=1)
    for name in ("ma", "mb", "mc"):
        other.join(name, _cfg(name, log_every=1))
    _run(other, 2)
    other.leave("mb")
    assert "mb" not in other.members and not any(".mb." in n for n, _ in other.model.named_parameters())
    _run(other, 2)
    for name in ("ma", "mc"):
        theirs, ours = _weights(group.model, name), _weights(other.model, name)
        assert all(torch.equal(theirs[k], ours[k]) for k in theirs), name


def test_dropout_masks_are_each_members_own():
    """With dropout, a member alone and the same member beside another draw the same masks: same numbers. One lane:
    in two, a member alone runs its kernels on both threads and beside another on one, and MKL's sums are not
    bit-identical across thread counts (two lanes against one are held to tolerances below)."""
    alone, pair = Group(_cfg(), _shard(_rows()), None, lanes=1), Group(_cfg(), _shard(_rows()), None, lanes=1)
    alone.join("ma", _cfg("ma", lora_dropout=0.2))
    for name in ("mb", "ma"):
        pair.join(name, _cfg(name, lora_dropout=0.2))
    _run(alone, 2), _run(pair, 2)
    ours, theirs = _weights(alone.model, "ma"), _weights(pair.model, "ma")
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_lanes_run_members_on_threads_of_their_own_and_change_no_number():
    """On CPU a step of several members runs in lanes, one per intra-op thread: each lane's forward runs on its
    own thread, and every loss, eval loss and weight is the one of a single lane (dropout masks included)."""
    rows = _rows()
    single, lanes = Group(_cfg(), _shard(rows), rows[:4], lanes=1), Group(_cfg(), _shard(rows), rows[:4], lanes=2)
    for group in (single, lanes):
        for name in ("ma", "mb", "mc"):
            group.join(name, _cfg(name, 0.2, log_every=1, eval_every=2))
    threads = set()
    lanes.base.model.layers[0].register_forward_pre_hook(lambda *_: threads.add(threading.get_ident()))
    reports, own = {}, torch.get_num_threads()
    for group in (single, lanes):
        reports[group.lanes] = [(e.member, e.report) for _ in range(3) for e in group.step()]
    assert len(threads) == 2 and threading.get_ident() in threads
    assert torch.get_num_threads() == own  # the calling thread's count is back
    assert [m for m, _ in reports[2]] == [m for m, _ in reports[1]] == ["ma", "mb", "mc"] * 3
    assert ["eval_loss" in r for _, r in reports[1]] == [False] * 3 + [True] * 3 + [False] * 3
    for (_, ours), (_, theirs) in zip(reports[2], reports[1], strict=True):
        assert ours.keys() == theirs.keys()
        for key in {"loss", "grad_norm", "eval_loss"} & theirs.keys():
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5), key
    # Adam moves each weight by about lr * m / sqrt(v): where an element's gradient is near zero (a sum that cancels),
    # the last bits MKL's thread count changes become a visible fraction of lr (found: 1 element of 512 off by 4.6e-5
    # after 3 steps at lr 1e-2 on a second machine), so weights are held to 1% of the smallest lr
    for name in ("ma", "mb", "mc"):
        for key, value in _weights(single.model, name).items():
            torch.testing.assert_close(_weights(lanes.model, name)[key], value, atol=1e-4, rtol=1e-5)


def test_siblings_share_each_members_down_projection_and_dropout_mask(monkeypatch):
    """As in the fused LoRA linear a worker runs: per decoder layer, a member on attention draws one mask for
    q/k/v and one for o, a member on the MLP one for gate/up and one for down, each over its own rows (one lane:
    the draws come in the order of the forward)."""
    group = Group(_cfg(), _shard(_rows()), None, lanes=1)
    group.join("ma", _cfg("ma", lora_dropout=0.2))
    group.join("mb", _cfg("mb", lora_dropout=0.2, batch_size=1))
    drawn = []
    keep_mask = raylora.ops.dropout.keep_mask

    def recording(shape, p, dtype=torch.bfloat16, device="cpu", generator=None):
        drawn.append(tuple(shape))
        return keep_mask(shape, p, dtype, device, generator)

    monkeypatch.setattr("raylora.ops.dropout.keep_mask", recording)
    group.step()
    layer = [(2, WIDTH, 64), (2, WIDTH, 64), (1, WIDTH, 64), (1, WIDTH, 128)]  # ma: q/k/v, o; mb: gate/up, down
    assert drawn == layer * 2


def test_a_member_with_dropout_trains_as_alone_given_the_same_masks(monkeypatch):
    """Masks are drawn differently in a group (each member's own generator); given one fixed pattern on both sides,
    a member with dropout 0.2 trains as it would alone: the 1/(1-p) scale is applied once, in its up-projection."""

    def pattern(shape, p, dtype=torch.bfloat16, device="cpu", generator=None):
        return (torch.arange(shape[-1]) % 5 != 2).to(dtype).expand(shape)

    monkeypatch.setattr("raylora.ops.dropout.keep_mask", pattern)
    group = Group(_cfg(), _shard(_rows()), None, lanes=1)
    group.join("ma", _cfg("ma", lora_dropout=0.2, log_every=1))
    losses = _run(group, 3)["ma"]
    alone_losses, alone_weights = _alone(_cfg("ma", lora_dropout=0.2), _rows(), 3)
    assert losses == pytest.approx(alone_losses, rel=1e-5)
    ours = _weights(group.model, "ma")
    for key, value in alone_weights.items():
        torch.testing.assert_close(ours[key], value, atol=1e-5, rtol=1e-5, msg=key)
    no_dropout, _ = _alone(_cfg("ma"), _rows(), 3)
    assert abs(losses[-1] - no_dropout[-1]) > 1e-4  # the masks were applied


def test_the_first_member_leaving_or_every_member_leaving_does_not_stop_the_group():
    """peft keeps one active adapter name, the first member's; the group goes on when that member leaves, and
    when every member has left and a new one joins."""
    group = Group(_cfg(), _shard(_rows()), None)
    for name in ("ma", "md", "mc"):
        group.join(name, _cfg(name, log_every=1))
    _run(group, 1)
    group.leave("ma")
    assert _run(group, 1).keys() == {"md", "mc"}
    group.leave("md"), group.leave("mc")
    group.join("mb", _cfg("mb", log_every=1))
    assert _run(group, 1).keys() == {"mb"}


def test_a_member_joining_mid_run_starts_at_its_own_step_zero():
    """Bit for bit in one lane (see the dropout test above)."""
    group = Group(_cfg(), _shard(_rows()), None, lanes=1)
    group.join("ma", _cfg("ma", log_every=1))
    _run(group, 2)
    group.join("md", _cfg("md", log_every=1))
    late = _run(group, 3)
    assert group.members["md"].state.step == 3 and group.members["ma"].state.step == 5
    alone = Group(_cfg(), _shard(_rows()), None, lanes=1)
    alone.join("md", _cfg("md", log_every=1))
    assert late["md"] == _run(alone, 3)["md"]
    ours, theirs = _weights(group.model, "md"), _weights(alone.model, "md")
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_each_member_saves_a_plain_peft_adapter(grouped, tmp_path):
    group, _ = grouped
    group.save_adapter("mb", tmp_path / "mb")
    loaded = PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "mb")
    assert loaded.peft_config["default"].r == 8 and set(loaded.peft_config["default"].target_modules) == {
        "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip
    assert all(torch.equal(loaded.state_dict()[k.replace("lora_A.", "lora_A.default.").replace("lora_B.", "lora_B.default.")], v)
               for k, v in _weights(group.model, "mb").items())  # fmt: skip


def test_members_due_a_generation_eval_answer_together_each_as_its_adapter_alone(tmp_path):
    tok = tiny_tokenizer()
    rows = [
        {"prompt_ids": tok(q, add_special_tokens=False).input_ids, "reference": ref, "calls": None, "tools": None,
         "keys": [ref.split()[0]], "source": "a.json"}
        for q, ref in [("Say hi.", "hi there"), ("Name a colour.", "blue"), ("Count to three.", "one two three")]
    ]  # fmt: skip
    metrics = ["exact_match", "contains", "rouge-l", "length"]
    cfg = from_dict({**BASE, "eval": {"max_tokens": 8, "metrics": metrics}})
    group = Group(cfg, _shard(_rows()), None, lanes=1, generate_rows=rows)
    group.join("ma", _cfg("ma", log_every=1, generate_eval_every=2))
    group.join("md", _cfg("md", log_every=1, generate_eval_every=2))
    group.join("mb", _cfg("mb", log_every=1))
    reports: dict[str, list[dict]] = {}
    for _ in range(4):
        for event in group.step():
            reports.setdefault(event.member, []).append(event.report)
    gen = {f"gen_{m}" for m in metrics}
    for name in ("ma", "md"):
        assert [sorted(gen & r.keys()) for r in reports[name]] == [[], sorted(gen), [], sorted(gen)], name
    assert not any(gen & r.keys() for r in reports["mb"])  # not due: it does not generate
    assert all(isinstance(layer.__dict__.get("forward"), type(group.step)) for layer in group.model.modules()
               if isinstance(layer, LoraLinear))  # the grouped forward is back  # fmt: skip
    alone_losses, _ = _alone(_cfg("ma"), _rows(), 4)
    assert [r["loss"] for r in reports["ma"]] == pytest.approx(alone_losses, rel=1e-5)  # answering changed no number
    for name in ("ma", "md"):
        group.save_adapter(name, tmp_path / name)
        alone = PeftModel.from_pretrained(tiny_model("llama"), tmp_path / name).eval()
        expected = generation_scores(alone, tok, rows, cfg)["default"]
        assert {k: reports[name][-1][k] for k in gen} == expected, name


def test_a_member_resumes_from_its_checkpoint_as_if_never_stopped(tmp_path):
    cfg = _cfg("ma", lora_dropout=0.1, checkpoint_every=2)
    whole = Group(_cfg(), _shard(_rows()), None)
    whole.join("ma", cfg, out=tmp_path / "whole")
    events = [e for _ in range(4) for e in whole.step()]
    assert [e.checkpoint.name for e in events if e.checkpoint] == ["checkpoint_000002", "checkpoint_000004"]
    assert events[-1].status == "done"
    first = Group(_cfg(), _shard(_rows()), None)
    first.join("ma", cfg, out=tmp_path / "first")
    _run(first, 2)
    resumed = Group(_cfg(), _shard(_rows()), None)
    resumed.join("ma", cfg, out=tmp_path / "first", resume_from=tmp_path / "first" / "ray" / "checkpoint_000002")
    assert resumed.members["ma"].state.step == 2
    _run(resumed, 2)
    ours, theirs = _weights(resumed.model, "ma"), _weights(whole.model, "ma")
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_diverging_member_reports_it_and_the_others_go_on():
    group = Group(_cfg(), _shard(_rows()), None)
    group.join("ma", _cfg("ma", log_every=1))
    group.join("bad", _cfg("mb", nan_tolerance=1))
    statuses = []
    for _ in range(2):
        with torch.no_grad():
            group.members["bad"].params[0].fill_(float("nan"))
        statuses.append({e.member: e.status for e in group.step()})
    # the first non-finite step rolls back to the last good state (at half the learning rate), the second diverges
    assert statuses[0]["bad"] == "running" and statuses[1]["bad"] == "diverged"
    assert group.members["bad"].lr_scale[0] == 0.5 and group.members["bad"].state.step == 0
    assert statuses[1]["ma"] == "running" and group.members["ma"].state.step == 2


def _ddp_member(rank: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    group = Group(_cfg(), _shard(_rows(), rank, 2), None, rank=rank, world=2, lanes=2)
    for name in ("ma", "mb"):
        group.join(name, _cfg(name, log_every=1))
    losses = _run(group, 3)
    if rank == 0:
        torch.save({"losses": losses, **{n: _weights(group.model, n) for n in ("ma", "mb")}}, f"{folder}/result.pt")
    dist.destroy_process_group()


def test_two_workers_all_reduce_each_members_gradients(tmp_path):
    """Two gloo workers, each reading its interleaved half of each epoch's rows and running its members in two lanes,
    train each member as one worker reading both halves' micro-batches together at twice the batch size (loss rel
    1e-5, weights 1e-4: the two halves' gradients are summed in another order, and Adam divides each element by
    its own running scale, so where a gradient is near zero it turns that rounding into a visible step; a missing
    or misscaled all-reduce moves weights by about the learning rate, 1e-2 to 3e-2 here)."""
    run_two_ranks(_ddp_member, str(tmp_path))
    pair = torch.load(tmp_path / "result.pt")
    one = Group(_cfg(), _shard(_rows()), None)
    for name in ("ma", "mb"):
        one.join(name, _cfg(name, log_every=1, batch_size=4))
    losses = _run(one, 3)
    for name in ("ma", "mb"):
        assert pair["losses"][name] == pytest.approx(losses[name], rel=1e-5)
        for key, value in _weights(one.model, name).items():
            torch.testing.assert_close(pair[name][key], value, atol=1e-4, rtol=1e-4, msg=f"{name} {key}")


@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_recompute_reruns_each_layer_in_the_backward_and_changes_no_number(dropout, lanes):
    """train.recompute_every applies to the group's one forward as to a worker's (it is a key members share); the
    backward's rerun of a layer draws the members' dropout masks of its forward again, in one lane or in two."""
    plain = Group(_cfg(), _shard(_rows()), None, lanes=lanes)
    recomputed = Group(_cfg(recompute_every=1), _shard(_rows()), None, lanes=lanes)
    for group in (plain, recomputed):
        for name in ("ma", "mb"):
            group.join(name, _cfg(name, dropout, log_every=1, recompute_every=group.cfg.train.recompute_every))
    calls = []
    recomputed.base.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: calls.append(1))
    ours, theirs = _run(recomputed, 3), _run(plain, 3)
    assert ours.keys() == theirs.keys() and all(ours[k] == pytest.approx(theirs[k], rel=1e-6) for k in ours)
    for name in ("ma", "mb"):
        for key, value in _weights(plain.model, name).items():
            torch.testing.assert_close(_weights(recomputed.model, name)[key], value, atol=1e-6, rtol=1e-5)
    assert len(calls) == 3 * 2 * lanes  # each step and lane: the forward, and again in the backward
    shared = {m._raylora_group for m in recomputed.model.modules() if getattr(m, "_raylora_group", None)}

    def nothing_kept() -> bool:  # nothing of the recompute kept alive, on the thread that ran it
        return bool(shared) and all(s.x is None and not s.parts for s in shared)

    assert nothing_kept()
    if lanes == 2:
        assert recomputed.pool.submit(nothing_kept).result()  # the pool's one thread ran the second lane


def test_a_bf16_group_stores_the_frozen_base_in_bf16_and_trains_fp32_adapters():
    cfg = from_dict({**BASE, "backend": {"device": "cpu", "precision": "bf16"}})
    group = Group(cfg, _shard(_rows()), None)
    group.join("ma", _cfg("ma", log_every=1))
    dtypes = {(n.split(".")[-2] if "lora_" in n else "base"): p.dtype for n, p in group.model.named_parameters()
              if n.endswith("proj.weight") or "base_layer" in n or "lora_" in n}  # fmt: skip
    assert dtypes == {"base": torch.bfloat16, "ma": torch.float32}
    fp32 = Group(_cfg(), _shard(_rows()), None)
    fp32.join("ma", _cfg("ma", log_every=1))
    assert _run(group, 3)["ma"] == pytest.approx(_run(fp32, 3)["ma"], rel=5e-3)  # bf16 matmuls: 0.1% seen
