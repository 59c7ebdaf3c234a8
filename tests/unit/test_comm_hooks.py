"""Communication hooks on 2 gloo processes: gradients against plain all-reduce, bytes, error feedback, resume."""

import io
import os

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from ranks import run_two_ranks
from torch.nn.parallel import DistributedDataParallel

from raylora.comm.hooks import CommHook, bytes_sent
from raylora.config import TrainArgs
from raylora.models import tiny_model

WORLD = 2


def _model():
    torch.manual_seed(0)
    model = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)  # so lora_A gets gradients too
    return model


def _batch(rank: int, step: int = 0) -> dict:
    gen = torch.Generator().manual_seed(100 * rank + step)
    ids = torch.randint(3, 250, (2, 16), generator=gen)
    return {"input_ids": ids, "labels": ids}


def _ddp(model, train: TrainArgs):
    ddp = DistributedDataParallel(model, bucket_cap_mb=train.bucket_mb)
    hook = CommHook(train)
    hook.register(ddp)
    return ddp, hook


def _train(ddp, model, optimizer, steps: int, first: int = 0) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        loss = ddp(**_batch(dist.get_rank(), step % 2)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _worker(rank: int, job: str, cases: list[dict], out: str) -> None:
    # A file store, not a port picked in advance that another process on the machine could take meanwhile.
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD)
    try:
        torch.save([JOBS[job](rank, TrainArgs(**options)) for options in cases], f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _grads_job(rank: int, train: TrainArgs) -> dict:
    """One step's averaged LoRA gradients through the hook, and through a plain all-reduce of local gradients."""
    model = _model()
    model(**_batch(rank)).loss.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    for g in reference.values():
        dist.all_reduce(g)
        g /= WORLD
    model.zero_grad()
    bytes_sent()
    ddp, hook = _ddp(model, train)
    ddp(**_batch(rank)).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"grads": grads, "reference": reference, "bytes": bytes_sent(), "residuals": hook.residuals}


def _train_job(rank: int, train: TrainArgs) -> dict:
    model = _model()
    ddp, _ = _ddp(model, train)
    return {
        "losses": _train(ddp, model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2), 12)
    }


def _resume_job(rank: int, train: TrainArgs) -> dict:
    """Train 6 steps straight; and 3 steps, save everything, rebuild from scratch, load, 3 more steps."""
    params = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    model = _model()
    ddp, _ = _ddp(model, train)
    optimizer = torch.optim.AdamW(params(model), lr=1e-2)
    straight = _train(ddp, model, optimizer, 6)
    model = _model()
    ddp, hook = _ddp(model, train)
    optimizer = torch.optim.AdamW(params(model), lr=1e-2)
    first = _train(ddp, model, optimizer, 3)
    saved = [{k: v.clone() for k, v in model.state_dict().items()}, optimizer.state_dict(), hook.state_dict()]
    saved = torch.load(_roundtrip(saved), weights_only=False)
    model = _model()
    model.load_state_dict(saved[0])
    ddp, hook = _ddp(model, train)
    optimizer = torch.optim.AdamW(params(model), lr=1e-2)
    optimizer.load_state_dict(saved[1])
    hook.load_state_dict(saved[2])
    resumed = first + _train(ddp, model, optimizer, 3, first=3)
    return {"straight": straight, "resumed": resumed}


