"""How far will a LoRA job scale, and does gradient compression help? ``raylora plan CONFIG --cards ...``.

Data parallel: every card holds the whole model and its LoRA, and one optimizer step is

    step(n)    = compute + exposed(n)                        efficiency(n) = compute / step(n)
    compute    = 4 N T / (peak * mfu)                        N: frozen base parameters, T: tokens per card per step
                 (a frozen base needs no weight gradients: 2N forward, 2N backward per token); ``peak`` is the
                 target card's dense bf16 matmul rate (the link preset), ``mfu`` the share of it a LoRA step
                 reaches, measured on this machine by :func:`measure_mfu` (or given)
    exposed(n) = comm / B + max(0, comm (B - 1) / B - backward)
                 DDP all-reduces a bucket as soon as its gradients are ready, so all but the last of the B
                 buckets can hide behind the rest of the last micro-step's backward (half its compute); LoRA's
                 gradients usually fill one bucket, which then hides nothing.

Collectives, for a payload of P bytes per card over n cards in nodes of p cards (m = n / p nodes), each
hop costing ``bytes / bandwidth + latency``:
    all-reduce, one node:   2 (n-1)/n P / bw_intra + 2 (n-1) lat_intra                       (ring)
    all-reduce, m nodes:    2 (p-1)/p P / bw_intra + 2 (p-1) lat_intra                        (hierarchical:
                            + 2 (m-1)/m (P/p) / bw_inter + 2 (m-1) lat_inter                    reduce-scatter in the
                                                                                                node, ring across
                                                                                                nodes, all-gather)
    all-gather (topk, sign, hadamard3): (n-1) P / bw + (n-1) lat, over bw_inter as soon as n > p (each card receives
                            every other card's selection: it grows with n, an all-reduce does not)
Payloads come from the real model and LoRA config, built on the meta device (never hand-entered sizes):
``none`` 4 bytes a LoRA entry, ``fp16``/``bf16`` 2, ``powersgd`` 4 (rows + cols) r per LoRA matrix,
``topk`` 8 per sent entry (values and int32 indices), ``sign`` 1/8 per entry and 4 per tensor, ``hadamard3``
3/8 per entry and 2 per 128 entries (whole blocks): the same counts
``raylora.comm.bytes`` measures during training. Assumptions: the presets' bandwidths are sustained bus
bandwidths (what nccl-tests / hccl_test call busbw), not link peaks; no congestion across nodes; the MFU of a
step carries over from this machine to the target card; the hooks' own compute is not counted.
"""

from __future__ import annotations

import math
import time

import torch

from raylora.comm.links import PRESETS as PRESETS  # re-exported: the presets live where the CLI reads them cheaply
from raylora.comm.links import Link
from raylora.config import JobConfig
from raylora.models import attach_lora, load_model, model_skeleton

HOOKS = ("none", "fp16", "bf16", "powersgd", "topk", "sign", "hadamard3")


def model_shapes(cfg: JobConfig) -> tuple[int, list[tuple[int, ...]]]:
    """``(frozen base parameters, shapes of the trainable LoRA tensors)`` of the job's model, built on the meta device."""
    model = attach_lora(model_skeleton(cfg.model), cfg.lora)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return frozen, [tuple(p.shape) for p in model.parameters() if p.requires_grad]


def payload(shapes: list[tuple[int, ...]], hook: str, cfg: JobConfig) -> tuple[float, str]:
    """``(bytes each card hands to the collective per step, "all_reduce" or "all_gather")`` for ``hook``."""
    entries = sum(math.prod(s) for s in shapes)
    if hook == "none":
        return 4.0 * entries, "all_reduce"
    if hook in ("fp16", "bf16"):
        return 2.0 * entries, "all_reduce"
    if hook == "powersgd":
        r = cfg.train.powersgd_rank
        return 4.0 * sum((s[0] + math.prod(s[1:])) * min(r, *s) for s in shapes), "all_reduce"
    if hook == "topk":
        return 8.0 * max(1, round(cfg.train.topk_fraction * entries)), "all_gather"
    if hook == "sign":
        return math.ceil(entries / 8) + 4.0 * len(shapes), "all_gather"
    return 50.0 * math.ceil(entries / 128), "all_gather"  # hadamard3, as one bucket: 48 bytes of codes, 2 of scale


