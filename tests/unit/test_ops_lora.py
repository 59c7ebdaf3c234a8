"""Stacked mixed-adapter LoRA against peft's own mixed-batch forward and per-row runs (tolerance 1e-5); adapters
named for a forward pass (rows, or prompts packed in one row) without peft's hooks."""

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from raylora.models import randomise_lora, tiny_model
from raylora.ops.int4 import quantize_adapter
from raylora.ops.lora import BASE, adapters_of, mixed_batch_reference, stack_adapters, stacked

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


def test_named_adapters_give_peft_s_rows_and_packed_prompts_their_own_without_peft_s_hooks(tmp_path, monkeypatch):
    model = _model(tmp_path)
    assert not stacked(model)
    stack_adapters(model)
    assert stacked(model)
    with torch.no_grad():
        rows = model(IDS, adapter_names=NAMES).logits
        hooks, enable = [], type(model.base_model)._enable_peft_forward_hooks

        def spy(self, *args, **kwargs):
            hooks.append(kwargs.get("adapter_names"))
            return enable(self, *args, **kwargs)

        monkeypatch.setattr(type(model.base_model), "_enable_peft_forward_hooks", spy)
        with adapters_of(NAMES):
            named = model(IDS).logits
        # the five prompts side by side in one row, each with its adapter (a per-token choice peft cannot make)
        with adapters_of(NAMES, [7] * 5):
            packed = model.base_model.model.model.layers[0].self_attn.q_proj(
                model.base_model.model.model.embed_tokens(IDS).reshape(1, 35, -1)
            )
        alone = torch.cat([model.base_model.model.model.layers[0].self_attn.q_proj(
            model.base_model.model.model.embed_tokens(IDS[i : i + 1]), adapter_names=[NAMES[i]]) for i in range(5)], dim=1
        )  # fmt: skip
        outside = model(IDS).logits  # no names: peft's own forward (adapter "a" active)
    assert hooks == [None, None]  # peft installed no hooks: it was given no names
    assert torch.equal(named, rows)
    torch.testing.assert_close(packed, alone, atol=1e-6, rtol=1e-6)
    model.set_adapter("a")
    with torch.no_grad():
        torch.testing.assert_close(outside, mixed_batch_reference(model, IDS, ["a"] * 5), atol=1e-5, rtol=1e-5)


def test_a_model_with_a_layer_the_stack_cannot_hold_is_not_named_for(tmp_path):
    model = _model(tmp_path)
    quantize_adapter(model, "a", 128)
    assert stack_adapters(model) > 0 and not stacked(model)  # int4 factors keep peft's path: names go through peft
