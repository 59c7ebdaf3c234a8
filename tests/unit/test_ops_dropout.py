"""The fused path's LoRA dropout: nn.Dropout's distribution with its scale left to the caller, masks from 16-bit
draws (four to a 64-bit random number)."""

import pytest
import torch

from raylora.ops.dropout import dropout_scale, keep_mask, lora_dropout


@pytest.mark.parametrize("p", [0.05, 0.3])
def test_each_element_drops_with_probability_p_in_every_lane_of_a_word(p):
    torch.manual_seed(0)
    keep = keep_mask((1000, 1000), p)
    assert keep.dtype == torch.bfloat16 and keep.shape == (1000, 1000)
    assert set(keep.unique().tolist()) == {0.0, 1.0}
    dropped = (keep == 0).flatten().float()
    assert dropped.mean().item() == pytest.approx(p, abs=0.0015)  # 7 standard deviations at p=0.05
    for lane in range(4):  # the four 16-bit draws of one 64-bit number are each uniform
        assert dropped[lane::4].mean().item() == pytest.approx(p, abs=0.003)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_masks_are_exact_ones_and_zeros_in_every_dtype_and_the_same_pattern(dtype):
    torch.manual_seed(1)
    reference = keep_mask((40, 30), 0.3)
    torch.manual_seed(1)
    mask = keep_mask((40, 30), 0.3, dtype)
    assert mask.dtype == dtype
    assert torch.equal(mask.float(), reference.float())


def test_the_mask_is_exactly_the_top_15_bits_of_each_word_against_the_rounded_threshold():
    torch.manual_seed(9)
    mask = keep_mask((3, 37), 0.3)
    torch.manual_seed(9)
    words = torch.empty(28, dtype=torch.int64).random_(-(1 << 63), None)
    draws = words.view(torch.int16)[:111].long() >> 1
    assert torch.equal(mask.flatten() == 1, draws >= round(0.3 * 32768) - 16384)
    assert keep_mask((10_000,), 1e-6).min() == 1  # rounds to 0: nothing dropped
    assert keep_mask((10_000,), 1 - 1e-6).max() == 0  # rounds to 1: everything dropped


def test_masks_follow_the_global_seed_and_odd_sizes_work():
    torch.manual_seed(3)
    first = keep_mask((3, 5, 7), 0.5)
    torch.manual_seed(3)
    assert torch.equal(keep_mask((3, 5, 7), 0.5), first)
    assert not torch.equal(keep_mask((3, 5, 7), 0.5), first)


def test_kept_values_are_not_scaled_and_the_scale_makes_them_nn_dropout_s():
    x = torch.randn(64, 96, requires_grad=True)
    torch.manual_seed(5)
    out = lora_dropout(x, 0.25, training=True)
    torch.manual_seed(5)
    keep = keep_mask(x.shape, 0.25, torch.float32)
    torch.testing.assert_close(out, torch.where(keep == 1, x, 0.0))
    out.sum().backward()
    torch.testing.assert_close(x.grad, keep)
    assert dropout_scale(0.25, True) == pytest.approx(1 / 0.75)
    assert dropout_scale(0.25, False) == dropout_scale(0.0, True) == 1.0


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
