"""W8A8 quantisation of a causal LM for serving: int8 weights, int8 activations, optional SmoothQuant.

Every ``nn.Linear`` becomes an :class:`Int8Linear`: weights symmetric int8 per output channel, activations
quantised to int8 per token at run time, an int8 x int8 -> int32 matmul, then one rescale. The input
embedding becomes an :class:`Int8Embedding` (int8 rows, one scale per row). A tied embedding and LM head
keep sharing one int8 tensor: the embedding's per-row scale *is* the LM head's per-output-channel scale.

SmoothQuant (Xiao et al., 2023) divides each activation channel by ``s_j = max|X_j|^a / max|W_j|^(1-a)``
and multiplies weight column ``j`` by ``s_j``, moving outliers from activations into weights before both
are quantised. Here ``1/s`` is applied inside each :class:`Int8Linear` rather than folded into the
preceding RMSNorm: a LoRA adapter injected by peft reads the *same* tensor as its base layer, so a
folded norm would feed every adapter ``x/s`` instead of ``x`` (its ``lora_A`` would need rescaling by
``s`` on every adapter load, which ``PeftModel.from_pretrained`` and ``load_adapter`` do not do).
In-module, o_proj and down_proj are smoothed too, unlike the paper: it costs the same one multiply and
none of the folded form's constraints (o_proj's factors shared by the query heads of a KV group and
folded into v_proj, down_proj's into up_proj). On SmolLM2-135M this measured perplexity 9.454 against
9.467 with them left alone (float32: 9.391). The LM head is not smoothed, so a tied one stays shared.

peft injects LoRA on top: :class:`Int8Linear` subclasses ``nn.Linear`` (peft dispatches on that and reads
``in_features``/``out_features``), and its int8 ``weight`` makes peft move adapters between devices
without casting them to the base dtype. Not supported on the quantised base: merging adapters into it
and DoRA (both read ``weight`` as floats).

The int8 matmul is the fastest exact kernel of :data:`INT8_MATMUL_KERNELS` on the CPU it runs on: ``torch._int_mm``
where the CPU has int8 dot-product instructions (VNNI, AMX); without them, for calls of :data:`FEW_ROWS` rows or more,
a float32 matmul of the int8 values, which gives the same numbers (every product and sum is an integer float32 holds
exactly) and is 5-20x faster there from 4 rows, holding no second copy of a weight; for fewer rows (a decode step of
a small batch), raylora's own AVX2 kernel (:mod:`raylora.ops.int8_rows`) where it streams the weights faster.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from raylora.ops.int8_rows import int8_rows, w8a8_rows

METHODS = ("w8a8", "w8a8-smoothquant")
# Linears fed by one tensor share SmoothQuant factors, so the transform stays expressible as a folded
# RMSNorm (the form an export without adapters would use, and the paper's).
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# A row of zeros quantises to zeros with any positive scale; this one keeps the division finite.
_MIN_SCALE = 1e-8
# SmoothQuant's own floor on activation and weight maxima (channels never active in calibration).
_MIN_ABSMAX = 1e-5


def _float_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # Exact while every partial |sum| < 2**24 (always for K <= 1040; beyond, the rounding is ~6e-8 relative, far
    # below int8 quantisation error): the same numbers as an integer kernel, in any order of summation. Works on every
    # device that has a float matmul; the weight's float32 copy lives for the call only.
    return a.float() @ b.float()


# Every kernel that runs and is exact on a probe is a candidate (:func:`int8_matmul_kernel`). torch._int_mm: oneDNN on
# x86 CPUs, fast with VNNI or AMX, 10-50x slower than a float32 matmul without them (an AVX2-only AMD EPYC: 16.6 ms
# against 1.2 ms with the conversion for 64 x 576 -> 960), cuBLASLt on CUDA (there it needs M > 16). raylora's AVX2
# kernel runs on x86 CPUs only, and raises elsewhere (so it is never the first exact kernel on an accelerator).
ROWS_KERNEL = "int8 rows (AVX2)"  # where chosen, a whole linear of few float32 rows runs in w8a8_rows
INT8_MATMUL_KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "torch._int_mm": torch._int_mm,
    "float32 matmul": _float_mm,
    ROWS_KERNEL: int8_rows,
}
# On the CPU, a call with fewer rows uses the kernel fastest at 1 row, others the one fastest at 16 (the float32
# kernel converts the whole weight each call: at 1 row that costs more than the matmul, 69 against 16 ms for
# SmolLM2's LM head on that EPYC).
FEW_ROWS = 4
# The timed probe: a 576-wide model's fused q/k/v projection, timed over a pass through as many such weights as fill
# _PROBE_BYTES, more than most CPUs' last-level cache: a decode step streams every weight from memory, and a kernel
# timed on one weight the cache holds ranked otherwise (torch._int_mm 10 against 17 us at one row on a 2-core EPYC
# with VNNI, but 13.5 against 5.3 ms a pass through SmolLM2's weights: bench/int8_kernel.py).
_PROBE = (576, 960)
_PROBE_BYTES = 64 << 20
_selected: dict[tuple[str, bool], str] = {}  # (device type, fewer than FEW_ROWS rows) -> kernel name


def int8_matmul_kernel(device: torch.device, rows: int = 16) -> str:
    """Name of the int8 matmul kernel for a call of ``rows`` rows on ``device``'s type (chosen once per device type
    and side of :data:`FEW_ROWS`, on first use): of the kernels of :data:`INT8_MATMUL_KERNELS` that run and are exact
    on a probe, the fastest on a timed probe (1 or 16 rows) on the CPU, the first elsewhere (timing an accelerator
    needs its own synchronisation, and its first exact kernel is its integer one). Every candidate gives the same
    numbers, so the choice changes speed only.

    Raises:
        RuntimeError: no kernel of :data:`INT8_MATMUL_KERNELS` runs on this device.
    """
    key = (device.type, rows < FEW_ROWS)
    if key in _selected:
        return _selected[key]
    failures, exact = [], []
    gen = torch.Generator().manual_seed(0)
    for name, kernel in INT8_MATMUL_KERNELS.items():
        problem = _probe_failure(kernel, device, gen)
        if problem:
            failures.append(f"{name}: {problem}")
        else:
            exact.append(name)
    if not exact:
        raise RuntimeError(
            f"No int8 matmul kernel runs on {device.type}: {'; '.join(failures)}. "
            f"Supported kernels, in order: {', '.join(INT8_MATMUL_KERNELS)}; quantise for a device where one runs."
        )
    if device.type == "cpu" and len(exact) > 1:
        weights = _probe_weights()
        exact.sort(key=lambda name: _pass_seconds(INT8_MATMUL_KERNELS[name], 1 if key[1] else 16, gen, weights))
    _selected[key] = exact[0]
    return exact[0]


def _probe_failure(kernel, device: torch.device, gen: torch.Generator) -> str | None:
    """Why ``kernel`` cannot serve on ``device`` (it fails, or is not exact on a probe), or None."""
    # M = 1 (decode) and M = 17 (prefill) cover the shape rules kernels have (cuBLASLt wants M > 16).
    for m in (1, 17):
        a = torch.randint(-127, 128, (m, 64), dtype=torch.int8, generator=gen).to(device)
        b = torch.randint(-127, 128, (32, 64), dtype=torch.int8, generator=gen).to(device)
        try:
            out = kernel(a, b.t())
        except (RuntimeError, NotImplementedError) as exc:
            return str(exc).splitlines()[0]
        if not torch.equal(out.cpu().to(torch.int32), a.cpu().int() @ b.cpu().int().t()):
            return "wrong result on a probe"
    return None


def _probe_weights() -> list[torch.Tensor]:
    """Weights of :data:`_PROBE`'s shape filling :data:`_PROBE_BYTES` (their values do not change a kernel's time)."""
    k, n = _PROBE
    block = torch.ones(_PROBE_BYTES // (k * n) * n, k, dtype=torch.int8)
    return list(block.split(n))


def _pass_seconds(kernel, rows: int, gen: torch.Generator, weights: list[torch.Tensor], repeats: int = 3) -> float:
    """Best of ``repeats`` timings of ``kernel`` on ``rows`` rows through every one of ``weights``, in turn."""
    a = torch.randint(-127, 128, (rows, weights[0].shape[1]), dtype=torch.int8, generator=gen)
    kernel(a, weights[0].t())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            kernel(a, w.t())
        best = min(best, time.perf_counter() - start)
    return best


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantisation with one scale per row.

    Args:
        weight: ``(rows, cols)`` float tensor (an ``nn.Linear`` weight is ``(out_features, in_features)``).
    Returns:
        ``(q, scale)``: ``q`` int8 ``(rows, cols)`` in [-127, 127], ``scale`` float32 ``(rows,)`` with
        ``weight ~= q * scale[:, None]``.
    """
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(_MIN_SCALE) / 127
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric dynamic int8 quantisation with one scale per row (token).

    Args:
        x: ``(tokens, features)`` float32.
    Returns:
        ``(q, scale)``: ``q`` int8 ``(tokens, features)``, ``scale`` float32 ``(tokens, 1)``.
    """
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min_(_MIN_SCALE).div_(127)
    # |x / scale| <= 127 by construction, so rounding needs no clamp.
    return (x / scale).round_().to(torch.int8), scale


def w8a8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    smooth: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + b`` with int8 weights and per-token int8 activations, on the selected int8 kernel.

    Args:
        x: ``(tokens, in_features)`` float (any float dtype; quantised in float32).
        weight: int8 ``(out_features, in_features)``.
        weight_scale: ``(out_features,)`` per-output-channel scale.
        bias: ``(out_features,)`` or None.
        smooth: ``(in_features,)`` SmoothQuant input multiplier ``1/s``, or None.
    Returns:
        ``(tokens, out_features)`` in ``x.dtype``.
    """
    if (
        x.shape[0] < FEW_ROWS
        and x.device.type == "cpu"
        and x.dtype == weight_scale.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and int8_matmul_kernel(x.device, x.shape[0]) == ROWS_KERNEL
    ):
        return w8a8_rows(x, weight, weight_scale, bias, smooth)  # the same steps in one call
    xf = x.float()
    if smooth is not None:
        xf = xf * smooth
    xq, x_scale = quantize_per_token(xf)
    acc = INT8_MATMUL_KERNELS[int8_matmul_kernel(x.device, xq.shape[0])](xq, weight.t())
    # Casting first keeps the two multiplies on same-dtype (vectorised) paths; int32 * float32 is not.
    out = acc.to(torch.float32).mul_(x_scale).mul_(weight_scale)
    if bias is not None:
        out = out.add_(bias)
    return out.to(x.dtype)


