"""Preference training (DPO): `raylora train` against TRL's `DPOTrainer` + peft, back to back on the same machine.

Baseline: TRL 1.16 `DPOTrainer` with `peft_config=LoraConfig(...)` (its reference is the base with the adapter off,
as ours is), `bf16=True` (autocast), `use_cpu=True`, its own collator (each pair's chosen and rejected sequences
padded to the batch's longest), `report_to=[]`, once with `gradient_checkpointing` on (DPOConfig's default) and once
off; the base model is the safetensors folder raylora converted the GGUF into (`raylora.model_files.model_folder`),
loaded with `AutoModelForCausalLM.from_pretrained` in fp32, and raylora's tokenizer (same chat template).
Ours: `raylora train` through `fit()` (one Ray Train worker taking every core, as bench/train_throughput.py runs it)
with configs/smollm2_dpo_cpu.yaml: `train.objective: dpo`, pairs packed whole into sequences of <= data.cutoff_len,
bf16 autocast (`backend.precision: bf16`).

Both sides: the pairs of data/raylora_identity_dpo.jsonl (LLaMA-Factory sharegpt ranking rows) with {{name}} /
{{author}} filled from the config's data.placeholders; the same held-out pairs (data.eval_count of them, chosen by
raylora's seeded rule: the rows with the smallest `split_draw`), the rest trained on; LoRA r=8, alpha 16, dropout 0,
all linear layers; DPO sigmoid with the config's beta (0.1); the config's lr, schedule and warm-up, max grad norm,
weight decay and seed; the same number of optimizer steps. TRL's batch is the number of pairs ours trains per step
(its train pairs over its packs, times train.batch_size, rounded; --trl-batch overrides it); TRL's max_length is
data.cutoff_len. Each run is its own process.

Figures per run: pairs trained per second (ours: the pairs each step trained, history.json's `pairs`; TRL: its batch),
the speed that compares, and real (non-padding) tokens per second of training (ours: the packs' num_tokens, as
history.json's tokens_per_s counts them, each prompt once: prefix sharing; TRL: the non-padding tokens of the chosen
and rejected sequences its collator built for each step, each prompt twice), steady (after the first step) and over
the whole run; peak resident memory of the training process
(ours: the Ray worker's peak_memory_mb in history.json; TRL: its process's ru_maxrss, read right after training);
eval reward accuracy (and margin, loss) on the held-out pairs after the same steps (ours: eval_rewards/accuracies in
history.json; TRL: `trainer.evaluate()` on those pairs); the ratios ours / TRL: pairs/s against the faster TRL run,
memory against the leaner one. The load averages before and after are printed: quote figures only with them.

The effect. Counting rule, fixed before any run: an answer counts when it contains "Raylora Assistant" or
"raylora team", case-insensitive. After training, `raylora eval` answers every held-out prompt (each prompt once,
greedy, eval.max_tokens) with two candidates, `base` and our DPO adapter, on one copy of the base (the serving
engine), the chosen answer being the reference; the bench prints each candidate's count by that rule and the
`contains` metric (eval.keys: the answer holds every key the reference holds).

    .venv/bin/python bench/preference.py [--steps 30] [--skip-trl] [--trl-checkpointing on,off] [--trl-batch N]
        [--skip-effect] [--size smollm2|tiny] [--keep DIR] [--set KEY=VALUE ...]

``--set`` overrides our run's config (e.g. ``preference.sft_weight=1.0``, ``train.objective=orpo``); TRL's runs stay
DPO as the docstring says, so compare speeds only without it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from train_throughput import launch  # noqa: E402  (the same child-process runner)

CONFIG = ROOT / "configs" / "smollm2_dpo_cpu.yaml"
# --size tiny: the same job on the 2-layer random Llama (a smoke run of this script, seconds a step)
TINY = ["model.name_or_path=tiny-llama", "data.cutoff_len=512"]
COUNTED = ("raylora assistant", "raylora team")  # the counting rule (see the docstring), lower case


def counts(answer: str) -> bool:
    """The counting rule: the answer names the assistant or its makers."""
    return any(key in answer.lower() for key in COUNTED)


def config(size: str, extra: list[str] | None = None):
    from raylora.config import load_config

    return load_config(CONFIG, (TINY if size == "tiny" else []) + (extra or []))


def data_file(cfg) -> Path:
    """The one preference file of ``data.sources`` (a path, or a name in data.dataset_info)."""
    (source,) = cfg.data.sources
    if source.path:
        return (ROOT / source.path).resolve()
    info = (ROOT / cfg.data.dataset_info).resolve()
    return info.parent / json.loads(info.read_text())[source.name]["file_name"]


def split_rows(cfg) -> tuple[list[dict], list[dict]]:
    """The file's rows as (train, held out), raylora's rule for data.eval_count: the rows with the smallest seeded
    draw of (file name, line) are held out."""
    from raylora.data.read import iter_raw
    from raylora.data.transforms import split_draw

    path = data_file(cfg)
    with open(path, "rb") as f:
        rows = [(split_draw(cfg.data.seed, str(path), line), line, json.loads(raw))
                for line, raw, error in iter_raw(f, str(path)) if error is None]  # fmt: skip
    held = {line for _, line, _ in sorted(rows, key=lambda r: r[:2])[: cfg.data.eval_count]}
    return [r for _, line, r in rows if line not in held], [r for _, line, r in rows if line in held]


def fill(text: str, placeholders: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: placeholders[m.group(1)], text)


ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def trl_row(row: dict, placeholders: dict[str, str]) -> dict:
    """A LLaMA-Factory sharegpt ranking row as TRL's conversational preference row."""

    def message(turn: dict) -> dict:
        return {"role": ROLES[turn["from"]], "content": fill(turn["value"], placeholders)}

    prompt = ([{"role": "system", "content": fill(row["system"], placeholders)}] if row.get("system") else []) + [
        message(t) for t in row["conversations"]
    ]
    return {"prompt": prompt, "chosen": [message(row["chosen"])], "rejected": [message(row["rejected"])]}


