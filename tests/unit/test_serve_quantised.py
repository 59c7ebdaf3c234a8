"""Quantised serving on a tiny model: the int8 base and a 4-bit adapter through the engine."""

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from raylora.config import from_dict
from raylora.generation import Engine, GenRequest, wait_for
from raylora.ops.int4 import quantize_adapter
from raylora.ops.int8 import Int8Linear
from raylora.serve.replica import load_serving_model


def test_smoothquant_base_serves_answers_close_to_fp32(root, monkeypatch):
    monkeypatch.chdir(root)
    cfg = from_dict({
        "model": {"name_or_path": "tiny-llama"},
        "data": {"sources": [{"path": "data/raylora_identity.jsonl"}], "cutoff_len": 128},
        "serve": {"quantization": "w8a8-smoothquant", "calibration_rows": 8},
        "backend": {"device": "cpu"},
    })  # fmt: skip
    model, tokenizer, summary = load_serving_model(cfg)
    assert summary["method"] == "w8a8-smoothquant" and summary["ratio"] < 0.35
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 2 * 7 + 1
    fp32, _, _ = load_serving_model(from_dict({"model": {"name_or_path": "tiny-llama"}, "backend": {"device": "cpu"}}))
    ids = torch.tensor([tokenizer("Who are you?").input_ids])
    with torch.no_grad():
        a, b = model(ids).logits, fp32(ids).logits
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99
    engine = Engine(model, tokenizer, 4, 0)
    out = wait_for(engine, GenRequest(ids[0].tolist(), max_tokens=6, temperature=0))
    engine.stop()
    assert out.completion_tokens == 6


def test_a_4bit_adapter_answers_like_the_full_precision_one(tmp_path):
    from raylora.model_files import tiny_tokenizer
    from raylora.models import tiny_model

    peft = get_peft_model(
        tiny_model("llama"), LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    peft.save_pretrained(tmp_path / "a")
    full = PeftModel.from_pretrained(tiny_model("llama"), str(tmp_path / "a"), adapter_name="a").eval()
    small = PeftModel.from_pretrained(tiny_model("llama"), str(tmp_path / "a"), adapter_name="a").eval()
    held = quantize_adapter(small, "a", 128)
    lora_bytes = sum(p.numel() * p.element_size() for n, p in full.named_parameters() if "lora_" in n)
    assert held < 0.3 * lora_bytes
    ids = torch.tensor([tiny_tokenizer()("hello there").input_ids])
    with torch.no_grad():
        a, b = small(ids, adapter_names=["a"]).logits, full(ids).logits
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99


def test_a_quantised_base_leaves_no_weight_in_the_checkpoints_memory_map(tmp_path):
    """Issue #38 (replica memory): the embeddings and norms that quantisation leaves kept the safetensors file mapped,
    and with it every page quantisation had read (SmolLM2-135M: 540 MB of a 1.3 GB replica)."""
    from raylora.model_files import tiny_tokenizer
    from raylora.models import tiny_model

    tiny_model("llama").save_pretrained(tmp_path / "base")
    tiny_tokenizer().save_pretrained(tmp_path / "base")
    weights = str(tmp_path / "base" / "model.safetensors")

    def mapped() -> bool:
        return weights in open("/proc/self/maps").read()

    served = {"model": {"name_or_path": str(tmp_path / "base")}, "backend": {"device": "cpu"}}
    model, _, _ = load_serving_model(from_dict(served))
    assert mapped()  # unquantised, the weights are served from the file's pages
    del model
    model, _, summary = load_serving_model(from_dict({**served, "serve": {"quantization": "w8a8"}}))
    assert summary["method"] == "w8a8" and not mapped()
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 2 * 7 + 1


def test_a_base_on_the_float_kernel_says_so_when_it_loads(monkeypatch, caplog):
    """Where torch._int_mm loses the timed probe (no VNNI or AMX), the replica's log says that the int8 base's batched
    matmuls run as float32 ones there and that an unquantised base may serve faster."""
    import raylora.ops.int8

    cfg = from_dict({"model": {"name_or_path": "tiny-llama"}, "serve": {"quantization": "w8a8"},
                     "backend": {"device": "cpu"}})  # fmt: skip
    said = {}
    for kernel in ("torch._int_mm", "float32 matmul"):
        monkeypatch.setattr(raylora.ops.int8, "_selected", {("cpu", True): "torch._int_mm", ("cpu", False): kernel})
        caplog.clear()
        load_serving_model(cfg)
        said[kernel] = [r.getMessage() for r in caplog.records if r.name == "ray.serve"]
    assert said["torch._int_mm"] == []
    (message,) = said["float32 matmul"]
    assert "run here as float32 matmuls of the int8 values" in message and "serve.quantization: none" in message
