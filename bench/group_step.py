"""The grouped step on its own: K LoRA members trained by one :class:`raylora.train.group.Group` against one member
alone, each in a fresh process, and the profile of a grouped step.

What a shared-base sweep saves or costs per step, without Tune, Ray or MLflow around it (bench/tune_shared.py
measures whole sweeps). Every run is a fresh Python process (so its peak RSS is its own) on the same 48 synthetic
rows (64-128 random token ids, the first quarter masked as prompt), ``--width`` tokens wide, batch 2, LoRA on
``--targets`` with rank 4 or 16 (members alternate) and lr 1e-3, the machine's default precision. It prints, for
one member alone and for groups of K: the median step time after 2 warm-up steps, the time per member-step, and
the process's peak RSS; then the ratios against K separate processes (K x the alone figures, what
trials_per_group=1 pays when K trials run at once), and torch.profiler's top operators of one grouped step.
Each group runs with each of ``--lanes``: 1 is every member on one thread with all ``--threads`` intra-op threads,
N splits the members into N lanes on threads of their own with threads / N intra-op threads each (the default on
CPU: as many lanes as threads). ``--busy F`` runs every measurement beside two processes that each keep a core busy
a fraction F of the time in 3 ms bursts, as Tune's driver and Ray's daemons do during a sweep.

    .venv/bin/python bench/group_step.py [--model smollm2-135m-instruct] [--k 4 8] [--recompute 0 1] [--lanes 1 2] [--busy 0.15]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rows(width: int, n: int = 48) -> list[dict]:
    gen = random.Random(0)
    rows = []
    for _ in range(n):
        length = gen.randrange(width // 2, width + 1)
        ids = [gen.randrange(3, 250) for _ in range(length)]  # within every model's vocabulary, tiny ones too
        prompt = length // 4
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:], "position_ids": list(range(length)),
                     "seq_lens": [length], "num_tokens": length})  # fmt: skip
    return rows


def _cfg(model: str, width: int, targets: str, rank: int, recompute: int):
    from raylora.config import from_dict

    return from_dict({
        "model": {"name_or_path": model}, "data": {"cutoff_len": width}, "backend": {"device": "cpu"},
        "tracking": {"enabled": False}, "lora": {"rank": rank, "alpha": 2 * rank, "target_modules": [targets]},
        "train": {"max_steps": 1000, "lr": 1e-3, "batch_size": 2, "recompute_every": recompute, "log_every": 1000},
    })  # fmt: skip


def child(args) -> None:
    """One run: a group of ``args.child`` members, its step times, peak RSS and (``--profile``) top operators."""
    import pyarrow as pa
    import torch

    from raylora.data.packs import PackShard
    from raylora.train.group import Group

    torch.set_num_threads(args.threads)
    recompute = args.recompute[0]
    group = Group(
        _cfg(args.model, args.width, args.targets, 4, recompute),
        PackShard(pa.Table.from_pylist(_rows(args.width))),
        None,
        lanes=args.lane,
    )
    for i in range(args.child):
        group.join(f"m{i}", _cfg(args.model, args.width, args.targets, (4, 16)[i % 2], recompute))
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        group.step()
        times.append(time.perf_counter() - started)
    table = ""
    if args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            group.step()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps({"step_s": statistics.median(times[2:]), "peak_gb": peak_gb, "profile": table}))


def _busy(fraction: float) -> None:
    """Keep a core busy ``fraction`` of the time, in 3 ms bursts, until killed."""
    while True:
        started = time.perf_counter()
        while time.perf_counter() - started < 0.003:
            pass
        time.sleep(0.003 * (1 - fraction) / fraction)


def _run(args, k: int, recompute: int, lanes: int = 1, profile: bool = False) -> dict:
    command = [sys.executable, __file__, "--child", str(k), "--model", args.model, "--width", str(args.width),
               "--targets", args.targets, "--recompute", str(recompute), "--steps", str(args.steps),
               "--threads", str(args.threads), "--lane", str(lanes)] + (["--profile"] if profile else [])  # fmt: skip
    out = subprocess.run(
        command, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--width", type=int, default=128, help="data.cutoff_len: every row is padded to it")
    p.add_argument("--targets", default="attention")
    p.add_argument("--k", type=int, nargs="+", default=[4, 8])
    p.add_argument("--recompute", type=int, nargs="+", default=[0, 1], help="train.recompute_every values to run")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--lanes", type=int, nargs="+", help="lanes of each group (default: 1 and --threads)")
    p.add_argument("--lane", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument(
        "--busy", type=float, default=0.0, help="two busy processes beside each run, each this share of a core"
    )
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.lanes = args.lanes or sorted({1, args.threads})
    if not 0 <= args.busy < 1:
        p.error("--busy is a share of a core: 0 (off) up to, not including, 1")
    if args.child:
        return child(args)
    if args.busy:
        import multiprocessing

        hogs = [multiprocessing.Process(target=_busy, args=(args.busy,), daemon=True) for _ in range(2)]
        for hog in hogs:
            hog.start()
    print(f"{args.model}, rows {args.width} tokens wide, batch 2, LoRA on {args.targets} (rank 4/16), "
          f"{args.threads} threads, {args.steps} steps a run (median after 2), "
          f"{f'beside two processes each busy {args.busy:.0%} of a core' if args.busy else 'nothing else running'}\n")  # fmt: skip
    print(
        "| recompute_every | members | lanes | step s | s per member-step | vs alone | peak RSS GB | vs K alone processes |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for recompute in args.recompute:
        alone = _run(args, 1, recompute)
        print(
            f"| {recompute} | 1 | 1 | {alone['step_s']:.2f} | {alone['step_s']:.2f} | 1.00x | {alone['peak_gb']:.2f} | |"
        )
        for k in args.k:
            for lanes in args.lanes:
                r = _run(args, k, recompute, lanes)
                per = r["step_s"] / k
                print(f"| {recompute} | {k} | {lanes} | {r['step_s']:.2f} | {per:.2f} | {alone['step_s'] / per:.2f}x faster | "
                      f"{r['peak_gb']:.2f} | {r['peak_gb'] / (k * alone['peak_gb']):.2f}x |")  # fmt: skip
    k, lanes = max(args.k), max(args.lanes)
    print(
        f"\nprofile of one step of {k} members in {lanes} lane(s), recompute_every {args.recompute[0]} (self CPU time of the first lane's thread)\n"
    )
    print(_run(args, k, args.recompute[0], lanes, profile=True)["profile"])


if __name__ == "__main__":
    main()