def run_ours(size: str, steps: int, tmp: str, extra: list[str]) -> dict:
    import ray

    from raylora.train.fit import fit

    cores = os.cpu_count() or 1
    ray.init(num_cpus=cores, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=True)
    cfg = config(size, [
        f"train.max_steps={steps}", f"data.output_dir={tmp}/data", f"train.output_dir={tmp}/dpo",
        f"train.cpus_per_worker={cores}", "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=0",
        "tracking.enabled=false", *extra,
    ])  # fmt: skip
    result = fit(cfg, log=lambda s: None)
    ray.shutdown()
    history = result["history"]
    last = history[-1]
    clock = [h["tokens"] / h["tokens_per_s"] for h in history]  # seconds since the loop started, at each step
    splits = json.loads((Path(tmp) / "data" / "summary.json").read_text())["splits"]
    train = splits["train"]
    return {
        "tokens_per_s": last["tokens_per_s"], "tokens": last["tokens"], "peak_mb": last["peak_memory_mb"],
        "steady_tokens_per_s": (last["tokens"] - history[0]["tokens"]) / (clock[-1] - clock[0]),
        "pairs_per_s": sum(h["pairs"] for h in history) / clock[-1],
        "steady_pairs_per_s": sum(h["pairs"] for h in history[1:]) / (clock[-1] - clock[0]),
        "pairs_per_step": sum(h["pairs"] for h in history) / steps, "tokens_per_step": last["tokens"] / steps,
        "eval_accuracy": last["eval_rewards/accuracies"], "eval_margin": last["eval_rewards/margins"],
        "eval_loss": last["eval_loss"], "train_loss": last["loss"], "adapter": result["adapter"],
        "train_accuracy": last.get("rewards/accuracies"), "train_pairs": train["pairs"],
        "eval_pairs": splits["eval"]["pairs"], "eval_chosen": last["eval_rewards/chosen"],
        "eval_rejected": last["eval_rewards/rejected"],
        "logps_first": (history[0]["logps/chosen"], history[0]["logps/rejected"]),
        "logps_last": (last["logps/chosen"], last["logps/rejected"]),
    }  # fmt: skip


