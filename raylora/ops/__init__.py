"""Ops with a plain-PyTorch reference each: W8A8 model quantisation (``int8``), 4-bit LoRA storage (``int4``)."""

from raylora.ops.int4 import Int4Linear, quantize_adapter
from raylora.ops.int8 import Int8Embedding, Int8Linear, quantize_model, weight_bytes

__all__ = ["Int4Linear", "Int8Embedding", "Int8Linear", "quantize_adapter", "quantize_model", "weight_bytes"]