def w8a8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    smooth: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch reference of :func:`w8a8_linear`: quantise, dequantise, float64 matmul.

    Same arguments, shapes and result as :func:`w8a8_linear`; every intermediate is spelled out.
    """
    xf = x.double()
    if smooth is not None:
        xf = xf * smooth.double()
    x_scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(_MIN_SCALE) / 127
    xq = torch.clamp(torch.round(xf / x_scale), -127, 127)
    w = weight.double() * weight_scale.double()[:, None]
    out = (xq * x_scale) @ w.t()
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)


class Int8Linear(nn.Linear):
    """W8A8 drop-in for ``nn.Linear`` (see module docs); peft wraps it like any ``nn.Linear``.

    Build one with :meth:`from_linear`; the constructor takes already-quantised tensors.

    Args:
        weight: int8 ``(out_features, in_features)``, or an int8 Parameter to share (a tied LM head).
        weight_scale: ``(out_features,)`` per-output-channel scale, in the original weight's float dtype.
        bias: ``(out_features,)`` or None.
        smooth: ``(in_features,)`` float32 SmoothQuant input multiplier ``1/s``, or None.
    """

    def __init__(
        self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, smooth: torch.Tensor | None
    ):
        # The meta device skips allocating and initialising a float weight that is replaced at once.
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        # A tied LM head passes the embedding's own Parameter: one tensor, held once.
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("smooth", smooth)

    @classmethod
    def from_linear(cls, linear: nn.Linear, smooth_factor: torch.Tensor | None = None) -> Int8Linear:
        """Quantise ``linear``; with ``smooth_factor`` ``s`` ``(in_features,)``, quantise ``W * s`` and feed ``x / s``."""
        w = linear.weight.detach().float()
        smooth = None
        if smooth_factor is not None:
            w = w * smooth_factor
            smooth = (1.0 / smooth_factor).float()
        q, scale = quantize_per_channel(w)
        return cls(q, scale.to(linear.weight.dtype), linear.bias, smooth)

    fused: SharedInput | None = None  # set by fuse_shared_inputs(): this layer's rows of its group's one matmul
    member: int = 0  # its place in that group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., in_features)`` float -> ``(..., out_features)`` in ``x.dtype``."""
        if self.fused is not None:
            return self.fused.output(self.member, x)
        out = w8a8_linear(x.reshape(-1, self.in_features), self.weight, self.weight_scale, self.bias, self.smooth)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, int8, smoothed={self.smooth is not None}"