def run_trl(size: str, steps: int, batch: int, checkpointing: bool, tmp: str) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from raylora.model_files import load_tokenizer, model_folder
    from raylora.models import load_model

    cfg = config(size)
    if size == "tiny":
        model, tokenizer = load_model(cfg.model)
    else:  # the converted safetensors folder, as a TRL user would load it
        model, tokenizer = AutoModelForCausalLM.from_pretrained(model_folder(cfg.model)), load_tokenizer(cfg.model)
    train_rows, eval_rows = split_rows(cfg)
    place = cfg.data.placeholders
    train = Dataset.from_list([trl_row(r, place) for r in train_rows])
    held = Dataset.from_list([trl_row(r, place) for r in eval_rows])
    lora = cfg.lora
    peft_config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules="all-linear", task_type="CAUSAL_LM")  # fmt: skip
    args = DPOConfig(
        output_dir=f"{tmp}/trl", per_device_train_batch_size=batch, per_device_eval_batch_size=batch,
        max_steps=steps, learning_rate=cfg.train.lr, lr_scheduler_type=cfg.train.scheduler,
        warmup_steps=cfg.train.warmup_steps, weight_decay=cfg.train.weight_decay, adam_epsilon=cfg.train.adam_eps,
        max_grad_norm=cfg.train.max_grad_norm, beta=cfg.preference.beta, loss_type=[cfg.preference.loss_type],
        max_length=cfg.data.cutoff_len, bf16=True, use_cpu=True, gradient_checkpointing=checkpointing,
        report_to=[], logging_steps=steps, save_strategy="no", eval_strategy="no", seed=cfg.train.seed,
        dataloader_num_workers=0,
    )  # fmt: skip
    real, slots, ends, counting = [], [], [], [True]

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    trainer = DPOTrainer(model=model, args=args, train_dataset=train, eval_dataset=held, processing_class=tokenizer,
                         peft_config=peft_config, callbacks=[Clock()])  # fmt: skip
    collate = trainer.data_collator

    def counted(features):
        batch = collate(features)
        if counting[0]:
            real.append(int(batch["attention_mask"].sum()))
            slots.append(batch["attention_mask"].numel())
        return batch

    trainer.data_collator = counted
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    counting[0] = False
    real, slots = real[:steps], slots[:steps]  # the loader may have collated a batch ahead
    scores = trainer.evaluate()
    return {
        "tokens": sum(real), "tokens_per_s": sum(real) / seconds,
        "steady_tokens_per_s": sum(real[1:]) / (ends[-1] - ends[0]), "peak_mb": peak_mb,
        "pairs_per_s": batch * steps / seconds, "steady_pairs_per_s": batch * (steps - 1) / (ends[-1] - ends[0]),
        "padding": 1 - sum(real) / sum(slots), "pairs_per_step": batch, "tokens_per_step": sum(real) / steps,
        "eval_accuracy": scores["eval_rewards/accuracies"], "eval_margin": scores["eval_rewards/margins"],
        "eval_loss": scores["eval_loss"], "threads": torch.get_num_threads(),
        "eval_pairs": len(held), "train_pairs": len(train), "eval_chosen": scores["eval_rewards/chosen"],
        "eval_rejected": scores["eval_rewards/rejected"],
    }  # fmt: skip


def child(spec: dict) -> dict:
    if spec["side"] == "trl":
        return run_trl(spec["size"], spec["steps"], spec["batch"], spec["checkpointing"], spec["tmp"])
    return run_ours(spec["size"], spec["steps"], spec["tmp"], spec["extra"])


