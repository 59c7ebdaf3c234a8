"""What Ray's own idle processes cost a CPU training step: the same `train_step` with N idle actors stopped, then
running, alternated in one process.

Every Ray worker process (each actor: Ray Train's controller, synchronisation, dataset-manager, preemption-watcher
and placement-group-cleaner actors, Ray Data's stats and autoscaling actors) wakes every 10 ms to check for signals
(`CoreWorker.CheckSignal`, fixed in Ray's C++). On a machine whose cores all run the training threads, each wake-up
takes a core from one of them, and the other waits for it at the end of the op. This runs our training step
(`raylora.train.loop.train_step` on the model `training_model` builds, the shipped fast path) in this process, with
no Ray worker of its own, while N idle `num_cpus=0` actors of a local Ray cluster are either stopped (SIGSTOP) or
running, phase by phase. Each rep runs both phases on the same micro-batches, in alternating order. Printed: real
tokens/s and the training threads' involuntary context switches per second for each phase, the means, the ratio
running / stopped, and the load averages before and after. The baseline ("stopped") is the same process, model and
batches: only the actors' wake-ups differ (Ray's daemons run in both phases).

    .venv/bin/python bench/ray_helpers.py [--size smollm2|tiny] [--actors 7] [--reps 8] [--steps 2]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from train_throughput import CUTOFF, SEED, alpaca_rows, encode, load  # noqa: E402

PACK = 512  # tokens per packed row, as the throughput benchmark's 2 x 512 micro-batches


def packed_rows(tokenizer) -> list[dict]:
    """The alpaca rows, chat-encoded and prompt-masked, packed as ``raylora prepare`` packs them (best-fit decreasing
    into :data:`PACK` tokens, :func:`raylora.data.packing.join`), each with its ``num_tokens``."""
    from raylora.data.packing import join, pack_lengths

    examples = [(row["input_ids"], row["labels"]) for row in encode(alpaca_rows()[0], tokenizer)]
    packs = [join([examples[i] for i in group]) for group in pack_lengths([len(ids) for ids, _ in examples], PACK)]
    return [{**pack, "num_tokens": len(pack["input_ids"])} for pack in packs]


def involuntary_switches(threads: list[int]) -> int:
    """Involuntary context switches so far of those of these threads of this process that are still alive."""
    total = 0
    for tid in threads:
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{os.getpid()}/task/{tid}/status") as f:
            total += int(f.read().split("nonvoluntary_ctxt_switches:")[1].split()[0])
    return total


def main() -> None:
    """Build the model, warm it up, start the cluster and its idle actors, alternate the phases, print the table."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--actors", type=int, default=7, help="idle actors (a training run keeps 7 besides its worker)")
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per phase")
    args = parser.parse_args()
    load_before = os.getloadavg()

    import ray
    import torch

    from raylora.backends import resolve_backend
    from raylora.cluster import normal_priority
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
    pairs = ((rows[i : i + 2], (0, i)) for i in itertools.cycle(range(0, len(rows) - 1, 2)))

    def phase(chunk: list) -> tuple[float, float]:
        seconds, tokens, before = 0.0, 0, involuntary_switches(threads)
        batches = iter(chunk)
        for _ in chunk:
            start = time.perf_counter()
            _, n, _, _ = train_step(loss_model, batches, optimizer, scheduler, scaler, tokenizer.pad_token_id,
                                    backend.amp_dtype or torch.float32, torch.device("cpu"), train, backend, 1)  # fmt: skip
            seconds += time.perf_counter() - start
            tokens += n
        return tokens / seconds, (involuntary_switches(threads) - before) / seconds

    print(f"{args.size}, {cores} cores, {setup_note()}; {normal_priority()}; path: {'; '.join(notes)}", flush=True)
    threads: list[int] = []
    phase([next(pairs) for _ in range(2)])  # warm-up: allocator, caches, torch's intra-op threads started
    threads = [int(t) for t in os.listdir(f"/proc/{os.getpid()}/task")]  # the training threads, before Ray's own
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
            chunk = [next(pairs) for _ in range(args.steps)]
            for mode in ("stopped", "running") if rep % 2 == 0 else ("running", "stopped"):
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP if mode == "stopped" else signal.SIGCONT)
                rate, switches = phase(chunk)
                results[mode].append((rate, switches))
                print(f"  rep {rep + 1} {mode:8s} {rate:6.1f} real tokens/s, {switches:5.0f} involuntary switches/s")
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        ray.shutdown()
    rate = {mode: sum(r for r, _ in v) / len(v) for mode, v in results.items()}
    switches = {mode: sum(w for _, w in v) / len(v) for mode, v in results.items()}
    slower = sum(r < s for (r, _), (s, _) in zip(results["running"], results["stopped"], strict=True))
    print(
        "| actors | stopped: tokens/s, switches/s | running: tokens/s, switches/s | running / stopped | reps where running was slower |"
    )
    print("|---|---|---|---|---|")
    print(f"| {args.actors} | {rate['stopped']:.1f}, {switches['stopped']:.0f} | {rate['running']:.1f}, "
          f"{switches['running']:.0f} | {rate['running'] / rate['stopped']:.3f}x | {slower} of {args.reps} |")  # fmt: skip
    after = os.getloadavg()
    print(f"load average (1, 5, 15 min) before: {load_before[0]:.2f}, {load_before[1]:.2f}, {load_before[2]:.2f}; "
          f"after: {after[0]:.2f}, {after[1]:.2f}, {after[2]:.2f} ({os.cpu_count()} cores)")  # fmt: skip


def setup_note() -> str:
    """What each step trains on."""
    return f"alpaca rows <= {CUTOFF} tokens packed into 2 x {PACK}-token rows per step, LoRA r=8 all linear"


if __name__ == "__main__":
    main()
