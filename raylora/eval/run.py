"""``raylora eval CONFIG``: which candidate answers best, on an eval set with references.

check (candidates, eval set, metrics: every problem at once, before Ray) → Ray Data generation on an actor pool
(:mod:`raylora.eval.generate`) → scores per row (:mod:`raylora.eval.metrics`) → ``eval.output_dir``: ``answers.jsonl``,
``rejects.jsonl``, ``report.md`` / ``report.json``, ``metrics.png`` → MLflow (:mod:`raylora.eval.report`).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raylora.cluster import ensure_ray
from raylora.config import METRICS, ConfigError, JobConfig
from raylora.data.sources import DataError
from raylora.eval.candidates import Candidate, resolve
from raylora.eval.generate import generate
from raylora.eval.judge import judge_all
from raylora.eval.metrics import means, score_row
from raylora.eval.report import log_runs, plot, render, write_jsonl
from raylora.eval.rows import EvalRow, eval_rows
from raylora.model_files import ModelError, load_tokenizer
from raylora.models import model_skeleton


def check_eval(
    cfg: JobConfig, source: str = "config", with_candidates: bool = True
) -> tuple[list[Candidate], list[EvalRow], list[dict]]:
    """The candidates, the eval set's rows and its rejects, or every problem with them.

    Args:
        with_candidates: False checks the eval set and metrics alone (a sweep, whose trials do not exist yet).
    Raises:
        ConfigError: listing every problem: an unknown metric, a candidate that is missing, not an adapter, trained
            on another base or not in the registry; an eval set that cannot be read or holds no row with a reference.
    """
    problems: list[tuple[str, str]] = []
    unknown = [m for m in cfg.eval.metrics if m not in METRICS]
    if unknown:
        problems.append(("eval.metrics", f"unknown {', '.join(map(repr, unknown))}; known: {', '.join(METRICS)}"))
    judge = cfg.eval.judge
    if judge.url and not judge.url.startswith(("http://", "https://")):
        problems.append(("eval.judge.url", f"got {judge.url!r}: give the endpoint's http(s) base URL, e.g. "
                                           "http://127.0.0.1:8000/v1"))  # fmt: skip
    if judge.url and judge.api_key_env and not os.environ.get(judge.api_key_env):
        problems.append(("eval.judge.api_key_env", f"${judge.api_key_env} is not set in this environment"))
    if not cfg.eval.sources and not (cfg.data.eval_fraction or cfg.data.eval_count):
        problems.append(("eval.sources", "is empty and data has no eval split: name the eval set's files, or hold "
                                         "rows out with data.eval_fraction / data.eval_count"))  # fmt: skip
    try:
        skeleton, tokenizer = model_skeleton(cfg.model), load_tokenizer(cfg.model)
    except ModelError as e:
        raise ConfigError([*problems, ("model.name_or_path", str(e))], source) from None
    candidates, found = resolve(cfg, skeleton) if with_candidates else ([], [])
    problems += found
    rows: list[EvalRow] = []
    rejects: list[dict] = []
    if not any(k == "eval.sources" for k, _ in problems):
        key = "eval.sources" if cfg.eval.sources else "data.sources"
        try:
            rows, rejects = eval_rows(cfg, tokenizer, skeleton.config.max_position_embeddings)
        except DataError as e:
            problems.append((key, str(e)))
        else:
            if not rows:
                reasons = sorted({r["reason"] for r in rejects})[:3]
                problems.append((key, f"the eval set holds no row with a reference to score ({len(rejects)} rows "
                                      f"rejected: {'; '.join(reasons) or 'none read'})"))  # fmt: skip
    if problems:
        raise ConfigError(problems, source)
    return candidates, rows, rejects


def evaluate(cfg: JobConfig, source: str = "config", log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the eval; returns the summary (also ``report.json``).

    Returns:
        ``{"candidates": {name: {"rows", "metrics", "covered", "sources"}}, "rows", "rejected", "tokens_per_s",
        "seconds", "run_id", ...}``.
    Raises:
        ConfigError: :func:`check_eval`'s problems, before Ray starts.
    """
    candidates, rows, rejects = check_eval(cfg, source)
    out = Path(cfg.eval.output_dir)
    for name in ("answers.jsonl", "rejects.jsonl", "report.md", "report.json", "metrics.png"):
        (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    log(f"eval: {len(rows)} rows ({len(rejects)} rejected) x {len(candidates)} candidates: "
        f"{', '.join(c.name for c in candidates)}")  # fmt: skip
    ensure_ray()
    start = time.perf_counter()
    generated = generate(cfg, rows, candidates)
    seconds = time.perf_counter() - start
    answers = []
    for g in generated:
        r = rows[g["row"]]
        loss = g.pop("reference_loss")  # NaN where not computed: answers.jsonl keeps it in scores, as null there
        scores = score_row(g["answer"], r.reference, r.calls, r.tools, r.keys, g["completion_tokens"], cfg.eval.metrics)
        if "reference_loss" in cfg.eval.metrics:
            scores["reference_loss"] = None if math.isnan(loss) else loss
        answers.append({"row": r.row, "source": r.source, "line": r.line, "question": r.question,
                        "reference": r.reference, "keys": r.keys, **g, "scores": scores})  # fmt: skip
    unjudged = 0
    if cfg.eval.judge.url and "judge" in cfg.eval.metrics:
        scored = [a for a in answers if not a["error"]]
        for a, (value, reason) in zip(scored, judge_all(cfg.eval.judge, scored), strict=True):
            a["scores"]["judge"], a["judge_error"] = value, reason
            unjudged += value is None
        if unjudged:
            log(f"{unjudged} answers were left unjudged (their reasons are in answers.jsonl, judge_error)")
    failed = [a for a in answers if a["error"]]
    summary = {
        "eval_set": ", ".join(s.path or s.name or "" for s in cfg.eval.sources) or "the held-out split of data.sources",
        "rows": len(rows),
        "rejected": len(rejects),
        "failed": len(failed),
        "unjudged": unjudged,
        "metrics": [m for m in METRICS if m in cfg.eval.metrics],
        "generation": {"max_tokens": cfg.eval.max_tokens, "temperature": cfg.eval.temperature},
        "candidates": means([a for a in answers if not a["error"]], cfg.eval.metrics),
        "adapters": {c.name: {"spec": c.spec, "path": c.path, "trained_by_run": c.run_id} for c in candidates},
        "seconds": seconds,
        "tokens_per_s": sum(a["completion_tokens"] for a in answers) / seconds,
    }
    write_jsonl(out / "answers.jsonl", answers)
    write_jsonl(out / "rejects.jsonl", rejects)
    (out / "report.md").write_text(render(summary) + "\n")
    plot(summary, out / "metrics.png")
    _write_json(out / "report.json", summary)
    summary["run_id"] = log_runs(cfg, candidates, summary, answers, out)
    _write_json(out / "report.json", summary)
    log(render(summary))
    if failed:
        log(f"{len(failed)} answers failed to generate (their error is in answers.jsonl); they are not scored")
    return summary


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=1, ensure_ascii=False))