def effect(size: str, adapter: str, tmp: str) -> dict:
    """`raylora eval` of base and ``adapter`` on the held-out prompts (chosen answers as references): each
    candidate's count by the counting rule, its `contains` mean and a few answers."""
    cfg = config(size)
    prompts, seen = [], set()
    for row in split_rows(cfg)[1]:
        pair = trl_row(row, cfg.data.placeholders)
        key = json.dumps(pair["prompt"])
        if key not in seen:  # each prompt once
            seen.add(key)
            prompts.append({"messages": pair["prompt"] + pair["chosen"]})
    eval_set = Path(tmp) / "held_out_prompts.jsonl"
    eval_set.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in prompts))
    out = Path(tmp) / "eval"
    cli = shutil.which("raylora", path=str(Path(sys.executable).parent)) or "raylora"
    cores = os.cpu_count() or 1
    overrides = [
        f"eval.candidates=[base, {adapter}]", f"eval.sources=[{{path: {eval_set}, format: openai}}]",
        f"eval.output_dir={out}", "eval.metrics=[contains, rouge-l, length]", f"eval.cpus_per_actor={cores}",
        "eval.actors_per_node=1", "tracking.enabled=false",
    ]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run([cli, "eval", str(CONFIG), *(TINY if size == "tiny" else []), *overrides],
                          capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"raylora eval failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}")
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines() if line.strip()]
    report = json.loads((out / "report.json").read_text())
    names = list(report["adapters"])
    per = {}
    for name in names:
        mine = [a for a in answers if a["candidate"] == name]
        per[name] = {
            "count": sum(counts(a["answer"]) for a in mine), "rows": len(mine),
            "contains": report["candidates"].get(name, {}).get("metrics", {}).get("contains"),
            "rouge-l": report["candidates"].get(name, {}).get("metrics", {}).get("rouge-l"),
            "examples": [(a["question"], a["answer"]) for a in mine[:3]],
        }  # fmt: skip
    return {"candidates": per, "prompts": len(prompts), "rejected": report["rejected"], "failed": report["failed"],
            "seconds": time.perf_counter() - started, "max_tokens": report["generation"]["max_tokens"]}  # fmt: skip


