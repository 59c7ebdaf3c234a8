"""Quantising a loaded base model in place for serving or export, calibrated on the job's own data."""

from __future__ import annotations

import torch

from raylora.config import JobConfig
from raylora.data.sources import sample_token_ids
from raylora.ops.int8 import quantize_model


def quantize(model, tokenizer, cfg: JobConfig, method: str) -> dict:
    """Quantise ``model`` in place (``w8a8`` or ``w8a8-smoothquant``, alpha ``serve.smoothquant_alpha``).

    SmoothQuant calibrates on the first ``serve.calibration_rows`` conversations of ``data.sources``,
    rendered with the chat template as at serving time.
    Returns:
        :func:`raylora.ops.int8.quantize_model`'s summary.
    Raises:
        ValueError: SmoothQuant without data.sources.
    """
    calibration = None
    if method == "w8a8-smoothquant":
        if not cfg.data.sources:
            raise ValueError(f"quantization {method} calibrates on data.sources, which is empty: name a data file")
        ids = sample_token_ids(cfg.data, tokenizer, cfg.serve.calibration_rows, objective=cfg.train.objective)
        calibration = [torch.tensor(x) for x in ids if x]
    return quantize_model(model, method, calibration, cfg.serve.smoothquant_alpha)
