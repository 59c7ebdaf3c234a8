"""Stacked mixed-adapter LoRA against peft's own mixed-batch forward and per-row runs (tolerance 1e-5)."""

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from raylora.models import randomise_lora, tiny_model
from raylora.ops.int4 import quantize_adapter
from raylora.ops.lora import BASE, mixed_batch_reference, stack_adapters

IDS = torch.randint(0, 200, (5, 7), generator=torch.Generator().manual_seed(0))
NAMES = ["a", "b", BASE, "c", "a"]


def _model(tmp_path) -> PeftModel:
    for seed, (name, rank) in enumerate([("a", 4), ("b", 8), ("c", 2)]):
        targets = ["q_proj", "v_proj"] if name != "c" else ["q_proj", "o_proj", "down_proj"]
        m = get_peft_model(tiny_model("llama"), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
        randomise_lora(m, seed, 0.3)
        m.save_pretrained(tmp_path / name)
    model = PeftModel.from_pretrained(tiny_model("llama"), str(tmp_path / "a"), adapter_name="a")
    for name in ("b", "c"):
        model.load_adapter(str(tmp_path / name), adapter_name=name)
    return model.eval()


def test_stacked_forward_equals_peft_and_each_row_alone(tmp_path):
    model = _model(tmp_path)
    with torch.no_grad():
        peft_logits = model(IDS, adapter_names=NAMES).logits
        assert stack_adapters(model) == 2 * 4  # q, v, o, down in both layers
        ours = model(IDS, adapter_names=NAMES).logits
        alone = mixed_batch_reference(model, IDS, NAMES)
    torch.testing.assert_close(ours, peft_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, alone, atol=1e-5, rtol=1e-5)


def test_restacking_after_a_delete_and_int4_layers_keep_peft_s_path(tmp_path):
    model = _model(tmp_path)
    model.delete_adapter("b")
    stack_adapters(model)
    names = ["a", BASE, "c", "a", "c"]
    with torch.no_grad():
        torch.testing.assert_close(model(IDS, adapter_names=names).logits, mixed_batch_reference(model, IDS, names),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip
    quantize_adapter(model, "a", 128)
    assert stack_adapters(model) == 2 * 2  # only o_proj and down_proj (adapter "c" alone) hold no int4 factors
    with torch.no_grad():
        torch.testing.assert_close(model(IDS, adapter_names=names).logits, mixed_batch_reference(model, IDS, names),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip
