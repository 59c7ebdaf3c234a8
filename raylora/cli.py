"""``raylora <command> CONFIG.yaml [section.key=value ...]``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from raylora.comm.links import PRESETS
from raylora.config import ConfigError, JobConfig, load_config
from raylora.errors import BadInput, RunFailed
from raylora.paths import anchor_inputs, anchor_outputs
from raylora.startup import gc_paused
from raylora.tune import space

# The modules above are light (no torch, Ray, transformers or mlflow at import; tune.space must stay so). Every other
# raylora module is imported in load_command(), once the arguments are parsed: each command's module pulls in torch,
# Ray, transformers or mlflow (1-5 s on 2 cores), and `raylora --help` or a usage error must pay none of it; a command
# pays only for its own (the error classes main() tells apart are raylora.errors').

COMMANDS = {
    "quickstart": "single-process LoRA fine-tune of a few steps, save the adapter, answer a question",
    "prepare": "tokenise, mask and pack instruction data into Parquet shards with Ray Data",
    "train": "LoRA fine-tune on N workers with Ray Train",
    "tune": "search LoRA rank, alpha, learning rate (any lora.* / train.* key) with Ray Tune and ASHA",
    "export": "write a merged or quantised model folder",
    "eval": "answer an eval set with the base model and many adapters at once (Ray Data), score and compare them",
    "serve": "serve the base model and adapters over an OpenAI-compatible HTTP API",
    "plan": "predict step time and scaling efficiency on 1 to 256 cards, with and without gradient compression",
    "demo": "the main job end to end: prepare, train and sweep on a local Ray cluster, serve the best adapter, "
    "print before/after",
    "doctor": "check that this environment can run a job, and say what to fix",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="raylora", description="LoRA fine-tuning on Ray, from Ascend NPUs to a CPU laptop."
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help in COMMANDS.items():
        cmd = sub.add_parser(name, help=help, description=help)
        cmd.add_argument("config", nargs="?" if name == "doctor" else None, help="job YAML file (see configs/)")
        cmd.add_argument("overrides", nargs="*", metavar="section.key=value", help="override a config value")
        if name == "serve":
            cmd.add_argument("--detach", action="store_true", help="deploy and return; the app keeps serving in Ray")
        if name == "plan":
            cmd.add_argument("--cards", default="1,8,16,32,64,128,256", help="card counts, comma-separated")
            cmd.add_argument("--link-preset", default="atlas800t-a2", choices=sorted(PRESETS), help="cluster links")
            cmd.add_argument(
                "--mfu", type=float, help="share of the card's peak a step reaches (default: measured here)"
            )
            cmd.add_argument("--out", help="PNG chart path (default: <train.output_dir>/plan.png)")
        if name == "tune":
            cmd.add_argument("--resume", action="store_true", help="continue the sweep in train.output_dir")
        if name == "doctor":
            cmd.add_argument(
                "--cluster", action="store_true",
                help="also inspect every node of the running Ray cluster: torch / torch_npu / CANN, NPUs, HCCL's NICs",
            )  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the process exit code (0 ok, 1 run failed, 2 bad input or not available)."""
    cli = parser()
    args, extra = cli.parse_known_args(argv)
    # overrides after a flag (`raylora tune CONFIG --resume train.output_dir=...`): argparse ends the positionals
    # at the flag and leaves the rest over
    strays = [a for a in extra if a.startswith("-") or "=" not in a]
    if strays:
        cli.error(f"unrecognized arguments: {' '.join(strays)}")
    args.overrides = [*getattr(args, "overrides", []), *extra]
    try:
        # the config's checks (a sweep's builds the model's skeleton) and the command's module import torch, Ray,
        # transformers or mlflow: with the garbage collector paused, see raylora.startup
        with gc_paused():
            cfg = load_config(args.config, args.overrides)
            cfg = anchor_inputs(anchor_outputs(cfg, args.command, args.config))
            if args.command == "tune":
                space.check(cfg)
            command = load_command(args.command)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    try:
        return command(cfg, args)
    except ConfigError as e:  # a sweep's trial that does not fit the cluster, found once Ray is up
        print(e, file=sys.stderr)
        return 2
    except BadInput as e:  # the input is wrong: a model, data, checkpoint, device or port (raylora.errors)
        print(f"raylora {args.command}: {e}", file=sys.stderr)
        return 2
    except (RunFailed, ValueError, OSError) as e:
        print(f"raylora {args.command}: {e}", file=sys.stderr)
        return 1


