"""``raylora <command> CONFIG.yaml [section.key=value ...]``."""

from __future__ import annotations

import argparse
import sys

from raylora.config import ConfigError, load_config
from raylora.paths import anchor_outputs

COMMANDS = {
    "quickstart": "single-process LoRA fine-tune of a few steps, save the adapter, answer a question",
    "prepare": "tokenise, mask and pack instruction data into Parquet shards with Ray Data",
    "train": "LoRA fine-tune on N workers with Ray Train",
    "tune": "search LoRA rank, alpha, learning rate (any lora.* / train.* key) with Ray Tune and ASHA",
    "export": "write a merged or quantised model folder",
    "serve": "serve the base model and adapters over an OpenAI-compatible HTTP API",
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
        if name == "tune":
            cmd.add_argument("--resume", action="store_true", help="continue the sweep in train.output_dir")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the process exit code (0 ok, 1 run failed, 2 bad input or not available)."""
    args = parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        cfg = anchor_outputs(cfg, args.command, args.config)
        if args.command == "tune":
            from raylora.tune.space import check

            check(cfg)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if args.command == "doctor":
        from raylora.doctor import check, render

        rows, problems = check(cfg)
        print(render(rows, problems))
        return 1 if problems else 0
    from raylora.backends import BackendError
    from raylora.model_files import ModelError
    from raylora.tracking import TrackingError
    from raylora.train.checkpoint import CheckpointError
    from raylora.train.fit import TrainingError

    expected = (BackendError, ModelError, TrackingError, CheckpointError, TrainingError, ValueError, OSError)

    try:
        if args.command == "prepare":
            from raylora.data.pipeline import prepare

            prepare(cfg)
        elif args.command == "export":
            from raylora.export import export

            export(cfg)
        elif args.command == "serve":
            from raylora.serve.launch import serve_forever, start

            if args.detach:
                print(f"raylora serve: {start(cfg)}/v1 is ready (OpenAI API)")
            else:
                serve_forever(cfg)
        elif args.command == "tune":
            from raylora.tune.sweep import sweep

            sweep(cfg, resume=args.resume)
        elif args.command == "train":
            from raylora.train.fit import fit

            fit(cfg)
        else:
            from raylora.train.quickstart import run_quickstart

            run_quickstart(cfg)
    except ConfigError as e:  # a sweep's trial that does not fit the cluster, found once Ray is up
        print(e, file=sys.stderr)
        return 2
    except expected as e:
        print(f"raylora {args.command}: {e}", file=sys.stderr)
        return 1
    return 0


def main_entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    main_entry()