def _roundtrip(obj) -> io.BytesIO:
    """What a checkpoint does to the saved state: a torch.save / torch.load round trip."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


JOBS = {"grads": _grads_job, "train": _train_job, "resume": _resume_job}


def run(job: str, tmp_path, cases: list[dict]) -> list[list[dict]]:
    """``job`` for every case of options, in one pair of gloo processes; per case, the ranks' results."""
    # Forked ranks end with os._exit: a spawned interpreter's finalisation can free the process group on one of
    # gloo's own threads, which then joins itself and aborts the rank after its results are saved.
    run_two_ranks(_worker, job, cases, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return [list(per_rank) for per_rank in zip(*ranks, strict=True)]


def _numel(grads: dict) -> int:
    return sum(g.numel() for g in grads.values())


LOSSLESS = [  # hook options, tolerance against plain all-reduce, payload bytes per gradient entry
    ({"comm_hook": "none"}, 1e-6, 4),
    ({"comm_hook": "fp16"}, 2e-3, 2),
    ({"comm_hook": "bf16"}, 1e-2, 2),
    ({"comm_hook": "topk", "topk_fraction": 1.0}, 1e-6, 8),  # values and int32 indices
    # found by use: PowerSGD's warm-up all-reduce (PyTorch's default_hooks) went uncounted, 0 bytes a step
    ({"comm_hook": "powersgd", "powersgd_warmup": 10}, 1e-6, 4),
]


def test_hooks_match_plain_all_reduce_and_count_their_bytes(tmp_path):
    cases = [options for options, _, _ in LOSSLESS] + [
        {"comm_hook": "hadamard3"},
        {"comm_hook": "sign"},
        {"comm_hook": "topk", "topk_fraction": 0.05},
    ]
    results = run("grads", tmp_path, cases)
    for (options, tolerance, per_entry), ranks in zip(LOSSLESS, results, strict=False):
        for result in ranks:
            for name, want in result["reference"].items():
                torch.testing.assert_close(
                    result["grads"][name], want, rtol=tolerance, atol=tolerance * float(want.abs().max()),
                    msg=lambda m, o=options: f"{o}: {m}",
                )  # fmt: skip
            assert result["bytes"] == per_entry * _numel(result["reference"]), options
    _check_hadamard3(results[-3])
    sign = results[-2]
    scaled = []
    for rank, result in enumerate(sign):  # one bit an entry, one scale per tensor
        local = _local_grads(rank)
        assert result["bytes"] == sum(
            -(-g.numel() // 8) for g in [torch.cat([x.flatten() for x in local.values()])]
        ) + 4 * len(local)
        sent = {n: torch.where(g >= 0, g.abs().mean(), -g.abs().mean()) for n, g in local.items()}
        for name, g in local.items():
            torch.testing.assert_close(result["residuals"][name], (g - sent[name]).flatten())
        scaled.append(sent)
    for result in sign:
        for name in result["grads"]:
            torch.testing.assert_close(result["grads"][name], (scaled[0][name] + scaled[1][name]) / 2)
    for rank, result in enumerate(results[-1]):  # topk at 5%: error feedback
        n = _numel(result["reference"])
        assert result["bytes"] == 8 * round(0.05 * n)  # one bucket: a 90% cut against 4 bytes an entry
        residual = torch.cat([r.flatten() for r in result["residuals"].values()])
        local = torch.cat([g.flatten() for g in _local_grads(rank).values()])
        kept = residual != 0
        # What was not sent is exactly the local gradient there; what was sent is the largest entries.
        assert int(kept.sum()) == n - round(0.05 * n)
        torch.testing.assert_close(residual[kept], local[kept])
        assert local[~kept].abs().min() >= local[kept].abs().max()


def _check_hadamard3(ranks: list[dict]) -> None:
    """3 bits an entry of whole 128-entry blocks and a bf16 scale per block; the average of what each rank's codes
    stand for, rotated back; the residual is exactly what they miss."""
    from raylora.comm.hooks import _hadamard3_encode, _hadamard3_values, _rotate

    decoded = []
    for rank, result in enumerate(ranks):
        local = torch.cat([g.flatten() for g in _local_grads(rank).values()])
        blocks = -(-local.numel() // 128)
        assert result["bytes"] == blocks * (3 * 128 // 8 + 2)
        sent = _rotate(_hadamard3_values(*_hadamard3_encode(local)))[: local.numel()]
        residual = torch.cat([result["residuals"][n].flatten() for n in _local_grads(rank)])
        torch.testing.assert_close(residual, local - sent)
        assert float(residual.square().sum() / local.square().sum()) < 0.05  # Lloyd-Max: about 3.5% of the energy
        decoded.append(sent)
    for result in ranks:
        got = torch.cat([g.flatten() for g in result["grads"].values()])
        torch.testing.assert_close(got, (decoded[0] + decoded[1]) / 2)


def test_hadamard3_rotation_levels_and_packing():
    from raylora.comm.hooks import (
        HADAMARD3_BLOCK,
        HADAMARD3_LEVELS,
        _hadamard3_encode,
        _hadamard3_values,
        _pack3,
        _rotate,
        _unpack3,
    )

    # the rotation: orthogonal, symmetric (its own inverse), and it spreads a spike over its block
    eye = torch.eye(HADAMARD3_BLOCK)
    rotation = torch.stack([_rotate(row) for row in eye])
    torch.testing.assert_close(rotation @ rotation.T, eye, atol=1e-6, rtol=0)
    torch.testing.assert_close(rotation, rotation.T)
    assert torch.allclose(rotation.abs(), torch.full_like(rotation, HADAMARD3_BLOCK**-0.5))
    # a heavy-tailed vector (cubes of Gaussian draws) loses about 3.5% of its energy, as a Gaussian one would
    x = torch.randn(300, generator=torch.Generator().manual_seed(0)) ** 3
    codes, scales = _hadamard3_encode(x)
    assert codes.numel() == 384 and codes.max() <= 7 and scales.dtype == torch.bfloat16 and scales.numel() == 3
    decoded = _rotate(_hadamard3_values(codes, scales))[:300]
    assert 0.02 < float((decoded - x).square().sum() / x.square().sum()) < 0.05
    # each rotated value's code is the nearest level in units of its block's RMS
    rotated = _rotate(torch.nn.functional.pad(x, (0, 84))).view(-1, HADAMARD3_BLOCK)
    nearest = (rotated[..., None] / scales.float()[:, None, None] - torch.tensor(HADAMARD3_LEVELS)).abs().argmin(-1)
    assert torch.equal(codes, nearest.flatten().to(torch.uint8))
    packed = _pack3(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == 3 * codes.numel() // 8
    assert torch.equal(_unpack3(packed, codes.numel()), codes)
    zeros, zero_scales = _hadamard3_encode(torch.zeros(5))
    assert _rotate(_hadamard3_values(zeros, zero_scales))[:5].tolist() == [0.0] * 5
    # small gradients (fp32 or bf16 training without loss scaling) keep their precision; a non-finite one stays
    # non-finite, so the step is skipped and the error feedback cleared
    for size in (1e-4, 1e-6, 1e-9, 1e-20):
        small = x * size
        codes, scales = _hadamard3_encode(small)
        decoded = _rotate(_hadamard3_values(codes, scales))[:300]
        assert 0.02 < float((decoded - small).square().sum() / small.square().sum()) < 0.05, size
    x[3] = float("inf")
    assert not _rotate(_hadamard3_values(*_hadamard3_encode(x))).isfinite().all()


def _local_grads(rank: int) -> dict:
    model = _model()
    model(**_batch(rank)).loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_every_hook_trains(tmp_path):
    cases = [{"comm_hook": h} for h in ("none", "fp16", "bf16")]
    cases += [{"comm_hook": "powersgd", "powersgd_rank": 2}, {"comm_hook": "topk", "topk_fraction": 0.05}]
    cases += [{"comm_hook": "sign"}, {"comm_hook": "hadamard3"}]
    for options, ranks in zip(cases, run("train", tmp_path, cases), strict=True):
        for result in ranks:
            losses = result["losses"]
            assert losses[-1] < 0.95 * losses[0], (options, losses)


def test_resume_with_hook_state_is_exact(tmp_path):
    # PowerSGD compresses from step 2 on: the resume at step 3 restores its errors and warm-start factors, which
    # PyTorch keys by bucket index while a new DDP's first bucket layout differs from its settled one.
    cases = [
        {"comm_hook": "topk", "topk_fraction": 0.05}, {"comm_hook": "sign"}, {"comm_hook": "hadamard3"},
        {"comm_hook": "powersgd", "powersgd_rank": 2, "bucket_mb": 0.002},
        {"comm_hook": "powersgd", "powersgd_rank": 1},
    ]  # fmt: skip
    for options, ranks in zip(cases, run("resume", tmp_path, cases), strict=True):
        for result in ranks:
            assert result["resumed"] == result["straight"], options


def test_bits_pack_and_unpack():
    from raylora.comm.hooks import _pack_bits, _unpack_bits

    flags = torch.rand(1001, generator=torch.Generator().manual_seed(0)) > 0.5
    packed = _pack_bits(flags)
    assert packed.dtype == torch.uint8 and packed.numel() == 126
    assert torch.equal(_unpack_bits(packed, 1001), flags)
