"""Gradient compression on 2 gloo workers: bytes per step, step time and final eval loss of every hook; how much of
the all-reduce hides behind backward for each bucket size; the planner's all-reduce term against gloo.

The tiny task: a tiny Llama with rank-8 LoRA on q/k/v/o (what the tests train), ``--steps`` steps of AdamW on
batches of 4 x 64 tokens drawn per rank (each sequence counts up from a random start), evaluated on 8 held-out
sequences. Every hook runs the same steps on the same data in the same pair of processes, back to back; ``none``
(an fp32 all-reduce) is the baseline. A compressed run drifts from ``none``'s like a run on other data would, so
each hook runs on ``--orders`` data orders (the batches drawn with other seeds), and its loss is compared with
``none``'s on the same order: the table gives the mean of these paired differences and their range. Bytes are
the payload each rank hands to collectives over the whole run, warm-up steps included (``raylora.comm.bytes``:
measured, not derived). Step times are medians after 3 steps; the overhead column is a hook's median step time
minus ``none``'s.

Overlap: 2 micro-batches per step (the first under ``no_sync``), ``none`` hook, and a profiler trace of each of 5
steps; ``raylora.comm.overlap`` reads off the share of gloo's all-reduce time that falls inside backward's compute.

    .venv/bin/python bench/comm.py [--steps 150] [--lr 5e-3] [--orders 3]
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

HOOKS = [
    {"comm_hook": "none"},
    {"comm_hook": "fp16"},
    {"comm_hook": "bf16"},
    {"comm_hook": "powersgd", "powersgd_rank": 1},
    {"comm_hook": "powersgd", "powersgd_rank": 4},
    {"comm_hook": "topk", "topk_fraction": 0.05},
    {"comm_hook": "topk", "topk_fraction": 0.01},
    {"comm_hook": "sign"},
    {"comm_hook": "hadamard3"},
]
BUCKETS_MB = [25.0, 0.008, 0.002]  # one bucket for the bench's 28 KiB of LoRA gradients; about 4; about 14


def _batch(seed: int, rows: int = 4) -> dict:
    gen = torch.Generator().manual_seed(seed)
    # a learnable task: each sequence counts up from a random start
    start = torch.randint(3, 150, (rows, 1), generator=gen)
    ids = (start + torch.arange(64)) % 250 + 3
    return {"input_ids": ids, "labels": ids}


def _model():
    from peft import LoraConfig, get_peft_model

    from raylora.models import tiny_model

    torch.manual_seed(0)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0)
    return get_peft_model(tiny_model("llama"), lora)


def _ddp(model, options: dict):
    from torch.nn.parallel import DistributedDataParallel

    from raylora.comm.hooks import CommHook
    from raylora.config import TrainArgs

    train = TrainArgs(**options)
    ddp = DistributedDataParallel(model, bucket_cap_mb=train.bucket_mb)
    CommHook(train).register(ddp)
    return ddp


def _run(options: dict, steps: int, lr: float, rank: int, order: int) -> dict:
    from raylora.comm.hooks import bytes_sent

    model = _model()
    ddp = _ddp(model, options)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    sent, times = [], []
    bytes_sent()
    for step in range(steps):
        batch = _batch(10**7 * order + 1000 * rank + step)
        dist.barrier()
        started = time.perf_counter()
        ddp(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
        sent.append(bytes_sent())
    with torch.no_grad():
        eval_loss = statistics.mean(model(**_batch(10**6 + i)).loss.item() for i in range(2))
    return {"bytes": sum(sent) / steps, "step_s": statistics.median(times[3:]), "eval_loss": eval_loss}


def _overlap(bucket_mb: float, rank: int) -> dict:
    """Median figures of 5 profiled steps of 2 micro-batches, and the median time of 10 unprofiled ones."""
    from raylora.comm.overlap import finish_trace, start_trace

    model = _model()
    ddp = _ddp(model, {"bucket_mb": bucket_mb})

    def step(k: int) -> None:
        with ddp.no_sync():
            ddp(**_batch(7000 * rank + 2 * k)).loss.backward()
        ddp(**_batch(7000 * rank + 2 * k + 1)).loss.backward()
        model.zero_grad()

    for k in range(3):  # DDP settles its buckets after the first step
        step(k)
    traced = []
    for k in range(5):
        dist.barrier()
        trace = start_trace(True)
        step(k)
        traced.append(finish_trace(trace))
    times = []
    for k in range(10):
        dist.barrier()
        started = time.perf_counter()
        step(k)
        times.append(time.perf_counter() - started)
    figures = {key: statistics.median(t[key] for t in traced) for key in traced[0]}
    return {**figures, "step_s": statistics.median(times)}


SIZES = [4 * 2**10, 64 * 2**10, 1 * 2**20, 16 * 2**20]  # all-reduce payloads timed for the planner's check


def _all_reduce_times() -> list[float]:
    """Median seconds of a gloo all-reduce of each of :data:`SIZES` (fp32) between the 2 processes."""
    times = []
    for size in SIZES:
        tensor = torch.ones(size // 4)
        runs = []
        for _ in range(15):
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(tensor)
            runs.append(time.perf_counter() - started)
        times.append(statistics.median(runs))
    return times


def _worker(rank: int, steps: int, lr: float, orders: int, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2)
    results = {
        "hooks": [[_run(options, steps, lr, rank, order) for order in range(orders)] for options in HOOKS],
        "overlap": [_overlap(mb, rank) for mb in BUCKETS_MB],
        "all_reduce": _all_reduce_times(),
    }
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()
    # Skip the interpreter's finalisation: it can free the process group on one of gloo's own threads, which then
    # joins itself and aborts the rank (SIGABRT) after its results are saved.
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--orders", type=int, default=3, help="data orders each hook trains on")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(args.steps, args.lr, args.orders, out), nprocs=2)
        ranks = [torch.load(f"{out}/rank{r}.pt", weights_only=False) for r in range(2)]
    results = ranks[0]["hooks"]
    base = results[0]
    print(f"\n2 gloo workers, tiny Llama + rank-8 LoRA, {args.steps} steps of AdamW at lr {args.lr:g}, "
          f"{args.orders} data orders; rank 0's figures")  # fmt: skip
    print("(bytes: mean over the whole run, warm-up included; step time: median over the orders)\n")
    print("| hook | bytes sent per step | vs none | step time ms | overhead ms | eval loss (mean) | vs none: mean "
          "(range over orders) |\n|---|---|---|---|---|---|---|")  # fmt: skip
    base_s = statistics.median(r["step_s"] for r in base)
    for options, runs in zip(HOOKS, results, strict=True):
        name = " ".join(f"{k}={v}" for k, v in options.items())
        step_s = statistics.median(r["step_s"] for r in runs)
        loss = statistics.mean(r["eval_loss"] for r in runs)
        deltas = [100 * (r["eval_loss"] / b["eval_loss"] - 1) for r, b in zip(runs, base, strict=True)]
        print(f"| {name} | {runs[0]['bytes']:,.0f} | {runs[0]['bytes'] / base[0]['bytes']:.3f}x | "
              f"{1000 * step_s:.1f} | {1000 * (step_s - base_s):+.1f} | {loss:.4f} | {statistics.mean(deltas):+.2f}% "
              f"({min(deltas):+.2f}% .. {max(deltas):+.2f}%) |")  # fmt: skip
    print("\ntarget: a hook cuts bytes by >= 90% with eval loss within 1% of none")
    print("\nall-reduce hidden behind backward (hook none, 2 micro-batches a step, median of 5 traced steps)\n")
    print("| train.bucket_mb | all-reduces | all-reduce ms | hidden ms | hidden share (rank 0, rank 1) | step ms |")
    print("|---|---|---|---|---|---|")
    for mb, r0, r1 in zip(BUCKETS_MB, ranks[0]["overlap"], ranks[1]["overlap"], strict=True):
        print(f"| {mb:g} | {r0['comm_collectives']:.0f} | {r0['comm_ms']:.2f} | {r0['comm_hidden_ms']:.2f} | "
              f"{r0['comm_hidden_fraction']:.2f}, {r1['comm_hidden_fraction']:.2f} | {1000 * r0['step_s']:.1f} |")  # fmt: skip
    planner_check(ranks[0]["all_reduce"])


def planner_check(measured: list[float]) -> None:
    """The planner's ring all-reduce term, its bandwidth and latency fitted on the smallest and largest payloads
    measured here (loopback gloo), against the measured times of every payload."""
    from raylora.comm.plan import Link, collective_s

    # on 2 cards the ring costs P / bw + 2 latency
    bw = (SIZES[-1] - SIZES[0]) / (measured[-1] - measured[0])
    latency = max(0.0, (measured[0] - SIZES[0] / bw) / 2)
    link = Link(cards_per_node=2, intra_gbs=bw / 1e9, inter_gbs=bw / 1e9, intra_latency_us=latency * 1e6,
                inter_latency_us=latency * 1e6, peak_tflops=1.0)  # fmt: skip
    print(f"\nplanner's all-reduce term against gloo on this machine (fitted: {bw / 1e9:.2f} GB/s, "
          f"{latency * 1e6:.0f} us latency)\n| payload | predicted ms | measured ms | ratio |\n|---|---|---|---|")  # fmt: skip
    for size, t in zip(SIZES, measured, strict=True):
        predicted = collective_s(size, "all_reduce", 2, link)
        print(f"| {size / 2**10:,.0f} KiB | {1e3 * predicted:.3f} | {1e3 * t:.3f} | {predicted / t:.2f}x |")


if __name__ == "__main__":
    main()
