"""What Ray's own idle processes cost a CPU training step: the same `train_step` with N idle actors stopped, then
running, alternated in one process.

Every Ray worker process (each actor: Ray Train's controller, synchronisation, dataset-manager, preemption-watcher
and placement-group-cleaner actors, Ray Data's stats and autoscaling actors) wakes every 10 ms to check for signals
(`CoreWorker.CheckSignal`, fixed in Ray's C++). On a machine whose cores all run the training threads, each wake-up
takes a core from one of them, and the other waits for it at the end of the op. This runs our training step
(`raylora.train.loop.train_step` on the model `training_model` builds, the shipped fast path) in this process, with
no Ray worker of its own, while N idle `num_cpus=0` actors of a local Ray cluster are either stopped (SIGSTOP) or
running, phase by phase. Printed: real tokens/s and the training threads' involuntary context switches per second
for each phase, the means, and the ratio running / stopped. The baseline ("stopped") is the same process, model
and batches: only the actors' wake-ups differ.

    .venv/bin/python bench/ray_helpers.py [--size smollm2|tiny] [--actors 7] [--reps 4] [--steps 2]
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from train_throughput import CUTOFF, SEED, alpaca_rows, encode, load  # noqa: E402

PACK = 512  # tokens per packed row, as the throughput benchmark's 2 x 512 micro-batches


def packed_rows(tokenizer) -> list[dict]:
    """The alpaca rows, chat-encoded and prompt-masked, packed first-fit into rows of at most :data:`PACK` tokens."""
    packs: list[dict] = []
    for row in encode(alpaca_rows()[0], tokenizer):
        ids, labels = row["input_ids"], row["labels"]
        pack = next((p for p in packs if p["num_tokens"] + len(ids) <= PACK), None)
        if pack is None:
            pack = {"input_ids": [], "labels": [], "position_ids": [], "seq_lens": [], "num_tokens": 0}
            packs.append(pack)
        pack["input_ids"] += ids
        pack["labels"] += labels
        pack["position_ids"] += list(range(len(ids)))
        pack["seq_lens"].append(len(ids))
        pack["num_tokens"] += len(ids)
    return packs


def involuntary_switches() -> int:
    """Involuntary context switches of every thread of this process so far."""
    total = 0
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/status"):
        with open(path) as f:
            total += int(f.read().split("nonvoluntary_ctxt_switches:")[1].split()[0])
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--actors", type=int, default=7, help="idle actors (a training run keeps 7 besides its worker)")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per phase")
    args = parser.parse_args()

    import itertools

    import ray
    import torch

    from raylora.backends import resolve_backend
    from raylora.config import BackendArgs, LoraArgs, TrainArgs
    from raylora.models import attach_lora
    from raylora.train.lm import training_model
    from raylora.train.loop import train_step
    from raylora.train.optim import build_optimizer, build_scheduler

    cores = os.cpu_count()
    torch.set_num_threads(cores)
    torch.manual_seed(SEED)
    backend = resolve_backend(BackendArgs(device="cpu", precision="auto"))
    base, tokenizer = load(args.size)
    lora = LoraArgs(rank=8, alpha=16, dropout=0.05, target_modules=["all-linear"])
    model = attach_lora(base, lora).train()
    train = TrainArgs(max_steps=10_000, batch_size=2, lr=2e-4, scheduler="linear")
    loss_model, notes = training_model(model, train, backend)
    optimizer = build_optimizer(model, train, backend)
    scheduler = build_scheduler(optimizer, train, [1.0])
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    rows = packed_rows(tokenizer)
    batches = ((rows[i : i + 2], (0, i)) for i in itertools.cycle(range(0, len(rows) - 1, 2)))

    def phase(steps: int) -> tuple[float, float]:
        seconds, tokens, before = 0.0, 0, involuntary_switches()
        for _ in range(steps):
            start = time.perf_counter()
            _, n, _, _ = train_step(loss_model, batches, optimizer, scheduler, scaler, tokenizer.pad_token_id,
                                    backend.amp_dtype or torch.float32, torch.device("cpu"), train, backend, 1)  # fmt: skip
            seconds += time.perf_counter() - start
            tokens += n
        return tokens / seconds, (involuntary_switches() - before) / seconds

    print(f"{args.size}, {cores} cores, {cutoff_note()}; path: {'; '.join(notes)}", flush=True)
    phase(2)  # warm-up: allocator, caches
    ray.init(num_cpus=cores, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Idle:
        def pid(self) -> int:
            return os.getpid()

    actors = [Idle.remote() for _ in range(args.actors)]
    pids = ray.get([a.pid.remote() for a in actors])
    time.sleep(2)
    results: dict[str, list[tuple[float, float]]] = {"stopped": [], "running": []}
    try:
        for rep in range(args.reps):
            for mode in results:
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP if mode == "stopped" else signal.SIGCONT)
                rate, switches = phase(args.steps)
                results[mode].append((rate, switches))
                print(f"  rep {rep + 1} {mode:8s} {rate:6.1f} real tokens/s, {switches:5.0f} involuntary switches/s")
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        ray.shutdown()
    means = {mode: sum(r for r, _ in v) / len(v) for mode, v in results.items()}
    wins = sum(r < s for (r, _), (s, _) in zip(results["running"], results["stopped"], strict=True))
    print("| actors | stopped tokens/s | running tokens/s | running / stopped | reps where running was slower |")
    print("|---|---|---|---|---|")
    print(f"| {args.actors} | {means['stopped']:.1f} | {means['running']:.1f} | "
          f"{means['running'] / means['stopped']:.3f}x | {wins} of {args.reps} |")  # fmt: skip


def cutoff_note() -> str:
    return f"alpaca rows <= {CUTOFF} tokens packed into 2 x {PACK}-token rows per step, LoRA r=8 all linear"


if __name__ == "__main__":
    main()
