"""The fused path's LoRA dropout: nn.Dropout's distribution from 16-bit draws, four to a 64-bit random number."""

import pytest
import torch

from raylora.ops.dropout import keep_mask, lora_dropout


@pytest.mark.parametrize("p", [0.05, 0.3])
def test_each_flag_drops_with_probability_p_in_every_lane_of_a_word(p):
    torch.manual_seed(0)
    keep = keep_mask((1000, 1000), p)
    assert keep.dtype == torch.bool and keep.shape == (1000, 1000)
    dropped = (~keep).flatten().float()
    assert dropped.mean().item() == pytest.approx(p, abs=0.0015)  # 7 standard deviations at p=0.05
    for lane in range(4):  # the four 16-bit draws of one 64-bit number are each uniform
        assert dropped[lane::4].mean().item() == pytest.approx(p, abs=0.003)


def test_masks_follow_the_global_seed_and_odd_sizes_work():
    torch.manual_seed(3)
    first = keep_mask((3, 5, 7), 0.5)
    torch.manual_seed(3)
    assert torch.equal(keep_mask((3, 5, 7), 0.5), first)
    assert not torch.equal(keep_mask((3, 5, 7), 0.5), first)


def test_kept_values_and_gradients_are_scaled_by_one_over_one_minus_p():
    x = torch.randn(64, 96, requires_grad=True)
    torch.manual_seed(5)
    out = lora_dropout(x, 0.25, training=True)
    torch.manual_seed(5)
    keep = keep_mask(x.shape, 0.25)
    torch.testing.assert_close(out, torch.where(keep, x / 0.75, 0.0))
    out.sum().backward()
    torch.testing.assert_close(x.grad, keep.float() / 0.75)


def test_eval_mode_and_p_zero_return_the_input_itself():
    x = torch.randn(4, 8)
    assert lora_dropout(x, 0.3, training=False) is x
    assert lora_dropout(x, 0.0, training=True) is x


def test_a_generator_owns_its_masks_whatever_the_global_seed():
    x = torch.ones(64, 48)
    masks = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        masks.append(lora_dropout(x, 0.25, True, torch.Generator().manual_seed(7)))
    assert torch.equal(masks[0], masks[1])
    assert not torch.equal(masks[0], lora_dropout(x, 0.25, True, torch.Generator().manual_seed(8)))
    assert (masks[0] == 0).float().mean().item() == pytest.approx(0.25, abs=0.03)
