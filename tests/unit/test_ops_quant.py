"""Parity of raylora.ops.int8 (W8A8, SmoothQuant) and raylora.ops.int4 (4-bit LoRA storage) on tiny random models.

Tolerances, measured on these models and kept with a margin:
- int8 kernels: bit-exact against an int32 matmul.
- w8a8_linear against its float64 reference: relative error < 1e-5 (float32 rounding only);
  against the float32 linear: relative error < 2% (int8 quantisation of weights and activations, 1.3% seen).
- SmoothQuant without quantisation: logits equal the original model's to 1e-5 relative.
- quantised model logits against float32 (llama and qwen2, with and without SmoothQuant): cosine > 0.999
  (0.9995-0.9997 seen), relative error < 5% (2.6-3.2% seen).
- LoRA on the quantised base: the adapter's effect on the logits matches float32's, cosine > 0.99 (0.9986 seen);
  held as int4, cosine > 0.98 to its float32 effect (0.993 seen).
- int4: representable values round-trip exactly; any value is within half a step of its group's scale.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

import raylora.ops.int8
from raylora.models import tiny_model
from raylora.ops import Int4Linear, Int8Embedding, Int8Linear, int8_rows, quantize_adapter, quantize_model, weight_bytes
from raylora.ops.int4 import int4_roundtrip_reference, pack_int4, unpack_int4
from raylora.ops.int8 import (
    FEW_ROWS,
    INT8_MATMUL_KERNELS,
    ROWS_KERNEL,
    _float_mm,
    fuse_shared_inputs,
    int8_matmul_kernel,
    quantize_per_channel,
    quantize_per_token,
    smoothquant_factors,
    w8a8_linear,
    w8a8_linear_reference,
)

IDS = torch.randint(3, 250, (3, 10), generator=torch.Generator().manual_seed(0))
CALIBRATION = [torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(n)) for n in (12, 17, 24, 9)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def logits(model: nn.Module, ids: torch.Tensor = IDS, **kwargs) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, **kwargs).logits


@pytest.fixture(scope="module")
def base() -> nn.Module:
    return tiny_model("llama").eval()


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict:
    """Two saved LoRA adapters (random A and B, so each visibly changes the logits), trained on no data."""
    out = {}
    for seed, name in ((1, "a"), (2, "b")):
        torch.manual_seed(seed)
        config = LoraConfig(
            r=8, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
        )
        model = get_peft_model(copy.deepcopy(base), config)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = path
    return out


@pytest.fixture(scope="module")
def smoothed(base) -> nn.Module:
    model = copy.deepcopy(base)
    quantize_model(model, "w8a8-smoothquant", CALIBRATION)
    return model


@pytest.mark.parametrize("shape", [(1, 64, 32), (7, 576, 192), (33, 130, 50)])
def test_int8_kernels_are_exact(shape):
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    a[0, :2], w[0, :2] = -127, torch.tensor([127, -127])  # the extremes: maddubs's pairs must not saturate
    expected = a.int() @ w.int().t()
    for name, kernel in INT8_MATMUL_KERNELS.items():
        if name == ROWS_KERNEL and int8_rows.unavailable():  # no C compiler, or not an x86 CPU with AVX2
            with pytest.raises(RuntimeError, match=int8_rows.unavailable()):
                kernel(a, w.t())
            continue
        assert torch.equal(kernel(a, w.t()).to(torch.int32), expected), name
    assert {int8_matmul_kernel(torch.device("cpu"), rows) for rows in (1, 64)} <= set(INT8_MATMUL_KERNELS)


def test_the_cpu_uses_the_fastest_exact_kernel_for_few_rows_and_for_many(monkeypatch):
    """Found on an AVX2-only AMD EPYC: torch._int_mm (oneDNN without VNNI) ran 10-50x slower than a float32 matmul of
    the same int8 values, and was chosen for being first. Timed at 1 row and at 16, each choice kept for its side of
    FEW_ROWS; a fast kernel that is not exact is never chosen. Each is timed on a pass through 64 MB of weights (121
    calls); the slow side sleeps 2 ms a call, 0.24 s a pass, 6x the slowest real kernel's pass (with 2 ms a call
    and one call timed, a loaded machine once timed torch._int_mm at one row slower than that)."""

    def slow_at_many_rows(a, b):
        time.sleep(0.002 if a.shape[0] >= FEW_ROWS else 0)
        return torch._int_mm(a, b)

    def slow_at_one_row(a, b):
        time.sleep(0.002 if a.shape[0] < FEW_ROWS else 0)
        return _float_mm(a, b)

    def inexact(a, b):
        return torch._int_mm(a, b) + 1

    exact = {"int": slow_at_many_rows, "float": slow_at_one_row}
    for kernels in ({"fast but wrong": inexact, **exact}, exact):
        monkeypatch.setattr(raylora.ops.int8, "INT8_MATMUL_KERNELS", kernels)
        monkeypatch.setattr(raylora.ops.int8, "_selected", {})
        cpu = torch.device("cpu")
        assert [int8_matmul_kernel(cpu, rows) for rows in (1, FEW_ROWS - 1, FEW_ROWS, 64)] == ["int"] * 2 + [
            "float"
        ] * 2
        assert raylora.ops.int8._kernels(cpu) == f"int below {FEW_ROWS} rows, float from {FEW_ROWS}"
    monkeypatch.setattr(raylora.ops.int8, "INT8_MATMUL_KERNELS", {"wrong": inexact})
    monkeypatch.setattr(raylora.ops.int8, "_selected", {})
    with pytest.raises(RuntimeError, match="No int8 matmul kernel runs on cpu: wrong: wrong result on a probe"):
        int8_matmul_kernel(torch.device("cpu"))


@pytest.mark.skipif(bool(int8_rows.unavailable()), reason=f"raylora's AVX2 kernel: {int8_rows.unavailable()}")
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_the_fused_few_rows_linear_is_bitwise_the_step_by_step_one(rows):
    """One C call does what w8a8_linear does op by op (smooth, per-row scale, round half to even, int8 products,
    rescale, bias): the same bits, for widths with and without a tail past whole 32-byte blocks."""
    gen = torch.Generator().manual_seed(rows)
    for k, n in ((64, 40), (130, 33), (576, 960)):
        x = torch.randn(rows, k, generator=gen) * 3
        x[0, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])  # scale 1: halves round to even
        x[0, 4:] = x[0, 4:].clamp(-127, 127)
        weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        weight_scale, bias, smooth = torch.rand(n, generator=gen), torch.randn(n, generator=gen), torch.rand(k) + 0.5
        assert quantize_per_token(x)[0][0, :4].tolist() == [127, 2, -4, 0]
        for b, sm in ((None, None), (bias, None), (bias, smooth), (None, smooth)):
            xf = x if sm is None else x * sm
            xq, x_scale = quantize_per_token(xf)
            step_by_step = torch._int_mm(xq, weight.t()).float().mul_(x_scale).mul_(weight_scale)
            step_by_step = step_by_step if b is None else step_by_step.add_(b)
            assert torch.equal(int8_rows.w8a8_rows(x, weight, weight_scale, b, sm), step_by_step), (k, n)
            strided = [None if t is None else torch.stack([t, t], dim=-1)[..., 0] for t in (x, b, sm)]  # not contiguous
            assert torch.equal(int8_rows.w8a8_rows(strided[0], weight, weight_scale, *strided[1:]), step_by_step)


@pytest.mark.parametrize("kernel", ["torch._int_mm", "float32 matmul", ROWS_KERNEL])
def test_a_quantised_model_answers_the_same_on_every_kernel(kernel, monkeypatch):
    model = tiny_model("llama")
    quantize_model(model, "w8a8")
    ids = torch.randint(3, 200, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for batch in (ids, ids[:1, :3]):  # 27 rows a linear, and 3 (a decode step's few: w8a8_rows on its kernel)
            monkeypatch.setattr(
                raylora.ops.int8, "_selected", dict.fromkeys([("cpu", True), ("cpu", False)], "torch._int_mm")
            )
            expected = model(input_ids=batch).logits
            monkeypatch.setattr(raylora.ops.int8, "_selected", dict.fromkeys([("cpu", True), ("cpu", False)], kernel))
            torch.testing.assert_close(model(input_ids=batch).logits, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_linear_matches_reference_and_float(dtype):
    torch.manual_seed(0)
    x = torch.randn(9, 96)
    linear = nn.Linear(96, 40)
    smooth = torch.rand(96) + 0.5
    module = Int8Linear.from_linear(linear, 1 / smooth)
    args = (module.weight, module.weight_scale, module.bias, module.smooth)
    fast = w8a8_linear(x.to(dtype), *args)
    assert fast.dtype == dtype
    assert rel(fast, w8a8_linear_reference(x.to(dtype), *args)) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel(fast, linear(x)) < 2e-2
    assert module(x.reshape(3, 3, 96)).shape == (3, 3, 40)


def test_int8_embedding_rows_close():
    torch.manual_seed(0)
    emb = nn.Embedding(50, 32)
    module = Int8Embedding(*quantize_per_channel(emb.weight), padding_idx=None)
    ids = torch.tensor([[0, 5, 49]])
    assert module.weight.dtype == torch.int8
    assert rel(module(ids), emb(ids)) < 1e-2


def test_smoothing_alone_is_exact_and_shared(base):
    model = copy.deepcopy(base)
    factors = smoothquant_factors(model, CALIBRATION, alpha=0.5)
    layer = "model.layers.0"
    assert factors[f"{layer}.self_attn.q_proj"] is factors[f"{layer}.self_attn.v_proj"]
    assert factors[f"{layer}.mlp.gate_proj"] is factors[f"{layer}.mlp.up_proj"]
    assert factors[f"{layer}.self_attn.o_proj"] is not factors[f"{layer}.self_attn.q_proj"]
    assert "lm_head" not in factors and all(bool((s > 0).all() and s.isfinite().all()) for s in factors.values())
    # The transform Int8Linear applies, without quantising: W * s on the weight, x / s on its input.
    for name, s in factors.items():
        linear = model.get_submodule(name)
        linear.weight.data *= s
        linear.register_forward_pre_hook(lambda mod, args, s=s: (args[0] / s,))
    assert rel(logits(model), logits(base)) < 1e-5


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("method", ["w8a8", "w8a8-smoothquant"])
def test_quantized_logits_close_to_float(kind, method):
    reference = tiny_model(kind).eval()
    model = copy.deepcopy(reference)
    summary = quantize_model(model, method, CALIBRATION if "smooth" in method else None)
    assert summary["linear_layers"] == 15 and summary["embedding"] and not summary["tied_head"]
    assert summary["bytes_after"] == weight_bytes(model) and summary["bytes_before"] == weight_bytes(reference)
    assert isinstance(model.model.layers[1].mlp.down_proj, Int8Linear)
    assert isinstance(model.lm_head, Int8Linear) and isinstance(model.model.embed_tokens, Int8Embedding)
    got, want = logits(model), logits(reference)
    assert cosine(got, want) > 0.999 and rel(got, want) < 5e-2


def test_bfloat16_model():
    reference = tiny_model("llama").eval()
    model = copy.deepcopy(reference).to(torch.bfloat16)
    quantize_model(model, "w8a8-smoothquant", CALIBRATION)
    got = logits(model)
    assert got.dtype == torch.bfloat16 and cosine(got, logits(reference)) > 0.999


def test_smoothquant_tames_an_activation_outlier(base):
    # One channel 30x larger after the first norm: per-token int8 then rounds the other channels of q/k/v's
    # input coarsely; smoothing moves the outlier into the weights (3x smaller error seen).
    reference = copy.deepcopy(base)
    reference.model.layers[0].input_layernorm.weight.data[5] *= 30
    plain, smooth = copy.deepcopy(reference), copy.deepcopy(reference)
    quantize_model(plain, "w8a8")
    quantize_model(smooth, "w8a8-smoothquant", CALIBRATION)
    outputs = {}
    for tag, model in (("reference", reference), ("plain", plain), ("smooth", smooth)):
        k_proj = model.model.layers[0].self_attn.k_proj
        k_proj.register_forward_hook(lambda mod, args, out, tag=tag: outputs.__setitem__(tag, out))
        logits(model)
    assert rel(outputs["smooth"], outputs["reference"]) < 0.5 * rel(outputs["plain"], outputs["reference"])


def test_tied_head_shares_the_embedding_int8_tensor():
    model = tiny_model("llama").eval()
    model.lm_head.weight = model.model.embed_tokens.weight
    reference = copy.deepcopy(model)
    summary = quantize_model(model, "w8a8")
    assert summary["tied_head"] and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight_scale is model.model.embed_tokens.weight_scale
    # One int8 copy of 259 x 64 instead of two; the total is about a quarter of float32 plus scales.
    assert summary["ratio"] < 0.3
    assert cosine(logits(model), logits(reference)) > 0.999


def test_weight_bytes_counts_parameters_and_persistent_buffers(base):
    expected = sum(p.numel() * 4 for p in base.parameters())
    assert weight_bytes(base) == expected  # rotary inv_freq is not persistent, so not a weight


def test_adapters_on_quantized_base_match_float(base, smoothed, adapters):
    float_model = PeftModel.from_pretrained(copy.deepcopy(base), adapters["a"])
    quant_model = PeftModel.from_pretrained(copy.deepcopy(smoothed), adapters["a"])
    q_proj = quant_model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, Int8Linear) and q_proj.lora_A["default"].weight.dtype == torch.float32
    float_delta = logits(float_model) - logits(base)
    quant_delta = logits(quant_model) - logits(smoothed)
    assert cosine(quant_delta, float_delta) > 0.99
    assert cosine(logits(quant_model), logits(float_model)) > 0.999


def test_mixed_batch_adapter_names(smoothed, adapters):
    model = PeftModel.from_pretrained(copy.deepcopy(smoothed), adapters["a"], adapter_name="a")
    model.load_adapter(adapters["b"], adapter_name="b")
    mixed = logits(model, adapter_names=["a", "b", "__base__"])
    for row, name in enumerate(["a", "b"]):
        model.set_adapter(name)
        assert rel(mixed[row], logits(model, IDS[row : row + 1])[0]) < 1e-5
    assert rel(mixed[2], logits(smoothed, IDS[2:3])[0]) < 1e-5
    assert rel(mixed[0], mixed[2]) > 1e-2  # the adapter changes the output at all


def test_generate_and_kv_cache(smoothed, adapters):
    model = PeftModel.from_pretrained(copy.deepcopy(smoothed), adapters["a"])
    out = model.generate(input_ids=IDS[:1], max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 16)
    # Per-token quantisation makes a cached step see exactly what a full forward sees.
    from transformers import DynamicCache

    cache = DynamicCache(config=smoothed.config)
    with torch.inference_mode():
        model(input_ids=out[:, :-3], cache=cache, use_cache=True)
        step = model(input_ids=out[:, -3:], cache=cache, use_cache=True).logits
    assert rel(step, logits(model, out)[:, -3:]) < 1e-4


@pytest.mark.parametrize("shape,group", [((8, 576), 128), ((576, 8), 128), ((5, 7), 4), ((3, 64), 16)])
def test_int4_roundtrip(shape, group):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=gen) * 0.01
    w[0] = 0  # an untrained LoRA B is all zeros
    packed, scales = pack_int4(w, group)
    assert packed.dtype == torch.uint8 and scales.dtype == torch.bfloat16
    back = unpack_int4(packed, scales, shape[1], group)
    assert torch.equal(back, int4_roundtrip_reference(w, group))
    g = min(group, shape[1])
    step = scales.float().repeat_interleave(g, dim=1)[:, : shape[1]]
    assert bool(((back - w).abs() <= 0.5 * step * (1 + 1e-6)).all())
    # Values on the grid (integer codes in [-7, 7] times a bfloat16 scale, with 7 in each group) are exact.
    codes = torch.randint(-7, 8, shape, generator=gen).float()
    codes[:, ::g] = 7
    grid = codes * 2.0**-9
    assert torch.equal(unpack_int4(*pack_int4(grid, group), shape[1], group), grid)


def test_quantize_adapter_int4(smoothed, adapters):
    model = PeftModel.from_pretrained(copy.deepcopy(smoothed), adapters["a"], adapter_name="a")
    model.load_adapter(adapters["b"], adapter_name="b")
    before = logits(model, adapter_names=["a", "b", "__base__"])
    lora_bytes = sum(p.nbytes for n, p in model.named_parameters() if ".b." in n)
    held = quantize_adapter(model, "b", group_size=128)
    layer = model.base_model.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj.lora_A["b"], Int4Linear)
    assert isinstance(layer.self_attn.q_proj.lora_A["a"], nn.Linear)
    # q, v, down: A (8 x 64|128) and B (64|32 x 8): 4 bits a weight plus one bfloat16 scale per row of each.
    assert held < lora_bytes / 4
    after = logits(model, adapter_names=["a", "b", "__base__"])
    assert torch.equal(after[0], before[0]) and torch.equal(after[2], before[2])
    base_row = before[2]
    assert cosine(after[1] - base_row, before[1] - base_row) > 0.98
    model.set_adapter("b")
    assert rel(logits(model, IDS[1:2])[0], after[1]) < 1e-5
    with pytest.raises(ValueError, match="no LoRA layer holds adapter 'c'"):
        quantize_adapter(model, "c")


def test_errors(base):
    with pytest.raises(ValueError, match="unknown method 'int4'"):
        quantize_model(copy.deepcopy(base), "int4")
    with pytest.raises(ValueError, match="needs calibration"):
        quantize_model(copy.deepcopy(base), "w8a8-smoothquant")
    with pytest.raises(ValueError, match="not non-empty 1-D LongTensors"):
        quantize_model(copy.deepcopy(base), "w8a8-smoothquant", [torch.zeros(2, 3, dtype=torch.long)])
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="already holds peft adapters"):
        quantize_model(peft_model, "w8a8")
    model = copy.deepcopy(base)
    quantize_model(model, "w8a8")
    with pytest.raises(ValueError, match="already quantised"):
        quantize_model(model, "w8a8")


@pytest.mark.parametrize("method", ["w8a8", "w8a8-smoothquant"])
def test_fused_shared_inputs_give_bitwise_the_same_logits_with_mixed_adapters_and_no_extra_memory(
    base, adapters, method
):
    model = copy.deepcopy(base)
    quantize_model(model, method, CALIBRATION if method == "w8a8-smoothquant" else None)
    separate = PeftModel.from_pretrained(copy.deepcopy(model), adapters["a"], adapter_name="a")
    separate.load_adapter(adapters["b"], adapter_name="b")
    bytes_before = weight_bytes(model)
    layers = model.config.num_hidden_layers
    assert fuse_shared_inputs(model) == 2 * layers  # q, k, v and gate, up in every layer
    assert weight_bytes(model) == bytes_before
    q_proj, k_proj = model.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.k_proj
    assert k_proj.weight.data_ptr() == q_proj.weight.data_ptr() + q_proj.weight.nbytes  # one tensor
    fused = PeftModel.from_pretrained(model, adapters["a"], adapter_name="a")
    fused.load_adapter(adapters["b"], adapter_name="b")
    names = ["a", "b", "__base__"]
    assert torch.equal(logits(fused, adapter_names=names), logits(separate, adapter_names=names))
    # a member called with another tensor than its group's last input computes its own output
    x = torch.randn(5, model.config.hidden_size)
    q, k = q_proj(x), k_proj(x + 1)
    assert torch.equal(k, w8a8_linear(x + 1, k_proj.weight, k_proj.weight_scale, None, k_proj.smooth))
    assert torch.equal(q, w8a8_linear(x, q_proj.weight, q_proj.weight_scale, None, q_proj.smooth))
