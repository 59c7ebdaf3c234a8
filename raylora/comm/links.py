"""The cluster link presets of ``raylora plan`` (``--link-preset``): cards per node, link bandwidths and latencies, and
the card's peak. Kept apart from :mod:`raylora.comm.plan` and free of torch, so the CLI's parser lists the presets
without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A cluster's cards and links. Bandwidths in GB/s (sustained bus bandwidth), latencies in microseconds."""

    cards_per_node: int
    intra_gbs: float
    inter_gbs: float
    intra_latency_us: float
    inter_latency_us: float
    peak_tflops: float


PRESETS = {
    # 8 x Ascend 910B (HCCS full mesh in the node), one 200 GbE RoCE port per card; 313 TFLOPS fp16/bf16 (910B3)
    "atlas800t-a2": Link(8, 150.0, 22.0, 10.0, 20.0, 313.0),
    # 8 x H100 SXM (NVLink 4 through NVSwitch), one 400 Gb/s NDR InfiniBand port per GPU; 989 TFLOPS dense bf16
    "h100-ib": Link(8, 360.0, 45.0, 5.0, 10.0, 989.0),
    # 8 x A100 SXM (NVLink 3), one 200 Gb/s HDR InfiniBand port per GPU; 312 TFLOPS dense bf16
    "a100-ib": Link(8, 230.0, 22.0, 5.0, 10.0, 312.0),
}