def collective_s(nbytes: float, kind: str, cards: int, link: Link) -> float:
    """Seconds of one collective of ``nbytes`` per card over ``cards`` cards (formulas in the module docstring)."""
    if cards == 1:
        return 0.0
    intra_bw, inter_bw = link.intra_gbs * 1e9, link.inter_gbs * 1e9
    intra_lat, inter_lat = link.intra_latency_us * 1e-6, link.inter_latency_us * 1e-6
    if kind == "all_gather":
        bw, lat = (intra_bw, intra_lat) if cards <= link.cards_per_node else (inter_bw, inter_lat)
        return (cards - 1) * (nbytes / bw + lat)
    if cards <= link.cards_per_node:
        return 2 * (cards - 1) * (nbytes / cards / intra_bw + intra_lat)
    p, m = link.cards_per_node, math.ceil(cards / link.cards_per_node)
    node = 2 * (p - 1) * (nbytes / p / intra_bw + intra_lat)
    return node + 2 * (m - 1) * (nbytes / p / m / inter_bw + inter_lat)


def predict(cfg: JobConfig, cards: list[int], link: Link, mfu: float, hooks=HOOKS) -> list[dict]:
    """One row per (hook, card count): compute, communication and exposed seconds, step time and efficiency."""
    frozen, shapes = model_shapes(cfg)
    tokens = cfg.train.batch_size * cfg.data.cutoff_len * cfg.train.grad_accum
    compute = 4 * frozen * tokens / (link.peak_tflops * 1e12 * mfu)
    backward = compute / cfg.train.grad_accum / 2
    buckets = max(1, math.ceil(4 * sum(math.prod(s) for s in shapes) / (cfg.train.bucket_mb * 2**20)))
    rows = []
    for hook in hooks:
        nbytes, kind = payload(shapes, hook, cfg)
        for n in cards:
            comm = collective_s(nbytes, kind, n, link)
            exposed = comm / buckets + max(0.0, comm * (buckets - 1) / buckets - backward)
            rows.append({"hook": hook, "cards": n, "payload_bytes": nbytes, "compute_s": compute, "comm_s": comm,
                         "exposed_s": exposed, "step_s": compute + exposed, "efficiency": compute / (compute + exposed)})  # fmt: skip
    return rows


def measure_mfu(cfg: JobConfig, seconds: float = 3.0) -> float:
    """The share of this machine's matmul peak that a LoRA training step of the job's model reaches.

    The peak is a square fp32 GEMM timed here; the step is forward and backward of one sequence of
    ``min(data.cutoff_len, 256)`` tokens, best of the runs that fit in ``seconds``.
    """
    model = attach_lora(load_model(cfg.model)[0], cfg.lora).train()
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    tokens = min(cfg.data.cutoff_len, 256)
    ids = torch.randint(3, model.config.vocab_size, (1, tokens))
    step = _best(lambda: model(input_ids=ids, labels=ids).loss.backward(), seconds)
    a = torch.randn(1024, 1024)
    peak = 2 * 1024**3 / _best(lambda: a @ a, seconds / 3)
    return 4 * frozen * tokens / step / peak


def _best(fn, seconds: float) -> float:
    fn()  # warm-up
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == float("inf"):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def table(rows: list[dict]) -> str:
    """The prediction as a Markdown table: one row per card count, a column pair per hook."""
    hooks = list(dict.fromkeys(r["hook"] for r in rows))
    cards = list(dict.fromkeys(r["cards"] for r in rows))
    at = {(r["hook"], r["cards"]): r for r in rows}
    head = "| cards | " + " | ".join(f"{h}: step ms (exposed comm ms), efficiency" for h in hooks) + " |"
    lines = [head, "|---" * (len(hooks) + 1) + "|"]
    for n in cards:
        cells = [f"{1e3 * at[h, n]['step_s']:.1f} ({1e3 * at[h, n]['exposed_s']:.2f}), {at[h, n]['efficiency']:.3f}"
                 for h in hooks]  # fmt: skip
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(rows: list[dict], path, title: str) -> None:
    """A PNG of scaling efficiency against cards, one line per hook."""
    # here, not at the top: pyplot must be imported after the Agg backend is chosen, which only drawing a chart
    # does (importing this module leaves the process's backend alone); matplotlib + pyplot cost about 0.4 s
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use("Agg"), see above

    fig, ax = plt.subplots(figsize=(7, 4))
    for hook in dict.fromkeys(r["hook"] for r in rows):
        mine = [r for r in rows if r["hook"] == hook]
        ax.plot([r["cards"] for r in mine], [r["efficiency"] for r in mine], marker="o", label=hook)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cards")
    ax.set_ylabel("scaling efficiency")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