def load_command(name: str) -> Callable[[JobConfig, argparse.Namespace], int]:
    """The function that runs command ``name`` and returns its exit code, its module imported (see the top)."""
    if name == "doctor":
        from raylora.doctor import check, render

        def doctor(cfg, args):
            rows, problems = check(cfg, cluster=args.cluster)
            print(render(rows, problems))
            return 1 if problems else 0

        return doctor
    if name == "prepare":
        from raylora.data.pipeline import prepare

        return lambda cfg, args: done(prepare(cfg))
    if name == "export":
        from raylora.export import export

        return lambda cfg, args: done(export(cfg))
    if name == "serve":
        from raylora.serve.launch import serve_forever, start

        def serve(cfg, args):
            if args.detach:
                print(f"raylora serve: {start(cfg, detach=True)}/v1 is ready (OpenAI API)")
            else:
                serve_forever(cfg)
            return 0

        return serve
    if name == "eval":
        from raylora.eval.run import evaluate

        return lambda cfg, args: done(evaluate(cfg, args.config))
    if name == "plan":
        from raylora.comm import plan

        return lambda cfg, args: done(run_plan(plan, cfg, args))
    if name == "tune":
        from raylora.tune.sweep import sweep

        return lambda cfg, args: done(sweep(cfg, resume=args.resume))
    if name == "demo":
        from raylora.cluster import sigterm_stops
        from raylora.demo import run_demo

        def demo(cfg, args):
            try:
                with sigterm_stops(lambda: None):  # SIGTERM (a scheduler, `timeout`) stops the demo as Ctrl-C does
                    run_demo(cfg, args.config)
            except KeyboardInterrupt:  # run_demo's `finally` stopped the cluster it started
                print("raylora demo: stopped by a signal; the cluster it started is stopped", file=sys.stderr)
                return 1
            return 0

        return demo
    if name == "train":
        from raylora.train.fit import fit

        return lambda cfg, args: done(fit(cfg))
    from raylora.train.quickstart import run_quickstart

    return lambda cfg, args: done(run_quickstart(cfg))


def done(_result: object) -> int:
    """The exit code of a command that returned (whatever it returned): 0."""
    return 0


def run_plan(plan, cfg, args) -> None:
    """``raylora plan``: print the predicted table and write the chart (``plan``: :mod:`raylora.comm.plan`)."""
    try:
        cards = [int(c) for c in args.cards.split(",")]
    except ValueError:
        raise ValueError(f"--cards takes whole numbers separated by commas, e.g. 8,16,32; got {args.cards!r}") from None
    mfu = args.mfu if args.mfu is not None else plan.measure_mfu(cfg)
    link = PRESETS[args.link_preset]
    rows = plan.predict(cfg, cards, link, mfu)
    print(f"{cfg.model.name_or_path} + LoRA r={cfg.lora.rank} on {args.link_preset}, MFU {mfu:.2f}"
          f"{' (given)' if args.mfu is not None else ' (measured on this machine)'}; "
          f"{cfg.train.batch_size} x {cfg.data.cutoff_len} tokens x {cfg.train.grad_accum} micro-batches per card per step\n")  # fmt: skip
    print(plan.table(rows))
    out = Path(args.out or Path(cfg.train.output_dir) / "plan.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    plan.chart(rows, out, f"{Path(cfg.model.name_or_path).name}, LoRA r={cfg.lora.rank}, {args.link_preset}")
    print(f"\nchart: {out}")


def main_entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    main_entry()
