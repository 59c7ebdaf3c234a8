"""UniformDropout against nn.Dropout's definition: each value kept with probability 1 - p and scaled by 1 / (1 - p).

Statistics on 10^6 values at p = 0.3: the kept share within 0.003 of 0.7 (over 6 standard deviations).
"""

import copy

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from raylora.models import randomise_lora, tiny_model
from raylora.ops.dropout import UniformDropout, use_uniform_dropout
from raylora.ops.fused_lora import fuse_lora


def test_values_are_kept_with_probability_one_minus_p_and_scaled_like_nn_dropout():
    x = torch.rand(1000, 1000) + 1.0
    torch.manual_seed(0)
    y = UniformDropout(0.3)(x)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.7) < 0.003
    torch.testing.assert_close(y[kept], x[kept] / 0.7)
    torch.manual_seed(0)
    assert torch.equal(UniformDropout(0.3)(x), y)  # reproducible under the seed
    assert not torch.equal(UniformDropout(0.3)(x), y)  # a new mask on each call


def test_the_gradient_is_the_mask_times_the_scale_and_eval_mode_is_the_identity():
    x = torch.randn(64, 32, requires_grad=True)
    y = UniformDropout(0.5)(x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, (y != 0).float() * 2.0)
    layer = UniformDropout(0.5).eval()
    assert layer(x) is x and UniformDropout(0.0)(x) is x


def test_only_peft_lora_dropouts_that_drop_are_replaced_and_fused_lora_still_equals_peft():
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.2, target_modules=["q_proj", "v_proj"])
    reference = get_peft_model(tiny_model("llama"), config)
    randomise_lora(reference, 1, 0.2)
    fused = copy.deepcopy(reference)
    assert use_uniform_dropout(reference) == 4  # q and v of 2 layers
    assert fuse_lora(fused) == 4 and use_uniform_dropout(fused) == 4 and use_uniform_dropout(fused) == 0
    assert all(type(m) is not nn.Dropout for m in fused.modules() if m.__class__.__name__.endswith("Dropout"))
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = []
    for model in (reference, fused):
        torch.manual_seed(7)
        logits.append(model.train()(ids).logits)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)
    no_drop = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.0))
    assert use_uniform_dropout(no_drop) == 0