class SharedInput:
    """One int8 matmul for the linears of a :data:`SHARED_INPUT_GROUPS` group (q, k and v; gate and up), which read
    the same tensor with the same SmoothQuant factors: the first member called computes every member's output (one
    quantisation of the input, one matmul over the concatenated weights) and each other member takes its columns
    when called with that same tensor. Integer products are exact and the rescale is per output channel, so each
    output is bitwise what the member alone would give; a member called with another tensor computes it again.

    Args:
        members: the group's layers; their weights become row slices of one concatenated tensor (no extra memory).
    """

    def __init__(self, members: list[Int8Linear]):
        first = members[0]
        self.weight = torch.cat([m.weight.detach() for m in members])
        self.weight_scale = torch.cat([m.weight_scale for m in members])
        self.bias = None if first.bias is None else torch.cat([m.bias.detach() for m in members])
        self.smooth, self.in_features = first.smooth, first.in_features
        self.splits = [m.out_features for m in members]
        start = 0
        for i, m in enumerate(members):
            m.weight = nn.Parameter(self.weight[start : start + m.out_features], requires_grad=False)
            m.weight_scale = self.weight_scale[start : start + m.out_features]
            m.fused, m.member = self, i
            start += m.out_features
        self._input: torch.Tensor | None = None
        self._outputs: dict[int, torch.Tensor] = {}

    def output(self, member: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``member``'s ``(..., out_features)`` output for ``x``."""
        held = self._input
        if held is not x or member not in self._outputs:  # held: the input of the outputs not yet taken
            out = w8a8_linear(x.reshape(-1, self.in_features), self.weight, self.weight_scale, self.bias, self.smooth)
            parts = out.reshape(*x.shape[:-1], out.shape[-1]).split(self.splits, dim=-1)
            self._outputs, self._input = dict(enumerate(parts)), x
        out = self._outputs.pop(member)
        if not self._outputs:
            self._input = None  # every member has its part: hold nothing between forward passes
        return out


def fuse_shared_inputs(model: nn.Module) -> int:
    """Give each :data:`SHARED_INPUT_GROUPS` group of a quantised ``model``'s int8 linears one matmul
    (:class:`SharedInput`); call it once the model is on its device. Returns the number of groups fused."""
    fused = 0
    for parent in model.modules():
        for group in SHARED_INPUT_GROUPS:
            members = [getattr(parent, name, None) for name in group]
            if not all(type(m) is Int8Linear and m.fused is None for m in members):
                continue
            first = members[0]
            if all(_same_input(m, first) for m in members):
                SharedInput(members)
                fused += 1
    return fused


def _same_input(a: Int8Linear, b: Int8Linear) -> bool:
    """Whether ``a`` and ``b`` can share one matmul: the same input width and SmoothQuant factors, both with or both
    without a bias."""
    same_smooth = a.smooth is b.smooth or (
        a.smooth is not None and b.smooth is not None and torch.equal(a.smooth, b.smooth)
    )
    return a.in_features == b.in_features and (a.bias is None) == (b.bias is None) and same_smooth


class Int8Embedding(nn.Embedding):
    """``nn.Embedding`` with int8 rows and one scale per row; returns rows in the scale's dtype.

    Args:
        weight: int8 ``(num_embeddings, embedding_dim)`` from :func:`quantize_per_channel`.
        weight_scale: ``(num_embeddings,)`` per-row scale, in the original weight's float dtype.
        padding_idx: as in ``nn.Embedding``.
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, padding_idx: int | None):
        super().__init__(weight.shape[0], weight.shape[1], padding_idx=padding_idx, device="meta")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("weight_scale", weight_scale)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``(...)`` token ids -> ``(..., embedding_dim)``."""
        rows = F.embedding(input_ids, self.weight).to(self.weight_scale.dtype)
        return rows * self.weight_scale[input_ids].unsqueeze(-1)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every distinct tensor in ``model.state_dict()``: parameters and persistent buffers.

    That is the weights, their scales and SmoothQuant factors, and adapters if any; tied tensors count
    once; non-persistent buffers (rotary frequencies) are not weights and are left out.
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in model.state_dict(keep_vars=True).values():
        key = (t.data_ptr(), t.nbytes)
        if key not in seen:
            seen.add(key)
            total += t.nbytes
    return total


def activation_absmax(model: nn.Module, calibration: list[torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """Per-input-channel ``max |x|`` at each named linear, over every token of the calibration sequences.

    Args:
        model: a Hugging Face causal LM; only its decoder (``get_decoder()``) runs, so no logits are made.
        calibration: 1-D LongTensors of token ids, each run alone (no padding).
        names: module names of the ``nn.Linear`` layers to observe.
    Returns:
        name -> float32 ``(in_features,)``.
    """
    absmax: dict[str, torch.Tensor] = {}

    def observe(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            seen = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
            absmax[name] = seen if name not in absmax else torch.maximum(absmax[name], seen)

        return hook

    handles = [model.get_submodule(n).register_forward_pre_hook(observe(n)) for n in names]
    try:
        decoder = model.get_decoder()
        with torch.inference_mode():
            for ids in calibration:
                decoder(input_ids=ids.reshape(1, -1).to(model.device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return absmax


def smoothquant_factors(
    model: nn.Module, calibration: list[torch.Tensor], alpha: float = 0.5
) -> dict[str, torch.Tensor]:
    """SmoothQuant factors ``s`` for every decoder linear (all ``nn.Linear`` but the output embedding).

    ``s_j = max|X_j|^alpha / max|W_j|^(1-alpha)``; linears of one :data:`SHARED_INPUT_GROUPS` group under the
    same parent (q/k/v, gate/up) get one shared ``s``, with ``max|W_j|`` taken over all of their weights.

    Args:
        model: a Hugging Face causal LM, unquantised.
        calibration: 1-D LongTensors of token ids.
        alpha: migration strength in [0, 1]; 0.5 balances activation and weight ranges.
    Returns:
        module name -> float32 ``(in_features,)``, all positive.
    """
    names = _linear_names(model, include_head=False)
    act = activation_absmax(model, calibration, names)
    groups: dict[str, list[str]] = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        key = next((f"{parent}.{'+'.join(g)}" for g in SHARED_INPUT_GROUPS if leaf in g), name)
        groups.setdefault(key, []).append(name)
    factors = {}
    for members in groups.values():
        x_max = torch.stack([act[n] for n in members]).amax(dim=0).clamp_min(_MIN_ABSMAX)
        w_max = torch.stack([_weight_col_absmax(model.get_submodule(n)) for n in members]).amax(dim=0)
        s = (x_max.pow(alpha) / w_max.clamp_min(_MIN_ABSMAX).pow(1 - alpha)).clamp_min(_MIN_ABSMAX)
        factors.update(dict.fromkeys(members, s))
    return factors


def quantize_model(
    model: nn.Module, method: str, calibration: list[torch.Tensor] | None = None, alpha: float = 0.5
) -> dict:
    """Quantise a Hugging Face causal LM in place for serving (load LoRA adapters afterwards).

    Every ``nn.Linear`` (decoder and LM head) becomes an :class:`Int8Linear`, the input embedding an
    :class:`Int8Embedding`; a tied LM head shares the embedding's int8 weight and scales.

    Args:
        model: an unquantised model without adapters, in float32, bfloat16 or float16.
        method: ``"w8a8"``, or ``"w8a8-smoothquant"`` (needs ``calibration``; the LM head is not smoothed,
            so a tied one keeps sharing the embedding's int8 tensor).
        calibration: 1-D LongTensors of token ids for SmoothQuant; each is run alone.
        alpha: SmoothQuant migration strength in [0, 1].
    Returns:
        ``{"method", "alpha", "linear_layers", "embedding", "tied_head", "kernel", "bytes_before", "bytes_after",
        "ratio"}``; ``alpha`` is None without SmoothQuant, ``kernel`` names the int8 matmuls used.
    Raises:
        ValueError: unknown method, missing or malformed calibration, alpha outside [0, 1], or the model
            already holds adapters or int8 layers.
    """
    _check_args(model, method, calibration, alpha)
    before = weight_bytes(model)
    factors = smoothquant_factors(model, calibration, alpha) if method == "w8a8-smoothquant" else {}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = isinstance(embedding, nn.Embedding) and head is not None and head.weight is embedding.weight
    if isinstance(embedding, nn.Embedding):
        q, scale = quantize_per_channel(embedding.weight)
        int8_embedding = Int8Embedding(q, scale.to(embedding.weight.dtype), embedding.padding_idx)
        model.set_input_embeddings(int8_embedding)
    names = _linear_names(model, include_head=True)
    for name in names:
        linear = model.get_submodule(name)
        if tied and linear is head:
            new = Int8Linear(int8_embedding.weight, int8_embedding.weight_scale, linear.bias, None)
        else:
            new = Int8Linear.from_linear(linear, factors.get(name))
        model.set_submodule(name, new)
    device = next(model.parameters()).device
    after = weight_bytes(model)
    return {
        "method": method,
        "alpha": alpha if factors else None,
        "linear_layers": len(names),
        "embedding": isinstance(embedding, nn.Embedding),
        "tied_head": tied,
        "kernel": _kernels(device),
        "bytes_before": before,
        "bytes_after": after,
        "ratio": after / before,
    }


def _kernels(device: torch.device) -> str:
    few, many = int8_matmul_kernel(device, 1), int8_matmul_kernel(device, FEW_ROWS)
    return many if few == many else f"{few} below {FEW_ROWS} rows, {many} from {FEW_ROWS}"


def _linear_names(model: nn.Module, include_head: bool) -> list[str]:
    head = model.get_output_embeddings()
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and not isinstance(m, Int8Linear) and (include_head or m is not head)
    ]


def _weight_col_absmax(linear: nn.Linear) -> torch.Tensor:
    return linear.weight.detach().float().abs().amax(dim=0)


def _check_args(model: nn.Module, method: str, calibration: list[torch.Tensor] | None, alpha: float) -> None:
    if method not in METHODS:
        raise ValueError(f"quantize_model: unknown method {method!r}; expected one of {', '.join(METHODS)}.")
    if any(type(m).__module__.startswith("peft.") for m in model.modules()):
        raise ValueError(
            "quantize_model: the model already holds peft adapters; quantise the base model first, then load "
            "adapters with PeftModel.from_pretrained."
        )
    if any(isinstance(m, (Int8Linear, Int8Embedding)) for m in model.modules()):
        raise ValueError("quantize_model: the model is already quantised; load a fresh copy to quantise again.")
    if method == "w8a8-smoothquant":
        if not calibration:
            raise ValueError(
                "quantize_model: w8a8-smoothquant needs calibration, a non-empty list of 1-D LongTensors of token "
                "ids (a few dozen representative rows); got none. Pass calibration=... or use method='w8a8'."
            )
        bad = [i for i, t in enumerate(calibration) if t.ndim != 1 or t.dtype != torch.long or t.numel() == 0]
        if bad:
            raise ValueError(
                f"quantize_model: calibration rows {bad[:5]} are not non-empty 1-D LongTensors of token ids; "
                "pass each row as tokenizer(text, return_tensors='pt').input_ids[0]."
            )
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"quantize_model: alpha={alpha} is outside [0, 1]; the paper's default is 0.5.")
