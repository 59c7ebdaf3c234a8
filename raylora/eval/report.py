"""What an eval leaves behind: ``answers.jsonl``, ``rejects.jsonl``, ``report.md`` / ``report.json``, ``metrics.png``,
and one MLflow run with a child run per candidate (its metrics, its answers as a table, a link to the run that
trained it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from raylora.config import JobConfig, to_record
from raylora.eval.candidates import Candidate
from raylora.runs import flatten
from raylora.tracking import finish_run, start_run, tracking_uri

PERCENT = ("exact_match", "contains", "tool_name", "tool_args", "tool_json")  # 0/1 per row, shown as a percentage
TRAINED_BY = "raylora.trained_by_run"


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def shown(metric: str, value: float) -> str:
    return f"{value * 100:.1f}%" if metric in PERCENT else f"{value:.2f}"


def render(summary: dict[str, Any]) -> str:
    """The report as Markdown: one line per candidate, one column per metric, then the rows per source."""
    scores = summary["candidates"]
    metrics = [m for m in summary["metrics"] if any(m in s["metrics"] for s in scores.values())]
    lines = [
        f"# Eval: {summary['rows']} rows, {len(scores)} candidates",
        "",
        f"Eval set: {summary['eval_set']}; {summary['rejected']} rows rejected (rejects.jsonl). "
        f"Generation: max_tokens {summary['generation']['max_tokens']}, temperature "
        f"{summary['generation']['temperature']}; {summary['tokens_per_s']:.1f} generated tokens/s over "
        f"{summary['seconds']:.0f} s.",
        "",
        "| candidate | " + " | ".join(metrics) + " |",
        "|---|" + "---|" * len(metrics),
    ]
    for name, s in scores.items():
        cells = [shown(m, s["metrics"][m]) if m in s["metrics"] else "n/a" for m in metrics]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    sources = sorted({src for s in scores.values() for src in s["sources"]})
    if len(sources) > 1:
        for src in sources:
            lines += [
                "",
                f"**{src}**",
                "",
                "| candidate | " + " | ".join(metrics) + " |",
                "|---|" + "---|" * len(metrics),
            ]
            for name, s in scores.items():
                got = s["sources"].get(src, {})
                lines.append(
                    f"| {name} | " + " | ".join(shown(m, got[m]) if m in got else "n/a" for m in metrics) + " |"
                )
    lines += ["", "exact_match: equal up to case and whitespace; contains: holds every key string of the reference; "
              "rouge/bleu: 0-100, as LLaMA-Factory's predict computes them; tool_*: over rows whose reference calls a "
              "tool; length: generated tokens."]  # fmt: skip
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    """Bars of each metric (0-100; length left out, it is in tokens) per candidate."""
    # here, not at the top: matplotlib costs 0.35 s, and importing the module must not choose the process's backend
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use("Agg"), see above

    scores = summary["candidates"]
    metrics = [m for m in summary["metrics"] if m != "length" and any(m in s["metrics"] for s in scores.values())]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(metrics) * max(1, len(scores)) / 2), 4), dpi=100)
    width = 0.8 / max(1, len(scores))
    for k, (name, s) in enumerate(scores.items()):
        values = [s["metrics"].get(m, 0) * (100 if m in PERCENT else 1) for m in metrics]
        ax.bar([i + k * width for i in range(len(metrics))], values, width, label=name)
    ax.set_xticks([i + width * (len(scores) - 1) / 2 for i in range(len(metrics))], metrics)
    ax.set_ylabel("score (0-100)")
    ax.set_ylim(0, 100)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def log_runs(
    cfg: JobConfig, candidates: list[Candidate], summary: dict[str, Any], answers: list[dict], out: Path
) -> str | None:
    """One MLflow run for the eval (params, the side-by-side table, report and chart) and a child per candidate
    (its metrics overall and per source, its answers as a table, ``raylora.trained_by_run`` naming the run that
    trained it); returns the parent run id (``None`` with tracking off)."""
    parent = start_run(cfg.tracking, f"eval {out.name}", flatten(to_record(cfg)), tags={"raylora.eval": "parent"})
    if parent is None:
        return None
    import mlflow  # only once tracking is on: see the note at the top of raylora.tracking

    client = mlflow.MlflowClient(tracking_uri(cfg.tracking))
    mlflow.set_tracking_uri(tracking_uri(cfg.tracking))
    for c in candidates:
        tags = {"mlflow.parentRunId": parent, "raylora.candidate": c.spec}
        if c.run_id:
            tags[TRAINED_BY] = c.run_id
        child = start_run(cfg.tracking, c.name, {"candidate": c.name, "adapter": c.path or "base"}, tags=tags)
        s = summary["candidates"].get(c.name, {"metrics": {}, "sources": {}})  # absent: every answer failed
        values = {**s["metrics"], **{f"{src}/{m}": v for src, got in s["sources"].items() for m, v in got.items()}}
        client.log_batch(child, metrics=[mlflow.entities.Metric(_key(k), v, 0, 0) for k, v in values.items()])
        mine = [a for a in answers if a["candidate"] == c.name]
        mlflow.log_table(_columns(mine), "eval_results.json", run_id=child)
        finish_run(cfg.tracking, child, [], "FINISHED")
    side = {"question": [], "reference": []}
    for a in answers:
        if a["candidate"] == candidates[0].name:
            side["question"].append(a["question"])
            side["reference"].append(a["reference"])
        side.setdefault(a["candidate"], []).append(a["answer"])
    mlflow.log_table(side, "answers_side_by_side.json", run_id=parent)
    client.log_batch(parent, metrics=[mlflow.entities.Metric(_key(f"{n}/{m}"), v, 0, 0) for n, s in
                                      summary["candidates"].items() for m, v in s["metrics"].items()])  # fmt: skip
    finish_run(cfg.tracking, parent, [out / "report.md", out / "report.json", out / "metrics.png", out / "rejects.jsonl"],
               "FINISHED")  # fmt: skip
    return parent


def _key(name: str) -> str:
    """An MLflow metric name: letters, digits, ``_ - . /`` and spaces."""
    return "".join(ch if ch.isalnum() or ch in "_-./ " else "_" for ch in name)


def _columns(rows: list[dict[str, Any]]) -> dict[str, list]:
    keep = ("row", "source", "question", "reference", "answer", "finish_reason")
    table: dict[str, list] = {k: [r[k] for r in rows] for k in keep}
    for m in rows[0]["scores"] if rows else ():
        table[m] = [r["scores"][m] for r in rows]
    return table
