"""Chunked linear + cross-entropy against full logits + F.cross_entropy: loss and gradients.

Tolerances: fp32 1e-5 relative; bf16 matrix products 2e-2 (both sides round the same operands to bf16).
"""

import pytest
import torch
import torch.nn.functional as F

from raylora.models import tiny_model
from raylora.ops import linear_ce
from raylora.ops.linear_ce import label_positions, linear_cross_entropy, linear_cross_entropy_reference


def _inputs(n=37, hidden=16, vocab=50, weight_grad=True):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden, generator=gen, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=gen).requires_grad_(weight_grad)
    t = torch.randint(0, vocab, (n,), generator=gen)
    return h, w, t


@pytest.mark.parametrize("dtype,tol", [(None, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("chunk_elements", [50 * 8, 50 * 37, 2**24])  # several chunks, one exact, one large
@pytest.mark.parametrize("cache_elements", [50 * 3, 2**20])  # rows scored a few at a time (the last part short)
def test_chunked_matches_full_logits(monkeypatch, dtype, tol, chunk_elements, cache_elements):
    monkeypatch.setattr(linear_ce, "CHUNK_ELEMENTS", chunk_elements)
    monkeypatch.setattr(linear_ce, "CACHE_ELEMENTS", cache_elements)
    h, w, t = _inputs()
    ours = linear_cross_entropy(h, w, t, dtype)
    (ours * 0.5).backward()
    got = ours.detach(), h.grad.clone(), w.grad.clone()
    h.grad, w.grad = None, None
    ref = linear_cross_entropy_reference(h, w, t, dtype)
    (ref * 0.5).backward()
    assert ours.dtype is torch.float32
    for a, b in zip(got, (ref.detach(), h.grad, w.grad), strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_frozen_head_gets_no_gradient_and_no_grad_mode_skips_it():
    h, w, t = _inputs(weight_grad=False)
    linear_cross_entropy(h, w, t).backward()
    assert w.grad is None and h.grad is not None
    with torch.no_grad():
        value = linear_cross_entropy(h, w, t)
    torch.testing.assert_close(value, linear_cross_entropy_reference(h, w, t).detach())


def test_no_label_positions_gives_zero_with_a_graph():
    h, w, t = _inputs(n=0)
    value = linear_cross_entropy(h, w, t)
    value.backward()
    assert value.item() == 0.0 and h.grad.shape == h.shape


def test_label_positions_on_a_model_match_transformers_loss():
    model = tiny_model("llama")
    ids = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :4] = -100
    labels[1, 7:] = -100
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        rows, targets = label_positions(hidden, labels)
        total = linear_cross_entropy(rows, model.lm_head.weight, targets)
        expected = model(input_ids=ids, labels=labels).loss  # transformers: mean over label tokens
    assert rows.shape == (6 + 6, 64)
    torch.testing.assert_close(total / 12, expected, atol=1e-5, rtol=1e-5)
    logits = model.lm_head(hidden)[:, :-1]
    plain = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
    torch.testing.assert_close(total, plain, atol=1e-4, rtol=1e-5)
