"""A small generation eval during training (``train.generate_eval_every``): the adapter being trained answers the first
``train.generate_eval_rows`` rows of the eval set through the serving engine, scored with ``eval.metrics`` as
``raylora eval`` scores them, logged as ``gen_<metric>`` beside the step's other metrics.

The driver reads the rows once (:func:`training_rows`, the eval set ``raylora eval`` reads: ``eval.sources``, else the
held-out split) and hands them to the workers; rank 0 answers them (:func:`generation_scores`) between two steps, with
the model in eval mode and the adapters as they are, while the other ranks wait at the next step's collective. A
shared-base group answers for all its members due at once: their rows decode together, each with its own adapter.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

from raylora.config import ConfigError, JobConfig
from raylora.eval.generate import eval_request
from raylora.eval.metrics import means, score_row
from raylora.eval.run import check_eval
from raylora.generation import answer_all


def training_rows(cfg: JobConfig) -> list[dict[str, Any]]:
    """The rows a run's generation evals answer, as plain dicts (they travel in the workers' config); none when
    ``train.generate_eval_every`` is 0.

    Raises:
        ConfigError: the eval set cannot be read or holds no row with a reference, or a metric is unknown.
    """
    if not cfg.train.generate_eval_every:
        return []
    _, rows, _ = check_eval(cfg, "train.generate_eval_every", with_candidates=False)
    if not rows:
        raise ConfigError([("train.generate_eval_every", "the eval set holds no row to answer")], "the job")
    return [dataclasses.asdict(r) for r in rows[: cfg.train.generate_eval_rows]]


def generation_scores(
    model, tokenizer, rows: list[dict[str, Any]], cfg: JobConfig,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext, adapters: tuple[str, ...] = ("default",),
) -> dict[str, dict[str, float]]:  # fmt: skip
    """Each of ``adapters``' (of the peft ``model``) mean ``eval.metrics`` over ``rows``, as
    ``{adapter: {"gen_<metric>": value}}``; the model is in eval mode while it answers and back in its mode after."""
    e = cfg.eval
    reqs = [eval_request(r["prompt_ids"], adapter, e) for adapter in adapters for r in rows]
    training = model.training
    model.eval()
    try:
        events = answer_all(model, tokenizer, reqs, autocast)
    finally:
        model.train(training)
    metrics = [m for m in e.metrics if m not in ("reference_loss", "judge")]
    scored = [
        {"candidate": adapter, "source": r["source"],
         "scores": score_row(ev.text, r["reference"], r["calls"], r["tools"], r["keys"], ev.completion_tokens, metrics)}
        for (adapter, r), ev in zip(((a, r) for a in adapters for r in rows), events, strict=True)
    ]  # fmt: skip
    per = means(scored, metrics)
    return {a: {f"gen_{m}": v for m, v in per[a]["metrics"].items()} for a in adapters}
