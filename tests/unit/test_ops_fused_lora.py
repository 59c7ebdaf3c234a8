"""Fused LoRA linear against peft's own forward: logits and LoRA gradients.

Tolerances: fp32 1e-5. Under bf16 autocast both round at different places, so each is compared with the fp32
result: the fused path's relative error (Frobenius norm) may be at most 1.25x peft's own, plus 1e-3.
"""

import copy
import math

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from raylora.models import randomise_lora, tiny_model
from raylora.ops.fused_lora import fuse_lora

IDS = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _pair(dropout: float = 0.0, targets=ALL, use_dora: bool = False):
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets, use_dora=use_dora)
    peft_model = get_peft_model(tiny_model("llama"), config)
    randomise_lora(peft_model, 1, 0.2)
    fused = copy.deepcopy(peft_model)
    return peft_model, fused


def _run(model, seed: int = 0, autocast: bool = False):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(IDS).logits
    (logits.float() ** 2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logits.detach().float(), grads


def _assert_same(a, b, tol):
    torch.testing.assert_close(a[0], b[0], atol=tol, rtol=tol)
    assert a[1].keys() == b[1].keys() and len(a[1]) > 0
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], atol=tol, rtol=tol, msg=name)


def _relative_errors(got, exact):
    tensors = [(got[0], exact[0])] + [(got[1][n], exact[1][n]) for n in exact[1]]
    return [((a - b).norm() / b.norm()).item() for a, b in tensors]


def test_fused_equals_peft_forward_and_backward_with_shared_down_projections():
    reference, fused = _pair()
    assert fuse_lora(fused) == 2 * 7
    attention = fused.base_model.model.model.layers[0].self_attn
    group = attention.q_proj._raylora_group
    assert group is not None and group.members == [attention.q_proj, attention.k_proj, attention.v_proj]
    mlp = fused.base_model.model.model.layers[0].mlp
    assert mlp.gate_proj._raylora_group.members == [mlp.gate_proj, mlp.up_proj] and mlp.down_proj._raylora_group is None
    fused.train(), reference.train()
    exact = _run(reference)
    _assert_same(_run(fused), exact, 1e-5)
    ours, peft_errors = (
        _relative_errors(_run(fused, autocast=True), exact),
        _relative_errors(_run(reference, autocast=True), exact),
    )
    assert all(o <= 1.25 * p + 1e-3 for o, p in zip(ours, peft_errors, strict=True)), (ours, peft_errors)
    assert group.x is None and group.parts == {}  # nothing held after the attention returns


def test_one_down_projection_serves_q_k_and_v(monkeypatch):
    _, fused = _pair()
    fuse_lora(fused)
    calls = []
    real = torch.nn.functional.linear

    def counting(x, w, *rest):
        calls.append(tuple(w.shape))
        return real(x, w, *rest)

    monkeypatch.setattr("raylora.ops.fused_lora.F.linear", counting)
    with torch.no_grad():
        fused(IDS)
    down = [shape for shape in calls if shape[0] <= 3 * 4]  # the base layers are 32 to 128 wide
    # per layer: one (3r, in) for q/k/v, one (2r, in) for gate/up, one each for o and down
    assert down == [(12, 64), (4, 64), (8, 64), (4, 128)] * 2


def _pattern(shape, p, device="cpu"):
    """A fixed keep pattern standing in for the random masks, so both paths can be given the same ones."""
    return (torch.arange(math.prod(shape)) % 7 != 3).view(shape)


class _Replay(torch.nn.Module):
    """peft's dropout module, applying :func:`_pattern` with nn.Dropout's scale."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        return x * _pattern(x.shape, self.p) / (1 - self.p) if self.training else x


def test_siblings_share_one_dropout_mask_and_match_peft_given_the_same_masks(monkeypatch):
    reference, fused = _pair(dropout=0.3)
    fuse_lora(fused)
    drawn = []

    def recording(shape, p, dtype=torch.bfloat16, device="cpu", generator=None):
        drawn.append((tuple(shape), p))
        return _pattern(shape, p).to(dtype)

    monkeypatch.setattr("raylora.ops.dropout.keep_mask", recording)
    for module in reference.modules():
        if hasattr(module, "lora_dropout"):
            module.lora_dropout["default"] = _Replay(0.3)
    fused.train(), reference.train()
    _assert_same(_run(fused), _run(reference), 1e-5)
    # per decoder layer: one mask for q/k/v, one for o, one for gate/up, one for down (peft: seven)
    assert drawn == [((2, 12, 64), 0.3)] * 3 + [((2, 12, 128), 0.3)] + [((2, 12, 64), 0.3)] * 3 + [((2, 12, 128), 0.3)]
    fused.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(IDS).logits, reference(IDS).logits, atol=1e-5, rtol=1e-5)


def test_disabled_merged_and_dora_layers_run_peft_s_forward():
    reference, fused = _pair()
    fuse_lora(fused)
    with torch.no_grad(), fused.disable_adapter(), reference.disable_adapter():
        torch.testing.assert_close(fused(IDS).logits, reference(IDS).logits, atol=1e-5, rtol=1e-5)
    dora, dora_fused = _pair(use_dora=True, targets=["q_proj", "v_proj"])
    assert fuse_lora(dora_fused) == 0
    fused.merge_adapter()
    with torch.no_grad():
        torch.testing.assert_close(fused(IDS).logits, reference(IDS).logits, atol=1e-4, rtol=1e-4)


def test_fused_model_saves_a_plain_peft_adapter(tmp_path):
    reference, fused = _pair()
    fuse_lora(fused)
    fused.save_pretrained(tmp_path / "fused")
    reference.save_pretrained(tmp_path / "peft")
    loaded = PeftModel.from_pretrained(tiny_model("llama"), str(tmp_path / "fused")).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, reference.eval()(IDS).logits, atol=1e-5, rtol=1e-5)
    names = sorted(p.name for p in (tmp_path / "fused").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "peft").iterdir())