def bench(
    size: str, steps: int, trl: list[bool], trl_batch: int | None, run_effect: bool, keep: str | None, extra: list[str]
) -> None:
    cfg = config(size, extra)
    train_rows, eval_rows = split_rows(cfg)
    load_before = os.getloadavg()
    print(f"\n== {size} ({cfg.model.name_or_path}), {os.cpu_count()} cores; {len(train_rows)} train pairs, "
          f"{len(eval_rows)} held out; {steps} steps", flush=True)  # fmt: skip
    runs = {}
    tmp = str(Path(keep).resolve()) if keep else tempfile.mkdtemp(prefix="bench-preference-")
    Path(tmp).mkdir(parents=True, exist_ok=True)
    try:
        name = f"raylora train ({cfg.train.objective}{', ' + ' '.join(extra) if extra else ''})"
        ours = runs[name] = launch({"side": "ours", "size": size, "steps": steps, "tmp": tmp, "extra": extra}, __file__)
        print(f"  done: ours: {json.dumps(ours)}", flush=True)
        batch = trl_batch or max(1, round(ours["pairs_per_step"]))
        for checkpointing in trl:
            name = f"TRL DPOTrainer + peft, bf16, gradient_checkpointing={'on' if checkpointing else 'off'}"
            runs[name] = launch({"side": "trl", "size": size, "steps": steps, "batch": batch,
                                 "checkpointing": checkpointing, "tmp": tmp}, __file__)  # fmt: skip
            print(f"  done: {name}: {json.dumps(runs[name])}", flush=True)
        load_after = os.getloadavg()
        judged = effect(size, ours["adapter"], tmp) if run_effect else None
        load_end = os.getloadavg()
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"ours: {steps} steps of {cfg.train.batch_size} packs of <= {cfg.data.cutoff_len} tokens "
          f"({ours['pairs_per_step']:.2f} pairs a step on average); TRL: {steps} steps of {batch} pairs "
          f"(2 x {batch} padded sequences), max_length {cfg.data.cutoff_len}")  # fmt: skip
    pairs = ", ".join(f"{n}: {r['train_pairs']} / {r['eval_pairs']}" for n, r in runs.items())
    print(f"pairs trained on / held out: {pairs}")
    print("steady = after the first step; all = the whole training loop; real tokens: the tokens each side computes "
          "(ours compute each prompt once, TRL twice), so pairs/s is what compares")  # fmt: skip
    print("| run | pairs/step | real tokens/step | pairs/s steady (all) | real tokens/s steady (all) | peak memory | "
          "eval reward accuracy | eval margin | eval rewards chosen / rejected | eval loss | wall s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        print(f"| {name} | {r['pairs_per_step']:.2f} | {r['tokens_per_step']:.0f} | {r['steady_pairs_per_s']:.2f} "
              f"({r['pairs_per_s']:.2f}) | {r['steady_tokens_per_s']:.0f} "
              f"({r['tokens_per_s']:.0f}) | {r['peak_mb'] / 1024:.2f} GB | {r['eval_accuracy']:.1%} | "
              f"{r['eval_margin']:.3f} | {r['eval_chosen']:+.3f} / {r['eval_rejected']:+.3f} | {r['eval_loss']:.4f} | "
              f"{r['wall_s']:.0f} |")  # fmt: skip
    print(f"our path: {ours['path']}")
    print("ours, log-probabilities of the step's chosen / rejected answers (summed over their tokens): step 1 "
          f"{ours['logps_first'][0]:.1f} / {ours['logps_first'][1]:.1f}, step {steps} {ours['logps_last'][0]:.1f} / "
          f"{ours['logps_last'][1]:.1f} (a reward is beta x the log-ratio to the base)")  # fmt: skip
    baselines = [r for name, r in runs.items() if name.startswith("TRL")]
    if baselines:
        padding = ", ".join(f"{r['padding']:.0%}" for r in baselines)
        print(f"padding in TRL's batches: {padding}")
        for key, what in (("steady_pairs_per_s", "steady"), ("pairs_per_s", "whole run")):
            faster = max(r[key] for r in baselines)
            print(f"speed, pairs/s ({what}): ours / faster TRL = {ours[key] / faster:.2f}x (target >= 2.0x)")
        leaner = min(r["peak_mb"] for r in baselines)
        print(f"memory: ours / leaner TRL = {ours['peak_mb'] / leaner:.2f}x (target <= 0.5x)")
        gaps = ", ".join(f"{100 * (ours['eval_accuracy'] - r['eval_accuracy']):+.1f}" for r in baselines)
        print(f"eval reward accuracy, ours minus TRL: {gaps} points (target: within 5)")
    print(f"load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; after training: "
          f"{', '.join(f'{x:.2f}' for x in load_after)}; after the eval: {', '.join(f'{x:.2f}' for x in load_end)} "
          f"({os.cpu_count()} cores)")  # fmt: skip
    if judged:
        print(f"\nthe effect: raylora eval, {judged['prompts']} held-out prompts, greedy, max_tokens "
              f"{judged['max_tokens']} ({judged['rejected']} rejected, {judged['failed']} failed, "
              f"{judged['seconds']:.0f} s); rule: the answer contains 'Raylora Assistant' or 'raylora team', "
              "case-insensitive")  # fmt: skip
        print("| candidate | counted answers | contains (eval.keys) | rouge-l |")
        print("|---|---|---|---|")
        for name, c in judged["candidates"].items():
            contains = "-" if c["contains"] is None else f"{c['contains']:.3f}"
            rouge = "-" if c["rouge-l"] is None else f"{c['rouge-l']:.1f}"
            print(f"| {name} | {c['count']} / {c['rows']} | {contains} | {rouge} |")
        base, *adapters = judged["candidates"].values()
        for c in adapters:
            ratio = f"{c['count'] / base['count']:.1f}x" if base["count"] else "base 0: any count above 0 doubles it"
            print(f"DPO / base count: {c['count']} / {base['count']} = {ratio} (target >= 2x)")
        for name, c in judged["candidates"].items():
            for question, answer in c["examples"]:
                print(f"  [{name}] {question!r} -> {answer!r}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps of each run (default: the config's)")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument(
        "--trl-checkpointing", default="on,off", help="TRL runs: gradient_checkpointing on, off or both"
    )
    parser.add_argument("--trl-batch", type=int, default=None, help="TRL's pairs per step (default: ours, rounded)")
    parser.add_argument("--skip-effect", action="store_true", help="no raylora eval of base against the adapter")
    parser.add_argument("--keep", help="keep the runs' outputs (our adapter and history.json, the eval's answers) here")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE override of our run's config")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return
    trl = [] if args.skip_trl else [{"on": True, "off": False}[v.strip()] for v in args.trl_checkpointing.split(",")]
    steps = args.steps or config(args.size).train.max_steps
    bench(args.size, steps, trl, args.trl_batch, not args.skip_effect, args.keep, args.set)


if __name__ == "__main__":
    main()
